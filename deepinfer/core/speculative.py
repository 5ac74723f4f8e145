"""Speculative decoding's verification and counters, the same on every backend.

A sequence with drafts d_1..d_k runs its last token and the drafts through the model in one
forward; the model samples a token at each of those k + 1 positions as plain decoding would
there (position j sees d_1..d_j as output: penalties, min_tokens, and the noise of output step
`step + j`). Drafts are accepted while each equals the model's own choice at its position, and
the model's token after the last accepted draft comes with them: 1..k+1 tokens per step.

The draft is a point mass (the MTP layer's argmax), so this is exact rejection sampling for
every temperature: a draft d is kept with probability p(d) = min(1, p(d) / q(d)), and on
rejection the token is one drawn from p conditioned on differing from d, which is
norm(max(0, p - q)). Because each position's noise depends on (seed, step) only, a seeded
request gets exactly the tokens plain decoding gives it, greedy or not.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

from deepinfer.core.batch import (GroupBatch, ModelBatch, SampledRow, SamplerOutput,
                                  SamplingRow)


def as_decode_rows(batch: ModelBatch) -> ModelBatch | None:
    """A verify step whose every sequence runs its last token and k >= 1 drafts, as decode
    rows: one row per token, with that token's length and its sequence's block tables and
    state slot, `tokens_per_seq` = k + 1 (so a model with state steps it token by token).
    Its tokens, positions and slots are the batch's, in the same order. None for any other
    step (prefill chunks, unequal draft counts)."""
    spec, n = batch.spec, batch.num_seqs
    if spec is None or len(batch.sample_indices) != n or batch.num_padding_seqs:
        return None
    drafts = {i: len(d) for i, d in zip(batch.sample_indices, spec.draft_token_ids)}
    q = batch.query_lens[0]
    if q < 2 or any(batch.query_lens[i] != q or drafts[i] != q - 1 for i in range(n)):
        return None
    groups = tuple(GroupBatch([t for t in g.block_tables for _ in range(q)], g.slot_mapping)
                   for g in batch.groups)
    return dataclasses.replace(
        batch, query_lens=[1] * batch.num_tokens, seq_lens=[p + 1 for p in batch.positions],
        groups=groups, sample_indices=[], sampling=[],
        state_slots=[s for s in batch.state_slots for _ in range(q)], spec=None,
        tokens_per_seq=q)


def verify_rows(rows: Sequence[SamplingRow],
                drafts: Sequence[Sequence[int]]) -> list[SamplingRow]:
    """One sampling row per verified position: row i, then one per draft of row i."""
    out: list[SamplingRow] = []
    for row, row_drafts in zip(rows, drafts):
        out.append(row)
        out.extend(_at_draft(row, row_drafts, j) for j in range(1, len(row_drafts) + 1))
    return out


def _at_draft(row: SamplingRow, drafts: Sequence[int], j: int) -> SamplingRow:
    """The row as plain decoding would sample it after the first j drafts."""
    return dataclasses.replace(row, step=row.step + j,
                               output_token_ids=[*row.output_token_ids, *drafts[:j]])


def accepted_length(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading drafts equal the tokens sampled at their positions."""
    n = 0
    while n < len(drafts) and drafts[n] == sampled[n]:
        n += 1
    return n


def accept(sampled: SamplerOutput, drafts: Sequence[Sequence[int]]) -> list[SampledRow]:
    """Per row: its accepted drafts and the model's token after them (sampled has one token
    per verify_rows row)."""
    rows, k = [], 0
    for row_drafts in drafts:
        tokens = sampled.token_ids[k:k + len(row_drafts) + 1]
        n = accepted_length(row_drafts, tokens) + 1
        rows.append(SampledRow(tokens[:n], sampled.logprobs[k:k + n]))
        k += len(row_drafts) + 1
    return rows


@dataclass
class SpecDecodeStats:
    """Running totals of the drafts verified (vLLM's spec_decode counters)."""

    num_speculative_tokens: int = 0  # the configured k (0: speculative decoding is off)
    drafts: int = 0  # verified rows that had at least one draft
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # accepted_per_position[j]: drafts accepted at position j (j = 0 is the first draft)
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        self.drafts += 1
        self.draft_tokens += num_drafts
        self.accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
