"""Qwen3-30B-A3B shape on one H200 (random bf16 weights): our CUDA backend against
transformers' Qwen3MoeForCausalLM on the same config in the same run, with the active-bytes
roofline.

    python benchmarks/cuda/moe_engine_bench.py --out benchmarks/results/cuda [--quick] [--skip-hf]
        [--quantization fp8]   (every linear weight and expert FP8 at load: moe_engine_fp8.json)

A batch-1 decode step reads the weights every token needs (attention, norms, the router, the
LM head and the embedding row) plus its top-k experts in every layer: the "active" bytes. The
roofline is that traffic at the measured device bandwidth. At batch 32 the step reads the
experts any of the 32 tokens picked (expected count under uniform routing). Writes
moe_engine.json and moe_engine.png.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from common import peer_bars  # noqa: E402
from engine_bench import ceilings, random_prompts  # noqa: E402
from mla_bench import _decode  # noqa: E402  (median decode-only step of a batch)

from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig  # noqa: E402
from deepinfer.core.engine import Engine  # noqa: E402
from deepinfer.core.sampling import SamplingParams  # noqa: E402

QWEN3_30B_A3B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645)
CONTEXT, BATCHES, PREFILL = 512, (1, 32), 8192


def write_config(path: str, layers: int) -> str:
    import transformers

    config = transformers.Qwen3MoeConfig(**{**QWEN3_30B_A3B, "num_hidden_layers": layers})
    config.torch_dtype = "bfloat16"
    config.save_pretrained(path)
    return path


def active_bytes(batch: int, layers: int, layer_bytes: float = 2.0) -> float:
    """Bytes a decode step of `batch` tokens reads, experts at their expected count: the
    layers' weights at layer_bytes a value (1 for FP8, whose scales add ~3% and are left
    out), the LM head and the embedding row in bf16."""
    c = QWEN3_30B_A3B
    h, heads, kv, d = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], \
        c["head_dim"]
    attention = h * (heads + 2 * kv) * d + heads * d * h + 2 * d + 2 * h
    experts, k = c["num_experts"], c["num_experts_per_tok"]
    touched = experts * (1 - (1 - k / experts) ** batch)
    per_expert = 3 * h * c["moe_intermediate_size"]
    per_layer = attention + experts * h + touched * per_expert
    return layer_bytes * layers * per_layer + 2 * (c["vocab_size"] * h + batch * h)


# ---- DeepInfer ---------------------------------------------------------------------------
def bench_ours(path: str, quick: bool, async_scheduling: bool = True,
               quantization: str = "auto") -> dict:
    config = EngineConfig(
        model=ModelSpec(path, dtype="bfloat16", max_model_len=16384, load_format="dummy",
                        quantization=quantization),
        cache=CacheConfig(gpu_memory_utilization=0.85),
        scheduler=SchedulerConfig(max_num_batched_tokens=PREFILL, max_num_seqs=64,
                                  async_scheduling=async_scheduling),
        accelerator="nvidia")
    engine = Engine(config, load_tokenizer=False)
    vocab = QWEN3_30B_A3B["vocab_size"]
    out: dict = {"weights_bytes": engine.accelerator.memory_stats().weights_bytes}
    steps = 32 if quick else 128
    _decode(engine, random_prompts(4, 300, vocab, 0), 8)  # warm-up: compile every kernel
    for batch in BATCHES:
        step_s = _decode(engine, random_prompts(batch, CONTEXT, vocab, batch), steps)
        out[f"batch{batch}_tok_s"] = batch / step_s
    prefill_seconds(engine, random_prompts(1, PREFILL, vocab, 99)[0])  # warm-up at this size
    prompts = [random_prompts(1, PREFILL, vocab, s)[0] for s in range(3)]
    out["prefill_tok_s"] = PREFILL / min(prefill_seconds(engine, p) for p in prompts)
    engine.shutdown()
    torch.cuda.empty_cache()
    return out


def prefill_seconds(engine: Engine, prompt: list[int]) -> float:
    """Seconds of the steps that prefill the prompt (max_tokens 1). A step the engine failed
    (out of memory, ...) ends the request with an error: that is raised, not timed."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_request(f"p{time.monotonic_ns()}", prompt, params, prefix_cache=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    reasons = [o.finish_reason for _ in iter(engine.has_unfinished_requests, False)
               for o in engine.step() if o.finished]
    torch.cuda.synchronize()
    if reasons != ["length"]:
        raise RuntimeError(f"the prefill ended with {reasons} (see the engine's log)")
    return time.perf_counter() - t0


