"""Time the FP8 block-scaled projections (kernels/fp8_gemm.py) on one GPU at Llama-3-8B shapes.

    python benchmarks/cuda/bench_fp8.py --out benchmarks/results/cuda [--quick] [--sweep]

Weights are random bf16, quantized as DeepSeek ships them (one scale per 128x128 block) and
expanded to the per-row scales the kernels take. Per projection shape:

1. M = 1 (decode): fp8_linear (its weight-only GEMV) against the bf16 GEMV (kernels/gemv.py)
   and cuBLAS (F.linear) in bf16.
2. M = 1, 2, 4, 8, 16, 32: fp8_linear's two paths forced, where the GEMV is allowed (M <= 8):
   the data GEMV_MAX_M is to be chosen from.
3. M = 8192 (prefill): fp8_linear (activation quantization + w8a8 GEMM) against bf16
   torch.matmul, and the quantization alone. The w8a8 GEMM three ways: cuBLAS (torch's
   scaled_mm) with the weight's 128 x 128 block scales, cuBLAS with one scale per row and 128
   columns, and the Triton kernel; the crossover (2.) times cuBLAS beside the Triton GEMM.

Every call is timed as bench_gemv does: a CUDA graph of one call per distinct weight copy (so
the L2, 50 MB, holds none of them), CUDA events around the replays, the median over replays.
Reported: microseconds, TB/s of weight bytes (fp8: codes and scales), TFLOP/s, the speed-up over
bf16, and the relative error against float32 references (the same fp8 weights, and the bf16
weights they came from). --sweep also times grids of GEMV tiles at M = 1 and 8 and GEMM tiles
at M = 8192: the data for gemv_config_for and gemm_config_for. Writes fp8_gemm.json and
fp8_gemm.png into --out.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench_gemv import _graph_ms  # noqa: E402

from deepinfer.backends.cuda.kernels.fp8_gemm import (  # noqa: E402
    FP8_MAX,
    GEMV_MAX_M,
    GROUP,
    Fp8GemmConfig,
    Fp8GemvConfig,
    cublas_block_scaled,
    cublas_weight_scale,
    fp8_gemm,
    fp8_gemv,
    fp8_linear,
    fp8_linear_reference,
    gemm_config_for,
    gemv_config_for,
    quantize_tokens_fp8,
)
from deepinfer.backends.cuda.kernels.gemv import gemv  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}  # (N, K)
DECODE_COPIES, PREFILL_COPIES, PREFILL_M = 16, 2, 8192
CROSSOVER_M = (1, 2, 4, 8, 16, 32, 64, 256, 1024)


class Weights:
    """copies distinct bf16 weights [N, K] and their fp8 codes and per-row scales."""

    def __init__(self, n: int, k: int, copies: int) -> None:
        g = torch.Generator(device="cuda").manual_seed(n + k)
        self.bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g)
                     / k ** 0.5 for _ in range(copies)]
        self.fp8 = [block_quantize(w) for w in self.bf16]
        self.n, self.k = n, k
        cublas = cublas_block_scaled(torch.device("cuda"))
        # cuBLAS's layouts of the same scales: the 128 x 128 grid, and one per row.
        self.blocks = [cublas_weight_scale(s, k) for _, s in self.fp8] if cublas else None
        self.rows = [s.t().contiguous().t() for _, s in self.fp8] if cublas else None

    def cublas_us(self, x: torch.Tensor, scales: list[torch.Tensor], reps: int) -> float:
        return _us(lambda: [fp8_linear(x, q, s, path="gemm", kernel_scale=c)
                            for (q, s), c in zip(self.fp8, scales)], len(self.fp8), reps)

    def fp8_bytes(self) -> int:
        wq, ws = self.fp8[0]
        return wq.numel() + ws.numel() * 4

    def bf16_bytes(self) -> int:
        return self.n * self.k * 2


def block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's format (codes, one inverse scale per 128x128 block), the scales expanded to
    [N, ceil(K/128)] as the loader does."""
    n, k = w.shape
    nb, kb = -(-n // GROUP), -(-k // GROUP)
    padded = torch.zeros(nb * GROUP, kb * GROUP, device=w.device)
    padded[:n, :k] = w.float()
    blocks = padded.view(nb, GROUP, kb, GROUP)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(nb * GROUP, kb * GROUP)[:n, :k].to(torch.float8_e4m3fn).contiguous()
    return q, scale.repeat_interleave(GROUP, dim=0)[:n].contiguous()


def _us(fn, copies: int, reps: int) -> float:
    """Microseconds of one call, from a graph of `copies` calls (fn runs them all)."""
    return _graph_ms(fn, reps) * 1e3 / copies


def _sweep_us(fn, copies: int, reps: int) -> float | str:
    """_us, with a compile failure (registers, shared memory) reported, not raised."""
    try:
        return _us(fn, copies, reps)
    except Exception as exc:  # noqa: BLE001 - a refused config is a result of a sweep
        return f"failed: {type(exc).__name__}"


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def _rates(us: float, weight_bytes: int, m: int, n: int, k: int) -> dict:
    return {"us": us, "tbs": weight_bytes / us / 1e6, "tflops": 2 * m * n * k / us / 1e6}


def accuracy(w: Weights, m: int, kernel_scale: torch.Tensor | None = None) -> dict:
    """Relative errors of fp8_linear at M rows: against float32 on the fp8 weights (the
    kernel's own error; the GEMM path includes activation quantization) and on the bf16
    weights they came from (what a model sees); and of bf16 F.linear against its float32."""
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, w.k, device="cuda", dtype=torch.bfloat16, generator=g)
    wq, ws = w.fp8[0]
    out = fp8_linear(x, wq, ws, kernel_scale=kernel_scale,
                     out=torch.full((m, w.n), float("nan"), device="cuda", dtype=torch.bfloat16))
    ref = fp8_linear_reference(x.float(), wq, ws)
    ref_bf16 = x.float() @ w.bf16[0].float().T
    return {"fp8_vs_fp32": _rel(out, ref), "fp8_vs_bf16_weights": _rel(out, ref_bf16),
            "bf16_vs_fp32": _rel(F.linear(x, w.bf16[0]), ref_bf16)}


