"""Host page bookkeeping: ref counts, the hash -> page index, LRU eviction, state slots.

No tensors here: page ids name pages in the memory the accelerator allocated. Every page is in
exactly one place: the free list (no content), the LRU (indexed, held by nobody, evictable) or
pinned (ref_cnt > 0: a copy in or out is in flight, so it is never evicted).
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Iterable, Protocol, Sequence

from deepinfer.core.kv.hashing import BlockHash


class Page(Protocol):
    """A host page as HiCache reads it: a HostPage, or a page of the node's shared pool."""

    @property
    def page_id(self) -> int: ...

    @property
    def block_hash(self) -> BlockHash | None: ...

    @property
    def token_ids(self) -> tuple[int, ...] | None: ...

    @property
    def complete(self) -> bool: ...

    @property
    def state_slot(self) -> int | None: ...


class PagePool(Protocol):
    """What HiCache asks of its host pages' bookkeeping: a rank's own (HostPagePool) or the
    node's, in shared memory (SharedHostPagePool). Pages passed in are the pool's own."""

    evictions: int

    @property
    def num_total(self) -> int: ...

    @property
    def num_used(self) -> int: ...

    @property
    def num_pinned(self) -> int: ...

    def lookup(self, block_hash: BlockHash, tokens: Sequence[int]) -> Page | None: ...

    def holder(self, block_hash: BlockHash) -> Page | None: ...

    def commit(self, page: Any, block_hash: BlockHash, tokens: Sequence[int],
               complete: bool = True) -> bool: ...

    def pin(self, pages: Iterable[Any]) -> None: ...

    def unpin(self, pages: Iterable[Any]) -> None: ...

    def allocate(self, n: int) -> Sequence[Page]: ...

    def take_state_slot(self) -> int | None: ...

    def set_state(self, page: Any, slot: int) -> None: ...

    def release_state_slot(self, slot: int) -> None: ...

    def touch_state(self, page: Any) -> None: ...

    def locked(self) -> contextlib.AbstractContextManager[None]: ...

    def maintain(self) -> None: ...

    def reset(self) -> int: ...

    def close(self) -> None: ...


@dataclass(eq=False)
class HostPage:
    page_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None  # kept to reject hash collisions on a hit
    state_slot: int | None = None  # layer state as of this page's end (stateful models)
    # Every KV group's block was stored. A sliding-window group frees the blocks that leave
    # its window, and a device hit's table holds only the window's pages: a write-through
    # that finds a page's block gone never wrote that group's bytes, and no hit may resume
    # where the window would read them.
    complete: bool = True


class HostPagePool:
    def __init__(self, num_pages: int, num_state_slots: int = 0) -> None:
        if num_pages < 1:
            raise ValueError("a host page pool needs at least 1 page")
        self.pages = [HostPage(i) for i in range(num_pages)]
        self._free: deque[HostPage] = deque(self.pages)
        self._lru: OrderedDict[int, HostPage] = OrderedDict()  # least recently used first
        self._index: dict[BlockHash, HostPage] = {}
        self._free_slots: deque[int] = deque(range(num_state_slots))
        self._slot_lru: OrderedDict[int, HostPage] = OrderedDict()  # slot -> the page owning it
        self.evictions = 0

    # ---- sizes ---------------------------------------------------------------------------
    @property
    def num_total(self) -> int:
        return len(self.pages)

    @property
    def num_used(self) -> int:
        return len(self.pages) - len(self._free)

    @property
    def num_pinned(self) -> int:
        # Every page is free, in the LRU or pinned (the module doc): no walk over the pages.
        return len(self.pages) - len(self._free) - len(self._lru)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    # ---- index ---------------------------------------------------------------------------
    def lookup(self, block_hash: BlockHash, tokens: Sequence[int]) -> HostPage | None:
        page = self._index.get(block_hash)
        if page is None or page.token_ids != tuple(tokens):
            return None
        return page

    def holder(self, block_hash: BlockHash) -> HostPage | None:
        """The page indexed under block_hash, whatever its tokens (for collision checks)."""
        return self._index.get(block_hash)

    def commit(self, page: HostPage, block_hash: BlockHash, tokens: Sequence[int],
               complete: bool = True) -> bool:
        """Index a freshly written page; False if another page already holds this hash."""
        if block_hash in self._index:
            return False
        page.block_hash, page.token_ids, page.complete = block_hash, tuple(tokens), complete
        self._index[block_hash] = page
        return True

    # ---- references ----------------------------------------------------------------------
    def pin(self, pages: Iterable[HostPage]) -> None:
        for page in pages:
            if page.ref_cnt == 0:
                self._lru.pop(page.page_id, None)
            page.ref_cnt += 1

    def unpin(self, pages: Iterable[HostPage]) -> None:
        """Drop one reference each. Pass them in eviction order: first is evicted first."""
        for page in pages:
            page.ref_cnt -= 1
            if page.ref_cnt < 0:
                raise RuntimeError(f"host page {page.page_id} unpinned twice")
            if page.ref_cnt > 0:
                continue
            if page.block_hash is not None:
                self._lru[page.page_id] = page  # most recently used end
            else:
                self._drop_state(page)
                self._free.append(page)  # a store that never committed: nothing to keep

    def allocate(self, n: int) -> list[HostPage]:
        """Up to n empty pinned pages: free ones first, then the least recently used."""
        out: list[HostPage] = []
        while len(out) < n:
            if self._free:
                page = self._free.popleft()
            elif self._lru:
                _, page = self._lru.popitem(last=False)
                self._evict(page)
            else:
                break  # everything left is pinned
            page.ref_cnt = 1
            out.append(page)
        return out

    def _evict(self, page: HostPage) -> None:
        if page.block_hash is not None and self._index.get(page.block_hash) is page:
            del self._index[page.block_hash]
        page.block_hash, page.token_ids = None, None
        self._drop_state(page)
        self.evictions += 1

    # ---- state slots ---------------------------------------------------------------------
    def take_state_slot(self) -> int | None:
        """A free state slot, else the least recently used one whose page is not pinned."""
        if self._free_slots:
            return self._free_slots.popleft()
        for slot, owner in self._slot_lru.items():
            if owner.ref_cnt == 0:
                del self._slot_lru[slot]
                owner.state_slot = None
                return slot
        return None

    def set_state(self, page: HostPage, slot: int) -> None:
        self._drop_state(page)
        page.state_slot = slot
        self._slot_lru[slot] = page

    def release_state_slot(self, slot: int) -> None:
        self._free_slots.append(slot)

    def touch_state(self, page: HostPage) -> None:
        if page.state_slot is not None:
            self._slot_lru.move_to_end(page.state_slot)

    def _drop_state(self, page: HostPage) -> None:
        if page.state_slot is not None:
            self._slot_lru.pop(page.state_slot, None)
            self._free_slots.append(page.state_slot)
            page.state_slot = None

    # ---- what a shared pool needs (shared_pool.py); nothing to do for a rank's own ------
    def locked(self) -> contextlib.AbstractContextManager[None]:
        """Hold the pool across several calls: one process touches a rank's own pool."""
        return contextlib.nullcontext()

    def maintain(self) -> None:
        pass

    def close(self) -> None:
        pass

    # ---- reset ---------------------------------------------------------------------------
    def reset(self) -> int:
        """Forget every indexed page nobody pins; returns how many were dropped."""
        dropped = 0
        while self._lru:
            _, page = self._lru.popitem(last=False)
            self._evict(page)
            self.evictions -= 1  # a reset is not pressure; keep the eviction count honest
            self._free.append(page)
            dropped += 1
        return dropped
