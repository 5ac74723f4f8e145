"""MLA decode on the H200: a dense model of DeepSeek-V2-Lite's width (MLA with a 512 + 64
latent, 16 heads, 27 layers, every layer dense) through our CUDA backend against transformers'
DeepseekV3ForCausalLM on the same config, in one run, with the bytes roofline.

    python benchmarks/cuda/mla_bench.py --out results/  [--quick]

Per decode step a sequence reads every weight once (shared by the batch) and its own latent
cache: layers x context x (kv_lora_rank + qk_rope_head_dim) x 2 bytes. The ceiling is that
traffic at the measured device bandwidth. Writes mla_decode.json and mla_decode.png.
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

from common import peer_bars  # noqa: E402
from engine_bench import ceilings, random_prompts  # noqa: E402

from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig  # noqa: E402
from deepinfer.core.engine import Engine  # noqa: E402
from deepinfer.core.sampling import SamplingParams  # noqa: E402

V2_LITE_DENSE = dict(
    hidden_size=2048, intermediate_size=10944, num_hidden_layers=27, num_attention_heads=16,
    num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64,
    qk_nope_head_dim=128, v_head_dim=128, vocab_size=102400, max_position_embeddings=16384,
    first_k_dense_replace=27, n_routed_experts=64, num_experts_per_tok=6, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=100000, eos_token_id=100001)
CONTEXT, BATCHES = 1024, (1, 32, 128)


def write_config(path: str) -> str:
    import transformers

    config = transformers.DeepseekV3Config(**V2_LITE_DENSE)
    config.torch_dtype = "bfloat16"
    config.save_pretrained(path)
    return path


def latent_bytes_per_token(config: dict) -> int:
    return config["num_hidden_layers"] * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 2


def bench_ours(path: str, quick: bool) -> dict:
    config = EngineConfig(
        model=ModelSpec(path, dtype="bfloat16", max_model_len=8192, load_format="dummy"),
        cache=CacheConfig(gpu_memory_utilization=0.85),
        scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=128),
        accelerator="nvidia")
    engine = Engine(config, load_tokenizer=False)
    vocab = V2_LITE_DENSE["vocab_size"]
    out: dict = {"weights_bytes": engine.accelerator.memory_stats().weights_bytes}
    steps_out = 32 if quick else 128
    _decode(engine, random_prompts(4, 300, vocab, 0), 8)  # warm-up: compile the kernels
    for batch in BATCHES:
        step_s = _decode(engine, random_prompts(batch, CONTEXT, vocab, batch), steps_out)
        out[f"batch{batch}_step_s"] = step_s
        out[f"batch{batch}_tok_s"] = batch / step_s
    engine.shutdown()
    torch.cuda.empty_cache()
    return out


def _decode(engine: Engine, prompts: list[list[int]], max_tokens: int) -> float:
    """Median wall time of the decode-only steps of the batch."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params, prefix_cache=False)
    steps = []
    while engine.has_unfinished_requests():
        decode = all(s.request.num_computed_tokens > 0 for s in engine._samples.values())
        t0 = time.perf_counter()
        engine.step()
        if decode:
            steps.append(time.perf_counter() - t0)
    return statistics.median(steps)


def bench_hf(quick: bool) -> dict:
    import transformers

    config = transformers.DeepseekV3Config(**V2_LITE_DENSE)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = transformers.DeepseekV3ForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    out: dict = {"transformers": transformers.__version__}
    new = 16 if quick else 64
    for batch in BATCHES[:2]:  # its cache of full K/V per head gets large fast
        ids = torch.tensor(random_prompts(batch, CONTEXT, config.vocab_size, batch), device="cuda")

        def gen(n: int) -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False)
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        gen(2)
        one, full = statistics.median(gen(1) for _ in range(2)), gen(new + 1)
        out[f"batch{batch}_tok_s"] = batch * new / (full - one)
    model = None  # freed before the next measurement
    torch.cuda.empty_cache()
    return out


def roofline(result: dict) -> dict:
    bandwidth = result["device"]["copy_bytes_per_s"]
    weights = result["ours"]["weights_bytes"]
    per_token = latent_bytes_per_token(V2_LITE_DENSE)
    ceiling = {}
    for batch in BATCHES:
        step_bytes = weights + batch * (CONTEXT + 64) * per_token
        ceiling[f"batch{batch}_tok_s"] = batch * bandwidth / step_bytes
    return ceiling


def plot(result: dict, path: str) -> None:
    peer_bars(path, result, [f"batch{b}_tok_s" for b in BATCHES],
              [f"batch {b}" for b in BATCHES], "decode output tok/s",
              f"MLA decode, V2-Lite-width dense model, {CONTEXT}-token context, H200 bf16",
              ceiling="bytes roofline")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/cuda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    result: dict = {"config": V2_LITE_DENSE, "context": CONTEXT, "device": ceilings()}
    with tempfile.TemporaryDirectory() as tmp:
        result["ours"] = bench_ours(write_config(tmp), args.quick)
    result["hf"] = {} if args.skip_hf else bench_hf(args.quick)
    result["ceiling"] = roofline(result)
    for b in BATCHES:
        ours, top = result["ours"][f"batch{b}_tok_s"], result["ceiling"][f"batch{b}_tok_s"]
        hf = result["hf"].get(f"batch{b}_tok_s")
        print(f"batch {b:4d}: ours {ours:9.1f} tok/s = {ours / top:.0%} of the roofline "
              f"{top:9.1f}" + (f"; transformers {hf:8.1f} (x{ours / hf:.1f})" if hf else ""))
    with open(os.path.join(args.out, "mla_decode.json"), "w") as f:
        json.dump(result, f, indent=2)
    plot(result, os.path.join(args.out, "mla_decode.png"))


if __name__ == "__main__":
    main()
