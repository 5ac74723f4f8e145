"""Device KV blocks: ref counts, an LRU free list, and the hash -> block prefix-cache map.

Freed blocks keep their contents and hash until reused, so a later request can hit them; the
free list hands out the least recently freed block first.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

from deepinfer.core.kv.hashing import BlockHash

NULL_BLOCK_ID = 0


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None  # kept to verify hits against collisions


class NoFreeBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError("a block pool needs at least 2 blocks (block 0 is the null block)")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Block 0 is never handed out: static-shape backends pad block tables with it.
        self._free: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:])
        self._cached: dict[BlockHash, KVBlock] = {}
        self.evictions = 0

    @property
    def num_usable(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self._free):
            raise NoFreeBlocks(f"need {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash, block.token_ids = None, None
            self.evictions += 1

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit); they leave the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference each. Pass them in eviction order: first is evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} released twice")
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def lookup(self, block_hash: BlockHash, tokens: Sequence[int]) -> KVBlock | None:
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(tokens):
            return None
        return block

    def cache(self, block: KVBlock, block_hash: BlockHash, tokens: Sequence[int]) -> None:
        if block.block_hash is not None:
            return
        if block_hash in self._cached:
            # Another block already holds this page (computed concurrently); keep the first.
            return
        block.block_hash, block.token_ids = block_hash, tuple(tokens)
        self._cached[block_hash] = block

    def reset_cache(self) -> int:
        """Forget every cached page held by no request; returns how many were dropped."""
        dropped = 0
        for block in list(self._free.values()):
            if block.block_hash is not None:
                self._evict(block)
                dropped += 1
        return dropped
