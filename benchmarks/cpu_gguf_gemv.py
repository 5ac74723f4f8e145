"""The CPU backend's GGUF GEMV by block type, against torch's float32 GEMV and the memory
ceiling, in one run: a weight of N x K (default 2048 x 2048) streamed from memory at 1 and 4
rows of x.

    python benchmarks/cpu_gguf_gemv.py [--n 2048] [--k 2048] [--threads 2]

Each weight is one of many copies (more bytes than the last-level cache), taken in turn, so
every call streams its blocks from memory as a decode step does. The ceiling is the weight's
bytes over the machine's read rate (a float32 sum over a 400 MB tensor, same threads).
Q4_0/Q4_1/Q8_0 are timed in the file's layout and with their rows interleaved by 8 as the
CPU backend serves them (gguf_rows8.cpp). Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 blocks come from gguf-py's
quantizer; the k-quants from random super-blocks (gguf-py cannot quantize them; the kernels'
time does not depend on the values).
Writes results/cpu_gguf_gemv.json and .png.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import RESULTS_DIR, log, machine_environment, pyplot, write_json  # noqa: E402

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# A k-quant super-block's bytes, and where its fp16 d (and dmin) sit.
K_QUANT_BYTES = {"Q2_K": (84, (80, 82)), "Q3_K": (110, (108,)), "Q4_K": (144, (0, 2)),
                 "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}
CACHE_BYTES = 256 << 20  # the copies of one weight span at least this much


def blocks(kind: str, n: int, k: int, seed: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    if kind in K_QUANT_BYTES:
        nbytes, scales = K_QUANT_BYTES[kind]
        raw = rng.integers(0, 256, (n, k // 256, nbytes), dtype=np.uint8)
        d = np.full((n, k // 256), 0.01, np.float16).view(np.uint8).reshape(n, k // 256, 2)
        for at in scales:
            raw[..., at:at + 2] = d
        return torch.from_numpy(raw.reshape(n, -1))
    w = rng.standard_normal((n, k)).astype(np.float32)
    return torch.from_numpy(quantize(w, GGMLQuantizationType[kind]))


def time_calls(calls: list, repeats: int = 5) -> float:
    """Median us per call over the rounds, each round one call per copy."""
    for call in calls[:4]:
        call()
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for call in calls:
            call()
        rounds.append((time.perf_counter() - start) / len(calls) * 1e6)
    return sorted(rounds)[len(rounds) // 2]


def read_rate() -> float:
    """Bytes per second a float32 sum reads (the machine's streaming rate)."""
    data = torch.ones(100 << 20)
    data.sum()
    start = time.perf_counter()
    for _ in range(3):
        data.sum()
    return 3 * data.numel() * 4 / (time.perf_counter() - start)


def measure(n: int, k: int) -> dict:
    from gguf import GGMLQuantizationType

    from deepinfer.backends.cpu.kernels import extension

    ext, rate, rows = extension(), read_rate(), {}
    for kind in ("float32",) + TYPES:
        weight = torch.randn(n, k) if kind == "float32" else blocks(kind, n, k, 0)
        nbytes = weight.numel() * weight.element_size()
        qtype = None if kind == "float32" else int(GGMLQuantizationType[kind])
        row = {"weight_bytes": nbytes, "ceiling_us": nbytes / rate * 1e6}
        for layout, w in layouts(weight, qtype, n, k):
            copies = [w.clone() for _ in range(max(2, CACHE_BYTES // nbytes))]
            for m in (1, 4):
                x = torch.randn(m, k)
                if qtype is None:
                    calls = [lambda w=w: torch.nn.functional.linear(x, w) for w in copies]
                else:
                    calls = [lambda w=w: ext.gemv(x, w, qtype, layout == "interleaved")
                             for w in copies]
                row[f"rows{m}{'_interleaved' if layout == 'interleaved' else ''}_us"] = \
                    time_calls(calls)
            del copies
        row["of_ceiling"] = row["ceiling_us"] / row.get("rows1_interleaved_us", row["rows1_us"])
        rows[kind] = row
        log(f"{kind:8s} {nbytes / 1e6:7.2f} MB  1 row {row['rows1_us']:8.1f} us  4 rows "
            f"{row['rows4_us']:8.1f} us  ceiling {row['ceiling_us']:7.1f} us"
            + (f"  interleaved: 1 row {row['rows1_interleaved_us']:7.1f} us"
               if "rows1_interleaved_us" in row else ""))
    return {"read_gb_per_s": rate / 1e9, "types": rows}


def layouts(weight: torch.Tensor, qtype: int | None, n: int, k: int) -> list:
    """The weight as the file stores it, and with its rows interleaved where the CPU backend
    serves its type so (kernels.interleaves)."""
    from deepinfer.backends.cpu.kernels import INTERLEAVE, interleaves
    from deepinfer.models.quant.packed import GGUFWeight
    from deepinfer.models.quant.tensors import GGUFTensor

    if qtype is None:
        return [("file", weight)]
    packed = GGUFWeight((n, k), qtype)
    if not interleaves(packed):
        return [("file", weight)]
    packed.load_rows(GGUFTensor(weight, qtype, (n, k)), None)
    packed.interleave_rows(INTERLEAVE)
    return [("file", weight), ("interleaved", packed.blocks)]


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    kinds = list(result["types"])
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.2
    for i, (key, label) in enumerate((("rows1_us", "1 row"),
                                      ("rows1_interleaved_us", "1 row, rows interleaved"),
                                      ("rows4_us", "4 rows"), ("ceiling_us", "memory ceiling"))):
        values = [result["types"][kind].get(key, 0.0) for kind in kinds]
        bars = ax.bar([j + (i - 1.5) * width for j in range(len(kinds))], values, width,
                      label=label)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(kinds)), kinds)
    ax.set_ylabel("us per GEMV")
    ax.set_title(f"{result['n']} x {result['k']} weight, {result['threads']} threads "
                 f"(float32: torch)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default=RESULTS_DIR)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = {"environment": machine_environment(), "n": args.n, "k": args.k,
              "threads": args.threads, **measure(args.n, args.k)}
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "cpu_gguf_gemv.json"), result)
    plot(result, os.path.join(args.out, "cpu_gguf_gemv.png"))


if __name__ == "__main__":
    main()
