"""A node-wide HiCache host pool: one set of host pages in shared memory for every rank of a
node, so any rank hits a page any rank stored (least-loaded routing, a restarted rank and a
changed --dp keep the node's cache).

Two files in a folder on a shared-memory file system (the server makes one per node):
`pages`, the page bytes, which every rank maps (and a GPU backend registers for its device),
and `meta`, the bookkeeping `HostPagePool` keeps in Python objects, as fixed arrays:

    header   geometry (pages, page bytes, block size, KV fingerprint) and the LRU clock
    ranks    per rank slot: the pid and start time of the process that holds it
    pages    per page: state (free / being written / indexed), hash, tokens, complete, LRU stamp
    pins     [pages, rank slots]: each rank's references, so a rank that dies is undone alone
    index    an open-addressing table hash -> page (linear probing, backward-shift deletion)

Every operation holds an exclusive `flock` on `meta` (the kernel drops it when a process dies,
so a SIGKILLed rank never leaves it held), and a thread lock within the process. The rank that
allocates a page owns it until it commits (indexes) it; an indexed page is read-only, and is
evicted only with no pin from any rank. A rank found dead (its pid gone, or another process
under it) is reaped: its pins dropped, the pages it was writing freed. Updates are ordered so
that one cut short by a death is harmless: an index entry is trusted only if the page's own
record holds the same hash, and an entry lost is only a miss.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
import time
from array import array
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np

from deepinfer.core.hicache.page_table import PageTable, table_slots
from deepinfer.core.kv.hashing import BlockHash

log = logging.getLogger(__name__)

MAGIC = b"DIHPOOL1"
HASH_BYTES = 16  # hash_block's digest
FREE, WRITING, INDEXED = 0, 1, 2
REAP_EVERY_S = 1.0  # how often a rank looks for dead peers without being short of pages


@dataclass(frozen=True)
class SharedPoolPlace:
    """Where a rank finds its node's shared pool: the folder, how many ranks share it (the
    pool holds each one's pages), and this rank's slot among them."""

    path: str
    num_ranks: int
    rank: int


@dataclass(frozen=True)
class PoolGeometry:
    num_pages: int
    page_bytes: int
    block_size: int
    fingerprint: str  # what the pages' bytes depend on: ranks of another model may not attach


def _dtypes(block_size: int, max_ranks: int) -> tuple[np.dtype, np.dtype, np.dtype]:
    header = np.dtype([("magic", "S8"), ("ready", "<i8"), ("num_pages", "<i8"),
                       ("page_bytes", "<i8"), ("block_size", "<i8"), ("max_ranks", "<i8"),
                       ("index_slots", "<i8"), ("fingerprint", "V32"), ("clock", "<i8"),
                       ("used", "<i8"), ("pinned", "<i8")])
    rank = np.dtype([("pid", "<i8"), ("started", "<i8")])
    page = np.dtype([("state", "u1"), ("complete", "u1"), ("hash", f"V{HASH_BYTES}"),
                     ("stamp", "<i8"), ("tokens", "<i8", (block_size,))])
    return header, rank, page


def _process_start(pid: int) -> int:
    """The process's start time in clock ticks since boot (/proc), so a pid reused by another
    process is told apart; 0 where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def process_alive(pid: int, started: int = 0) -> bool:
    """Whether process pid runs (and, given its start time, is still that process)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return started == 0 or _process_start(pid) in (0, started)


class SharedPage:
    """A page of the shared pool as HiCache sees a HostPage: its fields read the shared
    record (another rank may have changed them since; hits are pinned before they are used)."""

    __slots__ = ("pool", "page_id")

    def __init__(self, pool: "SharedHostPagePool", page_id: int) -> None:
        self.pool, self.page_id = pool, page_id

    @property
    def block_hash(self) -> BlockHash | None:
        rec = self.pool._pages[self.page_id]
        return bytes(rec["hash"]) if rec["state"] == INDEXED else None

    @property
    def token_ids(self) -> tuple[int, ...] | None:
        rec = self.pool._pages[self.page_id]
        return tuple(rec["tokens"].tolist()) if rec["state"] == INDEXED else None

    @property
    def complete(self) -> bool:
        return bool(self.pool._pages[self.page_id]["complete"])

    @property
    def ref_cnt(self) -> int:
        return int(self.pool._pins[self.page_id].sum())

    state_slot = None  # a shared pool keeps no layer state slots (HiCache.create checks)


class SharedHostPagePool:
    """HostPagePool's interface over the node's shared bookkeeping (see the module doc)."""

    def __init__(self, place: SharedPoolPlace, geometry: PoolGeometry) -> None:
        self.place, self.geometry = place, geometry
        self.slot = place.rank
        self.evictions = 0  # by this rank
        self._thread_lock = threading.RLock()
        self._depth = 0
        os.makedirs(place.path, exist_ok=True)
        self._fd = os.open(os.path.join(place.path, "meta"), os.O_RDWR | os.O_CREAT, 0o600)
        self._last_reap = 0.0
        try:
            with self.locked():
                self._map(create=os.fstat(self._fd).st_size == 0)
                self._take_slot()
        except BaseException:
            os.close(self._fd)
            raise
        self.pages = [SharedPage(self, i) for i in range(geometry.num_pages)]

    # ---- the mapping ---------------------------------------------------------------------
    def _map(self, create: bool) -> None:
        g, ranks = self.geometry, self.place.num_ranks
        header_t, rank_t, page_t = _dtypes(g.block_size, ranks)
        slots = table_slots(g.num_pages)
        sizes = [header_t.itemsize, rank_t.itemsize * ranks, page_t.itemsize * g.num_pages,
                 4 * g.num_pages * ranks, 8 * slots, 4 * slots]
        total = sum(sizes)
        if create:
            self._allocate_files(total)
        elif os.fstat(self._fd).st_size != total:
            raise ValueError(f"the shared host pool in {self.place.path} has another layout "
                             "(its ranks run another model or pool size)")
        self._mm = np.memmap(os.path.join(self.place.path, "meta"), np.uint8, "r+",
                             shape=(total,))
        offsets = np.cumsum([0] + sizes)
        raw: np.ndarray = self._mm.view(np.ndarray)  # plain arrays: memmap indexing is slow
        part = [raw[offsets[i]:offsets[i + 1]] for i in range(len(sizes))]
        self._header = part[0].view(header_t)[0:1]
        self._ranks = part[1].view(rank_t)
        self._pages = part[2].view(page_t)
        self._tokens: np.ndarray = self._pages["tokens"]
        self._hash: np.ndarray = self._pages["hash"]
        self._pins: np.ndarray = part[3].view("<i4").reshape(g.num_pages, ranks)
        self.index = PageTable(part[4].view("<u8"), part[5].view("<i4"), self._holds)
        self._state: np.ndarray = self._pages["state"]
        fingerprint = hashlib.sha256(g.fingerprint.encode()).digest()
        h = self._header[0]
        if create:
            h["magic"], h["num_pages"], h["page_bytes"] = MAGIC, g.num_pages, g.page_bytes
            h["block_size"], h["max_ranks"], h["index_slots"] = g.block_size, ranks, slots
            # Raw bytes (V32): an S32 field would drop a digest's trailing NUL bytes on read.
            h["fingerprint"], h["ready"] = np.void(fingerprint), 1
        elif (bytes(h["magic"]) != MAGIC or not h["ready"]
              or bytes(h["fingerprint"]) != fingerprint
              or (h["num_pages"], h["page_bytes"], h["block_size"], h["max_ranks"])
              != (g.num_pages, g.page_bytes, g.block_size, ranks)):
            theirs = (int(h["num_pages"]), int(h["page_bytes"]), int(h["block_size"]),
                      int(h["max_ranks"]), bytes(h["fingerprint"]).hex()[:16])
            ours = (g.num_pages, g.page_bytes, g.block_size, ranks, fingerprint.hex()[:16])
            raise ValueError(
                f"the shared host pool in {self.place.path} was made for another model or "
                f"layout than this rank's: (pages, page bytes, block size, ranks, model) "
                f"{theirs} there, {ours} here")

    def _allocate_files(self, meta_bytes: int) -> None:
        """Reserve both files' space now (tmpfs: a mapping past what it can hold would fault
        at first touch); a folder without the room is left empty, and the caller falls back
        to a pool per rank."""
        g, pages = self.geometry, pages_file(self.place)
        try:
            fd = os.open(pages, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.posix_fallocate(fd, 0, g.num_pages * g.page_bytes)
            finally:
                os.close(fd)
            os.posix_fallocate(self._fd, 0, meta_bytes)
        except OSError:
            os.ftruncate(self._fd, 0)
            with contextlib.suppress(OSError):
                os.unlink(pages)
            raise

    def _take_slot(self) -> None:
        if not 0 <= self.slot < self.place.num_ranks:
            raise ValueError(f"rank slot {self.slot} outside the pool's {self.place.num_ranks}")
        rec = self._ranks[self.slot]
        pid, started = int(rec["pid"]), int(rec["started"])
        if pid != os.getpid() and process_alive(pid, started):
            raise ValueError(f"rank slot {self.slot} of the shared host pool is held by the "
                             f"live process {int(rec['pid'])}")
        self._reap_slot(self.slot)  # a restarted rank: what its predecessor held goes
        rec["pid"], rec["started"] = os.getpid(), _process_start(os.getpid())

    # ---- locking -------------------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the pool (reentrant), also across several calls: a lookup and the pin that
        keeps its page."""
        with self._thread_lock:
            if self._depth == 0:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)

    # ---- sizes ---------------------------------------------------------------------------
    @property
    def num_total(self) -> int:
        return self.geometry.num_pages

    # Counted as pages change hands (a rank reports them after every step: no scan of the
    # pool), and recounted whenever dead ranks are looked for (what a death mid-update left).
    @property
    def num_used(self) -> int:
        return int(self._header[0]["used"])

    @property
    def num_pinned(self) -> int:
        """Pages some rank of the node pins."""
        return int(self._header[0]["pinned"])

    @property
    def num_free(self) -> int:
        return self.num_total - self.num_used

    def _count(self, used: int = 0, pinned: int = 0) -> None:
        h = self._header[0]
        h["used"], h["pinned"] = int(h["used"]) + used, int(h["pinned"]) + pinned

    def _recount(self) -> None:
        h = self._header[0]
        h["used"] = np.count_nonzero(self._state != FREE)
        h["pinned"] = np.count_nonzero(self._pins.any(axis=1))

    @property
    def num_evictable(self) -> int:
        with self.locked():
            return int(np.count_nonzero((self._state == INDEXED) & ~self._pins.any(axis=1)))

    # ---- index ---------------------------------------------------------------------------
    def _holds(self, page: int, block_hash: BlockHash) -> bool:
        """Whether the page's own record holds block_hash (what confirms an index entry)."""
        return self._state[page] == INDEXED and self._hash[page].tobytes() == block_hash

    def lookup(self, block_hash: BlockHash, tokens: Sequence[int]) -> SharedPage | None:
        with self.locked():
            page = self.index.find(block_hash)
            if page < 0 or self._tokens[page].tobytes() != array("q", tokens).tobytes():
                return None
            return self.pages[page]

    def holder(self, block_hash: BlockHash) -> SharedPage | None:
        with self.locked():
            page = self.index.find(block_hash)
            return None if page < 0 else self.pages[page]

    def commit(self, page: SharedPage, block_hash: BlockHash, tokens: Sequence[int],
               complete: bool = True) -> bool:
        with self.locked():
            if self.index.find(block_hash) >= 0:
                return False
            rec = self._pages[page.page_id]
            rec["hash"], rec["tokens"] = np.void(bytes(block_hash)), list(tokens)
            rec["complete"] = complete
            rec["state"] = INDEXED  # the record first: an entry is trusted only if it matches
            self.index.insert(block_hash, page.page_id)
            return True

    # ---- references ----------------------------------------------------------------------
    def pin(self, pages: Iterable[SharedPage]) -> None:
        ids = np.fromiter((p.page_id for p in pages), np.int64)
        with self.locked():
            uniq = np.unique(ids)
            self._count(pinned=int(np.count_nonzero(~self._pins[uniq].any(axis=1))))
            np.add.at(self._pins[:, self.slot], ids, 1)

    def unpin(self, pages: Iterable[SharedPage]) -> None:
        """Drop one reference each, in eviction order (first is evicted first)."""
        ids = np.fromiter((p.page_id for p in pages), np.int64)
        with self.locked():
            mine = self._pins[:, self.slot]
            counts = np.bincount(ids, minlength=len(mine))[ids]
            if (mine[ids] < counts).any():
                raise RuntimeError(f"host pages {ids[mine[ids] < counts].tolist()} unpinned "
                                   "twice")
            np.subtract.at(mine, ids, 1)
            # A page joins the LRU where its last reference in the list is, as one by one.
            uniq, from_end = np.unique(ids[::-1], return_index=True)
            idle = uniq[np.argsort(-from_end, kind="stable")]
            idle = idle[~self._pins[idle].any(axis=1)]
            indexed = idle[self._state[idle] == INDEXED]
            clock = int(self._header[0]["clock"])
            self._pages["stamp"][indexed] = clock + 1 + np.arange(len(indexed))
            self._header[0]["clock"] = clock + len(indexed)
            self._state[idle[self._state[idle] != INDEXED]] = FREE  # stores never committed
            self._count(used=len(indexed) - len(idle), pinned=-len(idle))

    def allocate(self, n: int) -> list[SharedPage]:
        """Up to n empty pages pinned by this rank: free ones first, then the least recently
        used indexed pages no rank pins."""
        with self.locked():
            out = self._take(n)
            if len(out) < n and self.reap():
                out += self._take(n - len(out))  # a dead rank's pages came back
            return [self.pages[i] for i in out]

    def _take(self, n: int) -> list[int]:
        free = np.flatnonzero(self._state == FREE)[:n].tolist()
        if len(free) < n:
            idle = np.flatnonzero((self._state == INDEXED) & ~self._pins.any(axis=1))
            oldest = idle[np.argsort(self._pages["stamp"][idle], kind="stable")]
            for page in oldest[:n - len(free)].tolist():
                self._evict(page)
                free.append(page)
        self._state[free] = WRITING
        self._pins[free, self.slot] = 1
        self._count(used=len(free), pinned=len(free))
        return free

    def _evict(self, page: int) -> None:
        self.index.remove(self._hash[page].tobytes(), page)  # first: a lost record is a miss
        self._state[page] = FREE
        self._count(used=-1)
        self.evictions += 1

    # ---- dead ranks ----------------------------------------------------------------------
    def reap(self) -> int:
        """Undo what ranks that died held: their pins dropped, the pages they were writing
        freed. How many pages came back."""
        with self.locked():
            self._last_reap = time.monotonic()
            freed = 0
            for slot in range(self.place.num_ranks):
                rec = self._ranks[slot]
                pid = int(rec["pid"])
                if slot != self.slot and pid and not process_alive(pid, int(rec["started"])):
                    log.warning("shared host pool: rank slot %d's process %d is gone; its "
                                "pins are released", slot, pid)
                    freed += self._reap_slot(slot)
                    rec["pid"] = 0
            self._recount()
            return freed

    def _reap_slot(self, slot: int) -> int:
        held = np.flatnonzero(self._pins[:, slot])
        self._pins[held, slot] = 0
        unpinned = held[~self._pins[held].any(axis=1)]
        writing = unpinned[self._state[unpinned] == WRITING]
        self._state[writing] = FREE
        self._count(used=-len(writing), pinned=-len(unpinned))
        return len(writing)

    def maintain(self) -> None:
        """Reap dead ranks from time to time (cheap; the step loop calls it when it polls)."""
        if time.monotonic() - self._last_reap >= REAP_EVERY_S:
            self.reap()

    # ---- state slots: none in a shared pool ------------------------------------------------
    def take_state_slot(self) -> int | None:
        return None

    def set_state(self, page: SharedPage, slot: int) -> None:
        raise RuntimeError("a shared host pool keeps no state slots")

    def release_state_slot(self, slot: int) -> None:
        raise RuntimeError("a shared host pool keeps no state slots")

    def touch_state(self, page: SharedPage) -> None:
        pass

    # ---- reset and close -------------------------------------------------------------------
    def reset(self) -> int:
        """Forget every indexed page no rank pins; how many were dropped."""
        with self.locked():
            idle = np.flatnonzero((self._state == INDEXED) & ~self._pins.any(axis=1))
            for page in idle.tolist():
                self._evict(page)
                self.evictions -= 1  # a reset is not pressure
            return len(idle)

    def close(self) -> None:
        """Let go of this rank's slot (its pins too: nothing it started is still in flight)."""
        if self._fd < 0:
            return
        with self.locked():
            self._reap_slot(self.slot)
            self._ranks[self.slot]["pid"] = 0
        self._mm.flush()
        os.close(self._fd)
        self._fd = -1


def pages_file(place: SharedPoolPlace) -> str:
    """The file of the pool's page bytes (mapped by the backend's allocate_host_pool)."""
    return os.path.join(place.path, "pages")
