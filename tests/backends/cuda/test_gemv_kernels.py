"""The one-token projection kernel against a float32 torch matmul.

Without a GPU it runs under TRITON_INTERPRET=1 (see conftest.py) on CPU tensors. Shapes are
small but not multiples of the tiles, so the masked edges (rows and the K tail) are exercised.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer.backends.cuda.kernels import gemv as gemv_module
from deepinfer.backends.cuda.kernels.gemv import (
    PRELOAD_PER_THREAD,
    GemvConfig,
    config_for,
    gemv,
    preload_cols,
)
from deepinfer.backends.cuda.settings import CudaSettings

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The whole row read before the wait; a preload of two tiles, then tiles; one tile, then tiles.
CONFIGS = [GemvConfig(16, 64, 4), GemvConfig(8, 32, 2, first_k=64),
           GemvConfig(8, 32, 2, first_k=32)]
pytestmark = pytest.mark.usefixtures("gpu_bf16_rounding")


def _rand(g: torch.Generator, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("n,k", [(40, 96), (33, 64), (8, 200)])
def test_gemv_equals_matmul(n: int, k: int, config: GemvConfig, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n * k)
    x, weight, bias = _rand(g, dtype, 1, k), _rand(g, dtype, n, k) / k ** 0.5, _rand(g, dtype, n)
    ref = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    # fp32: the sums differ in order only; bf16: one rounding of the float32 result.
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for b, r in ((bias, ref), (None, ref - bias.float())):
        poisoned = torch.full((1, n), float("nan"), dtype=dtype, device=DEVICE)
        out = gemv(x, weight, b, config, out=poisoned)
        assert out.shape == (1, n) and out.dtype == dtype
        torch.testing.assert_close(out.float(), r, rtol=tol, atol=tol)


def test_strided_weight_rows() -> None:
    """A weight whose rows are a slice of a wider tensor (row stride != K)."""
    g = torch.Generator().manual_seed(1)
    wide, x = _rand(g, torch.float32, 24, 80), _rand(g, torch.float32, 1, 64)
    weight = wide[:, :64]
    torch.testing.assert_close(gemv(x, weight, None, CONFIGS[0]), x @ weight.T,
                               rtol=1e-5, atol=1e-5)


def test_configs_cover_the_llama3_shapes() -> None:
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)):
        cfg = config_for(n, k)
        assert cfg.block_n * cfg.block_k <= 16384 and k % cfg.block_k == 0


def test_preload_is_a_power_of_two_within_the_thread_budget(monkeypatch) -> None:
    for n, k in ((5120, 2048), (2048, 4096), (128, 2048), (6144, 4096), (28672, 4096),
                 (4096, 14336), (8, 200)):
        cfg = config_for(n, k)
        first = preload_cols(cfg, k)
        assert first & (first - 1) == 0 and first >= cfg.block_k
        assert first == cfg.block_k or (
            first <= triton_next_pow2(k)
            and first * cfg.block_n <= PRELOAD_PER_THREAD * 32 * cfg.num_warps)
    assert preload_cols(config_for(5120, 2048), 2048) == 2048  # Qwen3-30B-A3B's qkv: all of it
    for n in (6144, 4096, 28672, 128256):  # Llama-3-8B's rows of 4096: whole, the LM head too
        assert preload_cols(config_for(n, 4096), 4096) == 4096
    assert preload_cols(config_for(4096, 14336), 14336) == 8192  # its down_proj: over half
    monkeypatch.setattr(gemv_module, "cuda_settings", lambda: CudaSettings(gemv_preload=False))
    assert preload_cols(config_for(5120, 2048), 2048) == config_for(5120, 2048).block_k


def triton_next_pow2(k: int) -> int:
    return 1 << (k - 1).bit_length()


def test_rejects_batches_and_bad_shapes() -> None:
    g = torch.Generator().manual_seed(4)
    x, weight = _rand(g, torch.float32, 1, 32), _rand(g, torch.float32, 8, 32)
    with pytest.raises(ValueError, match="one contiguous row"):
        gemv(torch.cat([x, x]), weight)
    with pytest.raises(ValueError, match="weight must be"):
        gemv(x, weight.T)
    with pytest.raises(ValueError, match="bias"):
        gemv(x, weight, torch.zeros(3))
