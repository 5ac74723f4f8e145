"""`deepinfer-serve --dp 2 --ep` on two GPUs: the ranks join one NCCL group (plus the gloo group
of the lockstep vote), a request pinned to one rank is answered with the same greedy tokens as
`--dp 1`, and the idle rank runs dummy steps in lockstep. Starts and stops its own servers.

    python benchmarks/cuda/check_lockstep.py [--out DIR] [--family qwen3_moe]

With an MoE family (qwen3_moe) the group is expert parallel: each GPU holds half the experts
and every MoE layer exchanges tokens over NCCL, inside the decode graphs too.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from tests.checkpoints import make_checkpoint  # noqa: E402

PROMPT = list(range(3, 60))


def tiny_model(path: str, family: str = "llama") -> str:
    """A random checkpoint with a word-level tokenizer (the device has no hub nor PyPI
    access)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    make_checkpoint(path, family)
    vocab = {f"t{i}": i for i in range(256)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0",
                                         eos_token="t255").save_pretrained(path)
    return path


def start(model: str, port: int, extra: list[str], log: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "deepinfer.serve.cli", "--model", model, "--port", str(port),
               "--accelerator", "nvidia", "--dtype", "float32",
               "--gpu-memory-utilization", "0.3", "--max-model-len", "512",
               "--tokenizer-backend", "hf", "--generation-config", "none", *extra]
    return subprocess.Popen(command, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_healthy(proc: subprocess.Popen, url: str, log: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:  # died: stop waiting at once
            raise RuntimeError(f"server exited {proc.returncode}:\n{open(log).read()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server not healthy in {timeout} s:\n{open(log).read()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def complete(url: str, session: str) -> tuple[list[int], int]:
    r = httpx.post(f"{url}/v1/completions", timeout=120, headers={"X-Session-Affinity": session},
                   json={"model": "tiny", "prompt": PROMPT, "max_tokens": 32, "temperature": 0,
                         "ignore_eos": True, "logprobs": 0})
    r.raise_for_status()
    body = r.json()
    tokens = body["choices"][0]["logprobs"]["tokens"]
    return tokens, int(r.headers["x-deepinfer-rank"])


def dummy_steps(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {line.split('rank="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("deepinfer:rank_dummy_steps_total")}


def run(model: str, extra: list[str], port: int, workdir: str, sessions: list[str]) -> dict:
    log = os.path.join(workdir, f"server-{port}.log")
    proc = start(model, port, extra, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log)
        answers = {s: complete(url, s) for s in sessions}
        return {"answers": answers, "dummy_steps": dummy_steps(url),
                "log_tail": open(log).read()[-1500:]}
    finally:
        stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--family", default="llama")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        model = tiny_model(os.path.join(workdir, "tiny"), args.family)
        sessions = [f"s{i}" for i in range(8)]
        one = run(model, [], 8431, workdir, sessions[:1])
        two = run(model, ["--dp", "2", "--ep"], 8432, workdir, sessions)
    reference = one["answers"]["s0"][0]
    ranks = {s: rank for s, (_, rank) in two["answers"].items()}
    report = {"gpus": 2, "family": args.family, "ranks_used": sorted(set(ranks.values())),
              "same_tokens": all(t == reference for t, _ in two["answers"].values()),
              "dummy_steps": two["dummy_steps"]}
    print(json.dumps(report, indent=2))
    if args.out:
        name = "lockstep_nccl" + ("" if args.family == "llama" else f"_{args.family}")
        with open(os.path.join(args.out, f"{name}.json"), "w") as f:
            json.dump(report, f, indent=2)
    assert report["same_tokens"], two["answers"]
    assert report["ranks_used"] == [0, 1], ranks
    assert all(v > 0 for v in report["dummy_steps"].values()), report
    print("lockstep over NCCL: passed")


if __name__ == "__main__":
    main()
