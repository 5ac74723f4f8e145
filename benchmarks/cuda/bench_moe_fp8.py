"""Fused MoE experts with FP8 weights (DeepSeek's 128 x 128 blocks) against the same layer in
bf16, on the H200, at moe_bench.py's two shapes and token counts:

    python benchmarks/cuda/bench_moe_fp8.py --out benchmarks/results/cuda/fused_moe_fp8.json

Per T, both as a CUDA graph of one call for each of 4 routings (moe_bench's method):
- bf16: fused_experts on bf16 weights;
- fp8: the same weights quantized (codes + scales per row and 128 columns), few tokens through
  the weight-only GEMVs, more through the w8a8 grouped GEMMs (x and the intermediate quantized
  per token and 128 columns, inside the call);
- the FP8 rooflines: the distinct experts' FP8 bytes (scales included) over 4.8 TB/s, or the
  FLOPs over 1,979 TFLOP/s (H200 datasheet, dense FP8), whichever is longer;
- the error of each against the reference loop in float32 on the weights it was given.
--sweep first times the grouped path under a few FP8 tile sets at every T it serves (the data
for fused_moe.FP8_MOE_CONFIGS). Writes the JSON and a PNG of the same base name.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench_gemv import _graph_ms  # noqa: E402
from moe_bench import (  # noqa: E402
    HBM_BYTES_PER_S,
    ROUTINGS,
    SHAPES,
    TOKENS,
    Problem,
    Shape,
    _time_tiles,
    flops,
    label_axes,
    make_problem,
    make_weights,
    shape_panels,
)

from deepinfer.backends.cuda.kernels.fp8_gemm import Scaled  # noqa: E402
from deepinfer.backends.cuda.kernels.fused_moe import MoeConfig, Tiles, fused_experts  # noqa: E402
from deepinfer.backends.cuda.kernels.moe_gemv import takes  # noqa: E402
from deepinfer.models.moe.experts import fused_experts_reference  # noqa: E402
from deepinfer.models.quant.packed import FP8Experts  # noqa: E402
from deepinfer.models.weight_targets import SlotRows  # noqa: E402

FP8_FLOPS = 1979e12
# (BLOCK_M, gate-up tiles, down tiles); BLOCK_K is always one 128-column scale group.
SWEEP = tuple(MoeConfig(m, Tiles(nu, 128, wu, su), Tiles(nd, 128, wd, sd)) for m, nu, wu, su,
              nd, wd, sd in ((16, 64, 4, 4, 128, 4, 4), (16, 128, 4, 3, 128, 4, 3),
                             (32, 64, 4, 3, 128, 4, 3), (64, 64, 4, 3, 128, 4, 3),
                             (64, 128, 8, 3, 128, 8, 3), (64, 64, 4, 4, 64, 4, 4),
                             (128, 64, 8, 3, 128, 8, 3)))


def quantize(w: torch.Tensor) -> FP8Experts:
    """[S, N, K] bf16 -> the model's FP8 experts, each slot in 128 x 128 blocks, as
    --quantization fp8 loads them."""
    experts = FP8Experts(tuple(w.shape)).to(w.device)
    for slot, weight in enumerate(w):
        experts.load_rows(weight, SlotRows(slot))
    return experts


def fp8_bytes(shape: Shape, problem: Problem) -> float:
    """Mean bytes a call must move in FP8: the touched experts' codes and scales, x, out."""
    h, f = shape.hidden, shape.ffn
    expert = 3 * h * f + 4 * (2 * f * triton.cdiv(h, 128) + h * triton.cdiv(f, 128))
    io = 2 * problem.x.numel() * 2
    return statistics.mean(torch.unique(s).numel() * expert + io for _, s in problem.routings)


def _time(x, w13, w2, problem: Problem) -> float:
    calls = [lambda w=w, s=s: fused_experts(x, w13, w2, w, s) for w, s in problem.routings]
    return _graph_ms(lambda: [c() for c in calls], reps=10) * 1e3 / ROUTINGS


def _error(x, w13, w2, reference_weights, problem: Problem) -> float:
    weights, slots = problem.routings[0]
    ref = fused_experts_reference(x.float(), *reference_weights, weights, slots)
    out = fused_experts(x, w13, w2, weights, slots).float()
    return ((out - ref).norm() / ref.norm()).item()


