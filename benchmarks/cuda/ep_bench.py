"""Expert parallel on two H200s of one host, Qwen3-30B-A3B shape (random bf16 weights).

    python benchmarks/cuda/ep_bench.py --out benchmarks/results/cuda [--quick] [--parts serve eplb]

serve: deepinfer-serve --dp 2 with expert parallel (each GPU holds half the experts, every MoE
       layer exchanges tokens over NCCL) against --dp 2 --no-ep (two independent replicas, each
       GPU holds every expert): N streaming /v1/completions of 512 random prompt tokens and 128
       output tokens at once (EOS ignored), output tok/s and TTFT p50 through the server.
exchange: one MoE layer (exchange + fused experts) per step size, all-gather + reduce-scatter
       vs all-to-all, which sets ALL_TO_ALL_MIN_TOKENS.
eplb:  two NCCL ranks in this process tree, decode batches with a skewed router (a bias on the
       router logits of 10% of the experts so that they get half of the routes), one EPLB
       rebalance with redundant experts: imbalance (max/mean tokens per rank) and decode step
       time before and after.
Writes ep.json and ep.png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from common import (  # noqa: E402
    free_port,
    percentile,
    pyplot,
    save_word_tokenizer,
    start_server,
    stop_server,
    wait_healthy,
)
from moe_engine_bench import QWEN3_30B_A3B, write_config  # noqa: E402

PROMPT, OUTPUT = 512, 128
HOT_FRACTION, HOT_SHARE = 0.1, 0.5


def model_dir(path: str, layers: int) -> str:
    """The config plus a word-level tokenizer over the whole vocabulary (no hub here)."""
    write_config(path, layers)
    save_word_tokenizer(path, QWEN3_30B_A3B["vocab_size"], 151645)
    return path


# ---- serve: EP vs replicas ---------------------------------------------------------------
def serve_one(path: str, extra: list[str], requests: int, workdir: str) -> dict:
    port = free_port()
    log_path = os.path.join(workdir, f"serve-{port}.log")
    cmd = [sys.executable, "-m", "deepinfer.serve.cli", "--model", path, "--port", str(port),
           "--accelerator", "nvidia", "--dtype", "bfloat16", "--load-format", "dummy",
           "--max-model-len", "4096", "--max-num-seqs", "128", "--max-num-batched-tokens",
           "8192", "--gpu-memory-utilization", "0.85", "--tokenizer-backend", "hf",
           "--generation-config", "none", "--routing", "least-loaded", "--dp", "2",
           "--served-model-name", "m", *extra]
    proc = start_server(cmd, log_path, {"NCCL_NVLS_ENABLE": "0"})
    base = f"http://127.0.0.1:{port}"
    try:
        startup = wait_healthy(proc, base, log_path, timeout_s=480)
        asyncio.run(wave(base, 16, 8))  # warm-up
        result = asyncio.run(wave(base, requests, OUTPUT))
        result["startup_s"] = startup
        return result
    finally:
        stop_server(proc)


async def wave(base: str, requests: int, output: int) -> dict:
    import httpx

    g = torch.Generator().manual_seed(requests)
    prompts = torch.randint(1000, QWEN3_30B_A3B["vocab_size"] - 1000, (requests, PROMPT),
                            generator=g).tolist()
    limits = httpx.Limits(max_connections=requests + 8)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_stream(client, p, output, t0) for p in prompts))
        wall = time.perf_counter() - t0
    ttfts = [r[0] for r in results]
    tokens = sum(r[1] for r in results)
    return {"requests": requests, "output_tok_s": tokens / wall, "wall_s": wall,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99)}


async def _stream(client, prompt: list[int], output: int, t0: float) -> tuple[float, int]:
    body = {"model": "m", "prompt": prompt, "max_tokens": output, "temperature": 0,
            "ignore_eos": True, "stream": True}
    first, count = None, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                first = first or time.perf_counter() - t0
                count += 1
    return first or 0.0, count


# ---- eplb: skewed routing, before and after a rebalance ----------------------------------
def eplb_rank(rank: int, path: str, port: int, redundant: int, steps: int, out) -> None:
    import torch.distributed as dist

    from deepinfer.core.accelerator import ParallelContext
    from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
    from deepinfer.core.engine import Engine

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, device_id=torch.device("cuda", rank))
    context = ParallelContext(rank, 2, dist.group.WORLD, True, redundant)
    config = EngineConfig(
        ModelSpec(path, dtype="bfloat16", max_model_len=4096, load_format="dummy"),
        CacheConfig(gpu_memory_utilization=0.85),
        SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=128), accelerator="nvidia")
    from deepinfer.backends.cuda.accelerator import CUDAAccelerator

    engine = Engine(config, CUDAAccelerator(), load_tokenizer=False, parallel=context)
    skew_router(engine.accelerator.runner.ops, QWEN3_30B_A3B["num_experts"])
    before = decode_steps(engine, rank, steps)
    report = engine.rebalance_experts()
    after = decode_steps(engine, rank, steps)
    out.put((rank, {"before_step_s": before, "after_step_s": after, "report": vars(report)}))
    dist.destroy_process_group()


def skew_router(ops, experts: int) -> None:
    """A bias on the router logits of 10% of the experts, sized so that they get about half of
    the routes (softmax top-k over roughly equal logits). The hot experts are the last ones of
    rank 0's block and have no replica in the initial placement (whose redundant slots copy
    experts 0..R-1), so the load starts on one rank."""
    import math

    hot = max(1, int(experts * HOT_FRACTION))
    # odds: hot experts' share / cold experts' share per expert = (0.5/hot) / (0.5/(E-hot))
    bias = torch.zeros(experts)
    bias[experts // 2 - hot:experts // 2] = math.log((experts - hot) / hot)
    route = ops.route

    def skewed(logits, spec, *rest, **options):  # the rest of ModelOps.route's arguments
        return route(logits + bias.to(logits.device, logits.dtype), spec, *rest, **options)
    ops.route = skewed


def decode_steps(engine, rank: int, steps: int) -> float:
    """Median decode step time of 64 sequences of 512 prompt tokens (both ranks busy)."""
    from deepinfer.core.sampling import SamplingParams

    g = torch.Generator().manual_seed(rank + steps)
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    for i in range(64):
        prompt = torch.randint(1000, 150000, (PROMPT,), generator=g).tolist()
        engine.add_request(f"r{rank}-{time.monotonic_ns()}-{i}", prompt, params,
                           prefix_cache=False)
    times = []
    while engine.has_unfinished_requests():
        decode = all(s.request.num_computed_tokens > 0 for s in engine._samples.values())
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        if decode:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_eplb(path: str, redundant: int, steps: int) -> dict:
    results = two_ranks(eplb_rank, lambda rank, port, out: (rank, path, port, redundant, steps,
                                                            out), timeout_s=540)
    return {"redundant_experts": redundant, "ranks": [results[0], results[1]]}


def two_ranks(target, args, timeout_s: float) -> dict:
    """Run target(*args(rank, port, queue)) on ranks 0 and 1; {rank: what it put}."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=target, args=args(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return dict(out.get(timeout=timeout_s) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


