"""Rotary embedding tables (default, linear, llama3, yarn), computed once per model.

Backends receive a cos/sin cache indexed by position; the maths follows the published scaling
rules so that positions beyond the original context match the reference implementations.
"""
from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(params: dict[str, Any], head_dim: int,
                  max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [head_dim/2], attention_scaling) for a rope_parameters dict."""
    base = float(params.get("rope_theta", 10000.0))
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = params.get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / params["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, params), 1.0
    if kind == "yarn":
        return _yarn(params, dim, base, max_position_embeddings)
    raise ValueError(f"unsupported rope_type {kind!r}")


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(p: dict[str, Any], dim: int, base: float,
          max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def rope_cos_sin(params: dict[str, Any], head_dim: int, max_position_embeddings: int,
                 max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables of shape [max_len, rotary_dim] (halves duplicated, NeoX layout)."""
    inv_freq, scaling = rope_inv_freq(params, head_dim, max_position_embeddings)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling
