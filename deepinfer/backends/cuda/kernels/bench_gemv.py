"""Check and time the one-token projections on a GPU at Llama-3-8B shapes.

    python -m deepinfer.backends.cuda.kernels.bench_gemv [--out results.json] [--quick]

1. Each projection shape and prologue: the Triton GEMV under a sweep of tile configs, beside
   cuBLAS (torch.nn.functional.linear) for plain ones and the separate norm / SiLU kernel for
   fused ones. Calls are timed as a CUDA graph of 16 calls over distinct weight copies, so the
   L2 (50 MB) holds none of them, as in a decode step.
2. The projections of all 32 layers as a decode step runs them: norm kernel + cuBLAS, norm
   kernel + Triton GEMV, and fused (norm or SiLU inside the Triton GEMV), as graphs.
3. Relative error of every fused op against the torch reference, outputs poisoned first.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics

import torch
import torch.nn.functional as F

from deepinfer.backends.cuda.kernels.activation import silu_and_mul
from deepinfer.backends.cuda.kernels.gemv import NORM_RESIDUAL, PLAIN, SILU, GemvConfig, gemv, \
    rms_norm_gemv, silu_and_mul_gemv
from deepinfer.backends.cuda.kernels.norm import add_rms_norm

HIDDEN, FFN, Q, KV, VOCAB, LAYERS = 4096, 14336, 4096, 1024, 128256, 32
SHAPES = {"qkv": (Q + 2 * KV, HIDDEN), "o": (HIDDEN, Q), "gate_up": (2 * FFN, HIDDEN),
          "down": (HIDDEN, FFN), "lm_head": (VOCAB, HIDDEN)}
EPS = 1e-5


def _graph_ms(fn, reps: int = 20) -> float:
    """Median milliseconds of one replay of a graph of fn."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the capture: compiles
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _configs(quick: bool) -> list[GemvConfig]:
    grid = itertools.product([4, 8, 16, 32], [256, 512, 1024], [4, 8], [1, 3])
    configs = [GemvConfig(*c) for c in grid if c[0] * c[1] <= 16384]
    return configs[::4] if quick else configs


# (shape, prologue) pairs a decode step can use; the norm ones against plain + a norm kernel.
VARIANTS = [("qkv", NORM_RESIDUAL), ("qkv", PLAIN), ("o", PLAIN), ("gate_up", NORM_RESIDUAL),
            ("gate_up", PLAIN), ("down", SILU), ("down", PLAIN), ("lm_head", PLAIN)]
PROLOGUE_NAMES = {PLAIN: "plain", NORM_RESIDUAL: "norm", SILU: "silu"}


def _call(prologue: int, x: torch.Tensor, r: torch.Tensor, nw: torch.Tensor, w: torch.Tensor,
          cfg: GemvConfig | None) -> torch.Tensor:
    if prologue == NORM_RESIDUAL:
        return rms_norm_gemv(x, r, nw, EPS, w, None, cfg)[0]
    if prologue == SILU:
        return silu_and_mul_gemv(x, w, None, cfg)
    return gemv(x, w, None, cfg)


def sweep(quick: bool) -> dict:
    out: dict = {}
    for name, prologue in VARIANTS:
        n, k = SHAPES[name]
        copies = 4 if name == "lm_head" else 16
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, 2 * k if prologue == SILU else k, device="cuda", dtype=torch.bfloat16)
        r, nw = torch.randn(1, k, device="cuda", dtype=torch.bfloat16), torch.ones(
            k, device="cuda", dtype=torch.bfloat16)
        nbytes = copies * n * k * 2
        row: dict = {"triton": {}}
        if prologue == PLAIN:
            def cublas():
                for w in weights:
                    F.linear(x, w)
            row["cublas_us"] = _graph_ms(cublas) * 1e3 / copies
        elif prologue == NORM_RESIDUAL:
            row["separate_op_us"] = _graph_ms(
                lambda: [add_rms_norm(x, r, nw, EPS) for _ in weights]) * 1e3 / copies
        else:
            row["separate_op_us"] = _graph_ms(
                lambda: [silu_and_mul(x) for _ in weights]) * 1e3 / copies
        for cfg in _configs(quick):
            def triton_gemv(cfg=cfg):
                for w in weights:
                    _call(prologue, x, r, nw, w, cfg)
            try:
                row["triton"][str(cfg)] = _graph_ms(triton_gemv) * 1e3 / copies
            except Exception as exc:  # a config the compiler refuses (registers, shared memory)
                row["triton"][str(cfg)] = f"failed: {type(exc).__name__}"
        ok = {c: v for c, v in row["triton"].items() if isinstance(v, float)}
        best = min(ok, key=ok.get)
        row["best"], row["best_us"] = best, ok[best]
        row["best_config"] = dataclasses.asdict(next(c for c in _configs(quick) if str(c) == best))
        row["best_gbs"] = nbytes / copies / ok[best] / 1e3
        key = f"{name}/{PROLOGUE_NAMES[prologue]}"
        base = (f"cuBLAS {row['cublas_us']:6.1f} us" if "cublas_us" in row
                else f"separate op {row['separate_op_us']:5.1f} us")
        print(f"{key:14s} [{n}x{k}] {base} | Triton best {ok[best]:6.1f} us "
              f"({row['best_gbs']:5.0f} GB/s) {best}", flush=True)
        out[key] = row
        del weights
        torch.cuda.empty_cache()
    return out


