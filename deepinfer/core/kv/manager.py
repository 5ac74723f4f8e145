"""Per-request block tables over one BlockPool per KV group, with prefix-cache hits on pages.

Every group has the same number of blocks, and a request's page i names the same tokens in every
group, so prefix hashing is shared. A sliding-window group frees the blocks that fell out of its
window (its table then holds the null block there), and a prefix hit needs from it only the
pages the next token can still see.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from deepinfer.core.kv.block_pool import NULL_BLOCK_ID, BlockPool, KVBlock
from deepinfer.core.kv.hashing import extend_block_hashes
from deepinfer.core.kv.spec import KVSpec
from deepinfer.core.request import Request


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens served from the cache


@dataclass
class HeldBlocks:
    """Blocks kept allocated past their request (KVCacheManager.hold); release once."""

    manager: "KVCacheManager"
    blocks: list[list[KVBlock]]  # per group

    def release(self) -> None:
        for g, blocks in zip(self.manager.groups, self.blocks):
            g.pool.release(blocks[::-1])  # tail pages first, as a request's own free
        self.blocks = [[] for _ in self.blocks]


class _Group:
    """One KV group's pool and tables."""

    def __init__(self, num_blocks: int, window: int | None) -> None:
        self.pool = BlockPool(num_blocks)
        self.window = window
        self.null = self.pool.blocks[NULL_BLOCK_ID]
        self.tables: dict[str, list[KVBlock]] = {}
        self.ids: dict[str, list[int]] = {}
        self.dropped: dict[str, int] = {}  # leading pages already freed (sliding groups)

    def first_visible_page(self, position: int, block_size: int) -> int:
        """The first page a query at `position` still sees."""
        if self.window is None:
            return 0
        return max(0, position - self.window + 1) // block_size

    def lookup(self, hashes: Sequence[bytes], req: Request, page: int, bs: int) -> KVBlock | None:
        return self.pool.lookup(hashes[page], req.token_slice(page * bs, (page + 1) * bs))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 spec: KVSpec | None = None, num_state_slots: int = 0) -> None:
        windows = [g.sliding_window for g in spec.groups] if spec is not None else [None]
        self.groups = [_Group(num_blocks, w) for w in windows or [None]]
        self.block_size = block_size
        self.enable_caching = enable_caching
        # A model with per-request state (a compressor's carry-over) cannot resume from cached
        # pages alone unless its pages store that state: else no device prefix hits.
        self.stateful = spec is not None and spec.state_bytes > 0
        self.no_prefix_hits = spec is not None and self.stateful and not spec.state_in_pages
        # How many leading pages of each request are already registered in the prefix cache.
        self._cached_pages: dict[str, int] = {}
        self._free_slots = list(range(num_state_slots - 1, -1, -1))
        self._slots: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def pool(self) -> BlockPool:
        """The first group's pool (the only one of single-group models)."""
        return self.groups[0].pool

    @property
    def all_sliding(self) -> bool:
        """Every group has a window: a sequence holds a bounded number of blocks."""
        return all(g.window is not None for g in self.groups)

    @property
    def usage(self) -> float:
        return max(1.0 - g.pool.num_free / g.pool.num_usable for g in self.groups)

    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """The request's block table in `group` (do not modify)."""
        return self.groups[group].ids.get(request_id, [])

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        return [g.ids.get(request_id, []) for g in self.groups]

    def state_slot(self, request_id: str) -> int | None:
        return self._slots.get(request_id)

    def _hashes(self, req: Request, num_tokens: int) -> list[bytes]:
        extend_block_hashes(req.block_hashes, req.token_slice, num_tokens, self.block_size,
                            req.cache_salt)
        return req.block_hashes

    # ---- prefix hits ---------------------------------------------------------------------
    def find_cached_prefix(self, req: Request) -> list[list[KVBlock]]:
        """Per group, the blocks of the longest cached run of the request's leading pages
        (the null block where a sliding group no longer needs a page); [] per group on a miss.

        At least one token is left to compute, since the step that computes it also
        produces the logits the next token is sampled from.
        """
        empty: list[list[KVBlock]] = [[] for _ in self.groups]
        if not (self.enable_caching and req.reads_prefix_cache) or self.no_prefix_hits:
            return empty
        bs = self.block_size
        limit = (req.num_tokens - 1) // bs
        hashes = self._hashes(req, limit * bs)
        pages = limit
        for g in self.groups:
            if g.window is None:
                pages = min(pages, self._full_run(g, hashes, req, pages))
        while pages > 0 and not all(self._window_cached(g, hashes, req, pages)
                                    for g in self.groups if g.window is not None):
            pages -= 1
        if pages == 0:
            return empty
        return [self._hit_blocks(g, hashes, req, pages) for g in self.groups]

    def _full_run(self, g: _Group, hashes: Sequence[bytes], req: Request, limit: int) -> int:
        for page in range(limit):
            if g.lookup(hashes, req, page, self.block_size) is None:
                return page
        return limit

    def _window_cached(self, g: _Group, hashes: Sequence[bytes], req: Request,
                       pages: int) -> bool:
        first = g.first_visible_page(pages * self.block_size, self.block_size)
        return all(g.lookup(hashes, req, p, self.block_size) is not None
                   for p in range(first, pages))

    def _hit_blocks(self, g: _Group, hashes: Sequence[bytes], req: Request,
                    pages: int) -> list[KVBlock]:
        first = g.first_visible_page(pages * self.block_size, self.block_size)
        blocks = [g.null if p < first else g.lookup(hashes, req, p, self.block_size)
                  for p in range(pages)]
        hits = [b for b in blocks if b is not None]
        assert len(hits) == pages, "a hit's pages were checked present by _hits"
        return hits

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        # Counted once per admitted request, not per retried lookup.
        self.stats.queries += num_query_tokens
        self.stats.hits += num_hit_tokens

    # ---- allocation ----------------------------------------------------------------------
    def blocks_needed(self, req: Request, num_new_tokens: int,
                      cached: list[list[KVBlock]] | None = None) -> int:
        """Blocks the most demanding group needs for num_new_tokens more tokens."""
        cached = cached or [[] for _ in self.groups]
        end = self._end(req, num_new_tokens, cached)
        return max(self._needed(g, req, end, c) for g, c in zip(self.groups, cached))

    def _end(self, req: Request, num_new: int, cached: list[list[KVBlock]]) -> int:
        """Tokens the request holds after num_new more past its computed and cached ones."""
        return req.num_computed_tokens + len(cached[0]) * self.block_size + num_new

    def _needed(self, g: _Group, req: Request, end: int, cached: list[KVBlock]) -> int:
        table = g.tables.get(req.request_id, [])
        return -(-end // self.block_size) - len(table) - len(cached)

    def can_allocate(self, num_blocks: int) -> bool:
        return all(num_blocks <= g.pool.num_free for g in self.groups)

    def _in_window(self, g: _Group, cached: list[KVBlock], hit_pages: int) -> list[KVBlock]:
        """A hit of hit_pages pages (cached first, then pages loaded from the host tier) as the
        group holds it: a sliding group takes the null block for every page out of its window
        at the hit's end, as a cold prefill would have freed it (a loaded page there is not
        loaded, a device-hit block there not taken)."""
        first = min(g.first_visible_page(hit_pages * self.block_size, self.block_size),
                    hit_pages)
        if g.window is None or first == 0:
            return cached
        kept = [g.null if p < first else b for p, b in enumerate(cached)]
        return kept + [g.null] * max(0, first - len(cached))

    def allocate(self, req: Request, num_new_tokens: int,
                 cached: list[list[KVBlock]] | None = None, loaded_pages: int = 0) -> bool:
        """Make room for num_new_tokens after the computed ones (and the cached blocks);
        False if a pool is short. The first loaded_pages pages of the new tokens are a
        host-tier hit: fresh blocks, except in a sliding group out of its window."""
        cached = cached or [[] for _ in self.groups]
        end = self._end(req, num_new_tokens, cached)
        if loaded_pages:
            hit_pages = len(cached[0]) + loaded_pages
            cached = [self._in_window(g, c, hit_pages) for g, c in zip(self.groups, cached)]
        needs = [self._needed(g, req, end, c) for g, c in zip(self.groups, cached)]
        if all(n <= 0 for n in needs) and not any(cached) and \
                req.request_id in self.groups[0].tables:
            return True  # a decode inside its last page: the common case, nothing to do
        for g, c, n in zip(self.groups, cached, needs):
            # Cached blocks sitting in the free list count against what is free.
            reclaim = sum(1 for b in c if b.ref_cnt == 0 and b is not g.null)
            if n > g.pool.num_free - reclaim:
                return False
        if req.request_id not in self._slots and self._free_slots:
            self._slots[req.request_id] = self._free_slots.pop()
        for g, c, n in zip(self.groups, cached, needs):
            g.pool.touch(b for b in c if b is not g.null)
            new = c + (g.pool.allocate(n) if n > 0 else [])
            g.tables.setdefault(req.request_id, []).extend(new)
            g.ids.setdefault(req.request_id, []).extend(b.block_id for b in new)
            if c and g.window is not None:
                g.dropped[req.request_id] = sum(1 for b in c if b is g.null)
        return True

    def free_out_of_window(self, req: Request) -> None:
        """Sliding groups: release the blocks no future query of the request can see."""
        for g in self.groups:
            if g.window is None or req.request_id not in g.tables:
                continue
            table, ids = g.tables[req.request_id], g.ids[req.request_id]
            start = g.dropped.get(req.request_id, 0)
            # Tokens a step still in flight computes (async scheduling) are not counted: their
            # step's results register and write through the pages they fill before any is
            # released, as when steps run one at a time.
            computed = req.num_computed_tokens - req.num_computed_in_flight
            end = min(g.first_visible_page(computed, self.block_size), len(table))
            if end <= start:
                continue
            # Freed in page order, so the oldest page is the first to be reused.
            g.pool.release([b for b in table[start:end] if b is not g.null])
            table[start:end] = [g.null] * (end - start)
            ids[start:end] = [NULL_BLOCK_ID] * (end - start)
            g.dropped[req.request_id] = end

    def cache_computed_pages(self, req: Request) -> None:
        """Register every page whose tokens are all computed, so later requests can hit it."""
        if not (self.enable_caching and req.use_prefix_cache):
            return
        tables = [g.tables.get(req.request_id, []) for g in self.groups]
        full = min(req.num_computed_tokens // self.block_size, *(len(t) for t in tables))
        done = self._cached_pages.get(req.request_id, 0)
        if full <= done:
            return  # no page filled up since the last call
        hashes = self._hashes(req, full * self.block_size)
        for i in range(done, full):
            start = i * self.block_size
            tokens = req.token_slice(start, start + self.block_size)
            for g, table in zip(self.groups, tables):
                block = table[i]
                if block.block_hash is None and block is not g.null:
                    g.pool.cache(block, hashes[i], tokens)
        self._cached_pages[req.request_id] = full

    def free(self, req: Request) -> None:
        for g in self.groups:
            table = g.tables.pop(req.request_id, [])
            g.ids.pop(req.request_id, None)
            g.dropped.pop(req.request_id, None)
            # Tail pages go first: a shared prefix is more likely to be hit again than a tail.
            g.pool.release([b for b in reversed(table) if b is not g.null])
        self._cached_pages.pop(req.request_id, None)
        slot = self._slots.pop(req.request_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def hold(self, request_id: str, pages: Sequence[int]) -> "HeldBlocks":
        """Keep the request's blocks of these pages (in every group) allocated until the
        returned hold is released, however the request ends: a copy still reading them
        (HiCache's write-through on a stream of its own) must not see them handed out again."""
        held = [[b for b in (g.tables[request_id][i] for i in pages) if b is not g.null]
                for g in self.groups]
        for g, blocks in zip(self.groups, held):
            g.pool.touch(blocks)
        return HeldBlocks(self, held)

    def num_request_blocks(self) -> int:
        return sum(len(t) for t in self.groups[0].tables.values())

    def reset_prefix_cache(self) -> int:
        return sum(g.pool.reset_cache() for g in self.groups)
