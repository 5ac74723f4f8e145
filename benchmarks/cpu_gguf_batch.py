"""The embedded default's GGUF blocks with several sequences decoding together on the CPU: this
tree against another (`--baseline TREE`, e.g. `git worktree add /tmp/base COMMIT`), taking turns
in separate processes.

    python benchmarks/cpu_gguf_batch.py --baseline /tmp/base [--rounds 3] [--seqs 1,16,32,64]

Each run loads the default model (GGUF blocks kept packed) and, per sequence count N, submits N
random 128-token prompts at once, 48 greedy tokens each (EOS ignored), and reports the median
step of the decode-only steps (up to 16 sequences a step goes through the integer GEMVs, above
that through a GEMM on the dequantized weight) as output tok/s; then the best of three
256-token prefills. Each tree's median over the rounds is reported, and this tree's ratio to
the baseline's. Writes results/cpu_gguf_batch.json and .png.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from common import RESULTS_DIR, log, machine_environment, pyplot, write_json

HERE = os.path.dirname(os.path.abspath(__file__))

_WORKER = r"""
import json, statistics, sys, time, torch
from deepinfer import LLM
from deepinfer.core.sampling import SamplingParams
seqs = json.loads(sys.argv[1])
engine = LLM().engine
g = torch.Generator().manual_seed(0)
vocab = engine.model.vocab_size

def decode_step_s(n, tag):
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    for i, ids in enumerate(torch.randint(200, vocab - 200, (n, 128), generator=g).tolist()):
        engine.add_request(f"{tag}-{i}", ids, params, prefix_cache=False)
    times = []
    while engine.has_unfinished_requests():
        decoding = not engine.scheduler.waiting and all(
            r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running)
        t0 = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)

def prefill_s(tag):
    ids = torch.randint(200, vocab - 200, (256,), generator=g).tolist()
    engine.add_request(tag, ids, SamplingParams(temperature=0.0, max_tokens=1), prefix_cache=False)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0

decode_step_s(4, "warm")
out = {"decode_step_s": {n: decode_step_s(n, f"d{n}") for n in seqs},
       "prefill256_s": min(prefill_s(f"p{i}") for i in range(3))}
print(json.dumps(out))
"""


def run_tree(tree: str, seqs: list[int], threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=tree, DEEPINFER_CPU_THREADS=str(threads))
    done = subprocess.run([sys.executable, "-c", _WORKER, json.dumps(seqs)], cwd=tree, env=env,
                          capture_output=True, text=True, check=True)
    raw = json.loads(done.stdout.strip().splitlines()[-1])
    steps = {int(n): s for n, s in raw["decode_step_s"].items()}
    return {"decode_step_ms": {n: s * 1e3 for n, s in steps.items()},
            "decode_tok_s": {n: n / s for n, s in steps.items()},
            "prefill256_tok_s": 256 / raw["prefill256_s"]}


def medians(runs: list[dict]) -> dict:
    seqs = runs[0]["decode_tok_s"]
    return {"decode_tok_s": {n: statistics.median(r["decode_tok_s"][n] for r in runs)
                             for n in seqs},
            "prefill256_tok_s": statistics.median(r["prefill256_tok_s"] for r in runs)}


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [n for n in ("this tree", "baseline") if n in result["medians"]]
    seqs = list(result["medians"][names[0]]["decode_tok_s"])
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        rates = result["medians"][name]["decode_tok_s"]
        ax.bar([i + j * width for i in range(len(seqs))], [rates[n] for n in seqs], width,
               label=name)
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(seqs))],
                  [str(n) for n in seqs])
    ax.set(xlabel="sequences decoding together", ylabel="output tok/s",
           title="GGUF blocks on the CPU, decode steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="another tree of this repository to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seqs", default="1,16,32,64")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default=RESULTS_DIR)
    args = parser.parse_args()
    seqs = [int(n) for n in args.seqs.split(",")]
    trees = {"this tree": os.path.dirname(HERE)}
    if args.baseline:
        trees["baseline"] = os.path.abspath(args.baseline)
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))  # taking turns
        for name in order:
            runs[name].append(run_tree(trees[name], seqs, args.threads))
            log(f"round {r + 1} {name}: {runs[name][-1]}")
    result = {"environment": machine_environment(), "threads": args.threads, "trees": trees,
              "runs": runs, "medians": {name: medians(rs) for name, rs in runs.items()}}
    if args.baseline:
        ours, base = result["medians"]["this tree"], result["medians"]["baseline"]
        result["ratios"] = {"decode": {n: ours["decode_tok_s"][n] / base["decode_tok_s"][n]
                                       for n in seqs},
                            "prefill256": ours["prefill256_tok_s"] / base["prefill256_tok_s"]}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "cpu_gguf_batch.json")
    write_json(path, result)
    plot(result, os.path.splitext(path)[0] + ".png")
    print(json.dumps({k: result[k] for k in ("medians", "ratios") if k in result}, indent=1))


if __name__ == "__main__":
    main()
