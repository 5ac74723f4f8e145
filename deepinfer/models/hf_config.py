"""A checkpoint's config.json through transformers.AutoConfig, and the facts the engine reads
from it: end-of-sequence ids, the context length, the weights' dtype."""
from __future__ import annotations

import json
import os
from typing import Any

from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def load_config(path: str) -> PretrainedConfig:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path} has no config.json: not an HF checkpoint folder")
    return AutoConfig.from_pretrained(path)


def architecture(config: PretrainedConfig) -> str:
    """config.json's "architectures"[0]; a config without it (one written by a config class's
    save_pretrained) names its model_type, whose causal-LM class transformers knows."""
    named = getattr(config, "architectures", None)
    if named:
        return named[0]
    model_type = getattr(config, "model_type", "")
    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if causal_lm is None:
        raise ValueError(f"config.json names no architecture and its model_type {model_type!r} "
                         "has no causal-LM class; add \"architectures\" to it")
    return causal_lm


def eos_token_ids(config: PretrainedConfig, path: str) -> tuple[int, ...]:
    """config.json's EOS ids plus generation_config.json's (end-of-turn tokens live there)."""
    ids = _as_tuple(getattr(config, "eos_token_id", None))
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            ids += _as_tuple(json.load(f).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


def max_model_len(config: PretrainedConfig, requested: int | None) -> int:
    """The one rule: the requested length, else the checkpoint's max_position_embeddings
    (already the extended length for rope-scaled checkpoints). A sliding window does not cap
    it: windowed layers attend to the last W tokens of any length."""
    trained = int(getattr(config, "max_position_embeddings", None) or 4096)
    if requested is None:
        return trained
    if requested < 1:
        raise ValueError(f"max_model_len must be >= 1, got {requested}")
    if requested > trained:
        raise ValueError(f"max_model_len {requested} exceeds the model's "
                         f"max_position_embeddings {trained}")
    return requested


def checkpoint_dtype(config: PretrainedConfig) -> str:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    return str(dtype).removeprefix("torch.")


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
