"""The disk tier's job queues (core/hicache/disk.py): a prompt's reads run on threads of their
own and never wait behind write-back, however slow that is."""
from __future__ import annotations

from deepinfer.core.hicache.disk import DiskTier
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
