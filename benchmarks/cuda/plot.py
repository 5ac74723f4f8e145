"""Plot the H200 results (run here, from the JSON files the device runs wrote).

    python benchmarks/cuda/plot.py [benchmarks/results/cuda]
"""
from __future__ import annotations

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(folder: str, name: str) -> dict:
    with open(os.path.join(folder, name)) as f:
        return json.load(f)


def engine_panels(axes, engine: dict) -> None:
    ours, hf = engine["deepinfer"], engine["hf"]
    panels = [
        ("batch-1 decode (tok/s)", ours["batch1_decode_tok_s"], hf["generate_decode_tok_s"],
         ours["decode_roofline_tok_s"], "roofline"),
        (f"{ours['batch256_requests']} x (512+128) output tok/s", ours["batch256_output_tok_s"],
         hf["generate_batch_output_tok_s"], ours["batch256_flop_bound_output_tok_s"], "FLOP bound"),
        ("8K-token prefill (tok/s)", ours["prefill8k_tok_s"], hf["prefill8k_tok_s"],
         ours["prefill8k_flop_bound_tok_s"], "FLOP bound"),
    ]
    for ax, (title, a, b, ceiling, label) in zip(axes, panels):
        bars = ax.bar(["DeepInfer", "transformers"], [a, b], color=["tab:blue", "tab:gray"])
        ax.axhline(ceiling, color="tab:red", linestyle="--", label=f"{label} {ceiling:,.0f}")
        ax.bar_label(bars, labels=[f"{a:,.0f}\n({a / b:.1f}x)", f"{b:,.0f}"])
        ax.set_title(title, fontsize=10)
        ax.set_ylim(0, max(a, ceiling) * 1.25)
        ax.legend(fontsize=8, loc="upper right")


def copy_panel(ax, copy: dict) -> None:
    best = {}
    for row in copy["results"]:
        kind = "UVA kernel" if row["method"].startswith("uva") else row["method"]
        key = (kind, row["direction"])
        best[key] = max(best.get(key, 0.0), row["GBps"])
    kinds = ["UVA kernel", "memcpy per chunk", "contiguous pinned copy"]
    width = 0.38
    for i, direction in enumerate(("h2d", "d2h")):
        values = [best[(k, direction)] for k in kinds]
        bars = ax.bar([x + i * width for x in range(3)], values, width, label=direction)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks([x + width / 2 for x in range(3)],
                  ["UVA kernel", "cudaMemcpyAsync\nper chunk", "one contiguous\npinned copy"],
                  fontsize=8)
    ax.set_title("HiCache page copy, 256 pages x 32 layers (GB/s)", fontsize=10)
    ax.legend(fontsize=8)


def gemv_panel(ax, gemv: dict) -> None:
    names = list(gemv["sweep"])
    width = 0.38
    for i, (key, label) in enumerate((("cublas_gbs", "cuBLAS"), ("chosen_gbs", "Triton GEMV"))):
        values = [gemv["sweep"][n][key] for n in names]
        bars = ax.bar([x + i * width for x in range(len(names))], values, width, label=label)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks([x + width / 2 for x in range(len(names))], names, fontsize=8)
    chain = gemv["chain"]
    ax.set_title(f"batch-1 projections (GB/s); 32 layers: cuBLAS {chain['cublas']['ms']:.2f} ms,"
                 f"\nGEMV {chain['gemv']['ms']:.2f} ms, "
                 f"GEMV + PDL {chain['gemv_pdl']['ms']:.2f} ms",
                 fontsize=9)
    ax.legend(fontsize=8, loc="lower right")


def main() -> None:
    folder = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/cuda"
    engine, copy = load(folder, "cuda_engine.json"), load(folder, "page_copy.json")
    fig, axes = plt.subplots(1, 5, figsize=(22, 4.5))
    engine_panels(axes[:3], engine)
    copy_panel(axes[3], copy)
    gemv_panel(axes[4], load(folder, "gemv.json"))
    gpu = engine["ceilings"]["gpu"]
    fig.suptitle(f"DeepInfer CUDA backend vs transformers {engine['hf']['transformers']} on one "
                 f"{gpu}, Llama-3-8B shape, random bf16 weights")
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "cuda_h200.png"), dpi=110)


if __name__ == "__main__":
    main()
