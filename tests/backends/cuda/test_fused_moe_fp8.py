"""The fused MoE kernels with FP8 experts (codes and one scale per row and 128 columns, as
DeepSeek's checkpoints give them) against the reference expert loop on the dequantized weights.

Two paths: a few tokens (moe_gemv) read the FP8 weights with x as it is, so they are as exact
as the float kernels; the grouped GEMMs quantize x and the intermediate per token and 128
columns (w8a8), so they are checked against the reference with the same activation rounding
done in torch. H 256 and F 192: two scale groups each, F's last one partial (a masked K step).
Without a GPU they run under TRITON_INTERPRET=1 (see conftest.py).
"""
from __future__ import annotations

import pytest
import torch

from deepinfer.backends.cuda.kernels.fp8_gemm import Scaled
from deepinfer.backends.cuda.kernels.fused_moe import (
    FP8_MOE_CONFIGS,
    MoeConfig,
    Tiles,
    config_for,
    fp8_tiles,
    fused_experts,
)
from deepinfer.backends.cuda.kernels.moe_gemv import GemvTiles, MoeGemvConfig, moe_gemv, takes
from deepinfer.models.moe.experts import fused_experts_reference, swiglu
from deepinfer.models.quant.tensors import RowScaledFP8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, F, SLOTS, IDLE = 256, 192, 5, 2  # slot IDLE gets no routes
# BLOCK_N 32 and 64 against F 192 / H 256; BLOCK_M 16 and 32 (the FP8 K step is always 128).
CONFIGS = [MoeConfig(16, Tiles(32, 64, 4, 1), Tiles(32, 64, 4, 1)),
           MoeConfig(32, Tiles(64, 64, 4, 2), Tiles(64, 64, 4, 2))]
# BLOCK_K 128 and 256 against H 256 and F 192: even and masked K loops, one group a step and two.
GEMV_CONFIGS = [MoeGemvConfig(GemvTiles(16, 128, 4), GemvTiles(16, 128, 4)),
                MoeGemvConfig(GemvTiles(8, 256, 2), GemvTiles(32, 256, 2))]
pytestmark = pytest.mark.usefixtures("gpu_bf16_rounding")


def _quantize(w: torch.Tensor) -> Scaled:
    """[S, N, K] float -> FP8 codes and scales in DeepSeek's 128 x 128 blocks, per slot."""
    parts = [RowScaledFP8.quantize(slot, block_rows=128) for slot in w]
    return Scaled(torch.stack([p.weight for p in parts]).to(DEVICE),
                  torch.stack([p.scale for p in parts]).to(DEVICE))


def _dequantize(w: Scaled) -> torch.Tensor:
    s, n, k = w.codes.shape
    flat = RowScaledFP8(w.codes.reshape(s * n, k).cpu(), w.scales.reshape(s * n, -1).cpu())
    return flat.dequantize().view(s, n, k).to(DEVICE)


def _round_tokens(x: torch.Tensor) -> torch.Tensor:
    """x through FP8 per token and 128 columns, as the w8a8 path quantizes activations."""
    return RowScaledFP8.quantize(x.float()).dequantize()


def _problem(g: torch.Generator, tokens: int, top_k: int, dtype: torch.dtype):
    choices = torch.tensor([s for s in range(SLOTS) if s != IDLE])
    slots = torch.stack([choices[torch.randperm(len(choices), generator=g)[:top_k]]
                         for _ in range(tokens)])
    slots = torch.where(torch.rand(tokens, top_k, generator=g) < 0.2, -1, slots)
    # x already on FP8's grid (rounding it again is exact): the w8a8 path's only activation
    # rounding left is the intermediate's, which the reference below repeats.
    x = _round_tokens(torch.randn(tokens, H, generator=g)).to(dtype=dtype, device=DEVICE)
    w13 = _quantize(torch.randn(SLOTS, 2 * F, H, generator=g) / H ** 0.5)
    w2 = _quantize(torch.randn(SLOTS, H, F, generator=g) / F ** 0.5)
    weights = torch.rand(tokens, top_k, generator=g).to(DEVICE)
    return x, w13, w2, weights, slots.to(torch.int32).to(DEVICE)


def _w8a8_reference(x, w13: Scaled, w2: Scaled, weights, slots, limit=None) -> torch.Tensor:
    """The expert loop in float32 with the intermediate rounded as the kernels round it (to
    x's dtype, then to FP8 per row and 128 columns)."""
    x, w13, w2 = x.float(), _dequantize(w13), _dequantize(w2)
    out = torch.zeros_like(x)
    flat = slots.reshape(-1).long()
    for slot in torch.unique(flat[flat >= 0]).tolist():
        routes = (flat == slot).nonzero().squeeze(1)
        tokens = routes // slots.shape[1]
        gate, up = (x[tokens] @ w13[slot].T).chunk(2, dim=-1)
        inter = swiglu(gate, up, limit).to(x.dtype)
        y = _round_tokens(inter.cpu()).to(DEVICE) @ w2[slot].T
        out.index_add_(0, tokens, y * weights.reshape(-1)[routes, None])
    return out


