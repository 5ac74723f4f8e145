"""DeepSeek-V3 MoE on the CUDA backend with its kernels under Triton's interpreter: the two
shared experts run as two slots of the fused MoE (DEEPINFER_CUDA_FUSED_SHARED_EXPERTS=1), in a
prefill (the grouped GEMMs) and in one-token decode steps (the MoE GEMV), against
transformers."""
from __future__ import annotations

import os

import pytest
import torch
import transformers

from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec
from deepinfer.core.engine import Engine
from deepinfer.core.sampling import SamplingParams
from deepinfer.models.moe.layer import MoEBlock
from tests.backends.cuda.test_backend_interpreted import _greedy_round, _interpreted_cls
from tests.checkpoints import make_checkpoint

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs the kernels under Triton's CPU interpreter")


def test_shared_experts_in_the_fused_moe_equal_transformers(tmp_path, monkeypatch):
    from deepinfer.backends.cuda import ops as cuda_ops
    from deepinfer.backends.cuda.settings import CudaSettings

    monkeypatch.setattr(cuda_ops, "cuda_settings", lambda: CudaSettings(fused_shared_experts=True))
    path = make_checkpoint(str(tmp_path / "m"), "deepseek_v3_moe", torch.float32,
                           n_shared_experts=2, vocab_size=128, eos_token_id=127,
                           intermediate_size=64)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 127, (n,), generator=g).tolist() for n in (7, 30)]
    new = 3
    expected = [model.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]
    config = EngineConfig(model=ModelSpec(path, dtype="float32"),
                          cache=CacheConfig(block_size=16, num_blocks=16))
    engine = Engine(config, accelerator=_interpreted_cls()(), load_tokenizer=False)
    blocks = [m for m in engine.accelerator.runner.model.modules() if isinstance(m, MoEBlock)]
    assert blocks and all(b.shared_slots == 2 and b.shared_experts is None for b in blocks)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    assert _greedy_round(engine, prompts, params, 0) == expected
    engine.shutdown()
