"""Batches built by hand the way the scheduler builds them, for driving a backend through the
Accelerator API alone: sequences with their block tables (null block where a windowed group
freed a block), chunks of a step, a shuffled block pool, and one step run."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from deepinfer.core.accelerator import Accelerator
from deepinfer.core.batch import GroupBatch, ModelBatch, SamplingRow
from deepinfer.core.sampling import SamplingParams

BLOCK_SIZE = 4
NULL_BLOCK = 0
DECODE_STEPS = 8
VOCAB = 128


@dataclass
class Seq:
    """One sequence as a scheduler tracks it: tokens, its blocks, tokens already in KV.

    `blocks` are its pages in order; every KV group uses the same ids (each group has its own
    pool of blocks). `windows` holds each KV group's sliding window (None: full attention), as
    the loaded model's KV spec declares them; build_batch turns them into per-group tables."""

    name: str
    prompt: list[int]
    blocks: list[int]
    outputs: list[int] = field(default_factory=list)
    computed: int = 0
    windows: tuple[int | None, ...] = (None,)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs

    def table(self, window: int | None, end: int, block_size: int = BLOCK_SIZE) -> list[int]:
        """The block table of a group with `window` for a step that ends at token `end`, as the
        engine hands it over: a windowed group freed the pages wholly before the first new
        token's window (KVCacheManager.free_out_of_window), and they read as the null block."""
        table = self.blocks[:math.ceil(end / block_size)]
        if window is None:
            return table
        first_visible = max(0, self.computed - window + 1) // block_size
        return [NULL_BLOCK] * first_visible + table[first_visible:]


@dataclass(frozen=True)
class Chunk:
    """`num_tokens` new tokens of `seq` in one step; `sample` only when they end its prompt."""

    seq: Seq
    num_tokens: int = 1
    sample: bool = True


class BlockPool:
    """Hands out block ids in a shuffled order, so block tables are never contiguous and block 0
    (the null block) is never used, as with a real block manager after some churn. `windows`
    are the KV groups' sliding windows, given to the sequences it makes."""

    def __init__(self, num_blocks: int, seed: int = 0,
                 windows: tuple[int | None, ...] = (None,)) -> None:
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)
        self.windows = windows

    def take(self, num_tokens: int) -> list[int]:
        count = math.ceil(num_tokens / BLOCK_SIZE)
        if count > len(self.free):
            raise RuntimeError(f"the pool has {len(self.free)} free blocks, {count} asked for")
        taken, self.free = self.free[:count], self.free[count:]
        return taken


def build_batch(chunks: list[Chunk], block_size: int = BLOCK_SIZE) -> ModelBatch:
    """The ModelBatch the scheduler would build: one GroupBatch per KV group (the sequences'
    `windows`), each with its own tables and slots."""
    windows = chunks[0].seq.windows if chunks else (None,)
    if any(c.seq.windows != windows for c in chunks):
        raise ValueError("the sequences of one batch disagree on the KV groups' windows")
    input_ids, positions, sample_indices, rows = [], [], [], []
    tables: list[list[list[int]]] = [[] for _ in windows]
    slots: list[list[int]] = [[] for _ in windows]
    for index, chunk in enumerate(chunks):
        seq, start = chunk.seq, chunk.seq.computed
        end = start + chunk.num_tokens
        input_ids += seq.tokens[start:end]
        positions += list(range(start, end))
        for g, window in enumerate(windows):
            table = seq.table(window, end, block_size)
            tables[g].append(table)
            slots[g] += [table[p // block_size] * block_size + p % block_size
                         for p in range(start, end)]
        if chunk.sample:
            sample_indices.append(index)
            rows.append(SamplingRow(
                params=SamplingParams(temperature=0.0, max_tokens=64), seed=0,
                step=len(seq.outputs), prompt_token_ids=list(seq.prompt),
                output_token_ids=list(seq.outputs), eos_token_ids=()))
    return ModelBatch(
        input_ids=input_ids, positions=positions,
        query_lens=[c.num_tokens for c in chunks],
        seq_lens=[c.seq.computed + c.num_tokens for c in chunks],
        groups=tuple(GroupBatch(t, s) for t, s in zip(tables, slots)),
        sample_indices=sample_indices, sampling=rows)


def run_step(accelerator: Accelerator, chunks: list[Chunk]) -> None:
    """Execute one batch and advance each sequence the way the scheduler would."""
    batch = build_batch(chunks)
    out = accelerator.execute(batch)
    sampled = [c.seq for c in chunks if c.sample]
    assert len(out.token_ids) == len(sampled), (
        f"execute returned {len(out.token_ids)} tokens for {len(sampled)} sampled sequences "
        f"(sample_indices={batch.sample_indices})")
    assert len(out.logprobs) == len(out.token_ids), "SamplerOutput.logprobs must be parallel"
    for chunk in chunks:
        chunk.seq.computed += chunk.num_tokens
    for seq, token in zip(sampled, out.token_ids):
        assert isinstance(token, int) and 0 <= token < VOCAB, f"{seq.name}: bad token {token!r}"
        seq.outputs.append(token)


def decode(accelerator: Accelerator, seqs: list[Seq], until: int = DECODE_STEPS) -> None:
    while any(len(s.outputs) < until for s in seqs):
        run_step(accelerator, [Chunk(s) for s in seqs if len(s.outputs) < until])
