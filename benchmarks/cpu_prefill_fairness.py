"""Running streams while a long prompt arrives, on the CPU backend: the longest wait between two
tokens of a decoding request, and the long prompt's time to first token, for several caps on
the prefill tokens a decoding step may carry (`prefill_beside_decodes`; 0 is no cap, the
whole 2,048-token budget).

    python benchmarks/cpu_prefill_fairness.py [--model DIR] [--prompt 4096] [--caps 0 256 512]

Writes results/cpu_prefill_fairness.json and .png. The default model is the embedded
SmolLM2-135M-Instruct (its GGUF blocks on the CPU)."""
from __future__ import annotations

import argparse
import os
import time

from common import RESULTS_DIR, log, machine_environment, pyplot, random_prompts, write_json


def run_case(model: str | None, cap: int, prompt_len: int, streams: int) -> dict:
    from deepinfer import LLM, SamplingParams

    llm = LLM(model, prefill_beside_decodes=cap, enable_prefix_caching=False)
    engine, vocab = llm.engine, len(llm.tokenizer)
    decode = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for i, ids in enumerate(random_prompts(streams, 16, vocab, seed=1)):
        engine.add_request(f"s{i}", ids, decode)
    for _ in range(3):  # every stream is decoding before the long prompt comes
        engine.step()
    [long_prompt] = random_prompts(1, prompt_len, vocab, seed=2)
    start = time.perf_counter()
    engine.add_request("long", long_prompt, SamplingParams(temperature=0, max_tokens=1))
    last = {f"s{i}": start for i in range(streams)}
    gaps: list[float] = []
    ttft = None
    while ttft is None:
        for out in engine.step():
            now = time.perf_counter()
            if out.request_id == "long":
                ttft = now - start
            elif out.request_id in last:
                gaps.append(now - last[out.request_id])
                last[out.request_id] = now
    for rid in last:
        engine.abort(rid)
    return {"cap": cap, "ttft_s": ttft, "max_token_gap_s": max(gaps),
            "mean_token_gap_s": sum(gaps) / len(gaps), "stream_tokens": len(gaps)}


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    cases = result["cases"]
    labels = [str(c["cap"]) if c["cap"] else "no cap" for c in cases]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(cases))
    ax.bar([i - 0.2 for i in x], [c["max_token_gap_s"] for c in cases], 0.4,
           label="longest gap between a stream's tokens")
    ax.bar([i + 0.2 for i in x], [c["ttft_s"] for c in cases], 0.4,
           label=f"TTFT of the {result['prompt_tokens']}-token prompt")
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("prefill tokens a decoding step may carry")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded model)")
    parser.add_argument("--prompt", type=int, default=4096, help="long prompt's tokens")
    parser.add_argument("--streams", type=int, default=2, help="requests decoding meanwhile")
    parser.add_argument("--caps", type=int, nargs="+", default=[0, 256, 512])
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, "cpu_prefill_fairness"))
    args = parser.parse_args()
    cases = []
    for cap in args.caps:
        cases.append(run_case(args.model, cap, args.prompt, args.streams))
        log(f"cap {cap}: {cases[-1]}")
    result = {"prompt_tokens": args.prompt, "streams": args.streams, "cases": cases,
              "environment": machine_environment()}
    write_json(args.out + ".json", result)
    plot(result, args.out + ".png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