def _layers() -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)

    def w(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k ** 0.5

    return [dict(qkv=w(*SHAPES["qkv"]), o=w(*SHAPES["o"]), gate_up=w(*SHAPES["gate_up"]),
                 down=w(*SHAPES["down"]), n1=torch.ones(HIDDEN, device="cuda",
                                                        dtype=torch.bfloat16),
                 n2=torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16))
            for _ in range(LAYERS)]


def chain(best: dict) -> dict:
    """All 32 layers' projections as decode runs them (attention left out: it is the same),
    with the sweep's best config of each (shape, prologue), and with config_for's choice."""
    layers = _layers()
    hidden0 = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    weight_bytes = sum(sum(t.numel() * 2 for k, t in lw.items() if k in SHAPES) for lw in layers)
    cfg = {key: GemvConfig(**row["best_config"]) for key, row in best.items()}

    def unfused(project):
        def run():
            hidden, residual = hidden0, hidden0.clone()
            for lw in layers:
                x, residual = add_rms_norm(hidden, residual, lw["n1"], EPS)
                qkv = project(x, lw["qkv"], "qkv")
                hidden = project(qkv[:, :Q].contiguous(), lw["o"], "o")
                x, residual = add_rms_norm(hidden, residual, lw["n2"], EPS)
                hidden = project(silu_and_mul(project(x, lw["gate_up"], "gate_up")),
                                 lw["down"], "down")
        return run

    def fused(configs):
        def run():
            hidden, residual = hidden0, hidden0.clone()
            for lw in layers:
                qkv, residual = rms_norm_gemv(hidden, residual, lw["n1"], EPS, lw["qkv"], None,
                                              configs.get("qkv/norm"))
                hidden = gemv(qkv[:, :Q].contiguous(), lw["o"], None, configs.get("o/plain"))
                x, residual = rms_norm_gemv(hidden, residual, lw["n2"], EPS, lw["gate_up"],
                                            None, configs.get("gate_up/norm"))
                hidden = silu_and_mul_gemv(x, lw["down"], None, configs.get("down/silu"))
        return run

    strategies = {
        "cublas_unfused": unfused(lambda x, w, name: F.linear(x, w)),
        "triton_unfused_best": unfused(lambda x, w, name: gemv(x, w, None, cfg[f"{name}/plain"])),
        "triton_fused_best": fused(cfg),
        "triton_fused_config_for": fused({}),
    }
    out = {"weight_bytes": weight_bytes}
    for name, fn in strategies.items():
        ms = _graph_ms(fn)
        out[name] = {"ms": ms, "gbs": weight_bytes / ms / 1e6}
        print(f"32-layer projections {name:24s} {ms:7.3f} ms {out[name]['gbs']:7.0f} GB/s",
              flush=True)
    return out


def accuracy() -> dict:
    torch.manual_seed(1)
    out = {}
    for name, (n, k) in SHAPES.items():
        if name == "lm_head":
            continue
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        nw = 1 + torch.rand(k, device="cuda", dtype=torch.bfloat16)
        s = (x + r).float()
        normed = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS)).to(torch.bfloat16)
        cases = {"plain": (gemv(x, w), x.float() @ w.float().T),
                 "norm": (rms_norm_gemv(x, r, nw, EPS, w)[0],
                          (nw * normed).float() @ w.float().T)}
        if name == "down":
            gu = torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16)
            act = F.silu(gu[:, :k]) * gu[:, k:]
            cases["silu"] = (silu_and_mul_gemv(gu, w), act.float() @ w.float().T)
        for case, (got, ref) in cases.items():
            err = ((got.float() - ref).norm() / ref.norm()).item()
            out[f"{name}/{case}"] = err
            print(f"rel err {name:8s} {case:6s} {err:.2e}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="a quarter of the config sweep")
    args = parser.parse_args()
    report = {"gpu": torch.cuda.get_device_name(), "accuracy": accuracy(),
              "sweep": sweep(args.quick)}
    report["chain"] = chain(report["sweep"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
