"""DeepSeek-V4 attention (models/deepseek_v4/attention.py) against transformers' own: a tiny
random DeepseekV4Model with one sliding, one CSA and one HCA layer runs a 37-token prefill and
5 decode steps through its cache; every attention call's input, output and the compressed
entries (and CSA indexer picks) its attention consumed are captured with hooks, and ours must
give the same output from the same input, its keys given explicitly (window + entries)."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import transformers
from torch import nn

from deepinfer.models.deepseek_v4.attention import (
    V4Attention,
    attend,
    entries_visible,
    selected_visible,
)

# 37: neither compressor's windows align with the prefill, and both emit an entry mid-decode
# (at position 39), so their buffered state crosses from prefill to decode.
PREFILL, DECODES, WINDOW = 37, 5, 8
LAYERS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
CONFIG = dict(
    vocab_size=64, hidden_size=48, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.25,
    q_lora_rank=24, o_groups=2, o_lora_rank=16, sliding_window=WINDOW, layer_types=LAYERS,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    index_n_heads=2, index_head_dim=16, index_topk=3, n_routed_experts=4,
    num_experts_per_tok=2, hc_mult=2, mlp_layer_types=["moe"] * 3, max_position_embeddings=256,
    # yarn on the compressed layers' rope, as the released checkpoints have it
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
)


@dataclass
class Call:
    """One attention call of one layer, as transformers ran it."""

    hidden: torch.Tensor  # [T, H] the attention's input
    positions: torch.Tensor  # [T]
    out: torch.Tensor  # [T, H]
    compressed: torch.Tensor | None  # [N, D] the entries the attention concatenated
    top_k: torch.Tensor | None  # [T, k] CSA indexer picks (-1: none)


@dataclass
class Records:
    """What the hooks saw of one layer, call by call: each attention call of a CSA / HCA
    layer runs its compressor once (and a CSA one its indexer once)."""

    attn: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    compressed: list[torch.Tensor] = field(default_factory=list)
    top_k: list[torch.Tensor] = field(default_factory=list)

    def calls(self) -> list[Call]:
        n = len(self.attn)
        compressed = self.compressed or [None] * n
        top_k = self.top_k or [None] * n
        assert len(compressed) == len(top_k) == n
        return [Call(*a, c, k) for a, c, k in zip(self.attn, compressed, top_k)]


def _randomize(model: nn.Module) -> None:
    """Weights big enough that every softmax is far from uniform; sinks and position biases
    non-zero (transformers initialises both to zero)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen) * 2.0)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.copy_(torch.randn(p.shape, generator=gen) * (2.0 / fan_in ** 0.5))


def _hook(attn: nn.Module, rec: Records) -> None:
    def on_attn(_m, args, kwargs, output):
        rec.attn.append((args[0][0].clone(), kwargs["position_ids"][0], output[0][0].clone()))

    attn.register_forward_hook(on_attn, with_kwargs=True)
    if attn.compressor is None:
        return
    # compressor output: (entries [B, 1, N, D], block bias); indexer output: picks [B, T, k]
    attn.compressor.register_forward_hook(lambda _m, _a, out: rec.compressed.append(out[0][0, 0]))
    if hasattr(attn.compressor, "indexer"):
        attn.compressor.indexer.register_forward_hook(
            lambda _m, _a, out: rec.top_k.append(out[0]))


@pytest.fixture(scope="module")
def reference() -> tuple[transformers.DeepseekV4Model, list[list[Call]]]:
    torch.manual_seed(0)
    config = transformers.DeepseekV4Config(**CONFIG)
    config._attn_implementation = "eager"
    model = transformers.DeepseekV4Model(config).eval()
    _randomize(model)
    records = [Records() for _ in LAYERS]
    for layer, rec in zip(model.layers, records):
        _hook(layer.self_attn, rec)
    ids = torch.randint(0, config.vocab_size, (1, PREFILL + DECODES),
                        generator=torch.Generator().manual_seed(1))
    cache = transformers.DynamicCache(config=config)
    with torch.no_grad():
        model(input_ids=ids[:, :PREFILL], cache=cache, use_cache=True)
        for step in range(DECODES):
            tok = ids[:, PREFILL + step: PREFILL + step + 1]
            model(input_ids=tok, cache=cache, use_cache=True)
    return model, [rec.calls() for rec in records]


def _ours(model: transformers.DeepseekV4Model, layer: int) -> V4Attention:
    ours = V4Attention(model.config, layer)
    theirs = {k: v for k, v in model.layers[layer].self_attn.state_dict().items()
              if not k.startswith("compressor.")}
    ours.load_state_dict(theirs, strict=True)  # same names, no extras, nothing missing
    return ours


def _visible(ours: V4Attention, call: Call, n: int) -> torch.Tensor:
    if call.top_k is not None:
        return selected_visible(call.top_k, n)
    return entries_visible(call.positions, n, ours.dims.compress_rate)