def _assert_near(out: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    assert torch.isfinite(out).all()
    assert (out.float() - ref).norm() <= rel * ref.norm()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (1, 2), (2, 3), (4, 4)])
def test_fp8_moe_gemv_equals_reference_on_dequantized_weights(tokens, top_k, dtype) -> None:
    """Weight-only: x is not quantized, so the only error is float rounding."""
    g = torch.Generator().manual_seed(10 * tokens + top_k)
    x, w13, w2, weights, slots = _problem(g, tokens, top_k, dtype)
    ref = fused_experts_reference(x.float(), _dequantize(w13), _dequantize(w2), weights, slots)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for config in GEMV_CONFIGS:
        out = moe_gemv(x, w13, w2, weights, slots, config)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    if takes(tokens, top_k, SLOTS):  # fused_experts' own choice at this size
        torch.testing.assert_close(fused_experts(x, w13, w2, weights, slots).float(), ref,
                                   rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k", [(3, 2), (17, 3)])
def test_fp8_grouped_gemms_equal_the_w8a8_reference(tokens, top_k, dtype) -> None:
    """The w8a8 grouped GEMMs against the loop with the same activation rounding: equal but
    for float32 sum order, which can move an intermediate value across an FP8 rounding
    boundary (one code, ~6%, of one of F values); against exact activations, within what
    FP8's rounding of the intermediate costs (~2-3% rms)."""
    g = torch.Generator().manual_seed(100 + 10 * tokens + top_k)
    x, w13, w2, weights, slots = _problem(g, tokens, top_k, dtype)
    ref = _w8a8_reference(x, w13, w2, weights, slots)
    exact = fused_experts_reference(x.float(), _dequantize(w13), _dequantize(w2), weights, slots)
    assert not takes(tokens, top_k, SLOTS)
    for config in [*CONFIGS, None]:  # None: the default tiles
        out = fused_experts(x, w13, w2, weights, slots, config)
        assert out.shape == x.shape and out.dtype == dtype
        _assert_near(out, ref, 1e-2 if dtype == torch.float32 else 2e-2)
        _assert_near(out, exact, 0.06)


def test_fp8_swiglu_limit_in_both_paths() -> None:
    g = torch.Generator().manual_seed(5)
    x, w13, w2, weights, slots = _problem(g, 6, 2, torch.float32)
    ref = _w8a8_reference(x, w13, w2, weights, slots, limit=0.5)
    assert (ref - _w8a8_reference(x, w13, w2, weights, slots)).norm() > 0.1 * ref.norm()
    _assert_near(fused_experts(x, w13, w2, weights, slots, CONFIGS[0], swiglu_limit=0.5),
                 ref, 1e-2)
    exact = fused_experts_reference(x.float(), _dequantize(w13), _dequantize(w2), weights,
                                    slots, 0.5)
    torch.testing.assert_close(moe_gemv(x, w13, w2, weights, slots, GEMV_CONFIGS[0],
                                        swiglu_limit=0.5), exact, rtol=1e-5, atol=1e-5)


def test_fp8_routes_served_elsewhere_and_bad_inputs() -> None:
    g = torch.Generator().manual_seed(6)
    x, w13, w2, weights, slots = _problem(g, 3, 2, torch.float32)
    nowhere = torch.full_like(slots, -1)
    assert torch.equal(fused_experts(x, w13, w2, weights, nowhere, CONFIGS[0]),
                       torch.zeros_like(x))
    assert torch.equal(moe_gemv(x, w13, w2, weights, nowhere), torch.zeros_like(x))
    with pytest.raises(ValueError, match="both be FP8"):
        fused_experts(x, w13, _dequantize(w2), weights, slots)
    with pytest.raises(ValueError, match="scales must be float32"):
        fused_experts(x, Scaled(w13.codes, w13.scales[..., :1]), w2, weights, slots)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fused_experts(x, Scaled(w13.codes.float(), w13.scales), w2, weights, slots)
    with pytest.raises(ValueError, match="multiples of 128"):
        moe_gemv(x, w13, w2, weights, slots, MoeGemvConfig(GemvTiles(8, 64, 2),
                                                           GemvTiles(8, 128, 2)))


def test_fp8_configs_take_one_scale_group_a_step():
    """Every FP8 config fits shared memory with BLOCK_K 128 (fp8_tiles raises otherwise), and
    the table covers every batch."""
    for bound, cfg in FP8_MOE_CONFIGS:
        assert fp8_tiles(cfg.gate_up, cfg.block_m, 2).block_k == 128
        assert fp8_tiles(cfg.down, cfg.block_m, 1).block_k == 128
    assert FP8_MOE_CONFIGS[-1][0] == float("inf")
    assert config_for(8192, 8, 128, fp8=True) in [cfg for _, cfg in FP8_MOE_CONFIGS]
