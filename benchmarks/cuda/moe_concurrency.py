"""MoE models at serving concurrency on one GPU, each run against its bound from the same lease's
own GEMM and copy rates (random weights made on the device, `load_format="dummy"`).

    python benchmarks/cuda/moe_concurrency.py --shape qwen3_30b_a3b --out DIR
        [--quantization fp8] [--workloads batch1,batch32,batch256,mixed] [--layers N]
        [--max-num-seqs N] [--max-num-batched-tokens N]   (unset: the backend's defaults)
        [--server]   (then the same workloads through deepinfer-serve, streamed)
    python benchmarks/cuda/moe_concurrency.py --shape S --profile   (time by kernel of one
        256-row decode step and one mixed step: 256 decode rows + a prefill chunk)
    python benchmarks/cuda/moe_concurrency.py --plot DIR   (moe_concurrency.png from the JSONs)
    python benchmarks/cuda/moe_concurrency.py --rebound DIR   (their bounds again, then the plot)

Shapes: llama3_8b (the dense reference), qwen3_30b_a3b (128 experts top-8), deepseek_v2_lite
(MLA, 64 routed + 2 shared top-6), deepseek_v3 (V3's widths, MLA, 256 routed top-8 + 1 shared;
--layers of them, as many as fit; FP8 with --quantization fp8).

Workloads, greedy with EOS ignored, every request submitted through Engine.add_request:
  batchN   N x (512 prompt + 128 output) submitted at once (batch1: one request).
  mixed    1,024 requests, log-normal prompt lengths (median 600) and output lengths (median
           180), 256 closed-loop clients: a finished request's client submits the next.
Through the server (--server) the same requests are streamed by 256 closed-loop clients spread
over CLIENT_PROCESSES processes. Offline, each workload first runs once untimed with 2-token
outputs (warm_up), so that the timed run finds its kernels compiled.

The bound of a run is its prefill FLOPs (2 x active parameters x prompt tokens, plus causal
attention) at the measured GEMM rate (FP8 weights: the FP8 rate) plus, for each decode step it
needs, the bytes that step must read (the dense weights, each MoE layer's experts that the
step's rows hit in expectation under uniform routing, the KV of every row's context) at the
measured copy rate; with --quantization fp8 the decoder layers' weights count one byte each,
the lm_head and MLA's kv_b_proj halves two (they stay bf16, as in DeepSeek's checkpoints). A
run at capacity needs ceil(outputs / 256) such steps at 256 rows. The JSON also records what
bounds the engine itself: its KV pool in tokens, the most requests it ran at once, and the
preemptions.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import glob
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from common import (  # noqa: E402
    free_port,
    pyplot,
    save_word_tokenizer,
    start_server,
    stop_server,
    wait_healthy,
    write_json,
)
from engine_bench import LLAMA3_8B, _time_cuda, ceilings, random_prompts  # noqa: E402
from moe_engine_bench import QWEN3_30B_A3B  # noqa: E402
from profile_v4 import device_profile  # noqa: E402
from stream_clients import closed_loop  # noqa: E402

from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig  # noqa: E402
from deepinfer.core.engine import Engine  # noqa: E402
from deepinfer.core.sampling import SamplingParams  # noqa: E402

V2_LITE = dict(
    hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
    num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
    qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=102400,
    max_position_embeddings=16384, first_k_dense_replace=1, n_routed_experts=64,
    n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1, norm_topk_prob=False,
    routed_scaling_factor=1.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    bos_token_id=100000, eos_token_id=100001)
V3 = dict(
    hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=4,
    num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
    qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=129280,
    max_position_embeddings=16384, first_k_dense_replace=1, n_routed_experts=256,
    n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, norm_topk_prob=True,
    routed_scaling_factor=2.5, rms_norm_eps=1e-6, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=1)
SHAPES = {"llama3_8b": ("LlamaConfig", LLAMA3_8B),
          "qwen3_30b_a3b": ("Qwen3MoeConfig", QWEN3_30B_A3B),
          "deepseek_v2_lite": ("DeepseekV3Config", V2_LITE),
          "deepseek_v3": ("DeepseekV3Config", V3)}
PROMPT, OUTPUT, CLIENTS, MIXED_REQUESTS = 512, 128, 256, 1024
MIXED_PROMPT, MIXED_OUTPUT = 600, 180  # medians of the mixed workload's log-normal lengths
MAX_MODEL_LEN = 16384
CLIENT_PROCESSES = 8  # the server's clients: 32 streams a process at 256


@dataclasses.dataclass(frozen=True)
class Shape:
    """Parameter counts of a config, split as a decode step reads them."""
    dense: float  # parameters every token reads (attention, dense MLPs, shared experts, norms)
    expert: float  # parameters of one routed expert
    experts: int  # routed experts per MoE layer
    top_k: int
    moe_layers: int
    lm_head: float
    kv_values: float  # cached values per token, all layers
    attn_dims: float  # layers x heads x (q.k dim + v dim): causal attention FLOPs per pair
    # Of `dense`, the parameters --quantization fp8 keeps in bf16 (MLA's kv_b_proj halves, as
    # DeepSeek's FP8 checkpoints do); the lm_head stays bf16 as well.
    float_dense: float = 0.0

    def active(self) -> float:
        """Parameters one token multiplies (the embedding row is a lookup, left out)."""
        return self.dense + self.lm_head + self.moe_layers * self.top_k * self.expert

    def step_params(self, rows: int) -> float:
        """Parameters a decode step of `rows` rows reads: the experts hit in expectation."""
        hit = self.experts * (1 - (1 - self.top_k / self.experts) ** rows) if self.experts else 0
        return self.dense + self.lm_head + self.moe_layers * hit * self.expert

    def step_bytes(self, rows: int, weight_bytes: float) -> float:
        """Bytes of the weights a decode step of `rows` rows reads; weight_bytes 1 (FP8) for
        the quantized ones, 2 for what stays bf16."""
        kept = self.lm_head + self.float_dense
        return (self.step_params(rows) - kept) * weight_bytes + kept * 2


def shape_of(c: dict) -> Shape:
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    heads = c["num_attention_heads"]
    if "kv_lora_rank" in c:  # MLA
        q = h * heads * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"]) if not c["q_lora_rank"] \
            else h * c["q_lora_rank"] + c["q_lora_rank"] * heads * (c["qk_nope_head_dim"] +
                                                                     c["qk_rope_head_dim"])
        kv = h * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) + c["kv_lora_rank"] * heads * (
            c["qk_nope_head_dim"] + c["v_head_dim"])
        attention = q + kv + heads * c["v_head_dim"] * h
        kv_values = layers * (c["kv_lora_rank"] + c["qk_rope_head_dim"])
        float_dense = layers * c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] +
                                                            c["v_head_dim"])
        attn_dims = layers * heads * (c["kv_lora_rank"] * 2 + c["qk_rope_head_dim"])
        dense_layers = c["first_k_dense_replace"]
        experts, top_k = c["n_routed_experts"], c["num_experts_per_tok"]
        shared = c["n_shared_experts"] * 3 * h * c["moe_intermediate_size"]
        router = experts * h
    else:
        d = c.get("head_dim") or h // heads
        attention = h * (heads + 2 * c["num_key_value_heads"]) * d + heads * d * h
        kv_values = layers * 2 * c["num_key_value_heads"] * d
        attn_dims = layers * heads * 2 * d
        experts, top_k = c.get("num_experts", 0), c.get("num_experts_per_tok", 0)
        dense_layers = 0 if experts else layers
        shared, router = 0, experts * h
        float_dense = 0
    moe_layers = layers - dense_layers
    expert = 3 * h * c.get("moe_intermediate_size", 0)
    dense = layers * attention + dense_layers * 3 * h * c["intermediate_size"] + \
        moe_layers * (shared + router)
    return Shape(dense, expert, experts, top_k, moe_layers, c["vocab_size"] * h, kv_values,
                 attn_dims, float_dense)


def gemm_rates() -> dict:
    """The bf16 rate (engine_bench.ceilings) and the FP8 rate of an 8192^3 scaled_mm."""
    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    seconds = statistics.median(_time_cuda(
        lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), reps=20))
    return {"fp8_gemm_flops": 2 * 8192 ** 3 / seconds}


# ---- workloads -----------------------------------------------------------------------------
@dataclasses.dataclass
class Run:
    prompts: list[int] = dataclasses.field(default_factory=list)  # prompt lengths
    outputs: list[int] = dataclasses.field(default_factory=list)  # output lengths
    seconds: float = 0.0
    steps: int = 0
    most_running: int = 0
    decode_steps: list[float] = dataclasses.field(default_factory=list)


def fixed(engine: Engine, n: int, vocab: int, seed: int) -> Run:
    """n x (PROMPT + OUTPUT) submitted at once."""
    run = Run([PROMPT] * n, [OUTPUT] * n)
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(n, PROMPT, vocab, seed)):
        engine.add_request(f"f{seed}-{i}", prompt, params, prefix_cache=False)
    _drain(engine, run, lambda: None)
    return run


def mixed(engine: Engine, vocab: int, seed: int, requests: int = MIXED_REQUESTS) -> Run:
    """The first `requests` of MIXED_REQUESTS log-normal requests kept CLIENTS in flight
    (closed loop)."""
    rng = random.Random(seed)
    prompts, outputs = _mixed_lengths(rng)
    prompts, outputs = prompts[:requests], outputs[:requests]
    requests = len(prompts)
    run, queue = Run(prompts, outputs), list(range(requests))[::-1]

    def submit() -> None:
        while queue and len(engine.scheduler.running) + len(engine.scheduler.waiting) < CLIENTS:
            i = queue.pop()
            ids = [rng.randrange(vocab // 8, vocab - vocab // 8) for _ in range(prompts[i])]
            params = SamplingParams(temperature=0.0, max_tokens=outputs[i], ignore_eos=True)
            engine.add_request(f"m{seed}-{i}", ids, params, prefix_cache=False)

    submit()
    _drain(engine, run, submit)
    return run


def workload_lengths(name: str) -> tuple[list[int], list[int]]:
    """A workload's (prompt lengths, output lengths), as its runs submit them."""
    if name == "mixed":
        return _mixed_lengths(random.Random(1))
    return [PROMPT] * int(name[5:]), [OUTPUT] * int(name[5:])


