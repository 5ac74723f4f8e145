"""Static shapes: the buckets a step is padded to, and the guard that keeps every step inside
the graphs built at start-up.

A compiled Neuron graph has one shape. A step's shape has three free sizes, each padded up to a
bucket: the tokens it runs (a prefill chunk's token count, padded by the scheduler to a token
bucket; a decode step's sequence count, padded to a batch bucket) and the context it reads (the
widest block table of the step, padded here to a context bucket of blocks). So the graphs are
(token bucket x context bucket) for prefill — active tokens x cached prefix — and (batch bucket
x context bucket) for decode, all built once when the KV pool is allocated.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

# The smallest prefill bucket: shorter chunks pad up to it (a decode-only step is never a
# prefill; its size is a batch bucket).
MIN_TOKEN_BUCKET = 16


def _powers_of_two(low: int, high: int) -> tuple[int, ...]:
    """low, 2 low, 4 low, ... below high, then high itself."""
    sizes, n = [], max(1, low)
    while n < high:
        sizes.append(n)
        n *= 2
    return tuple(sizes + [high])


def bucket_of(sizes: tuple[int, ...], n: int, what: str) -> int:
    i = bisect.bisect_left(sizes, n)
    if i == len(sizes):
        raise StaticShapeError(f"{what} {n} exceeds the largest bucket {sizes[-1]}")
    return sizes[i]


@dataclass(frozen=True)
class StaticShapes:
    token_buckets: tuple[int, ...]  # prefill: tokens of a step
    batch_buckets: tuple[int, ...]  # decode: sequences of a step
    context_buckets: tuple[int, ...]  # blocks of the widest block table of a step
    sample_rows: int  # rows whose logits a prefill step computes (every sequence it may hold)

    @classmethod
    def plan(cls, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
             block_size: int) -> "StaticShapes":
        tokens = _powers_of_two(min(MIN_TOKEN_BUCKET, max_num_batched_tokens),
                                max_num_batched_tokens)
        blocks = -(-max_model_len // block_size)
        # + 1: a padded prefill step holds a padding sequence besides max_num_seqs real ones.
        return cls(tokens, _powers_of_two(1, max_num_seqs), _powers_of_two(1, blocks),
                   max_num_seqs + 1)

    def context_bucket(self, blocks: int) -> int:
        return bucket_of(self.context_buckets, max(1, blocks), "a block table of")

    def graphs(self) -> list[tuple[str, int, int]]:
        """Every graph to build: (kind, tokens or sequences, context blocks)."""
        return [(kind, n, w) for kind, sizes in (("decode", self.batch_buckets),
                                                  ("prefill", self.token_buckets))
                for n in sizes for w in self.context_buckets]


class StaticShapeError(RuntimeError):
    """A step outside the graphs built at start-up: a new compile on the device."""


class StaticShapeGuard:
    """Records the input shapes of every graph while the buckets are built, then refuses any
    other: on the host it fails where the device would have compiled a new graph."""

    def __init__(self) -> None:
        self.signatures: set[tuple] = set()
        self.frozen = False

    @staticmethod
    def signature(kind: str, tensors: tuple) -> tuple:
        return (kind,) + tuple((tuple(t.shape), t.dtype) for t in tensors)

    def check(self, kind: str, *tensors) -> None:
        sig = self.signature(kind, tensors)
        if sig in self.signatures:
            return
        if self.frozen:
            shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
            raise StaticShapeError(f"{kind} step with shapes {shapes} is outside the "
                                   f"{len(self.signatures)} graphs built at start-up")
        self.signatures.add(sig)

    def freeze(self) -> None:
        self.frozen = True

    @property
    def num_graphs(self) -> int:
        return len(self.signatures)
