"""The node-wide HiCache pool's bookkeeping (core/hicache/shared_pool.py), checked against the
per-rank HostPagePool and a dict: what one rank commits another finds; eviction never takes a
page any rank pins; a rank killed (SIGKILL) while it holds pages is undone by its peers; the
index table stays exact through deletions that wrap around."""
from __future__ import annotations

import errno
import hashlib
import os
import random
import signal
import subprocess
import sys
import textwrap

import pytest

from deepinfer.core.hicache import shared_pool as shared_module
from deepinfer.core.hicache.shared_pool import (
    PoolGeometry,
    SharedHostPagePool,
    SharedPoolPlace,
    pages_file,
)
from deepinfer.core.kv.hashing import hash_block

BLOCK = 4
GEOMETRY = PoolGeometry(num_pages=8, page_bytes=64, block_size=BLOCK, fingerprint="model-a")


def _pools(path: str, n: int = 2, geometry: PoolGeometry = GEOMETRY) -> list[SharedHostPagePool]:
    return [SharedHostPagePool(SharedPoolPlace(path, n, rank), geometry) for rank in range(n)]


def _counted_right(pool: SharedHostPagePool) -> bool:
    """The pool's running counts are what a scan of its records gives."""
    return (pool.num_used, pool.num_pinned) == (
        int((pool._state != shared_module.FREE).sum()), int(pool._pins.any(axis=1).sum()))


def _page(i: int) -> tuple[bytes, tuple[int, ...]]:
    tokens = tuple(range(i * BLOCK, (i + 1) * BLOCK))
    return hash_block(None, tokens), tokens


def _store(pool: SharedHostPagePool, i: int) -> int:
    """Page i written and indexed by this rank, then let go; its page id."""
    h, tokens = _page(i)
    (page,) = pool.allocate(1)
    assert pool.commit(page, h, tokens)
    pool.unpin([page])
    return page.page_id


def test_one_rank_finds_what_another_committed(tmp_path):
    a, b = _pools(str(tmp_path))
    page_id = _store(a, 0)
    h, tokens = _page(0)
    found = b.lookup(h, tokens)
    assert found is not None and found.page_id == page_id
    assert found.block_hash == h and found.token_ids == tokens and found.complete
    assert b.lookup(h, tokens[:-1] + (999,)) is None, "a hit must compare the tokens"
    assert b.holder(h).page_id == page_id
    # A second rank storing the same page finds it indexed: its copy goes back free.
    (dup,) = b.allocate(1)
    assert not b.commit(dup, h, tokens)
    b.unpin([dup])
    assert a.num_used == b.num_used == 1 and a.num_pinned == 0
    assert os.path.getsize(pages_file(a.place)) == GEOMETRY.num_pages * GEOMETRY.page_bytes


def test_eviction_is_lru_and_skips_pages_any_rank_pins(tmp_path):
    a, b = _pools(str(tmp_path))
    ids = [_store(a, i) for i in range(8)]  # the pool is full
    held = b.lookup(*_page(0))
    b.pin([held])  # the oldest page, pinned by the other rank
    used_again = b.lookup(*_page(1))
    b.pin([used_again])
    b.unpin([used_again])  # page 1 is now the most recently used
    fresh = a.allocate(2)
    assert {p.page_id for p in fresh} == {ids[2], ids[3]}  # the oldest unpinned ones
    assert a.lookup(*_page(2)) is None and a.lookup(*_page(0)) is not None
    assert a.evictions == 2
    # Pinned: the 2 fresh pages and the one b holds; the other 5 can go.
    assert len(a.allocate(10)) == 5
    assert a.num_pinned == 8
    b.unpin([held])
    assert a.num_pinned == 7
    assert _counted_right(a)


