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

from deepinfer.core.batch import GroupBatch, ModelBatch, SampledRow, SamplerOutput, SamplingRow
from deepinfer.core.kv.block_pool import NULL_BLOCK_ID


def as_decode_rows(batch: ModelBatch, pad_to: int | None = None,
                   null_state_slot: int = 0) -> ModelBatch | None:
    """A verify step whose every sequence runs its last token and its drafts, as decode rows:
    one row per token, with that token's length and its sequence's block tables and state
    slot, in runs of `tokens_per_seq` per sequence (so a model with state steps them token
    by token). Without `pad_to` every sequence must have the same k >= 1 drafts, and the rows
    are the batch's tokens in order. With it, every run is pad_to rows long: a sequence with
    fewer drafts gets null rows after its own (token 0 at position 0 in the null block, state
    in `null_state_slot`: what a graph's padding rows are). None for any other step (prefill
    chunks, padding sequences, more drafts than fit)."""
    spec, n = batch.spec, batch.num_seqs
    if spec is None or len(batch.sample_indices) != n or batch.num_padding_seqs:
        return None
    drafts = {i: len(d) for i, d in zip(batch.sample_indices, spec.draft_token_ids)}
    lens = batch.query_lens
    if any(lens[i] != drafts[i] + 1 for i in range(n)):
        return None  # a prefill chunk
    q = pad_to or lens[0]
    if q < 2 or any(length > q or (pad_to is None and length != q) for length in lens):
        return None
    return _runs(batch, q, null_state_slot)


def _runs(batch: ModelBatch, q: int, null_state_slot: int) -> ModelBatch:
    """The batch's tokens in runs of q rows per sequence, null rows after a shorter one's."""
    ids: list[int] = []
    positions: list[int] = []
    seq_lens: list[int] = []
    states: list[int] = []
    slots: list[list[int]] = [[] for _ in batch.groups]
    tables: list[list[list[int]]] = [[] for _ in batch.groups]
    start = 0
    for i, length in enumerate(batch.query_lens):
        pad = q - length
        ids += batch.input_ids[start:start + length] + [0] * pad
        own = batch.positions[start:start + length]
        positions += own + [0] * pad
        seq_lens += [p + 1 for p in own] + [1] * pad
        for g, group in enumerate(batch.groups):
            slots[g] += group.slot_mapping[start:start + length] + [0] * pad
            tables[g] += [group.block_tables[i]] * length + [[NULL_BLOCK_ID]] * pad
        if batch.state_slots:
            states += [batch.state_slots[i]] * length + [null_state_slot] * pad
        start += length
    groups = tuple(GroupBatch(t, s) for t, s in zip(tables, slots))
    return dataclasses.replace(
        batch, input_ids=ids, positions=positions, query_lens=[1] * len(ids),
        seq_lens=seq_lens, groups=groups, sample_indices=[], sampling=[], state_slots=states,
        spec=None, tokens_per_seq=q)


def run_rows(query_lens: Sequence[int], q: int) -> list[int]:
    """Per token of a verify batch, its row in the runs of q (as_decode_rows' pad_to)."""
    return [i * q + j for i, length in enumerate(query_lens) for j in range(length)]


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
