"""Check and time the one-token projection kernel on a GPU at Llama-3-8B shapes.

    python benchmarks/cuda/bench_gemv.py [--out results.json] [--quick]

1. Relative error against a float32 matmul, output poisoned first.
2. Each projection shape: cuBLAS (torch.nn.functional.linear) beside the Triton GEMV under a
   sweep of tile configs and under config_for's choice, in us and GB/s of weight read. Calls
   are timed as a CUDA graph of 16 calls over distinct weight copies, so the L2 (50 MB) holds
   none of them, as in a decode step.
3. The projections of all 32 layers as a decode step runs them (norm and SiLU kernels between
   them), with cuBLAS and with the GEMV, each with programmatic dependent launch off and on,
   and with the GEMV's preload before that wait cut to one tile (DEEPINFER_CUDA_GEMV_PRELOAD=0).
4. --moe-chain: Qwen3-30B-A3B's decode layers without attention (norm, qkv, o, norm, router,
   top-k, the 8 experts' GEMVs), preload on and off.
5. --chain-tiles: the 32 layers' chain under PDL with other tiles than config_for's, each
   variant timed in alternating rounds (a tile that reads whole rows before its wait is only
   seen to pay off behind a kernel that lets it launch early, as the norms do).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics

import torch
import torch.nn.functional as F
import triton

from deepinfer.backends.cuda.kernels.activation import silu_and_mul
from deepinfer.backends.cuda.kernels.gemv import GemvConfig, config_for, gemv
from deepinfer.backends.cuda.kernels.moe_gemv import moe_gemv
from deepinfer.backends.cuda.kernels.moe_router import route_topk
from deepinfer.backends.cuda.kernels.norm import add_rms_norm
from deepinfer.models.moe.routing import RouterSpec

HIDDEN, FFN, Q, KV, VOCAB, LAYERS = 4096, 14336, 4096, 1024, 128256, 32
SHAPES = {"qkv": (Q + 2 * KV, HIDDEN), "o": (HIDDEN, Q), "gate_up": (2 * FFN, HIDDEN),
          "down": (HIDDEN, FFN), "lm_head": (VOCAB, HIDDEN)}
# Qwen3-30B-A3B's one-token projections (2048 wide; its experts go to the fused MoE).
MOE_SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096), "router": (128, 2048),
              "lm_head": (151936, 2048)}
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
    grid = itertools.product([1, 2, 4, 8, 16, 32], [256, 512, 1024], [2, 4, 8], [1])
    configs = [GemvConfig(*c) for c in grid if c[0] * c[1] <= 16384]
    return configs[::4] if quick else configs


def sweep(quick: bool, shapes: dict = SHAPES) -> dict:
    out: dict = {}
    for name, (n, k) in shapes.items():
        copies = 4 if name == "lm_head" else 16
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        row: dict = {"bytes": n * k * 2, "triton": {}}
        row["cublas_us"] = _graph_ms(lambda: [F.linear(x, w) for w in weights]) * 1e3 / copies
        chosen = config_for(n, k)
        for cfg in _configs(quick) + [chosen]:
            try:
                row["triton"][str(cfg)] = _graph_ms(
                    lambda cfg=cfg: [gemv(x, w, None, cfg) for w in weights]) * 1e3 / copies
            except Exception as exc:  # a config the compiler refuses (registers, shared memory)
                row["triton"][str(cfg)] = f"failed: {type(exc).__name__}"
        ok = {c: v for c, v in row["triton"].items() if isinstance(v, float)}
        best = min(ok, key=ok.get)
        row.update(best=best, best_us=ok[best], chosen=str(chosen), chosen_us=ok[str(chosen)])
        gbs = {key: row["bytes"] / row[f"{key}_us"] / 1e3 for key in ("cublas", "best", "chosen")}
        row.update({f"{key}_gbs": v for key, v in gbs.items()})
        print(f"{name:8s} [{n}x{k}] cuBLAS {row['cublas_us']:6.1f} us ({gbs['cublas']:4.0f} GB/s)"
              f" | GEMV chosen {row['chosen_us']:6.1f} us ({gbs['chosen']:4.0f} GB/s), best of "
              f"sweep {row['best_us']:6.1f} us {best}", flush=True)
        out[name] = row
        weights = []  # freed before the next shape's copies
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


def _chain_step(layers: list[dict], project):
    """One decode step's projections (attention left out: the same in every variant)."""
    hidden0 = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def run():
        hidden, residual = hidden0, hidden0.clone()
        for lw in layers:
            x, residual = add_rms_norm(hidden, residual, lw["n1"], EPS)
            qkv = project(x, lw["qkv"])
            hidden = project(qkv[:, :Q].contiguous(), lw["o"])
            x, residual = add_rms_norm(hidden, residual, lw["n2"], EPS)
            hidden = project(silu_and_mul(project(x, lw["gate_up"])), lw["down"])
    return run


