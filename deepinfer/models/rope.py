"""Rotary embedding tables, computed once per model with transformers' own rope init
functions (default, linear, llama3, yarn with DeepSeek's mscale, ...), so positions beyond
the original context match the reference implementations exactly."""
from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def rope_parameters(config: PretrainedConfig) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    return dict(params or {})


def inv_freq(config: PretrainedConfig, rotary_dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2], attention scaling) of the config's rope type."""
    params = rope_parameters(config)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        base = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        return 1.0 / (base ** exponents), 1.0
    if kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {kind!r}")
    freqs, scaling = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"))
    return freqs.float(), float(scaling)


def rope_cos_sin(config: PretrainedConfig, rotary_dim: int,
                 max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables of shape [max_len, rotary_dim] (halves duplicated, NeoX layout), float32."""
    freqs, scaling = inv_freq(config, rotary_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), freqs)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling
