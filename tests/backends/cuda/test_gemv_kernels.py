"""The fused one-token projections against the reference ops followed by a torch matmul.

Without a GPU they run under TRITON_INTERPRET=1 (see conftest.py) on CPU tensors. Shapes are
small but not multiples of the tiles, so the masked edges (rows and the K tail) are exercised.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer.backends.cpu import ops
from deepinfer.backends.cuda.kernels.gemv import GemvConfig, gemv, rms_norm_gemv, \
    silu_and_mul_gemv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIGS = [GemvConfig(16, 64, 4, 2), GemvConfig(8, 32, 2, 1)]
EPS = 1e-5
pytestmark = pytest.mark.usefixtures("gpu_bf16_rounding")


def _inputs(n: int, k: int, dtype: torch.dtype, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)

    return dict(x=rand(1, k), residual=rand(1, k), weight=rand(n, k) / k ** 0.5, bias=rand(n),
                norm=(1 + 0.5 * torch.rand(k, generator=g)).to(dtype=dtype, device=DEVICE))


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    # fp32: the sums differ in order only; bf16: a few ulps of the result's scale.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < tol, err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("n,k", [(40, 96), (33, 64)])
def test_plain_gemv(n: int, k: int, config: GemvConfig, dtype: torch.dtype) -> None:
    t = _inputs(n, k, dtype, seed=n + k)
    out = gemv(t["x"], t["weight"], t["bias"], config)
    ref = torch.nn.functional.linear(t["x"].float(), t["weight"].float(), t["bias"].float())
    _close(out, ref, dtype)
    _close(gemv(t["x"], t["weight"], None, config), t["x"].float() @ t["weight"].float().T,
           dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", CONFIGS)
def test_rms_norm_gemv_with_residual(config: GemvConfig, dtype: torch.dtype) -> None:
    t = _inputs(40, 96, dtype, seed=1)
    residual_before = t["residual"].clone()
    out, summed = rms_norm_gemv(t["x"], t["residual"], t["norm"], EPS, t["weight"], None,
                                config)
    ref_sum = t["x"] + residual_before  # rounded to dtype, as the model's residual stream is
    assert torch.equal(summed, ref_sum)
    assert torch.equal(t["residual"], residual_before)  # the old residual is left alone
    ref = ops.rms_norm(ref_sum, t["norm"], EPS).float() @ t["weight"].float().T
    _close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_gemv_first_layer(dtype: torch.dtype) -> None:
    t = _inputs(33, 64, dtype, seed=2)
    out, summed = rms_norm_gemv(t["x"], None, t["norm"], EPS, t["weight"], t["bias"],
                                CONFIGS[0])
    assert summed is t["x"]
    ref = torch.nn.functional.linear(ops.rms_norm(t["x"], t["norm"], EPS).float(),
                                     t["weight"].float(), t["bias"].float())
    _close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", CONFIGS)
def test_silu_and_mul_gemv(config: GemvConfig, dtype: torch.dtype) -> None:
    t = _inputs(40, 96, dtype, seed=3)
    gate_up = torch.cat([t["x"], t["residual"]], dim=1) * 3
    out = silu_and_mul_gemv(gate_up, t["weight"], None, config)
    act = torch.nn.functional.silu(gate_up[:, :96]) * gate_up[:, 96:]
    _close(out, act.float() @ t["weight"].float().T, dtype)


def test_rejects_batches_and_bad_shapes() -> None:
    t = _inputs(8, 32, torch.float32, seed=4)
    with pytest.raises(ValueError, match="one contiguous row"):
        gemv(torch.cat([t["x"], t["x"]]), t["weight"])
    with pytest.raises(ValueError, match="weight must be"):
        gemv(t["x"], t["weight"][:, :16])
    with pytest.raises(ValueError, match="norm_weight"):
        rms_norm_gemv(t["x"], None, t["norm"][:8], EPS, t["weight"])
