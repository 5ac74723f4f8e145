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

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# Prompt seeds whose greedy paths keep the reference's top-1/top-2 margin (MIN_MARGIN).
SEEDS = {"llama": 2, "qwen3_moe": 1, "deepseek_v3_moe": 4}
# Small buckets keep the compiles few: tokens 16, 32; batches 1, 2, 4; context 1, 2, 4 blocks.
SHAPES = dict(dtype="float32", accelerator="neuron", block_size=16, num_blocks=32,
              max_num_batched_tokens=32, max_num_seqs=4, max_model_len=64)


@pytest.fixture(autouse=True)
def xla_device(monkeypatch):
    monkeypatch.setenv("DEEPINFER_NEURON_DEVICE", "xla")
    monkeypatch.setenv("DEEPINFER_NEURON_AUDIT_GRAPHS", "1")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_cache(tmp_path_factory, make_checkpoint)


def _llm(path: str) -> LLM:
    return LLM(path, load_tokenizer=False, **SHAPES)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3_moe"])
def test_one_compile_per_bucket_and_greedy_equals_transformers(checkpoint, family):
    """Start-up compiles exactly one graph per planned bucket; batched prompts longer than a
    prefill bucket (chunked), decoding together, then a prefix-cache hit, compile nothing more
    and sync nothing mid-step (the audit raises otherwise); every token is transformers'
    argmax."""
    path = checkpoint(family)
    before = xla_counts()
    llm = _llm(path)
    acc = llm.engine.accelerator
    assert acc.device.kind == "xla" and acc.audit is not None
    started = xla_counts()
    assert started.compiles - before.compiles == len(acc.shapes.graphs())
    prompts = _prompts((5, 23, 40), seed=SEEDS[family])
    outs = llm.generate(prompts, GREEDY)
    again = llm.generate([prompts[2]], GREEDY)[0]
    done = xla_counts().minus(started)
    assert done.compiles == 0, "a graph compiled after start-up"
    # One graph a step, and the logits its only transfer out.
    assert acc.audit.steps > 0 and done.executions == done.from_device == acc.audit.steps
    model = _reference(path)
    for prompt, out in zip(prompts, outs):
        _assert_reference_greedy(model, prompt, list(out.outputs[0].token_ids))
    assert list(again.outputs[0].token_ids) == list(outs[2].outputs[0].token_ids)
    assert again.num_cached_tokens >= 32


def test_the_audit_names_a_recompile_and_a_host_sync(checkpoint):
    """A step whose trace departs from its bucket's graph fails naming the op it adds;
    a step that reads a value back mid-way fails naming the op that synced."""
    llm = _llm(checkpoint("llama"))
    acc = llm.engine.accelerator
    forward = acc._forward

    def extra_op(ids, meta, rows):
        return forward(ids, meta, rows) * 2.5

    acc._forward = extra_op
    # The engine fails the request with the audit's message.
    with pytest.raises(RuntimeError, match=r"compilation.*the trace adds .*aten::mul"):
        llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=1))

    def reads_back(ids, meta, rows):
        logits = forward(ids, meta, rows)
        return logits if float(logits.sum()) else logits

    llm = _llm(checkpoint("llama"))
    llm.engine.accelerator._forward = reads_back
    with pytest.raises(RuntimeError, match=r"host sync.*aten::_local_scalar_dense"):
        llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=1))
