"""Architecture name (config.json "architectures") -> model class."""
from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from deepinfer.core.kv.spec import KVSpec

BUILTIN_MODELS: Mapping[str, str] = MappingProxyType({
    "LlamaForCausalLM": "deepinfer.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "deepinfer.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "deepinfer.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "deepinfer.models.llama:LlamaForCausalLM",
    "Qwen3MoeForCausalLM": "deepinfer.models.llama:LlamaForCausalLM",
    "MixtralForCausalLM": "deepinfer.models.llama:LlamaForCausalLM",
    "DeepseekV2ForCausalLM": "deepinfer.models.deepseek_v3:DeepseekV3ForCausalLM",
    "DeepseekV3ForCausalLM": "deepinfer.models.deepseek_v3:DeepseekV3ForCausalLM",
    "DeepseekV4ForCausalLM": "deepinfer.models.deepseek_v4.model:DeepseekV4ForCausalLM",
})


def model_class(architecture: str, extra: Mapping[str, str] | None = None) -> type[Any]:
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


def kv_spec_of(path: str) -> "KVSpec":
    """The KV spec of the checkpoint at `path`, from its config alone (the model is built on
    the meta device: no weights are read or allocated)."""
    import torch

    from deepinfer.models.hf_config import architecture, load_config

    config = load_config(path)
    with torch.device("meta"):
        model = model_class(architecture(config))(config, None, 1)
    return model.kv_spec()


def has_experts(path: str) -> bool:
    """Whether the checkpoint at `path` has MoE layers."""
    return expert_count(path) > 0


def expert_count(path: str) -> int:
    """Routed experts per MoE layer of the checkpoint at `path` (from its config alone, as
    kv_spec_of); 0 for a dense model or anything that is not a checkpoint folder we can read."""
    import torch

    from deepinfer.models.hf_config import architecture, load_config

    try:
        config = load_config(path)
        with torch.device("meta"):
            model = model_class(architecture(config))(config, None, 1)
    except (OSError, ValueError):
        return 0
    return 0 if model.moe is None else model.moe.num_experts
