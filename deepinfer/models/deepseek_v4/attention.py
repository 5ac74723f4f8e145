"""DeepSeek-V4 attention: its projections, a reference of its attention math, its output.

Equal to transformers' `DeepseekV4Attention` (models/deepseek_v4/modeling_deepseek_v4.py,
5.24; "L<n>" below are its line numbers), split where an engine splits it:

- `project(hidden, positions)`: q [T, heads, D] and the one shared K=V head kv [T, D], both
  roped. q = q_b_norm(q_b_proj(q_a_norm(q_a_proj(h)))) (L827-829), kv = kv_norm(kv_proj(h))
  (L832); rope rotates the *trailing* rope_dim channels of each head, in interleaved pairs
  (L346-370), at the token's position (L830, L833).
- `attend(...)`: one sequence's attention over an explicit key set, what a backend op does
  over paged storage: the sliding-window keys plus the compressed entries the query may see;
  scores scaled by head_dim**-0.5, a per-head sink logit joins the softmax and is dropped
  (L739-753). Keys are the values (shared-KV MQA, L789, L858-862).
- `output(attn, positions)`: the rope slice of each head's output is rotated back by its
  query's position (cos, -sin: L877), then the grouped output projection: heads in o_groups
  groups, each group to o_lora_rank by its own block of o_a_proj (L314-343), then o_b_proj
  (L879-881).

Sliding layers rope with config.rope_parameters["main"] (rope_theta); CSA / HCA layers with
["compress"] (compress_rope_theta, yarn if configured) for q, kv and their compressed entries
alike (L785-787, L1364-1367).

Parameters carry transformers' names, so its `self_attn.*` state dict (less `compressor.*`)
loads as is. DeepSeek's own checkpoint (through transformers' conversion_mapping.py) names
them, under `layers.N.attn.`: wq_a -> q_a_proj, q_norm -> q_a_norm, wq_b -> q_b_proj,
wkv -> kv_proj, kv_norm -> kv_norm, wo_a -> o_a_proj, wo_b -> o_b_proj, attn_sink -> sinks.
The norms and sinks stay float32 (transformers' _keep_in_fp32_modules_strict).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from deepinfer.models.traits import Float32Params

SLIDING = "sliding_attention"


@dataclass(frozen=True)
class V4AttentionDims:
    """The config fields one V4 attention layer reads."""

    hidden_size: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    rms_norm_eps: float
    layer_type: str
    compress_rate: int | None  # source tokens per compressed entry; None on sliding layers

    @classmethod
    def from_config(cls, config: PretrainedConfig, layer: int) -> "V4AttentionDims":
        layer_type = config.layer_types[layer]
        rate = None if layer_type == SLIDING else config.compress_rates[layer_type]
        return cls(
            hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
            head_dim=config.head_dim, rope_dim=config.qk_rope_head_dim,
            q_lora_rank=config.q_lora_rank, o_groups=config.o_groups,
            o_lora_rank=config.o_lora_rank, sliding_window=config.sliding_window,
            rms_norm_eps=config.rms_norm_eps, layer_type=layer_type, compress_rate=rate)

    @property
    def rope_label(self) -> str:
        return "main" if self.layer_type == SLIDING else "compress"

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5


# ---- rope ---------------------------------------------------------------------------------
def rope_inv_freq(config: PretrainedConfig, label: str) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rope_dim / 2], cos/sin scaling) of rope_parameters[label]
    ("main" or "compress"), as DeepseekV4RotaryEmbedding builds them (L100-139)."""
    params = config.rope_parameters[label]
    kind = params.get("rope_type", "default")
    if kind != "default":
        # The V4 config pins yarn's attention_factor to 1.0, so the scaling is 1 there too.
        freqs, scaling = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"), layer_type=label)
        return freqs.float(), float(scaling)
    dim = int(config.head_dim * params.get("partial_rotary_factor", 1.0))
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    return 1.0 / (float(params["rope_theta"]) ** exponents), 1.0