def _mixed_lengths(rng: random.Random) -> tuple[list[int], list[int]]:
    """MIXED_REQUESTS (prompt, output) lengths, each log-normal around its median."""
    prompts = [min(8192, max(16, round(rng.lognormvariate(math.log(MIXED_PROMPT), 0.7))))
               for _ in range(MIXED_REQUESTS)]
    outputs = [min(1024, max(8, round(rng.lognormvariate(math.log(MIXED_OUTPUT), 0.7))))
               for _ in range(MIXED_REQUESTS)]
    return prompts, outputs


def _only_decodes(engine: Engine) -> bool:
    """Whether the next step decodes only: nothing waits and every prompt is prefilled."""
    return not engine.scheduler.waiting and all(
        r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running)


def _drain(engine: Engine, run: Run, refill) -> None:
    torch.cuda.synchronize()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        decode = _only_decodes(engine)
        t0 = time.perf_counter()
        engine.step()
        if decode:
            run.decode_steps.append(time.perf_counter() - t0)
        run.steps += 1
        run.most_running = max(run.most_running, len(engine.scheduler.running))
        refill()
    torch.cuda.synchronize()
    run.seconds = time.perf_counter() - start


# ---- bound ---------------------------------------------------------------------------------
def bound_seconds(run: Run, shape: Shape, device: dict, weight_bytes: float,
                  most_rows: int | None = None) -> dict:
    """The run's time at the lease's rates, every decode step at up to most_rows rows."""
    rate = device["fp8_gemm_flops" if weight_bytes == 1 else "bf16_gemm_flops"]
    flops = sum(2 * shape.active() * p + 2 * shape.attn_dims * p * p / 2 for p in run.prompts)
    prefill = flops / rate
    rows = max(1, min(most_rows or CLIENTS, CLIENTS, len(run.outputs)))
    steps = math.ceil(sum(o - 1 for o in run.outputs) / rows)
    kv_bytes = 2 * shape.kv_values * sum(o * p + o * o / 2 for p, o in zip(run.prompts,
                                                                            run.outputs))
    decode = (steps * shape.step_bytes(rows, weight_bytes) + kv_bytes) / \
        device["copy_bytes_per_s"]
    return {"prefill_s": prefill, "decode_s": decode, "seconds": prefill + decode,
            "decode_steps": steps, "rows": rows}


