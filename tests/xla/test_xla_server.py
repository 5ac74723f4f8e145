"""deepinfer-serve on the Neuron backend's xla device (PyTorch/XLA's CPU device): 200 requests of
mixed prompt and output lengths, 16 at a time, with every step audited against its plan
(DEEPINFER_NEURON_AUDIT_GRAPHS=1: a compilation after start-up or a host sync inside a step fails
the step, and every later one, with a message naming the op). All 200 finish, those checked
with transformers' greedy tokens.

Runs in the XLA venv (scripts/xla_env.sh); skipped where torch_xla is not installed."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("torch_xla")

from tests.models.test_moe_parity import (  # noqa: E402
    _assert_reference_greedy,
    _prompts,
    _reference,
)
from tests.xla.serving import VOCAB, complete, served_checkpoint, xla_server  # noqa: E402

REQUESTS, CLIENTS = 200, 16
# Prompts whose 16 greedy tokens keep the reference's margin (test_xla_device's qwen3_moe seed).
CHECKED = _prompts((5, 23, 40), seed=1)
SHAPES = ["--dtype", "float32", "--block-size", "16", "--num-kv-blocks", "40",
          "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--max-model-len", "64"]


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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return served_checkpoint(str(tmp_path_factory.mktemp("qwen3_moe")), "qwen3_moe")


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