# ---- exchange: all-gather vs all-to-all per step size -------------------------------------
EXCHANGE_TOKENS = (1, 16, 64, 256, 1024, 4096, 8192)


def exchange_rank(rank: int, port: int, out) -> None:
    """One Qwen3-30B-A3B MoE layer's exchange + experts on each of two ranks, both modes."""
    import torch.distributed as dist

    from deepinfer.backends.cuda.kernels.fused_moe import fused_experts
    from deepinfer.core.accelerator import ParallelContext
    from deepinfer.models.moe.runtime import ExpertRuntime

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, device_id=torch.device("cuda", rank))
    c = QWEN3_30B_A3B
    h, f, experts, k = c["hidden_size"], c["moe_intermediate_size"], c["num_experts"], \
        c["num_experts_per_tok"]
    runtime = ExpertRuntime(1, experts, ParallelContext(rank, 2, dist.group.WORLD, True))
    runtime.to("cuda")
    s = runtime.slots_per_rank
    w13 = torch.randn(s, 2 * f, h, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(s, h, f, device="cuda", dtype=torch.bfloat16) * 0.02

    def compute(x, weights, slots):
        return fused_experts(x, w13, w2, weights, slots)

    times = {}
    for tokens in EXCHANGE_TOKENS:
        x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(experts, device="cuda")[:k] for _ in range(tokens)])
        weights = torch.rand(tokens, k, device="cuda")
        phys = runtime._physical(0, ids)
        modes = {"all_gather": lambda: runtime.exchange.run(x, weights, phys, tokens, compute),
                 "all_to_all": lambda: runtime.all_to_all.run(x, weights, phys, compute)}
        times[tokens] = {name: _median_ms(fn) for name, fn in modes.items()}
    out.put((rank, times))
    dist.destroy_process_group()


