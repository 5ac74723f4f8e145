"""Where a whole throughput run's time goes: 256 x (512 in + 128 out) on the Llama-3-8B shape,
submitted at once, as engine_bench runs it.

    python benchmarks/cuda/profile_run.py [--out DIR] [--requests 256] [--quantization fp8]

Runs the scenario twice after a warm-up: once plain (the wall time engine_bench reports), once
under torch.profiler (CUDA kernels only). From the second it reports the GPU's busy time (the
union of kernel intervals) against the wall, the kernels by kind (GEMM, attention, norms, ...)
with their share, and the host's side of each step: what it scheduled (prompt tokens, decodes),
how long the step call took and how much of that it waited on the device. Steps are grouped
as prefill-only, mixed and decode-only. Writes profile_run.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from common import exposed_by_name  # noqa: E402
from engine_bench import LLAMA3_8B, make_engine, random_prompts, run_all, write_config  # noqa: E402

# (kind, substrings of the kernel name), first match wins
KINDS = (
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "_gemv", "scaled_mm")),
    ("prefill_attention", ("prefill", "fmha", "flash", "cudnn", "attention")),
    ("decode_attention", ("decode",)),
    ("norm", ("norm",)),
    ("rotary_kv", ("rotary", "kv_write", "rope")),
    ("activation", ("silu", "gelu")),
    ("sampling", ("argmax", "sample", "topk", "softmax")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, subs in KINDS if any(s in low for s in subs)), "other")


@dataclass
class StepRecord:
    prompt_tokens: int
    decodes: int
    call_s: float = 0.0  # engine.step() wall
    wait_s: float = 0.0  # of which: waiting for a step's tokens on the device


@dataclass
class HostLog:
    steps: list[StepRecord] = field(default_factory=list)


def instrument(engine, log: HostLog) -> None:
    """Record each schedule's composition and the time spent waiting on device tokens."""
    scheduler, accel = engine.scheduler, engine.accelerator
    schedule, launch = scheduler.schedule, accel.launch

    def scheduled():
        out = schedule()
        decodes = sum(1 for s in out.seqs if s.num_new_tokens == 1)
        log.steps.append(StepRecord(out.num_tokens - decodes, decodes))
        return out

    def launched(batch):
        future = launch(batch)
        result = future.result

        def timed():
            t0 = time.perf_counter()
            value = result()
            log.steps[-1].wait_s += time.perf_counter() - t0
            return value

        future.result = timed
        return future

    scheduler.schedule, accel.launch = scheduled, launched


def timed_steps(engine, prompts: list[list[int]], log: HostLog) -> float:
    step = engine.step

    def timed():
        t0 = time.perf_counter()
        out = step()
        if log.steps:
            log.steps[-1].call_s += time.perf_counter() - t0
        return out

    engine.step = timed
    try:
        seconds, _ = run_all(engine, prompts, 128)
    finally:
        engine.step = step
    return seconds


def kernel_report(prof, wall: float) -> dict:
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
              and e.device_time > 0]
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    spans = []
    for e in events:
        start = e.time_range.start
        spans.append((start, start + e.device_time, ""))
        by_kind[kind_of(e.name)] += e.device_time / 1e6
        by_name[e.name[:90]] += e.device_time / 1e6
    busy = sum(exposed_by_name(spans).values()) / 1e6  # the union of the kernels' intervals
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:25]
    return {"wall_s": wall, "gpu_busy_s": busy, "gpu_idle_s": wall - busy,
            "kernel_s": sum(by_kind.values()),
            "by_kind_s": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "top_kernels_s": dict(top)}


def phase_report(log: HostLog) -> dict:
    phases: dict[str, dict] = {}
    for rec in log.steps:
        phase = ("prefill" if not rec.decodes else "decode" if not rec.prompt_tokens
                 else "mixed")
        p = phases.setdefault(phase, {"steps": 0, "prompt_tokens": 0, "decodes": 0,
                                      "call_s": 0.0, "wait_s": 0.0})
        p["steps"] += 1
        p["prompt_tokens"] += rec.prompt_tokens
        p["decodes"] += rec.decodes
        p["call_s"] += rec.call_s
        p["wait_s"] += rec.wait_s
    for p in phases.values():
        p["host_s"] = p["call_s"] - p["wait_s"]
    return phases


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--quantization", default="auto", choices=("auto", "fp8"))
    parser.add_argument("--plain", action="store_true", help="the plain runs only (3), no profile")
    args = parser.parse_args()
    vocab = LLAMA3_8B["vocab_size"]
    with tempfile.TemporaryDirectory() as path:
        write_config(path, LLAMA3_8B["num_hidden_layers"])
        engine = make_engine(path, max_len=16384, util=0.85, quantization=args.quantization)
        run_all(engine, random_prompts(4, 600, vocab, 1), 16)  # compile every kernel
        run_all(engine, random_prompts(args.requests, 512, vocab, 2), 128)  # warm graphs
        plain, _ = run_all(engine, random_prompts(args.requests, 512, vocab, 3), 128)
        if args.plain:
            runs = [plain] + [run_all(engine, random_prompts(args.requests, 512, vocab, s), 128)[0]
                              for s in (4, 5)]
            engine.shutdown()
            print(json.dumps({"plain_s": runs,
                              "out_tok_s": [args.requests * 128 / s for s in runs]}))
            return
        log = HostLog()
        instrument(engine, log)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            wall = timed_steps(engine, random_prompts(args.requests, 512, vocab, 4), log)
            torch.cuda.synchronize()
        engine.shutdown()
    report = {"requests": args.requests, "quantization": args.quantization,
              "plain_s": plain, "plain_out_tok_s": args.requests * 128 / plain,
              "profiled": kernel_report(prof, wall), "phases": phase_report(log),
              "steps": [asdict(s) for s in log.steps]}
    summary = {k: v for k, v in report.items() if k != "steps"}
    print(json.dumps(summary, indent=1))
    if args.out:
        tag = "" if args.quantization == "auto" else f"_{args.quantization}"
        with open(os.path.join(args.out, f"profile_run{tag}.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