def decode(w: Weights, reps: int) -> dict:
    x = torch.randn(1, w.k, device="cuda", dtype=torch.bfloat16)
    copies = len(w.bf16)
    fp8 = _us(lambda: [fp8_linear(x, q, s) for q, s in w.fp8], copies, reps)
    bf16_gemv = _us(lambda: [gemv(x, b) for b in w.bf16], copies, reps)
    cublas = _us(lambda: [F.linear(x, b) for b in w.bf16], copies, reps)
    row = {"fp8": _rates(fp8, w.fp8_bytes(), 1, w.n, w.k),
           "bf16_gemv": _rates(bf16_gemv, w.bf16_bytes(), 1, w.n, w.k),
           "cublas_bf16": _rates(cublas, w.bf16_bytes(), 1, w.n, w.k),
           "speedup_vs_bf16_gemv": bf16_gemv / fp8, "speedup_vs_cublas": cublas / fp8,
           "config": str(gemv_config_for(w.n, w.k, 1)), "error": accuracy(w, 1)}
    print(f"  M=1    fp8 GEMV {fp8:7.1f} us ({row['fp8']['tbs']:4.2f} TB/s) | bf16 GEMV "
          f"{bf16_gemv:7.1f} us ({row['speedup_vs_bf16_gemv']:.2f}x) | cuBLAS {cublas:7.1f} us "
          f"({row['speedup_vs_cublas']:.2f}x) | rel err {row['error']['fp8_vs_fp32']:.1e}",
          flush=True)
    return row


def crossover(w: Weights, reps: int) -> dict:
    out = {}
    copies = len(w.fp8)
    for m in CROSSOVER_M:
        x = torch.randn(m, w.k, device="cuda", dtype=torch.bfloat16)
        row = {"gemm_us": _us(lambda: [fp8_linear(x, q, s, path="gemm") for q, s in w.fp8],
                              copies, reps)}
        if w.blocks is not None:
            row["cublas_us"] = w.cublas_us(x, w.blocks, reps)
        if m <= GEMV_MAX_M:
            row["gemv_us"] = _us(lambda: [fp8_linear(x, q, s, path="gemv") for q, s in w.fp8],
                                 copies, reps)
        out[str(m)] = row
        print(f"  M={m:<4d} " + " | ".join(f"{k} {v:7.1f}" for k, v in row.items()), flush=True)
    return out


