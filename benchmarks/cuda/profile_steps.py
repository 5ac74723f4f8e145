"""Where a step's GPU time goes: torch.profiler over decode steps of the Llama-3-8B shape.

    python benchmarks/cuda/profile_steps.py [--out DIR] [--batches 1 256] [--tag NAME]
        [--quantization fp8] [--prefill 8192]
    DEEPINFER_CUDA_GEMV=0 python benchmarks/cuda/profile_steps.py --batches 1 --tag unfused

For each batch size, runs a few warm decode steps (CUDA graphs replayed as in serving) under
the profiler and prints the kernels by total GPU time, with the step's wall time beside the sum
of kernel times: the difference is launch gaps and host work. `--prefill N` profiles one
N-token prompt's prefill the same way (batch 0 in the JSON). Writes profile_steps.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from common import exposed_by_name  # noqa: E402
from engine_bench import LLAMA3_8B, make_engine, random_prompts, run_all, write_config  # noqa: E402

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
    return {"batch": batch, "step_ms": wall * 1e3, **kernel_table(prof, steps)}


def prefill_profile(engine, tokens: int, reps: int = 3) -> dict:
    """One `tokens`-long prompt's prefill (and its one sampled token), after an unprofiled
    warm-up; the whole run of each, as engine_bench's prefill_8k times it."""
    prompts = random_prompts(reps + 1, tokens, LLAMA3_8B["vocab_size"], tokens)
    run_all(engine, prompts[:1], 1)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        wall = sum(run_all(engine, [prompt], 1)[0] for prompt in prompts[1:]) / reps
        torch.cuda.synchronize()
    return {"batch": 0, "prefill_tokens": tokens, "step_ms": wall * 1e3,
            **kernel_table(prof, reps)}


def kernel_table(prof, steps: int) -> dict:
    """GPU time per step by kernel, largest first (the top 30): each kernel's own time and what
    it adds to the union of all kernels' intervals (under PDL a kernel waits inside its span for
    the one ahead, so its own time overstates what the step pays for it)."""
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
              and e.device_time > 0]
    own: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    spans = []
    for e in events:
        name = e.name[:90]
        own[name][0] += 1
        own[name][1] += e.device_time
        spans.append((e.time_range.start, e.time_range.start + e.device_time, name))
    exposed = exposed_by_name(spans)
    rows = [{"name": name, "calls_per_step": n / steps, "us_per_step": us / steps,
             "exposed_us_per_step": exposed.get(name, 0.0) / steps}
            for name, (n, us) in sorted(own.items(), key=lambda kv: -kv[1][1])[:30]]
    return {"kernel_ms": sum(us for _, us in own.values()) / steps / 1e3,
            "busy_ms": sum(exposed.values()) / steps / 1e3, "top": rows}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--tag", default="", help="suffix of the JSON file name")
    parser.add_argument("--quantization", default="auto", choices=("auto", "fp8"))
    parser.add_argument("--prefill", type=int, default=0, metavar="N",
                        help="also profile one N-token prefill")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as path:
        write_config(path, LLAMA3_8B["num_hidden_layers"])
        engine = make_engine(path, max_len=16384, util=0.45, quantization=args.quantization)
        report = [decode_profile(engine, b) for b in args.batches]
        if args.prefill:
            report.append(prefill_profile(engine, args.prefill))
        engine.shutdown()
    for r in report:
        what = f"prefill {r['prefill_tokens']}" if r["batch"] == 0 else f"batch {r['batch']}"
        print(f"{what}: step {r['step_ms']:.3f} ms, kernels {r['kernel_ms']:.3f} ms, "
              f"GPU busy {r['busy_ms']:.3f} ms")
        for row in r["top"][:20]:
            print(f"  {row['us_per_step']:9.1f} us  exposed {row['exposed_us_per_step']:9.1f}  "
                  f"x{row['calls_per_step']:5.1f}  {row['name']}")
    if args.out:
        name = f"profile_steps{'_' + args.tag if args.tag else ''}.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
