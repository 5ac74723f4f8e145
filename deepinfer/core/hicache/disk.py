"""HiCache's disk tier: KV pages written back from host pages to files in a local folder, and
read back into host pages when a prompt's page hashes match (before the request runs).

One file per page, named by its hash-chain hash, in a folder named for everything the page's
bytes depend on (the checkpoint, dtype, backend, page layout: `kv_fingerprint`), so a page of
another model or layout is never read. A file is a header, the page's tokens and its bytes,
with a CRC-32 over tokens and bytes: a page that fails it (a flipped bit, a file cut short) is
deleted and recomputed, never served. Files are written under a temporary name and renamed,
so a process killed mid-write leaves no page under a page's name; the next start removes the
temporaries.

The index is the folder itself: a start reads every file's header (least recently used first,
by modification time, which a hit refreshes), and a lookup the in-memory index misses checks
for the file, so ranks sharing the folder hit each other's pages. File I/O and checksums run on
worker threads (both release the GIL; reads have their own, never queued behind
write-back); the step loop only submits jobs and collects the
finished ones (`poll`). A write that fails (the disk full) stops write-back for good, with a
log line and a metric; reads and serving go on.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import struct
import threading
import time
import zlib
from array import array
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Sequence

from deepinfer.core.config import ModelSpec
from deepinfer.core.hicache.rate import Rate
from deepinfer.core.kv.hashing import BlockHash

log = logging.getLogger(__name__)

MAGIC = b"DIKVPG01"
# magic, complete, number of tokens, payload bytes, block hash, CRC-32 of tokens + payload
_HEADER = struct.Struct("<8s?3xIQ16sI")
SUFFIX = ".kv"
_TMP = ".tmp"


@dataclass
class DiskStats:
    """Running totals of one rank's disk tier (gauges: pages, bytes_used, capacity_bytes,
    write_queue, write_stopped)."""

    pages: int = 0
    bytes_used: int = 0
    capacity_bytes: int = 0
    write_queue: int = 0  # pages waiting for or in write-back
    write_stopped: int = 0  # 1 once a write failed (the disk full): write-back is off
    written_pages: int = 0
    write_bytes: int = 0
    write_seconds: float = 0.0
    write_errors: int = 0
    write_dropped: int = 0  # pages not written back: the queue was full or write-back off
    read_pages: int = 0
    read_bytes: int = 0
    read_seconds: float = 0.0
    corrupt_pages: int = 0  # failed their checksum (or header): deleted, never served
    evicted_pages: int = 0
    # prompts admitted before their pages from disk were all read: the disk reads a page
    # slower than the engine recomputes it (worth_waiting)
    unawaited_prefetches: int = 0


@dataclass(frozen=True)
class DiskEntry:
    tokens: tuple[int, ...]
    complete: bool
    file_bytes: int


@dataclass(frozen=True)
class DiskDone:
    """A finished job: a read (`entry` None unless the page is whole and its tokens are the
    ones asked for) or a write (`entry` None if it failed)."""

    is_read: bool
    block_hash: BlockHash
    page_id: int
    entry: DiskEntry | None
    corrupt: bool = False


@dataclass
class _Job:
    is_read: bool
    block_hash: BlockHash
    page_id: int
    future: Future
    started: float


@dataclass
class _ReadSpan:
    """Reads in flight without a break: from the first one's submission to the last's end."""

    start: float
    bytes: int = 0
    end: float = 0.0


def kv_fingerprint(model: ModelSpec, seed: int, backend: str, page_bytes: int,
                   block_size: int) -> str:
    """A name for what a page's bytes depend on: the checkpoint's files (names, sizes,
    modification times), how it is loaded, the backend and the page layout."""
    h = hashlib.blake2b(digest_size=8)
    path = os.path.realpath(model.path)
    files = sorted(os.listdir(path)) if os.path.isdir(path) else [""]
    for name in files:
        st = os.stat(os.path.join(path, name)) if name else os.stat(path)
        h.update(f"{name}:{st.st_size}:{st.st_mtime_ns};".encode())
    dummy_seed = seed if model.load_format == "dummy" else None
    h.update(repr((path, model.dtype, model.load_format, model.quantization, dummy_seed,
                   backend, page_bytes, block_size)).encode())
    return h.hexdigest()


# Reads (a prompt waits for them) have threads of their own, so they never queue behind
# write-back; several, as one thread's page at a time leaves an NVMe drive mostly idle
# (benchmarks/disk_tier.py, docs/benchmarks.md).
READ_WORKERS = 4
WRITE_WORKERS = 2
# Reads done in the open span that make its own rate the one to go by (fewer: the readers'
# first pages, which end about together, would understate it).
SPAN_MIN_READS = 2 * READ_WORKERS


class DiskTier:
    def __init__(self, root: str, capacity_bytes: int, memory: memoryview, page_bytes: int,
                 fingerprint: str, max_queue: int = 64, write_bytes_per_s: float = 0.0,
                 read_workers: int = READ_WORKERS, write_workers: int = WRITE_WORKERS) -> None:
        self.dir = os.path.join(root, fingerprint)
        os.makedirs(self.dir, exist_ok=True)
        self.memory, self.page_bytes = memory, page_bytes
        self.max_queue = max(1, max_queue)
        self.file_bytes = _HEADER.size + page_bytes  # without the tokens
        self._index: OrderedDict[BlockHash, DiskEntry] = OrderedDict()  # LRU first
        self._jobs: list[_Job] = []
        self._writing: set[BlockHash] = set()
        self._stats = DiskStats(capacity_bytes=capacity_bytes)
        self._readers = ThreadPoolExecutor(read_workers, thread_name_prefix="hicache-disk-read")
        self._writers = ThreadPoolExecutor(write_workers,
                                           thread_name_prefix="hicache-disk-write")
        self._throttle = _Throttle(write_bytes_per_s) if write_bytes_per_s > 0 else None
        # Bytes a second the reads move, measured over spans with reads in flight (from a read
        # submitted with none in flight to the last of them done): whether a prompt should wait
        # for its pages or recompute them (worth_waiting).
        self.read_rate = Rate()
        self._span: _ReadSpan | None = None
        self._scan()

    # ---- the folder ----------------------------------------------------------------------
    def path(self, block_hash: BlockHash) -> str:
        name = block_hash.hex()
        return os.path.join(self.dir, name[:2], name + SUFFIX)

    def _scan(self) -> None:
        """The index from the files' headers, oldest first; leftover temporaries removed."""
        found: list[tuple[int, BlockHash, DiskEntry]] = []
        for sub in os.listdir(self.dir):
            folder = os.path.join(self.dir, sub)
            if not os.path.isdir(folder):
                continue
            for name in os.listdir(folder):
                path = os.path.join(folder, name)
                if _TMP in name:
                    _unlink(path)  # a write a killed process left unfinished
                    continue
                read = _read_header(path, self.page_bytes)
                if read is None:
                    self._stats.corrupt_pages += 1
                    _unlink(path)
                    continue
                block_hash, entry, mtime = read
                found.append((mtime, block_hash, entry))
        for _, block_hash, entry in sorted(found, key=lambda f: f[0]):
            self._add(block_hash, entry)
        self._evict_over_capacity()

    # ---- lookups -------------------------------------------------------------------------
    def holds(self, block_hash: BlockHash) -> bool:
        """Whether the page may be read: in the index, or written by another rank sharing
        the folder (its tokens are checked when it is read)."""
        return block_hash in self._index or os.path.exists(self.path(block_hash))

    def read(self, block_hash: BlockHash, tokens: Sequence[int], page_id: int) -> None:
        """Start reading the page into host page `page_id` (its bytes are trusted only once
        poll returns the read with an entry)."""
        if block_hash in self._index:
            self._index.move_to_end(block_hash)
        view = self._page(page_id)
        if self._span is None:
            self._span = _ReadSpan(time.perf_counter())
        future = self._readers.submit(_timed_read, self.path(block_hash), view, tuple(tokens))
        self._jobs.append(_Job(True, block_hash, page_id, future, time.perf_counter()))

    # ---- write-back ----------------------------------------------------------------------
    def write(self, block_hash: BlockHash, tokens: Sequence[int], complete: bool,
              page_id: int) -> bool:
        """Start writing host page `page_id` back; False when it is not written (held already,
        being written, write-back off or its queue full). The host page must not change
        until poll returns the write."""
        if block_hash in self._index or block_hash in self._writing:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
            return False
        if self._stats.write_stopped or len(self._writing) >= self.max_queue:
            self._stats.write_dropped += 1
            return False
        self._writing.add(block_hash)
        future = self._writers.submit(_write_page, self.path(block_hash), block_hash,
                                      tuple(tokens), complete, self._page(page_id),
                                      self._throttle)
        self._jobs.append(_Job(False, block_hash, page_id, future, time.perf_counter()))
        return True

    # ---- jobs ----------------------------------------------------------------------------
    def poll(self, wait: bool = False) -> list[DiskDone]:
        done, still = [], []
        for job in self._jobs:
            if wait or job.future.done():
                done.append(self._finish(job))
            else:
                still.append(job)
        self._jobs = still
        if self._span is not None and not any(j.is_read for j in still):
            self.read_rate.add(self._span.bytes, self._span.end - self._span.start)
            self._span = None
        return done

    def page_read_s(self) -> float | None:
        """Seconds a page takes to read: by the reads in flight now once SPAN_MIN_READS of
        them are done (the first prompt after a start, a disk that turned slow), else by the
        spans before; None before any."""
        span = self._span
        if span is not None and span.bytes >= SPAN_MIN_READS * self.page_bytes \
                and span.end > span.start:
            return self.page_bytes * (span.end - span.start) / span.bytes
        return self.read_rate.seconds_for(self.page_bytes)

    def worth_waiting(self, recompute_page_s: float | None) -> bool:
        """Whether a prompt should wait (on) for its pages from this disk: one page reads
        faster than it is recomputed (`recompute_page_s`); yes while either is unknown. A no
        is counted (unawaited_prefetches): its reads go on, for the host tier, while the
        prompt recomputes what has not landed."""
        read_s = self.page_read_s()
        if read_s is None or recompute_page_s is None or read_s < recompute_page_s:
            return True
        self._stats.unawaited_prefetches += 1
        return False

    def reading(self, page_ids: Iterable[int]) -> bool:
        wanted = set(page_ids)
        return any(j.is_read and j.page_id in wanted for j in self._jobs)

    def _finish(self, job: _Job) -> DiskDone:
        elapsed = time.perf_counter() - job.started
        s = self._stats
        try:
            result = job.future.result()
        except OSError as exc:
            return self._failed(job, exc)
        if job.is_read:
            entry, corrupt, ended = result
            self._span_read(ended)
            s.read_seconds += elapsed
            if corrupt:
                s.corrupt_pages += 1
                self._drop(job.block_hash)
            elif entry is not None:
                s.read_pages += 1
                s.read_bytes += self.page_bytes
                if job.block_hash not in self._index:  # another rank's page
                    self._add(job.block_hash, entry)
                    self._evict_over_capacity()
            return DiskDone(True, job.block_hash, job.page_id, entry, corrupt)
        entry, _ = result
        self._writing.discard(job.block_hash)
        s.written_pages += 1
        s.write_bytes += entry.file_bytes
        s.write_seconds += elapsed
        self._add(job.block_hash, entry)
        self._evict_over_capacity()
        return DiskDone(False, job.block_hash, job.page_id, entry)

    def _span_read(self, ended: float) -> None:
        """A read of the open span ended (every read in flight belongs to it)."""
        assert self._span is not None
        self._span.bytes += self.page_bytes
        self._span.end = max(self._span.end, ended)

    def _failed(self, job: _Job, exc: OSError) -> DiskDone:
        if job.is_read:  # unreadable now (removed by another rank's eviction): a miss
            self._index.pop(job.block_hash, None)
            return DiskDone(True, job.block_hash, job.page_id, None)
        self._writing.discard(job.block_hash)
        self._stats.write_errors += 1
        if not self._stats.write_stopped:
            self._stats.write_stopped = 1
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            log.warning("HiCache disk tier: write-back to %s stopped (%s)%s; serving goes on",
                        self.dir, exc.strerror or exc,
                        ": the disk is full" if full else "")
        return DiskDone(False, job.block_hash, job.page_id, None)

    # ---- the index -----------------------------------------------------------------------
    def _add(self, block_hash: BlockHash, entry: DiskEntry) -> None:
        old = self._index.pop(block_hash, None)
        if old is not None:
            self._stats.bytes_used -= old.file_bytes
        self._index[block_hash] = entry
        self._stats.bytes_used += entry.file_bytes

    def _drop(self, block_hash: BlockHash) -> None:
        entry = self._index.pop(block_hash, None)
        if entry is not None:
            self._stats.bytes_used -= entry.file_bytes
        _unlink(self.path(block_hash))

    def _evict_over_capacity(self) -> None:
        """Delete least recently used pages until the rest fit the capacity; pages being read
        stay (a file removed under a read would only turn it into a miss)."""
        reading = {j.block_hash for j in self._jobs if j.is_read}
        cap = self._stats.capacity_bytes
        for block_hash in list(self._index):
            if self._stats.bytes_used <= cap:
                return
            if block_hash not in reading:
                self._drop(block_hash)
                self._stats.evicted_pages += 1

    def _page(self, page_id: int) -> memoryview:
        start = page_id * self.page_bytes
        return self.memory[start:start + self.page_bytes]

    # ---- admin ---------------------------------------------------------------------------
    def reset(self) -> int:
        """Delete every page no job reads or writes; returns how many were dropped."""
        busy = {j.block_hash for j in self._jobs}
        dropped = [h for h in self._index if h not in busy]
        for block_hash in dropped:
            self._drop(block_hash)
        return len(dropped)

    def stats(self) -> DiskStats:
        s = self._stats
        s.pages, s.write_queue = len(self._index), len(self._writing)
        return DiskStats(**vars(s))

    def close(self) -> None:
        """Finish the jobs in flight (their host pages must outlive them) and stop."""
        self.poll(wait=True)
        self._readers.shutdown(wait=True)
        self._writers.shutdown(wait=True)


