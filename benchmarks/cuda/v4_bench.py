"""DeepSeek-V4-Flash width with a few layers of each kind (random bf16) on one H200: our CUDA
backend against transformers' DeepseekV4ForCausalLM on the same config in the same run, with the
active-bytes roofline for decode and the FLOP roofline for prefill.

    python benchmarks/cuda/v4_bench.py --out benchmarks/results/cuda [--quick] [--skip-hf]

The config is transformers' DeepseekV4Config defaults (V4-Flash: hidden 4096, 64 heads of 512,
256 experts top-6 + 1 shared, q_lora 1024, o_groups 8, window 128, CSA rate 4 with a 512-entry
indexer top-k, HCA rate 128, mHC x4) cut to LAYER_TYPES. The active bytes of a decode step are
counted from transformers' own module tree (on the meta device): every weight but the embedding
table and the routed experts, one embedding row, and the routed experts the batch is expected
to touch. Writes v4_engine.json and v4_engine.png.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from common import peer_bars, save_word_tokenizer  # noqa: E402
from engine_bench import ceilings, random_prompts  # noqa: E402
from mla_bench import _decode  # noqa: E402  (median decode-only step of a batch)
from moe_engine_bench import _hf_generate, hf_prefill, prefill_seconds  # noqa: E402

from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig  # noqa: E402
from deepinfer.core.engine import Engine  # noqa: E402

LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention",
               "heavily_compressed_attention", "compressed_sparse_attention"]
MLP_TYPES = ["hash_moe", "moe", "moe", "moe"]
# transformers' V4 runs out of memory at 8K (its attention materializes scores and masks over
# every key): 4K is measured too, the longest it runs.
CONTEXT, BATCHES, PREFILLS = 512, (1, 32), (4096, 8192, 65536)


def v4_config():
    import transformers

    config = transformers.DeepseekV4Config(
        num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES, mlp_layer_types=MLP_TYPES,
        max_position_embeddings=131072, bos_token_id=0, eos_token_id=1)
    config.architectures = ["DeepseekV4ForCausalLM"]
    config.torch_dtype = "bfloat16"
    return config


def write_config(path: str) -> str:
    v4_config().save_pretrained(path)
    return path


# ---- ceilings ----------------------------------------------------------------------------
def parameter_counts() -> dict:
    """Parameters by kind, from transformers' module tree (meta device: no memory)."""
    import transformers

    with torch.device("meta"):
        model = transformers.DeepseekV4ForCausalLM(v4_config())
    counts = {"routed": 0, "embedding": 0, "other": 0}
    for name, p in model.named_parameters():
        kind = "routed" if ".mlp.experts." in name else \
            "embedding" if "embed_tokens" in name else "other"
        counts[kind] += p.numel()
    return counts


def active_bytes(batch: int, counts: dict) -> float:
    """bf16 bytes a decode step of `batch` tokens reads: routed experts at their expected count
    under uniform routing (KV reads are left out: ~1 MB a layer at this context)."""
    c = v4_config()
    experts, k = c.n_routed_experts, c.num_experts_per_tok
    touched = experts * (1 - (1 - k / experts) ** batch)
    routed = counts["routed"] * touched / experts
    return 2 * (counts["other"] + routed + batch * c.hidden_size)