def rope_cos_sin(inv_freq: torch.Tensor, scaling: float, positions: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rope_dim / 2], one per interleaved pair; computed in float32 and cast to
    the activations' dtype, as transformers hands them to the layers (L150-153)."""
    angles = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    return (angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] channels of x [T, ..., D] in interleaved pairs
    (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin), in float32; the leading channels pass."""
    rope_dim = 2 * cos.shape[-1]
    extra = (1,) * (x.dim() - 2)  # broadcast cos/sin [T, R/2] over any head dims
    cos = cos.view(cos.shape[0], *extra, -1).float()
    sin = sin.view(sin.shape[0], *extra, -1).float()
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
    return torch.cat((nope, rotated.flatten(-2).to(x.dtype)), dim=-1)


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
         inverse: bool = False) -> torch.Tensor:
    """x [T, ..., D] roped at positions [T] (inverse: rotated back, sin negated): the reference
    of DeepSeekV4Ops.interleaved_rope."""
    cos, sin = rope_cos_sin(inv_freq, scaling, positions, x.dtype)
    return apply_rope(x, cos, -sin if inverse else sin)


class UsesOps:
    """A V4 module whose rope and norms go to the backend's ops once the model binds them
    (the model sets `ops` on each); standalone (the component tests) it runs the reference."""

    ops: Any = None  # models.ops.ModelOps; None: the reference

    def linear(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """layer(x) through the backend's projection (a GEMV for one token on CUDA)."""
        return layer(x) if self.ops is None else self.ops.linear(x, layer.weight)

    def roped(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
              scaling: float, inverse: bool = False) -> torch.Tensor:
        """`rope` through DeepSeekV4Ops.interleaved_rope."""
        if self.ops is None:
            return rope(x, positions, inv_freq, scaling, inverse)
        return self.ops.interleaved_rope(x, positions, inv_freq, scaling, inverse)

    def normed(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """`v4_rms_norm` through DeepSeekV4Ops.v4_rms_norm."""
        if self.ops is None:
            return v4_rms_norm(x, weight, eps)
        return self.ops.v4_rms_norm(x, weight, eps)


# ---- norms --------------------------------------------------------------------------------
def v4_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The reference of DeepSeekV4Ops.v4_rms_norm: RMSNorm.forward with a weight,
    unweighted_rms_norm without."""
    if weight is None:
        return unweighted_rms_norm(x, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


class RMSNorm(UsesOps, Float32Params, nn.Module):
    """V4's weighted RMSNorm (DeepseekV4RMSNorm, L55-61): a float32 weight, float32 statistics
    *and* weight product, cast once at the end (the CPU op casts before the weight). Every V4
    norm with a weight: the layers', the model's, q_a/kv norms, the compressors' kv norms."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normed(x, self.weight, self.eps)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """q_b_norm: the float32 reciprocal rms, multiplied in x's dtype (L72-73)."""
    inv = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)
    return x * inv.to(x.dtype)


# ---- the layer ----------------------------------------------------------------------------
class V4Attention(UsesOps, Float32Params, nn.Module):
    """One V4 attention layer's parameters, its projections and its output; the attention
    in between is `attend` (the backend op's reference). Compressor weights live elsewhere."""

    def __init__(self, config: PretrainedConfig, layer: int) -> None:
        super().__init__()
        self.dims = d = V4AttentionDims.from_config(config, layer)
        self.q_a_proj = nn.Linear(d.hidden_size, d.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(d.q_lora_rank, d.rms_norm_eps)
        self.q_b_proj = nn.Linear(d.q_lora_rank, d.num_heads * d.head_dim, bias=False)
        self.kv_proj = nn.Linear(d.hidden_size, d.head_dim, bias=False)
        self.kv_norm = RMSNorm(d.head_dim, d.rms_norm_eps)
        # Row block g of o_a_proj projects head group g (DeepseekV4GroupedLinear's layout).
        group_in = d.num_heads * d.head_dim // d.o_groups
        self.o_a_proj = nn.Linear(group_in, d.o_groups * d.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(d.o_groups * d.o_lora_rank, d.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(d.num_heads, dtype=torch.float32))
        inv_freq, self.rope_scaling = rope_inv_freq(config, d.rope_label)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False
             ) -> torch.Tensor:
        return self.roped(x, positions, self.inv_freq, self.rope_scaling, inverse)

    def q_residual(self, hidden: torch.Tensor) -> torch.Tensor:
        """q_a_norm(q_a_proj(h)) [T, q_lora_rank]; CSA's indexer reads it too (L840)."""
        return self.q_a_norm(self.linear(self.q_a_proj, hidden))

    def project(self, hidden: torch.Tensor, positions: torch.Tensor,
                q_residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H], positions [T] -> (q [T, heads, D], kv [T, D]), roped. q_residual:
        this hidden's `q_residual`, if the caller already has it."""
        d = self.dims
        if q_residual is None:
            q_residual = self.q_residual(hidden)
        q = self.linear(self.q_b_proj, q_residual).view(-1, d.num_heads, d.head_dim)
        q = self.rope(self.normed(q, None, d.rms_norm_eps), positions)
        kv = self.kv_norm(self.linear(self.kv_proj, hidden))
        return q, self.rope(kv, positions)

    def output(self, attn: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """attn [T, heads, D] -> [T, H]: undo the values' rope at the query's position, then
        the grouped output projection."""
        d = self.dims
        # Values carry their own position's rope (K=V); the conjugate rotation at the query's
        # position leaves a function of the relative distance.
        attn = self.rope(attn, positions, inverse=True)
        groups = attn.reshape(attn.shape[0], d.o_groups, -1)
        weight = self.o_a_proj.weight.view(d.o_groups, d.o_lora_rank, -1)
        mixed = torch.einsum("tgi,gri->tgr", groups, weight)
        return self.linear(self.o_b_proj, mixed.flatten(1))


# ---- the attention itself (reference for the backend op) ----------------------------------
# Score elements (queries x heads x keys) one block of queries may hold: a long prefill chunk
# (8K queries, 64 heads, a 24K-key CSA layer at 64K context: 51 GB of float32 scores) is
# attended in blocks of queries that each fit in ~1 GiB.
MAX_SCORES = 1 << 28
# Queries a block holds at most: its windows span QUERY_BLOCK + window - 1 keys, so a long
# chunk scores each query against about twice its window instead of the whole chunk.
QUERY_BLOCK = 256


def attend(q: torch.Tensor, positions: torch.Tensor, window_kv: torch.Tensor,
           window_positions: torch.Tensor, compressed_kv: torch.Tensor | None,
           compressed_visible: torch.Tensor | None, sinks: torch.Tensor, window: int,
           scale: float, picks: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's V4 attention. q [T, heads, D] at consecutive positions [T];
    window_kv [K, D] the cached K=V entries at consecutive window_positions [K] (any run that
    covers the queries' windows: query p sees key k iff p - window < k <= p, L90-99 of
    masking_utils); compressed_kv [N, D] the layer's compressed entries, and which of them
    each query sees: compressed_visible [T, N] (`entries_visible`, HCA) or picks [T, k]
    (CSA: the indexer's entry numbers, -1 none; the same set `selected_visible` marks,
    gathered per query instead of masking all N). sinks [heads]: a logit per head in every
    softmax denominator. Returns [T, heads, D] in q's dtype."""
    seen = picks.shape[1] if picks is not None else \
        (0 if compressed_kv is None else compressed_kv.shape[0])
    heads, t = q.shape[1], q.shape[0]
    rows = max(1, min(QUERY_BLOCK, MAX_SCORES // (heads * (QUERY_BLOCK + window + seen))))
    if t <= rows:
        return _attend_block(q, positions, window_kv, window_positions, compressed_kv,
                             compressed_visible, picks, sinks, window, scale)
    p0, k0 = torch.stack((positions[0], window_positions[0])).tolist()
    blocks = []
    for i in range(0, t, rows):
        j = min(t, i + rows)
        keys = slice(max(0, p0 + i - window + 1 - k0), p0 + j - k0)  # the block's windows
        blocks.append(_attend_block(
            q[i:j], positions[i:j], window_kv[keys], window_positions[keys], compressed_kv,
            _rows(compressed_visible, i, j), _rows(picks, i, j), sinks, window, scale))
    return torch.cat(blocks)


def _rows(x: torch.Tensor | None, i: int, j: int) -> torch.Tensor | None:
    return None if x is None else x[i:j]


def _attend_block(q: torch.Tensor, positions: torch.Tensor, window_kv: torch.Tensor,
                  window_positions: torch.Tensor, compressed_kv: torch.Tensor | None,
                  compressed_visible: torch.Tensor | None, picks: torch.Tensor | None,
                  sinks: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    rel = positions[:, None] - window_positions[None, :]
    scores = [_masked(torch.einsum("thd,kd->thk", q, window_kv) * scale,
                      (rel >= 0) & (rel < window))]
    values = [window_kv]
    if picks is not None and picks.shape[1] > 0:
        gathered = compressed_kv[picks.clamp(min=0)].to(window_kv.dtype)  # [T, k, D]
        scores.append(_masked(torch.einsum("thd,tkd->thk", q, gathered) * scale, picks >= 0))
        values.append(gathered)
    elif compressed_visible is not None and compressed_kv.shape[0] > 0:
        entries = compressed_kv.to(window_kv.dtype)
        scores.append(_masked(torch.einsum("thd,kd->thk", q, entries) * scale,
                              compressed_visible))
        values.append(entries)
    # Sinks are float32: the softmax runs in float32 whatever q's dtype, as in transformers.
    sink = sinks.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
    logits = torch.cat([s.float() for s in scores] + [sink], dim=-1)
    # The max shift is transformers' (L749); it also keeps low precision from overflowing.
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1)[..., :-1].to(window_kv.dtype)
    out, start = None, 0
    for value in values:  # each part's weighted sum, added in float32, rounded once
        width = value.shape[-2]
        pattern = "thk,kd->thd" if value.dim() == 2 else "thk,tkd->thd"
        part = torch.einsum(pattern, probs[..., start:start + width], value).float()
        out, start = part if out is None else out + part, start + width
    return out.to(q.dtype)


def _masked(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """scores [T, heads, K] with -inf where visible [T, K] is False."""
    return scores.masked_fill(~visible[:, None, :], float("-inf"))


def entries_visible(positions: torch.Tensor, n_entries: int, rate: int) -> torch.Tensor:
    """[T, N]: entry w (source tokens up to (w + 1) * rate - 1) is visible to position p iff
    w < (p + 1) // rate, its last source token at or before p (HCA: L447-454; the same
    threshold bounds CSA's picks, L589-595)."""
    threshold = torch.div(positions + 1, rate, rounding_mode="floor")
    return torch.arange(n_entries, device=positions.device)[None, :] < threshold[:, None]


def selected_visible(top_k: torch.Tensor, n_entries: int) -> torch.Tensor:
    """CSA: the indexer's picks top_k [T, k] (-1: none, already causally bounded) -> [T, N]
    visibility, as CSA's block bias builds it (L705-712)."""
    valid = top_k >= 0
    slots = torch.where(valid, top_k, torch.full_like(top_k, n_entries))
    mask = torch.zeros(top_k.shape[0], n_entries + 1, dtype=torch.bool, device=top_k.device)
    mask.scatter_(1, slots, True)
    return mask[:, :n_entries]
