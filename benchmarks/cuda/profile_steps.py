"""Where a step's GPU time goes: torch.profiler over decode steps of the Llama-3-8B shape.

    python benchmarks/cuda/profile_steps.py [--out DIR] [--batches 1 256] [--tag NAME]
        [--quantization fp8]
    DEEPINFER_CUDA_GEMV=0 python benchmarks/cuda/profile_steps.py --batches 1 --tag unfused

For each batch size, runs a few warm decode steps (CUDA graphs replayed as in serving) under
the profiler and prints the kernels by total GPU time, with the step's wall time beside the sum
of kernel times: the difference is launch gaps and host work. Writes profile_steps.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))

from engine_bench import LLAMA3_8B, make_engine, random_prompts, write_config  # noqa: E402

from deepinfer.core.sampling import SamplingParams  # noqa: E402


def decode_profile(engine, batch: int, steps: int = 8) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    ids = [f"p{batch}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, random_prompts(batch, 512, LLAMA3_8B["vocab_size"], batch)):
        engine.add_request(rid, prompt, params, prefix_cache=False)
    budget = engine.config.scheduler.max_num_batched_tokens
    for _ in range(-(-batch * 512 // budget) + 4):
        engine.step()  # the prefills, then a few warm decodes
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
    for rid in ids:
        engine.abort(rid)
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0 and e.count]
    kernels.sort(key=lambda e: -e.device_time_total)
    gpu_us = sum(e.device_time_total for e in kernels) / steps
    rows = [{"name": e.key[:90], "calls_per_step": e.count / steps,
             "us_per_step": e.device_time_total / steps} for e in kernels[:30]]
    return {"batch": batch, "step_ms": wall * 1e3, "kernel_ms": gpu_us / 1e3, "top": rows}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--tag", default="", help="suffix of the JSON file name")
    parser.add_argument("--quantization", default="auto", choices=("auto", "fp8"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as path:
        write_config(path, LLAMA3_8B["num_hidden_layers"])
        engine = make_engine(path, max_len=16384, util=0.45, quantization=args.quantization)
        report = [decode_profile(engine, b) for b in args.batches]
        engine.shutdown()
    for r in report:
        print(f"batch {r['batch']}: step {r['step_ms']:.3f} ms, kernels {r['kernel_ms']:.3f} ms")
        for row in r["top"][:20]:
            print(f"  {row['us_per_step']:9.1f} us  x{row['calls_per_step']:5.1f}  {row['name']}")
    if args.out:
        name = f"profile_steps{'_' + args.tag if args.tag else ''}.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
