"""Where a long DeepSeek-V4 prefill goes (v4_bench.py's V4-Flash-width model): its kernels by
device time (torch.profiler), how long the GPU is busy against the prefill's wall time, and
the host's Python by own time (cProfile, a second prefill of the same length).

    python benchmarks/cuda/profile_v4_prefill.py --tokens 65536 --out benchmarks/results/cuda
Writes v4_prefill_profile_<tokens>.json.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)

from engine_bench import random_prompts  # noqa: E402
from moe_engine_bench import prefill_seconds  # noqa: E402
from profile_moe import exposed_us  # noqa: E402
from v4_bench import v4_config, write_config  # noqa: E402

from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig  # noqa: E402
from deepinfer.core.engine import Engine  # noqa: E402


def device_profile(engine: Engine, prompt: list[int]) -> dict:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        wall = prefill_seconds(engine, prompt)
    rows = [{"name": e.key[:90], "calls": e.count,
             "ms": (getattr(e, "device_time_total", 0) or 0) / 1e3}
            for e in prof.key_averages()]
    rows = sorted((r for r in rows if r["ms"] > 0), key=lambda r: -r["ms"])
    return {"wall_ms": wall * 1e3, "gpu_busy_ms": sum(exposed_us(prof).values()) / 1e3,
            "top": rows[:30]}


def host_profile(engine: Engine, prompt: list[int], top: int = 30) -> dict:
    prof = cProfile.Profile()
    prof.enable()
    wall = prefill_seconds(engine, prompt)
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = [{"function": f"{path.split('/')[-1]}:{line}:{name}", "calls": c,
             "own_ms": tt * 1e3, "cum_ms": ct * 1e3}
            for (path, line, name), (c, _, tt, ct, _) in stats.items()]
    return {"wall_ms": wall * 1e3,
            "by_own": sorted(rows, key=lambda r: -r["own_ms"])[:top]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/cuda")
    parser.add_argument("--tokens", type=int, default=65536)
    args = parser.parse_args()
    vocab = v4_config().vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        config = EngineConfig(
            model=ModelSpec(write_config(tmp), dtype="bfloat16", max_model_len=args.tokens + 256,
                            load_format="dummy"),
            cache=CacheConfig(gpu_memory_utilization=0.85),
            scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=8),
            accelerator="nvidia")
        engine = Engine(config, load_tokenizer=False)
        prompt = random_prompts(1, args.tokens, vocab, 99)[0]
        t0 = time.perf_counter()
        prefill_seconds(engine, prompt)  # warm-up
        result = {"tokens": args.tokens, "first_s": time.perf_counter() - t0,
                  "device": device_profile(engine, prompt), "host": host_profile(engine, prompt)}
        engine.shutdown()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"v4_prefill_profile_{args.tokens}.json"), "w") as f:
        json.dump(result, f, indent=2)
    d = result["device"]
    print(f"{args.tokens}-token prefill {d['wall_ms']:.0f} ms, GPU busy {d['gpu_busy_ms']:.0f} ms")
    for r in d["top"][:20]:
        print(f"  {r['ms']:9.1f} ms {r['calls']:6d}x {r['name']}")
    for r in result["host"]["by_own"][:20]:
        print(f"  own {r['own_ms']:9.1f} ms {r['calls']:7d}x {r['function']}")


if __name__ == "__main__":
    main()
