"""Fused MoE experts (kernels/fused_moe.py) on the H200 against the reference loop and the
rooflines, at two MoE layer shapes in bf16 with random top-k routing:

    python benchmarks/cuda/moe_bench.py --out benchmarks/results/cuda/fused_moe.json [--sweep]

- Qwen3-30B-A3B: H 2048, F 768 per expert, 128 experts, top-8;
- Mixtral-8x7B: H 4096, F 14336, 8 experts, top-2;
each at T in {1, 8, 32, 128, 512, 2048, 8192} tokens. Per T:
- ours: a CUDA graph (the kernels never sync with the host) of one call for each of 4 routings,
  so consecutive calls read different experts and the L2 keeps little of them;
- the reference, fused_experts_reference (a loop over experts that syncs), at T <= 128;
- the rooflines: the weight bytes of the distinct experts a routing touches (plus x and the
  output) over 4.8 TB/s, and 2 * T*k * 3 * H * F FLOPs over 989 TFLOP/s (H200 datasheet, dense
  bf16); "% of roofline" is the larger of the two times over ours.
--sweep first times each GEMM under a grid of tiles at every T: the data MOE_CONFIGS was chosen
from. --gemv-sweep times the few-token path (kernels/moe_gemv.py) under a grid of tiles at
T in 1..8 against the grouped GEMMs at the same T: the data moe_gemv.CONFIG and MAX_TOKENS were
chosen from (into moe_gemv_sweep.json next to --out). Writes the JSON and a PNG of the same
base name.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import NamedTuple

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench_gemv import _graph_ms

from deepinfer.backends.cuda.kernels.fused_moe import (
    MoeConfig,
    Tiles,
    align_routes,
    config_for,
    fused_experts,
    moe_down,
    moe_gate_up,
)
from deepinfer.backends.cuda.kernels.moe_gemv import CONFIG as GEMV_CONFIG
from deepinfer.backends.cuda.kernels.moe_gemv import GemvTiles, MoeGemvConfig, moe_gemv, takes
from deepinfer.backends.cuda.timing import cuda_times_ms
from deepinfer.models.moe.experts import fused_experts_reference


class Shape(NamedTuple):
    hidden: int
    ffn: int
    experts: int
    top_k: int


# deepseek-v3-widths: V3's expert widths with 128 experts top-4 (its rows an expert at every T,
# T / 32, in half its 256 experts' memory: bf16, FP8 and the fp32 reference fit one 80 GB card).
SHAPES = {"qwen3-30b-a3b": Shape(2048, 768, 128, 8), "mixtral-8x7b": Shape(4096, 14336, 8, 2),
          "deepseek-v3-widths": Shape(7168, 2048, 128, 4)}
TOKENS = (1, 2, 4, 8, 32, 128, 512, 2048, 4096, 8192, 16384)
HBM_BYTES_PER_S, BF16_FLOPS = 4.8e12, 989e12
ROUTINGS, REFERENCE_MAX_TOKENS = 4, 128
# Sweep grid: narrow tiles and long K steps for the weight-bound small batches, wide tiles
# (wgmma needs BLOCK_M >= 64) for the compute-bound large ones.
SMALL_TILES = (Tiles(16, 256, 4, 4), Tiles(32, 128, 4, 4), Tiles(32, 256, 4, 3),
               Tiles(64, 128, 4, 3), Tiles(64, 128, 4, 4), Tiles(16, 128, 4, 5))
# Serving's mixed steps (2K-16K tokens, hundreds of routes per expert) are compute-bound: wider
# N tiles and deeper pipelines there, as vLLM's tuned tables for these shapes have.
LARGE_TILES = (Tiles(64, 64, 4, 3), Tiles(64, 64, 4, 4), Tiles(128, 64, 8, 3),
               Tiles(128, 64, 8, 4), Tiles(64, 128, 4, 3), Tiles(256, 64, 8, 3),
               Tiles(256, 64, 8, 4), Tiles(128, 128, 8, 3), Tiles(128, 128, 8, 4),
               Tiles(128, 32, 4, 4))
SAFE_TILES = Tiles(32, 64, 4, 2)  # fits every BLOCK_M: makes the down GEMM's input
# Few-token (GEMV) sweep: rows per program and K step, as bench_gemv's grid for small weights.
GEMV_TOKENS = (1, 2, 4, 8)
# K steps up to a whole Qwen3-30B-A3B row (2048 for gate-up; 1024 covers down's 768 in one
# masked step): one memory round trip a program. At most 4096 weights a route a step (down's
# tile holds the k routes': more spilled and ran 7-12x slower).
GEMV_GATE_UP = tuple(GemvTiles(n, k, w) for n in (1, 2, 4) for k in (256, 512, 1024, 2048)
                     for w in (2, 4, 8) if n * k <= 4096)
GEMV_DOWN = tuple(GemvTiles(n, k, w) for n in (1, 2, 4, 8, 16) for k in (128, 256, 512, 1024)
                  for w in (4, 8) if n * k <= 4096)


class Problem(NamedTuple):
    x: torch.Tensor
    routings: list[tuple[torch.Tensor, torch.Tensor]]  # (weights [T, k] f32, slots [T, k] i32)


def make_weights(shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    h, f, e = shape.hidden, shape.ffn, shape.experts
    w13 = torch.randn(e, 2 * f, h, device="cuda", dtype=torch.bfloat16, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, f, device="cuda", dtype=torch.bfloat16, generator=g) / f ** 0.5
    return w13, w2


def make_problem(shape: Shape, tokens: int) -> Problem:
    """x and ROUTINGS random routings: k distinct experts per token, uniformly, with
    normalised random weights."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, shape.hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    routings = []
    for _ in range(ROUTINGS):
        scores = torch.rand(tokens, shape.experts, device="cuda", generator=g)
        top, ids = scores.topk(shape.top_k, dim=-1)
        routings.append(((top / top.sum(-1, keepdim=True)).float(), ids.to(torch.int32)))
    return Problem(x, routings)


