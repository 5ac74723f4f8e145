"""Tiny random-weight checkpoints written by transformers itself (the independent reference)."""
from __future__ import annotations

from typing import Callable

import torch


def checkpoint_cache(tmp_path_factory, make: Callable[[str, str], str]) -> Callable[[str], str]:
    """name -> path of `make(folder, name)`, written once (for a module-scoped fixture)."""
    paths: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in paths:
            paths[name] = make(str(tmp_path_factory.mktemp(name)), name)
        return paths[name]
    return get


def make_checkpoint(path: str, family: str = "llama", dtype: torch.dtype = torch.float32,
                    **overrides) -> str:
    """Save a random-weight transformers model of the given family to `path`."""
    import transformers

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  max_position_embeddings=512, initializer_range=0.1, eos_token_id=255,
                  bos_token_id=1, tie_word_embeddings=False)
    common.update(overrides)
    if family == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif family == "qwen3":
        config = transformers.Qwen3Config(head_dim=32, **common)
        cls = transformers.Qwen3ForCausalLM
    elif family == "qwen2":
        config = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    elif family == "deepseek_v3":  # MLA attention, every layer dense (MoE comes later)
        mla = dict(num_key_value_heads=common["num_attention_heads"], q_lora_rank=64,
                   kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                   first_k_dense_replace=common["num_hidden_layers"], n_routed_experts=4,
                   num_experts_per_tok=2)
        config = transformers.DeepseekV3Config(**{**common, **mla, **overrides})
        cls = transformers.DeepseekV3ForCausalLM
    elif family == "qwen3_moe":  # layer 0 dense (mlp_only_layers), the rest MoE
        moe = dict(head_dim=32, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                   norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=1)
        config = transformers.Qwen3MoeConfig(**{**common, **moe, **overrides})
        cls = transformers.Qwen3MoeForCausalLM
    elif family == "mixtral":
        config = transformers.MixtralConfig(**{**common, "intermediate_size": 32,
                                               "num_local_experts": 4, "num_experts_per_tok": 2,
                                               **overrides})
        cls = transformers.MixtralForCausalLM
    elif family == "deepseek_v3_moe":  # MLA, layer 0 dense, then MoE with shared experts
        moe = dict(num_key_value_heads=common["num_attention_heads"], q_lora_rank=32,
                   kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                   first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2,
                   routed_scaling_factor=2.5, norm_topk_prob=True)
        config = transformers.DeepseekV3Config(**{**common, **moe, **overrides})
        cls = transformers.DeepseekV3ForCausalLM
    elif family == "mistral":
        config = transformers.MistralConfig(**common)
        cls = transformers.MistralForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(0)
    model = cls(config).to(dtype).eval()
    if family == "deepseek_v3_moe":  # transformers initialises the bias to zeros: make it count
        for layer in model.model.layers[config.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return path
