"""UVAPageCopier's argument checks, which run before anything touches CUDA."""
from __future__ import annotations

import pytest
import torch

from deepinfer.backends.cuda.page_copy import UVAPageCopier, validate_layout

LAYERS, BLOCK, HEADS, DIM = 2, 4, 2, 8


def _kv(blocks: int = 3, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.zeros(LAYERS, 2, blocks * BLOCK, HEADS, DIM, dtype=dtype)


def _host(pages: int = 5, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.zeros(pages, LAYERS, 2, BLOCK, HEADS, DIM, dtype=dtype)


@pytest.mark.parametrize("host, kv, block_size, match", [
    (_host(), _kv()[0], BLOCK, "kv must be"),
    (_host(), _kv(), 5, "not a multiple of block_size"),
    (_host()[:, :1], _kv(), BLOCK, "host_pool must be"),
    (_host().view(5, LAYERS, 2, -1)[..., :-8], _kv(), BLOCK, "host_pool must be"),
    (_host(dtype=torch.float32), _kv(), BLOCK, "dtype"),
    (_host().transpose(0, 1).contiguous().transpose(0, 1), _kv(), BLOCK, "contiguous"),
    (_host(), _kv(), BLOCK, "CUDA device"),
])
def test_layout_errors(host, kv, block_size, match):
    with pytest.raises(ValueError, match=match):
        validate_layout(host, kv, block_size)
    with pytest.raises(ValueError, match=match):
        UVAPageCopier().copy(host, kv, [0], [1], block_size, to_device=True)


def test_flat_page_layout_is_accepted_up_to_placement():
    host = _host().view(5, LAYERS, 2, BLOCK * HEADS * DIM)
    with pytest.raises(ValueError, match="CUDA device"):  # every shape check passed
        validate_layout(host, _kv(), BLOCK)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["copy", "copy_memcpy"])
def test_round_trip_matches_gather(method):
    torch.manual_seed(0)
    kv = torch.randn(LAYERS, 2, 6 * BLOCK, HEADS, DIM, device="cuda").to(torch.bfloat16)
    host = torch.randn(5, LAYERS, 2, BLOCK, HEADS, DIM).to(torch.bfloat16).pin_memory()
    copy = getattr(UVAPageCopier(), method)
    pages, blocks = [3, 0, 4], [5, 2, 1]
    paged = kv.view(LAYERS, 2, 6, BLOCK, HEADS, DIM)
    copy(host, kv, pages, torch.tensor(blocks, device="cuda"), BLOCK, to_device=True)
    torch.cuda.synchronize()
    assert torch.equal(paged[:, :, blocks].cpu(), host[pages].permute(1, 2, 0, 3, 4, 5))
    host[pages] = 0
    copy(host, kv, torch.tensor(pages), blocks, BLOCK, to_device=False)
    torch.cuda.synchronize()
    assert torch.equal(host[pages], paged[:, :, blocks].permute(2, 0, 1, 3, 4, 5).cpu())
