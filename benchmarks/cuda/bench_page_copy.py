"""Benchmark of HiCache page copies at Llama-3-8B shapes (32 layers, 8 KV heads of 128, bf16,
block 128: 512 KiB per page-layer, 16 MiB per page).

    python benchmarks/cuda/bench_page_copy.py --out page_copy.json

Checks every method against a torch gather first (poisoned destinations, both directions), then
times with CUDA events (median of --reps after warm-up): the UVA kernel under several launch
configurations, one cudaMemcpyAsync per chunk, and one contiguous pinned copy of the same bytes.
"""
from __future__ import annotations

import argparse
import json
import statistics
from typing import Callable

import torch

from deepinfer.backends.cuda.page_copy import UVAPageCopier
from deepinfer.backends.cuda.timing import cuda_times_ms

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 128
CONFIGS = [  # (threads, ctas_per_chunk, unroll)
    (256, 1, 4), (128, 1, 4), (512, 1, 4), (256, 1, 2), (256, 1, 8), (1024, 1, 2),
    (256, 2, 4), (256, 4, 4), (128, 4, 8),
]


def _random_(t: torch.Tensor, device: torch.device) -> None:
    """Random bits (not zeros), generated on the device slab by slab (pools are tens of GiB)."""
    flat = t.view(-1).view(torch.int16)
    slab = 1 << 28
    for start in range(0, flat.numel(), slab):
        part = flat[start:start + slab]
        part.copy_(torch.randint(-2**15, 2**15, part.shape, dtype=torch.int16, device=device))


def _blocks_view(kv: torch.Tensor) -> torch.Tensor:
    """kv as [layers, 2, num_blocks, chunk]."""
    return kv.view(LAYERS, 2, -1, BLOCK * KV_HEADS * HEAD_DIM)


def _check(name: str, copy: Callable[[bool], None], host: torch.Tensor, kv: torch.Tensor,
           pages: torch.Tensor, blocks: torch.Tensor) -> None:
    paged = _blocks_view(kv)
    host_pages = host.view(host.shape[0], LAYERS, 2, -1)
    paged[:, :, blocks.to(kv.device)] = 0x7F  # poison the destination blocks
    copy(True)
    torch.cuda.synchronize()
    want = host_pages[pages].to(kv.device).permute(1, 2, 0, 3)
    got = paged[:, :, blocks.to(kv.device)]
    if not torch.equal(want.view(torch.int16), got.view(torch.int16)):
        raise AssertionError(f"{name}: host -> device copy differs from the gather")
    del want, got
    host_pages[pages] = 0x3C  # poison the destination pages
    copy(False)
    torch.cuda.synchronize()
    want = paged[:, :, blocks.to(kv.device)].permute(2, 0, 1, 3).cpu()
    if not torch.equal(want.view(torch.int16), host_pages[pages].view(torch.int16)):
        raise AssertionError(f"{name}: device -> host copy differs from the gather")


def _time_ms(fn: Callable[[], None], reps: int, warmup: int = 3) -> float:
    return statistics.median(cuda_times_ms(fn, reps, warmup))


def _row(name: str, direction: str, ms: float, nbytes: int) -> dict:
    return {"method": name, "direction": direction, "ms": ms, "GBps": nbytes / ms / 1e6}


def run(num_blocks: int, num_pages: int, n: int, reps: int, seed: int) -> dict:
    device = torch.device("cuda")
    torch.manual_seed(seed)
    kv = torch.empty((LAYERS, 2, num_blocks * BLOCK, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16,
                     device=device)
    host = torch.empty((num_pages, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16,
                       pin_memory=True)
    _random_(kv, device)
    _random_(host, device)
    pages = torch.randperm(num_pages)[:n]
    blocks = torch.randperm(num_blocks - 1)[:n] + 1  # block 0 is the null block
    pages_dev, blocks_dev = pages.to(device), blocks.to(device)
    nbytes = n * LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * kv.element_size()

    def uva(cfg):
        copier = UVAPageCopier(*cfg)
        return lambda to_dev: copier.copy(host, kv, pages_dev, blocks_dev, BLOCK, to_dev)

    def memcpy(to_dev: bool) -> None:
        UVAPageCopier().copy_memcpy(host, kv, pages, blocks, BLOCK, to_dev)

    _check("memcpy", memcpy, host, kv, pages, blocks)
    for cfg in CONFIGS:
        _check(f"uva{cfg}", uva(cfg), host, kv, pages, blocks)

    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rows = []
    for to_dev, direction in ((True, "h2d"), (False, "d2h")):
        for cfg in CONFIGS:
            name = "uva threads={} ctas_per_chunk={} unroll={}".format(*cfg)
            fn = uva(cfg)
            rows.append(_row(name, direction, _time_ms(lambda: fn(to_dev), reps), nbytes))
        rows.append(_row("memcpy per chunk", direction,
                         _time_ms(lambda: memcpy(to_dev), reps), nbytes))
        dst, src = (flat_dev, flat_host) if to_dev else (flat_host, flat_dev)
        rows.append(_row("contiguous pinned copy", direction,
                         _time_ms(lambda: dst.copy_(src, non_blocking=True), reps), nbytes))
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "shape": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                      "block_size": BLOCK, "dtype": "bfloat16"},
            "device_blocks": num_blocks, "host_pages": num_pages, "pages_copied": n,
            "bytes_per_copy": nbytes, "reps": reps, "results": rows}


def _print_table(report: dict) -> None:
    print(f"{report['device']}: {report['pages_copied']} pages, "
          f"{report['bytes_per_copy'] / 2**30:.2f} GiB per copy")
    for direction in ("h2d", "d2h"):
        rows = [r for r in report["results"] if r["direction"] == direction]
        contiguous = next(r for r in rows if r["method"] == "contiguous pinned copy")
        for r in rows:
            ratio = r["GBps"] / contiguous["GBps"]
            print(f"{direction}  {r['method']:<40} {r['ms']:9.2f} ms {r['GBps']:7.1f} GB/s "
                  f"{ratio:5.2f}x contiguous")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file for the results")
    parser.add_argument("--device-blocks", type=int, default=4096)
    parser.add_argument("--host-pages", type=int, default=2048)
    parser.add_argument("--pages", type=int, default=256, help="pages per copy")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    report = run(args.device_blocks, args.host_pages, args.pages, args.reps, args.seed)
    _print_table(report)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
