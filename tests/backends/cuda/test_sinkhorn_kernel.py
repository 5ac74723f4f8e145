"""mHC's Sinkhorn kernel against the model's torch definition (deepseek_v4/hyper.py), under
the interpreter on CPU or on the GPU."""
from __future__ import annotations

import pytest
import torch

from deepinfer.backends.cuda.kernels.sinkhorn import sinkhorn
from deepinfer.models.deepseek_v4.hyper import sinkhorn as reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("tokens,n,iters", [(1, 4, 20), (33, 4, 20), (70, 4, 1), (5, 3, 7)])
def test_sinkhorn_matches_the_model(tokens, n, iters):
    g = torch.Generator().manual_seed(tokens * 10 + n)
    logits = (3 * torch.randn(tokens, n, n, generator=g)).to(DEVICE)
    got = sinkhorn(logits, iters, 1e-6)
    torch.testing.assert_close(got, reference(logits, iters, 1e-6), rtol=1e-5, atol=1e-6)


def test_sinkhorn_rejects_other_shapes():
    with pytest.raises(ValueError, match="float32"):
        sinkhorn(torch.zeros(2, 4, 4, dtype=torch.bfloat16, device=DEVICE), 20, 1e-6)
    assert sinkhorn(torch.zeros(0, 4, 4, device=DEVICE), 20, 1e-6).shape == (0, 4, 4)
