"""Where a batch-1 decode step of the Qwen3-30B-A3B shape spends its GPU time: kernels by
total device time over a few graph-replayed steps (torch.profiler), and the step's wall time.

Three runs: CUDA graphs as served; graphs with PDL off (pdl.py), whose kernel times do not
include the wait on the kernel ahead, so they are each kernel's own; and eager. Each run also
gives the time each kernel adds to the step past every earlier kernel's end (`exposed_top`):
with PDL a kernel's duration includes its wait, and this is the part the step pays for. The served
run also profiles the host (cProfile over the same steps): what the engine's Python does while the
GPU waits for the next step.

    python benchmarks/cuda/profile_moe.py --out benchmarks/results/cuda [--layers 48]
Writes moe_profile.json.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from common import exposed_by_name  # noqa: E402
from engine_bench import random_prompts  # noqa: E402
from moe_engine_bench import QWEN3_30B_A3B, write_config  # noqa: E402

from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig  # noqa: E402
from deepinfer.core.engine import Engine  # noqa: E402
from deepinfer.core.sampling import SamplingParams  # noqa: E402

STEPS = 20


def profile(path: str, eager: bool, pdl: bool = True) -> dict:
    os.environ["DEEPINFER_CUDA_PDL"] = "1" if pdl else "0"
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
    host = host_profile(engine) if not eager and pdl else []
    replay = replay_times(engine) if not eager else {}
    exposed = exposed_us(prof)
    busy = sum(exposed.values()) / STEPS
    exposed_top = [{"name": name, "us_per_step": us / STEPS}
                   for name, us in sorted(exposed.items(), key=lambda kv: -kv[1])[:25]]
    engine.shutdown()
    del engine, prof
    gc.collect()  # the next run loads the model again: free this one's weights and cache first
    torch.cuda.empty_cache()
    return {"step_ms": wall * 1e3, "gpu_busy_us_per_step": busy,
            "kernels_per_step": sum(r["calls_per_step"] for r in rows),
            "device_us_per_step": sum(r["us_per_step"] for r in rows), "top": rows[:40],
            "exposed_top": exposed_top,
            "host_top": host, "replay": replay}


def replay_times(engine: Engine, n: int = 50) -> dict:
    """The batch-1 graph replayed n times back to back: the host time of one launch, and the
    GPU time of one forward with no host work between (the step time less this is what the
    engine's Python and the sampling cost the GPU)."""
    graphs = engine.accelerator.graphs.graphs
    graph = graphs[min(key for key in graphs if key[0] == 1)].graph  # shortest context class
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        graph.replay()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return {"launch_host_us": (t1 - t0) / n * 1e6, "forward_us": (t2 - t0) / n * 1e6}


def exposed_us(prof: torch.profiler.profile) -> dict[str, float]:
    """Per kernel (or copy) name, the device time it adds to the union of all intervals
    (common.exposed_by_name): their sum is the time the GPU was busy, and the step time less
    that is the GPU waiting for the host."""
    return exposed_by_name([(e.time_range.start, e.time_range.end, e.name[:90])
                            for e in prof.events()
                            if e.device_type == torch.autograd.DeviceType.CUDA])


def host_profile(engine: Engine, top: int = 30) -> list[dict]:
    """The step's Python by cumulative time (us per step), from cProfile."""
    return sorted(host_rows(engine, STEPS), key=lambda r: -r["cum_us_per_step"])[:top]


def host_rows(engine: Engine, steps: int) -> list[dict]:
    """Every function the engine's `steps` steps ran, with its calls and own and cumulative
    time per step (us), from cProfile."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof).stats
    return [{"function": f"{path.split('/')[-1]}:{line}:{name}", "calls_per_step": c / steps,
             "own_us_per_step": tt / steps * 1e6, "cum_us_per_step": ct / steps * 1e6}
            for (path, line, name), (c, _, tt, ct, _) in stats.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/cuda")
    parser.add_argument("--layers", type=int, default=QWEN3_30B_A3B["num_hidden_layers"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_config(tmp, args.layers)
        result = {"layers": args.layers, "graphs": profile(path, False),
                  "graphs_no_pdl": profile(path, False, pdl=False),
                  "eager": profile(path, True)}
    for mode in ("graphs", "graphs_no_pdl", "eager"):
        r = result[mode]
        print(f"{mode}: step {r['step_ms']:.2f} ms, GPU busy {r['gpu_busy_us_per_step']:.0f} us, "
              f"{r['kernels_per_step']:.0f} kernels, {r['device_us_per_step']:.0f} us of kernels "
              f"per step; replay {r['replay']}")
        for row in r["top"][:25]:
            print(f"{row['us_per_step']:9.1f} us {row['calls_per_step']:6.0f}x  {row['name']}")
        print("time each kernel adds to the step (past every earlier kernel's end):")
        for row in r["exposed_top"]:
            print(f"{row['us_per_step']:9.1f} us  {row['name']}")
        for row in r["host_top"]:
            print(f"host {row['cum_us_per_step']:9.1f} us cum {row['own_us_per_step']:8.1f} own "
                  f"{row['calls_per_step']:6.1f}x  {row['function']}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "moe_profile.json"), "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
