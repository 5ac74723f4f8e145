"""Build a model from an HF folder and load its safetensors weights into it."""
from __future__ import annotations

import glob
import os
import re
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from deepinfer.models.model_config import ModelConfig

if TYPE_CHECKING:
    from deepinfer.core.config import ModelSpec

# checkpoint name pattern -> (our parameter name, fused shard index or None)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_RENAMES = {
    "input_layernorm.weight": "input_layernorm",
    "post_attention_layernorm.weight": "post_attention_layernorm",
    "self_attn.q_norm.weight": "self_attn.q_norm",
    "self_attn.k_norm.weight": "self_attn.k_norm",
}


def resolve_dtype(name: str, cfg: ModelConfig) -> torch.dtype:
    name = cfg.torch_dtype if name == "auto" else name
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(table)}")
    return table[name]


def iter_checkpoint(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _shard_slices(cfg: ModelConfig, fused: str) -> list[tuple[int, int]]:
    if "qkv_proj" in fused:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
    f = cfg.intermediate_size
    return [(0, f), (f, 2 * f)]


def map_name(name: str) -> tuple[str, int | None] | None:
    """Checkpoint tensor name -> (parameter name in our model, fused shard), None to skip."""
    name = name.removeprefix("model.")
    if name.startswith("lm_head."):
        return name, None
    if name == "norm.weight":
        return "norm", None
    match = re.match(r"layers\.(\d+)\.(.+)", name)
    if not match:
        return name, None
    prefix, rest = f"layers.{match.group(1)}.", match.group(2)
    if rest in _RENAMES:
        return prefix + _RENAMES[rest], None
    module, _, kind = rest.rpartition(".")
    if module in _FUSED:
        target, shard = _FUSED[module]
        return f"{prefix}{target}.{kind}", shard
    if "rotary_emb" in rest:
        return None
    return prefix + rest, None


def load_weights(model: nn.Module, cfg: ModelConfig, path: str,
                 progress: Callable[[str], None] | None = None) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for ckpt_name, tensor in iter_checkpoint(path):
        mapped = map_name(ckpt_name)
        if mapped is None or (cfg.tie_word_embeddings and mapped[0].startswith("lm_head")):
            continue
        target, shard = mapped
        if target not in params:
            raise KeyError(f"checkpoint tensor {ckpt_name!r} has no place in the model")
        param = params[target]
        with torch.no_grad():
            if shard is None:
                param.copy_(tensor)
            else:
                start, end = _shard_slices(cfg, target)[shard]
                param[start:end].copy_(tensor)
        loaded.add(target)
        if progress:
            progress(ckpt_name)
    missing = set(params) - loaded
    if missing:
        raise KeyError(f"checkpoint lacks weights for: {sorted(missing)[:8]}")


def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights in place, made where the model lives: norm scales 1, the rest N(0, std).

    For benchmarks of a model shape (`load_format="dummy"`): the step costs the same as with
    the real checkpoint, and a 16 GB model needs no 16 GB download."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and "norm" in name:
                param.fill_(1.0)
            elif param.dim() == 1:  # biases
                param.zero_()
            else:
                param.normal_(0.0, std, generator=generator)


def build_model(cfg: ModelConfig, ops: object, spec: "ModelSpec", max_len: int,
                device: torch.device | str, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """The model of `spec` on `device`, ready to run.

    Built on the meta device first, so no time goes into random init of weights that are then
    overwritten; weights are the checkpoint's, or random ones made on the device for
    load_format "dummy". Rotary tables are computed, not loaded, and stay float32."""
    from deepinfer.models.registry import model_class
    from deepinfer.models.rope import rope_cos_sin

    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg, ops, max_len)
    model = model.to_empty(device=device).to(dtype)
    if spec.load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        load_weights(model, cfg, spec.path)
    cos, sin = rope_cos_sin(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, max_len)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    return model.eval()


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block (K and V of block_size tokens) across every layer."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem
