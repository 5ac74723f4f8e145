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
    block_size: int
    # Indices (into the sequence list) whose last token's logits are sampled: decodes and
    # prefills whose final chunk is in this step. Partial prefill chunks sample nothing.
    sample_indices: list[int]
    sampling: list[SamplingRow]  # parallel to sample_indices
    # Per sequence: its per-request state slot (models whose KV spec has state), else empty.
    state_slots: list[int] = field(default_factory=list)
    # Trailing sequences that only pad the step to a backend's bucket (one null-block token
    # each, never sampled).
    num_padding_seqs: int = 0

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
class SamplerOutput:
    """One sampled token (and optional logprobs) per row of ModelBatch.sampling."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
