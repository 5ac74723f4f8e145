"""deepinfer-serve on the Neuron backend's xla device, for the XLA server tests: a server with
every step audited (a compilation after start-up or a host sync inside a step fails the step),
greedy completions of token ids, and a checkpoint with a word tokenizer to serve."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from typing import Iterator

import pytest

from tests.checkpoints import make_checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from common import save_word_tokenizer  # noqa: E402

VOCAB = 256
# scripts/test.sh runs these niced beside the main suite: a start or a request may wait long.
PATIENCE_S = 900.0
ENV = {"DEEPINFER_NEURON_DEVICE": "xla", "DEEPINFER_NEURON_AUDIT_GRAPHS": "1",
       "DEEPINFER_CPU_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def served_checkpoint(path: str, family: str) -> str:
    """A random checkpoint of `family` (VOCAB tokens, the last one EOS) with a word tokenizer."""
    make_checkpoint(path, family, eos_token_id=VOCAB - 1)
    save_word_tokenizer(path, VOCAB, VOCAB - 1)
    return path


def save_tokenizer_for(path: str) -> None:
    """A word tokenizer for a checkpoint made elsewhere (its vocabulary and EOS from config)."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    eos = config.get("eos_token_id")
    save_word_tokenizer(path, config["vocab_size"], (eos[0] if isinstance(eos, list) else eos) or 1)


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
