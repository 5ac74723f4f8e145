"""Static-shape padding: a step grown to a backend's bucket sizes (Capabilities.token_buckets,
batch_buckets) with rows that write to the null block and are never sampled."""
from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass

from deepinfer.core.batch import GroupBatch, ModelBatch
from deepinfer.core.kv.block_pool import NULL_BLOCK_ID


@dataclass(frozen=True)
class Buckets:
    tokens: tuple[int, ...] = ()  # a step's token count is padded up to one of these
    batch: tuple[int, ...] = ()  # a decode-only step's sequence count, likewise

    def __post_init__(self) -> None:
        for name, sizes in (("token_buckets", self.tokens), ("batch_buckets", self.batch)):
            if any(s < 1 for s in sizes) or list(sizes) != sorted(set(sizes)):
                raise ValueError(f"{name} must be increasing positive sizes, got {sizes}")

    def token_budget(self, budget: int) -> int:
        """The step budget, capped at the largest token bucket."""
        return min(budget, self.tokens[-1]) if self.tokens else budget

    def max_seqs(self, max_seqs: int) -> int:
        return min(max_seqs, self.batch[-1]) if self.batch else max_seqs

    def padded_tokens(self, num_tokens: int) -> int:
        return _bucket(self.tokens, num_tokens)

    def padded_seqs(self, num_seqs: int) -> int:
        return _bucket(self.batch, num_seqs)


def _bucket(sizes: tuple[int, ...], n: int) -> int:
    if not sizes:
        return n
    i = bisect.bisect_left(sizes, n)
    if i == len(sizes):
        raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")
    return sizes[i]


def pad_batch(batch: ModelBatch, buckets: Buckets, block_size: int) -> ModelBatch:
    """Pad a decode-only step's sequence count to a batch bucket (one-token padding rows),
    any other step's token count to a token bucket (one padding sequence), as static-shape
    backends keep one graph per decode batch size and one per prefill token count. Padding rows
    sit in the null block, whose pages hold block_size tokens."""
    if not batch.num_seqs:
        return batch
    if batch.is_decode_only and buckets.batch:
        extra = buckets.padded_seqs(batch.num_seqs) - batch.num_seqs
        return _with_padding(batch, [1] * extra, block_size) if extra else batch
    if not buckets.tokens:
        return batch
    extra = buckets.padded_tokens(batch.num_tokens) - batch.num_tokens
    return _with_padding(batch, [extra], block_size) if extra else batch


def _with_padding(batch: ModelBatch, lens: list[int], bs: int) -> ModelBatch:
    """Padding sequences of the given lengths: positions 0.., the null block's slots (its
    contents are garbage by definition), never sampled."""
    # Positions wrap inside the block so that no table (rotary, block) is read past its end.
    pad_positions = [p % bs for n in lens for p in range(n)]
    pad_slots = [NULL_BLOCK_ID * bs + p for p in pad_positions]
    groups = tuple(GroupBatch(g.block_tables + [[NULL_BLOCK_ID] * -(-n // bs) for n in lens],
                              g.slot_mapping + pad_slots) for g in batch.groups)
    return dataclasses.replace(
        batch, input_ids=batch.input_ids + [0] * len(pad_positions),
        positions=batch.positions + pad_positions, query_lens=batch.query_lens + lens,
        seq_lens=batch.seq_lens + lens, groups=groups,
        state_slots=batch.state_slots + ([0] * len(lens) if batch.state_slots else []),
        num_padding_seqs=batch.num_padding_seqs + len(lens))


def dummy_batch(num_groups: int, block_size: int) -> ModelBatch:
    """One padding token at position 0 of the null block, in every KV group; samples nothing."""
    group = GroupBatch([[NULL_BLOCK_ID]], [NULL_BLOCK_ID * block_size])
    return ModelBatch([0], [0], [1], [1], (group,) * num_groups, [], [],
                      num_padding_seqs=1)
