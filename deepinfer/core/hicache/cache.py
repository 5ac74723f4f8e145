"""HiCache: a per-rank host-memory tier of KV pages behind the device prefix cache.

Write-through: as a request's prompt is computed, chunk by chunk, its full prompt pages the host
does not hold yet are copied device -> host. Load-on-hit: at admission, matching continues from
where the device hit ended, capped so keep_tokens are recomputed, snapped to a page end a
prefill can resume from (a stored state slot, for models with state slots; the pages a sliding
window reads there stored whole, for sliding-window models); the pages are copied into freshly
allocated device blocks and count as computed. The core never touches tensors: copies are
accelerator calls by page-id lists.

Sliding-window models (DeepSeek-V4's window group, Mistral): a windowed group frees its blocks
as they leave the window, and a device hit's table holds only the pages the window reads. Each
prefill chunk's pages are stored right after it runs, before they can leave the window; pages a
device hit left out are stored without that group's bytes (`Page.complete` False; the page
copy skips the null block). A hit loads no block of such a group out of the window at the hit's
end (the manager gives the null block), so what the window reads there must come from complete
pages. Models that keep their state in their pages (`KVSpec.state_in_pages`: DeepSeek-V4's
page_state entries) need no state slots.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from deepinfer.core.accelerator import Accelerator, CopyHandle, HostPoolLayout
from deepinfer.core.config import CacheConfig
from deepinfer.core.hicache.disk import DiskStats, DiskTier
from deepinfer.core.hicache.pool import HostPagePool, Page, PagePool
from deepinfer.core.hicache.rate import Rate
from deepinfer.core.hicache.shared_pool import (
    PoolGeometry,
    SharedHostPagePool,
    SharedPoolPlace,
    pages_file,
)
from deepinfer.core.kv.block_pool import NULL_BLOCK_ID
from deepinfer.core.kv.hashing import BlockHash, extend_block_hashes
from deepinfer.core.kv.spec import KVSpec
from deepinfer.core.request import Request

log = logging.getLogger(__name__)

GIB = 1 << 30
# How long a waiting request's admission waits for its pages to come from disk: past it, it
# runs with what has landed (a slow disk costs a recompute, not a stall). Where the disk reads
# a page slower than the engine recomputes it, it does not wait, or stops waiting as soon as
# its reads in flight show it (DiskTier.worth_waiting).
PREFETCH_WAIT_S = 2.0
# Prompts that compute fewer tokens say more about a step's fixed costs than about the rate
# a long prefill runs at.
RATE_MIN_TOKENS = 256


@dataclass
class HiCacheStats:
    """Running totals of one rank (gauges: pages_used, pages_total)."""

    pages_used: int = 0
    pages_total: int = 0
    pages_pinned: int = 0  # held by a copy or disk job in flight (any rank's, if shared)
    shared: bool = False  # the node's shared pool: the page gauges are the node's
    lookups: int = 0  # admitted requests that consulted the host tier
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    stored_pages: int = 0
    loaded_pages: int = 0
    evicted_pages: int = 0
    load_bytes: int = 0
    store_bytes: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0


@dataclass(frozen=True)
class HostHit:
    """Host pages continuing a device hit: the request's pages first_page.. in order."""

    first_page: int
    pages: tuple[Page, ...]
    block_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.pages) * self.block_size

    @property
    def end_tokens(self) -> int:
        return (self.first_page + len(self.pages)) * self.block_size


@dataclass(frozen=True)
class _Commit:
    """A stored page, indexed once its copy is done."""

    page: Page
    block_hash: BlockHash
    tokens: tuple[int, ...]
    complete: bool  # every KV group's block was held (see Page.complete)


class Held(Protocol):
    def release(self) -> None: ...


# A store's hold on the device blocks it reads (KVCacheManager.hold): page indices -> hold.
Hold = Callable[[Sequence[int]], Held]


@dataclass
class _Copy:
    """A copy in flight; its pages stay pinned and its index entries wait until it is done.
    A store also holds the device blocks it reads until then."""

    handles: list[CopyHandle]
    pinned: list[Page]  # unpinned at the end, in eviction order (tails first)
    to_device: bool
    started: float
    commits: list[_Commit] = field(default_factory=list)
    state: tuple[Page, int] | None = None
    held: Held | None = None

    def add(self, handle: CopyHandle | None) -> None:
        """Track a copy's handle; None is a copy that was done when the call returned."""
        if handle is not None:
            self.handles.append(handle)


