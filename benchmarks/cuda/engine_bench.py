"""DeepInfer's CUDA backend vs transformers on one GPU, in one run (the H200 numbers in
docs/benchmarks.md). Model: the Llama-3-8B shape with random bf16 weights made on the device.

    python benchmarks/cuda/engine_bench.py --out results/  [--skip-hf] [--quick]
        [--quantization fp8]   (the weights quantized to FP8 at load: cuda_engine_fp8.json)

Measures, each with its ceiling:
  - device ceilings: device-to-device copy bandwidth, bf16 GEMM rate;
  - batch-1 decode tok/s vs the roofline (weight bytes / measured bandwidth);
  - 256 requests x (512 in + 128 out) submitted at once: output tok/s;
  - one 8192-token prefill: tok/s;
and the same three for transformers' generate / generate_batch / forward.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from common import save_word_tokenizer  # noqa: E402

from deepinfer.backends.cuda.timing import cuda_times_ms  # noqa: E402
from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig  # noqa: E402
from deepinfer.core.engine import Engine  # noqa: E402
from deepinfer.core.sampling import SamplingParams  # noqa: E402

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                 max_position_embeddings=16384, rope_theta=500000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001)


def write_config(path: str, layers: int, max_len: int = LLAMA3_8B["max_position_embeddings"]
                 ) -> str:
    import transformers

    config = transformers.LlamaConfig(**{**LLAMA3_8B, "num_hidden_layers": layers,
                                         "max_position_embeddings": max_len})
    config.torch_dtype = "bfloat16"
    config.save_pretrained(path)
    return path


def ceilings() -> dict:
    """Measured device-to-device bandwidth (bytes read + written) and bf16 GEMM rate."""
    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    times = _time_cuda(lambda: dst.copy_(src), reps=20)
    bandwidth = 2 * src.numel() * 2 / statistics.median(times)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm = statistics.median(_time_cuda(lambda: a @ b, reps=20))
    src = dst = a = b = None  # freed before the model loads
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": bandwidth, "bf16_gemm_flops": 2 * 8192 ** 3 / gemm,
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}


def _time_cuda(fn, reps: int, warmup: int = 3) -> list[float]:
    """Seconds of each call."""
    return [ms / 1e3 for ms in cuda_times_ms(fn, reps, warmup)]


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, vocab - 1000, (n, length), generator=g).tolist()


# ---- DeepInfer ---------------------------------------------------------------------------
def make_engine(path: str, max_len: int, util: float, quantization: str = "auto") -> Engine:
    config = EngineConfig(
        model=ModelSpec(path, dtype="bfloat16", max_model_len=max_len, load_format="dummy",
                        quantization=quantization),
        cache=CacheConfig(gpu_memory_utilization=util),
        scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256),
        accelerator="nvidia")
    return Engine(config, load_tokenizer=False)


def run_all(engine: Engine, prompts: list[list[int]], max_tokens: int,
            prefix_cache: bool = False) -> tuple[float, list[float]]:
    """Submit everything at once, step to completion; (seconds, per-step wall times)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params, prefix_cache=prefix_cache)
    torch.cuda.synchronize()
    steps, start = [], time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    return time.perf_counter() - start, steps


def prefill_8k(engine: Engine, vocab: int, reps: int = 5) -> float:
    """Median seconds of an 8192-token prompt's prefill (and its one sampled token)."""
    prefill = []
    for rep in range(reps):
        # The whole run, not its first step: under async scheduling a step returns once the
        # next is launched, before the GPU has finished it.
        seconds, _ = run_all(engine, random_prompts(1, 8192, vocab, 10 + rep), 1)
        prefill.append(seconds)
    return statistics.median(prefill)


