"""DeepSeek-V4's mHC (models/deepseek_v4/hyper.py) against transformers' own modules
(transformers/models/deepseek_v4/modeling_deepseek_v4.py, 5.24): random-weight
DeepseekV4HyperConnection / DeepseekV4HyperHead, loaded into ours through hyper_target from
transformers' parameter names, and the streams of two layers driven as its decoder layer and
model drive them."""
from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.core_model_loading import WeightRenaming
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4HyperConnection,
    DeepseekV4HyperHead,
)

from deepinfer.backends.cpu.ops import CPUOps
from deepinfer.backends.torch.paged_cache import PagedCache
from deepinfer.backends.torch.runner import _restore_float32
from deepinfer.models.deepseek_v4.hyper import (
    HyperConnection,
    HyperDims,
    HyperHead,
    expand,
    hyper_target,
    init_hyper_buffers,
    sinkhorn,
)
from deepinfer.models.weights import load_mapped

HIDDEN, N, LAYERS = 64, 4, 2
BATCH, SEQ = 2, 5  # transformers' [B, S] is our flat T = B * S
TINY = dict(hidden_size=HIDDEN, hc_mult=N, num_hidden_layers=LAYERS, num_attention_heads=2,
            head_dim=32, q_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, vocab_size=32, o_groups=2, o_lora_rank=16,
            index_n_heads=2, index_head_dim=16, index_topk=4)
DEFAULT_ITERS = transformers.DeepseekV4Config().hc_sinkhorn_iters


class Reference(nn.Module):
    """transformers' mHC modules where its DeepseekV4Model holds them (layers.{i}.attn_hc,
    layers.{i}.ffn_hc, hc_head), float32 as _keep_in_fp32_modules_strict keeps them."""

    def __init__(self, config: transformers.DeepseekV4Config) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleDict(dict(attn_hc=DeepseekV4HyperConnection(config),
                               ffn_hc=DeepseekV4HyperConnection(config)))
            for _ in range(LAYERS))
        self.hc_head = DeepseekV4HyperHead(config)


class Ours(nn.Module):
    def __init__(self, dims: HyperDims) -> None:
        super().__init__()
        ops = CPUOps(PagedCache())
        self.layers = nn.ModuleList(
            nn.ModuleDict(dict(attn_hc=HyperConnection(dims, ops),
                               ffn_hc=HyperConnection(dims, ops)))
            for _ in range(LAYERS))
        self.hc_head = HyperHead(dims, ops)


def randomize(reference: Reference, seed: int) -> None:
    """Gates far from trivial: logits of order 1 (the normed streams have unit RMS over N*H,
    so fn ~ N(0, 0.1) gives logits ~ N(0, 1.6)), scales and biases off 1 and 0."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith("fn"):
                param.normal_(0.0, 0.1, generator=generator)
            elif name.endswith("base"):
                param.normal_(0.0, 0.5, generator=generator)
            else:
                param.uniform_(0.5, 1.5, generator=generator)


def transformers_names() -> list[str]:
    """The mHC parameter names of a real (meta-device) DeepseekV4ForCausalLM."""
    with torch.device("meta"):
        model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**TINY))
    return [name for name, _ in model.named_parameters() if "hc" in name]


@pytest.fixture(scope="module")
def hf_names() -> list[str]:
    return transformers_names()


def build(iters: int, hf_names: list[str], seed: int = 0) -> tuple[Reference, Ours, HyperDims]:
    config = transformers.DeepseekV4Config(**TINY, hc_sinkhorn_iters=iters)
    reference = Reference(config).float()
    randomize(reference, seed)
    dims = HyperDims.from_config(config)
    ours = Ours(dims)
    tensors = dict(reference.named_parameters())
    # hf name "model.layers.0.attn_hc.fn" holds the reference's "layers.0.attn_hc.fn"
    checkpoint = [(name, tensors[name.removeprefix("model.")].detach()) for name in hf_names]
    load_mapped(ours, checkpoint, lambda name: (hyper_target(name), None))
    return reference, ours, dims


def block(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Stands in for attention / MLP: any function of the collapsed input, the same for both."""
    return torch.tanh(x.float() @ weight).to(x.dtype)


