"""The few-rows FP8 projection (kernels/fp8_skinny.py) against torch references.

Without a GPU it runs under TRITON_INTERPRET=1 on CPU tensors (conftest.py) at tiny shapes:
N 100 (no multiple of the 64-row tile: wrapped rows dropped at the store) and 200, K 200 (a
partial last scale group) and 640, M 1, 5 and 17 (a 16- and a 32-token tile); split over K or
not, with and without a bias, and SiLU-and-mul fused. With a GPU the same run compiled, plus
Llama-3-8B shapes at M 32 and 64 and a CUDA-graph capture.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from test_fp8_gemm import DEVICE, ON_GPU, _check_result, _id, _poisoned, _problem, _w8a8_reference

from deepinfer.backends.cuda.kernels.activation import silu_and_mul
from deepinfer.backends.cuda.kernels.fp8_gemm import fp8_linear_reference
from deepinfer.backends.cuda.kernels.fp8_skinny import (
    MAX_ROWS,
    SkinnyConfig,
    fp8_skinny,
    skinny_config_for,
)
from deepinfer.backends.cuda.kernels.rotary_decode import SplitCounters

pytestmark = pytest.mark.usefixtures("gpu_bf16_rounding")
CASES = [(1, 100, 200), (5, 200, 640), (17, 100, 640)] + \
    [(32, 6144, 4096), (64, 4096, 14336)] * ON_GPU  # (M, N, K)
CONFIGS = [SkinnyConfig(64, 1), SkinnyConfig(64, 4, num_stages=3)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=_id)
@pytest.mark.parametrize("m,n,k", CASES)
def test_equals_reference(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(m * n + k)
    x, wq, w_scale, bias = _problem(g, m, n, k, dtype)
    exact = _w8a8_reference(x, wq, w_scale, bias)  # the same arithmetic: x quantized
    ref = fp8_linear_reference(x.float(), wq, w_scale, bias.float()).float()
    counters = SplitCounters()
    for cfg, b in itertools.product(CONFIGS, (bias, None)):
        shift = 0.0 if b is not None else bias.float()
        out, wide = _poisoned(m, n, dtype)
        assert fp8_skinny(x, wq, w_scale, b, counters, 8, cfg, out=out) is out
        # The interpreter's dot is float32 throughout: held elementwise to the same arithmetic.
        # A GPU's fp8 tensor cores sum a 128-wide dot in about 14 bits: held in norm, as the
        # prefill GEMM's test holds it.
        _check_result(out, wide, exact - shift, None if ON_GPU else 1e-2)
        assert _rel(out, exact - shift) < 1e-2
        assert _rel(out, ref - shift) < 4e-2  # and to the unquantized x: fp8's rounding of x
        assert not counters.get(1, x.device).any(), "a split ticket counter was left set"


@pytest.mark.parametrize("m,f", [(5, 200), (17, 640)] + [(32, 14336)] * ON_GPU)
def test_silu_equals_silu_then_product(m: int, f: int) -> None:
    """silu=True quantizes silu_and_mul(x) in the quantization kernel: the same bits as
    SiLU-and-mul, then the product."""
    g = torch.Generator().manual_seed(m + f)
    x = torch.randn(m, 2 * f, generator=g).to(dtype=torch.bfloat16, device=DEVICE)
    _, wq, w_scale, bias = _problem(g, 1, 100, f, torch.bfloat16)
    counters, cfg = SplitCounters(), SkinnyConfig(64, 2)
    fused = fp8_skinny(x, wq, w_scale, bias, counters, 8, cfg, silu=True)
    assert torch.equal(fused, fp8_skinny(silu_and_mul(x), wq, w_scale, bias, counters, 8, cfg))


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def test_split_is_deterministic() -> None:
    """The last split sums the partials in split order: the same bits every call."""
    g = torch.Generator().manual_seed(3)
    x, wq, w_scale, bias = _problem(g, 5, 100, 640, torch.bfloat16)
    counters, cfg = SplitCounters(), SkinnyConfig(64, 4)
    first = fp8_skinny(x, wq, w_scale, bias, counters, 8, cfg)
    for _ in range(3):
        assert torch.equal(fp8_skinny(x, wq, w_scale, bias, counters, 8, cfg), first)


def test_config_splits_until_the_gpu_is_busy() -> None:
    assert skinny_config_for(32, 4096, 4096, 132).split == 4  # 64 tiles -> 256 programs
    assert skinny_config_for(32, 6144, 4096, 132).split == 4  # 96 tiles -> 384
    assert skinny_config_for(32, 4096, 14336, 132).split == 4
    assert skinny_config_for(32, 28672, 4096, 132).split == 1  # 448 tiles already
    assert skinny_config_for(32, 4096, 512, 132).split == 1  # 4 groups: nothing to split


def test_rejects_too_many_rows() -> None:
    g = torch.Generator().manual_seed(4)
    x, wq, w_scale, _ = _problem(g, MAX_ROWS + 1, 64, 128, torch.bfloat16)
    with pytest.raises(ValueError, match="at most"):
        fp8_skinny(x, wq, w_scale, None, SplitCounters(), 8)
    assert fp8_skinny(x[:0], wq, w_scale, None, SplitCounters(), 8).shape == (0, 64)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_in_a_cuda_graph() -> None:
    """A decode batch's projection captured as the decode graphs are, split over K."""
    g = torch.Generator().manual_seed(9)
    x, wq, w_scale, bias = _problem(g, 24, 4096, 4096, torch.bfloat16)
    counters = SplitCounters()
    out = torch.empty(24, 4096, dtype=torch.bfloat16, device=DEVICE)
    fp8_skinny(x, wq, w_scale, bias, counters, 132, out=out)  # compile, counters: outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8_skinny(x, wq, w_scale, bias, counters, 132, out=out)
    x.copy_(torch.randn(24, 4096, generator=g).to(DEVICE))
    out.fill_(float("nan"))
    graph.replay()
    torch.testing.assert_close(out, fp8_skinny(x, wq, w_scale, bias, counters, 132),
                               rtol=0, atol=0)
