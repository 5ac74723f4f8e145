"""The batched decode step of DeepSeek-V4's compressors (deepinfer/models/deepseek_v4/
decode_compress.py) against the chunk step (compressor.py, itself checked against transformers
in test_deepseek_v4_compressor.py): three sequences, each prefilled to its own length through
the packed state slot, then decoded together one token a step across window closes and a
128-token page end. Every entry a closing token pools, and the carry-over at the page end,
equal the one-chunk compression of the whole sequence."""
from __future__ import annotations

import pytest
import torch

from deepinfer.models.deepseek_v4.compressor import CSA, HCA, build_compressor
from deepinfer.models.deepseek_v4.decode_compress import SlotRows, closes_window, decode_step
from tests.models.test_deepseek_v4_compressor import ATOL, _attention, _config

PREFILLS = (0, 5, 121)  # a fresh sequence, one inside a CSA window, one near the page end
STEPS = 140


def _compressors(layer_type: str, hca_rate: int):
    config = _config(hca_rate)
    comp = build_compressor(config, layer_type)
    comp.load_state_dict(_attention(config, config.layer_types.index(layer_type))
                         .compressor.state_dict())
    return [comp, comp.indexer] if layer_type == CSA else [comp]


@pytest.mark.parametrize("layer_type,hca_rate", [(CSA, 128), (HCA, 16)])
@torch.no_grad()
def test_decode_step_equals_the_chunk_step(layer_type, hca_rate):
    hidden = torch.randn(len(PREFILLS), max(PREFILLS) + STEPS, 64,
                         generator=torch.Generator().manual_seed(3))
    for comp in _compressors(layer_type, hca_rate):
        # The reference: each whole sequence in one chunk.
        full = [comp(h, 0, comp.initial_state(torch.float32))[0].entries for h in hidden]
        regions = []
        for b, n in enumerate(PREFILLS):
            _, state = comp(hidden[b, :n], 0, comp.initial_state(torch.float32))
            regions.append(comp.pack_state(state))
        slots = SlotRows.unpack(comp, torch.stack(regions))
        positions = torch.tensor(PREFILLS)
        closed = page_ends = 0
        for _ in range(STEPS):
            h = hidden[torch.arange(len(PREFILLS)), positions]
            entries, slots = decode_step(comp, comp.kv_proj(h), comp.gate_proj(h), positions,
                                         slots)
            # Through the slot's packing, as the engine keeps it between steps.
            slots = SlotRows.unpack(comp, slots.pack().clone())
            for b in closes_window(positions, comp.rate).nonzero().flatten().tolist():
                w = int(positions[b]) // comp.rate
                torch.testing.assert_close(entries[b], full[b][w], atol=ATOL, rtol=ATOL)
                closed += 1
            for b in ((positions + 1) % 128 == 0).nonzero().flatten().tolist():
                if comp.overlap:  # what page_end_rows stores for the page ending here
                    _, state = comp(hidden[b, :int(positions[b]) - 3], 0,
                                    comp.initial_state(torch.float32))
                    chunk = hidden[b, int(positions[b]) - 3:int(positions[b]) + 1]
                    ref = comp.page_end_rows(state, comp.kv_proj(chunk), comp.gate_proj(chunk),
                                             [int(positions[b]) + 1])[0]
                    torch.testing.assert_close(slots.carry_over()[b], ref, atol=ATOL,
                                               rtol=ATOL)
                page_ends += 1
            positions = positions + 1
        assert closed >= STEPS // comp.rate and page_ends == 4  # 127 of each, 255 of the third
