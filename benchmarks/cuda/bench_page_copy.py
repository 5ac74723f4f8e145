"""Benchmark of HiCache page copies over KV chunk lists, at two model shapes (bf16):

    llama8b  Llama-3-8B: 32 layers x (K, V) of 8 KV heads x 128, block 128: 64 chunks of
             256 KiB, 16 MiB a page
    mla      DeepSeek-V3-like MLA: 61 layers x one latent of 576 (512 + 64 rope), block 64:
             61 chunks of 72 KiB, 4.3 MiB a page

    python benchmarks/cuda/bench_page_copy.py --out page_copy.json [--layouts llama8b mla]

Checks every method against a torch gather first (poisoned destinations, both directions, on
--check-pages of the pairs), then times with CUDA events (median of --reps after warm-up): the
UVA kernel under several launch configurations, one cudaMemcpyAsync per (page, chunk), and one
contiguous pinned copy of the same bytes. GB/s are also given as a fraction of the 55 GB/s that
one contiguous pinned copy reaches on an H200 (PCIe Gen5 x16), the ceiling for any page copy.
The JSON keeps the llama8b layout's fields at the top level (plot.py reads them) and has every
layout under "layouts".

"store_overlap" (llama8b) times what a write-through costs the steps beside it: a model-like
chunk (32 layers of a 128-token prefill over a 32K context at the Llama-3-8B width) alone, right
after a store of --pages pages enqueued on the pool's own stream (as HiCache stores), and right
after the same store on the engine's stream (where it would queue ahead of the chunk).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from deepinfer.backends.cuda.host_pool import CUDAHostPool
from deepinfer.backends.cuda.page_copy import DeviceChunks, UVAPageCopier
from deepinfer.backends.cuda.timing import cuda_times_ms
from deepinfer.core.kv.spec import KVSpec, kv_heads_layer, latent_layer

CEILING_GBPS = 55.0  # one contiguous pinned host<->device copy on an H200
CONFIGS = [  # (threads, ctas_per_chunk, unroll, max_ctas): the last ones cap the grid, as the
    # write-through's copy beside the model's kernels does
    (256, 1, 4, 0), (128, 1, 4, 0), (512, 1, 4, 0), (256, 1, 2, 0), (256, 1, 8, 0),
    (1024, 1, 2, 0), (256, 2, 4, 0), (256, 4, 4, 0), (128, 4, 8, 0),
    (256, 1, 4, 8), (256, 1, 4, 16), (256, 1, 4, 32), (512, 1, 8, 16),
]
Copy = Callable[[bool], None]


@dataclass(frozen=True)
class Layout:
    name: str
    spec: KVSpec
    block_size: int
    shape: dict  # for the report

    def chunk_tensors(self, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
        """One bf16 cache tensor [num_blocks * entries per block, *entry shape] per chunk."""
        return [torch.empty((num_blocks * c.entry.entries_per_block(self.block_size),
                             *c.entry.shape), dtype=torch.bfloat16, device=device)
                for c in self.spec.chunks(self.block_size)]


LAYOUTS = {
    "llama8b": Layout("llama8b", KVSpec.uniform(32, kv_heads_layer(8, 128)), 128,
                      {"layers": 32, "kv_heads": 8, "head_dim": 128, "block_size": 128,
                       "dtype": "bfloat16"}),
    # Block 64: the page size of DeepSeek's MLA decode kernels.
    "mla": Layout("mla", KVSpec.uniform(61, latent_layer(576)), 64,
                  {"layers": 61, "latent_dim": 576, "block_size": 64, "dtype": "bfloat16"}),
}


def _random_(t: torch.Tensor, device: torch.device) -> None:
    """Random bits (not zeros), generated on the device slab by slab (pools are tens of GiB)."""
    flat = t.view(-1).view(torch.uint8)
    slab = 1 << 29
    for start in range(0, flat.numel(), slab):
        part = flat[start:start + slab]
        part.copy_(torch.randint(0, 256, part.shape, dtype=torch.uint8, device=device))


def _block_views(chunks: DeviceChunks) -> list[torch.Tensor]:
    """Each chunk as uint8 [num_blocks, block_bytes]."""
    layout = chunks.layout
    return [t.view(-1).view(torch.uint8).view(layout.num_blocks[g], size)
            for t, g, size in zip(chunks.tensors, layout.groups, layout.block_bytes)]


def _check(name: str, copy: Copy, host: torch.Tensor, chunks: DeviceChunks,
           pages: torch.Tensor, blocks: torch.Tensor) -> None:
    """copy moves pairs (pages[i], blocks[:, i]); compare with a torch gather of the same bytes."""
    layout, views = chunks.layout, _block_views(chunks)
    rows = blocks.to(chunks.device)
    spans = list(zip(views, layout.groups, layout.host_offsets, layout.block_bytes))
    for view, g, _, _ in spans:
        view[rows[g]] = 0x7F  # poison the destination blocks
    copy(True)
    torch.cuda.synchronize()
    want = host[pages].to(chunks.device)
    for c, (view, g, off, size) in enumerate(spans):
        if not torch.equal(view[rows[g]], want[:, off:off + size]):
            raise AssertionError(f"{name}: host -> device copy of chunk {c} differs")
    host[pages] = 0x3C  # poison the destination pages
    copy(False)
    torch.cuda.synchronize()
    got = host[pages].to(chunks.device)
    for c, (view, g, off, size) in enumerate(spans):
        if not torch.equal(got[:, off:off + size], view[rows[g]]):
            raise AssertionError(f"{name}: device -> host copy of chunk {c} differs")


def _time_ms(fn: Callable[[], None], reps: int, warmup: int = 3) -> float:
    return statistics.median(cuda_times_ms(fn, reps, warmup))


def _row(name: str, direction: str, ms: float, nbytes: int) -> dict:
    gbps = nbytes / ms / 1e6
    return {"method": name, "direction": direction, "ms": ms, "GBps": gbps,
            "of_ceiling": gbps / CEILING_GBPS}


def _methods(pool: CUDAHostPool, chunks: DeviceChunks, pages: torch.Tensor,
             blocks: torch.Tensor) -> dict[str, Copy]:
    """Every copy under test, by report name; indices on the device for the kernel (as the
    engine passes them), on the host for the memcpy baseline (which reads them there)."""
    pages_dev, blocks_dev = pages.to(chunks.device), blocks.to(chunks.device)

    def uva(cfg: tuple[int, int, int, int]) -> Copy:
        copier = UVAPageCopier(*cfg)
        return lambda to_dev: copier.copy(pool.pages, chunks, pages_dev, blocks_dev, to_dev)

    def memcpy(to_dev: bool) -> None:
        UVAPageCopier().copy_memcpy(pool.pages, chunks, pages, blocks, to_dev)

    methods = {"uva threads={} ctas_per_chunk={} unroll={} max_ctas={}".format(*cfg): uva(cfg)
               for cfg in CONFIGS}
    methods["memcpy per chunk"] = memcpy
    return methods


def run_layout(layout: Layout, num_blocks: int, num_pages: int, n: int, check_pages: int,
               reps: int, seed: int) -> dict:
    device = torch.device("cuda")
    torch.manual_seed(seed)
    tensors = layout.chunk_tensors(num_blocks, device)
    groups = [c.group for c in layout.spec.chunks(layout.block_size)]
    chunks = DeviceChunks.prepare(tensors, groups, num_blocks)
    pool = CUDAHostPool.allocate(num_pages, chunks)
    for t in tensors:
        _random_(t, device)
    _random_(pool.pages, device)
    pages = torch.randperm(num_pages)[:n]
    blocks = (torch.randperm(num_blocks - 1)[:n] + 1).view(1, n)  # block 0 is the null block
    nbytes = n * chunks.page_bytes
    methods = _methods(pool, chunks, pages, blocks)
    check = _methods(pool, chunks, pages[:check_pages], blocks[:, :check_pages])
    for name, copy in check.items():
        _check(name, copy, pool.pages, chunks, pages[:check_pages], blocks[:, :check_pages])

    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rows = []
    for to_dev, direction in ((True, "h2d"), (False, "d2h")):
        for name, copy in methods.items():
            rows.append(_row(name, direction, _time_ms(lambda: copy(to_dev), reps), nbytes))
        dst, src = (flat_dev, flat_host) if to_dev else (flat_host, flat_dev)
        rows.append(_row("contiguous pinned copy", direction,
                         _time_ms(lambda: dst.copy_(src, non_blocking=True), reps), nbytes))
    overlap = store_overlap(pool, chunks, pages, blocks, reps) if layout.name == "llama8b" \
        else None
    return {"shape": layout.shape, "chunks": chunks.layout.num_chunks,
            "chunk_block_bytes": sorted(set(chunks.layout.block_bytes)),
            "page_bytes": chunks.page_bytes, "device_blocks": num_blocks,
            "host_pages": num_pages, "pages_copied": n, "bytes_per_copy": nbytes,
            "results": rows, "store_overlap": overlap}


def _chunk_forward(device: torch.device, context: int = 32768,
                   layers: int = 32) -> Callable[[], None]:
    """A 128-token prefill chunk over `context` cached tokens at the Llama-3-8B width: the
    GEMMs and attention of every layer (one set of weights, reused), its inputs uploaded from
    pinned memory first and its sampled id copied back to pinned memory last, as a step's
    are (the copy engines share PCIe with the store's writes)."""
    bf16 = dict(dtype=torch.bfloat16, device=device)
    x = torch.randn(128, 4096, **bf16)
    qkv, wo = torch.randn(4096, 6144, **bf16) / 64, torch.randn(4096, 4096, **bf16) / 64
    w13, w2 = torch.randn(4096, 28672, **bf16) / 64, torch.randn(14336, 4096, **bf16) / 120
    k = torch.randn(1, 32, context, 128, **bf16)
    v = torch.randn(1, 32, context, 128, **bf16)

    ids_host = torch.zeros(4096, dtype=torch.int64, pin_memory=True)
    ids = torch.empty(4096, dtype=torch.int64, device=device)
    token_host = torch.empty(1, dtype=torch.int64, pin_memory=True)

    def forward() -> None:
        ids.copy_(ids_host, non_blocking=True)
        h = x + ids[:1].to(x.dtype)
        for _ in range(layers):
            q = (h @ qkv)[:, :4096].view(1, 128, 32, 128).transpose(1, 2)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            h = h + a.transpose(1, 2).reshape(128, 4096) @ wo
            gate, up = (h @ w13).chunk(2, dim=-1)
            h = h + (torch.nn.functional.silu(gate) * up) @ w2
        token_host.copy_(h[0].argmax(), non_blocking=True)
    return forward


def _timed(forward: Callable[[], None], before: Callable[[], None],
           side: torch.cuda.Stream) -> tuple[float, float, float]:
    """(GPU ms of forward on the current stream, host ms from its launch to its end, GPU ms of
    the copy that before() enqueued on `side` first, 0 if none)."""
    torch.cuda.synchronize()
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    marks[2].record(side)
    with torch.cuda.stream(side):
        before()
    marks[3].record(side)
    t0 = time.perf_counter()
    marks[0].record()
    forward()
    marks[1].record()
    marks[1].synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()  # the copy too, before the next repetition
    return marks[0].elapsed_time(marks[1]), wall, marks[2].elapsed_time(marks[3])


def _behind(forward: Callable[[], None], copy: Callable[[], None]) -> tuple[float, float]:
    """(GPU ms of forward, host ms from the copy's launch to the forward's end) with the copy
    enqueued ahead of it on the same stream."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    copy()
    start.record()
    forward()
    end.record()
    end.synchronize()
    return start.elapsed_time(end), (time.perf_counter() - t0) * 1e3


def store_overlap(pool: CUDAHostPool, chunks: DeviceChunks, pages: torch.Tensor,
                  blocks: torch.Tensor, reps: int) -> dict:
    """The chunk forward alone and beside a device -> host copy of the same bytes on another
    stream, for each way of copying: the UVA kernel at several grid caps (the write-through's
    is STORE_CTAS), a cudaMemcpyAsync per (page, chunk) (the copy engines), one contiguous
    copy; and the UVA store on the engine's own stream (ahead of the chunk)."""
    forward, side = _chunk_forward(chunks.device), torch.cuda.Stream(chunks.device)
    pages_l, blocks_l = pages.tolist(), blocks.tolist()
    nbytes = pages.numel() * chunks.page_bytes
    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=chunks.device)

    def uva(ctas: int) -> Callable[[], None]:
        copier = UVAPageCopier(max_ctas=ctas)
        return lambda: copier.copy(pool.pages, chunks, pages_l, blocks_l, False, skip_null=True)
    arms = {"alone": lambda: None}
    arms.update({f"uva max_ctas={c}, own stream": uva(c) for c in (16, 4, 2, 1)})
    arms["memcpy per chunk, own stream"] = lambda: UVAPageCopier().copy_memcpy(
        pool.pages, chunks, pages_l, blocks_l, False)
    arms["contiguous copy, own stream"] = lambda: flat_host.copy_(flat_dev, non_blocking=True)
    on_engine = CUDAHostPool(pool.pages, chunks, pool.copier, pool.store_copier, None)
    engine_store = lambda: on_engine.copy(pages_l, blocks_l, to_device=False)  # noqa: E731
    for _ in range(2):  # warm up cuBLAS and the copies
        for before in arms.values():
            _timed(forward, before, side)
    out = {}
    for name, before in arms.items():
        times = [_timed(forward, before, side) for _ in range(reps)]
        out[name] = {"gpu_ms": statistics.median(t[0] for t in times),
                     "wall_ms": statistics.median(t[1] for t in times),
                     "copy_ms": statistics.median(t[2] for t in times),
                     "copy_GBps": nbytes / statistics.median(t[2] for t in times) / 1e6
                     if name != "alone" else None}
    gpu, wall = zip(*(_behind(forward, engine_store) for _ in range(reps)))
    out["uva store on the engine stream"] = {"gpu_ms": statistics.median(gpu),
                                             "wall_ms": statistics.median(wall),
                                             "copy_ms": None, "copy_GBps": None}
    return out


