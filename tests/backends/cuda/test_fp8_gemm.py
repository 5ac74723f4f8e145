"""The FP8 block-scaled projection kernels against torch references.

Without a GPU they run under TRITON_INTERPRET=1 (see conftest.py) on CPU tensors, so the shapes
are tiny: K 128, 200 (a partial last scale group) and 384, N 64 and 100 (a multiple of no N
tile), M 1, 3 and 8 for the GEMV and 1 and 33 for the GEMM. Weights are quantized as DeepSeek
ships them (one scale per 128x128 block) in two parts stacked at row 40 (32 for N 64), as a
fused projection is, so the per-row scales change inside a 128-row block. The interpreter's
tl.dot takes fp8 operands as they are (it widens them to fp16, exactly); its float32 -> fp8
cast is wrong and is patched for the session (conftest.py, _patch_fp8_cast). With a GPU the same
tests run compiled, plus larger shapes and a CUDA-graph capture.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from deepinfer.backends.cuda.kernels.activation import silu_and_mul
from deepinfer.backends.cuda.kernels.fp8_gemm import (
    FP8_MAX,
    GEMV_AUTO_M,
    GEMV_MAX_M,
    Fp8GemmConfig,
    Fp8GemvConfig,
    cublas_block_scaled,
    cublas_weight_scale,
    dequantize_weight,
    fp8_gemm,
    fp8_gemv,
    fp8_linear,
    fp8_linear_reference,
    gemm_config_for,
    gemv_config_for,
    quantize_tokens_fp8,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
SHAPES = [(64, 128), (100, 200), (100, 384)]  # (N, K)
GPU_SHAPES = [(1000, 1800), (6144, 4096)] if ON_GPU else []
# GEMV: BLOCK_K 128 and 256, a K loop of one scale group a chunk and of two (masked but for
# K 128 and 384 at 128), and one row read ahead further than a step; BLOCK_N 128 and 64 against
# N 64 and 100 (few programs: the interpreter's time goes by the program; on a GPU, tiles that fit
# in registers). GEMM: 3 x 2 and 1 x 4 tiles at M 33 (grouped order, wrapped rows and columns).
# The third reads two (GPU: eight) groups before the wait, then one (two) a step.
GEMV_CONFIGS = ([Fp8GemvConfig(16, 1, 4), Fp8GemvConfig(8, 2, 4, scale_each=False),
                 Fp8GemvConfig(8, 2, 4, scale_each=False, first_groups=8)] if ON_GPU
                else [Fp8GemvConfig(128, 1, 4), Fp8GemvConfig(64, 2, 4, scale_each=False),
                      Fp8GemvConfig(64, 1, 4, scale_each=False, first_groups=2)])
GEMM_CONFIGS = [Fp8GemmConfig(16, 64, 4, 1), Fp8GemmConfig(64, 32, 4, 2)]
pytestmark = pytest.mark.usefixtures("gpu_bf16_rounding")


def _cases(ms: list[int]) -> list[tuple]:
    """(m, n, k, dtype) for each m and shape, float32 and bf16 in turn (so each shape sees
    both over the m's); on a GPU every pairing, and the larger shapes too."""
    dtypes = (torch.float32, torch.bfloat16)
    if ON_GPU:
        return [(m, *shape, dtype)
                for m, shape, dtype in itertools.product(ms, SHAPES + GPU_SHAPES, dtypes)]
    return [(m, *shape, dtype) for (m, shape), dtype
            in zip(itertools.product(ms, SHAPES), itertools.cycle(dtypes))]


def _id(value) -> str | None:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


def _block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's format: codes and one inverse scale per 128x128 block, expanded to the
    loader's per-row scales [N, ceil(K/128)]."""
    n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    padded = torch.zeros(nb * 128, kb * 128)
    padded[:n, :k] = w
    blocks = padded.view(nb, 128, kb, 128)
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # [nb, kb]
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(nb * 128, kb * 128)[:n, :k].to(torch.float8_e4m3fn)
    return q, scale_inv.repeat_interleave(128, dim=0)[:n]


def _weight(g: torch.Generator, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused weight: two parts quantized on their own and stacked at row min(40, n // 2), not
    a multiple of 128; block magnitudes e^N(0, 1) apart."""
    parts = []
    for rows in (min(40, n // 2), n - min(40, n // 2)):
        magnitude = torch.exp(torch.randn(-(-rows // 128), -(-k // 128), generator=g))
        magnitude = magnitude.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :k]
        parts.append(_block_quantize(torch.randn(rows, k, generator=g) / k ** 0.5 * magnitude))
    wq, ws = (torch.cat(t) for t in zip(*parts))
    return wq.to(DEVICE), ws.to(DEVICE)


def _problem(g: torch.Generator, m: int, n: int, k: int, dtype: torch.dtype):
    x = torch.randn(m, k, generator=g).to(dtype=dtype, device=DEVICE)
    bias = torch.randn(n, generator=g).to(dtype=dtype, device=DEVICE)
    return (x, *_weight(g, n, k), bias)


def _quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per_token_group_quant_fp8 in torch: scale = max(|x|, 1e-10) / 448 per token and
    128 columns, q = clamp(x / scale, -448, 448). The divisions in float64, rounded once to
    float32: IEEE division as the kernel's div_rn (torch on CUDA divides by a scalar through
    its reciprocal, an ulp off)."""
    m, k = x.shape
    padded = torch.zeros(m, -(-k // 128) * 128, device=x.device, dtype=torch.float64)
    padded[:, :k] = x.double()
    groups = padded.view(m, -1, 128)
    scales = (groups.abs().amax(dim=2).clamp(min=1e-10) / FP8_MAX).float()
    q = (groups / scales.double()[:, :, None]).float()
    q = q.clamp(-FP8_MAX, FP8_MAX).view(m, -1)[:, :k]
    return q.to(torch.float8_e4m3fn), scales


def _w8a8_reference(x, wq, w_scale, bias):
    """What the GEMM computes exactly: x quantized as above, then float32."""
    q, s = _quantize_reference(x)
    return fp8_linear_reference(dequantize_weight(q, s), wq, w_scale, bias.float()).float()


def _poisoned(m: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN [m, n] view into a NaN [m, n + 3] buffer: the output, and the buffer whose last
    columns must stay untouched."""
    wide = torch.full((m, n + 3), float("nan"), dtype=dtype, device=DEVICE)
    return wide[:, :n], wide


def _check_result(out, wide, ref, tol) -> None:
    """Every element written, nothing past the columns, and (tol not None) elementwise close."""
    assert not out.isnan().any(), "an output element was never written"
    assert wide[:, out.shape[1]:].isnan().all(), "written past the output's columns"
    if tol is None:
        return
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol,
                               msg=lambda m: f"{m}\nrelative error {rel:.3g}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=_id)
@pytest.mark.parametrize("m,k", [(1, 128), (3, 200), (33, 384)] + [(517, 4096)] * ON_GPU)
def test_quantize_tokens_matches_torch(m: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(m * k)
    x = torch.randn(m, k, generator=g) * torch.exp(2 * torch.randn(m, 1, generator=g))
    x[0, :128] = 0.0  # an all-zero group: the scale floor
    x[-1, -1] = 1e4  # an outlier in the last (maybe partial) group
    x = x.to(dtype=dtype, device=DEVICE)
    q, scales = quantize_tokens_fp8(x)
    q_ref, scales_ref = _quantize_reference(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (m, -(-k // 128))
    assert torch.equal(scales, scales_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    # Round trip: half a unit in the last place of e4m3 (2^-4 relative), or of its subnormals
    # (2^-10 of the scale) near zero.
    s = scales.repeat_interleave(128, dim=1)[:, :k]
    err = (q.float() * s - x.float()).abs()
    bound = torch.maximum(x.float().abs() * 2 ** -4, s * 2 ** -10) * (1 + 1e-5)
    assert (err <= bound).all(), f"round trip off by {(err / bound).max():.3g} of the bound"


def test_quantize_tokens_for_cublas() -> None:
    """Column-major scales over padded rows (what scaled_mm reads): the first M rows equal the
    row-major result; the strides are (1, rows)."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(3, 384, generator=g).to(DEVICE)
    q, scales = quantize_tokens_fp8(x)
    q_cm, scales_cm = quantize_tokens_fp8(x, column_major=True, rows=16)
    assert q_cm.shape == (16, 384) and scales_cm.shape == (16, 3)
    assert scales_cm.stride() == (1, 16)
    assert torch.equal(scales_cm[:3], scales)
    assert torch.equal(q_cm[:3].view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
@pytest.mark.parametrize("m,f", [(1, 128), (3, 200), (33, 384)] + [(517, 14336)] * ON_GPU)
def test_quantize_silu_equals_silu_then_quantize(m: int, f: int, dtype: torch.dtype) -> None:
    """SiLU-and-mul fused into the quantization: bit-equal to silu_and_mul's 16-bit output
    quantized, in both scale layouts; and within e4m3's rounding of torch's silu(gate) * up."""
    g = torch.Generator().manual_seed(m * f + 3)
    x = (torch.randn(m, 2 * f, generator=g) * 3).to(dtype=dtype, device=DEVICE)
    x[0, :128] = 0.0  # a zero gate group: its product group is all zero, the scale floor
    product = silu_and_mul(x)
    q_ref, s_ref = quantize_tokens_fp8(product)
    q, s = quantize_tokens_fp8(x, silu=True)
    assert q.shape == (m, f) and s.shape == (m, -(-f // 128))
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    q_cm, s_cm = quantize_tokens_fp8(x, column_major=True, rows=m + 5, silu=True)
    assert s_cm.stride() == (1, m + 5) and torch.equal(s_cm[:m], s_ref)
    assert torch.equal(q_cm[:m].view(torch.uint8), q_ref.view(torch.uint8))
    gate, up = x.float().chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    back = q.float() * s.repeat_interleave(128, dim=1)[:, :f]
    bound = expected.abs() * (2 ** -4 + (2 ** -7 if dtype == torch.bfloat16 else 1e-5)) + \
        s.repeat_interleave(128, dim=1)[:, :f] * 2 ** -9
    assert ((back - expected).abs() <= bound).all()


@pytest.mark.parametrize("m,n,f,dtype", [(2, 64, 200, torch.float32), (33, 128, 384,
                                                                        torch.bfloat16)])
def test_gemm_silu_equals_silu_then_gemm(m: int, n: int, f: int, dtype: torch.dtype) -> None:
    """A gated MLP's down projection from the gate/up output: the same result as SiLU-and-mul
    first, on the Triton GEMM (and on a GPU with block scales, on cuBLAS: the second case,
    whose N and K scaled_mm takes)."""
    g = torch.Generator().manual_seed(m + n + f)
    gate_up = torch.randn(m, 2 * f, generator=g).to(dtype=dtype, device=DEVICE)
    wq, w_scale = _weight(g, n, f)
    bias = torch.randn(n, generator=g).to(dtype=dtype, device=DEVICE)
    product = silu_and_mul(gate_up)
    for config in GEMM_CONFIGS:
        assert torch.equal(fp8_gemm(gate_up, wq, w_scale, bias, config, silu=True),
                           fp8_gemm(product, wq, w_scale, bias, config))
    kernel_scale = cublas_weight_scale(w_scale, f)
    if ON_GPU and kernel_scale is not None and dtype != torch.float32 and \
            cublas_block_scaled(DEVICE):
        assert torch.equal(fp8_gemm(gate_up, wq, w_scale, bias, kernel_scale=kernel_scale,
                                    silu=True),
                           fp8_gemm(product, wq, w_scale, bias, kernel_scale=kernel_scale))
    with pytest.raises(ValueError, match=f"x must be \\[M, {2 * f}\\]"):
        fp8_gemm(product, wq, w_scale, silu=True)
    with pytest.raises(ValueError, match="2F"):
        quantize_tokens_fp8(gate_up[:, 1:], silu=True)


def _configs(configs: list, m: int, n: int) -> list:
    """Both test configs, with and without a bias, in an order that turns with the shape; on
    a GPU also the default (config_for's tiles)."""
    turn = (m + n) % len(configs)
    return configs[turn:] + configs[:turn] + [None] * ON_GPU


@pytest.mark.parametrize("m,n,k,dtype", _cases([1, 3, GEMV_MAX_M]), ids=_id)
def test_gemv_equals_reference(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(m * n * k)
    x, wq, w_scale, bias = _problem(g, m, n, k, dtype)
    ref = fp8_linear_reference(x.float(), wq, w_scale, bias.float())
    # x is not quantized: float32 differs in summation order only, bf16 by one rounding.
    tol = (1e-5 if k <= 1024 else 1e-4) if dtype == torch.float32 else 1e-2
    for config, b in zip(_configs(GEMV_CONFIGS, m, n), (bias, None, bias, None)):
        out, wide = _poisoned(m, n, dtype)
        assert fp8_gemv(x, wq, w_scale, b, config, out=out) is out
        _check_result(out, wide, ref if b is not None else ref - bias.float(), tol)


@pytest.mark.parametrize("m,n,k,dtype", _cases([1, 33] + [517] * ON_GPU), ids=_id)
def test_gemm_equals_reference(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(m * n * k + 1)
    x, wq, w_scale, bias = _problem(g, m, n, k, dtype)
    exact = _w8a8_reference(x, wq, w_scale, bias)
    ref = fp8_linear_reference(x.float(), wq, w_scale, bias.float())
    # Hopper's fp8 tensor cores sum a 128-wide dot in about 14 bits (DeepSeek-V3's report): on
    # a GPU the result is held to 1% in norm (0.3% measured on the H200); the interpreter's dot
    # is float32 throughout, held elementwise.
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for config, b in zip(_configs(GEMM_CONFIGS, m, n), (bias, None, bias)):
        out, wide = _poisoned(m, n, dtype)
        assert fp8_gemm(x, wq, w_scale, b, config, out=out) is out
        # Against the same arithmetic (activations quantized): summation order and the output
        # rounding only. Against the unquantized x: fp8's 2^-4 per activation, averaged.
        shift = 0.0 if b is not None else bias.float()
        if ON_GPU:  # the tensor cores' error is relative to the sums, not to each output
            _check_result(out, wide, exact - shift, None)
            rel = ((out.float() - (exact - shift)).norm() / (exact - shift).norm()).item()
            assert rel < 1e-2, f"relative error to the same arithmetic {rel:.3g}"
        else:
            _check_result(out, wide, exact - shift, tol)
        rel = ((out.float() - (ref - shift)).norm() / (ref - shift).norm()).item()
        assert rel < 4e-2, f"relative error to the float32 reference {rel:.3g}"


def _block_weight(g: torch.Generator, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One weight in 128 x 128 blocks from row 0 (no fused parts): cuBLAS's block layout."""
    q, s = _block_quantize(torch.randn(n, k, generator=g) / k ** 0.5)
    return q.to(DEVICE), s.to(DEVICE)


def test_cublas_weight_scale_layouts() -> None:
    g = torch.Generator().manual_seed(11)
    _, blocks = _block_weight(g, 256, 640)  # 5 groups: padded to 8
    grid = cublas_weight_scale(blocks, 640)
    assert grid.shape == (8, 2) and grid.stride() == (1, 8)
    assert torch.equal(grid[:5], blocks[::128].T) and torch.equal(grid[5:].cpu(), torch.ones(3, 2))
    _, fused = _weight(g, 256, 640)  # parts at row 40: one scale per row
    rows = cublas_weight_scale(fused, 640)
    assert rows.shape == (256, 5) and rows.stride() == (1, 256) and torch.equal(rows, fused)
    assert cublas_weight_scale(fused[:, :2], 200) is None  # K not a multiple of 128
    assert cublas_weight_scale(fused[:100], 640) is None  # N not a multiple of 16


@pytest.mark.skipif(not ON_GPU or not cublas_block_scaled(DEVICE),
                    reason="needs scaled_mm with block scales (cuBLAS 12.9+, Hopper)")
@pytest.mark.parametrize("layout", ["blocks", "rows"])
@pytest.mark.parametrize("m,n,k", [(2, 256, 640), (33, 6144, 4096), (517, 256, 640),
                                   (517, 4096, 14336)])
def test_cublas_gemm_equals_reference(m: int, n: int, k: int, layout: str) -> None:
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g).to(dtype=torch.bfloat16, device=DEVICE)
    bias = torch.randn(n, generator=g).to(dtype=torch.bfloat16, device=DEVICE)
    wq, w_scale = (_block_weight if layout == "blocks" else _weight)(g, n, k)
    kernel_scale = cublas_weight_scale(w_scale, k)
    assert kernel_scale.shape[1] == (n // 128 if layout == "blocks" else k // 128)
    exact = _w8a8_reference(x, wq, w_scale, bias)
    ref = fp8_linear_reference(x.float(), wq, w_scale, bias.float())
    out, wide = _poisoned(m, n, torch.bfloat16)
    assert fp8_linear(x, wq, w_scale, bias, out=out, kernel_scale=kernel_scale) is out
    _check_result(out, wide, exact, None)
    for target, bound in ((exact, 1e-2), (ref, 4e-2)):
        rel = ((out.float() - target).norm() / target.norm()).item()
        assert rel < bound, f"relative error {rel:.3g}"


def test_fp8_linear_picks_the_path_by_m() -> None:
    g = torch.Generator().manual_seed(5)
    x, wq, w_scale, bias = _problem(g, GEMV_MAX_M + 1, 16, 200, torch.float32)
    small, large = x[:GEMV_AUTO_M], x[:GEMV_AUTO_M + 2]
    assert torch.equal(fp8_linear(small, wq, w_scale, bias), fp8_gemv(small, wq, w_scale, bias))
    assert torch.equal(fp8_linear(large, wq, w_scale, bias), fp8_gemm(large, wq, w_scale, bias))
    large = x
    forced = fp8_linear(small, wq, w_scale, bias, path="gemm")
    assert torch.equal(forced, fp8_gemm(small, wq, w_scale, bias))
    with pytest.raises(ValueError, match="at most"):
        fp8_linear(large, wq, w_scale, bias, path="gemv")
    with pytest.raises(ValueError, match="path"):
        fp8_linear(small, wq, w_scale, path="cublas")
    assert fp8_linear(x[:0], wq, w_scale).shape == (0, 16)


def test_strided_rows() -> None:
    """x, weight and scale rows that are slices of wider tensors (row strides != K)."""
    g = torch.Generator().manual_seed(6)
    x, wq, w_scale, _ = _problem(g, 3, 64, 384, torch.float32)
    wide_x = torch.randn(3, 400, generator=g).to(DEVICE)
    wide_x[:, :200] = x[:, :200]
    wide_q = torch.zeros(64, 256, dtype=torch.float8_e4m3fn, device=DEVICE)
    wide_q[:, :200] = wq[:, :200]
    wide_s = torch.ones(64, 5, device=DEVICE)
    wide_s[:, :2] = w_scale[:, :2]
    xs, qs, ss = wide_x[:, :200], wide_q[:, :200], wide_s[:, :2]
    ref = fp8_linear_reference(xs, qs, ss)
    torch.testing.assert_close(fp8_gemv(xs, qs, ss, None, GEMV_CONFIGS[0]), ref,
                               rtol=1e-5, atol=1e-5)
    exact = _w8a8_reference(xs, qs, ss, torch.zeros(64, device=DEVICE))
    torch.testing.assert_close(fp8_gemm(xs, qs, ss, None, GEMM_CONFIGS[0]), exact,
                               rtol=2e-3, atol=2e-3)


def test_configs_cover_the_llama3_shapes() -> None:
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)):
        for m in (1, 2, 4, GEMV_MAX_M):
            cfg = gemv_config_for(n, k, m)
            assert k % (cfg.groups * 128) == 0 and m * cfg.block_n * cfg.groups * 128 <= 32768
        for m in (16, 64, 8192):
            assert gemm_config_for(m, n, k).block_n <= 128
    assert gemv_config_for(100, 200).groups == 2  # never wider than K


def test_rejects_bad_inputs() -> None:
    g = torch.Generator().manual_seed(7)
    x, wq, w_scale, bias = _problem(g, 2, 64, 200, torch.float32)
    with pytest.raises(ValueError, match="wq must be"):
        fp8_linear(x, wq.float(), w_scale)
    with pytest.raises(ValueError, match="x must be"):
        fp8_linear(x[:, :128], wq, w_scale)
    with pytest.raises(ValueError, match="w_scale must be"):
        fp8_linear(x, wq, w_scale[:, :1])
    with pytest.raises(ValueError, match="bias"):
        fp8_linear(x, wq, w_scale, bias[:3])
    with pytest.raises(ValueError, match="out must be"):
        fp8_linear(x, wq, w_scale, out=torch.empty(2, 64, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="groups"):
        quantize_tokens_fp8(x, group=64)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_gemv_in_a_cuda_graph() -> None:
    g = torch.Generator().manual_seed(8)
    x, wq, w_scale, bias = _problem(g, 4, 4096, 4096, torch.bfloat16)
    out = torch.empty(4, 4096, dtype=torch.bfloat16, device=DEVICE)
    fp8_gemv(x, wq, w_scale, bias, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8_gemv(x, wq, w_scale, bias, out=out)
    x.copy_(torch.randn(4, 4096, generator=g).to(DEVICE))
    out.fill_(float("nan"))
    graph.replay()
    torch.testing.assert_close(out, fp8_gemv(x, wq, w_scale, bias), rtol=0, atol=0)


@pytest.mark.skipif(not ON_GPU or not cublas_block_scaled(DEVICE),
                    reason="needs scaled_mm with block scales (cuBLAS 12.9+, Hopper)")
def test_cublas_gemm_in_a_cuda_graph() -> None:
    """A decode batch's projection (M = 8) through cuBLAS, captured as the decode graphs are."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(8, 4096, generator=g).to(dtype=torch.bfloat16, device=DEVICE)
    wq, w_scale = _block_weight(g, 4096, 4096)
    kernel_scale = cublas_weight_scale(w_scale, 4096)
    out = torch.empty(8, 4096, dtype=torch.bfloat16, device=DEVICE)
    fp8_gemm(x, wq, w_scale, out=out, kernel_scale=kernel_scale)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8_gemm(x, wq, w_scale, out=out, kernel_scale=kernel_scale)
    x.copy_(torch.randn(8, 4096, generator=g).to(DEVICE))
    out.fill_(float("nan"))
    graph.replay()
    expected = fp8_gemm(x, wq, w_scale, kernel_scale=kernel_scale)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