def prefill_attention_ab(engine: Engine, vocab: int) -> dict:
    """The 8K prefill with each attention for a fresh prompt (DEEPINFER_CUDA_SDPA_PREFILL's
    choices: "0" the paged Triton kernel, else SDPA backends), then the default again."""
    from deepinfer.backends.cuda.ops import sdpa_backends

    ops = engine.accelerator.runner.ops
    default, rates = ops.sdpa_backends, {}
    for name in ("0", "FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        ops.sdpa_backends = sdpa_backends(name)
        refused = ops.sdpa_backends and _sdpa_refuses(ops.sdpa_backends)
        rates[name] = refused or 8192 / prefill_8k(engine, vocab, reps=3)
    ops.sdpa_backends = default
    return rates


def _sdpa_refuses(backends: tuple) -> str | None:
    """Why these SDPA backends refuse the model's attention (GQA, bf16, D=128), or None."""
    from torch.nn.attention import sdpa_kernel

    q = torch.randn(1, 32, 256, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, 8, 256, 128, dtype=torch.bfloat16, device="cuda")
    try:
        with sdpa_kernel(list(backends), set_priority=True):
            torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True,
                                                             enable_gqa=True)
    except RuntimeError as exc:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None


def bench_ours(path: str, vocab: int, quick: bool, quantization: str = "auto") -> dict:
    engine = make_engine(path, max_len=16384, util=0.85, quantization=quantization)
    out: dict = {"kv_blocks": engine.kv.pool.num_usable}
    run_all(engine, random_prompts(4, 600, vocab, 1), 16)  # warm-up: compile every kernel
    decode_tokens = 64 if quick else 256
    _, steps = run_all(engine, random_prompts(1, 512, vocab, 2), decode_tokens + 1)
    out["batch1_decode_step_s"] = statistics.median(steps[1:])
    out["batch1_decode_tok_s"] = 1.0 / out["batch1_decode_step_s"]
    n_req = 32 if quick else 256
    seconds, steps = run_all(engine, random_prompts(n_req, 512, vocab, 3), 128)
    out["batch256_requests"] = n_req
    out["batch256_seconds"] = seconds
    out["batch256_output_tok_s"] = n_req * 128 / seconds
    out["batch256_steps"] = len(steps)
    out["prefill8k_s"] = prefill_8k(engine, vocab)
    out["prefill8k_tok_s"] = 8192 / out["prefill8k_s"]
    out["prefill8k_tok_s_by_attention"] = prefill_attention_ab(engine, vocab)
    weights = engine.accelerator.memory_stats().weights_bytes
    out["weights_bytes"] = weights
    engine.shutdown()
    del engine
    torch.cuda.empty_cache()
    return out


