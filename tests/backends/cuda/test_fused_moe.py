"""The fused MoE kernels against the reference expert loop (fused_experts_reference).

Without a GPU they run under TRITON_INTERPRET=1 (see conftest.py) on CPU tensors, so the shapes
are tiny: H 32, F 48 and 5 expert slots (a multiple of no tile), with some routes served
elsewhere (slot -1) and a slot no route picks. The align step is checked on its own too.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer.backends.cuda.kernels.fused_moe import (
    MoeConfig,
    Tiles,
    align_routes,
    config_for,
    fused_experts,
)
from deepinfer.backends.cuda.kernels.moe_gemv import GemvTiles, MoeGemvConfig, moe_gemv, takes
from deepinfer.models.moe.experts import fused_experts_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, F, SLOTS, IDLE = 32, 48, 5, 2  # slot IDLE gets no routes
# BLOCK_N 16 and 32 against F 48: whole and wrapped column tiles; BLOCK_K 32 against H 32 and
# F 48: an even and a masked K loop.
CONFIGS = [MoeConfig(16, Tiles(16, 32, 4, 1), Tiles(16, 32, 4, 1)),
           MoeConfig(32, Tiles(32, 16, 4, 2), Tiles(32, 32, 4, 2))]
pytestmark = pytest.mark.usefixtures("gpu_bf16_rounding")


def _slots(g: torch.Generator, tokens: int, top_k: int, num_slots: int = SLOTS) -> torch.Tensor:
    """Random distinct slots per token, never IDLE, about one route in five served elsewhere
    (-1)."""
    choices = torch.tensor([s for s in range(num_slots) if s != IDLE])
    picks = torch.stack([choices[torch.randperm(len(choices), generator=g)[:top_k]]
                         for _ in range(tokens)])
    elsewhere = torch.rand(tokens, top_k, generator=g) < 0.2
    return torch.where(elsewhere, -1, picks).to(torch.int32)


def _problem(g: torch.Generator, tokens: int, top_k: int, dtype: torch.dtype):
    x = torch.randn(tokens, H, generator=g)
    w13 = torch.randn(SLOTS, 2 * F, H, generator=g) / H ** 0.5
    w2 = torch.randn(SLOTS, H, F, generator=g) / F ** 0.5
    weights = torch.rand(tokens, top_k, generator=g)
    slots = _slots(g, tokens, top_k)
    return ([t.to(dtype=dtype, device=DEVICE) for t in (x, w13, w2)]
            + [weights.to(DEVICE), slots.to(DEVICE)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_fused_experts_equals_reference(tokens: int, top_k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(100 * tokens + top_k)
    x, w13, w2, weights, slots = _problem(g, tokens, top_k, dtype)
    # The reference in float32 on the same (rounded) inputs: bf16 is then off by the rounding
    # of the intermediate and of the k per-route rows, each a few 1e-3 at most.
    ref = fused_experts_reference(x.float(), w13.float(), w2.float(), weights, slots)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for config in CONFIGS:
        out = fused_experts(x, w13, w2, weights, slots, config)
        assert out.shape == x.shape and out.dtype == dtype
        torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def test_default_config_and_edge_cases() -> None:
    g = torch.Generator().manual_seed(7)
    x, w13, w2, weights, slots = _problem(g, 3, 2, torch.float32)
    ref = fused_experts_reference(x, w13, w2, weights, slots)
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, slots), ref,
                               rtol=1e-5, atol=1e-5)
    nowhere = torch.full_like(slots, -1)  # every route served by another rank
    assert torch.equal(fused_experts(x, w13, w2, weights, nowhere), torch.zeros_like(x))
    assert fused_experts(x[:0], w13, w2, weights[:0], slots[:0]).shape == (0, H)


def test_rejects_bad_inputs() -> None:
    g = torch.Generator().manual_seed(8)
    x, w13, w2, weights, slots = _problem(g, 3, 2, torch.float32)
    with pytest.raises(ValueError, match="int32"):
        fused_experts(x, w13, w2, weights, slots.long())
    with pytest.raises(ValueError, match="w13"):
        fused_experts(x, w13, w2[:, :, :-1], weights, slots)
    with pytest.raises(ValueError, match="both be"):
        fused_experts(x, w13, w2, weights[:, :1], slots)


@pytest.mark.parametrize("tokens,top_k,num_slots,block_m,max_chunk", [
    (1, 1, 5, 16, 1024),  # decode: one route
    (17, 4, 5, 16, 1024),  # one align program
    (17, 4, 5, 16, 16),  # five: per-chunk counts, then each chunk placed after the ones ahead
    (40, 2, 33, 32, 32),  # slots past a power of two, more blocks than one program labels
])
def test_align_routes(tokens: int, top_k: int, num_slots: int, block_m: int,
                      max_chunk: int) -> None:
    g = torch.Generator().manual_seed(tokens * num_slots)
    slots = _slots(g, tokens, top_k, num_slots).to(DEVICE)
    al = align_routes(slots, num_slots, block_m, max_chunk)
    flat, n = slots.reshape(-1).cpu(), slots.numel()
    routes, block_slots = al.routes.cpu().view(-1, block_m), al.block_slots.cpu()
    served = routes[routes < n]
    # Every route served here appears once; every other row is padding (the id n).
    assert sorted(served.tolist()) == [i for i in range(n) if flat[i] >= 0]
    assert ((routes < n) | (routes == n)).all()
    used = block_slots >= 0
    assert used.sum() == sum(-(-int((flat == s).sum()) // block_m) for s in range(num_slots))
    assert used[:int(used.sum())].all()  # used blocks first, by slot, then unused ones
    assert (block_slots[used].diff() >= 0).all()
    for row, slot in zip(routes, block_slots.tolist()):
        live = row[row < n]
        assert (row[:len(live)] == live).all()  # padding at the end of a block
        if slot < 0:
            assert len(live) == 0
        else:  # one slot per block, in route order (stable)
            assert len(live) > 0 and (flat[live.long()] == slot).all()
            assert (live.diff() > 0).all()


def test_configs_cover_the_model_shapes() -> None:
    for tokens, top_k, slots in ((1, 8, 128), (8192, 8, 128), (1, 2, 8), (8192, 2, 8)):
        cfg = config_for(tokens, top_k, slots)
        assert cfg.block_m in (16, 32, 64, 128)
    assert config_for(1, 8, 128).block_m == 16  # decode: weight-bound GEMVs


def test_tiles_fit_shared_memory_in_every_dtype():
    from deepinfer.backends.cuda.kernels.fused_moe import (
        MOE_CONFIGS,
        SHARED_MEMORY_BYTES,
        fit_tiles,
    )

    for _, cfg in MOE_CONFIGS:
        for size in (2, 4):
            for tiles, b in ((cfg.gate_up, 2), (cfg.down, 1)):
                fitted = fit_tiles(tiles, cfg.block_m, size, b)
                need = fitted.num_stages * (cfg.block_m + b * fitted.block_n) * fitted.block_k
                assert need * size <= SHARED_MEMORY_BYTES
                if size == 2:
                    assert fitted == tiles  # the tuned bf16 tiles already fit: unchanged


# BLOCK_N 16 and 32 against F 48 / H 32: whole and partial row tiles; BLOCK_K 32 against H 32
# and F 48: an even and a masked K loop; BLOCK_K 64: one step past the end.
GEMV_CONFIGS = [MoeGemvConfig(GemvTiles(16, 32, 4), GemvTiles(16, 32, 4)),
                MoeGemvConfig(GemvTiles(32, 64, 2), GemvTiles(32, 16, 2))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 3, 4])
@pytest.mark.parametrize("tokens", [1, 2, 4])
def test_moe_gemv_equals_reference(tokens: int, top_k: int, dtype: torch.dtype) -> None:
    """The few-token path (each route's expert as GEMVs, the k routes summed in one program),
    k = 3 padded to 4 lanes, routes served elsewhere skipped."""
    g = torch.Generator().manual_seed(1000 + 10 * tokens + top_k)
    x, w13, w2, weights, slots = _problem(g, tokens, top_k, dtype)
    ref = fused_experts_reference(x.float(), w13.float(), w2.float(), weights, slots)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for config in GEMV_CONFIGS:
        out = moe_gemv(x, w13, w2, weights, slots, config)
        assert out.shape == x.shape and out.dtype == dtype
        torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    # fused_experts takes this path by itself at decode sizes, the grouped GEMMs above it.
    assert takes(1, 8, 128) and takes(8, 8, 128) and not takes(16, 8, 128)
    assert takes(2, 2, 8) and not takes(4, 2, 8)
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, slots).float(), ref,
                               rtol=tol, atol=tol)
    nowhere = torch.full_like(slots, -1)
    assert torch.equal(moe_gemv(x, w13, w2, weights, nowhere), torch.zeros_like(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k", [(2, 2), (17, 3)])
def test_swiglu_limit_clamps_gate_and_up(tokens: int, top_k: int, dtype: torch.dtype) -> None:
    """DeepSeek-V4's swiglu_limit: silu(min(gate, limit)) * clamp(up, -limit, limit), in the
    grouped GEMMs (every config), in the GEMV path, and through fused_experts' own choice of
    path. Pre-activations are ~N(0, 1): a limit of 0.5 clamps most of them."""
    g = torch.Generator().manual_seed(300 + 10 * tokens + top_k)
    x, w13, w2, weights, slots = _problem(g, tokens, top_k, dtype)
    args = (x.float(), w13.float(), w2.float(), weights, slots)
    ref = fused_experts_reference(*args, swiglu_limit=0.5)
    assert (ref - fused_experts_reference(*args)).abs().max() > 0.1  # the clamp matters
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    outs = [fused_experts(x, w13, w2, weights, slots, config, swiglu_limit=0.5)
            for config in CONFIGS]
    outs += [moe_gemv(x, w13, w2, weights, slots, config, swiglu_limit=0.5)
             for config in GEMV_CONFIGS]
    outs.append(fused_experts(x, w13, w2, weights, slots, swiglu_limit=0.5))
    for out in outs:
        assert out.shape == x.shape and out.dtype == dtype
        torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
