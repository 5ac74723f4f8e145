"""TTFT/TPOT matrix (batch sizes x input lengths) through a running server's /v1/completions.

The load generator behind run_bench.sh when aiperf is not installed, and the summary of
aiperf's results when it is (--from-aiperf). For every (batch, input_len) cell it sends
`batch` streaming completions at once (concurrency = batch size), each of `input_len` random
token ids (fixed seed; token ids, so the server runs exactly that many prompt tokens),
greedy, EOS ignored, prefix cache off, `--output-len` tokens each: one untimed warm-up wave,
then `--waves` timed waves. Per request, from the official `openai` client's stream:

  TTFT  send -> the first chunk with a choice
  TPOT  (last chunk - first chunk) / (completion_tokens - 1), with completion_tokens from the
        stream's usage chunk (a chunk may carry more than one token)

A cell's ttft_ms is the median over waves of the wave's slowest TTFT (when every request of the
batch has its first token, as bench_neuron.py measures offline); ttft_p50_ms is the median
over all requests; tpot_ms the median over waves of the wave's mean TPOT; throughput the
batch's output tokens / the wave's wall time (median).

    python examples/neuron/serve_bench.py --url http://127.0.0.1:8000 --batch-sizes 1,4 \\
        --input-lens 32,128 --output-len 32 --out serve_bench.json
    python examples/neuron/serve_bench.py --from-aiperf DIR ...   # DIR/b{B}_i{L}/ of aiperf

Writes the JSON and a heat map PNG beside it (bench_neuron.py's plot; needs matplotlib).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # bench_neuron, also when run from another folder
from bench_neuron import cell_line, finish, int_list, random_prompts  # noqa: E402

DEFINITIONS = {
    "ttft_ms": "median over waves of the slowest request's send -> first chunk",
    "ttft_p50_ms": "median over every request of send -> first chunk",
    "tpot_ms": "median over waves of the mean over requests of (last chunk - first chunk) / "
               "(completion_tokens - 1)",
    "throughput_tok_s": "batch x output_len / wave wall time (median over waves)"}
AIPERF_DEFINITIONS = {
    "ttft_ms": "aiperf time_to_first_token avg (per request, concurrency = batch)",
    "ttft_p50_ms": "aiperf time_to_first_token p50",
    "tpot_ms": "aiperf inter_token_latency avg",
    "throughput_tok_s": "aiperf output_token_throughput avg"}


# ---- the server --------------------------------------------------------------------------------
def get_json(url: str, api_key: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
        return json.load(r)


def served_model(url: str, api_key: str | None) -> dict:
    """The server's one model: {"id", "root" (its folder), "max_model_len"}."""
    return get_json(f"{url}/v1/models", api_key)["data"][0]


def vocab_size(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    return config.get("vocab_size") or config["text_config"]["vocab_size"]


# ---- load --------------------------------------------------------------------------------------
@dataclass
class Timing:
    ttft_s: float
    tpot_s: float | None  # None with fewer than 2 tokens
    tokens: int


async def one_request(client: Any, model: str, prompt: list[int], output_len: int) -> Timing:
    start = time.perf_counter()
    first = last = None
    tokens = 0
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=output_len, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "prefix_cache": False})
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices:
            first = first or now
            last = now
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    if first is None:
        raise RuntimeError("the stream ended without a token")
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return Timing(first - start, tpot, tokens)


async def wave(client: Any, model: str, prompts: list[list[int]], output_len: int
               ) -> tuple[list[Timing], float]:
    """Every prompt at once; the timings and the wall time until the last one is done."""
    start = time.perf_counter()
    timings = await asyncio.gather(*(one_request(client, model, p, output_len) for p in prompts))
    return list(timings), time.perf_counter() - start


async def bench_cell(client: Any, model: str, batch: int, input_len: int,
                     args: argparse.Namespace, vocab: int) -> dict:
    seed = args.seed + 1000 * batch + input_len  # bench_neuron.py's prompts for the same cell
    cell: dict[str, Any] = {"batch": batch, "input_len": input_len}
    try:
        await wave(client, model, random_prompts(batch, input_len, vocab, seed + 1),
                   args.output_len)
        waves = [await wave(client, model,
                            random_prompts(batch, input_len, vocab, seed + 2 + w),
                            args.output_len)
                 for w in range(args.waves)]
    except Exception as exc:  # noqa: BLE001 - one bad cell must not cost the rest
        return {**cell, "error": f"{type(exc).__name__}: {exc}"}
    every = [t for timings, _ in waves for t in timings]
    cell.update(
        ttft_ms=1e3 * statistics.median(max(t.ttft_s for t in ts) for ts, _ in waves),
        ttft_p50_ms=1e3 * statistics.median(t.ttft_s for t in every),
        tpot_ms=1e3 * statistics.median(
            statistics.fmean(t.tpot_s for t in ts if t.tpot_s is not None) for ts, _ in waves),
        throughput_tok_s=statistics.median(sum(t.tokens for t in ts) / wall for ts, wall in waves),
        output_tokens=[sum(t.tokens for t in ts) for ts, _ in waves],
        wave_wall_ms=[1e3 * wall for _, wall in waves])
    return cell


