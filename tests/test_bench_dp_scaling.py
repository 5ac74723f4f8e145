"""benchmarks/dp_scaling.py end to end on the CPU: two real servers (--dp 1, then --dp 2) on a
tiny random llama, every stream's tokens counted, the servers stopped, JSON and PNG written."""
from __future__ import annotations

import json
import os
import socket
import sys

import pytest
from checkpoints import make_checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import dp_scaling  # noqa: E402
from common import save_word_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    path = make_checkpoint(str(tmp_path_factory.mktemp("dp-llama")), "llama")
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    save_word_tokenizer(path, vocab, vocab - 1)
    return path


def test_both_sides_stream_every_token(tiny_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DEEPINFER_CPU_THREADS", "1")
    started = []
    real_start = dp_scaling.start_server
    monkeypatch.setattr(dp_scaling, "start_server",
                        lambda cmd, *a, **k: started.append(cmd) or real_start(cmd, *a, **k))
    rc = dp_scaling.main(["--dp", "2", "--per-rank", "2,3", "--prompt-len", "8",
                          "--output-len", "3", "--vocab", "250", "--client-procs", "2",
                          "--out", str(tmp_path), "--", "--model", tiny_dir,
                          "--dtype", "float32", "--max-num-seqs", "8", "--max-model-len", "64",
                          "--num-kv-blocks", "64", "--block-size", "16"])
    assert rc == 0
    with open(tmp_path / "dp_scaling.json") as f:
        result = json.load(f)
    assert [s["dp"] for s in result["sides"]] == [1, 2]
    for side in result["sides"]:
        assert [w["streams"] for w in side["waves"]] == [2 * side["dp"], 3 * side["dp"]]
        assert [w["output_tokens"] for w in side["waves"]] == [6 * side["dp"], 9 * side["dp"]]
    assert [r["per_rank"] for r in result["ratios"]] == [2, 3]
    assert all(r["tok_s_ratio"] > 0 for r in result["ratios"])
    with open(tmp_path / "dp_scaling.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    for cmd in started:  # each server was stopped: its port is free again
        port = int(cmd[cmd.index("--port") + 1])
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_dp_below_two_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit):
        dp_scaling.parse_args(["--dp", "1"])
    assert "--dp must be at least 2" in capsys.readouterr().err
