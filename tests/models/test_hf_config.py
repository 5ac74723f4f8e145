"""Which model a config.json builds: its "architectures", else its model_type's causal-LM class
(a config written by a config class's save_pretrained has no "architectures")."""
from __future__ import annotations

import json

import pytest
import transformers

from deepinfer.models.hf_config import architecture, load_config
from deepinfer.models.registry import expert_count

TINY_V3 = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
               kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
               vocab_size=256, first_k_dense_replace=1, n_routed_experts=16, n_shared_experts=1,
               num_experts_per_tok=2, n_group=4, topk_group=2)


@pytest.mark.parametrize("cls, values, expected, experts", [
    ("DeepseekV3Config", TINY_V3, "DeepseekV3ForCausalLM", 16),
    ("Qwen3MoeConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, num_experts=8, vocab_size=256),
     "Qwen3MoeForCausalLM", 8),
    ("LlamaConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         vocab_size=256), "LlamaForCausalLM", 0),
])
def test_a_config_without_architectures_builds_its_model_type(tmp_path, cls, values, expected,
                                                              experts):
    getattr(transformers, cls)(**values).save_pretrained(tmp_path)
    assert "architectures" not in json.loads((tmp_path / "config.json").read_text())
    assert architecture(load_config(str(tmp_path))) == expected
    assert expert_count(str(tmp_path)) == experts


def test_architectures_in_the_config_come_first(tmp_path):
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      vocab_size=256, architectures=["MistralForCausalLM"])
    config.save_pretrained(tmp_path)
    assert architecture(load_config(str(tmp_path))) == "MistralForCausalLM"


def test_a_model_type_without_a_causal_lm_is_refused():
    config = transformers.ViTConfig()
    with pytest.raises(ValueError, match="names no architecture"):
        architecture(config)
