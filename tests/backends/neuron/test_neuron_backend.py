"""The Neuron backend's static graphs run on the host (DEEPINFER_NEURON_DEVICE=cpu): its static
attention against a dense computation, its buckets and static-shape guard, and the whole
backend against transformers on tiny random checkpoints."""
from __future__ import annotations

import math

import pytest
import torch

from deepinfer.backends.neuron.attention import static_paged_attention
from deepinfer.backends.neuron.buckets import StaticShapeError, StaticShapeGuard, StaticShapes
from deepinfer.backends.neuron.env import use_compile_cache
from deepinfer.core.sampling import SamplingParams
from deepinfer.llm import LLM
from tests.checkpoints import checkpoint_cache, make_checkpoint
from tests.models.test_moe_parity import (
    _assert_reference_greedy,
    _prompts,
    _reference,
)

# Prompt seeds whose greedy paths keep the reference's top-1/top-2 margin (MIN_MARGIN).
SEEDS = {"deepseek_v3_moe": 4}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(autouse=True)
def host_device(monkeypatch):
    monkeypatch.setenv("DEEPINFER_NEURON_DEVICE", "cpu")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_cache(tmp_path_factory, make_checkpoint)


# ---- static attention --------------------------------------------------------------------
def _dense(q, keys, values, position, window):
    """One token's attention over its sequence's keys 0..position (within the window)."""
    lo = max(0, position - window + 1) if window else 0
    k, v = keys[lo:position + 1], values[lo:position + 1]
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,khd->hk", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("hk,khd->hd", scores.softmax(dim=-1), v)


def test_static_latent_attention_equals_dense():
    """MLA on the static kernel: one latent head shared by every query head, keys all of the
    latent, values its first dims, the model's own scale."""
    g = torch.Generator().manual_seed(1)
    bs, blocks, heads, latent_dim, value_dim, scale = 4, 8, 3, 12, 8, 0.37
    cache = torch.randn(blocks * bs, 1, latent_dim, generator=g)
    table, seq_len = [6, 2, 5], 10
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(seq_len)])
    q = torch.randn(seq_len, heads, latent_dim, generator=g)
    out = static_paged_attention(q, cache, cache[..., :value_dim],
                                 torch.tensor([table + [0]] * seq_len), torch.arange(seq_len),
                                 bs, scale=scale)
    keys = cache[slots, 0]
    for p in range(seq_len):
        probs = (q[p] @ keys[:p + 1].T * scale).softmax(dim=-1)
        torch.testing.assert_close(out[p], probs @ keys[:p + 1, :value_dim], rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("window", [0, 5])
def test_static_attention_equals_dense(window):
    """Tokens of three sequences (one decoding, two prefilling, pages out of order) and a
    padding row, tables padded with the null block to a width wider than any sequence and
    chunked: each token equals the dense softmax over the keys it may see."""
    g = torch.Generator().manual_seed(0)
    bs, blocks, hq, hk, d = 4, 24, 4, 2, 8
    k_cache = torch.randn(blocks * bs, hk, d, generator=g)
    v_cache = torch.randn(blocks * bs, hk, d, generator=g)
    seqs = [([5, 3, 9], 11, [10]), ([7, 2], 8, [5, 6, 7]), ([12, 1, 4, 20], 14, [0, 1, 2])]
    width = 8
    rows, positions, expected = [], [], []
    for table, seq_len, positions_of in seqs:
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(seq_len)])
        for p in positions_of:
            rows.append(table + [0] * (width - len(table)))
            positions.append(p)
            q = torch.randn(hq, d, generator=g)
            expected.append((q, _dense(q, k_cache[slots], v_cache[slots], p, window)))
    rows.append([0] * width)  # a padding row in the null block
    positions.append(1)
    q = torch.stack([e[0] for e in expected] + [torch.randn(hq, d, generator=g)])
    out = static_paged_attention(q, k_cache, v_cache, torch.tensor(rows),
                                 torch.tensor(positions), bs, window)
    for i, (_, ref) in enumerate(expected):
        torch.testing.assert_close(out[i], ref, rtol=1e-5, atol=1e-5)


# ---- buckets and the guard ---------------------------------------------------------------
def test_bucket_plan_and_guard():
    shapes = StaticShapes.plan(max_num_batched_tokens=200, max_num_seqs=6, max_model_len=300,
                               block_size=16)
    assert shapes.token_buckets == (16, 32, 64, 128, 200)
    assert shapes.batch_buckets == (1, 2, 4, 6)
    assert shapes.context_buckets == (1, 2, 4, 8, 16, 19)
    assert shapes.context_bucket(9) == 16 and shapes.sample_rows == 7
    assert len(shapes.graphs()) == (5 + 4) * 6
    with pytest.raises(StaticShapeError, match="exceeds"):
        shapes.context_bucket(20)
    guard = StaticShapeGuard()
    guard.check("decode", torch.zeros(4), torch.zeros(4, 8))
    guard.freeze()
    guard.check("decode", torch.ones(4), torch.ones(4, 8))  # same shapes: the built graph
    with pytest.raises(StaticShapeError, match="outside the 1 graphs"):
        guard.check("decode", torch.zeros(4), torch.zeros(4, 16))


