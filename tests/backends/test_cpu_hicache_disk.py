"""HiCache's disk tier on the CPU backend: pages written back to a folder serve a restarted
engine (greedy tokens equal to a run with no cache, for llama, a sliding-window model and MLA);
a page that fails its checksum, a write a crash cut short and a full disk cost recomputes,
never wrong tokens; a disk slower than recomputing is not waited for; the folder stays within
its space."""
from __future__ import annotations

import errno
import logging
import os
import random
import time

import pytest
from checkpoints import make_checkpoint

from deepinfer.backends.cpu.accelerator import CPUAccelerator
from deepinfer.core.config import ModelSpec
from deepinfer.core.engine import Engine
from deepinfer.core.hicache import cache as cache_module
from deepinfer.core.hicache import disk as disk_module
from deepinfer.core.hicache.disk import SUFFIX, kv_fingerprint
from deepinfer.testing.hicache import BLOCK, GREEDY, check_disk_tier, generate, make_engine

VOCAB = 250
PROMPT_TOKENS = 200  # 12 pages a hit may cover (the last 8 tokens are recomputed)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    rng = random.Random(1)
    return [rng.randrange(2, VOCAB) for _ in range(PROMPT_TOKENS)]


def _engine(path: str, disk_dir: str | None, disk_pages: int = 1024) -> Engine:
    return make_engine(path, CPUAccelerator(), host_pages=64, disk_dir=disk_dir,
                       disk_pages=disk_pages)


def _run(path: str, disk_dir: str | None, prompt: list[int], disk_pages: int = 1024):
    """One request in a fresh engine (a restart): its output and the disk tier's stats."""
    engine = _engine(path, disk_dir, disk_pages)
    out = generate(engine, "r", prompt)
    engine.shutdown()
    disk = engine.hicache.disk_stats() if disk_dir is not None else None
    assert engine.hicache.pool.num_pinned == 0
    return out, disk


def _page_files(disk_dir: str) -> dict[tuple[int, ...], str]:
    """Every page file under disk_dir by the tokens its header names."""
    files = {}
    for folder, _, names in os.walk(disk_dir):
        for name in names:
            if name.endswith(SUFFIX):
                path = os.path.join(folder, name)
                page_bytes = os.path.getsize(path) - disk_module._HEADER.size - 8 * BLOCK
                read = disk_module._read_header(path, page_bytes)
                assert read is not None, path
                files[read[1].tokens] = path
    return files


@pytest.fixture(scope="module")
def reference(llama_dir, prompt):
    out, _ = _run(llama_dir, None, prompt)
    return list(out.token_ids)


@pytest.mark.parametrize("family", ["llama", "mistral", "deepseek_v3"])
def test_a_restart_is_served_from_disk_with_the_same_tokens(family, tmp_path):
    overrides = {"sliding_window": 24} if family == "mistral" else {}
    path = make_checkpoint(str(tmp_path / family), family, **overrides)
    runs = check_disk_tier(path, CPUAccelerator, VOCAB, str(tmp_path / "disk"))
    assert runs[1].stats.host_hit_tokens > runs[0].stats.host_hit_tokens


def test_a_corrupt_page_is_recomputed_not_served(llama_dir, prompt, reference, tmp_path):
    disk_dir = str(tmp_path / "disk")
    _, written = _run(llama_dir, disk_dir, prompt)
    assert written.written_pages == 12
    files = _page_files(disk_dir)
    bad = files[tuple(prompt[5 * BLOCK:6 * BLOCK])]
    with open(bad, "r+b") as f:  # one flipped bit in the page's bytes
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    out, read = _run(llama_dir, disk_dir, prompt)
    assert list(out.token_ids) == reference
    assert read.corrupt_pages == 1
    assert out.num_cached_tokens == 5 * BLOCK  # the pages before the corrupt one
    assert read.read_pages == 5 + 6  # the rest were read too, but a hit cannot pass a gap
    # The corrupt file was deleted; the recomputed page was written back whole.
    assert read.written_pages == 1
    page = memoryview(bytearray(os.path.getsize(bad) - disk_module._HEADER.size - 8 * BLOCK))
    entry, corrupt = disk_module._read_page(bad, page, tuple(prompt[5 * BLOCK:6 * BLOCK]))
    assert entry is not None and not corrupt


