"""The prefill and batched-decode GEMMs of the Llama-3-8B shape on a GPU, by BLAS library.

    python benchmarks/cuda/bench_gemm.py [--out results.json]

Each projection (x [M, K] @ W[N, K].T, bf16, as F.linear runs it) at M = 256 (a batch-256
decode step), 512 and 8192 (a full prefill budget), timed with torch's default BLAS (cuBLAS)
and with cuBLASLt (torch.backends.cuda.preferred_blas_library), beside the 8192^3 GEMM that the
engine benchmark calls the ceiling. Weights rotate over enough copies that L2 holds none.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from deepinfer.backends.cuda.timing import cuda_times_ms

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
ROWS = (256, 512, 8192)
L2_BYTES = 64 << 20


def time_linear(m: int, n: int, k: int) -> float:
    """Median ms of one x @ W.T over weight copies that together overflow L2."""
    copies = max(2, -(-2 * L2_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    state = {"i": 0}

    def run() -> torch.Tensor:
        state["i"] = (state["i"] + 1) % copies
        return F.linear(x, weights[state["i"]])

    return statistics.median(cuda_times_ms(run, reps=30, warmup=5))


def run_all() -> list[dict]:
    rows = []
    for library in ("default", "cublaslt"):
        torch.backends.cuda.preferred_blas_library("cublas" if library == "default"
                                                   else "cublaslt")
        ms = time_linear(8192, 8192, 8192)
        rows.append(dict(library=library, shape="8192^3", m=8192, ms=ms,
                         tflops=2 * 8192 ** 3 / ms / 1e9))
        for (name, (n, k)) in SHAPES.items():
            for m in ROWS:
                ms = time_linear(m, n, k)
                rows.append(dict(library=library, shape=name, m=m, n=n, k=k, ms=ms,
                                 tflops=2 * m * n * k / ms / 1e9))
    torch.backends.cuda.preferred_blas_library("cublas")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    rows = run_all()
    for r in rows:
        print(f"{r['library']:<9} {r['shape']:<8} M={r['m']:<5} {r['ms'] * 1e3:9.1f} us"
              f"  {r['tflops']:6.0f} TFLOP/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           results=rows), f, indent=2)


if __name__ == "__main__":
    main()