def prefill(w: Weights, reps: int) -> dict:
    m, copies = PREFILL_M, len(w.bf16)
    x = torch.randn(m, w.k, device="cuda", dtype=torch.bfloat16)
    fp8 = _us(lambda: [fp8_linear(x, q, s) for q, s in w.fp8], copies, reps)
    quant = _us(lambda: [quantize_tokens_fp8(x) for _ in w.fp8], copies, reps)
    bf16 = _us(lambda: [torch.matmul(x, b.T) for b in w.bf16], copies, reps)
    row = {"fp8": _rates(fp8, w.fp8_bytes(), m, w.n, w.k), "quantize_us": quant,
           "bf16_matmul": _rates(bf16, w.bf16_bytes(), m, w.n, w.k),
           "speedup_vs_bf16": bf16 / fp8, "config": str(gemm_config_for(m, w.n, w.k)),
           "error": accuracy(w, m)}
    print(f"  M={m} fp8 Triton {fp8:8.1f} us ({row['fp8']['tflops']:5.0f} TFLOP/s, quantize "
          f"{quant:6.1f} us) | bf16 matmul {bf16:8.1f} us ({row['bf16_matmul']['tflops']:5.0f} "
          f"TFLOP/s) | {row['speedup_vs_bf16']:.2f}x | rel err "
          f"{row['error']['fp8_vs_fp32']:.1e}", flush=True)
    for name, scales in (("cublas_blocks", w.blocks), ("cublas_rows", w.rows)):
        if scales is None:
            continue
        us = w.cublas_us(x, scales, reps)
        row[name] = {**_rates(us, w.fp8_bytes(), m, w.n, w.k), "speedup_vs_bf16": bf16 / us,
                     "error": accuracy(w, m, scales[0])}
        print(f"    {name:13s} {us:8.1f} us ({row[name]['tflops']:5.0f} TFLOP/s) | "
              f"{row[name]['speedup_vs_bf16']:.2f}x bf16 | rel err "
              f"{row[name]['error']['fp8_vs_fp32']:.1e}", flush=True)
    return row


def _best(times: dict) -> dict:
    ok = {c: t for c, t in times.items() if isinstance(t, float)}
    best = min(ok, key=ok.get)
    return {"times_us": times, "best": best, "best_us": ok[best]}


def sweep_gemv(w: Weights, quick: bool, reps: int) -> dict:
    """GEMV tiles at M = 1 and GEMV_MAX_M, up to 32K products [M, BLOCK_N, BLOCK_K] a tile."""
    out = {}
    for m in (1, GEMV_MAX_M):
        x = torch.randn(m, w.k, device="cuda", dtype=torch.bfloat16)
        each = (True, False) if m == 1 else (True,)  # M=1: both loops of _gemv_row_kernel
        grid = [Fp8GemvConfig(bn, g, nw, e) for bn, g, nw, e in
                itertools.product((2, 4, 8, 16, 32), (1, 2, 4, 8), (4, 8), each)
                if m * bn * g <= 256]
        times = {str(c): _sweep_us(lambda c=c: [fp8_gemv(x, q, s, None, c) for q, s in w.fp8],
                                   len(w.fp8), reps) for c in (grid[::3] if quick else grid)}
        out[str(m)] = _best(times)
        print(f"  sweep GEMV M={m}: best {out[str(m)]['best']} {out[str(m)]['best_us']:.1f} us "
              f"(config_for: {gemv_config_for(w.n, w.k, m)})", flush=True)
    return out