def _print_table(name: str, report: dict) -> None:
    print(f"{name}: {report['pages_copied']} pages of {report['page_bytes'] / 2**20:.2f} MiB "
          f"({report['chunks']} chunks), {report['bytes_per_copy'] / 2**30:.2f} GiB per copy")
    for direction in ("h2d", "d2h"):
        rows = [r for r in report["results"] if r["direction"] == direction]
        contiguous = next(r for r in rows if r["method"] == "contiguous pinned copy")
        for r in rows:
            print(f"{direction}  {r['method']:<40} {r['ms']:9.2f} ms {r['GBps']:7.1f} GB/s "
                  f"{r['of_ceiling']:5.2f}x {CEILING_GBPS:.0f} GB/s "
                  f"{r['GBps'] / contiguous['GBps']:5.2f}x contiguous")
    for arm, t in (report["store_overlap"] or {}).items():
        copy = f", copy {t['copy_ms']:6.2f} ms ({t['copy_GBps']:.1f} GB/s)" if t["copy_GBps"] \
            else ""
        print(f"chunk forward, {arm:<32} GPU {t['gpu_ms']:7.2f} ms, wall {t['wall_ms']:7.2f} ms"
              + copy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file for the results")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--device-blocks", type=int, default=4096)
    parser.add_argument("--host-pages", type=int, default=2048)
    parser.add_argument("--pages", type=int, default=256, help="pages per copy")
    parser.add_argument("--check-pages", type=int, default=32,
                        help="pairs checked against the torch gather before timing")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "ceiling_GBps": CEILING_GBPS, "reps": args.reps, "layouts": {}}
    for name in args.layouts:
        result = run_layout(LAYOUTS[name], args.device_blocks, args.host_pages, args.pages,
                            args.check_pages, args.reps, args.seed)
        torch.cuda.empty_cache()  # the next layout's cache takes the freed device memory
        _print_table(name, result)
        report["layouts"][name] = result
    if "llama8b" in report["layouts"]:
        report.update(report["layouts"]["llama8b"])  # the top-level fields plot.py reads
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
