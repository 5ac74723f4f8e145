"""DeepSeek's FP8 release format (float8_e4m3fn weights + `weight_scale_inv` per block) on the
CPU backend, which dequantizes it at load: logits and greedy tokens equal transformers on the
same weights dequantized, for a tiny llama and a tiny DeepSeek-V3 MoE (MLA: its kv_b_proj and
rope rows are split and reordered after dequantizing)."""
from __future__ import annotations

import pytest
import torch
import transformers

from deepinfer.core.sampling import SamplingParams
from deepinfer.llm import LLM
from deepinfer.models.quant.tensors import FP8BlockTensor, RowScaledFP8
from deepinfer.models.weights import checkpoint_kinds, iter_checkpoint
from deepinfer.testing.conformance import MIN_MARGIN
from tests.checkpoints import make_checkpoint, write_fp8_checkpoint
from tests.models.test_moe_parity import _prefill_logits

# 16 x 16 blocks: several per matrix of these tiny models, so every block has its own scale.
BLOCK = (16, 16)


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory):
    made: dict[str, tuple[str, str]] = {}

    def get(family: str) -> tuple[str, str]:
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            source = make_checkpoint(str(root / "float"), family)
            made[family] = write_fp8_checkpoint(source, str(root / "fp8"), str(root / "deq"),
                                                BLOCK)
        return made[family]
    return get


def _reference(path: str) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_fp8_tensors_are_read_with_their_block_scales(fp8_pair):
    fp8, _ = fp8_pair("llama")
    kinds = checkpoint_kinds(fp8)
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "fp8"
    assert kinds["model.layers.0.input_layernorm.weight"] == "float"
    assert not any(name.endswith("_scale_inv") for name in kinds)
    tensors = dict(iter_checkpoint(fp8, BLOCK))
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, FP8BlockTensor) and q.weight.dtype == torch.float8_e4m3fn
    assert q.scale_inv.shape == (64 // 16, 64 // 16)
    # Rows cut at an offset inside a block keep that block's scales.
    torch.testing.assert_close(q.rows(5, 37).dequantize(), q.dequantize()[5:37], rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "deepseek_v3_moe"])
def test_fp8_checkpoint_logits_equal_transformers_on_dequantized(fp8_pair, family):
    fp8, dequantized = fp8_pair(family)
    prompt = torch.randint(2, 250, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = _prefill_logits(fp8, prompt)
    with torch.no_grad():
        ref = _reference(dequantized)(torch.tensor([prompt])).logits[0].float()
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["llama", "deepseek_v3_moe"])
def test_fp8_checkpoint_greedy_equals_transformers(fp8_pair, family):
    fp8, dequantized = fp8_pair(family)
    prompt = torch.randint(2, 250, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    llm = LLM(fp8, dtype="float32", accelerator="cpu", block_size=16, kv_cache_memory_gb=0.05,
              load_tokenizer=False)
    ours = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24,
                                                 ignore_eos=True))[0].outputs[0].token_ids
    with torch.no_grad():
        logits = _reference(dequantized)(torch.tensor([prompt + ours])).logits[0].float()
    logits = logits[len(prompt) - 1:-1]
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min().item() >= MIN_MARGIN, "near-tie on the reference"
    assert logits.argmax(dim=-1).tolist() == ours


def test_quantize_at_load_is_refused_without_fp8_kernels(fp8_pair):
    _, dequantized = fp8_pair("llama")
    with pytest.raises(ValueError, match="FP8 kernels"):
        LLM(dequantized, accelerator="cpu", quantization="fp8", kv_cache_memory_gb=0.05,
            load_tokenizer=False)


def test_row_scaled_quantization_bounds_the_error():
    w = torch.randn(40, 300, generator=torch.Generator().manual_seed(0)) * 3
    w[7, 200] = 80.0  # one outlier: only its row's second group scales for it
    q = RowScaledFP8.quantize(w)
    assert q.weight.dtype == torch.float8_e4m3fn and q.scale.shape == (40, 3)
    err = (q.dequantize() - w).abs()
    # e4m3 keeps 3 mantissa bits: half a step is 1/16 of a value's binade, at most 2^-4 * max.
    bound = q.scale.repeat_interleave(128, 1)[:, :300] * 448 / 16
    assert (err <= bound).all()
    assert q.scale[7, 1].item() == pytest.approx(80.0 / 448)
    assert q.scale[7, 0] < q.scale[7, 1] / 4 and q.scale[7, 2] < q.scale[7, 1] / 4


def test_block_quantization_shares_a_scale_per_block():
    """block_rows = 16 on 40 rows: blocks of rows 0-15, 16-31 and 32-39 (a partial one), each
    with one scale per 128 columns, spread to its rows."""
    w = torch.randn(40, 300, generator=torch.Generator().manual_seed(1))
    w[7, 200] = 80.0
    q = RowScaledFP8.quantize(w, block_rows=16)
    assert q.scale.shape == (40, 3)
    for start, end in ((0, 16), (16, 32), (32, 40)):
        assert torch.equal(q.scale[start:end], q.scale[start].expand(end - start, 3))
        amax = torch.stack([w[start:end, c:c + 128].abs().max() for c in (0, 128, 256)])
        torch.testing.assert_close(q.scale[start], amax / 448, rtol=0, atol=0)
    assert q.scale[0, 1].item() == pytest.approx(80.0 / 448)
    bound = q.scale.repeat_interleave(128, 1)[:, :300] * 448 / 16
    assert ((q.dequantize() - w).abs() <= bound).all()


def test_fp8_weights_take_gguf_rows_through_their_float_values():
    """--quantization fp8 on a GGUF checkpoint: a Q8_0 tensor's rows are quantized from its
    dequantized values in 128 x 128 blocks, into a linear weight and into an expert slot."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    from deepinfer.models.quant.packed import FP8Experts, FP8Weight
    from deepinfer.models.quant.tensors import GGUFTensor
    from deepinfer.models.weight_targets import SlotRows

    w = torch.randn(160, 256, generator=torch.Generator().manual_seed(2))
    blocks = gguf_quantize(w.numpy(), GGMLQuantizationType.Q8_0)
    tensor = GGUFTensor(torch.from_numpy(blocks), int(GGMLQuantizationType.Q8_0), (160, 256))
    expected = RowScaledFP8.quantize(tensor.dequantize(), block_rows=128).dequantize()
    linear = FP8Weight((160, 256))
    linear.load_rows(tensor, None)
    assert torch.equal(linear.dequantize(), expected)
    experts = FP8Experts((2, 320, 256))
    experts.load_rows(tensor, SlotRows(1, (160, 320)))
    assert torch.equal(experts.dequantize()[1, 160:], expected)
