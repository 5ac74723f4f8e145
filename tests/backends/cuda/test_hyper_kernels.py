"""mHC's collapse and update kernels (kernels/hyper_connections.py) against the model's torch
definitions (deepseek_v4/hyper.py: collapse_gates, update_streams), under the interpreter on
CPU or on the GPU."""
from __future__ import annotations

import pytest
import torch

from deepinfer.backends.cuda.kernels.hyper_connections import hyper_collapse, hyper_update
from deepinfer.models.deepseek_v4.hyper import collapse_gates, update_streams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("gpu_bf16_rounding")  # the interpreter rounds as a GPU


def _inputs(tokens: int, n: int, hidden: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(tokens * 10 + n + hidden)
    logits = (2 * torch.randn(tokens, (2 + n) * n, generator=g)).to(DEVICE)
    streams = torch.randn(tokens, n, hidden, generator=g).to(dtype).to(DEVICE)
    scale = (0.5 + torch.rand(3, generator=g)).to(DEVICE)
    base = torch.randn((2 + n) * n, generator=g).to(DEVICE)
    return logits, streams, scale, base


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,n,hidden,iters", [(1, 4, 64, 20), (5, 4, 700, 20),
                                                   (3, 3, 32, 1)])
def test_collapse_matches_the_model(dtype, tokens, n, hidden, iters):
    logits, streams, scale, base = _inputs(tokens, n, hidden, dtype)
    got = hyper_collapse(logits, streams, scale, base, iters, 1e-6)
    want = collapse_gates(logits, streams, scale, base, iters, 1e-6)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else \
        {"rtol": 2 ** -7, "atol": 2 ** -7}
    torch.testing.assert_close(got[0].float(), want[0].float(), **tol)  # the block's input
    assert got[0].dtype == dtype
    for ours, ref in zip(got[1:], want[1:]):  # post, comb: float32
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,n,hidden", [(1, 4, 64), (4, 4, 1100), (2, 3, 40)])
def test_update_matches_the_model(dtype, tokens, n, hidden):
    logits, streams, scale, base = _inputs(tokens, n, hidden, dtype)
    _, post, comb = collapse_gates(logits, streams, scale, base, 20, 1e-6)
    out = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(3)).to(dtype)
    out = out.to(DEVICE)
    got = hyper_update(streams, post, comb, out)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else \
        {"rtol": 2 ** -7, "atol": 2 ** -6}
    torch.testing.assert_close(got.float(), update_streams(streams, post, comb, out).float(),
                               **tol)
    assert got.dtype == dtype and got.shape == streams.shape


def test_shapes_are_checked():
    logits, streams, scale, base = _inputs(2, 4, 16, torch.float32)
    with pytest.raises(ValueError, match="float32"):
        hyper_collapse(logits.double(), streams, scale, base, 20, 1e-6)
    with pytest.raises(ValueError, match="block_output"):
        hyper_update(streams, logits[:, :4], logits[:, :16].view(2, 4, 4), streams[:, 0, :8])
