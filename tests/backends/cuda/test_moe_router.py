"""The one-kernel softmax router (kernels/moe_router.py) against select_experts, the reference.

Without a GPU the kernel runs under TRITON_INTERPRET=1 (see conftest.py) on CPU tensors. Logits
are chosen tie-free (fp32: random normals; bf16: a shuffled grid of distinct bf16 values), so
the ids must match in order, not only as sets.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer.backends.cuda.kernels.moe_router import softmax_topk
from deepinfer.backends.cuda.ops import CUDAOps
from deepinfer.models.moe.routing import RouteCounts, RouterSpec, select_experts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _logits(g: torch.Generator, tokens: int, experts: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float32:
        x = 3 * torch.randn(tokens, experts, generator=g)
    else:  # multiples of 1/32 in [-E/64, E/64): distinct and exact in bf16
        x = torch.stack([torch.randperm(experts, generator=g) for _ in range(tokens)])
        x = (x - experts / 2) / 32
    return x.to(dtype=dtype, device=DEVICE)


def _check(logits: torch.Tensor, spec: RouterSpec) -> None:
    ref_w, ref_ids = select_experts(logits, spec)
    w, ids = softmax_topk(logits, spec.top_k, spec.renormalize, spec.scaling)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts", [8, 60, 128])
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_softmax_topk_equals_select_experts(experts: int, top_k: int, dtype: torch.dtype
                                            ) -> None:
    g = torch.Generator().manual_seed(1000 * experts + 10 * top_k + (dtype == torch.bfloat16))
    for tokens in (1, 5, 33):
        logits = _logits(g, tokens, experts, dtype)
        for renormalize in (False, True):
            for scaling in (1.0, 2.5):
                _check(logits, RouterSpec(experts, top_k, "softmax", renormalize,
                                          scaling=scaling))


def test_strided_logits_and_no_tokens() -> None:
    g = torch.Generator().manual_seed(3)
    wide = _logits(g, 7, 300, torch.float32)
    _check(wide[:, 10:138], RouterSpec(128, 8))  # a row stride of 300
    _check(wide[:, :256:2], RouterSpec(128, 4, renormalize=False))  # an expert stride of 2
    w, ids = softmax_topk(wide[:0, :64], 2, True)
    assert w.shape == ids.shape == (0, 2)


def test_ties_take_the_lowest_ids_first() -> None:
    w, ids = softmax_topk(torch.zeros(3, 16, device=DEVICE), 4, False)
    assert ids.tolist() == [[0, 1, 2, 3]] * 3
    torch.testing.assert_close(w, torch.full((3, 4), 1 / 16, device=DEVICE))


def test_rejects_bad_inputs() -> None:
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="top_k"):
        softmax_topk(x, 9, True)
    with pytest.raises(ValueError, match="float"):
        softmax_topk(x.to(torch.int32), 2, True)


def test_cuda_ops_route() -> None:
    """CUDAOps.route takes the kernel for softmax routers and the reference for sigmoid ones."""
    ops = CUDAOps(cache=None)
    g = torch.Generator().manual_seed(4)
    logits = _logits(g, 5, 64, torch.bfloat16)
    for spec in (RouterSpec(64, 8), RouterSpec(64, 6, "sigmoid", num_groups=8, topk_groups=3,
                                               scaling=2.5)):
        bias = torch.randn(64, generator=g).to(DEVICE) if spec.scoring == "sigmoid" else None
        w, ids = ops.route(logits, spec, bias)
        ref_w, ref_ids = select_experts(logits, spec, bias)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(w, ref_w, rtol=0, atol=1e-6)


def test_counts_match_the_reference_and_skip_padding_rows() -> None:
    """The router's per-expert counters (EPLB's load) equal RouteCounts.add, the reference:
    every real token's k routes, and nothing for the rows past num_real (graph padding)."""
    g = torch.Generator().manual_seed(5)
    logits = _logits(g, 9, 60, torch.float32)
    for num_real in (9, 6, 0):
        real = torch.tensor(num_real, device=DEVICE)
        counts = RouteCounts(torch.full((60,), 3, dtype=torch.int64, device=DEVICE), real)
        expected = RouteCounts(counts.counts.clone(), real)
        _, ids = softmax_topk(logits, 4, True, counts=counts)
        expected.add(ids)
        assert torch.equal(counts.counts, expected.counts)
        assert int(counts.counts.sum()) == 3 * 60 + 4 * num_real
        # CUDAOps.route counts with the kernel, the sigmoid reference with RouteCounts.add.
        for spec in (RouterSpec(60, 4), RouterSpec(60, 4, "sigmoid")):
            routed = RouteCounts(torch.zeros(60, dtype=torch.int64, device=DEVICE), real)
            _, ids = CUDAOps(cache=None).route(logits, spec, None, routed)
            assert torch.equal(routed.counts.cpu(), torch.bincount(
                ids[:num_real].reshape(-1).long().cpu(), minlength=60))
    with pytest.raises(ValueError, match="int64"):
        softmax_topk(logits, 4, True, counts=RouteCounts(torch.zeros(60, device=DEVICE), real))

