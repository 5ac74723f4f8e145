"""CPU seconds of the API process and the rank(s) for a wave of concurrent non-streaming
completions through deepinfer-serve, for this tree and optionally a baseline tree, alternately.

    python benchmarks/api_cpu_nonstream.py --model DIR [--baseline TREE] [--requests 256]
        [--stream]

--stream sends streaming completions instead (the clients read every SSE chunk) and writes
api_cpu_stream.json.

A baseline tree is e.g. `git worktree add /tmp/base COMMIT`. Each side starts its own server
(one torch thread), sends one small warm-up wave, then `--waves` waves of `--requests`
token-id prompts (64 tokens, `--max-tokens` greedy tokens each, ignore_eos, prefix cache off);
CPU time of the API process and its ranks from serve_overhead's CpuMeter. Writes
api_cpu_nonstream.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import free_port, start_server, stop_server, wait_healthy  # noqa: E402
from serve_overhead import CpuMeter  # noqa: E402


async def wave(base: str, n: int, max_tokens: int, vocab: int, seed: int,
               stream: bool = False) -> int:
    async def one(client: httpx.AsyncClient, i: int) -> int:
        rng = random.Random(seed * 100_003 + i)
        body = {"model": "m", "prompt": [rng.randrange(3, vocab) for _ in range(64)],
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "prefix_cache": False, "stream": stream}
        if stream:
            return await _streamed_tokens(client, f"{base}/v1/completions", body)
        r = await client.post(f"{base}/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n)) as client:
        return sum(await asyncio.gather(*[one(client, i) for i in range(n)]))


async def _streamed_tokens(client: httpx.AsyncClient, url: str, body: dict) -> int:
    """The SSE chunks of one streaming completion, read to the end: its token count."""
    body = {**body, "stream_options": {"include_usage": True}}
    tokens = 0
    async with client.stream("POST", url, json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                tokens = (json.loads(line[6:]).get("usage") or {}).get("completion_tokens",
                                                                         tokens)
    return tokens


def run_side(tree: str, args: argparse.Namespace, log_path: str) -> list[dict]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=tree, DEEPINFER_CPU_THREADS="1")
    server = start_server([sys.executable, "-m", "deepinfer.serve.cli", "--model", args.model,
                           "--port", str(port), "--max-num-seqs", str(args.requests),
                           "--num-kv-blocks", "2048", "--block-size", "16", "--dtype",
                           "float32", "--log-level", "warning", "--served-model-name", "m"],
                          log_path, env=env, cwd=tree)
    base, out = f"http://127.0.0.1:{port}", []
    try:
        wait_healthy(server, base, log_path, 600)
        asyncio.run(wave(base, 4, 8, args.vocab, 0))
        meter = CpuMeter(server.pid)
        for w in range(args.waves):
            cpu0, t0 = meter.sample(), time.perf_counter()
            tokens = asyncio.run(wave(base, args.requests, args.max_tokens, args.vocab, w + 1,
                                      args.stream))
            wall = time.perf_counter() - t0
            cpu = CpuMeter.delta(cpu0, meter.sample())
            out.append({"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
                        "api_cpu_s": cpu["api"], "rank_cpu_s": cpu["rank"]})
    finally:
        stop_server(server)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--baseline", default=None, help="another source tree, run alternately")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--waves", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--stream", action="store_true", help="streaming completions instead")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    trees = {"this": os.path.dirname(HERE)}
    if args.baseline:
        trees["baseline"] = os.path.abspath(args.baseline)
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name, tree in trees.items():
            runs[name] += run_side(tree, args, os.path.join(args.out, f"api_cpu_{name}.log"))
            print(name, f"round {r}:", [round(w["api_cpu_s"], 2) for w in runs[name][-args.waves:]],
                  flush=True)
    summary = {name: {"api_cpu_s_median": statistics.median(w["api_cpu_s"] for w in waves),
                      "api_us_per_token": 1e6 * statistics.median(
                          w["api_cpu_s"] / w["tokens"] for w in waves),
                      "rank_cpu_s_median": statistics.median(w["rank_cpu_s"] for w in waves),
                      "tok_s_median": statistics.median(w["tok_s"] for w in waves)}
               for name, waves in runs.items()}
    name = "api_cpu_stream.json" if args.stream else "api_cpu_nonstream.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump({"settings": vars(args), "trees": trees, "runs": runs, "summary": summary},
                  f, indent=2)
    for name, s in summary.items():
        print(f"{name:9s} API {s['api_us_per_token']:.1f} us/token "
              f"(median {s['api_cpu_s_median']:.2f} CPU-s a wave), "
              f"rank {s['rank_cpu_s_median']:.2f} CPU-s, {s['tok_s_median']:.0f} tok/s")


if __name__ == "__main__":
    main()