def test_a_write_cut_short_leaves_no_page(llama_dir, prompt, reference, tmp_path):
    """What a crash mid write-back can leave: a temporary file, and (on a file system that
    reorders writes) a page file cut short. Neither is served; a restart removes both."""
    disk_dir = str(tmp_path / "disk")
    _run(llama_dir, disk_dir, prompt)
    files = _page_files(disk_dir)
    cut = files[tuple(prompt[3 * BLOCK:4 * BLOCK])]
    with open(cut, "r+b") as f:
        f.truncate(os.path.getsize(cut) // 2)
    stray = cut + ".tmp123-456"
    with open(stray, "wb") as f:
        f.write(b"partial")
    out, read = _run(llama_dir, disk_dir, prompt)
    assert list(out.token_ids) == reference
    assert not os.path.exists(stray)
    assert read.corrupt_pages == 1  # found by the start's scan: deleted before any read
    assert out.num_cached_tokens == 3 * BLOCK
    assert os.path.getsize(cut) == os.path.getsize(files[tuple(prompt[:BLOCK])])  # rewritten


def test_a_full_disk_stops_write_back_and_serving_goes_on(llama_dir, prompt, reference,
                                                          tmp_path, monkeypatch, caplog):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(disk_module, "_write_page", full)
    disk_dir = str(tmp_path / "disk")
    engine = _engine(llama_dir, disk_dir)
    with caplog.at_level(logging.WARNING, logger="deepinfer.core.hicache.disk"):
        first = generate(engine, "a", prompt)
        again = generate(engine, "b", prompt[:96] + list(range(2, 82)))  # new pages
    engine.hicache.poll(wait=True)
    stats = engine.hicache.disk_stats()
    assert list(first.token_ids) == reference
    assert stats.write_stopped == 1 and stats.write_errors >= 1 and stats.written_pages == 0
    assert stats.write_dropped > 0  # the new pages, after the failure
    assert "disk is full" in caplog.text
    assert again.num_cached_tokens > 0  # the device and host tiers still serve
    assert engine.hicache.pool.num_pinned == 0
    engine.shutdown()


def test_the_folder_stays_within_its_space(llama_dir, prompt, tmp_path):
    disk_dir = str(tmp_path / "disk")
    _, stats = _run(llama_dir, disk_dir, prompt, disk_pages=4)
    assert stats.written_pages == 12 and stats.pages <= 4 + 1
    assert stats.evicted_pages == stats.written_pages - stats.pages
    assert stats.bytes_used <= stats.capacity_bytes
    assert len(_page_files(disk_dir)) == stats.pages


def test_pages_of_another_checkpoint_or_layout_are_never_read(llama_dir, tmp_path):
    spec = ModelSpec(llama_dir, "float32")
    base = kv_fingerprint(spec, 0, "cpu", 4096, 16)
    assert base == kv_fingerprint(spec, 0, "cpu", 4096, 16)
    assert base != kv_fingerprint(ModelSpec(llama_dir, "bfloat16"), 0, "cpu", 4096, 16)
    assert base != kv_fingerprint(spec, 0, "cpu", 4096, 32)
    assert base != kv_fingerprint(spec, 0, "cuda", 4096, 16)
    weights = os.path.join(llama_dir, "config.json")
    st = os.stat(weights)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    try:
        assert base != kv_fingerprint(spec, 0, "cpu", 4096, 16)
    finally:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_reset_drops_the_disk_pages_too(llama_dir, prompt, tmp_path):
    disk_dir = str(tmp_path / "disk")
    engine = _engine(llama_dir, disk_dir)
    generate(engine, "a", prompt)
    engine.hicache.poll(wait=True)
    assert len(_page_files(disk_dir)) == 12
    assert engine.reset_prefix_cache() >= 12
    assert _page_files(disk_dir) == {} and engine.hicache.disk_stats().pages == 0
    assert generate(engine, "b", prompt).num_cached_tokens == 0
    engine.shutdown()


def test_a_request_aborted_while_its_pages_come_from_disk_leaves_nothing(llama_dir, prompt,
                                                                         tmp_path):
    disk_dir = str(tmp_path / "disk")
    _run(llama_dir, disk_dir, prompt)
    engine = _engine(llama_dir, disk_dir)
    engine.add_request("gone", prompt, GREEDY)  # its pages start coming from disk
    assert engine.hicache.prefetching(engine.scheduler.waiting[0])
    engine.abort("gone")
    engine.hicache.poll(wait=True)
    assert not engine.hicache._prefetching and not engine.hicache.busy
    assert engine.hicache.pool.num_pinned == 0 and engine.kv.num_request_blocks() == 0
    # The pages it asked for were indexed all the same: the next request hits them.
    assert generate(engine, "next", prompt).num_cached_tokens == 12 * BLOCK
    engine.shutdown()


def test_a_disk_slower_than_recompute_is_not_waited_for(llama_dir, prompt, reference, tmp_path,
                                                        monkeypatch):
    """Where a page reads slower than it is recomputed, a prompt stops waiting for its pages
    from disk as soon as the reads in flight show it (the disk's rate not known before: the
    first prompt), and does not wait at all once it is known (the second): the tokens of no
    cache, while the reads go on into the host tier."""
    rng = random.Random(5)
    other, fresh = ([rng.randrange(2, VOCAB) for _ in range(PROMPT_TOKENS)] for _ in range(2))
    disk_dir = str(tmp_path / "disk")
    _run(llama_dir, disk_dir, prompt)
    expected, _ = _run(llama_dir, disk_dir, other)  # both prompts' pages on disk
    monkeypatch.setattr(cache_module, "RATE_MIN_TOKENS", 64)
    read = disk_module._read_page

    def slow_read(*args):  # 0.4 s a page: slower than this model recomputes one
        time.sleep(0.4)
        return read(*args)

    monkeypatch.setattr(disk_module, "_read_page", slow_read)
    engine = _engine(llama_dir, disk_dir)
    generate(engine, "fresh", fresh)  # on no tier: the prefill's rate
    assert engine.hicache.prefill_rate.value is not None
    # The disk's rate is not known yet: the prompt waits for its reads (rounds of 4) until 8
    # are done, which show the disk slower than the prefill; it runs with those 8 pages.
    first = generate(engine, "first", prompt)
    assert 8 * BLOCK <= first.num_cached_tokens < 12 * BLOCK
    assert list(first.token_ids) == reference
    second = generate(engine, "second", other)  # the rate known now: no wait at all
    assert engine.hicache.disk_stats().unawaited_prefetches == 2
    assert second.num_cached_tokens < 8 * BLOCK
    assert list(second.token_ids) == list(expected.token_ids)
    engine.hicache.poll(wait=True)
    assert engine.hicache.disk_stats().read_pages == 24  # the second's reads went on
    engine.shutdown()
    assert engine.hicache.pool.num_pinned == 0 and engine.kv.num_request_blocks() == 0