# ---- transformers ------------------------------------------------------------------------
def bench_hf(quick: bool, layers: int) -> dict:
    import transformers

    config = transformers.Qwen3MoeConfig(**{**QWEN3_30B_A3B, "num_hidden_layers": layers})
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = transformers.Qwen3MoeForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    out: dict = {"transformers": transformers.__version__}
    new = 8 if quick else 32
    for batch in BATCHES:
        ids = torch.tensor(random_prompts(batch, CONTEXT, config.vocab_size, batch),
                           device="cuda")
        gen = _hf_generate(model, ids)
        gen(2)
        one, full = statistics.median(gen(1) for _ in range(2)), gen(new + 1)
        out[f"batch{batch}_tok_s"] = batch * new / (full - one)
    out["prefill_tok_s"] = hf_prefill(model, PREFILL, config.vocab_size)
    del model
    torch.cuda.empty_cache()
    return out


def hf_prefill(model, n: int, vocab: int) -> float:
    """Tokens/s of one forward over an n-token random prompt (after a 512-token warm-up)."""
    ids = torch.tensor(random_prompts(1, n, vocab, 99), device="cuda")
    with torch.inference_mode():
        model(ids[:, :512])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(ids, logits_to_keep=1)
        torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def _hf_generate(model, ids: torch.Tensor):
    def gen(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                       min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    return gen


# ---- report ------------------------------------------------------------------------------
def roofline(result: dict, layers: int) -> dict:
    bandwidth = result["device"]["copy_bytes_per_s"]
    fp8 = result.get("quantization") == "fp8"
    out = {f"batch{b}_tok_s": b * bandwidth / active_bytes(b, layers, 1.0 if fp8 else 2.0)
           for b in BATCHES}
    c = QWEN3_30B_A3B
    flops_per_token = 2 * active_bytes(1, layers) / 2  # 2 FLOPs per active weight
    attention = 4 * c["num_attention_heads"] * c["head_dim"] * PREFILL / 2 * layers
    # FP8 projections at twice bf16's measured GEMM rate (the tensor cores' FP8 rate is
    # 1,979 vs 989 TFLOP/s dense); attention stays bf16.
    rate = result["device"]["bf16_gemm_flops"]
    out["prefill_tok_s"] = 1 / (flops_per_token / (rate * (2 if fp8 else 1)) + attention / rate)
    return out


def plot(result: dict, path: str) -> None:
    keys = [f"batch{b}_tok_s" for b in BATCHES] + ["prefill_tok_s"]
    labels = [f"decode b{b}" for b in BATCHES] + [f"{PREFILL // 1024}K prefill"]
    peer_bars(path, result, keys, labels, "tokens/s",
              f"Qwen3-30B-A3B shape ({result['layers']} layers), H200, "
              + ("FP8" if result.get("quantization") == "fp8" else "bf16") + " weights")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/cuda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--layers", type=int, default=QWEN3_30B_A3B["num_hidden_layers"])
    parser.add_argument("--compare-sync", action="store_true",
                        help="also run the engine with async scheduling off (ours_sync)")
    parser.add_argument("--no-async-scheduling", action="store_true",
                        help="run the engine with async scheduling off")
    parser.add_argument("--quantization", default="auto", choices=("auto", "fp8"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    result: dict = {"config": QWEN3_30B_A3B, "layers": args.layers, "context": CONTEXT,
                    "device": ceilings()}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_config(tmp, args.layers)
        result["ours"] = bench_ours(path, args.quick, not args.no_async_scheduling,
                                    args.quantization)
        result["quantization"] = args.quantization
        if args.compare_sync:
            gc.collect()  # the first engine's weights, cache and graphs (reference cycles)
            torch.cuda.empty_cache()
            result["ours_sync"] = bench_ours(path, args.quick, async_scheduling=False)
    result["hf"] = {} if args.skip_hf else bench_hf(args.quick, args.layers)
    result["ceiling"] = roofline(result, args.layers)
    for key in [f"batch{b}_tok_s" for b in BATCHES] + ["prefill_tok_s"]:
        ours, top = result["ours"][key], result["ceiling"][key]
        hf = result["hf"].get(key)
        sync = result.get("ours_sync", {}).get(key)
        print(f"{key:16s}: ours {ours:10.1f} = {ours / top:.0%} of the roofline {top:10.1f}"
              + (f"; transformers {hf:9.1f} (x{ours / hf:.1f})" if hf else "")
              + (f"; async scheduling off {sync:9.1f}" if sync else ""))
    name = "moe_engine" if args.quantization == "auto" else "moe_engine_fp8"
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    plot(result, os.path.join(args.out, f"{name}.png"))


if __name__ == "__main__":
    main()