def _median_ms(fn, reps: int = 20) -> float:
    import torch.distributed as dist

    for _ in range(3):
        fn()
    samples = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def run_exchange() -> dict:
    results = two_ranks(exchange_rank, lambda rank, port, out: (rank, port, out), timeout_s=300)
    return {str(t): {mode: max(results[r][t][mode] for r in (0, 1))
                     for mode in ("all_gather", "all_to_all")} for t in EXCHANGE_TOKENS}


# ---- report ------------------------------------------------------------------------------
def plot(result: dict, path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    exchange = result.get("exchange")
    if exchange:
        tokens = [int(t) for t in exchange]
        for mode in ("all_gather", "all_to_all"):
            axes[2].plot(tokens, [exchange[str(t)][mode] for t in tokens], marker="o",
                         label=mode)
        axes[2].set_xscale("log")
        axes[2].set_yscale("log")
        axes[2].set_xlabel("tokens per rank")
        axes[2].set_ylabel("ms per MoE layer (exchange + experts)")
        axes[2].legend()
    serve = result.get("serve", {})
    if serve:
        names = list(serve)
        axes[0].bar(names, [serve[n]["output_tok_s"] for n in names])
        axes[0].set_ylabel("output tok/s through the server")
        axes[0].set_title(f"--dp 2, {serve[names[0]]['requests']} x ({PROMPT}+{OUTPUT})")
    eplb = result.get("eplb")
    if eplb:
        report = eplb["ranks"][0]["report"]
        axes[1].bar(["before", "after"], [report["imbalance_before"], report["imbalance_after"]])
        axes[1].set_ylabel("max / mean tokens per rank")
        axes[1].set_title(f"EPLB, skewed router, {eplb['redundant_experts']} redundant experts")
    fig.suptitle("Qwen3-30B-A3B shape, 2 x H200, bf16")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/cuda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--parts", nargs="+", default=["exchange", "serve", "eplb"])
    parser.add_argument("--layers", type=int, default=QWEN3_30B_A3B["num_hidden_layers"])
    parser.add_argument("--requests", type=int, default=256)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    result: dict = {"config": QWEN3_30B_A3B, "layers": args.layers, "gpus": 2,
                    "gpu": torch.cuda.get_device_name(0)}
    if "exchange" in args.parts:
        result["exchange"] = run_exchange()
        print(json.dumps(result["exchange"], indent=1), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(os.path.join(tmp, "model"), args.layers)
        if "serve" in args.parts:
            requests = 32 if args.quick else args.requests
            result["serve"] = {name: serve_one(path, extra, requests, tmp)
                               for name, extra in (("ep", ["--ep"]), ("replicas", ["--no-ep"]))}
            print(json.dumps(result["serve"], indent=1), flush=True)
        if "eplb" in args.parts:
            result["eplb"] = run_eplb(path, 16, 16 if args.quick else 48)
            print(json.dumps(result["eplb"], indent=1), flush=True)
    name = "ep" if not args.quick else "ep_quick"
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    plot(result, os.path.join(args.out, f"{name}.png"))


if __name__ == "__main__":
    main()
