"""Models declare the op mixins they need (ModelTraits.ops), and the runner refuses, at load and
before any weight is read, a backend whose ops lack one: the error names the mixin and the
backend. Only config.json is written: the check runs on the meta-device build, before the
weights are read."""
import pytest
import torch
import transformers

from deepinfer.backends.cpu.ops import CPUOps
from deepinfer.backends.neuron.ops import NeuronOps
from deepinfer.backends.torch.ops import ReferenceMLAOps, ReferenceOps
from deepinfer.backends.torch.runner import TorchRunner, check_ops
from deepinfer.core.accelerator import Capabilities
from deepinfer.core.config import ModelSpec
from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM
from deepinfer.models.deepseek_v4.ops import DeepSeekV4Ops
from deepinfer.models.llama import LlamaForCausalLM
from deepinfer.models.mla_ops import MLAOps
from deepinfer.models.moe.ops import MoEOps
from deepinfer.models.traits import ModelTraits, missing_ops

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
MOE = dict(head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)


class DenseOnlyOps(ReferenceOps):
    """A backend's ops that run dense models only: no MoEOps."""


def _config_only(path, config) -> str:
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    config.save_pretrained(str(path))
    return str(path)


def _load(ops, path: str, backend: str = "fake"):
    return TorchRunner("cpu", Capabilities(), ops, backend=backend).load(ModelSpec(path))


def test_a_moe_model_on_ops_without_moe_ops_is_refused(tmp_path):
    path = _config_only(tmp_path, transformers.Qwen3MoeConfig(**MOE, **SMALL))
    with pytest.raises(ValueError) as refused:
        _load(DenseOnlyOps, path)
    assert str(refused.value) == \
        "Qwen3MoeForCausalLM needs MoEOps, which backend 'fake' does not provide"


def test_deepseek_v4_on_ops_without_the_v4_mixin_names_it():
    moe_mla = type("MoEAndMLA", (MoEOps, ReferenceMLAOps, ReferenceOps), {})
    ops = moe_mla.__new__(moe_mla)  # what check_ops reads is the class
    with pytest.raises(ValueError, match="^DeepseekV4ForCausalLM needs DeepSeekV4Ops, which "
                                         "backend 'moe-mla' does not provide$"):
        check_ops("DeepseekV4ForCausalLM", DeepseekV4ForCausalLM.traits, ops, "moe-mla")


def test_a_llama_needs_moe_ops_only_with_experts():
    with torch.device("meta"):
        dense = LlamaForCausalLM(transformers.LlamaConfig(**SMALL), None, 64)
        moe = LlamaForCausalLM(transformers.Qwen3MoeConfig(**MOE, **SMALL), None, 64)
    assert dense.traits.ops == () and moe.traits.ops == (MoEOps,)


def test_backends_declare_the_mixins_they_run():
    every = ModelTraits(ops=(MoEOps, MLAOps, DeepSeekV4Ops))
    assert missing_ops(every, CPUOps.__new__(CPUOps)) == []
    assert missing_ops(every, NeuronOps.__new__(NeuronOps)) == []
    assert missing_ops(every, ReferenceOps.__new__(type("MLAOnly", (ReferenceMLAOps,
                                                                    ReferenceOps), {}))) \
        == [MoEOps, DeepSeekV4Ops]
