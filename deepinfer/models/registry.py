"""Architecture name (config.json "architectures") -> model class."""
from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import Mapping

BUILTIN_MODELS: Mapping[str, str] = MappingProxyType({
    "LlamaForCausalLM": "deepinfer.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "deepinfer.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "deepinfer.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "deepinfer.models.llama:LlamaForCausalLM",
})


def model_class(architecture: str, extra: Mapping[str, str] | None = None) -> type:
    """Resolve a model class; `extra` holds plugin-registered architectures."""
    if extra is None and architecture not in BUILTIN_MODELS:
        from deepinfer.core.plugins import load_plugins

        extra = load_plugins().models()
    table = {**BUILTIN_MODELS, **(extra or {})}
    if architecture not in table:
        raise ValueError(f"unsupported architecture {architecture!r}; "
                         f"supported: {', '.join(sorted(table))}")
    module, _, name = table[architecture].partition(":")
    return getattr(importlib.import_module(module), name)