async def run_matrix(args: argparse.Namespace, model: str, vocab: int) -> list[dict]:
    from openai import AsyncOpenAI

    # Retries would hide failures and time them as one slow request.
    client = AsyncOpenAI(base_url=f"{args.url}/v1", api_key=args.api_key or "none",
                         max_retries=0, timeout=args.request_timeout)
    cells = []
    try:
        for batch in args.batch_sizes:
            for input_len in args.input_lens:
                cell = await bench_cell(client, model, batch, input_len, args, vocab)
                print(cell_line(cell), flush=True)
                cells.append(cell)
    finally:
        await client.close()
    return cells


# ---- aiperf's results --------------------------------------------------------------------------
def aiperf_cell(folder: str, batch: int, input_len: int) -> dict:
    """One cell from aiperf's profile_export_aiperf.json in folder/b{batch}_i{input_len}."""
    cell: dict[str, Any] = {"batch": batch, "input_len": input_len}
    path = os.path.join(folder, f"b{batch}_i{input_len}", "profile_export_aiperf.json")
    try:
        with open(path) as f:
            agg = json.load(f)
        cell.update(ttft_ms=agg["time_to_first_token"]["avg"],
                    ttft_p50_ms=agg["time_to_first_token"].get("p50"),
                    tpot_ms=agg["inter_token_latency"]["avg"],
                    throughput_tok_s=agg.get("output_token_throughput", {}).get("avg"),
                    aiperf_errors=agg.get("error_summary") or [])
    except (OSError, KeyError, ValueError) as exc:
        cell["error"] = f"no aiperf result in {path}: {type(exc).__name__}: {exc}"
    return cell


# ---- command line ------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server, without /v1")
    p.add_argument("--api-key", default=os.environ.get("DEEPINFER_API_KEY"))
    p.add_argument("--model-dir", help="the served checkpoint's folder, for its vocabulary "
                   "(default: the folder /v1/models reports)")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 4, 16])
    p.add_argument("--input-lens", type=int_list, default=[32, 128, 512])
    p.add_argument("--output-len", type=int, default=32, help="tokens per request (>= 2)")
    p.add_argument("--waves", type=int, default=2, help="timed waves per cell (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--backend", default=os.environ.get("DEEPINFER_ACCELERATOR") or "auto",
                   help="the server's accelerator, as a label in the JSON")
    p.add_argument("--dtype", default="", help="the server's dtype, as a label in the JSON")
    p.add_argument("--dp", type=int, default=1, help="the server's --dp, as a label")
    p.add_argument("--from-aiperf", metavar="DIR",
                   help="summarize aiperf's results in DIR/b{B}_i{L}/ instead of sending load")
    p.add_argument("--out", default="serve_bench.json", help="JSON path; the PNG goes beside it")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.output_len < 2 or args.waves < 1:
        raise SystemExit("--output-len must be >= 2 and --waves >= 1")
    info = served_model(args.url, args.api_key)
    result: dict[str, Any] = {
        "benchmark": "examples/neuron/serve_bench.py",
        "title": "aiperf" if args.from_aiperf else "deepinfer-serve /v1/completions",
        "backend": args.backend,
        "config": {"model": info.get("root") or info["id"], "served_model_name": info["id"],
                   "dtype": args.dtype, "dp": args.dp, "url": args.url,
                   "batch_sizes": args.batch_sizes, "input_lens": args.input_lens,
                   "output_len": args.output_len, "waves": args.waves, "seed": args.seed,
                   "load": "aiperf" if args.from_aiperf else "openai client"},
        "definitions": AIPERF_DEFINITIONS if args.from_aiperf else DEFINITIONS}
    if args.from_aiperf:
        result["cells"] = [aiperf_cell(args.from_aiperf, b, n)
                           for b in args.batch_sizes for n in args.input_lens]
        for cell in result["cells"]:
            print(cell_line(cell), flush=True)
    else:
        vocab = vocab_size(args.model_dir or info["root"])
        result["cells"] = asyncio.run(run_matrix(args, info["id"], vocab))
    return finish(args.out, result)


if __name__ == "__main__":
    sys.exit(main())
