"""The subset of an HF config.json the llama-family model needs, normalised across families."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "smollm2")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str = "float32"
    sliding_window: int | None = None

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        return cls.from_dict(raw, _generation_eos(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], extra_eos: tuple[int, ...] = ()) -> "ModelConfig":
        model_type = raw.get("model_type", "llama")
        heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        return cls(
            architecture=(raw.get("architectures") or ["LlamaForCausalLM"])[0],
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 has q/k/v biases without saying so in older configs.
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            rope=_rope_parameters(raw),
            eos_token_ids=_as_tuple(raw.get("eos_token_id")) + extra_eos,
            bos_token_id=raw.get("bos_token_id"),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            sliding_window=_active_sliding_window(raw),
        )


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 writes rope_parameters; older checkpoints rope_theta + rope_scaling."""
    params = dict(raw.get("rope_parameters") or {})
    if not params:
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    params.setdefault("original_max_position_embeddings",
                      raw.get("original_max_position_embeddings"))
    return params


def _active_sliding_window(raw: dict[str, Any]) -> int | None:
    window = raw.get("sliding_window")
    if window is None or raw.get("use_sliding_window") is False:
        return None
    return int(window)


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _generation_eos(path: str) -> tuple[int, ...]:
    gen_path = os.path.join(path, "generation_config.json")
    if not os.path.exists(gen_path):
        return ()
    with open(gen_path) as f:
        return _as_tuple(json.load(f).get("eos_token_id"))