def run_reference(reference: Reference, embeds: torch.Tensor, weights: list[torch.Tensor]
                  ) -> list[torch.Tensor]:
    """Driven as transformers drives it: the expand of DeepseekV4Model.forward (line 1363),
    DeepseekV4DecoderLayer.forward's collapse / update per block (lines 1188-1199, with
    `block` for self_attn(input_layernorm(.)) and mlp(post_attention_layernorm(.))), the
    hc_head of line 1380. Returns every collapsed input, stream state and the final collapse."""
    seen = []
    hidden_states = embeds.unsqueeze(2).expand(-1, -1, N, -1).contiguous()
    dtype = hidden_states.dtype
    for layer, (w_attn, w_mlp) in zip(reference.layers, zip(weights[::2], weights[1::2])):
        post, comb, collapsed = layer["attn_hc"](hidden_states)
        attn_output = block(collapsed, w_attn)
        hidden_states = post.to(dtype).unsqueeze(-1) * attn_output.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), hidden_states
        )
        seen += [collapsed, hidden_states]
        post, comb, collapsed = layer["ffn_hc"](hidden_states)
        mlp_output = block(collapsed, w_mlp)
        hidden_states = post.to(dtype).unsqueeze(-1) * mlp_output.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), hidden_states
        )
        seen += [collapsed, hidden_states]
    return seen + [reference.hc_head(hidden_states)]


def run_ours(ours: Ours, embeds: torch.Tensor, weights: list[torch.Tensor]
             ) -> list[torch.Tensor]:
    seen = []
    streams = expand(embeds, N)
    for layer, w in zip([hc for lay in ours.layers for hc in (lay["attn_hc"], lay["ffn_hc"])],
                        weights):
        x, mix = layer.collapse(streams)
        streams = layer.update(streams, mix, block(x, w))
        seen += [x, streams]
    return seen + [ours.hc_head(streams)]


