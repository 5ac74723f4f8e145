"""What the DeepSeek-V4 tests under Triton's interpreter share: the checkpoint of
tests/models/test_deepseek_v4_parity.py (a sliding, a CSA and an HCA layer; window 16, HCA rate
32, indexer top-8) with a 512-token vocabulary so the interpreter gets through the LM head
quickly, transformers' model of it, random prompts, and a greedy engine run.

The fixtures are module-scoped: each test module that imports them writes the checkpoint and
loads the reference once.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer.core.engine import Engine
from deepinfer.core.sampling import SamplingParams
from tests.checkpoints import checkpoint_cache
from tests.models.test_deepseek_v4_parity import make_v4

VOCAB = 512


def random_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return checkpoint_cache(tmp_path_factory, lambda path, name: make_v4(
        path, name, vocab_size=VOCAB))("v4-small-vocab")


@pytest.fixture(scope="module")
def reference(checkpoint):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """150 tokens (past the first 128-token page) and 45."""
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (150, 45)]


def run_greedy(engine: Engine, prompts: list[list[int]], new: int, tag: str
               ) -> dict[int, tuple]:
    """The prompts submitted together and stepped to the end: each one's (tokens, cached)."""
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}{i}", prompt, params)
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = (list(out.token_ids), out.num_cached_tokens)
    return {i: got[f"{tag}{i}"] for i in range(len(prompts))}
