"""Side by side: the engine numbers compare_trees.sh measured for two trees in one lease.

    python benchmarks/cuda/compare_trees.py [--dir benchmarks/results/cuda/compare]

Writes compare.json (each metric before, after, after/before) and compare.png.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

METRICS = {  # file -> its record of our numbers, [(key, label)]
    "cuda_engine.json": ("deepinfer", [("batch1_decode_tok_s", "Llama-3-8B batch-1 decode tok/s"),
                                       ("batch256_output_tok_s", "256 x (512+128) output tok/s"),
                                       ("prefill8k_tok_s", "8K prefill tok/s")]),
    "moe_engine.json": ("ours", [("batch1_tok_s", "Qwen3-30B-A3B batch-1 decode tok/s"),
                                 ("batch32_tok_s", "Qwen3-30B-A3B batch-32 decode tok/s")]),
}


def load(folder: Path) -> dict[str, float]:
    values = {}
    for name, (record, metrics) in METRICS.items():
        path = folder / name
        if not path.exists():
            continue
        ours = json.loads(path.read_text())[record]
        for key, label in metrics:
            if key in ours:
                values[label] = float(ours[key])
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("benchmarks/results/cuda/compare"))
    args = parser.parse_args()
    before, after = load(args.dir / "before"), load(args.dir / "after")
    rows = {label: {"before": before[label], "after": after[label],
                    "ratio": after[label] / before[label]}
            for label in before if label in after}
    (args.dir / "compare.json").write_text(json.dumps(rows, indent=1) + "\n")
    for label, row in rows.items():
        print(f"{label:40s} {row['before']:10.1f} {row['after']:10.1f} {row['ratio']:6.3f}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    labels = list(rows)
    ax.barh(labels, [rows[k]["ratio"] for k in labels], color="tab:blue")
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xlim(0.8, 1.2)
    ax.set_xlabel("after / before (same lease)")
    for i, k in enumerate(labels):
        ax.text(rows[k]["ratio"], i, f" {rows[k]['ratio']:.3f}", va="center")
    fig.tight_layout()
    fig.savefig(args.dir / "compare.png", dpi=120)


if __name__ == "__main__":
    main()