def inputs(dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    embeds = torch.randn(BATCH, SEQ, HIDDEN, generator=generator).to(dtype)
    weights = [torch.randn(HIDDEN, HIDDEN, generator=generator) / HIDDEN ** 0.5
               for _ in range(2 * LAYERS)]
    return embeds, weights


@pytest.mark.parametrize("iters", [3, DEFAULT_ITERS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streams_match_transformers(hf_names, iters, dtype):
    reference, ours, _ = build(iters, hf_names)
    embeds, weights = inputs(dtype)
    with torch.no_grad():
        expected = run_reference(reference, embeds, weights)
        got = run_ours(ours, embeds.flatten(0, 1), weights)
    assert torch.equal(expand(embeds.flatten(0, 1), N),
                       embeds.unsqueeze(2).expand(-1, -1, N, -1).flatten(0, 1))
    for step, (want, have) in enumerate(zip(expected, got)):
        want = want.flatten(0, 1)
        assert have.dtype == want.dtype == dtype and have.shape == want.shape
        if dtype == torch.float32:  # the CPU backend's one-call RMSNorm sums in another
            # order than torch's: float32 rounding at the streams' scale (~8), 1.5e-6 seen
            torch.testing.assert_close(have, want, rtol=1e-6, atol=1e-5, msg=f"step {step}")
        else:  # the same ops in the same order: at most one bf16 rounding apart
            torch.testing.assert_close(have.float(), want.float(), rtol=2 ** -7, atol=1e-5,
                                       msg=f"step {step}")


@pytest.mark.parametrize("iters", [3, DEFAULT_ITERS])
def test_gates_match_transformers(hf_names, iters):
    """post and comb themselves, on streams of unequal scale (not copies of one embedding)."""
    reference, ours, _ = build(iters, hf_names, seed=3)
    streams = torch.randn(BATCH, SEQ, N, HIDDEN, generator=torch.Generator().manual_seed(2))
    streams = streams * torch.tensor([0.5, 1.0, 2.0, 4.0]).view(1, 1, N, 1)
    with torch.no_grad():
        post, comb, collapsed = reference.layers[1]["ffn_hc"](streams)
        x, mix = ours.layers[1]["ffn_hc"].collapse(streams.flatten(0, 1))
    for have, want in ((x, collapsed), (mix.post, post), (mix.comb, comb)):
        assert have.dtype == torch.float32
        torch.testing.assert_close(have, want.flatten(0, 1), rtol=1e-6, atol=1e-6)
    # the gates are not trivial: the comb is far from uniform and the post far from 1
    assert (mix.comb - 1 / N).abs().max() > 0.1 and (mix.post - 1).abs().max() > 0.3


def test_sinkhorn_doubly_stochastic():
    """Sinkhorn ends on the columns: from 2 iterations on they sum to 1 however peaked the
    logits (after 1, a column of tiny softmax entries sums to s / (s + eps)). The rows only
    converge towards 1: within 1e-5 after the default iterations for logits of moderate
    spread; for peaked ones 20 iterations leave them a few percent off, in transformers too."""
    eps = transformers.DeepseekV4Config().hc_eps
    logits = torch.randn(4096, N, N, generator=torch.Generator().manual_seed(4))
    ones = torch.ones(4096, N)
    comb = sinkhorn(0.5 * logits, DEFAULT_ITERS, eps)
    torch.testing.assert_close(comb.sum(dim=-1), ones, rtol=0, atol=1e-5)
    torch.testing.assert_close(comb.sum(dim=-2), ones, rtol=0, atol=1e-5)
    assert (comb > 0).all() and (comb - 1 / N).abs().max() > 0.1
    for iters in (2, 3, DEFAULT_ITERS):
        columns = sinkhorn(3 * logits, iters, eps).sum(dim=-2)
        torch.testing.assert_close(columns, ones, rtol=0, atol=1e-5)


def test_release_names_map_like_transformers(hf_names):
    """DeepSeek's release names land where transformers' conversion mapping puts them."""
    renamings = [t for t in get_checkpoint_conversion_mapping("deepseek_v4")
                 if isinstance(t, WeightRenaming)]
    release = ["hc_head_fn", "hc_head_base", "hc_head_scale"] + [
        f"layers.{i}.hc_{site}_{p}" for i in range(LAYERS) for site in ("attn", "ffn")
        for p in ("fn", "base", "scale")]
    for name in release:
        renamed = name
        for renaming in renamings:
            renamed, _ = renaming.rename_source_key(renamed)
        assert "model." + renamed in hf_names
        assert hyper_target(name) == hyper_target("model." + renamed) == renamed
    for other in ("layers.0.attn.wq_a.weight", "model.norm.weight", "mtp.0.hc_attn_fn",
                  "model.layers.0.input_layernorm.weight", "embed.weight"):
        assert hyper_target(other) is None


def test_runner_load_keeps_float32():
    """As TorchRunner.load builds a model: on the meta device, to_empty, .to(bfloat16), the
    fp32_params restored, then the buffers made."""
    dims = HyperDims(HIDDEN, N, DEFAULT_ITERS, 1e-6, 1e-6)
    with torch.device("meta"):
        ours = Ours(dims)
    ours = ours.to_empty(device="cpu").to(torch.bfloat16)
    _restore_float32(ours)
    init_hyper_buffers(ours, "cpu")
    assert {p.dtype for p in ours.parameters()} == {torch.float32}
    units = [m.unit for m in ours.modules() if isinstance(m, (HyperConnection, HyperHead))]
    assert len(units) == 2 * LAYERS + 1
    assert all(torch.equal(unit, torch.ones(N * HIDDEN)) for unit in units)