def _run_layer(ours: V4Attention, calls: list[Call], use_compressed: bool = True
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ours, theirs) per call, our keys held as a paged cache would hold them."""
    history = []  # every token's kv, by position
    pairs = []
    for call in calls:
        q, kv = ours.project(call.hidden, call.positions)
        history.extend(kv)
        first = max(0, int(call.positions[0]) - ours.dims.sliding_window + 1)
        window_positions = torch.arange(first, int(call.positions[-1]) + 1)
        window_kv = torch.stack(history[first:])
        compressed, visible = None, None
        if call.compressed is not None and use_compressed:
            compressed = call.compressed
            visible = _visible(ours, call, compressed.shape[0])
        attn = attend(q, call.positions, window_kv, window_positions, compressed, visible,
                      ours.sinks, ours.dims.sliding_window, ours.dims.scale)
        pairs.append((ours.output(attn, call.positions), call.out))
    return pairs


@pytest.mark.parametrize("layer", [0, 1, 2], ids=LAYERS)
def test_attention_matches_transformers(reference, layer: int) -> None:
    model, calls = reference
    assert [c.hidden.shape[0] for c in calls[layer]] == [PREFILL] + [1] * DECODES
    ours = _ours(model, layer)
    with torch.no_grad():
        pairs = _run_layer(ours, calls[layer])
    for step, (mine, theirs) in enumerate(pairs):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"layer {layer} call {step}: {m}")


@pytest.mark.parametrize("layer", [1, 2], ids=LAYERS[1:])
def test_compressed_entries_matter(reference, layer: int) -> None:
    """The comparison is not vacuous: entries exist and one more appears during decode, CSA's
    picks are a strict subset of the causally visible ones, and leaving the entries out changes
    the output."""
    model, calls = reference
    rate = model.config.compress_rates[LAYERS[layer]]
    prefill = calls[layer][0]
    n = prefill.compressed.shape[0]
    assert n == PREFILL // rate
    assert calls[layer][-1].compressed.shape[0] == (PREFILL + DECODES) // rate == n + 1
    causal = entries_visible(prefill.positions, n, rate)
    if prefill.top_k is not None:
        picked = selected_visible(prefill.top_k, n)
        assert not (picked & ~causal).any() and (causal & ~picked).any()
    ours = _ours(model, layer)
    with torch.no_grad():
        pairs = _run_layer(ours, calls[layer], use_compressed=False)
    assert all((mine - theirs).abs().max() > 1e-3 for mine, theirs in pairs)


def test_window_and_sinks_matter(reference) -> None:
    """The sliding layer's window cuts the prefill (40 > 8) and the sinks shift the output."""
    model, calls = reference
    ours = _ours(model, 0)
    call = calls[0][0]
    with torch.no_grad():
        q, kv = ours.project(call.hidden, call.positions)
        pos = call.positions
        full = attend(q, pos, kv, pos, None, None, ours.sinks, PREFILL + 1, ours.dims.scale)
        windowed = attend(q, pos, kv, pos, None, None, ours.sinks, WINDOW, ours.dims.scale)
        no_sink = attend(q, pos, kv, pos, None, None, torch.full_like(ours.sinks, -1e30), WINDOW,
                         ours.dims.scale)
    assert (full[WINDOW:] - windowed[WINDOW:]).abs().max() > 1e-3
    torch.testing.assert_close(full[:WINDOW], windowed[:WINDOW])
    assert (no_sink - windowed).abs().max() > 1e-3


def test_long_prefills_attend_in_blocks_of_queries(monkeypatch) -> None:
    """A chunk whose scores would not fit is attended block by block of queries: the same
    output (here blocks of 2 queries, with compressed entries each query sees differently)."""
    from deepinfer.models.deepseek_v4 import attention

    g = torch.Generator().manual_seed(5)
    q, kv, comp = (torch.randn(*s, generator=g) for s in ((9, 4, 16), (9, 16), (3, 16)))
    pos, sinks = torch.arange(9), torch.randn(4, generator=g)
    visible = entries_visible(pos, 3, 3)
    whole = attend(q, pos, kv, pos, comp, visible, sinks, 4, 0.25)
    monkeypatch.setattr(attention, "MAX_SCORES", 2 * 4 * 12)
    torch.testing.assert_close(attend(q, pos, kv, pos, comp, visible, sinks, 4, 0.25), whole)


def test_picks_and_window_blocks_equal_the_masked_whole(monkeypatch) -> None:
    """CSA's picks gathered per query == the same entries as a [T, N] mask; and a chunk that
    starts past 0, whose window keys start earlier, attended in blocks that each take only the
    keys their windows span == all keys at once."""
    from deepinfer.models.deepseek_v4 import attention

    g = torch.Generator().manual_seed(7)
    q, kv, comp = (torch.randn(*s, generator=g) for s in ((9, 4, 16), (12, 16), (6, 16)))
    pos, keys, sinks = torch.arange(20, 29), torch.arange(17, 29), torch.randn(4, generator=g)
    picks = torch.tensor([[0, 3, -1], [5, 1, 2], [4, -1, -1]] * 3)
    masked = attend(q, pos, kv, keys, comp, selected_visible(picks, 6), sinks, 4, 0.25)
    torch.testing.assert_close(attend(q, pos, kv, keys, comp, None, sinks, 4, 0.25,
                                      picks=picks), masked)
    monkeypatch.setattr(attention, "QUERY_BLOCK", 2)
    torch.testing.assert_close(attend(q, pos, kv, keys, comp, None, sinks, 4, 0.25,
                                      picks=picks), masked)
    assert not torch.equal(attend(q, pos, kv, keys, comp, None, sinks, 5, 0.25, picks=picks),
                           masked)  # the window matters: the blocks' key runs follow it