def sweep_gemv_reads(w: Weights, reps: int) -> dict:
    """The batch-1 GEMV's tiles (per-group sums) with more of each row read before the wait on
    the kernel ahead: one step's tile, or 8, 16, 32 or 64 groups up to the whole row, within
    128 weights a thread."""
    x = torch.randn(1, w.k, device="cuda", dtype=torch.bfloat16)
    row = triton.next_power_of_2(-(-w.k // GROUP))
    grid = [Fp8GemvConfig(bn, g, nw, False, first)
            for bn, g, nw in itertools.product((2, 4, 8, 16), (2, 4, 8), (4, 8))
            for first in [0] + [f for f in (8, 16, 32, 64)
                                if g < f <= row and bn * f * GROUP <= 128 * 32 * nw]]
    times = {str(c): _sweep_us(lambda c=c: [fp8_gemv(x, q, s, None, c) for q, s in w.fp8],
                               len(w.fp8), reps) for c in grid}
    out = _best(times)
    print(f"  sweep GEMV M=1 reads: best {out['best']} {out['best_us']:.1f} us "
          f"(config_for: {gemv_config_for(w.n, w.k, 1)})", flush=True)
    return out


def sweep_gemm(w: Weights, reps: int) -> dict:
    """GEMM tiles at M = PREFILL_M (BLOCK_K is the scale group, 128)."""
    x = torch.randn(PREFILL_M, w.k, device="cuda", dtype=torch.bfloat16)
    tiles = [Fp8GemmConfig(*t) for t in ((64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3),
                                         (128, 128, 8, 4), (128, 256, 8, 3), (64, 256, 8, 3))]
    times = {str(c): _sweep_us(lambda c=c: [fp8_gemm(x, q, s, None, c) for q, s in w.fp8],
                               len(w.fp8), reps) for c in tiles}
    out = _best(times)
    print(f"  sweep GEMM M={PREFILL_M}: best {out['best']} {out['best_us']:.1f} us", flush=True)
    return out


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["shapes"])
    rows = [report["shapes"][n] for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    width = 0.27
    for i, (key, label) in enumerate((("cublas_bf16", "cuBLAS bf16"), ("bf16_gemv", "GEMV bf16"),
                                      ("fp8", "fp8 GEMV"))):
        values = [r["decode"][key]["us"] for r in rows]
        bars = axes[0].bar([x + i * width for x in range(len(names))], values, width, label=label)
        axes[0].bar_label(bars, fmt="%.0f", fontsize=7)
    axes[0].set_title("M = 1: us per projection (lower is better)", fontsize=10)
    kinds = [(k, label) for k, label in (("bf16_matmul", "torch.matmul bf16"),
                                          ("fp8", "fp8 Triton (+ quantize)"),
                                          ("cublas_blocks", "fp8 cuBLAS, 128x128 scales"),
                                          ("cublas_rows", "fp8 cuBLAS, row scales"))
             if all(k in r["prefill"] for r in rows)]
    for i, (key, label) in enumerate(kinds):
        values = [r["prefill"][key]["tflops"] for r in rows]
        bars = axes[1].bar([x + i * width * 3 / len(kinds) for x in range(len(names))], values,
                           width * 3 / len(kinds), label=label)
        axes[1].bar_label(bars, fmt="%.0f", fontsize=6)
    axes[1].set_title(f"M = {PREFILL_M}: TFLOP/s (higher is better)", fontsize=10)
    for ax in axes[:2]:
        ax.set_xticks([x + width for x in range(len(names))], names)
        ax.legend(fontsize=7, loc="lower right")
    for name, r in zip(names, rows):
        for key, style in (("gemv_us", "-"), ("gemm_us", "--"), ("cublas_us", ":")):
            ms = [int(m) for m in r["crossover"] if isinstance(r["crossover"][m].get(key), float)]
            axes[2].plot(ms, [r["crossover"][str(m)][key] for m in ms], style, marker="o",
                         label=f"{name} {key[:4]}")
    axes[2].set_xscale("log", base=2)
    axes[2].set_yscale("log")
    axes[2].set_xlabel("M")
    axes[2].set_title("fp8 paths by M: us (GEMV solid, Triton GEMM dashed, cuBLAS dotted)",
                      fontsize=9)
    axes[2].legend(fontsize=7, ncol=2)
    fig.suptitle(f"FP8 block-scaled projections, Llama-3-8B shapes, {report['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def gemv_sweep_only(args: argparse.Namespace, report: dict, reps: int) -> None:
    for name in args.shapes:
        n, k = SHAPES[name]
        print(f"{name} [{n} x {k}]", flush=True)
        w = Weights(n, k, DECODE_COPIES)
        report["shapes"][name] = {"decode": decode(w, reps),
                                  "sweep_gemv_reads": sweep_gemv_reads(w, reps)}
        del w
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "fp8_gemv_reads.json"), "w") as f:
        json.dump(report, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/cuda",
                        help="folder for fp8_gemm.json and fp8_gemm.png")
    parser.add_argument("--quick", action="store_true", help="fewer replays, a third of --sweep")
    parser.add_argument("--sweep", action="store_true", help="also time grids of tiles")
    parser.add_argument("--gemv-sweep", action="store_true",
                        help="only the batch-1 GEMV: its time and its tiles with reads "
                             "ahead of the wait (fp8_gemv_reads.json)")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    args = parser.parse_args()
    reps = 5 if args.quick else 20
    os.makedirs(args.out, exist_ok=True)
    report: dict = {"gpu": torch.cuda.get_device_name(), "prefill_m": PREFILL_M,
                    "gemv_max_m": GEMV_MAX_M, "shapes": {}}
    if args.gemv_sweep:
        gemv_sweep_only(args, report, reps)
        return
    for name in args.shapes:
        n, k = SHAPES[name]
        print(f"{name} [{n} x {k}]", flush=True)
        w = Weights(n, k, DECODE_COPIES)
        row = {"decode": decode(w, reps), "crossover": crossover(w, reps)}
        if args.sweep:
            row["sweep_gemv"] = sweep_gemv(w, args.quick, reps)
        del w
        torch.cuda.empty_cache()
        w = Weights(n, k, PREFILL_COPIES)  # compute-bound: two copies keep the L2 honest
        row["prefill"] = prefill(w, max(3, reps // 4))
        if args.sweep:
            row["sweep_gemm"] = sweep_gemm(w, max(3, reps // 4))
        report["shapes"][name] = row
        del w
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "fp8_gemm.json"), "w") as f:
        json.dump(report, f, indent=2)
    plot(report, os.path.join(args.out, "fp8_gemm.png"))


if __name__ == "__main__":
    main()