def _weight_bytes(layers: list[dict]) -> int:
    return sum(sum(t.numel() * 2 for k, t in lw.items() if k in SHAPES) for lw in layers)


def chain() -> dict:
    """All 32 layers' projections as a decode step runs them, with cuBLAS and with the GEMV
    kernel at config_for's tiles."""
    layers = _layers()
    weight_bytes = _weight_bytes(layers)

    def step(project):
        return _chain_step(layers, project)

    out = {"weight_bytes": weight_bytes}
    variants = [("cublas", F.linear, "0", "1"), ("cublas_pdl", F.linear, "1", "1"),
                ("gemv", gemv, "0", "1"), ("gemv_pdl_one_tile", gemv, "1", "0"),
                ("gemv_pdl", gemv, "1", "1")]
    for key, project, pdl, preload in variants:
        out[key] = _timed_variant(step(project), weight_bytes, pdl, preload,
                                  f"32-layer projections + norms, {key:17s}")
    return out


def _timed_variant(run, weight_bytes: int, pdl: str, preload: str, label: str) -> dict:
    # Both switches are read at every launch (kernels/pdl.py, gemv.preload_cols).
    os.environ.update(DEEPINFER_CUDA_PDL=pdl, DEEPINFER_CUDA_GEMV_PRELOAD=preload)
    try:
        ms = _graph_ms(run)
    finally:
        os.environ.pop("DEEPINFER_CUDA_PDL")
        os.environ.pop("DEEPINFER_CUDA_GEMV_PRELOAD")
    row = {"ms": ms, "gbs": weight_bytes / ms / 1e6}
    print(f"{label} {ms:7.3f} ms {row['gbs']:5.0f} GB/s of weights", flush=True)
    return row


# Tile variants of --chain-tiles: (weight rows a program, warps) for rows of up to 4096
# columns, read whole before the wait (64 values a thread at these pairs); down_proj keeps
# config_for's tiles unless a variant names its own.
WHOLE_ROW_TILES = {"whole_4x8w": (4, 8), "whole_2x4w": (2, 4), "whole_8x16w": (8, 16)}


def _chooser(name: str):
    if name == "config_for":
        return config_for
    if name.startswith("down_"):  # config_for, down_proj reading its first 8192 columns first
        def down_first(n: int, k: int) -> GemvConfig:
            return GemvConfig(2, 1024, 8, first_k=8192) if k > 4096 else config_for(n, k)
        return down_first
    rows, warps = WHOLE_ROW_TILES[name]

    def whole(n: int, k: int) -> GemvConfig:
        if k > 4096:
            return config_for(n, k)
        return GemvConfig(rows, 1024, warps, first_k=triton.next_power_of_2(k))
    return whole


def chain_tiles(rounds: int = 3) -> dict:
    """The 32-layer chain under PDL with each tile variant, rounds alternating variants."""
    layers = _layers()
    weight_bytes = _weight_bytes(layers)
    names = ["config_for", *WHOLE_ROW_TILES, "down_first8192"]
    runs: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names:
            choose = _chooser(name)
            step = _chain_step(layers, lambda x, w: gemv(x, w, None, choose(*w.shape)))
            runs[name].append(_timed_variant(step, weight_bytes, "1", "1",
                                             f"round {r} {name:16s}")["ms"])
    return {"weight_bytes": weight_bytes, "ms": runs,
            "median_ms": {n: statistics.median(v) for n, v in runs.items()}}


