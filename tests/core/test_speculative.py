"""Speculative decoding's verification rule and counters (core/speculative.py), and the
engine's refusal on a backend without it."""
from __future__ import annotations

import pytest

from deepinfer.core.batch import GroupBatch, ModelBatch, SamplerOutput, SamplingRow, SpecBatch
from deepinfer.core.config import EngineConfig, ModelSpec, SchedulerConfig
from deepinfer.core.engine import Engine
from deepinfer.core.sampling import SamplingParams
from deepinfer.core.speculative import (
    SpecDecodeStats,
    accept,
    as_decode_rows,
    run_rows,
    verify_rows,
)
from tests.core.fakes import PagedFakeAccelerator, write_config


def test_each_draft_position_samples_as_plain_decoding_would_there():
    row = SamplingRow(SamplingParams(temperature=0.7), seed=3, step=4, prompt_token_ids=[1],
                      output_token_ids=[5, 6])
    rows = verify_rows([row], [[7, 8]])
    assert [r.step for r in rows] == [4, 5, 6]
    assert [list(r.output_token_ids) for r in rows] == [[5, 6], [5, 6, 7], [5, 6, 7, 8]]
    assert verify_rows([row], [[]]) == [row]


def test_accepts_the_agreeing_drafts_then_the_models_own_token():
    # Row 0: drafts 7, 8, 9; the model chose 7, 8, 4 (rejecting 9), then 2 after a 9.
    # Row 1: no drafts (a prefill's last chunk). Row 2: its only draft rejected.
    sampled = SamplerOutput([7, 8, 4, 2, 11, 30, 31], list("abcdefg"))
    rows = accept(sampled, [[7, 8, 9], [], [29]])
    assert [r.token_ids for r in rows] == [[7, 8, 4], [11], [30]]
    assert [r.logprobs for r in rows] == [list("abc"), ["e"], ["f"]]


def _verify_batch(query_lens: list[int], drafts: list[int], sampled: int) -> ModelBatch:
    """Sequence i at positions 10 * (i + 1) ..., block table [i + 1], state slot 5 + i."""
    ids, positions, slots = [], [], []
    for i, q in enumerate(query_lens):
        ids += [100 + i] * q
        positions += range(10 * (i + 1), 10 * (i + 1) + q)
        slots += [(i + 1) * 16 + p % 16 for p in range(10 * (i + 1), 10 * (i + 1) + q)]
    seq_lens = [10 * (i + 1) + q for i, q in enumerate(query_lens)]
    row = SamplingRow(SamplingParams(), 0, 0, [1], [])
    spec = SpecBatch([[7] * d for d in drafts], [2] * sampled, [-1] * len(query_lens))
    return ModelBatch(ids, positions, query_lens, seq_lens,
                      (GroupBatch([[i + 1] for i in range(len(query_lens))], slots),),
                      list(range(sampled)), [row] * sampled, [5, 6], spec=spec)


def test_verify_steps_as_decode_rows():
    """Each token its own row (its own length; its sequence's table and state slot), in
    runs of k + 1; with pad_to, a shorter run gets null rows; prefill chunks: None."""
    rows = as_decode_rows(_verify_batch([3, 3], [2, 2], 2))
    assert rows.tokens_per_seq == 3 and rows.is_decode_only
    assert rows.seq_lens == [11, 12, 13, 21, 22, 23] and rows.state_slots == [5] * 3 + [6] * 3
    assert rows.groups[0].block_tables == [[1]] * 3 + [[2]] * 3
    assert as_decode_rows(_verify_batch([3, 2], [2, 1], 2)) is None  # unequal, no padding
    padded = as_decode_rows(_verify_batch([3, 2], [2, 1], 2), pad_to=3, null_state_slot=9)
    assert padded.input_ids == [100] * 3 + [101, 101, 0]
    assert padded.positions == [10, 11, 12, 20, 21, 0] and padded.seq_lens[-1] == 1
    assert padded.state_slots == [5, 5, 5, 6, 6, 9]
    assert padded.groups[0].slot_mapping[-1] == 0 and padded.groups[0].block_tables[-1] == [0]
    assert run_rows([3, 2], 3) == [0, 1, 2, 3, 4]
    assert as_decode_rows(_verify_batch([3, 4], [2, 2], 1)) is None  # a prefill chunk
    assert as_decode_rows(_verify_batch([3, 4], [2, 3], 2), pad_to=3) is None  # too long


def test_counters():
    stats = SpecDecodeStats(3)
    for drafts, accepted in [(3, 3), (3, 1), (2, 0), (0, 0)]:
        stats.record(drafts, accepted)
    assert (stats.drafts, stats.draft_tokens, stats.accepted_tokens) == (3, 8, 4)
    assert stats.accepted_per_position == [2, 1, 1]
    assert stats.acceptance_rate == 0.5


def test_a_backend_without_it_is_refused(tmp_path):
    config = EngineConfig(ModelSpec(write_config(str(tmp_path))),
                          scheduler=SchedulerConfig(num_speculative_tokens=2))
    with pytest.raises(ValueError, match="fake backend does not run speculative decoding"):
        Engine(config, PagedFakeAccelerator(), load_tokenizer=False)