def active_bytes(shape: Shape, problem: Problem) -> float:
    """Mean bytes a call must move: the weights of the distinct experts it touches, x, out."""
    expert = 3 * shape.hidden * shape.ffn * 2
    io = 2 * problem.x.numel() * 2
    return statistics.mean(torch.unique(s).numel() * expert + io for _, s in problem.routings)


def flops(shape: Shape, tokens: int) -> float:
    return 2.0 * tokens * shape.top_k * 3 * shape.hidden * shape.ffn


# ---- sweep ---------------------------------------------------------------------------------
def block_ms_for(per_slot: float) -> tuple[int, ...]:
    if per_slot <= 4:
        return (16,)
    if per_slot <= 48:
        return (16, 32, 64)
    return (64, 128) if per_slot < 256 else (64, 128, 256)


def _time_tiles(fn) -> float | str:
    """Microseconds of one call of fn(), from a graph of ROUTINGS calls; a compile failure
    (shared memory, registers) is reported, not raised."""
    try:
        return _graph_ms(fn, reps=10) * 1e3 / ROUTINGS
    except Exception as exc:  # noqa: BLE001 - any compiler refusal is a result of the sweep
        return f"failed: {type(exc).__name__}"


def sweep_point(shape: Shape, w13: torch.Tensor, w2: torch.Tensor, tokens: int) -> dict:
    """Best tiles of each GEMM for each candidate BLOCK_M at this T."""
    problem = make_problem(shape, tokens)
    return {str(bm): sweep_block_m(shape, w13, w2, problem, bm)
            for bm in block_ms_for(tokens * shape.top_k / shape.experts)}


def sweep_block_m(shape: Shape, w13: torch.Tensor, w2: torch.Tensor, problem: Problem,
                  bm: int) -> dict:
    als = [align_routes(s, shape.experts, bm) for _, s in problem.routings]
    downs = [(moe_gate_up(problem.x, w13, al, shape.top_k, SAFE_TILES), al, w.reshape(-1))
             for al, (w, _) in zip(als, problem.routings)]
    gate_up, down = {}, {}
    for t in SMALL_TILES if bm <= 32 else LARGE_TILES:
        if bm * t.block_n <= 128 * 128:  # two accumulators: beyond this they spill
            gate_up[str(t)] = _time_tiles(lambda t=t: [
                moe_gate_up(problem.x, w13, al, shape.top_k, t) for al in als])
        down[str(t)] = _time_tiles(lambda t=t: [
            moe_down(h, w2, al, w, t) for h, al, w in downs])
    return {"gate_up": gate_up, "down": down, **_best(gate_up, down)}


def _best(gate_up: dict, down: dict) -> dict:
    ok_gu = {k: v for k, v in gate_up.items() if isinstance(v, float)}
    ok_dn = {k: v for k, v in down.items() if isinstance(v, float)}
    gu, dn = min(ok_gu, key=ok_gu.get), min(ok_dn, key=ok_dn.get)
    return {"best_gate_up": gu, "best_down": dn, "best_us": ok_gu[gu] + ok_dn[dn]}


