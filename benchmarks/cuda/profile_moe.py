"""Where a batch-1 decode step of the Qwen3-30B-A3B shape spends its GPU time: kernels by
total device time over a few graph-replayed steps (torch.profiler), and the step's wall time.

    python benchmarks/cuda/profile_moe.py --out benchmarks/results/cuda [--layers 48]
Writes moe_profile.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)

from engine_bench import random_prompts  # noqa: E402
from moe_engine_bench import QWEN3_30B_A3B, write_config  # noqa: E402

from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig  # noqa: E402
from deepinfer.core.engine import Engine  # noqa: E402
from deepinfer.core.sampling import SamplingParams  # noqa: E402

STEPS = 20


def profile(path: str, eager: bool) -> dict:
    config = EngineConfig(
        model=ModelSpec(path, dtype="bfloat16", max_model_len=4096, load_format="dummy"),
        cache=CacheConfig(gpu_memory_utilization=0.85),
        scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=8),
        accelerator="nvidia", enforce_eager=eager)
    engine = Engine(config, load_tokenizer=False)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS + 40, ignore_eos=True)
    engine.add_request("p", random_prompts(1, 512, QWEN3_30B_A3B["vocab_size"], 0)[0], params)
    for _ in range(20):  # prefill and warm decode steps
        engine.step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(STEPS):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / STEPS
    rows = []
    for e in prof.key_averages():
        device_us = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if device_us > 0:
            rows.append({"name": e.key[:90], "calls_per_step": e.count / STEPS,
                         "us_per_step": device_us / STEPS})
    rows.sort(key=lambda r: -r["us_per_step"])
    engine.shutdown()
    return {"step_ms": wall * 1e3, "kernels_per_step": sum(r["calls_per_step"] for r in rows),
            "device_us_per_step": sum(r["us_per_step"] for r in rows), "top": rows[:40]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/cuda")
    parser.add_argument("--layers", type=int, default=QWEN3_30B_A3B["num_hidden_layers"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_config(tmp, args.layers)
        result = {"layers": args.layers, "graphs": profile(path, False),
                  "eager": profile(path, True)}
    for mode in ("graphs", "eager"):
        r = result[mode]
        print(f"{mode}: step {r['step_ms']:.2f} ms, {r['kernels_per_step']:.0f} kernels, "
              f"{r['device_us_per_step']:.0f} us of kernels per step")
        for row in r["top"][:25]:
            print(f"{row['us_per_step']:9.1f} us {row['calls_per_step']:6.0f}x  {row['name']}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "moe_profile.json"), "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
