"""HiCache's disk tier reading pages back, against the disk's own read rate.

N pages of PAGE_MB each are written by DiskTier into a folder on the disk measured, synced and
dropped from the OS page cache (posix_fadvise, no root needed), then read back into host pages
the way a prefetch does (every read submitted at once, then polled), for each reader-thread
count. Beside it, the disk's bound in the same run: one thread reading one big file, and as
many threads as the most readers reading the page files themselves with plain reads (no
checksum, no header). A disk-tier hit of a prompt is its pages' bytes at the tier's rate.

    python benchmarks/disk_tier.py --dir /path/on/the/disk [--pages 64 --page-mb 16]
Writes disk_tier.json and disk_tier.png.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))
from common import log, machine_environment, pyplot, write_json  # noqa: E402

from deepinfer.core.hicache.disk import DiskTier  # noqa: E402
from deepinfer.core.kv.hashing import hash_block  # noqa: E402


def drop_cache(folder: str) -> None:
    os.sync()
    for root, _, names in os.walk(folder):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def page(i: int) -> tuple[bytes, tuple[int, ...]]:
    tokens = (i, i + 1, i + 2)
    return hash_block(None, tokens), tokens


def write_pages(folder: str, memory: memoryview, page_bytes: int, pages: int) -> None:
    tier = DiskTier(folder, 1 << 50, memory, page_bytes, "bench", max_queue=pages)
    for i in range(pages):
        tier.write(*page(i), True, i)
    tier.poll(wait=True)
    tier.close()


def tier_read(folder: str, memory: memoryview, page_bytes: int, pages: int,
              readers: int) -> float:
    """Bytes per second DiskTier reads the pages back with `readers` threads (cold)."""
    tier = DiskTier(folder, 1 << 50, memory, page_bytes, "bench", read_workers=readers)
    drop_cache(folder)
    t0 = time.perf_counter()
    for i in range(pages):
        tier.read(*page(i), i)
    read = 0
    while read < pages:
        done = tier.poll()
        if not done:
            time.sleep(0.0005)
        for d in done:
            if d.entry is None:
                raise RuntimeError(f"page {d.page_id} did not read back whole")
            read += 1
    elapsed = time.perf_counter() - t0
    tier.close()
    return pages * page_bytes / elapsed


def raw_read(paths: list[str], threads: int, chunk: int = 16 << 20) -> float:
    """Bytes per second plain reads of these files take (cold), `threads` at a time."""
    drop_cache(os.path.dirname(os.path.dirname(paths[0])))
    buf_size = chunk

    def read(path: str) -> int:
        total = 0
        with open(path, "rb", buffering=0) as f:
            while data := f.read(buf_size):
                total += len(data)
        return total

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, paths))
    return total / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="a folder on the disk to measure (default: a "
                   "temporary folder under $TMPDIR)")
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--page-mb", type=float, default=16.0,
                   help="page size (16.8 MB: 128 tokens of Llama-3-8B's bf16 KV)")
    p.add_argument("--readers", default="1,2,4,8")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args(argv)
    page_bytes = int(args.page_mb * (1 << 20)) // 4096 * 4096
    scratch = tempfile.mkdtemp(prefix="disk-tier-", dir=args.dir)
    block = os.urandom(4096)
    memory = memoryview(bytearray(block * (args.pages * page_bytes // len(block))))
    readers = [int(r) for r in args.readers.split(",")]
    result: dict = {"page_bytes": page_bytes, "pages": args.pages, "dir": scratch,
                    "environment": machine_environment(), "tier_bytes_per_s": {},
                    "raw_bytes_per_s": {}}
    try:
        write_pages(scratch, memory, page_bytes, args.pages)
        paths = [os.path.join(root, n) for root, _, names in os.walk(scratch) for n in names]
        for n in readers:
            result["tier_bytes_per_s"][n] = tier_read(scratch, memory, page_bytes,
                                                      args.pages, n)
            result["raw_bytes_per_s"][n] = raw_read(paths, n)
            log(f"{n} readers: disk tier {result['tier_bytes_per_s'][n] / 1e9:.2f} GB/s, plain "
                f"reads of the same files {result['raw_bytes_per_s'][n] / 1e9:.2f} GB/s")
    finally:
        for root, _, names in os.walk(scratch, topdown=False):
            for name in names:
                os.unlink(os.path.join(root, name))
            os.rmdir(root)
    best_raw = max(result["raw_bytes_per_s"].values())
    result["tier_share_of_best_raw"] = {n: v / best_raw
                                        for n, v in result["tier_bytes_per_s"].items()}
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "disk_tier.json"), result)
    plot(result, os.path.join(args.out, "disk_tier.png"))
    return 0


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    readers = list(result["tier_bytes_per_s"])
    ax.plot(readers, [result["tier_bytes_per_s"][n] / 1e9 for n in readers], "o-",
            label="disk tier (header, CRC-32, tokens)")
    ax.plot(readers, [result["raw_bytes_per_s"][n] / 1e9 for n in readers], "s--",
            label="plain reads of the same files")
    ax.set_xlabel("reader threads")
    ax.set_ylabel("GB/s, not in the page cache")
    ax.set_title(f"{result['pages']} pages of {result['page_bytes'] / 2**20:.0f} MiB")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
