"""Time the FP8 few-rows projection (kernels/fp8_skinny.py) against cuBLAS's block-scaled GEMM
at the Llama-3-8B shapes, M = 2-64 (decode batches).

    python benchmarks/cuda/bench_fp8_skinny.py --out benchmarks/results/cuda [--quick]

Per shape and M: the engine's path before the skinny GEMM (fp8_gemm through cuBLAS, with the
activations' quantization), the bf16 projection (cuBLAS through F.linear) and a grid of skinny
tiles (rows a program, K split, warps, pipeline stages), each timed as bench_gemv
does: a CUDA graph of one call per distinct weight copy (L2 holds none of them), the median
replay. Reported: microseconds, TB/s of FP8 weight bytes (codes and scales), the speed-up over
cuBLAS's FP8 GEMM and the error against the float32 product. The copy rate of the same run is
the ceiling. Writes fp8_skinny.json and fp8_skinny.png into --out.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench_fp8 import SHAPES, Weights, _sweep_us, _us  # noqa: E402
from engine_bench import ceilings  # noqa: E402

from deepinfer.backends.cuda.kernels.fp8_gemm import fp8_gemm, fp8_linear_reference  # noqa: E402
from deepinfer.backends.cuda.kernels.fp8_skinny import SkinnyConfig, fp8_skinny, skinny_config_for  # noqa: E402
from deepinfer.backends.cuda.kernels.rotary_decode import SplitCounters  # noqa: E402

MS = (2, 8, 16, 32, 64)
COPIES = 16


def grid(quick: bool) -> list[SkinnyConfig]:
    configs = [SkinnyConfig(bw, split, warps, stages) for bw, split, warps, stages
               in itertools.product((64, 128), (1, 2, 4, 8), (4, 8), (3, 5))
               if not (bw == 64 and warps == 8)]
    return configs[::3] if quick else configs


def measure(w: Weights, m: int, configs: list[SkinnyConfig], sms: int, reps: int) -> dict:
    x = torch.randn(m, w.k, device="cuda", dtype=torch.bfloat16)
    fp8_bytes = sum(q.numel() + s.numel() * 4 for q, s in w.fp8) / COPIES
    counters = SplitCounters()
    counters.get(w.n, x.device)
    row = {"m": m, "fp8_bytes": fp8_bytes}
    if w.blocks is not None:
        row["cublas_fp8_us"] = _us(lambda: [fp8_gemm(x, q, s, kernel_scale=ks) for (q, s), ks
                                            in zip(w.fp8, w.blocks)], COPIES, reps)
    row["cublas_bf16_us"] = _us(lambda: [F.linear(x, b) for b in w.bf16], COPIES, reps)
    chosen = skinny_config_for(m, w.n, w.k, sms)
    times = {}
    for cfg in dict.fromkeys(configs + [chosen]):
        times[str(cfg)] = _sweep_us(lambda cfg=cfg: [fp8_skinny(x, q, s, None, counters, sms, cfg)
                                                     for q, s in w.fp8], COPIES, reps)
    ok = {c: t for c, t in times.items() if isinstance(t, float)}
    best = min(ok, key=ok.get)
    row.update(best=best, best_us=ok[best], chosen=str(chosen), chosen_us=ok[str(chosen)],
               times_us=times)
    for key in ("best", "chosen", "cublas_fp8"):
        if f"{key}_us" in row:
            row[f"{key}_tbs"] = fp8_bytes / row[f"{key}_us"] / 1e6
    ref = fp8_linear_reference(x.float(), *w.fp8[0])
    out = fp8_skinny(x, *w.fp8[0], None, counters, sms)
    row["rel_error"] = ((out.float() - ref).norm() / ref.norm()).item()
    print(f"  M={m:3d}: cuBLAS fp8 {row.get('cublas_fp8_us', float('nan')):6.1f} us, bf16 "
          f"{row['cublas_bf16_us']:6.1f}, skinny chosen {row['chosen_us']:6.1f} "
          f"({row['chosen_tbs']:.2f} TB/s), best {row['best_us']:6.1f} {best}", flush=True)
    return row


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(report["shapes"]), figsize=(4 * len(report["shapes"]), 3.6),
                             sharey=True)
    for ax, (name, rows) in zip(axes, report["shapes"].items()):
        ms = [r["m"] for r in rows]
        for key, label in (("chosen_tbs", "skinny (chosen tiles)"),
                           ("cublas_fp8_tbs", "cuBLAS block-scaled FP8")):
            ax.plot(ms, [r.get(key, float("nan")) for r in rows], marker="o", label=label)
        ax.axhline(report["copy_tbs"], color="gray", linestyle="--", label="copy rate")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{name} {SHAPES[name][0]}x{SHAPES[name][1]}")
        ax.set_xlabel("tokens (M)")
    axes[0].set_ylabel("FP8 weight TB/s")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/cuda")
    parser.add_argument("--quick", action="store_true", help="a third of the tile grid")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    reps = 10 if args.quick else 30
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "copy_tbs": ceilings()["copy_bytes_per_s"] / 1e12, "shapes": {}}
    print(f"copy rate {report['copy_tbs']:.2f} TB/s", flush=True)
    for name in args.shapes:
        print(name, flush=True)
        w = Weights(*SHAPES[name], COPIES)
        report["shapes"][name] = [measure(w, m, grid(args.quick), sms, reps) for m in MS]
        del w
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fp8_skinny.json"), "w") as f:
        json.dump(report, f, indent=1)
    plot(report, os.path.join(args.out, "fp8_skinny.png"))


if __name__ == "__main__":
    main()
