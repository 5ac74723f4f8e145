"""Check and time the paged attention kernels on a GPU at Llama-3-8B shapes, sliding-window
cases at Mistral-7B's (the same heads, window 4096), and MLA (decode and prefill) at
DeepSeek-V2-Lite's.

    python benchmarks/cuda/bench_attention.py [--out results.json]

Every case draws fresh random bf16 inputs, poisons the output with NaN, and reports the
relative error against a float32 torch reference before it is timed (triton's do_bench, median;
do_bench clears the L2 between runs). Decode is timed as a CUDA graph replay, as the engine
runs it (eager time beside it), and reports GB/s (cache bytes read plus q and out) and its
share of the H200's ~4.1 TB/s; prefill is timed eagerly and reports TFLOP/s counted over the
visible (query, key) pairs: causally 4 * Hq * D * qlen * (prefix + qlen / 2) without a window.
Windowed cases point the blocks wholly before the window at a NaN null block, as the engine does
once it frees them, so a kernel that read them would show a NaN error; their rate counts only
the window's keys. MLA prefill counts 2 * H * (2L + R) FLOPs per visible pair (absorbed form).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 128
SCALE = HEAD_DIM ** -0.5
# (batch, context, window): window 0 is full attention.
DECODE_CASES = [(1, 1024, 0), (1, 8192, 0), (1, 32768, 0), (64, 2048, 0), (256, 640, 0),
                (1, 32768, 4096), (64, 8192, 4096)]
# (name, [(cached prefix, new tokens)], window)
PREFILL_CASES = [("1x8192", [(0, 8192)], 0), ("4x2048", [(0, 2048)] * 4, 0),
                 ("16x512", [(0, 512)] * 16, 0),
                 ("2048 over 6144", [(6144, 2048)], 0), ("1x8192 w4096", [(0, 8192)], 4096),
                 ("2048/30720 w4096", [(30720, 2048)], 4096)]
# Split-K prefill (a prefix-cache hit's last chunk) and a mixed step's decodes apart from its
# prefill: each (name, chunks) runs the way before (one prefill launch, no splits) and now.
SPLIT_CASES = [("128 over 32640", [(32640, 128)]),
               ("255 decodes + 512", [(575, 1)] * 255 + [(0, 512)]),
               ("64 decodes + 128/32640", [(2047, 1)] * 64 + [(32640, 128)])]
# MLA, weight-absorbed, at DeepSeek-V2-Lite's width: 16 heads over one [512 + 64] latent.
MLA_HEADS, MLA_LORA, MLA_ROPE = 16, 512, 64
MLA_SCALE = (128 + MLA_ROPE) ** -0.5  # the model's qk_nope_head_dim + qk_rope_head_dim
MLA_DECODE_CASES = [(b, c) for b in (1, 32, 128) for c in (1024, 4096)]  # (batch, context)
MLA_PREFILL_CASES = [("1x4096", [(0, 4096)]), ("1024 over 3072", [(3072, 1024)])]
PEAK_GB_PER_S = 4100  # what an H200's HBM3e delivers to a streaming read (4.8 TB/s nominal)


@dataclass
class Paged:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    slots: list[torch.Tensor]  # per sequence: slots of its tokens in order


def _tables(seq_lens: list[int], device: str) -> tuple[int, torch.Tensor, list[torch.Tensor]]:
    """Shuffled blocks for the sequences (block 0 stays the null block): the number of blocks,
    the block tables, and each sequence's slots in order."""
    counts = [math.ceil(n / BLOCK_SIZE) for n in seq_lens]
    num_blocks = 1 + sum(counts)
    order = torch.randperm(num_blocks - 1, device=device) + 1
    tables = torch.zeros(len(seq_lens), max(counts), dtype=torch.int32, device=device)
    offsets = torch.arange(BLOCK_SIZE, device=device)
    slots, used = [], 0
    for i, (n, c) in enumerate(zip(seq_lens, counts)):
        ids = order[used:used + c]
        used += c
        tables[i, :c] = ids.to(torch.int32)
        slots.append((ids[:, None] * BLOCK_SIZE + offsets).flatten()[:n])
    return num_blocks, tables, slots


