"""Shared experts run as slots of the fused MoE (MoEOps.fuses_shared_experts): a shared expert
of n experts' width loads, split, into n slots past the routed ones that every token takes with
weight 1. On the CPU backend with the trait on, against transformers on the same checkpoint
(DeepSeek-V3 MoE with one and with two shared experts, float and FP8), and the checkpoint
tensor's split (quant.tensors.narrow) against plain slicing."""
from __future__ import annotations

import pytest
import torch
import transformers

from deepinfer.backends.cpu.ops import CPUOps
from deepinfer.models.moe.layer import MoEBlock
from deepinfer.models.quant.tensors import FP8BlockTensor, RowScaledFP8, narrow
from tests.checkpoints import _block_quantize, make_checkpoint, write_fp8_checkpoint
from tests.models.test_moe_parity import _prefill_logits, _prompts

# Two scale groups per row of every projection, so FP8 parts split on a block boundary.
FP8_DIMS = dict(hidden_size=256, moe_intermediate_size=128, intermediate_size=256)


@pytest.fixture
def fused(monkeypatch):
    monkeypatch.setattr(CPUOps, "fuses_shared_experts", True)


def _logits_and_blocks(path: str) -> tuple[torch.Tensor, list[MoEBlock], torch.Tensor]:
    """Our prefill logits, the model's MoE blocks, transformers' logits for the same prompt."""
    from deepinfer.backends.cpu.accelerator import CPUAccelerator

    prompt = _prompts((29,))[0]
    blocks: list[MoEBlock] = []
    original = CPUAccelerator.load_model

    def load_model(self, spec):  # keeps the model's blocks to look at
        original(self, spec)
        blocks.extend(m for m in self.runner.model.modules() if isinstance(m, MoEBlock))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CPUAccelerator, "load_model", load_model)
        ours = _prefill_logits(path, prompt)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        expected = reference.eval()(torch.tensor([prompt])).logits[0].float()
    return ours, blocks, expected


@pytest.mark.parametrize("shared", [1, 2])
def test_shared_experts_as_slots_equal_transformers(tmp_path, fused, shared):
    path = make_checkpoint(str(tmp_path / "m"), "deepseek_v3_moe", n_shared_experts=shared)
    ours, blocks, expected = _logits_and_blocks(path)
    assert blocks and all(b.shared_experts is None and b.shared_slots == shared for b in blocks)
    assert all(b.w13.shape[0] == 8 + shared and b.w2.shape[0] == 8 + shared for b in blocks)
    assert (ours - expected).abs().max().item() < 1e-4


def test_fp8_shared_experts_split_on_scale_blocks(tmp_path, fused):
    """An FP8 checkpoint's two-expert-wide shared expert: its down projection's columns split
    between the slots on a 128-column scale block, its codes and scales as they are."""
    source = make_checkpoint(str(tmp_path / "m"), "deepseek_v3_moe", n_shared_experts=2,
                             **FP8_DIMS)
    fp8, dequantized = write_fp8_checkpoint(source, str(tmp_path / "fp8"), str(tmp_path / "deq"))
    ours, blocks, _ = _logits_and_blocks(fp8)
    assert blocks[0].shared_slots == 2
    _, _, expected = _logits_and_blocks(dequantized)
    assert (ours - expected).abs().max().item() < 1e-4


def test_without_the_trait_shared_experts_stay_a_dense_mlp(tmp_path):
    path = make_checkpoint(str(tmp_path / "m"), "deepseek_v3_moe", n_shared_experts=2)
    ours, blocks, expected = _logits_and_blocks(path)
    assert all(b.shared_slots == 0 and b.shared_experts is not None for b in blocks)
    assert all(b.w13.shape[0] == 8 for b in blocks)
    assert (ours - expected).abs().max().item() < 1e-4


def test_narrow_keeps_fp8_codes_on_block_boundaries():
    w = torch.randn(256, 384)
    codes, scale = _block_quantize(w, (128, 128))
    tensor = FP8BlockTensor(codes, scale)
    cols = narrow(tensor, 1, 128, 384)
    assert isinstance(cols, FP8BlockTensor)
    assert torch.equal(cols.weight.view(torch.uint8), codes[:, 128:].view(torch.uint8))
    assert torch.equal(cols.dequantize(), tensor.dequantize()[:, 128:])
    rows = narrow(tensor, 0, 128, 256)
    assert isinstance(rows, RowScaledFP8)
    assert torch.equal(rows.dequantize(), tensor.dequantize()[128:])
    # Off a block boundary the part is dequantized, the same values.
    assert torch.equal(narrow(tensor, 1, 64, 192), tensor.dequantize()[:, 64:192])
    assert torch.equal(narrow(w, 1, 5, 9), w[:, 5:9])