def sweep(shape: Shape, w13: torch.Tensor, w2: torch.Tensor,
          tokens_list: tuple[int, ...] = TOKENS) -> dict:
    out = {}
    for tokens in tokens_list:
        point = sweep_point(shape, w13, w2, tokens)
        bm = min(point, key=lambda b: point[b]["best_us"])
        out[str(tokens)] = {"points": point, "best_block_m": int(bm)}
        print(f"  sweep T={tokens:5d}: best BLOCK_M {bm} {point[bm]['best_us']:9.1f} us "
              f"gate_up {point[bm]['best_gate_up']} down {point[bm]['best_down']}", flush=True)
    return out


def gemv_sweep(shape: Shape, w13: torch.Tensor, w2: torch.Tensor) -> dict:
    """At each few-token T: the gate-up tiles (down at the default), then the down tiles
    (gate-up at its best), each timed as whole moe_gemv calls; and the grouped GEMM path."""
    out = {}
    for tokens in GEMV_TOKENS:
        problem = make_problem(shape, tokens)

        def timed(cfg: MoeGemvConfig | MoeConfig) -> float | str:
            call = moe_gemv if isinstance(cfg, MoeGemvConfig) else fused_experts
            return _time_tiles(lambda: [call(problem.x, w13, w2, w, s, cfg)
                                        for w, s in problem.routings])

        gate_up = {t: timed(MoeGemvConfig(t, GEMV_CONFIG.down)) for t in GEMV_GATE_UP}
        best_gu = min((t for t in gate_up if isinstance(gate_up[t], float)), key=gate_up.get)
        down = {t: timed(MoeGemvConfig(best_gu, t)) for t in GEMV_DOWN}
        best_dn = min((t for t in down if isinstance(down[t], float)), key=down.get)
        grouped = timed(config_for(tokens, shape.top_k, shape.experts))
        default = timed(GEMV_CONFIG)
        out[str(tokens)] = {"gate_up": {str(t): v for t, v in gate_up.items()},
                            "down": {str(t): v for t, v in down.items()},
                            "best": str(MoeGemvConfig(best_gu, best_dn)), "best_us": down[best_dn],
                            "default_us": default, "grouped_us": grouped}
        print(f"  gemv T={tokens}: best {down[best_dn]:7.1f} us (gate_up {best_gu}, down "
              f"{best_dn}), default {default:7.1f} us, grouped GEMMs {grouped:7.1f} us",
              flush=True)
    return out


# ---- benchmark -----------------------------------------------------------------------------
def bench_point(shape: Shape, w13: torch.Tensor, w2: torch.Tensor, tokens: int) -> dict:
    problem = make_problem(shape, tokens)
    cfg = GEMV_CONFIG if takes(tokens, shape.top_k, shape.experts) else \
        config_for(tokens, shape.top_k, shape.experts)
    x = problem.x
    calls = [lambda w=w, s=s: fused_experts(x, w13, w2, w, s) for w, s in problem.routings]
    ours_us = _graph_ms(lambda: [c() for c in calls], reps=10) * 1e3 / ROUTINGS
    weights, slots = problem.routings[0]
    ref = fused_experts_reference(x, w13, w2, weights, slots).float()
    err = ((fused_experts(x, w13, w2, weights, slots).float() - ref).norm() / ref.norm()).item()
    if not err < 2e-2:
        raise AssertionError(f"T={tokens}: relative error {err:.2e} against the reference")
    nbytes, nflops = active_bytes(shape, problem), flops(shape, tokens)
    bytes_us, flops_us = nbytes / HBM_BYTES_PER_S * 1e6, nflops / BF16_FLOPS * 1e6
    row = {"tokens": tokens, "config": str(cfg), "us": ours_us, "rel_err": err,
           "active_bytes": nbytes, "flops": nflops, "tb_per_s": nbytes / ours_us / 1e6,
           "tflop_per_s": nflops / ours_us / 1e6, "bytes_roofline_us": bytes_us,
           "flops_roofline_us": flops_us, "bound": "bytes" if bytes_us >= flops_us else "flops",
           "pct_of_roofline": 100 * max(bytes_us, flops_us) / ours_us}
    if tokens <= REFERENCE_MAX_TOKENS:
        refs = [lambda w=w, s=s: fused_experts_reference(x, w13, w2, w, s)
                for w, s in problem.routings]
        row["reference_us"] = statistics.median(
            cuda_times_ms(lambda: [r() for r in refs], reps=5, warmup=1)) * 1e3 / ROUTINGS
        row["speedup_vs_reference"] = row["reference_us"] / ours_us
    return row


