"""How often FP8 weights pick the token bf16 picks, on a real model (SmolLM2-135M-Instruct,
the embedded default's GGUF, dequantized to bf16 as the reference; `--quantization fp8`
quantizes its decoder layers to DeepSeek's 128 x 128 FP8 blocks at load):

    python benchmarks/cuda/fp8_agreement.py --model SmolLM2.gguf --out benchmarks/results/cuda

1. bf16 generates 128 greedy tokens for each of 8 chat prompts (ignore_eos: 1,024 tokens).
2. Teacher-forced top-1 agreement: every prefix of those sequences (prompt + the first i
   generated tokens) is prefilled by each engine with max_tokens 1; the greedy next tokens are
   compared position by position. The bf16 engine's own prefill against its decode is the
   noise floor (bf16 rounding differs between the two paths).
3. Free-running: FP8 generates from the same prompts; per prompt, how many tokens equal bf16's
   before the first difference.
Writes fp8_agreement.json and fp8_agreement.png.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from deepinfer.core.sampling import SamplingParams  # noqa: E402
from deepinfer.llm import LLM  # noqa: E402

PROMPTS = [
    "Explain why the sky is blue in a short paragraph.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What are three good habits for a software engineer?",
    "Summarize the plot of Romeo and Juliet.",
    "How does a hash table work?",
    "Give me a recipe for pancakes.",
    "What is the difference between a list and a tuple in Python?",
    "Describe the water cycle to a ten-year-old.",
]
NEW_TOKENS = 128


def _engine(model: str, quantization: str) -> LLM:
    return LLM(model, dtype="bfloat16", accelerator="nvidia", quantization=quantization,
               gpu_memory_utilization=0.3, max_model_len=1024)


def _free_running(llm: LLM) -> list[list[int]]:
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    return [[*o.prompt_token_ids, *o.outputs[0].token_ids] for o in llm.chat(chats, greedy)]


def _next_tokens(llm: LLM, sequences: list[list[int]], prompt_lens: list[int]) -> list[int]:
    """The greedy next token after every prefix that ends inside the generated part (no
    prefix cache: each prefix is one prefill)."""
    prefixes = [seq[:end] for seq, n in zip(sequences, prompt_lens)
                for end in range(n, len(seq))]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    return [o.outputs[0].token_ids[0] for o in llm.generate(prefixes, one, prefix_cache=False)]


def _release(llm: LLM) -> None:
    llm.engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def measure(model: str) -> dict:
    bf16 = _engine(model, "auto")
    sequences = _free_running(bf16)
    prompt_lens = [len(s) - NEW_TOKENS for s in sequences]
    decoded = [t for s in sequences for t in s[-NEW_TOKENS:]]
    bf16_forced = _next_tokens(bf16, sequences, prompt_lens)
    _release(bf16)
    fp8 = _engine(model, "fp8")
    fp8_forced = _next_tokens(fp8, sequences, prompt_lens)
    fp8_free = _free_running(fp8)
    _release(fp8)
    same_run = [next((i for i, (a, b) in enumerate(zip(x[n:], y[n:])) if a != b), NEW_TOKENS)
                for x, y, n in zip(sequences, fp8_free, prompt_lens)]
    return {
        "model": os.path.basename(model), "prompts": len(PROMPTS), "new_tokens": NEW_TOKENS,
        "positions": len(decoded),
        "fp8_vs_bf16_top1": _rate(fp8_forced, bf16_forced),
        "fp8_vs_bf16_decoded_top1": _rate(fp8_forced, decoded),
        "bf16_prefill_vs_bf16_decode_top1": _rate(bf16_forced, decoded),
        "free_running_tokens_before_first_difference": same_run,
        "free_running_identical_prompts": sum(n == NEW_TOKENS for n in same_run),
    }


def _rate(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["fp8_vs_bf16_top1", "fp8_vs_bf16_decoded_top1", "bf16_prefill_vs_bf16_decode_top1"]
    labels = ["FP8 vs bf16\n(both prefilled)", "FP8 prefill vs\nbf16 decode",
              "bf16 prefill vs\nbf16 decode (floor)"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    bars = ax.bar(labels, [100 * result[k] for k in keys], color=["tab:blue", "tab:cyan",
                                                                   "tab:gray"])
    ax.bar_label(bars, fmt="%.1f%%")
    ax.set(ylim=(0, 105), ylabel="top-1 agreement, %",
           title=f"teacher-forced, {result['positions']} positions")
    same = result["free_running_tokens_before_first_difference"]
    bx.bar(range(len(same)), same)
    bx.set(xlabel="prompt", ylabel="tokens", ylim=(0, result["new_tokens"] + 5))
    bx.set_title("free-running: FP8 = bf16 tokens before the first difference", fontsize=10)
    fig.suptitle(f"{result['model']}, FP8 (128x128 blocks) vs bf16, {result['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a .gguf file or an HF folder")
    parser.add_argument("--out", default="benchmarks/results/cuda")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    result = {"gpu": torch.cuda.get_device_name(), **measure(args.model)}
    for key, value in result.items():
        print(f"{key}: {value}")
    with open(os.path.join(args.out, "fp8_agreement.json"), "w") as f:
        json.dump(result, f, indent=2)
    plot(result, os.path.join(args.out, "fp8_agreement.png"))


if __name__ == "__main__":
    main()