def bench_point(shape: Shape, bf16: tuple, fp8: tuple, exact_fp8: tuple, tokens: int) -> dict:
    problem = make_problem(shape, tokens)
    x = problem.x
    row = {"tokens": tokens, "bf16_us": _time(x, *bf16, problem),
           "fp8_us": _time(x, *fp8, problem),
           "bf16_rel_err": _error(x, *bf16, [w.float() for w in bf16], problem),
           "fp8_rel_err": _error(x, *fp8, exact_fp8, problem)}
    nbytes, nflops = fp8_bytes(shape, problem), flops(shape, tokens)
    bytes_us, flops_us = nbytes / HBM_BYTES_PER_S * 1e6, nflops / FP8_FLOPS * 1e6
    row.update(fp8_bytes=nbytes, fp8_roofline_us=max(bytes_us, flops_us),
               bound="bytes" if bytes_us >= flops_us else "flops",
               fp8_pct_of_roofline=100 * max(bytes_us, flops_us) / row["fp8_us"],
               speedup=row["bf16_us"] / row["fp8_us"], fp8_tb_per_s=nbytes / row["fp8_us"] / 1e6,
               fp8_tflop_per_s=nflops / row["fp8_us"] / 1e6)
    return row


def bench(shape: Shape, with_sweep: bool = False) -> dict:
    w13, w2 = make_weights(shape)
    e13, e2 = quantize(w13), quantize(w2)
    q13, q2 = Scaled(e13.weight, e13.scale), Scaled(e2.weight, e2.scale)
    exact = (e13.dequantize(), e2.dequantize())
    entry: dict = {"shape": shape._asdict()}
    if with_sweep:
        entry["sweep"] = sweep(shape, (q13, q2))
    rows = entry["bench"] = []
    for tokens in TOKENS:
        row = bench_point(shape, (w13, w2), (q13, q2), exact, tokens)
        print(f"  T={tokens:5d}: bf16 {row['bf16_us']:8.1f} us, fp8 {row['fp8_us']:8.1f} us "
              f"(x{row['speedup']:.2f}) = {row['fp8_pct_of_roofline']:5.1f}% of the FP8 "
              f"{row['bound']} roofline; errors bf16 {row['bf16_rel_err']:.1e} "
              f"fp8 {row['fp8_rel_err']:.1e}", flush=True)
        rows.append(row)
    return entry


def sweep(shape: Shape, fp8: tuple) -> list[dict]:
    """us of the grouped FP8 path under each SWEEP config, at every T it serves."""
    rows = []
    for tokens in TOKENS:
        if takes(tokens, shape.top_k, shape.experts):
            continue
        problem = make_problem(shape, tokens)
        times = {}
        for cfg in SWEEP:
            calls = [lambda w=w, s=s, c=cfg: fused_experts(problem.x, *fp8, w, s, c)
                     for w, s in problem.routings]
            times[str(cfg)] = _time_tiles(lambda: [c() for c in calls])
        best = min((t, c) for c, t in times.items() if isinstance(t, float))
        print(f"  sweep T={tokens:5d}: best {best[0]:8.1f} us {best[1]}", flush=True)
        rows.append({"tokens": tokens, "us": times, "best": best[1]})
    return rows


def plot(result: dict, path: str) -> None:
    fig, panels = shape_panels(result)
    for ax, (name, entry) in panels:
        rows = entry["bench"]
        tokens = [r["tokens"] for r in rows]
        ax.plot(tokens, [r["bf16_us"] for r in rows], "s-", label="bf16 weights")
        ax.plot(tokens, [r["fp8_us"] for r in rows], "o-", label="FP8 weights")
        ax.plot(tokens, [r["fp8_roofline_us"] for r in rows], "--", color="tab:red",
                label="FP8 roofline (bytes or FLOPs)")
        for r in rows:
            ax.annotate(f"x{r['speedup']:.2f}", (r["tokens"], r["fp8_us"]), fontsize=8,
                        textcoords="offset points", xytext=(0, -12), ha="center")
        label_axes(ax, name, entry["shape"])
    fig.suptitle(f"Fused MoE, FP8 vs bf16 weights, {result['gpu']} (x = bf16 time / FP8 time)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/cuda/fused_moe_fp8.json")
    parser.add_argument("--sweep", action="store_true", help="time FP8 tile sets first")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    result: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "triton": triton.__version__, "hbm_bytes_per_s": HBM_BYTES_PER_S,
                    "fp8_flops": FP8_FLOPS, "shapes": {}}
    for name in args.shapes:
        shape = SHAPES[name]
        print(f"{name} {shape}", flush=True)
        result["shapes"][name] = bench(shape, args.sweep)
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:  # after each shape: a partial result survives a timeout
            json.dump(result, f, indent=2)
    plot(result, os.path.splitext(args.out)[0] + ".png")


if __name__ == "__main__":
    main()
