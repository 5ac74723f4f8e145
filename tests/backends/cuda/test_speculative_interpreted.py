"""Speculative decoding on the CUDA backend (DeepSeek-V3's MTP layer as the draft), on a GPU or
with its Triton kernels under TRITON_INTERPRET=1: greedy tokens equal plain decoding on the
CPU backend (itself equal to transformers, tests/models/test_deepseek_v3_mtp.py) for k = 2 (two
proposals a step, so the draft layer's own steps run too), drafts get verified, and every
block is freed."""
from __future__ import annotations

import os

import pytest
import torch

from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from deepinfer.core.engine import Engine
from deepinfer.core.sampling import SamplingParams
from deepinfer.llm import LLM
from tests.backends.cuda.test_backend_interpreted import _interpreted_cls
from tests.models.mtp_checkpoints import add_mtp
from tests.models.test_deepseek_v3_parity import _prompts, make_deepseek

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(),
                                reason="runs the kernels on a GPU or Triton's CPU interpreter")


def _accelerator():
    if INTERPRETED:
        return _interpreted_cls()()
    from deepinfer.backends.cuda.accelerator import CUDAAccelerator

    return CUDAAccelerator()

N = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
LENGTHS = (5, 19)


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory) -> str:
    return add_mtp(make_deepseek(str(tmp_path_factory.mktemp("v3_mtp")), "v3"), seed=5)


@pytest.fixture(scope="module")
def plain(mtp_path) -> list[list[int]]:
    llm = LLM(mtp_path, dtype="float32", accelerator="cpu", block_size=16,
              kv_cache_memory_gb=0.05, load_tokenizer=False)
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(LENGTHS, seed=1), GREEDY)]


def _run(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [done[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("k, graphs", [(2, False), (2, True)])  # k = 1..3 on the CPU
def test_greedy_equals_plain_decoding(mtp_path, plain, k, graphs):   # backend: test_deepseek_v3_mtp
    """Eager, and through speculative decoding's graphs (spec_graphs.py; recorded afresh
    without a GPU) with the single-group row layout."""
    config = EngineConfig(model=ModelSpec(mtp_path, dtype="float32"),
                          cache=CacheConfig(block_size=16, num_blocks=24),
                          scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4,
                                                    num_speculative_tokens=k))
    engine = Engine(config, accelerator=_accelerator(), load_tokenizer=False)
    if graphs and engine.accelerator.graphs is None:
        engine.accelerator.capture_graphs(16)
    verified = []
    if graphs:
        graph_set = engine.accelerator.speculator.verify
        record = graph_set.record
        graph_set.record = lambda *a: verified.append(a[1]) or record(*a)
    assert _run(engine, _prompts(LENGTHS, seed=1)) == plain
    assert bool(verified) == (graphs and INTERPRETED)  # on a GPU the graphs replay
    stats = engine.scheduler.spec_stats
    assert stats.draft_tokens > 0 and 0 <= stats.accepted_tokens <= stats.draft_tokens
    assert engine.kv.num_request_blocks() == 0
    engine.shutdown()