# ---- transformers ------------------------------------------------------------------------
def bench_hf(path: str, vocab: int, quick: bool) -> dict:
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    out: dict = {"transformers": transformers.__version__}
    prompt = torch.tensor(random_prompts(1, 512, vocab, 2), device="cuda")
    new = 32 if quick else 128

    def gen(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    gen(2)
    one, full = statistics.median(gen(1) for _ in range(3)), gen(new + 1)
    out["generate_decode_tok_s"] = new / (full - one)

    with torch.inference_mode():
        ids = torch.tensor(random_prompts(1, 8192, vocab, 10), device="cuda")
        model(ids, logits_to_keep=1)
        times = _time_cuda(lambda: model(ids, logits_to_keep=1), reps=5, warmup=1)
    out["prefill8k_tok_s"] = 8192 / statistics.median(times)

    n_req = 32 if quick else 256
    gen_cfg = transformers.GenerationConfig(max_new_tokens=128, min_new_tokens=128,
                                            do_sample=False, eos_token_id=None, pad_token_id=0)
    inputs = random_prompts(n_req, 512, vocab, 3)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    results = model.generate_batch(inputs=inputs, generation_config=gen_cfg, progress_bar=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    generated = sum(len(r.generated_tokens) for r in results.values())
    out["generate_batch_seconds"] = seconds
    out["generate_batch_output_tok_s"] = generated / seconds
    out["generate_batch_tokens"] = generated
    model = None  # freed before the next measurement
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--quick", action="store_true", help="fewer requests and tokens")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--quantization", default="auto", choices=("auto", "fp8"))
    parser.add_argument("--write-model", metavar="DIR",
                        help="only write the config and a word-level tokenizer to DIR (a model "
                             "for deepinfer-serve --load-format dummy) and print DIR")
    parser.add_argument("--max-len", type=int, default=LLAMA3_8B["max_position_embeddings"],
                        help="max_position_embeddings of --write-model's config")
    args = parser.parse_args()
    if args.write_model:
        write_config(args.write_model, args.layers, args.max_len)
        save_word_tokenizer(args.write_model, LLAMA3_8B["vocab_size"], LLAMA3_8B["eos_token_id"])
        print(args.write_model)
        return
    os.makedirs(args.out, exist_ok=True)
    result: dict = {"model": {**LLAMA3_8B, "num_hidden_layers": args.layers}}
    result["ceilings"] = ceilings()
    print("ceilings", result["ceilings"], flush=True)
    with tempfile.TemporaryDirectory() as path:
        write_config(path, args.layers)
        result["deepinfer"] = bench_ours(path, LLAMA3_8B["vocab_size"], args.quick,
                                         args.quantization)
        result["quantization"] = args.quantization
        print("deepinfer", result["deepinfer"], flush=True)
        if not args.skip_hf:
            result["hf"] = bench_hf(path, LLAMA3_8B["vocab_size"], args.quick)
            print("hf", result["hf"], flush=True)
    summarize(result)
    name = "cuda_engine.json" if args.quantization == "auto" else "cuda_engine_fp8.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(result, f, indent=2)
    print_table(result)


def summarize(result: dict) -> None:
    ours, ceil = result["deepinfer"], result["ceilings"]
    roofline = ceil["copy_bytes_per_s"] / ours["weights_bytes"]
    ours["decode_roofline_tok_s"] = roofline
    ours["decode_pct_of_roofline"] = 100 * ours["batch1_decode_tok_s"] / roofline
    # FLOP ceiling of the batch workload: every prompt and output token through the weights.
    m = result["model"]
    h, f, layers = m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"]
    kv = h // m["num_attention_heads"] * m["num_key_value_heads"]
    per_token = 2 * layers * (h * (h + 2 * kv) + h * h + 3 * h * f)
    n = ours["batch256_requests"]
    flops = per_token * n * (512 + 128) + 2 * h * m["vocab_size"] * n * 128
    ours["batch256_flop_bound_output_tok_s"] = n * 128 / (flops / ceil["bf16_gemm_flops"])
    attn = 2 * 2 * layers * h * 8192 * 8192 / 2
    ours["prefill8k_flop_bound_tok_s"] = 8192 / ((per_token * 8192 + attn)
                                                 / ceil["bf16_gemm_flops"])


def print_table(result: dict) -> None:
    ours, hf = result["deepinfer"], result.get("hf", {})
    rows = [
        ("batch-1 decode tok/s", ours["batch1_decode_tok_s"], hf.get("generate_decode_tok_s"),
         ours["decode_roofline_tok_s"]),
        (f"{ours['batch256_requests']}x(512+128) output tok/s", ours["batch256_output_tok_s"],
         hf.get("generate_batch_output_tok_s"), ours["batch256_flop_bound_output_tok_s"]),
        ("8K prefill tok/s", ours["prefill8k_tok_s"], hf.get("prefill8k_tok_s"),
         ours["prefill8k_flop_bound_tok_s"]),
    ]
    print(f"{'scenario':32s} {'deepinfer':>10s} {'hf':>10s} {'ratio':>7s} "
          f"{'ceiling':>10s} {'%ceil':>6s}")
    for name, a, b, c in rows:
        ratio = f"{a / b:.1f}x" if b else "-"
        print(f"{name:32s} {a:10.1f} {b or 0:10.1f} {ratio:>7s} {c:10.1f} {100 * a / c:5.1f}%")
    for name, rate in ours.get("prefill8k_tok_s_by_attention", {}).items():
        label = "paged Triton kernel" if name == "0" else f"SDPA {name}"
        shown = f"{rate:10.1f}" if isinstance(rate, float) else f"refused: {rate}"
        print(f"  8K prefill, fresh-prompt attention {label}: {shown}")


if __name__ == "__main__":
    main()
