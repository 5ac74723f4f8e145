"""Where a batch-1 decode step of the DeepSeek-V4-Flash-width model (v4_bench.py's config) goes:
its kernels by device time (torch.profiler), how long the GPU is busy in the step, and the
host's Python by own and cumulative time (cProfile), and the batch-1 decode graph replayed back
to back (its GPU time with no host work between replays). With `--speculative K`, the same for
steps that verify K MTP drafts (v4_mtp_bench.py's chain weights: every draft is accepted).

    python benchmarks/cuda/profile_v4.py --out benchmarks/results/cuda [--speculative K]
Writes v4_profile.json (v4_profile_mtpK.json).
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
from profile_moe import exposed_us, host_rows, replay_times  # noqa: E402
from v4_bench import v4_config, write_config  # noqa: E402
from v4_mtp_bench import arrange  # noqa: E402

from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig  # noqa: E402
from deepinfer.core.engine import Engine  # noqa: E402
from deepinfer.core.sampling import SamplingParams  # noqa: E402

STEPS = 10


def decoding_engine(path: str, k: int = 0) -> Engine:
    """An engine with one request past its prefill and a few decode steps (k drafts each)."""
    config = EngineConfig(
        model=ModelSpec(path, dtype="bfloat16", max_model_len=4096, load_format="dummy"),
        cache=CacheConfig(gpu_memory_utilization=0.85),
        scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=8,
                                  num_speculative_tokens=k),
        accelerator="nvidia")
    engine = Engine(config, load_tokenizer=False)
    params = SamplingParams(temperature=0.0, max_tokens=(k + 1) * (4 * STEPS + 20),
                            ignore_eos=True)
    if k:  # drafts that are accepted: the chain weights, a prompt of chain tokens
        chain = list(arrange(engine.accelerator.runner.model, 1.0))
        prompt = [chain[i] for i in torch.randint(len(chain), (512,)).tolist()]
    else:
        prompt = random_prompts(1, 512, v4_config().vocab_size, 0)[0]
    engine.add_request("p", prompt, params)
    for _ in range(10):
        engine.step()
    torch.cuda.synchronize()
    return engine


def device_profile(engine: Engine, steps: int = STEPS) -> dict:
    """Device time by kernel over the engine's next `steps` steps, per step."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    rows = [{"name": e.key[:90], "calls_per_step": e.count / steps,
             "us_per_step": (getattr(e, "device_time_total", 0) or 0) / steps}
            for e in prof.key_averages()]
    rows = sorted((r for r in rows if r["us_per_step"] > 0), key=lambda r: -r["us_per_step"])
    busy = sum(exposed_us(prof).values()) / steps
    return {"step_ms": wall * 1e3, "gpu_busy_us_per_step": busy,
            "kernels_per_step": sum(r["calls_per_step"] for r in rows), "top": rows[:30]}


def host_profile(engine: Engine, top: int = 30) -> dict:
    rows = host_rows(engine, STEPS)
    return {"by_own": sorted(rows, key=lambda r: -r["own_us_per_step"])[:top],
            "by_cumulative": sorted(rows, key=lambda r: -r["cum_us_per_step"])[:top]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/cuda")
    parser.add_argument("--speculative", type=int, default=0, metavar="K",
                        help="steps verifying K MTP drafts (all accepted)")
    args = parser.parse_args()
    k = args.speculative
    with tempfile.TemporaryDirectory() as tmp:
        engine = decoding_engine(write_config(tmp), k)
        result = {"speculative_tokens": k, "device": device_profile(engine),
                  "host": host_profile(engine),
                  "replay": replay_times(engine) if engine.accelerator.graphs and not k else {}}
        engine.shutdown()
    os.makedirs(args.out, exist_ok=True)
    name = f"v4_profile_mtp{k}.json" if k else "v4_profile.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(result, f, indent=2)
    d = result["device"]
    print(f"step {d['step_ms']:.2f} ms, GPU busy {d['gpu_busy_us_per_step'] / 1e3:.2f} ms, "
          f"{d['kernels_per_step']:.0f} kernels; replay {result['replay']}")
    for r in d["top"][:12]:
        print(f"  {r['us_per_step']:9.1f} us {r['calls_per_step']:6.1f}x {r['name']}")
    for r in result["host"]["by_own"][:15]:
        print(f"  own {r['own_us_per_step']:9.1f} us {r['calls_per_step']:7.1f}x {r['function']}")


if __name__ == "__main__":
    main()
