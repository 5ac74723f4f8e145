"""Per-request block tables over the BlockPool, with prefix-cache hits on full pages."""
from __future__ import annotations

from dataclasses import dataclass

from deepinfer.core.kv.block_pool import BlockPool, KVBlock
from deepinfer.core.kv.hashing import extend_block_hashes
from deepinfer.core.request import Request


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens served from the cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._tables: dict[str, list[KVBlock]] = {}
        # Block ids of each table, kept alongside so a step does not rebuild them per request.
        self._ids: dict[str, list[int]] = {}
        # How many leading pages of each request are already registered in the prefix cache.
        self._cached_pages: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_usable

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (do not modify: the manager keeps it up to date)."""
        return self._ids.get(request_id, [])

    def _hashes(self, req: Request, num_tokens: int) -> list[bytes]:
        extend_block_hashes(req.block_hashes, req.token_slice, num_tokens, self.block_size,
                            req.cache_salt)
        return req.block_hashes

    def find_cached_prefix(self, req: Request) -> list[KVBlock]:
        """Longest run of cached pages that equal the request's leading pages.

        At least one token is left to compute, since the step that computes it also
        produces the logits the next token is sampled from.
        """
        if not (self.enable_caching and req.use_prefix_cache):
            return []
        limit = (req.num_tokens - 1) // self.block_size
        hashes = self._hashes(req, limit * self.block_size)
        hit: list[KVBlock] = []
        for i, h in enumerate(hashes[:limit]):
            start = i * self.block_size
            block = self.pool.lookup(h, req.token_slice(start, start + self.block_size))
            if block is None:
                break
            hit.append(block)
        return hit

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        # Counted once per admitted request, not per retried lookup.
        self.stats.queries += num_query_tokens
        self.stats.hits += num_hit_tokens

    def allocate(self, req: Request, num_new_tokens: int,
                 cached: list[KVBlock] | None = None) -> bool:
        """Make room for num_new_tokens after the computed ones; False if the pool is short."""
        table = self._tables.get(req.request_id, [])
        cached = cached or []
        needed_tokens = req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        needed = -(-needed_tokens // self.block_size) - len(table) - len(cached)
        if needed <= 0 and not cached and table:
            return True  # a decode inside its last page: the common case, nothing to do
        # Cached blocks sitting in the free list count against what is free.
        reclaim = sum(1 for b in cached if b.ref_cnt == 0)
        if needed > self.pool.num_free - reclaim:
            return False
        self.pool.touch(cached)
        new = cached + (self.pool.allocate(needed) if needed > 0 else [])
        self._tables.setdefault(req.request_id, table).extend(new)
        self._ids.setdefault(req.request_id, []).extend(b.block_id for b in new)
        return True

    def cache_computed_pages(self, req: Request) -> None:
        """Register every page whose tokens are all computed, so later requests can hit it."""
        if not (self.enable_caching and req.use_prefix_cache):
            return
        table = self._tables.get(req.request_id, [])
        full = min(req.num_computed_tokens // self.block_size, len(table))
        done = self._cached_pages.get(req.request_id, 0)
        if full <= done:
            return  # no page filled up since the last call
        hashes = self._hashes(req, full * self.block_size)
        for i in range(done, full):
            block = table[i]
            if block.block_hash is None:
                start = i * self.block_size
                self.pool.cache(block, hashes[i], req.token_slice(start, start + self.block_size))
        self._cached_pages[req.request_id] = full

    def free(self, req: Request) -> None:
        table = self._tables.pop(req.request_id, [])
        self._ids.pop(req.request_id, None)
        self._cached_pages.pop(req.request_id, None)
        # Tail pages go first: a shared prefix is more likely to be hit again than a tail.
        self.pool.release(list(reversed(table)))

    def num_request_blocks(self) -> int:
        return sum(len(t) for t in self._tables.values())

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_cache()