class HiCache:
    def __init__(self, accelerator: Accelerator, layout: HostPoolLayout, block_size: int,
                 keep_tokens: int, window: int | None = None,
                 state_in_pages: bool = False, disk: DiskTier | None = None,
                 pool: SharedHostPagePool | None = None) -> None:
        self.accelerator = accelerator
        self.layout = layout
        self.block_size = block_size
        # One token is always recomputed anyway: that step yields the logits to sample from.
        self.keep_tokens = max(1, keep_tokens)
        # The widest sliding window of the model (None: no windowed group): how far back a
        # resumed prefill reads the windowed groups' pages.
        self.window = window
        # Layer state must come back from a state slot: the backend keeps some (stateful
        # layout) and the pages do not carry it already.
        self.restores_state = layout.stateful and not state_in_pages
        self.pool: PagePool = pool or HostPagePool(layout.num_pages, layout.num_state_slots)
        self._stats = HiCacheStats(pages_total=layout.num_pages, shared=pool is not None)
        self._inflight: list[_Copy] = []
        # Pages a store in flight is writing, by hash: a prompt that comes back before its
        # first store is done (the next turn, a device hit) is not stored a second time.
        self._storing: dict[BlockHash, _Commit] = {}
        self.disk = disk
        self._disk_pages: dict[int, Page] = {}  # page id -> the host page a job reads/writes
        self._prefetching: dict[str, tuple[list[int], float]] = {}  # request -> pages, deadline
        # Prompt tokens a second the engine computes (record_prefill): against the disk's
        # reads, whether a prompt waits for its pages from disk or recomputes them.
        self.prefill_rate = Rate()

    @classmethod
    def create(cls, accelerator: Accelerator, cache: CacheConfig,
               kv_spec: KVSpec | None = None,
               fingerprint: Callable[[int], str] | None = None,
               shared: SharedPoolPlace | None = None) -> "HiCache | None":
        """The rank's host tier, or None when it is off (size 0 or no prefix caching); with
        its disk tier where cache.hicache_disk_dir is set (`fingerprint(page_bytes)` names
        the folder of this model's pages there). With `shared`, the node's ranks share one
        pool of hicache_size_gb per rank (see shared_pool.py), where the backend and model
        allow it; else the rank has its own."""
        if cache.hicache_size_gb <= 0 or not cache.enable_prefix_caching:
            return None
        if not accelerator.capabilities.host_page_copy:
            raise ValueError(f"the {accelerator.name} backend cannot copy KV pages to host "
                             "memory; run without hicache_size_gb")
        spec = kv_spec if kv_spec is not None else KVSpec(())
        if spec.has_sliding_window and not accelerator.capabilities.host_copy_skips_null:
            # A sliding group's freed blocks are the null block in its table: a copy that
            # moved them would store garbage, or load host bytes into the null block.
            raise ValueError(f"the {accelerator.name} backend's host page copy cannot leave "
                             "out a sliding window's freed pages; run without hicache_size_gb")
        page_bytes = accelerator.host_page_bytes()
        num_pages = int(cache.hicache_size_gb * GIB) // page_bytes
        if num_pages < 1:
            raise ValueError(f"hicache_size_gb={cache.hicache_size_gb} holds no page of "
                             f"{page_bytes} bytes")
        # State kept in the pages moves with them: host state slots would hold nothing new.
        slots = 0 if spec.state_in_pages else cache.hicache_state_slots
        name = fingerprint(page_bytes) if fingerprint is not None else "default"
        pool = cls._shared_pool(accelerator, shared, slots, PoolGeometry(
            num_pages * (shared.num_ranks if shared else 1), page_bytes, cache.block_size, name))
        layout = cls._map_shared(accelerator, pool)
        if layout is None:
            pool = None
            layout = accelerator.allocate_host_pool(num_pages, slots)
        windows = [g.sliding_window for g in spec.groups if g.sliding_window is not None]
        disk = cls._disk_tier(accelerator.name, cache, layout, spec, name)
        return cls(accelerator, layout, cache.block_size, cache.yoco_keep_tokens,
                   max(windows, default=None), spec.state_in_pages, disk, pool)

    @staticmethod
    def _map_shared(accelerator: Accelerator,
                    pool: SharedHostPagePool | None) -> HostPoolLayout | None:
        """The backend's mapping of the shared pool's pages, or None (no pool, or the backend
        could not map or pin them: then the rank keeps its own)."""
        if pool is None:
            return None
        try:
            return accelerator.allocate_host_pool(pool.num_total, 0, pages_file(pool.place))
        except (OSError, RuntimeError, ValueError) as e:
            log.warning("HiCache: a host pool per rank, not shared: %s", e)
            pool.close()
            return None

    @staticmethod
    def _shared_pool(accelerator: Accelerator, place: SharedPoolPlace | None, state_slots: int,
                     geometry: PoolGeometry) -> SharedHostPagePool | None:
        """The node's shared pool, or None: none offered, a backend that cannot map one, a
        model with layer state slots, or no room for it in shared memory (then each rank
        keeps its own, as with one rank)."""
        if place is None:
            return None
        why = None
        if not accelerator.capabilities.host_pool_shared:
            why = f"the {accelerator.name} backend cannot map a shared host pool"
        elif state_slots:
            why = "a shared host pool keeps no layer state slots"
        else:
            try:
                return SharedHostPagePool(place, geometry)
            except OSError as e:
                why = f"no room for {geometry.num_pages} pages in {place.path} ({e})"
        log.warning("HiCache: a host pool per rank, not shared: %s", why)
        return None

    @staticmethod
    def _disk_tier(backend: str, cache: CacheConfig, layout: HostPoolLayout, spec: KVSpec,
                   name: str) -> DiskTier | None:
        if cache.hicache_disk_dir is None:
            return None
        if layout.memory is None:
            raise ValueError(f"the {backend} backend's host pages cannot be read by the host; "
                             "run without hicache_disk_dir")
        if layout.stateful and not spec.state_in_pages:
            raise ValueError("the disk tier keeps KV pages, not layer state slots; run this "
                             "model without hicache_disk_dir")
        capacity = int(cache.hicache_disk_gb * GIB)
        if capacity < layout.page_bytes:
            raise ValueError(f"hicache_disk_gb={cache.hicache_disk_gb:g} holds no page of "
                             f"{layout.page_bytes} bytes")
        # Write-back holds a host page per page in its queue: at most a quarter of the pool.
        return DiskTier(cache.hicache_disk_dir, capacity, layout.memory, layout.page_bytes,
                        name, max_queue=max(1, layout.num_pages // 4),
                        write_bytes_per_s=cache.hicache_disk_write_mb_s * 1e6)

    # ---- hits ----------------------------------------------------------------------------
    def match(self, req: Request, num_device_pages: int) -> HostHit | None:
        """Host pages continuing the request's device hit of num_device_pages pages, pinned
        (another rank of a shared pool could evict them otherwise): `load` them, or
        `release` the hit."""
        if not req.reads_prefix_cache:
            return None
        bs = self.block_size
        limit = max(0, req.num_tokens - self.keep_tokens) // bs  # pages the whole hit may cover
        if limit <= num_device_pages:
            return None
        extend_block_hashes(req.block_hashes, req.token_slice, limit * bs, bs, req.cache_salt)
        with self.pool.locked():
            pages = self._host_run(req, num_device_pages, limit)
            while pages and not self._resumable(num_device_pages, pages):
                pages.pop()
            self.pool.pin(pages)
        return HostHit(num_device_pages, tuple(pages), bs) if pages else None

    def _host_run(self, req: Request, first: int, limit: int) -> list[Page]:
        """The host pages holding the request's pages first.. in a row (up to limit)."""
        bs, pages = self.block_size, []
        for i in range(first, limit):
            page = self.pool.lookup(req.block_hashes[i], req.token_slice(i * bs, (i + 1) * bs))
            if page is None:
                break
            pages.append(page)
        return pages

    def release(self, hit: HostHit) -> None:
        """A hit that is not loaded (its request was not admitted) lets go of its pages."""
        self.pool.unpin(reversed(hit.pages))

    def prefetch(self, req: Request, num_device_pages: int) -> None:
        """Start reading from disk the pages that continue the request's device and host
        hits, into host pages, as soon as the request is queued: by its turn to run they are
        host pages that `match` finds."""
        if self.disk is None or not req.reads_prefix_cache:
            return
        bs = self.block_size
        limit = max(0, req.num_tokens - self.keep_tokens) // bs
        if limit <= num_device_pages:
            return
        extend_block_hashes(req.block_hashes, req.token_slice, limit * bs, bs, req.cache_salt)
        with self.pool.locked():  # the host hit so far, pinned while room is made
            held = self._host_run(req, num_device_pages, limit)
            self.pool.pin(held)
        # The disk's pages after it, looked for outside the pool's hold (a file check is a
        # system call, and a shared pool's hold stalls every rank of the node).
        wanted: list[int] = []
        for i in range(num_device_pages + len(held), limit):
            h = req.block_hashes[i]
            if self.pool.holder(h) is not None or not self.disk.holds(h):
                break
            wanted.append(i)
        fresh = self.pool.allocate(len(wanted)) if wanted else []
        self.pool.unpin(reversed(held))
        if not fresh:
            return
        for i, page in zip(wanted, fresh):
            self._disk_pages[page.page_id] = page
            self.disk.read(req.block_hashes[i], req.token_slice(i * bs, (i + 1) * bs),
                           page.page_id)
        wait = PREFETCH_WAIT_S if self._disk_worth_waiting() else 0.0
        self._prefetching[req.request_id] = ([p.page_id for p in fresh], time.monotonic() + wait)

    def _disk_worth_waiting(self) -> bool:
        assert self.disk is not None
        return self.disk.worth_waiting(self.prefill_rate.seconds_for(self.block_size))

    def record_prefill(self, req: Request) -> None:
        """The request's first token is back: its prefill's rate, from its first schedule
        (with the disk tier only, from prompts of at least RATE_MIN_TOKENS computed tokens, the
        ones a disk read would replace)."""
        computed = req.num_prompt_tokens - max(0, req.num_cached_tokens)
        if self.disk is None or computed < RATE_MIN_TOKENS or req.first_scheduled_time is None \
                or req.first_token_time is None:
            return
        self.prefill_rate.add(computed, req.first_token_time - req.first_scheduled_time)

    def prefetching(self, req: Request) -> bool:
        """Whether the request's pages are still coming from disk (within PREFETCH_WAIT_S, and
        while the disk reads a page faster than the engine recomputes it)."""
        entry = self._prefetching.get(req.request_id)
        if entry is None or self.disk is None:
            return False
        pages, deadline = entry
        if time.monotonic() < deadline and self.disk.reading(pages) \
                and self._disk_worth_waiting():
            return True
        del self._prefetching[req.request_id]
        return False

    def forget(self, req: Request) -> None:
        """The request ended (an abort while it waited too): its prefetch entry goes; reads
        still in flight finish and index their pages as usual."""
        self._prefetching.pop(req.request_id, None)

    def wait_prefetch(self, req: Request) -> None:
        """Wait (at most until its deadline) for the request's disk reads, and index them."""
        while self.prefetching(req):
            time.sleep(0.001)
            self.poll()

    def _resumable(self, first_page: int, pages: list[Page]) -> bool:
        """Whether a prefill can resume after `pages` (the request's pages first_page..).
        Layer state must be restored too, and it exists only where a store saved it. A
        sliding window reads its last pages there: those must have been stored whole (the
        device hit's own pages, before first_page, are held on the device)."""
        if self.restores_state and pages[-1].state_slot is None:
            return False
        end = first_page + len(pages)
        read_from = self._window_start(end) - first_page
        return all(p.complete for p in pages[max(0, read_from):])

    def _window_start(self, num_pages: int) -> int:
        """The first page the window reads from a query right after num_pages pages."""
        if self.window is None:
            return num_pages
        return max(0, num_pages * self.block_size - self.window + 1) // self.block_size

    def load(self, req: Request, hit: HostHit, device_blocks: list[list[int]]) -> None:
        """Copy the hit's pages (and state) into the request's new device blocks (one list per
        KV group); the pins `match` took go when the copy is done."""
        if any(len(blocks) != len(hit.pages) for blocks in device_blocks):
            self.release(hit)
            raise ValueError(f"{len(hit.pages)} host pages for {len(device_blocks)} blocks")
        pages = list(hit.pages)
        copy = _Copy([], list(reversed(pages)), True, time.perf_counter())
        try:
            copy.add(self.accelerator.copy_pages(
                [p.page_id for p in pages], device_blocks, to_device=True))
            nbytes = len(pages) * self.layout.page_bytes
            if self.restores_state:
                self.pool.touch_state(pages[-1])
                slot = pages[-1].state_slot
                assert slot is not None  # restores_state: every hit page keeps its state
                copy.add(self.accelerator.copy_state(
                    slot, req.request_id, hit.end_tokens, to_device=True))
                nbytes += self.layout.state_slot_bytes
        except BaseException:
            self.pool.unpin(copy.pinned)
            raise
        self._stats.loaded_pages += len(pages)
        self._stats.load_bytes += nbytes
        self._track(copy)

    def record_lookup(self, device_hit_tokens: int, host_hit_tokens: int) -> None:
        # Counted once per request, at its first admission, like the device prefix stats.
        self._stats.lookups += 1
        self._stats.device_hit_tokens += device_hit_tokens
        self._stats.host_hit_tokens += host_hit_tokens

    # ---- write-through -------------------------------------------------------------------
    def store(self, req: Request, device_blocks: list[list[int]], hold: Hold | None = None,
              upto: int | None = None) -> None:
        """Copy the request's full prompt pages up to token `upto` (default: the whole prompt)
        that the host lacks from device to host (device_blocks: the request's block table in
        each KV group; a sliding group's freed pages are the null block there, which the copy
        leaves out). The scheduler calls it after each prefill chunk, so a long prompt's store
        runs while the rest of it is computed; pages an earlier call took are skipped
        (req.num_host_pages). `hold` keeps the copied pages' device blocks allocated until the
        copy is done, so a backend may store on a stream of its own while the request ends
        and its blocks go back to the pool."""
        if not req.use_prefix_cache:
            return
        bs, first = self.block_size, req.num_host_pages
        upto = req.num_prompt_tokens if upto is None else min(upto, req.num_prompt_tokens)
        num_full = min(upto // bs, *(len(b) for b in device_blocks))
        if num_full <= first:
            return
        extend_block_hashes(req.block_hashes, req.token_slice, num_full * bs, bs, req.cache_salt)
        with self.pool.locked():
            chain = self._host_chain(req, first, num_full)
            # Pin what the host holds first, so making room never evicts this chain's pages.
            self.pool.pin(p for p in chain if p is not None)
            missing = [first + j for j, p in enumerate(chain) if p is None]
            fresh = self.pool.allocate(len(missing))
        missing = missing[:len(fresh)]  # short of room: the leading missing pages go first
        for i, page in zip(missing, fresh):
            chain[i - first] = page
        whole = all(p is not None for p in chain) and len(chain) == num_full - first
        # A collision or a full host pool ends the chain: pages after a gap are never hit.
        req.num_host_pages = num_full if whole else req.num_prompt_tokens // bs + 1
        copy = _Copy([], list(reversed([p for p in chain if p is not None])), False,
                     time.perf_counter())
        copy.commits = [_Commit(p, req.block_hashes[i],
                                tuple(req.token_slice(i * bs, (i + 1) * bs)),
                                all(blocks[i] != NULL_BLOCK_ID for blocks in device_blocks))
                        for i, p in zip(missing, fresh)]
        if fresh and hold is not None:
            copy.held = hold(missing)
        try:
            if fresh:
                copy.add(self.accelerator.copy_pages(
                    [p.page_id for p in fresh],
                    [[blocks[i] for i in missing] for blocks in device_blocks], to_device=False))
            nbytes = len(fresh) * self.layout.page_bytes
            # The prompt's last full page carries the state a later turn resumes from.
            last = chain[-1] if chain else None
            if whole and last is not None and num_full == req.num_prompt_tokens // bs:
                nbytes += self._store_state(req, last, num_full * bs, copy)
        except BaseException:
            copy.commits, copy.handles = [], []
            self._finish(copy)
            raise
        self._stats.store_bytes += nbytes
        self._storing.update((c.block_hash, c) for c in copy.commits)
        self._track(copy)

    def _host_chain(self, req: Request, first: int, num_full: int) -> list[Page | None]:
        """Per prompt page from `first`: the host page that holds it (or a store in flight
        writes it to), None where the host lacks it; cut before a page whose hash collides."""
        bs, chain = self.block_size, []
        for i in range(first, num_full):
            page, tokens = self._holder(req.block_hashes[i])
            if page is not None and tokens != tuple(req.token_slice(i * bs, (i + 1) * bs)):
                break  # a hash collision: no hit can pass this page anyway
            chain.append(page)
        return chain

    def _store_state(self, req: Request, last: Page, num_tokens: int, copy: _Copy) -> int:
        """The request's layer state at num_tokens into a state slot beside its last page
        (models that restore state, once per page); the bytes it copies."""
        if not self.restores_state or last.state_slot is not None:
            return 0
        slot = self.pool.take_state_slot()
        if slot is None:
            return 0
        try:
            copy.add(self.accelerator.copy_state(slot, req.request_id, num_tokens,
                                                            to_device=False))
        except BaseException:
            self.pool.release_state_slot(slot)
            raise
        copy.state = (last, slot)
        return self.layout.state_slot_bytes

    def _holder(self, block_hash: BlockHash) -> tuple[Page | None, tuple[int, ...] | None]:
        """The host page that holds this hash, or that a store in flight is writing it to,
        and its tokens (for the collision check)."""
        page = self.pool.holder(block_hash)
        if page is not None:
            return page, page.token_ids
        storing = self._storing.get(block_hash)
        return (None, None) if storing is None else (storing.page, storing.tokens)

    # ---- copies in flight ----------------------------------------------------------------
    def _track(self, copy: _Copy) -> None:
        if copy.handles:
            self._inflight.append(copy)
        else:
            self._finish(copy)

    def poll(self, wait: bool = False) -> None:
        """Complete finished copies: index stored pages, unpin pages (all of them if wait)."""
        still: list[_Copy] = []
        for copy in self._inflight:
            if wait:
                for handle in copy.handles:
                    handle.wait()
            if all(h.done() for h in copy.handles):
                self._finish(copy)
            else:
                still.append(copy)
        self._inflight = still
        if self.disk is not None:
            self._finish_disk(wait)
        self.pool.maintain()

    def _finish_disk(self, wait: bool) -> None:
        """Index pages read from disk (whole ones: a corrupt page goes back to the free
        list); let go of host pages written back."""
        assert self.disk is not None
        for done in self.disk.poll(wait):
            page = self._disk_pages.pop(done.page_id)
            if done.is_read and done.entry is not None:
                self.pool.commit(page, done.block_hash, done.entry.tokens, done.entry.complete)
            self.pool.unpin([page])

    def _write_back(self, page: Page) -> None:
        """A page just indexed on the host goes to disk too (pinned until it is written)."""
        if self.disk is None or page.block_hash is None or page.token_ids is None:
            return
        if self.disk.write(page.block_hash, page.token_ids, page.complete, page.page_id):
            self.pool.pin([page])
            self._disk_pages[page.page_id] = page

    def _finish(self, copy: _Copy) -> None:
        for c in copy.commits:
            if self._storing.get(c.block_hash) is c:
                del self._storing[c.block_hash]
            if self.pool.commit(c.page, c.block_hash, c.tokens, c.complete):
                self._stats.stored_pages += 1
                self._write_back(c.page)
        if copy.state is not None:
            page, slot = copy.state
            if page.block_hash is not None:
                self.pool.set_state(page, slot)
            else:
                self.pool.release_state_slot(slot)
        self.pool.unpin(copy.pinned)  # uncommitted pages go back to the free list here
        if copy.held is not None:
            copy.held.release()
        elapsed = time.perf_counter() - copy.started
        if copy.to_device:
            self._stats.load_seconds += elapsed
        else:
            self._stats.store_seconds += elapsed

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    @property
    def busy(self) -> bool:
        """Copies or disk jobs in flight: poll() has work to finish (host pages to unpin)."""
        return bool(self._inflight or self._disk_pages)

    @property
    def holds_blocks(self) -> bool:
        """Whether a store in flight holds device blocks (KVCacheManager.hold)."""
        return any(c.held is not None for c in self._inflight)

    # ---- admin ---------------------------------------------------------------------------
    def reset(self) -> int:
        """Forget unpinned host pages and the disk tier's pages (an explicit reset asks for
        cold prefills, not the next restart's hits)."""
        return self.pool.reset() + (self.disk.reset() if self.disk is not None else 0)

    def disk_stats(self) -> DiskStats | None:
        return self.disk.stats() if self.disk is not None else None

    def close(self) -> None:
        """Every copy and disk job done (they target the host pool), the disk workers gone."""
        self.poll(wait=True)
        if self.disk is not None:
            self.disk.close()
        self.pool.close()

    def stats(self) -> HiCacheStats:
        self.pool.maintain()  # an idle rank reports: a dead peer's pins go all the same
        s = self._stats
        s.pages_used, s.evicted_pages = self.pool.num_used, self.pool.evictions
        s.pages_pinned = self.pool.num_pinned
        return HiCacheStats(**vars(s))
