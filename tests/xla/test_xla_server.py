"""deepinfer-serve on the Neuron backend's xla device (PyTorch/XLA's CPU device): 200 requests of
mixed prompt and output lengths, 16 at a time, with every step audited against its plan
(DEEPINFER_NEURON_AUDIT_GRAPHS=1: a compilation after start-up or a host sync inside a step fails
the step, and every later one, with a message naming the op). All 200 finish, those checked
with transformers' greedy tokens.

Runs in the XLA venv (scripts/xla_env.sh); skipped where torch_xla is not installed."""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Iterator

import pytest

pytest.importorskip("torch_xla")

from tests.checkpoints import make_checkpoint  # noqa: E402
from tests.models.test_moe_parity import (  # noqa: E402
    _assert_reference_greedy,
    _prompts,
    _reference,
)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from common import save_word_tokenizer  # noqa: E402

VOCAB = 256
REQUESTS, CLIENTS = 200, 16
# scripts/test.sh runs these niced beside the main suite: a start or a request may wait long.
PATIENCE_S = 900.0
# Prompts whose 16 greedy tokens keep the reference's margin (test_xla_device's qwen3_moe seed).
CHECKED = _prompts((5, 23, 40), seed=1)
SHAPES = ["--dtype", "float32", "--block-size", "16", "--num-kv-blocks", "40",
          "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--max-model-len", "64"]
ENV = {"DEEPINFER_NEURON_DEVICE": "xla", "DEEPINFER_NEURON_AUDIT_GRAPHS": "1",
       "DEEPINFER_CPU_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _workload(seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens): prompts of 1-44 tokens (a fifth of them a shared 16-token
    prefix plus a tail: prefix-cache hits), outputs of 1-16 tokens."""
    rng = random.Random(seed)
    shared = [rng.randrange(2, VOCAB - 1) for _ in range(16)]
    work = [(prompt, 16) for prompt in CHECKED]
    for i in range(REQUESTS - len(CHECKED)):
        head = shared if i % 5 == 0 else []
        tail = [rng.randrange(2, VOCAB - 1) for _ in range(rng.randint(1, 44 - len(head)))]
        work.append((head + tail, rng.randint(1, 16)))
    return work


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=PATIENCE_S) as response:
            return json.load(response)
    except urllib.error.HTTPError as err:
        return {"error": err.read().decode(errors="replace")}


def _wait_healthy(proc: subprocess.Popen, url: str, log: str) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"deepinfer-serve exited ({proc.returncode}):\n{open(log).read()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"deepinfer-serve not healthy after {PATIENCE_S:.0f} s:\n"
                f"{open(log).read()[-3000:]}")


@contextmanager
def xla_server(model: str, shapes: list[str], log: str) -> Iterator[str]:
    """deepinfer-serve on the xla device with every step audited (ENV): its URL once healthy;
    stopped with SIGTERM (its process group killed if it does not end)."""
    port = _free_port()
    command = [sys.executable, "-m", "deepinfer.serve.cli", "--model", model,
               "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port),
               "--accelerator", "neuron", "--tokenizer-backend", "hf",
               "--generation-config", "none", *shapes]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **ENV}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, log)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def complete(url: str, prompt: list[int], max_tokens: int) -> dict:
    """A greedy completion of token ids, EOS ignored, with its token ids."""
    return _post(f"{url}/v1/completions",
                 {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                  "ignore_eos": True, "return_token_ids": True})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_checkpoint(str(tmp_path_factory.mktemp("qwen3_moe")), "qwen3_moe",
                           eos_token_id=VOCAB - 1)
    save_word_tokenizer(path, VOCAB, VOCAB - 1)
    return path


def test_200_mixed_requests_through_the_server_compile_nothing(model_dir, tmp_path):
    work = _workload()
    with xla_server(model_dir, SHAPES, str(tmp_path / "server.log")) as url:
        with ThreadPoolExecutor(CLIENTS) as pool:
            replies = list(pool.map(lambda item: complete(url, *item), work))
    errors = [r["error"] for r in replies if "error" in r]
    assert not errors, f"{len(errors)} of {REQUESTS} failed; the first: {errors[0]}"
    got = [r["choices"][0]["token_ids"] for r in replies]
    assert [len(t) for t in got] == [n for _, n in work]
    # The first requests' prompts keep the reference's top-1/top-2 margin: their tokens are
    # transformers' argmax.
    model = _reference(model_dir)
    for (prompt, _), tokens in zip(work[:len(CHECKED)], got):
        _assert_reference_greedy(model, prompt, tokens)
