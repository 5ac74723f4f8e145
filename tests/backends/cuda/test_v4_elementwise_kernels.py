"""DeepSeek-V4's rope and norm kernels (kernels/interleaved_rope.py, kernels/norm.v4_rms_norm)
against the model's torch definitions (models/deepseek_v4/attention.py), under the interpreter
on CPU or on the GPU: float32 to rounding, bfloat16 to one unit of the last place."""
from __future__ import annotations

import pytest
import torch

from deepinfer.backends.cuda.kernels.interleaved_rope import interleaved_rope
from deepinfer.backends.cuda.kernels.norm import v4_rms_norm
from deepinfer.models.deepseek_v4.attention import rope
from deepinfer.models.deepseek_v4.attention import v4_rms_norm as reference_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("gpu_bf16_rounding")  # the interpreter rounds as a GPU


def _tolerance(dtype: torch.dtype) -> dict:
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else \
        {"rtol": 2 ** -7, "atol": 2 ** -7}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,rope_dim", [((5, 3, 48), 16), ((4, 32), 32), ((3, 2, 16), 8)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_matches_the_model(dtype, shape, rope_dim, inverse):
    g = torch.Generator().manual_seed(sum(shape) + rope_dim)
    x = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    positions = torch.tensor([0, 7, 130, 4095, 65000][:shape[0]], device=DEVICE)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, rope_dim, 2) / rope_dim)).to(DEVICE)
    got = interleaved_rope(x, positions, inv_freq, 1.25, inverse)
    want = rope(x, positions, inv_freq, 1.25, inverse)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), want.float(), **_tolerance(dtype))
    nope = shape[-1] - rope_dim
    assert torch.equal(got[..., :nope], x[..., :nope])  # the leading channels pass untouched


def test_rope_inverse_undoes_the_rotation():
    x = torch.randn(6, 4, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    positions = torch.arange(6, device=DEVICE) * 1000
    inv_freq = (1.0 / 10000 ** (torch.arange(0, 32, 2) / 32)).to(DEVICE)
    back = interleaved_rope(interleaved_rope(x, positions, inv_freq, 1.0), positions, inv_freq,
                            1.0, inverse=True)
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 64), (2, 4, 32), (1, 1000)])
@pytest.mark.parametrize("weighted", [True, False])
def test_norm_matches_the_model(dtype, shape, weighted):
    g = torch.Generator().manual_seed(sum(shape))
    x = (3 * torch.randn(shape, generator=g)).to(dtype).to(DEVICE)
    weight = (1 + 0.3 * torch.randn(shape[-1], generator=g)).to(DEVICE) if weighted else None
    got = v4_rms_norm(x, weight, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), reference_norm(x, weight, 1e-6).float(),
                               **_tolerance(dtype))