# ---- the backend end to end --------------------------------------------------------------
def _neuron_llm(path: str, **options) -> LLM:
    settings = dict(dtype="float32", accelerator="neuron", block_size=16, num_blocks=40,
                    max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256)
    return LLM(path, load_tokenizer=False, **{**settings, **options})


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3_moe"])
def test_greedy_equals_transformers(checkpoint, family):
    """Batched prompts longer than a prefill bucket (so chunked), decoding together in padded
    batch buckets, then a prefix-cache hit: every token is transformers' argmax, every step ran
    in a graph built at start-up, and the fixed pool never grew."""
    path = checkpoint(family)
    llm = _neuron_llm(path)
    engine = llm.engine
    graphs, usable = engine.accelerator.guard.num_graphs, engine.kv.pool.num_usable
    assert engine.accelerator.guard.frozen and engine.scheduler.fixed_pool
    assert graphs == len(engine.accelerator.shapes.graphs())  # every bucket built, once
    prompts = _prompts((5, 23, 90), seed=SEEDS.get(family, 1))
    outs = llm.generate(prompts, GREEDY)
    again = llm.generate([prompts[2]], GREEDY)[0]  # its pages are cached now
    model = _reference(path)
    for prompt, out in zip(prompts, outs):
        _assert_reference_greedy(model, prompt, list(out.outputs[0].token_ids))
    assert list(again.outputs[0].token_ids) == list(outs[2].outputs[0].token_ids)
    assert again.num_cached_tokens >= 80
    assert engine.accelerator.guard.num_graphs == graphs
    assert engine.kv.pool.num_usable == usable and engine.scheduler.num_preemptions == 0


def test_a_shape_outside_the_buckets_is_refused(checkpoint):
    llm = _neuron_llm(checkpoint("llama"))
    acc = llm.engine.accelerator
    from deepinfer.core.padding import dummy_batch

    with pytest.raises(StaticShapeError):
        acc.forward_logits(dummy_batch(1, 16), width=3)  # 3 blocks: not a context bucket


def test_region_timing(checkpoint, monkeypatch):
    """DEEPINFER_NEURON_REGION_TIMING=1: attention, the router exchange, the experts and the
    combine are timed every layer of every step; off (the default), nothing is."""
    path = checkpoint("qwen3_moe")
    assert _neuron_llm(path).engine.accelerator.region_times() == {}
    monkeypatch.setenv("DEEPINFER_NEURON_REGION_TIMING", "1")
    llm = _neuron_llm(path)
    before = llm.engine.accelerator.region_times()  # the start-up graphs ran timed too
    llm.generate(_prompts((30,), seed=2), SamplingParams(temperature=0.0, max_tokens=4))
    after = llm.engine.accelerator.region_times()
    assert set(after) == {"attention", "router_exchange", "experts", "combine"}
    steps = 4  # one prefill (30 tokens fit the 64-token budget) and three decodes
    assert after["attention"]["calls"] - before["attention"]["calls"] == 2 * steps  # 2 layers
    assert after["experts"]["calls"] - before["experts"]["calls"] == steps  # 1 MoE layer
    assert all(r["seconds"] > 0 for r in after.values())


def test_device_adapter_selection(monkeypatch):
    """The host device on request; no Neuron runtime here, so `auto` is not available and
    asking for it is one clear error; a bad value names the variable."""
    from deepinfer.backends.neuron import device

    host = device.select_device({"DEEPINFER_NEURON_DEVICE": "cpu"})
    assert (host.kind, host.distributed_backend, host.torch_device.type) == ("cpu", "gloo", "cpu")
    assert host.compile(len, "x") is len  # the host runs the graphs as they are
    assert device.available({"DEEPINFER_NEURON_DEVICE": "cpu"})
    assert not device.available({})
    with pytest.raises(device.NeuronUnavailable, match="DEEPINFER_NEURON_DEVICE=cpu"):
        device.select_device({})
    # Asked for by name, the backend says what is missing and what to install.
    assert "PyTorch/XLA (torch-xla) is not installed" in device.unavailable_reason(
        {"DEEPINFER_NEURON_DEVICE": "xla"})
    assert "neither TorchNeuron" in device.unavailable_reason({})
    with pytest.raises(ValueError, match="DEEPINFER_NEURON_DEVICE='tpu'"):
        device.requested_kind({"DEEPINFER_NEURON_DEVICE": "tpu"})
    env = {"NEURON_CC_FLAGS": "--model-type=transformer"}
    use_compile_cache(env)
    assert env["NEURON_CC_FLAGS"].startswith("--model-type=transformer --cache_dir=")
    kept = {"NEURON_CC_FLAGS": "--cache_dir=/mine"}
    use_compile_cache(kept)
    assert kept["NEURON_CC_FLAGS"] == "--cache_dir=/mine"
