"""The disk tier's job queues (core/hicache/disk.py): a prompt's reads run on threads of their
own and never wait behind write-back, however slow that is; the reads' rate, and whether a
prompt waits for them."""
from __future__ import annotations

import time

from deepinfer.core.hicache import disk as disk_module
from deepinfer.core.hicache.disk import SPAN_MIN_READS, DiskTier
from deepinfer.core.hicache.rate import Rate
from deepinfer.core.kv.hashing import hash_block

PAGE = 8 << 10


def _page(i: int) -> tuple[bytes, tuple[int, ...]]:
    tokens = (i, i + 1)
    return hash_block(None, tokens), tokens


def test_a_read_does_not_queue_behind_write_back(tmp_path):
    memory = memoryview(bytearray(PAGE * 8))
    memory[:PAGE] = bytes(range(256)) * (PAGE // 256)
    first = DiskTier(str(tmp_path), 1 << 30, memory, PAGE, "fp")
    assert first.write(*_page(0), True, 0)
    first.poll(wait=True)
    first.close()
    # Write-back at 16 KB/s: the four pages below take 2 s, both writer threads busy with
    # them; the read of page 0 must not wait for that.
    tier = DiskTier(str(tmp_path), 1 << 30, memory, PAGE, "fp", write_bytes_per_s=16e3)
    for i in range(1, 5):
        assert tier.write(*_page(i), True, i)
    h, tokens = _page(0)
    tier.read(h, tokens, 5)
    done = []
    while not done:
        done = [d for d in tier.poll() if d.is_read]
    assert done[0].entry is not None and done[0].entry.tokens == tokens
    assert bytes(memory[5 * PAGE:6 * PAGE]) == bytes(memory[:PAGE])
    assert tier.stats().write_queue > 0, "the read waited for write-back to finish"
    tier.close()
    assert tier.stats().written_pages == 4


def test_the_read_rate_spans_reads_in_flight_and_decides_waiting(tmp_path):
    """The read rate is bytes over the span with reads in flight (here 4 pages, read by 4
    threads at once); a prompt waits for its pages while either rate is unknown or a page
    reads faster than it is recomputed, and not otherwise (counted)."""
    memory = memoryview(bytearray(PAGE * 8))
    tier = DiskTier(str(tmp_path), 1 << 30, memory, PAGE, "fp")
    for i in range(4):
        assert tier.write(*_page(i), True, i)
    tier.poll(wait=True)
    assert tier.read_rate.value is None and tier.worth_waiting(1e-3)  # not measured yet
    t0 = time.perf_counter()
    for i in range(4):
        tier.read(*_page(i), 4 + i)
    while tier.poll() or any(j.is_read for j in tier._jobs):
        pass
    span = time.perf_counter() - t0
    assert tier.read_rate.value is not None and tier.read_rate.value >= 4 * PAGE / span
    read_s = PAGE / tier.read_rate.value
    assert tier.worth_waiting(None)  # the prefill's rate unknown
    assert tier.worth_waiting(2 * read_s)
    assert not tier.worth_waiting(read_s / 2)
    assert tier.stats().unawaited_prefetches == 1
    tier.close()


def test_a_rate_weighs_new_samples_against_the_old():
    rate = Rate()
    assert rate.seconds_for(10) is None
    rate.add(100, 1.0)
    assert rate.value == 100 and rate.seconds_for(50) == 0.5
    rate.add(200, 1.0)
    assert 100 < rate.value < 200
    rate.add(0, 1.0)  # no sample
    rate.add(5, 0.0)
    assert 100 < rate.value < 200


def test_the_reads_in_flight_give_the_rate_before_their_span_ends(tmp_path, monkeypatch):
    """Once SPAN_MIN_READS reads of the open span are done, their own rate is the one a prompt
    goes by (the first prompt after a start has no span before it)."""
    memory = memoryview(bytearray(PAGE * 32))
    tier = DiskTier(str(tmp_path), 1 << 30, memory, PAGE, "fp")
    pages = SPAN_MIN_READS + 4
    for i in range(pages):
        assert tier.write(*_page(i), True, i)
    tier.poll(wait=True)
    read = disk_module._read_page

    def slow_read(*args):
        time.sleep(0.2)
        return read(*args)

    monkeypatch.setattr(disk_module, "_read_page", slow_read)
    for i in range(pages):
        tier.read(*_page(i), pages + i)
    while tier.page_read_s() is None:
        tier.poll()
    assert tier.read_rate.value is None  # the span is still open: its reads are the measure
    assert any(j.is_read for j in tier._jobs)
    # 4 readers, 0.2 s a page: ~0.05 s a page (thread start-up and polling add some).
    assert 0.02 < tier.page_read_s() < 0.2
    assert not tier.worth_waiting(0.005) and tier.worth_waiting(1.0)
    tier.close()