def bounds(run: Run, shape: Shape, device: dict, weight_bytes: float, kv_tokens: int) -> dict:
    """The run's bound and its share, and the same at the rows the KV pool holds at once."""
    bound = bound_seconds(run, shape, device, weight_bytes)
    # Where the KV pool cannot hold CLIENTS requests' whole contexts, no engine runs that many.
    context = statistics.mean(p + o for p, o in zip(run.prompts, run.outputs))
    capacity = bound_seconds(run, shape, device, weight_bytes, int(kv_tokens // context))
    return {"bound": bound, "bound_output_tok_s": sum(run.outputs) / bound["seconds"],
            "share_of_bound": bound["seconds"] / run.seconds,
            "bound_at_kv_capacity": capacity,
            "share_of_bound_at_kv_capacity": capacity["seconds"] / run.seconds}


def report(name: str, run: Run, shape: Shape, device: dict, weight_bytes: float,
           kv_tokens: int) -> dict:
    outputs = sum(run.outputs)
    out = {"requests": len(run.outputs), "prompt_tokens": sum(run.prompts),
           "output_tokens": outputs, "seconds": run.seconds,
           "output_tok_s": outputs / run.seconds, "steps": run.steps,
           "most_running": run.most_running,
           **bounds(run, shape, device, weight_bytes, kv_tokens)}
    capacity = out["bound_at_kv_capacity"]
    if run.decode_steps:
        out["median_decode_step_s"] = statistics.median(run.decode_steps)
        out["decode_steps"] = len(run.decode_steps)
    print(f"{name}: {out['output_tok_s']:,.0f} out tok/s, bound {out['bound_output_tok_s']:,.0f}"
          f" ({out['share_of_bound']:.0%}; {capacity['rows']} rows fit the KV pool: "
          f"{out['share_of_bound_at_kv_capacity']:.0%}), {run.steps} steps, at most "
          f"{run.most_running} running", flush=True)
    return out


# ---- through the server --------------------------------------------------------------------
def serve_workloads(args: argparse.Namespace, path: str, values: dict, names: list[str]
                    ) -> tuple[dict, dict]:
    """The workloads through deepinfer-serve (the same engine flags), streamed by closed-loop
    clients: (Runs by workload, the server's start)."""
    vocab = values["vocab_size"]
    save_word_tokenizer(path, vocab, values["eos_token_id"])
    port = free_port()
    flags = ["--model", path, "--load-format", "dummy", "--dtype", "bfloat16",
             "--max-model-len", str(MAX_MODEL_LEN), "--quantization", args.quantization,
             "--gpu-memory-utilization", str(args.gpu_memory_utilization),
             "--served-model-name", "m", "--port", str(port), "--no-prefix-caching",
             "--accelerator", args.accelerator]
    for flag, value in (("--max-num-seqs", args.max_num_seqs),
                        ("--max-num-batched-tokens", args.max_num_batched_tokens)):
        flags += [flag, str(value)] if value else []
    log_path = os.path.join(args.out, f"{args.shape}_server.log")
    os.makedirs(args.out, exist_ok=True)
    server = start_server([sys.executable, "-m", "deepinfer.serve.cli", *flags], log_path)
    try:
        base = f"http://127.0.0.1:{port}"
        started = wait_healthy(server, base, log_path, timeout_s=900)
        _clients(base, [[PROMPT] * 8, [OUTPUT] * 8], 8, vocab)  # warm-up
        runs = {}
        for name in names:
            run = _clients(base, workload_lengths(name), CLIENTS, vocab)
            runs[name] = run
            print(f"server {name}: {sum(run.outputs) / run.seconds:,.0f} out tok/s", flush=True)
        return runs, {"start_s": started}
    finally:
        stop_server(server)


def _clients(base: str, lengths: list[list[int]], clients: int, vocab: int) -> Run:
    """Every request (prompt length, output length) streamed, `clients` at a time from
    CLIENT_PROCESSES processes (stream_clients.py: one process would time itself)."""
    prompts, outputs = lengths
    rng = random.Random(2)
    ids = [[rng.randrange(vocab // 8, vocab - vocab // 8) for _ in range(n)] for n in prompts]
    seconds, got = closed_loop(base, "m", ids, list(outputs), clients, CLIENT_PROCESSES)
    if got != list(outputs):
        raise RuntimeError(f"the server gave {sum(got)} tokens, {sum(outputs)} were asked for")
    return Run(list(prompts), list(outputs), seconds)


# ---- kernel breakdown ----------------------------------------------------------------------
def profile_steps(engine: Engine, vocab: int) -> dict:
    """Device time by kernel of one CLIENTS-row decode step (the mean of 5) and of one mixed
    step: CLIENTS decode rows and a prefill chunk filling the token budget."""
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(CLIENTS, PROMPT, vocab, 7)):
        engine.add_request(f"d{i}", prompt, params, prefix_cache=False)
    while not _only_decodes(engine):
        engine.step()
    for _ in range(3):
        engine.step()
    out = {"decode": _kernels(engine, 5)}
    # A seat for the long prompt: with every decode row running, max_num_seqs would keep it
    # waiting and the "mixed" step would be one more decode step.
    rows = len(engine.scheduler.running)
    if rows >= engine.scheduler.max_num_seqs:
        engine.abort(engine.scheduler.running[0].request_id)
        rows -= 1
    chunk = engine.config.scheduler.step_tokens - rows
    engine.add_request("long", random_prompts(1, chunk, vocab, 8)[0],
                       SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                       prefix_cache=False)
    out["mixed"] = _kernels(engine, 1)
    if not engine.last_step_prefilled:
        raise RuntimeError("the profiled mixed step ran no prompt chunk")
    out["mixed"]["prefill_tokens"], out["mixed"]["decode_rows"] = chunk, rows
    while engine.has_unfinished_requests():
        engine.step()
    return out


def _kernels(engine: Engine, steps: int) -> dict:
    torch.cuda.synchronize()
    out = device_profile(engine, steps)
    total = sum(r["us_per_step"] for r in out["top"])
    for row in out["top"]:
        row["share_of_top"] = row["us_per_step"] / total
    return out


# ---- main ----------------------------------------------------------------------------------
def write_config(path: str, name: str, layers: int | None) -> dict:
    import transformers

    cls, base = SHAPES[name]
    values = {**base, **({"num_hidden_layers": layers} if layers else {})}
    config = getattr(transformers, cls)(**values)
    config.torch_dtype = "bfloat16"
    config.save_pretrained(path)
    return values


def make_engine(path: str, args: argparse.Namespace) -> Engine:
    limits = {k: v for k, v in (("max_num_seqs", args.max_num_seqs),
                                ("max_num_batched_tokens", args.max_num_batched_tokens)) if v}
    config = EngineConfig(
        model=ModelSpec(path, dtype="bfloat16", max_model_len=MAX_MODEL_LEN, load_format="dummy",
                        quantization=args.quantization),
        cache=CacheConfig(gpu_memory_utilization=args.gpu_memory_utilization),
        # The breakdown times one step at a time: no step launched while the last one runs.
        scheduler=SchedulerConfig(**limits, async_scheduling=not args.profile),
        accelerator=args.accelerator)
    return Engine(config, load_tokenizer=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES))
    p.add_argument("--out", default="benchmarks/results/cuda/moe_concurrency")
    p.add_argument("--quantization", default="auto", choices=("auto", "fp8"))
    p.add_argument("--workloads", default="batch1,batch32,batch256,mixed")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--tag", default="", help="added to the JSON's name")
    p.add_argument("--profile", action="store_true",
                   help="instead of the workloads: device time by kernel of a 256-row decode "
                        "step and of a mixed step (<shape>_profile.json)")
    p.add_argument("--server", action="store_true",
                   help="also run the workloads through deepinfer-serve (streamed, closed loop)")
    p.add_argument("--accelerator", default="nvidia", help=argparse.SUPPRESS)
    p.add_argument("--plot", metavar="DIR", help="only plot the JSONs in DIR")
    p.add_argument("--rebound", metavar="DIR",
                   help="only compute the bounds of the JSONs in DIR again, then plot them")
    args = p.parse_args()
    if args.rebound:
        rebound(args.rebound)
        return plot(args.rebound)
    if args.plot:
        return plot(args.plot)
    if not args.shape:
        p.error("--shape is required")
    device = {**ceilings(), **gemm_rates()}
    with tempfile.TemporaryDirectory() as tmp:
        values = write_config(tmp, args.shape, args.layers)
        result = offline(args, tmp, values, device)
        if args.server and not args.profile:  # the offline engine's memory is free by now
            runs, result["server_start"] = serve_workloads(args, tmp, values,
                                                           list(result["workloads"]))
            result["server"] = {name: report(f"server {name}", run, shape_of(values), device,
                                             _weight_bytes(args), result["kv_pool_tokens"])
                                for name, run in runs.items()}
            for name, served in result["server"].items():
                served["over_offline"] = served["output_tok_s"] / \
                    result["workloads"][name]["output_tok_s"]
    os.makedirs(args.out, exist_ok=True)
    name = f"{args.shape}{'_fp8' if args.quantization == 'fp8' else ''}{args.tag}.json"
    write_json(os.path.join(args.out, name), result)


def _weight_bytes(args: argparse.Namespace) -> float:
    return 1.0 if args.quantization == "fp8" else 2.0


def offline(args: argparse.Namespace, path: str, values: dict, device: dict) -> dict:
    """The workloads (or the kernel breakdown) through Engine.step in this process."""
    engine = make_engine(path, args)
    shape = shape_of(values)
    sched = engine.scheduler
    result = {"shape": args.shape, "config": values, "quantization": args.quantization,
              "device": device, "max_num_seqs": sched.max_num_seqs,
              "max_num_batched_tokens": sched.config.max_num_batched_tokens,
              "kv_pool_tokens": engine.kv.pool.num_usable * engine.kv.block_size,
              "weights_bytes": engine.accelerator.memory_stats().weights_bytes,
              "active_params": shape.active(), "workloads": {}}
    vocab = values["vocab_size"]
    if args.profile:
        fixed(engine, 8, vocab, 0)  # warm-up (the workloads warm up one by one: warm_up)
        args.tag += "_profile"
        result["profile"] = profile_steps(engine, vocab)
    for w in [] if args.profile else args.workloads.split(","):
        warm_up(engine, w, vocab)
        preempted = sched.num_preemptions
        run = mixed(engine, vocab, 1) if w == "mixed" else fixed(engine, int(w[5:]), vocab, 1)
        result["workloads"][w] = report(w, run, shape, device, _weight_bytes(args),
                                        result["kv_pool_tokens"])
        result["workloads"][w]["preemptions"] = sched.num_preemptions - preempted
    engine.shutdown()
    del engine, sched
    gc.collect()
    torch.cuda.empty_cache()
    return result


def warm_up(engine: Engine, workload: str, vocab: int) -> None:
    """The workload once, untimed (mixed: its first CLIENTS requests), so that a machine's
    first process times what the next ones do: kernels compiled, caches and pools grown. With
    2-token outputs a first process still ran slower (docs/benchmarks.md)."""
    if workload == "mixed":
        mixed(engine, vocab, 2, requests=CLIENTS)
    else:
        fixed(engine, int(workload[5:]), vocab, 2)


def rebound(folder: str) -> None:
    """Each JSON's bounds again, from its config, its lease's rates and its workloads' lengths
    (after a change to how a bound counts); the measured values stay as they were."""
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            result = json.load(f)
        shape = shape_of(result["config"])
        weight_bytes = 1.0 if result["quantization"] == "fp8" else 2.0
        for key in ("workloads", "server"):
            for name, out in result.get(key, {}).items():
                prompts, outputs = workload_lengths(name)
                run = Run(prompts, outputs, out["seconds"])
                out.update(bounds(run, shape, result["device"], weight_bytes,
                                  result["kv_pool_tokens"]))
        write_json(path, result)


def plot(folder: str) -> None:
    """Each run's share of its bound by workload: offline, and through the server where run."""
    results = [r for r in (json.load(open(f))
                           for f in sorted(glob.glob(os.path.join(folder, "*.json"))))
               if r.get("workloads")]
    plt = pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(11, 8), sharey=True)
    for ax, key, where in ((axes[0], "workloads", "offline (Engine.step)"),
                           (axes[1], "server", "through deepinfer-serve, streamed")):
        _bars(ax, [r for r in results if r.get(key)], key)
        ax.set_ylabel("% of the lease's bound")
        ax.set_title(f"{where} (labels: output tok/s)", fontsize=9)
    gpu = results[0]["device"]["gpu"] if results else ""
    fig.suptitle(f"MoE at concurrency, {gpu}")
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "moe_concurrency.png"), dpi=120)


def _bars(ax, results: list[dict], key: str) -> None:
    workloads = ["batch1", "batch32", "batch256", "mixed"]
    width = 0.8 / max(1, len(results))
    for i, r in enumerate(results):
        runs = r[key]
        shares = [runs.get(w, {}).get("share_of_bound", 0) * 100 for w in workloads]
        label = f"{r['shape']}{' fp8' if r['quantization'] == 'fp8' else ''}, " \
                f"{r['config']['num_hidden_layers']} layers, seqs {r['max_num_seqs']}"
        bars = ax.bar([x + i * width for x in range(len(workloads))], shares, width, label=label)
        for bar, w in zip(bars, workloads):
            tok_s = runs.get(w, {}).get("output_tok_s")
            if tok_s:
                ax.annotate(f"{tok_s:,.0f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=6, rotation=90)
    ax.set_xticks([x + width * (len(results) - 1) / 2 for x in range(len(workloads))], workloads)
    ax.legend(fontsize=7)

if __name__ == "__main__":
    main()
