"""The compressor decode kernel (kernels/compress_decode.py) against its reference
(models/deepseek_v4/decode_compress.decode_compress) on the same paged storage, under the
interpreter on CPU or on the GPU: three sequences from random states at different positions,
one token a step for 16 steps, across window closes and the 128-token page ends, with a padding
row sharing the spare state slot. The state slots and page_state rows must be equal bit for bit
(they are copies of the projected rows) and every written entry equal to rounding."""
from __future__ import annotations

import pytest
import torch

from deepinfer.backends.cuda.kernels.compress_decode import compress_decode
from deepinfer.models.deepseek_v4.compressor import CSA, HCA, PAGE_TOKENS, build_compressor
from deepinfer.models.deepseek_v4.decode_compress import decode_compress
from deepinfer.models.deepseek_v4.paged_ops import DecodeTarget, PagedRows
from tests.models.test_deepseek_v4_compressor import _attention, _config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("gpu_bf16_rounding")  # the interpreter rounds as a GPU
# Positions of each sequence's first decoded token: a first window (no previous one), the
# first page end (127) and the second (255) within STEPS.
STARTS = (0, 118, 250)
STEPS = 16
BLOCK = 128
PAGES = 3  # per sequence: positions up to 384


def _storage(comp, dtype: torch.dtype, page_numel: int, g: torch.Generator) -> dict:
    batch = len(STARTS) + 1  # the last row pads: the spare slot, the null block's tables
    blocks = 1 + PAGES * len(STARTS)
    tables = torch.zeros(batch, PAGES, dtype=torch.int32)
    tables[:-1] = torch.arange(1, blocks).view(len(STARTS), PAGES)
    return {
        "states": torch.randn(batch, comp.state_numel + 8, generator=g).to(dtype),
        "slots": torch.tensor([2, 0, 1, 3]),
        "entries": torch.zeros(blocks * BLOCK // comp.rate, comp.head_dim, dtype=dtype),
        "page_state": torch.zeros(blocks, page_numel, dtype=dtype),
        "tables": tables}


def _target(comp, store: dict, overlap_offset: int) -> DecodeTarget:
    on = {k: v.to(DEVICE).clone() for k, v in store.items()}  # each side its own copy
    page = PagedRows(on["page_state"], on["tables"], BLOCK, PAGE_TOKENS) if comp.overlap \
        else None
    return DecodeTarget(on["states"], on["slots"], 8, PagedRows(on["entries"], on["tables"],
                                                                 BLOCK, comp.rate),
                        page, overlap_offset)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer_type,hca_rate,indexer", [(CSA, 128, False), (CSA, 128, True),
                                                         (HCA, 16, False)])
@torch.no_grad()
def test_kernel_equals_the_reference(dtype, layer_type, hca_rate, indexer):
    config = _config(hca_rate)
    comp = build_compressor(config, layer_type)
    comp.load_state_dict(_attention(config, config.layer_types.index(layer_type))
                         .compressor.state_dict())
    comp = (comp.indexer if indexer else comp).to(DEVICE)
    comp.kv_proj.to(dtype), comp.gate_proj.to(dtype)  # float32 bias and norm, as V4 loads
    g = torch.Generator().manual_seed(7)
    store = _storage(comp, dtype, 3 * comp.page_state_numel, g)
    # The indexer's carry-over sits after the compressor's in a page_state row.
    offset = comp.page_state_numel if indexer else 0
    ours, ref = _target(comp, store, offset), _target(comp, store, offset)
    positions = torch.tensor(list(STARTS) + [0], device=DEVICE)
    hidden = torch.randn(STEPS, len(positions), 64, generator=g).to(dtype).to(DEVICE)
    for step in range(STEPS):
        kv, gate = comp.kv_proj(hidden[step]), comp.gate_proj(hidden[step])
        compress_decode(comp, kv, gate, positions, ours)
        decode_compress(comp, kv, gate, positions, ref)
        positions[:-1] += 1  # the padding row stays at position 0
    real = slice(BLOCK // comp.rate, None)  # rows past the null block
    assert torch.equal(ours.states[ours.slots[:-1]], ref.states[ref.slots[:-1]])
    written = ref.entries.cache[real].abs().sum(-1) > 0
    assert written.sum() >= len(STARTS) * (STEPS // comp.rate)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(ours.entries.cache[real].float(), ref.entries.cache[real].float(),
                               **tol)
    if comp.overlap:
        assert torch.equal(ours.page_state.cache[1:], ref.page_state.cache[1:])
        assert (ref.page_state.cache[1:].abs().sum(-1) > 0).sum() == 2  # 127 and 255