def _paged(seq_lens: list[int], device: str, first_seen: list[int] | None = None) -> Paged:
    """Random K/V for the sequences in shuffled blocks. first_seen (windowed cases): each
    sequence's first key any query sees; blocks wholly before it go to a NaN null block."""
    num_blocks, tables, slots = _tables(seq_lens, device)
    shape = (num_blocks * BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device=device)
    v_cache = torch.randn(shape, dtype=torch.bfloat16, device=device)
    if first_seen is not None:
        k_cache[:BLOCK_SIZE] = float("nan")
        v_cache[:BLOCK_SIZE] = float("nan")
        for i, lo in enumerate(first_seen):
            tables[i, :lo // BLOCK_SIZE] = 0
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return Paged(k_cache, v_cache, tables, lens, slots)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.isnan().any():
        return float("nan")  # an element was never written
    return ((out.float() - ref).norm() / ref.norm()).item()


def _decode_reference(q: torch.Tensor, kv: Paged, window: int = 0) -> torch.Tensor:
    """Dense float32 attention of each row's single query over its gathered context (its last
    `window` tokens with a window)."""
    outs = []
    for b, slots in enumerate(kv.slots):
        slots = slots[-window:] if window else slots
        k = kv.k_cache[slots].float().transpose(0, 1)  # [Hk, n, D]
        v = kv.v_cache[slots].float().transpose(0, 1)
        qb = q[b].float().view(KV_HEADS, Q_HEADS // KV_HEADS, HEAD_DIM)
        p = (qb @ k.transpose(1, 2) * SCALE).softmax(-1)
        outs.append((p @ v).reshape(Q_HEADS, HEAD_DIM))
    return torch.stack(outs)


def _first_seen(prefix: int, window: int) -> int:
    """The first key that any query of a chunk after `prefix` cached tokens sees."""
    return max(0, prefix - window + 1) if window else 0


def _prefill_reference(q: torch.Tensor, kv: Paged, chunks: list[tuple[int, int]],
                       window: int = 0) -> torch.Tensor:
    """float32 SDPA per sequence over its gathered K/V, causal with the prefix in front (and
    keys k > p - window of the query at p with a window)."""
    outs, start = [], 0
    for (prefix, qlen), slots in zip(chunks, kv.slots):
        lo = _first_seen(prefix, window)
        qs = q[start:start + qlen].float().transpose(0, 1)[None]
        k = kv.k_cache[slots[lo:]].float().transpose(0, 1)[None]
        v = kv.v_cache[slots[lo:]].float().transpose(0, 1)[None]
        pos = torch.arange(prefix, prefix + qlen, device=q.device)[:, None]
        keys = torch.arange(lo, prefix + qlen, device=q.device)[None, :]
        mask = keys <= pos
        if window:
            mask &= keys > pos - window
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


def _num_sms(device: str) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _time_decode(kernel: str, run, reference, nbytes: int, **fields) -> dict:
    """Check run() against reference() eagerly and as a graph replay; time both; the rate is
    nbytes over the graph time."""
    err = _rel_err(run(), reference())
    eager_ms = _time_ms(run)
    out = run()
    out.fill_(float("nan"))
    ms = _graph_time_ms(run)
    graph_err = _rel_err(out, reference())
    gb_per_s = nbytes / ms / 1e6
    return dict(kernel=kernel, **fields, rel_err=err, graph_rel_err=graph_err,
                eager_ms=eager_ms, ms=ms, gb_per_s=gb_per_s,
                peak_fraction=gb_per_s / PEAK_GB_PER_S)


def bench_decode(batch: int, context: int, window: int, device: str) -> dict:
    from deepinfer.backends.cuda.kernels.decode_attention import (
        choose_num_splits,
        paged_decode_attention,
    )

    seen = min(context, window) if window else context  # keys the query attends
    kv = _paged([context] * batch, device, [context - seen] * batch if window else None)
    q = _fused_q(batch, device)
    splits = choose_num_splits(batch, KV_HEADS, seen, _num_sms(device))
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=device)

    def run() -> torch.Tensor:
        return paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                      BLOCK_SIZE, SCALE, splits, out=out, window=window)

    nbytes = 2 * batch * seen * KV_HEADS * HEAD_DIM * 2 + 2 * q.numel() * 2
    return _time_decode("decode", run, lambda: _decode_reference(q, kv, window), nbytes,
                        batch=batch, context=context, window=window, num_splits=splits)