def test_a_killed_rank_is_undone_by_its_peers(tmp_path):
    """SIGKILL of a rank holding pages (one it reads, two it writes): the pool's pinned count
    returns to 0 and the pages it was writing are free again."""
    a = SharedHostPagePool(SharedPoolPlace(str(tmp_path), 2, 0), GEOMETRY)
    _store(a, 0)
    child = textwrap.dedent(f"""
        import sys, time
        from deepinfer.core.hicache.shared_pool import *
        from deepinfer.core.kv.hashing import hash_block
        pool = SharedHostPagePool(SharedPoolPlace({str(tmp_path)!r}, 2, 1),
                                  PoolGeometry(8, 64, {BLOCK}, "model-a"))
        tokens = tuple(range({BLOCK}))
        pool.pin([pool.lookup(hash_block(None, tokens), tokens)])  # a copy from the pool
        pool.allocate(2)  # two stores in flight
        print("holding", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "holding"
        assert a.num_pinned == 3 and a.num_used == 3
        with pytest.raises(ValueError, match="held by the live process"):
            SharedHostPagePool(SharedPoolPlace(str(tmp_path), 2, 1), GEOMETRY)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert a.num_pinned == 3  # not reaped yet
    assert a.reap() == 2
    assert a.num_pinned == 0 and a.num_used == 1 and _counted_right(a)
    assert a.lookup(*_page(0)) is not None  # what the dead rank read is kept
    # A replacement takes the slot.
    SharedHostPagePool(SharedPoolPlace(str(tmp_path), 2, 1), GEOMETRY).close()


def test_a_restarted_rank_reaps_its_own_slot(tmp_path):
    path = str(tmp_path)
    a = SharedHostPagePool(SharedPoolPlace(path, 2, 1), GEOMETRY)
    a.allocate(3)
    a._ranks[1]["pid"] = 2 ** 22 + 12345  # as if its process were gone (pids stay below)
    again = SharedHostPagePool(SharedPoolPlace(path, 2, 1), GEOMETRY)
    assert again.num_pinned == 0 and again.num_used == 0 and _counted_right(again)


def test_another_model_or_layout_may_not_attach(tmp_path):
    _pools(str(tmp_path))
    other = PoolGeometry(8, 64, BLOCK, "model-b")
    with pytest.raises(ValueError, match="another model or layout"):
        SharedHostPagePool(SharedPoolPlace(str(tmp_path), 2, 0), other)
    with pytest.raises(ValueError, match="another layout"):
        SharedHostPagePool(SharedPoolPlace(str(tmp_path), 2, 0), PoolGeometry(16, 64, BLOCK, "a"))


def test_a_model_whose_digest_ends_in_zero_bytes_attaches(tmp_path):
    """The pool keeps the model's digest as raw bytes: one ending in NUL bytes (1 model in
    256) is the same digest when read back, so its ranks attach."""
    name = next(f"model-{i}" for i in range(10_000)
                if hashlib.sha256(f"model-{i}".encode()).digest()[-1] == 0)
    geometry = PoolGeometry(8, 64, BLOCK, name)
    first, second = _pools(str(tmp_path), geometry=geometry)
    page = _store(first, 3)
    assert second.lookup(*_page(3)).page_id == page
    with pytest.raises(ValueError, match="another model or layout"):
        SharedHostPagePool(SharedPoolPlace(str(tmp_path), 2, 0),
                           PoolGeometry(8, 64, BLOCK, name + "x"))


def test_no_room_leaves_no_files(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shared_module.os, "posix_fallocate", full)
    with pytest.raises(OSError):
        SharedHostPagePool(SharedPoolPlace(str(tmp_path), 2, 0), GEOMETRY)
    assert not os.path.exists(pages_file(SharedPoolPlace(str(tmp_path), 2, 0)))
    assert os.path.getsize(tmp_path / "meta") == 0  # the next rank tries afresh
    monkeypatch.undo()
    _pools(str(tmp_path))


def test_reset_forgets_what_no_rank_pins(tmp_path):
    a, b = _pools(str(tmp_path))
    for i in range(4):
        _store(a, i)
    kept = b.lookup(*_page(3))
    b.pin([kept])
    assert a.reset() == 3 and a.evictions == 0
    assert b.lookup(*_page(3)) is not None and b.lookup(*_page(0)) is None
    b.unpin([kept])


def test_the_index_stays_exact_through_wrapping_deletions(tmp_path):
    """Random commits and evictions on a small table, with hashes forced into a few home
    slots (long probe runs that wrap around the table's end): every lookup agrees with a
    dict."""
    geometry = PoolGeometry(num_pages=24, page_bytes=8, block_size=1, fingerprint="t")
    (pool,) = _pools(str(tmp_path), 1, geometry)
    rng = random.Random(0)
    mask = pool.index.mask
    homes = [mask, mask - 1, 0, 3]  # the last slots too: runs wrap to the start
    reference: dict[bytes, tuple[int, ...]] = {}
    for step in range(3000):
        home = rng.choice(homes)
        key = rng.getrandbits(56) << 8 | home | 1  # the low bits pick the home slot
        h = (key & ~1).to_bytes(8, "little") + rng.randbytes(8)
        tokens = (step,)
        (page,) = pool.allocate(1)  # evicts the LRU page when full
        victims = [k for k in reference if pool.lookup(k, reference[k]) is None]
        for k in victims:
            del reference[k]
        assert pool.commit(page, h, tokens)
        pool.unpin([page])
        reference[h] = tokens
        assert len(reference) == min(step + 1, 24)
        if step % 50 == 0:
            for k, t in reference.items():
                assert pool.lookup(k, t) is not None
            assert len(pool.index) == len(reference)
            assert _counted_right(pool)