def prefill_flops_per_token(tokens: int, counts: dict) -> float:
    """2 FLOPs per weight a token uses (its k + shared experts) plus its attention: the window's
    keys and the compressed entries it sees (CSA: the indexer's top-k; HCA: all of its)."""
    c = v4_config()
    routed = counts["routed"] / c.n_routed_experts * c.num_experts_per_tok
    weights = counts["other"] - c.vocab_size * c.hidden_size + routed  # lm_head: last token
    seen = {"sliding_attention": 0, "compressed_sparse_attention": min(c.index_topk, tokens // 8),
            "heavily_compressed_attention": tokens // 256}
    keys = sum(c.sliding_window + seen[t] for t in LAYER_TYPES)
    return 2 * weights + 4 * c.num_attention_heads * c.head_dim * keys


def roofline(result: dict, counts: dict) -> dict:
    bandwidth, flops = result["device"]["copy_bytes_per_s"], result["device"]["bf16_gemm_flops"]
    out = {f"batch{b}_tok_s": b * bandwidth / active_bytes(b, counts) for b in BATCHES}
    for n in PREFILLS:
        out[f"prefill{n // 1024}k_tok_s"] = flops / prefill_flops_per_token(n, counts)
    return out


# ---- DeepInfer ---------------------------------------------------------------------------
def bench_ours(path: str, quick: bool) -> dict:
    config = EngineConfig(
        model=ModelSpec(path, dtype="bfloat16", max_model_len=max(PREFILLS) + 256,
                        load_format="dummy"),
        cache=CacheConfig(gpu_memory_utilization=0.85),
        scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=64),
        accelerator="nvidia")
    engine = Engine(config, load_tokenizer=False)
    vocab = v4_config().vocab_size
    out: dict = {"weights_bytes": engine.accelerator.memory_stats().weights_bytes}
    _decode(engine, random_prompts(2, 300, vocab, 0), 4)  # warm-up: compile every kernel
    for batch in BATCHES:
        prompts = random_prompts(batch, CONTEXT, vocab, batch)
        _measure(out, f"batch{batch}_tok_s",
                 lambda: batch / _decode(engine, prompts, 16 if quick else 64))
    for n in PREFILLS:
        prefill_seconds(engine, random_prompts(1, min(n, 8192), vocab, 98)[0])  # warm-up
        prompt = random_prompts(1, n, vocab, 99)[0]
        _measure(out, f"prefill{n // 1024}k_tok_s", lambda: n / prefill_seconds(engine, prompt))
    engine.shutdown()
    torch.cuda.empty_cache()
    return out


def _measure(out: dict, key: str, run) -> None:
    """out[key] = run(), or the error that stopped it under out["errors"] (out of memory: the
    rest still runs)."""
    try:
        out[key] = run()
    except (torch.OutOfMemoryError, RuntimeError) as e:
        torch.cuda.empty_cache()
        out.setdefault("errors", {})[key] = str(e).splitlines()[0]
    print(key, out.get(key, out.get("errors", {}).get(key)), flush=True)


# ---- transformers ------------------------------------------------------------------------
def bench_hf(quick: bool) -> dict:
    out = _bench_hf_model(_hf_model(), 4 if quick else 16)
    torch.cuda.empty_cache()  # the model is gone with the call's frame
    return out


def _hf_model():
    import transformers

    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = transformers.DeepseekV4ForCausalLM(v4_config()).eval()
    torch.set_default_dtype(torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _bench_hf_model(model, new: int) -> dict:
    import transformers

    vocab = model.config.vocab_size
    out: dict = {"transformers": transformers.__version__}
    for batch in BATCHES:
        ids = torch.tensor(random_prompts(batch, CONTEXT, vocab, batch), device="cuda")
        _measure(out, f"batch{batch}_tok_s", lambda: _hf_decode(model, ids, new))
    for n in PREFILLS:
        _measure(out, f"prefill{n // 1024}k_tok_s", lambda: hf_prefill(model, n, vocab))
    return out


def _hf_decode(model, ids: torch.Tensor, new: int) -> float:
    """Decode tokens/s of generate: (n + 1 tokens) - (1 token), so the prefill cancels."""
    gen = _hf_generate(model, ids)
    gen(2)
    one, full = gen(1), gen(new + 1)
    return ids.shape[0] * new / (full - one)


# ---- report ------------------------------------------------------------------------------
def keys() -> list[str]:
    return [f"batch{b}_tok_s" for b in BATCHES] + [f"prefill{n // 1024}k_tok_s" for n in PREFILLS]


def longest_peer_prefill(result: dict) -> dict | None:
    """Our 64K prefill against transformers' at the longest prompt it ran: its tokens/s only
    fall as prompts grow (attention is quadratic there), so the ratio is a lower bound of the
    one at 64K."""
    ran = [n for n in PREFILLS if result["hf"].get(f"prefill{n // 1024}k_tok_s")]
    ours = result["ours"].get(f"prefill{max(PREFILLS) // 1024}k_tok_s")
    if not ran or not ours:
        return None
    hf = result["hf"][f"prefill{max(ran) // 1024}k_tok_s"]
    return {"ours_tokens": max(PREFILLS), "transformers_tokens": max(ran),
            "ours_tok_s": ours, "transformers_tok_s": hf, "ratio_at_least": ours / hf}


def report(result: dict) -> None:
    longest = result.get("prefill_vs_longest_peer")
    if longest:
        print(f"{longest['ours_tokens']}-token prefill {longest['ours_tok_s']:.0f} tok/s vs "
              f"transformers at {longest['transformers_tokens']} tokens "
              f"{longest['transformers_tok_s']:.0f}: x{longest['ratio_at_least']:.1f} or more")
    for key in keys():
        ours, top, hf = result["ours"].get(key), result["ceiling"][key], result["hf"].get(key)
        line = f"{key:18s}: roofline {top:10.1f}"
        if ours:
            line += f"; ours {ours:10.1f} = {ours / top:.0%}"
        if hf:
            line += f"; transformers {hf:9.1f}" + (f" (x{ours / hf:.1f})" if ours else "")
        print(line)


def save(result: dict, out: str) -> None:
    with open(os.path.join(out, "v4_engine.json"), "w") as f:
        json.dump(result, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/cuda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--write-model", metavar="DIR",
                        help="only write the config and a word-level tokenizer to DIR (a model "
                             "for deepinfer-serve --load-format dummy) and print DIR")
    args = parser.parse_args()
    if args.write_model:
        write_config(args.write_model)
        config = v4_config()
        save_word_tokenizer(args.write_model, config.vocab_size, config.eos_token_id)
        print(args.write_model)
        return
    os.makedirs(args.out, exist_ok=True)
    counts = parameter_counts()
    result: dict = {"config": {"layer_types": LAYER_TYPES, "mlp_layer_types": MLP_TYPES},
                    "parameters": counts, "context": CONTEXT, "device": ceilings()}
    result["ceiling"] = roofline(result, counts)
    with tempfile.TemporaryDirectory() as tmp:
        result["ours"] = bench_ours(write_config(tmp), args.quick)
    save(result, args.out)  # kept if the peer's run does not finish
    result["hf"] = {} if args.skip_hf else bench_hf(args.quick)
    result["prefill_vs_longest_peer"] = longest_peer_prefill(result)
    save(result, args.out)
    report(result)
    peer_bars(os.path.join(args.out, "v4_engine.png"), result, keys(),
              [f"decode b{b}" for b in BATCHES] + [f"{n // 1024}K prefill" for n in PREFILLS],
              "tokens/s", f"DeepSeek-V4-Flash width, {len(LAYER_TYPES)} layers, H200 bf16")


if __name__ == "__main__":
    main()