def bench_mla_decode(batch: int, context: int, device: str) -> dict:
    from deepinfer.backends.cuda.kernels.mla_attention import (
        choose_mla_num_splits,
        paged_mla_decode,
    )

    width = MLA_LORA + MLA_ROPE
    num_blocks, tables, slots = _tables([context] * batch, device)
    cache = torch.randn(num_blocks * BLOCK_SIZE, width, dtype=torch.bfloat16, device=device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, MLA_HEADS, width, dtype=torch.bfloat16, device=device)
    splits = choose_mla_num_splits(batch, MLA_HEADS, context, _num_sms(device))
    out = torch.full((batch, MLA_HEADS, MLA_LORA), float("nan"), dtype=q.dtype, device=device)

    def run() -> torch.Tensor:
        return paged_mla_decode(q, cache, tables, lens, BLOCK_SIZE, MLA_SCALE, splits, MLA_LORA,
                                out=out)

    def reference() -> torch.Tensor:
        outs = []
        for b, s in enumerate(slots):
            latent = cache[s].float()  # [n, L + R]
            p = (q[b].float() @ latent.T * MLA_SCALE).softmax(-1)
            outs.append(p @ latent[:, :MLA_LORA])
        return torch.stack(outs)

    nbytes = (batch * context * width + q.numel() + out.numel()) * 2
    return _time_decode("mla_decode", run, reference, nbytes, batch=batch, context=context,
                        num_splits=splits)


def _mla_reference(q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                   prefix: int) -> torch.Tensor:
    """float32 absorbed MLA of q [Q, H, L + R], the tokens after `prefix`, over the latents at
    slots: scores over all L + R dims, values the first L."""
    latent = cache[slots].float()  # [n, L + R]
    scores = q.float().transpose(0, 1) @ latent.T * MLA_SCALE  # [H, Q, n]
    pos = torch.arange(prefix, prefix + q.shape[0], device=q.device)[:, None]
    keys = torch.arange(latent.shape[0], device=q.device)[None, :]
    scores = scores.masked_fill(keys > pos, float("-inf"))
    return (scores.softmax(-1) @ latent[:, :MLA_LORA]).transpose(0, 1)


def bench_mla_prefill(name: str, chunks: list[tuple[int, int]], device: str) -> dict:
    from deepinfer.backends.cuda.kernels.mla_attention import paged_mla_prefill

    width = MLA_LORA + MLA_ROPE
    num_blocks, tables, slots = _tables([p + n for p, n in chunks], device)
    cache = torch.randn(num_blocks * BLOCK_SIZE, width, dtype=torch.bfloat16, device=device)
    lens = torch.tensor([p + n for p, n in chunks], dtype=torch.int32, device=device)
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], MLA_HEADS, width, dtype=torch.bfloat16, device=device)
    query_starts = torch.tensor(starts, dtype=torch.int32, device=device)
    max_qlen = max(n for _, n in chunks)

    def run() -> torch.Tensor:
        return paged_mla_prefill(q, cache, tables, query_starts, lens, max_qlen, BLOCK_SIZE,
                                 MLA_SCALE, MLA_LORA)

    ref = torch.cat([_mla_reference(q[starts[i]:starts[i + 1]], cache, slots[i], p)
                     for i, (p, _) in enumerate(chunks)])
    err = _rel_err(run(), ref)
    ms = _time_ms(run)
    # Per visible pair and head: L + R multiply-adds for the score, L for the value.
    flops = sum(2 * MLA_HEADS * (width + MLA_LORA) * _visible_pairs(p, n, 0) for p, n in chunks)
    return dict(kernel="mla_prefill", case=name, rel_err=err, ms=ms, tflops=flops / ms / 1e9)


