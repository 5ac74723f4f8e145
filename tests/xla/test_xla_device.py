"""The Neuron backend on PyTorch/XLA's CPU device (DEEPINFER_NEURON_DEVICE=xla, PJRT_DEVICE=CPU):
the graphs torch-neuronx's compiler would receive are traced once per bucket, compiled once, and
replayed; PyTorch/XLA's debug metrics are the source of every count here.

These run in the XLA venv (scripts/xla_env.sh: torch and torch-xla at the versions PyTorch/XLA
pins); where torch_xla is not installed they skip."""
from __future__ import annotations

import pytest

pytest.importorskip("torch_xla")

from deepinfer.backends.neuron.xla_audit import xla_counts  # noqa: E402
from deepinfer.core.sampling import SamplingParams  # noqa: E402
from deepinfer.llm import LLM  # noqa: E402
from tests.checkpoints import checkpoint_cache, make_checkpoint  # noqa: E402
from tests.models.test_moe_parity import (  # noqa: E402
    _assert_reference_greedy,
    _prompts,
    _reference,
)

pytestmark = pytest.mark.usefixtures("xla_device")
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# Prompt seeds whose greedy paths keep the reference's top-1/top-2 margin (MIN_MARGIN).
SEEDS = {"llama": 2, "qwen3_moe": 1, "deepseek_v3_moe": 4}
# Small buckets keep the compiles few: tokens 16, 32; batches 1, 2; context 1, 2, 4 blocks.
SHAPES = dict(dtype="float32", accelerator="neuron", block_size=16, num_blocks=32,
              max_num_batched_tokens=32, max_num_seqs=2, max_model_len=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_cache(tmp_path_factory, make_checkpoint)


def _llm(path: str, **options) -> LLM:
    return LLM(path, load_tokenizer=False, **{**SHAPES, **options})


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3_moe"])
def test_one_compile_per_bucket_and_greedy_equals_transformers(checkpoint, family):
    """Start-up compiles exactly one graph per planned bucket; batched prompts longer than a
    prefill bucket (chunked), decoding together, then a prefix-cache hit, then a sampled
    request beside a greedy one, compile nothing more and sync nothing mid-step (the audit
    raises otherwise), and take out one transfer a step (the greedy ids, or the logits to
    sample from); every greedy token is transformers' argmax."""
    path = checkpoint(family)
    before = xla_counts()
    llm = _llm(path)
    acc = llm.engine.accelerator
    assert acc.device.kind == "xla" and acc.audit is not None
    started = xla_counts()
    plan = acc.graph_plan()
    assert len(plan) == len(acc.shapes.graphs())  # none of these buckets can overflow a slot
    # One compile per bucket, and one before them that materialises the weights and the pool.
    assert [g["compiles"] for g in acc.graph_report] == [1] * len(plan)
    assert started.compiles - before.compiles == len(plan) + 1
    prompts = _prompts((5, 23, 40), seed=SEEDS[family])
    outs = llm.generate(prompts, GREEDY)  # plain greedy steps: the graph's argmax comes out
    again = llm.generate([prompts[2]], GREEDY)[0]
    # A sampled request beside a greedy one: the logits come out, the host samples.
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True)
    mixed = llm.generate(prompts[:2], [GREEDY, sampled])
    done = xla_counts().minus(started)
    assert done.compiles == 0, "a graph compiled after start-up"
    # The logits are each step's one transfer out (the audit checked each step's one graph).
    assert acc.audit.steps > 0 and done.from_device == acc.audit.steps
    model = _reference(path)
    for prompt, out in zip(prompts, outs):
        _assert_reference_greedy(model, prompt, list(out.outputs[0].token_ids))
    assert list(again.outputs[0].token_ids) == list(outs[2].outputs[0].token_ids)
    assert again.num_cached_tokens >= 32
    assert list(mixed[0].outputs[0].token_ids) == list(outs[0].outputs[0].token_ids)
    assert len(mixed[1].outputs[0].token_ids) == 8


def test_an_overflowing_step_reruns_dense_without_a_host_sync(checkpoint, monkeypatch):
    """Capacity at a quarter of the mean load and grouped experts from 8 tokens: prefill steps
    overflow a slot. On XLA the step does not read its counts back (the audit would fail it):
    its graph flags the overflow beside the logits, and the step runs again with dense experts,
    a graph planned and built at start-up. Tokens stay transformers'."""
    monkeypatch.setenv("DEEPINFER_NEURON_MOE_CAPACITY", "0.25")
    monkeypatch.setattr("deepinfer.backends.neuron.moe.DECODE_MAX_TOKENS", 8)
    path = checkpoint("qwen3_moe")
    before = xla_counts()
    # A pool of its own size: no graph of the test above is in PyTorch/XLA's compile cache.
    llm = _llm(path, num_blocks=24)
    acc = llm.engine.accelerator
    plan = acc.graph_plan()
    dense = [g for g in plan if g[0].endswith("-dense")]
    assert {g[0] for g in dense} == {"prefill-dense"} and len(dense) == 6  # 2 tokens x 3 ctx
    started = xla_counts()
    assert started.compiles - before.compiles == len(plan) + 1  # + the weights and the pool
    exchange = acc.runner.moe.static_exchange
    dense_before = exchange.dense_runs
    prompts = _prompts((5, 23, 40), seed=SEEDS["qwen3_moe"])
    outs = llm.generate(prompts, GREEDY)
    assert exchange.dense_runs > dense_before  # steps ran again dense
    assert xla_counts().minus(started).compiles == 0
    model = _reference(path)
    for prompt, out in zip(prompts, outs):
        _assert_reference_greedy(model, prompt, list(out.outputs[0].token_ids))


def test_the_audit_names_a_recompile_and_a_host_sync(checkpoint):
    """A step whose trace departs from its bucket's graph fails naming the op it adds;
    a step that reads a value back mid-way fails naming the op that synced."""
    llm = _llm(checkpoint("llama"))
    acc = llm.engine.accelerator
    forward = acc._forward

    def extra_op(ids, meta, rows):
        logits, tokens = forward(ids, meta, rows)
        return logits * 2.5, tokens

    acc._forward = extra_op
    # The engine fails the request with the audit's message.
    with pytest.raises(RuntimeError, match=r"compilation.*the trace adds .*aten::mul"):
        llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=1))

    def reads_back(ids, meta, rows):
        logits, tokens = forward(ids, meta, rows)
        return (logits if float(logits.sum()) else logits), tokens

    llm = _llm(checkpoint("llama"))
    llm.engine.accelerator._forward = reads_back
    with pytest.raises(RuntimeError, match=r"host sync.*aten::_local_scalar_dense"):
        llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=1))