# ---- the workers' side ----------------------------------------------------------------------
class _Throttle:
    """Write-back at most `bytes_per_s`: each write starts at its slot in one schedule shared
    by the workers."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self._next = 0.0
        self._lock = threading.Lock()

    def wait(self, nbytes: int) -> None:
        with self._lock:
            start = max(time.monotonic(), self._next)
            self._next = start + nbytes / self.bytes_per_s
        time.sleep(max(0.0, start - time.monotonic()))


def _write_page(path: str, block_hash: BlockHash, tokens: tuple[int, ...], complete: bool,
                payload: memoryview, throttle: _Throttle | None = None
                ) -> tuple[DiskEntry, bool]:
    if throttle is not None:
        throttle.wait(len(payload))
    token_bytes = array("q", tokens).tobytes()
    crc = zlib.crc32(payload, zlib.crc32(token_bytes))
    header = _HEADER.pack(MAGIC, complete, len(tokens), len(payload), block_hash, crc)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}{_TMP}{os.getpid()}-{threading.get_ident()}"
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(token_bytes)
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise
    size = len(header) + len(token_bytes) + len(payload)
    return DiskEntry(tokens, complete, size), False


def _timed_read(path: str, payload: memoryview, tokens: tuple[int, ...]
                ) -> tuple[DiskEntry | None, bool, float]:
    """_read_page, and the moment it ended (the read rate's span)."""
    entry, corrupt = _read_page(path, payload, tokens)
    return entry, corrupt, time.perf_counter()


def _read_page(path: str, payload: memoryview, tokens: tuple[int, ...]
               ) -> tuple[DiskEntry | None, bool]:
    """(entry, False) for a whole page of these tokens, (None, True) for a corrupt one, (None,
    False) for another page under the same hash (a collision) or none at all."""
    try:
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
            fields = _parse(head, len(payload))
            if fields is None:
                return None, True
            complete, ntokens, crc = fields
            token_bytes = f.read(8 * ntokens)
            got = f.readinto(payload)
            extra = f.read(1)
    except FileNotFoundError:
        return None, False
    if len(token_bytes) != 8 * ntokens or got != len(payload) or extra:
        return None, True
    if zlib.crc32(payload, zlib.crc32(token_bytes)) != crc:
        return None, True
    stored = tuple(array("q", token_bytes))
    if stored != tokens:
        return None, False
    try:
        os.utime(path)  # the LRU order a restart reads back
    except OSError:
        pass
    return DiskEntry(stored, complete, len(head) + len(token_bytes) + len(payload)), False


def _parse(head: bytes, page_bytes: int) -> tuple[bool, int, int] | None:
    if len(head) != _HEADER.size:
        return None
    magic, complete, ntokens, nbytes, _, crc = _HEADER.unpack(head)
    if magic != MAGIC or nbytes != page_bytes:
        return None
    return complete, ntokens, crc


def _read_header(path: str, page_bytes: int) -> tuple[BlockHash, DiskEntry, int] | None:
    """A file's hash, entry and modification time from its header and size (its checksum is
    checked when it is read); None for a file that cannot be a whole page."""
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
            fields = _parse(head, page_bytes)
            if fields is None:
                return None
            complete, ntokens, _ = fields
            token_bytes = f.read(8 * ntokens)
    except OSError:
        return None
    block_hash = _HEADER.unpack(head)[4]
    size = _HEADER.size + 8 * ntokens + page_bytes
    name = os.path.basename(path)
    if len(token_bytes) != 8 * ntokens or st.st_size != size or name != block_hash.hex() + SUFFIX:
        return None
    return block_hash, DiskEntry(tuple(array("q", token_bytes)), complete, size), st.st_mtime_ns


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