def _visible_pairs(prefix: int, qlen: int, window: int) -> float:
    """(query, key) pairs a chunk attends: causally, and inside the window if one is set."""
    if not window:
        return qlen * (prefix + qlen / 2)
    # Query at position p sees min(p + 1, window) keys.
    ramp_end = min(prefix + qlen, window)  # positions below this see p + 1 keys
    ramp = sum(p + 1 for p in range(prefix, ramp_end))
    return ramp + max(0, prefix + qlen - max(prefix, ramp_end)) * window


def bench_prefill(name: str, chunks: list[tuple[int, int]], window: int, device: str,
                  split: bool = False) -> dict:
    """One prefill launch over every chunk, or (split) as CUDAOps runs a step: leading
    one-token chunks through the decode kernel, the rest with choose_prefill_splits' splits."""
    from deepinfer.backends.cuda.kernels.decode_attention import (
        choose_num_splits,
        paged_decode_attention,
    )
    from deepinfer.backends.cuda.kernels.prefill_attention import (
        choose_prefill_splits,
        paged_prefill_attention,
    )
    from deepinfer.backends.cuda.step_inputs import leading_decodes

    first_seen = [_first_seen(p, window) for p, _ in chunks] if window else None
    kv = _paged([p + n for p, n in chunks], device, first_seen)
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    q = _fused_q(starts[-1], device)
    query_starts = torch.tensor(starts, dtype=torch.int32, device=device)
    max_qlen, longest = max(n for _, n in chunks), max(p + n for p, n in chunks)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    d = leading_decodes([n for _, n in chunks]) if split else 0
    splits = choose_prefill_splits(len(chunks) - d, Q_HEADS, max_qlen, longest, sms) \
        if split else 1
    d_splits = choose_num_splits(d, KV_HEADS, longest, sms)

    def run() -> torch.Tensor:
        if d:
            paged_decode_attention(q[:d], kv.k_cache, kv.v_cache, kv.block_tables[:d],
                                   kv.seq_lens[:d], BLOCK_SIZE, SCALE, d_splits, out=out[:d])
        paged_prefill_attention(q[d:], kv.k_cache, kv.v_cache, kv.block_tables[d:],
                                query_starts[d:], kv.seq_lens[d:], max_qlen, BLOCK_SIZE, SCALE,
                                out=out[d:], window=window, num_splits=splits)
        return out

    err = _rel_err(run(), _prefill_reference(q, kv, chunks, window))
    ms = _time_ms(run)
    flops = sum(4 * Q_HEADS * HEAD_DIM * _visible_pairs(p, n, window) for p, n in chunks)
    return dict(kernel="prefill_split" if split else "prefill", case=name, window=window,
                num_splits=splits, decodes_apart=d, rel_err=err, ms=ms, tflops=flops / ms / 1e9)


