"""The one-kernel MoE router (kernels/moe_router.py) against select_experts, the reference.

Without a GPU the kernel runs under TRITON_INTERPRET=1 (see conftest.py) on CPU tensors. Softmax
logits are chosen tie-free (fp32: random normals; bf16: a shuffled grid of distinct bf16
values), so the ids must match in order, not only as sets. The reference's sigmoid routers take
torch.topk(sorted=False), whose order is unspecified: those compare each row's (id, weight)
pairs sorted by id.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer.backends.cuda.kernels.moe_router import route_topk, takes
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


def _by_id(w: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=1)
    return w.gather(1, order), ids.gather(1, order)


def _check(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None = None) -> None:
    ref_w, ref_ids = select_experts(logits, spec, bias)
    w, ids = route_topk(logits, spec, bias)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    if spec.scoring != "softmax":
        (w, ids), (ref_w, ref_ids) = _by_id(w, ids), _by_id(ref_w, ref_ids)
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


@pytest.mark.parametrize("experts,top_k,groups,topk_groups", [
    (64, 6, 1, 1),  # DeepSeek-V2-Lite's widths, no groups
    (60, 4, 1, 1),  # E not a power of two: padded experts are never picked
    (64, 6, 8, 3),
    (256, 8, 8, 4),  # DeepSeek-V3's
])
def test_sigmoid_routers_equal_select_experts(experts: int, top_k: int, groups: int,
                                              topk_groups: int) -> None:
    """Sigmoid scores, the bias that picks but does not weigh, and group-limited routing: the
    bias is wide enough to change which experts win (a test that fails if it is dropped or
    added to the weights), and with groups the winners differ from the ungrouped ones."""
    g = torch.Generator().manual_seed(experts + 7 * groups)
    for tokens in (1, 5, 33):
        logits = _logits(g, tokens, experts, torch.float32)
        bias = (0.5 * torch.randn(experts, generator=g)).to(DEVICE)
        for renormalize, scaling in ((True, 2.5), (False, 1.0)):
            spec = RouterSpec(experts, top_k, "sigmoid", renormalize, groups, topk_groups,
                              scaling)
            _check(logits, spec, bias)
            _check(_logits(g, tokens, experts, torch.bfloat16), spec, None)  # tie-free
    free = select_experts(logits, RouterSpec(experts, top_k, "sigmoid"), bias)[1]
    grouped = route_topk(logits, RouterSpec(experts, top_k, "sigmoid", True, groups,
                                            topk_groups), bias)[1]
    unbiased = route_topk(logits, RouterSpec(experts, top_k, "sigmoid"))[1]
    assert not torch.equal(free.sort(1)[0], unbiased.sort(1)[0].to(free.device))
    assert (groups == 1) == torch.equal(free.sort(1)[0], grouped.sort(1)[0])


def test_which_routers_the_kernel_takes() -> None:
    assert takes(RouterSpec(256, 8, "sigmoid", num_groups=8, topk_groups=4), 256)
    assert takes(RouterSpec(60, 4, "sigmoid"), 60)
    assert not takes(RouterSpec(96, 4, "sigmoid", num_groups=4, topk_groups=2), 96)
    assert not takes(RouterSpec(64, 6, "sqrtsoftplus"), 64)
    assert not takes(RouterSpec(2048, 8), 2048)


def test_strided_logits_and_no_tokens() -> None:
    g = torch.Generator().manual_seed(3)
    wide = _logits(g, 7, 300, torch.float32)
    _check(wide[:, 10:138], RouterSpec(128, 8))  # a row stride of 300
    _check(wide[:, :256:2], RouterSpec(128, 4, renormalize=False))  # an expert stride of 2
    _check(wide[:, 10:138], RouterSpec(128, 8, "sigmoid", num_groups=4, topk_groups=2))
    w, ids = route_topk(wide[:0, :64], RouterSpec(64, 2))
    assert w.shape == ids.shape == (0, 2)


def test_ties_take_the_lowest_ids_first() -> None:
    w, ids = route_topk(torch.zeros(3, 16, device=DEVICE), RouterSpec(16, 4, renormalize=False))
    assert ids.tolist() == [[0, 1, 2, 3]] * 3
    torch.testing.assert_close(w, torch.full((3, 4), 1 / 16, device=DEVICE))


def test_rejects_bad_inputs() -> None:
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="float"):
        route_topk(x.to(torch.int32), RouterSpec(8, 2))
    with pytest.raises(ValueError, match="does not take"):
        route_topk(x, RouterSpec(16, 2))  # a spec of another expert count
    with pytest.raises(ValueError, match="does not take"):
        route_topk(x, RouterSpec(8, 2, "sqrtsoftplus"))
    with pytest.raises(ValueError, match="bias"):
        route_topk(x, RouterSpec(8, 2, "sigmoid"), torch.zeros(9, device=DEVICE))


def test_cuda_ops_route() -> None:
    """CUDAOps.route takes the kernel for softmax and sigmoid routers and the reference for
    sqrtsoftplus ones; both agree with select_experts."""
    ops = CUDAOps(cache=None)
    g = torch.Generator().manual_seed(4)
    logits = _logits(g, 5, 64, torch.bfloat16)
    bias = torch.randn(64, generator=g).to(DEVICE)
    for spec in (RouterSpec(64, 8), RouterSpec(64, 6, "sigmoid", num_groups=8, topk_groups=3,
                                               scaling=2.5), RouterSpec(64, 6, "sqrtsoftplus")):
        w, ids = ops.route(logits, spec, bias)
        ref_w, ref_ids = select_experts(logits, spec, bias)
        (w, ids), (ref_w, ref_ids) = _by_id(w, ids), _by_id(ref_w, ref_ids)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(w, ref_w, rtol=0, atol=1e-6)


def test_counts_match_the_reference_and_skip_padding_rows() -> None:
    """The router's per-expert counters (EPLB's load) equal RouteCounts.add, the reference:
    every real token's k routes, and nothing for the rows past num_real (graph padding)."""
    g = torch.Generator().manual_seed(5)
    logits = _logits(g, 9, 60, torch.float32)
    for num_real in (9, 6, 0):
        real = torch.tensor(num_real, device=DEVICE)
        for spec in (RouterSpec(60, 4), RouterSpec(60, 4, "sigmoid"),
                     RouterSpec(60, 4, "sqrtsoftplus")):
            counts = RouteCounts(torch.full((60,), 3, dtype=torch.int64, device=DEVICE), real)
            _, ids = CUDAOps(cache=None).route(logits, spec, None, counts)
            expected = RouteCounts(torch.full((60,), 3, dtype=torch.int64, device=DEVICE), real)
            expected.add(ids)
            assert torch.equal(counts.counts, expected.counts)
            assert int(counts.counts.sum()) == 3 * 60 + 4 * num_real
    with pytest.raises(ValueError, match="int64"):
        route_topk(logits, RouterSpec(60, 4),
                   counts=RouteCounts(torch.zeros(60, device=DEVICE), real))
