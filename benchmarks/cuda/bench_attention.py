"""Check and time the paged attention kernels on a GPU at Llama-3-8B shapes.

    python benchmarks/cuda/bench_attention.py [--out results.json]

Every case draws fresh random bf16 inputs, poisons the output with NaN, and reports the
relative error against a float32 torch reference before it is timed (triton's do_bench, median;
do_bench clears the L2 between runs). Decode is timed as a CUDA graph replay, as the engine
runs it (eager time beside it), and reports GB/s (K/V read plus q and out); prefill is timed
eagerly and reports TFLOP/s counted causally as 4 * Hq * D * qlen * (prefix + qlen / 2).
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 128
SCALE = HEAD_DIM ** -0.5
DECODE_CASES = [(1, 1024), (1, 8192), (1, 32768), (64, 2048), (256, 640)]  # (batch, context)
PREFILL_CASES = [("1x8192", [(0, 8192)]), ("4x2048", [(0, 2048)] * 4),
                 ("2048 over 6144", [(6144, 2048)])]  # (name, [(cached prefix, new tokens)])


@dataclass
class Paged:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    slots: list[torch.Tensor]  # per sequence: slots of its tokens in order


def _paged(seq_lens: list[int], device: str) -> Paged:
    """Random K/V for the sequences in shuffled blocks (block 0 stays the null block)."""
    counts = [math.ceil(n / BLOCK_SIZE) for n in seq_lens]
    num_blocks = 1 + sum(counts)
    shape = (num_blocks * BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device=device)
    v_cache = torch.randn(shape, dtype=torch.bfloat16, device=device)
    order = torch.randperm(num_blocks - 1, device=device) + 1
    tables = torch.zeros(len(seq_lens), max(counts), dtype=torch.int32, device=device)
    offsets = torch.arange(BLOCK_SIZE, device=device)
    slots, used = [], 0
    for i, (n, c) in enumerate(zip(seq_lens, counts)):
        ids = order[used:used + c]
        used += c
        tables[i, :c] = ids.to(torch.int32)
        slots.append((ids[:, None] * BLOCK_SIZE + offsets).flatten()[:n])
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return Paged(k_cache, v_cache, tables, lens, slots)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.isnan().any():
        return float("nan")  # an element was never written
    return ((out.float() - ref).norm() / ref.norm()).item()


def _decode_reference(q: torch.Tensor, kv: Paged) -> torch.Tensor:
    """Dense float32 attention of each row's single query over its gathered context."""
    outs = []
    for b, slots in enumerate(kv.slots):
        k = kv.k_cache[slots].float().transpose(0, 1)  # [Hk, n, D]
        v = kv.v_cache[slots].float().transpose(0, 1)
        qb = q[b].float().view(KV_HEADS, Q_HEADS // KV_HEADS, HEAD_DIM)
        p = (qb @ k.transpose(1, 2) * SCALE).softmax(-1)
        outs.append((p @ v).reshape(Q_HEADS, HEAD_DIM))
    return torch.stack(outs)


def _prefill_reference(q: torch.Tensor, kv: Paged, chunks: list[tuple[int, int]]) -> torch.Tensor:
    """float32 SDPA per sequence over its gathered K/V, causal with the prefix in front."""
    outs, start = [], 0
    for (prefix, qlen), slots in zip(chunks, kv.slots):
        qs = q[start:start + qlen].float().transpose(0, 1)[None]
        k = kv.k_cache[slots].float().transpose(0, 1)[None]
        v = kv.v_cache[slots].float().transpose(0, 1)[None]
        pos = torch.arange(prefix, prefix + qlen, device=q.device)[:, None]
        mask = torch.arange(prefix + qlen, device=q.device)[None, :] <= pos
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
        start += qlen
    return torch.cat(outs)


def _time_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _graph_time_ms(fn) -> float:
    """Median time of a CUDA graph replay of fn: what the engine's captured decode step pays,
    without the Python launch cost that dominates small eager calls. Capturing also proves
    the launch is graph safe."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _time_ms(graph.replay)


def _fused_q(tokens: int, device: str) -> torch.Tensor:
    """q as a strided view of a fused qkv projection, as the model hands it over."""
    width = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = torch.randn(tokens, width, dtype=torch.bfloat16, device=device)
    return qkv[:, :Q_HEADS * HEAD_DIM].view(tokens, Q_HEADS, HEAD_DIM)


def bench_decode(batch: int, context: int, device: str) -> dict:
    from deepinfer.backends.cuda.kernels.decode_attention import (choose_num_splits,
                                                                  paged_decode_attention)

    kv = _paged([context] * batch, device)
    q = _fused_q(batch, device)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    splits = choose_num_splits(batch, KV_HEADS, context, num_sms)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=device)

    def run() -> torch.Tensor:
        return paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                      BLOCK_SIZE, SCALE, splits, out=out)

    err = _rel_err(run(), _decode_reference(q, kv))
    eager_ms = _time_ms(run)
    out.fill_(float("nan"))
    ms = _graph_time_ms(run)
    graph_err = _rel_err(out, _decode_reference(q, kv))
    nbytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2 + 2 * q.numel() * 2
    return dict(kernel="decode", batch=batch, context=context, num_splits=splits, rel_err=err,
                graph_rel_err=graph_err, eager_ms=eager_ms, ms=ms, gb_per_s=nbytes / ms / 1e6)


def bench_prefill(name: str, chunks: list[tuple[int, int]], device: str) -> dict:
    from deepinfer.backends.cuda.kernels.prefill_attention import paged_prefill_attention

    kv = _paged([p + n for p, n in chunks], device)
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    q = _fused_q(starts[-1], device)
    query_starts = torch.tensor(starts, dtype=torch.int32, device=device)
    max_qlen = max(n for _, n in chunks)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=device)

    def run() -> torch.Tensor:
        return paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, query_starts,
                                       kv.seq_lens, max_qlen, BLOCK_SIZE, SCALE, out=out)

    err = _rel_err(run(), _prefill_reference(q, kv, chunks))
    ms = _time_ms(run)
    flops = sum(4 * Q_HEADS * HEAD_DIM * n * (p + n / 2) for p, n in chunks)
    return dict(kernel="prefill", case=name, rel_err=err, ms=ms, tflops=flops / ms / 1e9)


def bench_sdpa(seq: int, device: str) -> dict:
    """The peer: torch SDPA (flash backend) on contiguous [1, H, S, D], causal, GQA."""
    q = torch.randn(1, Q_HEADS, seq, HEAD_DIM, dtype=torch.bfloat16, device=device)
    k = torch.randn(1, KV_HEADS, seq, HEAD_DIM, dtype=torch.bfloat16, device=device)
    v = torch.randn_like(k)
    ms = _time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                         enable_gqa=True))
    flops = 4 * Q_HEADS * HEAD_DIM * seq * seq / 2
    return dict(kernel="torch_sdpa", case=f"1x{seq}", ms=ms, tflops=flops / ms / 1e9)


def run_all(device: str = "cuda") -> list[dict]:
    torch.manual_seed(0)
    rows = [bench_decode(b, c, device) for b, c in DECODE_CASES]
    rows += [bench_prefill(name, chunks, device) for name, chunks in PREFILL_CASES]
    rows.append(bench_sdpa(8192, device))
    return rows


def _print(rows: list[dict]) -> None:
    for r in rows:
        if r["kernel"] == "decode":
            print(f"decode  B={r['batch']:<4} ctx={r['context']:<6} splits={r['num_splits']:<3}"
                  f" err={r['rel_err']:.2e}/{r['graph_rel_err']:.2e}  graph {r['ms'] * 1e3:7.1f} us"
                  f"  {r['gb_per_s']:5.0f} GB/s  (eager {r['eager_ms'] * 1e3:6.1f} us)")
        else:
            err = f" err={r['rel_err']:.2e}" if "rel_err" in r else " " * 14
            print(f"{r['kernel']:<10} {r['case']:<15}{err}  {r['ms']:8.3f} ms"
                  f"  {r['tflops']:6.0f} TFLOP/s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    device = "cuda"
    rows = run_all(device)
    _print(rows)
    if args.out:
        meta = dict(device=torch.cuda.get_device_name(device), torch=torch.__version__)
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, results=rows), f, indent=2)


if __name__ == "__main__":
    main()
