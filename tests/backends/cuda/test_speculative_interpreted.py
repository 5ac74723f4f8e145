"""Speculative decoding on the CUDA backend (DeepSeek-V3's MTP layer as the draft), on a GPU or
with its Triton kernels under TRITON_INTERPRET=1: greedy tokens equal plain decoding on the
CPU backend (itself equal to transformers, tests/models/test_deepseek_v3_mtp.py) for k = 2 (two
proposals a step, so the draft layer's own steps run too), drafts get verified, and every
block is freed."""
from __future__ import annotations

import os

import pytest
import torch

from deepinfer.backends.torch.speculative import MTPSpeculator
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

N = 4  # tokens a request: its prefill and up to three verify steps
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


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams = GREEDY
         ) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [done[str(i)] for i in range(len(prompts))]


def _engine(mtp_path: str, k: int) -> Engine:
    config = EngineConfig(model=ModelSpec(mtp_path, dtype="float32"),
                          cache=CacheConfig(block_size=16, num_blocks=24),
                          scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4,
                                                    num_speculative_tokens=k))
    return Engine(config, accelerator=_accelerator(), load_tokenizer=False)


def _stats(engine: Engine) -> tuple[int, int, list[int]]:
    stats = engine.scheduler.spec_stats
    return stats.draft_tokens, stats.accepted_tokens, list(stats.accepted_per_position)


@pytest.mark.parametrize("k", [2])  # k = 1..3 on the CPU backend: test_deepseek_v3_mtp.py
def test_greedy_equals_plain_decoding(mtp_path, plain, k):
    """Eager steps, then speculative decoding's graphs (spec_graphs.py; recorded afresh
    without a GPU, single-group row layout): the same tokens as plain decoding, and the same
    drafts proposed (the graphs' draft layer reads the verify graph's own ids on the device)."""
    eager = _engine(mtp_path, k)
    if eager.accelerator.graphs is not None:  # a GPU captured them: run these steps eagerly
        eager.accelerator.speculator = MTPSpeculator(eager.accelerator.runner,
                                                     eager.accelerator._step_meta)
    assert _run(eager, _prompts(LENGTHS, seed=1)) == plain
    stats = eager.scheduler.spec_stats
    assert stats.draft_tokens > 0 and 0 <= stats.accepted_tokens <= stats.draft_tokens
    assert eager.kv.num_request_blocks() == 0
    eager.shutdown()
    graphed = _engine(mtp_path, k)
    if graphed.accelerator.graphs is None:
        graphed.accelerator.record_graphs()
    assert _run(graphed, _prompts(LENGTHS, seed=1)) == plain
    assert _stats(graphed) == _stats(eager)
    assert graphed.kv.num_request_blocks() == 0
    graphed.shutdown()


def test_graphs_draft_what_the_draft_layer_predicts(tmp_path):
    """A model and MTP layer that continue a known chain (every draft right when the draft
    layer reads the right ids): through the graphs every draft is accepted, k + 1 tokens a
    step."""
    from tests.models.mtp_checkpoints import make_successor_model
    from tests.models.test_deepseek_v3_parity import DIMS

    path, succ = make_successor_model(str(tmp_path / "successor"), DIMS)
    engine = _engine(path, 3)  # two draft steps: each reads the one before on the device
    if engine.accelerator.graphs is None:
        engine.accelerator.record_graphs()
    prompt = [3, 9, 4]
    (out,) = _run(engine, [prompt])
    chain = [succ[prompt[-1]]]
    while len(chain) < N:
        chain.append(succ[chain[-1]])
    assert out == chain
    draft_tokens, accepted, _ = _stats(engine)
    assert accepted == draft_tokens > 0
    engine.shutdown()


def test_seeded_sampling_through_the_graphs_equals_eager_steps(mtp_path):
    """Temperature 0.8, seeded: the graphs' verify logits go through the sampler and the
    draft graph reads the accepted tokens from the host; the same tokens, and every step the
    same proposals, as the eager speculator."""
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=N, ignore_eos=True)
    runs = []
    for graphs in (False, True):
        engine = _engine(mtp_path, 2)
        if graphs and engine.accelerator.graphs is None:
            engine.accelerator.record_graphs()
        if not graphs and engine.accelerator.graphs is not None:
            engine.accelerator.speculator = MTPSpeculator(engine.accelerator.runner,
                                                          engine.accelerator._step_meta)
        proposed = []
        execute = engine.accelerator.speculator.execute
        engine.accelerator.speculator.execute = lambda batch, _e=execute: _proposals(
            _e(batch), proposed)
        runs.append((_run(engine, _prompts(LENGTHS, seed=1), params), proposed))
        engine.shutdown()
    assert runs[0] == runs[1] and any(runs[0][1])


def _proposals(out, into: list):
    """Record the step's proposals (every row's) and pass its output on."""
    into.append([row.proposals for row in out.rows()])
    return out