MOE_LAYERS, EXPERTS, TOP_K, MOE_FFN = 16, 128, 8, 768


def _moe_layers() -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) / 45.0

    (qkv_n, h), (o_n, q) = MOE_SHAPES["qkv"], MOE_SHAPES["o"]
    return [dict(qkv=w(qkv_n, h), o=w(o_n, q), router=w(EXPERTS, h),
                 w13=w(EXPERTS, 2 * MOE_FFN, h), w2=w(EXPERTS, h, MOE_FFN),
                 n=torch.ones(h, device="cuda", dtype=torch.bfloat16))
            for _ in range(MOE_LAYERS)]


def moe_chain() -> dict:
    """Qwen3-30B-A3B decode layers without attention, as the engine runs them at batch 1."""
    layers = _moe_layers()
    h, q = MOE_SHAPES["o"]
    hidden0 = torch.randn(1, h, device="cuda", dtype=torch.bfloat16)
    per_layer = (MOE_SHAPES["qkv"][0] * h + h * q + EXPERTS * h + TOP_K * 3 * MOE_FFN * h) * 2
    router = RouterSpec(EXPERTS, TOP_K)

    def run():
        hidden, residual = hidden0, hidden0.clone()
        for lw in layers:
            x, residual = add_rms_norm(hidden, residual, lw["n"], EPS)
            hidden = gemv(gemv(x, lw["qkv"])[:, :q].contiguous(), lw["o"])
            x, residual = add_rms_norm(hidden, residual, lw["n"], EPS)
            weights, ids = route_topk(gemv(x, lw["router"]), router)
            hidden = moe_gemv(x, lw["w13"], lw["w2"], weights, ids)

    total = per_layer * MOE_LAYERS
    out = {"layers": MOE_LAYERS, "active_bytes": total}
    for key, pdl, preload in (("gemv", "0", "1"), ("gemv_pdl_one_tile", "1", "0"),
                              ("gemv_pdl", "1", "1")):
        out[key] = _timed_variant(run, total, pdl, preload,
                                  f"{MOE_LAYERS} Qwen3-30B-A3B layers w/o attention, {key:17s}")
        out[key]["us_per_layer"] = out[key]["ms"] * 1e3 / MOE_LAYERS
    return out


def accuracy() -> dict:
    torch.manual_seed(1)
    out = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ w.float().T
        got = gemv(x, w, out=torch.full((1, n), float("nan"), device="cuda",
                                        dtype=torch.bfloat16))
        err = ((got.float() - ref).norm() / ref.norm()).item()
        out[name] = err
        print(f"rel err {name:8s} {err:.2e}", flush=True)
        if not err < 1e-2:
            raise AssertionError(f"{name}: relative error {err:.2e}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="a quarter of the config sweep")
    parser.add_argument("--moe-shapes", action="store_true",
                        help="only the sweep, at Qwen3-30B-A3B's shapes")
    parser.add_argument("--moe-chain", action="store_true",
                        help="only Qwen3-30B-A3B's layers without attention, preload on/off")
    parser.add_argument("--chain-tiles", action="store_true",
                        help="only the 32-layer chain under other tiles (WHOLE_ROW_TILES)")
    args = parser.parse_args()
    if args.chain_tiles:
        report = {"gpu": torch.cuda.get_device_name(), "chain_tiles": chain_tiles()}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
        return
    if args.moe_chain:
        report = {"gpu": torch.cuda.get_device_name(), "moe_chain": moe_chain(),
                  "chain": chain()}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
        return
    if args.moe_shapes:
        report = {"gpu": torch.cuda.get_device_name(), "sweep": sweep(args.quick, MOE_SHAPES)}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
        return
    report = {"gpu": torch.cuda.get_device_name(), "accuracy": accuracy(),
              "sweep": sweep(args.quick)}
    report["chain"] = chain()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
