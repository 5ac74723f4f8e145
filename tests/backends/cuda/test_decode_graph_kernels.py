"""The kernels a decode graph begins and ends with: the row unpack (ids from the step in flight)
against the numpy rows it reads, and the greedy argmax against torch.argmax.

Without a GPU they run under TRITON_INTERPRET=1 (see conftest.py) on CPU tensors; outputs are
poisoned first.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.backends.cuda.kernels.argmax import BLOCK, greedy_ids
from deepinfer.backends.cuda.step_inputs import (
    DECODE_COLS,
    SRC_COL,
    decode_inputs,
    fill_decode_rows,
)
from deepinfer.core.batch import GroupBatch, InputsFromLastStep, ModelBatch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows,vocab", [(1, 5 * BLOCK + 77), (3, 300), (2, 2 * BLOCK)])
def test_argmax_equals_torch(rows: int, vocab: int) -> None:
    g = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=g).to(DEVICE)
    out = torch.full((rows,), -7, dtype=torch.int64, device=DEVICE)
    assert torch.equal(greedy_ids(logits, out=out), logits.argmax(dim=-1))


def test_argmax_ties_go_to_the_first_index() -> None:
    """Equal maxima within one part, across parts, and a row of one value everywhere: the
    first maximal index wins, as torch's."""
    vocab = 3 * BLOCK + 5
    logits = torch.zeros(4, vocab)
    logits[0, [BLOCK + 9, BLOCK + 3, 2 * BLOCK + 1]] = 2.0  # same part, then a later part
    logits[1, [3 * BLOCK + 4, BLOCK]] = 1.5  # the tail part, and an earlier one
    logits[2, [7, 3 * BLOCK + 4]] = -1.0  # maxima of zero everywhere else: index 0
    logits[3] = -3.0
    logits = logits.to(DEVICE)
    got = greedy_ids(logits)
    assert got.tolist() == [BLOCK + 3, BLOCK, 0, 0] == logits.argmax(dim=-1).tolist()


def test_argmax_takes_strided_rows_and_refuses_bad_out() -> None:
    wide = torch.randn(3, 400).to(DEVICE)
    logits = wide[:, :300]
    assert torch.equal(greedy_ids(logits), logits.argmax(dim=-1))
    with pytest.raises(ValueError, match="int64"):
        greedy_ids(logits, out=torch.empty(3, dtype=torch.int32, device=DEVICE))


def _decode_batch(from_last: InputsFromLastStep | None) -> ModelBatch:
    """Three decodes over blocks of 4 tokens: lengths 6, 9, 1."""
    tables = [[5, 2], [7, 8, 3], [4]]
    lens = [6, 9, 1]
    slots = [t[(n - 1) // 4] * 4 + (n - 1) % 4 for t, n in zip(tables, lens)]
    return ModelBatch(input_ids=[11, 0, 0], positions=[n - 1 for n in lens],
                      query_lens=[1, 1, 1], seq_lens=lens, groups=(GroupBatch(tables, slots),),
                      sample_indices=[0, 1, 2], sampling=[],
                      from_last_step=from_last)


def test_unpack_takes_ids_from_the_step_in_flight() -> None:
    """Rows 1 and 2 take their ids from rows 3 and 0 of the last step's ids; row 0 keeps its
    own; the padding row attends one null-block token and writes no KV."""
    last = InputsFromLastStep(token_indices=[1, 2], rows=[3, 0], source=None)
    batch = _decode_batch(last)
    rows = np.full((4, DECODE_COLS + 5), 99, dtype=np.int64)
    fill_decode_rows(rows, batch, 4)
    assert rows[:, SRC_COL].tolist() == [-1, 3, 0, -1]
    last_ids = torch.tensor([40, 41, 42, 43], device=DEVICE)
    inputs = decode_inputs(torch.from_numpy(rows).to(DEVICE), last_ids, num_splits=2)
    assert inputs.input_ids.tolist() == [11, 43, 40, 0]
    assert inputs.positions.tolist() == [5, 8, 0, 0]
    assert inputs.meta.slot_mapping.tolist() == batch.slot_mapping + [-1]
    assert inputs.meta.seq_lens.dtype == torch.int32
    assert inputs.meta.seq_lens.tolist() == [6, 9, 1, 1]
    tables = inputs.meta.block_tables
    assert tables.dtype == torch.int32 and tables.shape == (4, 5)
    assert tables.tolist() == [[5, 2, 0, 0, 0], [7, 8, 3, 0, 0], [4, 0, 0, 0, 0], [0] * 5]
    assert inputs.meta.num_splits == 2 and inputs.meta.decode


def test_unpack_of_a_wide_block_table() -> None:
    """Block tables wider than one program's chunk are copied whole."""
    width = 700
    rows = torch.arange(2 * (DECODE_COLS + width), dtype=torch.int64).view(2, -1).to(DEVICE)
    rows[:, SRC_COL] = -1
    inputs = decode_inputs(rows, torch.zeros(1, dtype=torch.int64, device=DEVICE), 1)
    assert torch.equal(inputs.meta.block_tables, rows[:, DECODE_COLS:].to(torch.int32))
    assert torch.equal(inputs.input_ids, rows[:, 0])
