"""examples/neuron at a tiny size: the offline TTFT/TPOT matrix (bench_neuron.py) on the CPU
backend and on the Neuron backend's host mode (DEEPINFER_NEURON_DEVICE=cpu), and the server
matrix (run_bench.sh: a real deepinfer-serve driven by serve_bench.py's OpenAI client) on the
CPU. Every cell must be present with positive, finite times; the server must be gone after."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from types import ModuleType

import pytest

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "examples", "neuron")
BATCHES, INPUT_LENS, OUTPUT_LEN = (1, 2), (8, 16), 4
MATRIX = ["--batch-sizes", "1,2", "--input-lens", "8,16", "--output-len", str(OUTPUT_LEN)]
# A small KV pool and token budget: the Neuron backend builds a graph per bucket at start-up,
# and its default buckets (to 2048 tokens, a 1 GB pool) take a minute on the host.
SMALL_ENGINE = ["-o", "num_blocks=64", "-o", "block_size=16", "-o", "max_num_batched_tokens=64"]


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_example("bench_neuron")


@pytest.fixture
def one_thread(monkeypatch):
    """One torch thread in the engines (DEEPINFER_CPU_THREADS; the server's rank inherits it):
    on a busy 2-core runner two OpenMP threads wait on each other and a 1 ms step takes 40.
    The process's own setting is put back after."""
    import torch

    threads = torch.get_num_threads()
    monkeypatch.setenv("DEEPINFER_CPU_THREADS", "1")
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_model(bench, tmp_path_factory) -> str:
    return bench.write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-random-llama")))


def neuron_missing() -> str | None:
    """Why the `neuron` accelerator cannot run on this host, or None when it can."""
    from deepinfer.core.plugins import load_plugins

    registry = load_plugins()
    info = next((i for i in registry.accelerators() if i.matches("neuron")), None)
    if info is None:
        failures = "; ".join(f"{f.name}: {f.error}" for f in registry.failures) or "none"
        return f"deepinfer.core.plugins finds no `neuron` accelerator (plugin failures: {failures})"
    try:
        available = info.load().is_available()
    except Exception as exc:  # noqa: BLE001 - the backend is still being written
        return f"the `neuron` accelerator does not load: {type(exc).__name__}: {exc}"
    return None if available else "`neuron` is not available with DEEPINFER_NEURON_DEVICE=cpu"


def check_matrix(result: dict, keys: tuple[str, ...]) -> None:
    cells = {(c["batch"], c["input_len"]): c for c in result["cells"]}
    assert set(cells) == {(b, n) for b in BATCHES for n in INPUT_LENS}
    for where, cell in cells.items():
        assert "error" not in cell, (where, cell["error"])
        for key in keys:
            assert math.isfinite(cell[key]) and cell[key] > 0, (where, key, cell[key])
    assert result["config"]["output_len"] == OUTPUT_LEN


def check_png(json_path: str) -> None:
    png = os.path.splitext(json_path)[0] + ".png"
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("accelerator", ["cpu", "neuron"])
def test_offline_matrix(accelerator, bench, tiny_model, tmp_path, monkeypatch, capsys,
                        one_thread):
    if accelerator == "neuron":
        monkeypatch.setenv("DEEPINFER_NEURON_DEVICE", "cpu")
        reason = neuron_missing()
        if reason:
            pytest.skip(reason)
    out = str(tmp_path / "bench.json")
    rc = bench.main(["--accelerator", accelerator, "--model", tiny_model, "--repeats", "1",
                     "--out", out, *MATRIX, *SMALL_ENGINE])
    assert rc == 0, capsys.readouterr().out
    with open(out) as f:
        result = json.load(f)
    assert result["backend"] == accelerator
    check_matrix(result, ("ttft_ms", "tpot_ms", "throughput_tok_s"))
    for cell in result["cells"]:
        assert [r["output_tokens"] for r in cell["runs"]] == [cell["batch"] * OUTPUT_LEN]
    check_png(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_matrix(tiny_model, tmp_path, one_thread):
    port = free_port()
    out = str(tmp_path / "serve.json")
    env = dict(os.environ, PYTHON=sys.executable, TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        ["bash", os.path.join(EXAMPLE, "run_bench.sh"), "--accelerator", "cpu",
         "--model", tiny_model, "--port", str(port), "--no-aiperf", "--waves", "1",
         "--out", out, *MATRIX],
        env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out) as f:
        result = json.load(f)
    assert result["config"]["load"] == "openai client"
    check_matrix(result, ("ttft_ms", "ttft_p50_ms", "throughput_tok_s"))
    # A client's TPOT may be 0 here: the API process, sharing two cores with the rank and the
    # clients, can fall behind the tiny model's sub-millisecond steps and then sends a stream
    # the steps it missed as one chunk (RankSupervisor._drain + coalesce), a whole answer at once.
    for cell in result["cells"]:
        assert math.isfinite(cell["tpot_ms"]) and cell["tpot_ms"] >= 0, cell
        assert cell["output_tokens"] == [cell["batch"] * OUTPUT_LEN]
    check_png(out)
    with pytest.raises(urllib.error.URLError):  # the script stopped the server it started
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
