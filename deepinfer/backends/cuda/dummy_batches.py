"""Batches that serve no request: the profiling step that sizes the KV pool, and the warm-up
steps that compile the prefill path's kernels before the first request.

Triton compiles a kernel once per set of its constexpr values and integer specializations
(1, divisible by 16); several prefill kernels pick theirs from the chunk's token count (the
fused MoE's route sort takes a power of two of the routes, for one). Compiled on a request's
path, each new class stalls that request for seconds: a 128-token chunk after a 128K-token
prefix hit waited 2 s on the H200 for its route sort. The warm-up runs one chunk of every class
a step can take, from position 0 and after a page of prefix, so that compiles happen at start
(and land in Triton's on-disk cache for the next start). The attention kernels' split-K counts
depend on the context length instead: a short chunk over each power-of-two context, alone and
behind a decode, compiles every count a long prefix hit or a mixed step can take (the first
32K-token hit on the H200 waited 2.2 s for its compiles).
"""
from __future__ import annotations

from deepinfer.core.batch import GroupBatch, ModelBatch, SamplingRow
from deepinfer.core.sampling import SamplingParams

SMALL_CHUNKS = 8  # every count up to here: the few-token paths (MoE GEMVs) switch on it


def profile_batch(tokens: int, max_len: int, block_size: int, num_groups: int = 1,
                  stateful: bool = False) -> ModelBatch:
    """A full token budget of prefill, cut into sequences no longer than the context (rotary
    tables end there), each in its own blocks after the null block (the same blocks in every
    KV group), each in its own state slot when the model keeps state."""
    lengths = [max_len] * (tokens // max_len) + ([tokens % max_len] if tokens % max_len else [])
    tables, slots, positions, next_block = [], [], [], 1
    for length in lengths:
        table, seq_slots = _sequence(0, length, next_block, block_size)
        next_block += len(table)
        tables.append(table)
        slots.extend(seq_slots)
        positions.extend(range(length))
    return ModelBatch(
        input_ids=[0] * tokens, positions=positions, query_lens=lengths, seq_lens=lengths,
        groups=(GroupBatch(tables, slots),) * num_groups, sample_indices=list(range(len(lengths))),
        sampling=[profile_row()] * len(lengths),
        state_slots=list(range(len(lengths))) if stateful else [])


def warmup_batch(tokens: int, offset: int, block_size: int, num_blocks: int,
                 num_groups: int = 1, stateful: bool = False) -> ModelBatch:
    """One sequence's chunk of `tokens` queries after `offset` tokens of (garbage) prefix, in
    state slot 0 and blocks 1.. of a pool of num_blocks, wrapping around where the pool is
    shorter than the chunk (the values are never read; every rank runs the same chunks)."""
    table, slots = _sequence(offset, offset + tokens, 1, block_size, num_blocks - 1)
    return ModelBatch(
        input_ids=[0] * tokens, positions=list(range(offset, offset + tokens)),
        query_lens=[tokens], seq_lens=[offset + tokens],
        groups=(GroupBatch([table], slots),) * num_groups, sample_indices=[0],
        sampling=[profile_row()], state_slots=[0] if stateful else [])


def split_warmup_batches(context: int, block_size: int, num_blocks: int, num_groups: int = 1,
                         stateful: bool = False) -> list[ModelBatch]:
    """A SMALL_CHUNKS-token chunk ending at `context` tokens alone, then in a mixed step behind
    a decode (both over the same wrapped blocks; the values are never read). Both: Triton also
    specializes on pointer alignment, and a step's later sequences start 4 bytes into its
    int32 lengths."""
    chunk = min(SMALL_CHUNKS, context - 1)
    alone = warmup_batch(chunk, context - chunk, block_size, num_blocks, num_groups, stateful)
    table, slots = _sequence(context - 1, context, 1, block_size, num_blocks - 1)
    mixed = ModelBatch(
        input_ids=[0] * (1 + chunk), positions=[context - 1] + alone.positions,
        query_lens=[1, chunk], seq_lens=[context, context],
        groups=(GroupBatch([table, table], slots + alone.slot_mapping),) * num_groups,
        sample_indices=[0, 1], sampling=[profile_row()] * 2,
        state_slots=[0, 0] if stateful else [])
    return [alone, mixed]


def split_warmup_contexts(max_len: int) -> list[int]:
    """Powers of two from 128 to 32K (every split count from 1 to 32 at both kernels' sizes)
    that fit the context."""
    return [1 << k for k in range(7, 16) if 1 << k <= max_len]


def warmup_token_counts(max_tokens: int) -> list[int]:
    """A chunk size of every class: 1..SMALL_CHUNKS, then each power of two and the count
    after it (a multiple of 16 and not), and the budget itself."""
    counts = set(range(1, min(SMALL_CHUNKS, max_tokens) + 1))
    power = 16
    while power <= max_tokens:
        counts.update(c for c in (power, power + 1) if c <= max_tokens)
        power *= 2
    counts.add(max_tokens)
    return sorted(counts)


def profile_row() -> SamplingRow:
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, logprobs=5)
    return SamplingRow(params=params, seed=0, step=0, prompt_token_ids=(), output_token_ids=())


def _sequence(start: int, end: int, first_block: int, block_size: int,
              wrap: int | None = None) -> tuple[list[int], list[int]]:
    """Block table (blocks first_block.., the wrap-th block again as the first) of a sequence
    `end` tokens long, and the slots of its positions start..end-1."""
    used = range(-(-end // block_size))
    table = [first_block + (i if wrap is None else i % wrap) for i in used]
    slots = [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
    return table, slots