def bench(shape: Shape, w13: torch.Tensor, w2: torch.Tensor) -> list[dict]:
    rows = []
    for tokens in TOKENS:
        row = bench_point(shape, w13, w2, tokens)
        ref = (f" | reference {row['reference_us']:9.1f} us (x{row['speedup_vs_reference']:.1f})"
               if "reference_us" in row else "")
        print(f"  T={tokens:5d}: {row['us']:9.1f} us {row['tb_per_s']:5.2f} TB/s "
              f"{row['tflop_per_s']:6.1f} TFLOP/s = {row['pct_of_roofline']:5.1f}% of the "
              f"{row['bound']} roofline{ref}", flush=True)
        rows.append(row)
    return rows


def shape_panels(result: dict):
    """A figure with a panel per shape of the result: (figure, [(axes, (name, entry))])."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result["shapes"]), figsize=(13, 4.5), squeeze=False)
    return fig, list(zip(axes[0], result["shapes"].items()))


def label_axes(ax, name: str, shape: dict) -> None:
    """Log-log axes of us per MoE layer by tokens, titled with the layer's shape."""
    ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="us per MoE layer",
           title=f"{name}: H {shape['hidden']}, F {shape['ffn']}, {shape['experts']} experts, "
                 f"top-{shape['top_k']}")
    ax.legend(fontsize=8)


def plot(result: dict, path: str) -> None:
    fig, panels = shape_panels(result)
    for ax, (name, entry) in panels:
        rows = entry["bench"]
        tokens = [r["tokens"] for r in rows]
        roof = [max(r["bytes_roofline_us"], r["flops_roofline_us"]) for r in rows]
        ax.plot(tokens, [r["us"] for r in rows], "o-", label="fused_experts (Triton)")
        ax.plot(tokens, roof, "--", color="tab:red", label="roofline (bytes or FLOPs)")
        ref = [(r["tokens"], r["reference_us"]) for r in rows if "reference_us" in r]
        ax.plot(*zip(*ref), "s:", color="tab:gray", label="reference loop")
        for r in rows:
            ax.annotate(f"{r['pct_of_roofline']:.0f}%", (r["tokens"], r["us"]), fontsize=8,
                        textcoords="offset points", xytext=(0, 6), ha="center")
        label_axes(ax, name, entry["shape"])
    fig.suptitle(f"Fused MoE, bf16, {result['gpu']} (% = share of the roofline reached)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/cuda/fused_moe.json")
    parser.add_argument("--sweep", action="store_true", help="time the tile grid first")
    parser.add_argument("--gemv-sweep", action="store_true",
                        help="time the few-token path's tiles (and only that)")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES),
                        default=["qwen3-30b-a3b", "mixtral-8x7b"])
    parser.add_argument("--sweep-tokens", type=int, nargs="+", default=list(TOKENS),
                        help="the token counts --sweep times (default: every one)")
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    result: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "triton": triton.__version__, "hbm_bytes_per_s": HBM_BYTES_PER_S,
                    "bf16_flops": BF16_FLOPS, "shapes": {}}
    for name in args.shapes:
        shape = SHAPES[name]
        print(f"{name} {shape}", flush=True)
        w13, w2 = make_weights(shape)
        entry: dict = {"shape": shape._asdict()}
        if args.gemv_sweep:
            result["shapes"][name] = {"shape": shape._asdict(),
                                      "gemv_sweep": gemv_sweep(shape, w13, w2)}
            with open(os.path.join(os.path.dirname(args.out), "moe_gemv_sweep.json"), "w") as f:
                json.dump(result, f, indent=2)
            continue
        if args.sweep:
            entry["sweep"] = sweep(shape, w13, w2, tuple(args.sweep_tokens))
        entry["bench"] = bench(shape, w13, w2)
        result["shapes"][name] = entry
        del w13, w2
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:  # after each shape: a partial result survives a timeout
            json.dump(result, f, indent=2)
    if not args.gemv_sweep:
        plot(result, os.path.splitext(args.out)[0] + ".png")


if __name__ == "__main__":
    main()
