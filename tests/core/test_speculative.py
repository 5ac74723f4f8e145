"""Speculative decoding's verification rule and counters (core/speculative.py), and the
engine's refusal on a backend without it."""
from __future__ import annotations

import pytest

from deepinfer.core.batch import SamplerOutput, SamplingRow
from deepinfer.core.config import EngineConfig, ModelSpec, SchedulerConfig
from deepinfer.core.engine import Engine
from deepinfer.core.sampling import SamplingParams
from deepinfer.core.speculative import SpecDecodeStats, accept, verify_rows
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