def bench_sdpa(seq: int, device: str, backend: str) -> dict:
    """The peer: torch SDPA on one backend (flash, cuDNN, memory-efficient) on contiguous
    [1, H, S, D], causal, GQA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, Q_HEADS, seq, HEAD_DIM, dtype=torch.bfloat16, device=device)
    k = torch.randn(1, KV_HEADS, seq, HEAD_DIM, dtype=torch.bfloat16, device=device)
    v = torch.randn_like(k)
    flops = 4 * Q_HEADS * HEAD_DIM * seq * seq / 2
    row = dict(kernel="torch_sdpa", case=f"1x{seq} {backend}")

    def run(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                  enable_gqa=k.shape[1] != Q_HEADS)

    # A backend without GQA gets K/V repeated to every query head (not counted in the time).
    for kv_heads in (KV_HEADS, Q_HEADS):
        group = Q_HEADS // kv_heads
        kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        try:
            ms = _time_ms(lambda: run(kk, vv))
        except RuntimeError as exc:  # this backend does not take these inputs here
            row["error"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            continue
        return dict(row, kv_heads=kv_heads, ms=ms, tflops=flops / ms / 1e9)
    return dict(row, ms=float("nan"), tflops=float("nan"))


def bench_varlen(name: str, lens: list[int], device: str) -> dict:
    """The peer for several fresh prompts in one step: torch's varlen attention (FlashAttention
    over packed [T, H, D] with cumulative lengths), causal, GQA where it takes it."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    total = sum(lens)
    q = torch.randn(total, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    gqa = "enable_gqa" in params
    heads = KV_HEADS if gqa else Q_HEADS
    k = torch.randn(total, heads, HEAD_DIM, dtype=torch.bfloat16, device=device)
    v = torch.randn_like(k)
    cu = torch.tensor(list(itertools.accumulate(lens, initial=0)), dtype=torch.int32,
                      device=device)
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    extra = {"enable_gqa": True} if gqa else {}
    ms = _time_ms(lambda: varlen_attn(q, k, v, cu, cu, max(lens), max(lens), **causal, **extra))
    flops = sum(4 * Q_HEADS * HEAD_DIM * n * n / 2 for n in lens)
    return dict(kernel="torch_varlen", case=name, kv_heads=heads, ms=ms, tflops=flops / ms / 1e9,
                signature=str(inspect.signature(varlen_attn)))


def run_all(device: str = "cuda") -> list[dict]:
    torch.manual_seed(0)
    rows = [bench_decode(b, c, w, device) for b, c, w in DECODE_CASES]
    rows += [bench_mla_decode(b, c, device) for b, c in MLA_DECODE_CASES]
    rows += [bench_prefill(name, chunks, w, device) for name, chunks, w in PREFILL_CASES]
    rows += [bench_prefill(name, chunks, 0, device, split) for name, chunks in SPLIT_CASES
             for split in (False, True)]
    rows += [bench_mla_prefill(name, chunks, device) for name, chunks in MLA_PREFILL_CASES]
    rows += [bench_sdpa(8192, device, b)
             for b in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")]
    rows += [bench_varlen(name, [n for _, n in chunks], device)
             for name, chunks, w in PREFILL_CASES if not w and all(p == 0 for p, _ in chunks)]
    return rows


def _print(rows: list[dict]) -> None:
    for r in rows:
        if r["kernel"] in ("decode", "mla_decode"):
            window = f" w={r['window']}" if r.get("window") else ""
            print(f"{r['kernel']:<10} B={r['batch']:<4} ctx={r['context']:<6}{window:<7}"
                  f" splits={r['num_splits']:<3}"
                  f" err={r['rel_err']:.2e}/{r['graph_rel_err']:.2e}  graph {r['ms'] * 1e3:7.1f} us"
                  f"  {r['gb_per_s']:5.0f} GB/s ({r['peak_fraction']:4.0%} of"
                  f" {PEAK_GB_PER_S / 1000:.1f} TB/s)  (eager {r['eager_ms'] * 1e3:6.1f} us)")
        else:
            err = f" err={r['rel_err']:.2e}" if "rel_err" in r else " " * 14
            split = f"  splits={r['num_splits']} decodes apart={r['decodes_apart']}" \
                if r["kernel"] == "prefill_split" else ""
            print(f"{r['kernel']:<13} {r['case']:<22}{err}  {r['ms']:8.3f} ms"
                  f"  {r['tflops']:6.0f} TFLOP/s{split}")


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
