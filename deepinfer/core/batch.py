"""Messages between the scheduler and a backend. Plain host data: the scheduler never sees a
device tensor, and a backend never sees a Request, only this description of one step."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from deepinfer.core.sampling import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    """Everything the sampler needs for one sequence whose next token is sampled this step."""

    params: SamplingParams
    # Effective seed: the request's own, or one drawn for it at arrival. Noise for output
    # position `step` depends on (seed, step) only, so a seeded request samples the same tokens
    # whatever else shares its batch.
    seed: int
    step: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: tuple[int, ...] = ()
    # Structured output: packed int32 bitmask of the allowed next tokens (bit t of word t//32),
    # a host tensor; None when the request is unconstrained.
    token_bitmask: Any = None


@dataclass(frozen=True)
class GroupBatch:
    """One KV group's view of a step: each sequence's block table in that group and the slot
    (block_id * block_size + offset) each input token's entries are written to. Blocks a
    sliding-window group freed read as block 0, the null block."""

    block_tables: list[list[int]]
    slot_mapping: list[int]


@dataclass(frozen=True)
class SpecBatch:
    """Speculative decoding's part of a step: drafts to verify, drafts to propose."""

    # Per sampled row (parallel to ModelBatch.sampling): the draft tokens its query ends with.
    # The model samples at each of them and at the token before, and the longest run of drafts
    # equal to its own choices is accepted (core/speculative.py).
    draft_token_ids: list[list[int]]
    # Per sampled row: how many drafts to propose for its next step (0: none).
    num_proposals: list[int]
    # Per sequence: the token after its query's last one where it is already known (a prefill
    # chunk short of the prompt's end), else -1 (this step samples it). The draft layer at
    # position p reads the token at p + 1.
    next_token_ids: list[int]


@dataclass(frozen=True)
class InputsFromLastStep:
    """Input ids a step takes from the step still in flight (async scheduling): the host does
    not know them yet, the device does. input_ids holds 0 at these token indices until the
    backend writes there the ids that `source` (that step's StepFuture) sampled in `rows`."""

    token_indices: list[int]
    rows: list[int]  # sampled rows of the step in flight, parallel to token_indices
    source: Any  # the step in flight's StepFuture (a backend's own type)


@dataclass(frozen=True)
class PromptLogprobRows:
    """One sequence's prompt positions whose logprobs this step computes (prompt_logprobs):
    the query rows [first, first + len(token_ids)) of sequence `seq`, each scored against the
    prompt token that follows its position."""

    seq: int  # index into the step's sequences
    first: int  # the first scored row, counted from the start of the sequence's query
    token_ids: list[int]  # the token after each scored position
    num_top: int  # how many top alternatives each entry lists


@dataclass(frozen=True)
class ModelBatch:
    """One forward pass over a flattened set of sequences (prefill chunks and decodes).

    Sequence i contributes query_lens[i] new tokens at positions
    [seq_lens[i] - query_lens[i], seq_lens[i]); its KV lives in groups[g].block_tables[i] for
    each KV group g of the model's KV spec.
    """

    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    groups: tuple[GroupBatch, ...]
    # Indices (into the sequence list) whose last token's logits are sampled: decodes and
    # prefills whose final chunk is in this step. Partial prefill chunks sample nothing.
    sample_indices: list[int]
    sampling: list[SamplingRow]  # parallel to sample_indices
    # Per sequence: its per-request state slot (models whose KV spec has state), else empty.
    state_slots: list[int] = field(default_factory=list)
    # Trailing sequences that only pad the step to a backend's bucket (one null-block token
    # each, never sampled).
    num_padding_seqs: int = 0
    spec: SpecBatch | None = None  # set on every step of an engine that speculates
    from_last_step: InputsFromLastStep | None = None  # async scheduling only
    # Decode rows in runs of this many of one sequence, positions consecutive (a verify step
    # run as decode rows, core/speculative.as_decode_rows); 1: every row its own sequence.
    tokens_per_seq: int = 1
    # Sequences whose prompt positions are scored this step (requests asking for
    # prompt_logprobs); the lm_head runs over these rows besides the sampled ones.
    prompt_logprobs: list[PromptLogprobRows] = field(default_factory=list)

    @property
    def block_tables(self) -> list[list[int]]:
        """The first KV group's block tables (all of them for single-group models)."""
        return self.groups[0].block_tables

    @property
    def slot_mapping(self) -> list[int]:
        return self.groups[0].slot_mapping

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_real_tokens(self) -> int:
        """Tokens of real sequences (the padding sequences trail them)."""
        return sum(self.query_lens[:self.num_seqs - self.num_padding_seqs])

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens)


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    rank: int  # 1-based rank of the sampled token in the (unprocessed) distribution
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class SampledRow:
    """What one row got from a step: its new tokens (one; with speculative decoding the
    accepted drafts, then the model's own next token), their logprobs, and the drafts proposed
    for its next step."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    proposals: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class SamplerOutput:
    """One sampled token (and optional logprobs) per row of ModelBatch.sampling."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    # Speculative steps: every row in full (token_ids[i] is the first of its tokens); empty on
    # other steps.
    spec_rows: list[SampledRow] = field(default_factory=list)
    # Per entry of ModelBatch.prompt_logprobs, keyed by its sequence index: one entry per
    # scored position, in order.
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)

    def rows(self) -> list[SampledRow]:
        if self.spec_rows:
            return self.spec_rows
        return [SampledRow([t], [lp]) for t, lp in zip(self.token_ids, self.logprobs)]

    @classmethod
    def from_rows(cls, rows: list[SampledRow],
                  prompt_logprobs: dict[int, list[TokenLogprobs]] | None = None
                  ) -> "SamplerOutput":
        spec = any(len(r.token_ids) > 1 or r.proposals for r in rows)
        return cls([r.token_ids[0] for r in rows], [r.logprobs[0] for r in rows],
                   rows if spec else [], prompt_logprobs or {})
