"""Offline TTFT/TPOT matrix (batch sizes x input lengths) on any DeepInfer backend.

For every (batch, input_len) cell: `batch` prompts of `input_len` random token ids (fixed seed)
are submitted at once to one Engine, after one untimed warm-up batch of the same shape (on a
static-shape backend such as `neuron` that compiles the cell's graphs), then `--repeats` timed
batches. Greedy, EOS ignored, prefix cache off, so every run prefills everything and makes
exactly `--output-len` tokens per request. From one run:

  ttft_ms    submit -> the step at which every request of the batch has its first token
  tpot_ms    decode time per output token after the first: per request
             (last token - first token) / (output_len - 1), averaged over the batch
  throughput output tokens of the batch / wall time from submit to the last token

Cells report the median of the repeats. Without --model a tiny random llama (2 layers, hidden
64, a 257-token byte-level tokenizer) is written to a temporary folder, so the matrix runs in
seconds on a CPU; its numbers measure the engine's overhead, not a model.

    python examples/neuron/bench_neuron.py --accelerator cpu
    DEEPINFER_NEURON_DEVICE=cpu python examples/neuron/bench_neuron.py --accelerator neuron
    python examples/neuron/bench_neuron.py --accelerator neuron --model /path/to/hf-folder \\
        --dtype bfloat16 --batch-sizes 1,8,32 --input-lens 128,1024 --output-len 64
    python examples/neuron/bench_neuron.py --save-tiny-model DIR    # only write the checkpoint

Writes the JSON (--out) and a heat map PNG beside it (needs matplotlib). If the backend's
accelerator has `region_times()`, what it returns after each cell is kept in the JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

DEFAULT_OUT = "bench_neuron.json"
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  initializer_range=0.1, tie_word_embeddings=False)
TINY_EOS = "<|endoftext|>"
TINY_NAME = "tiny-random-llama"


# ---- inputs ------------------------------------------------------------------------------------
def int_list(text: str) -> list[int]:
    """argparse type of "1,4,16": positive ints."""
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,4,16; got {text!r}")
    return values


def engine_option(text: str) -> tuple[str, Any]:
    """argparse type of NAME=VALUE for any engine option (deepinfer.core.config), typed as the
    option is, so that e.g. `-o block_size=32 -o enable_prefix_caching=false` both work."""
    from deepinfer.core.config import engine_options

    name, sep, raw = text.partition("=")
    option = next((o for o in engine_options() if o.name == name.strip()), None)
    if not sep or option is None:
        names = ", ".join(o.name for o in engine_options())
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE with NAME one of: {names}")
    if option.optional and raw.strip().lower() == "none":
        return option.name, None
    if option.type is bool:
        return option.name, raw.strip().lower() in ("1", "true", "yes", "on")
    return option.name, option.type(raw)


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`count` distinct prompts of uniform random ids. Ids below min(100, vocab/4) are skipped:
    many tokenizers keep their special tokens there."""
    rng = random.Random(seed)
    low = min(100, vocab_size // 4)
    return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(count)]


def write_tiny_checkpoint(path: str) -> str:
    """A random 2-layer llama with a byte-level tokenizer (256 bytes + an end token), written by
    transformers itself; the server can then detokenize and aiperf can tokenize text."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([TINY_EOS])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=TINY_EOS)
    tokenizer.save_pretrained(path)
    eos = tokenizer.eos_token_id
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), bos_token_id=eos,
                                      eos_token_id=eos, **TINY_LLAMA)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


# ---- one timed batch ---------------------------------------------------------------------------
@dataclass
class Run:
    ttft_s: float  # submit -> every request has its first token
    tpot_s: float  # mean over requests of (last - first token) / (tokens - 1)
    wall_s: float  # submit -> the last token of the batch
    output_tokens: int
    steps: int

    def as_ms(self) -> dict[str, float]:
        return {"ttft_ms": 1e3 * self.ttft_s, "tpot_ms": 1e3 * self.tpot_s,
                "wall_ms": 1e3 * self.wall_s, "output_tokens": self.output_tokens,
                "steps": self.steps}


def run_batch(engine: Any, prompts: list[list[int]], output_len: int, tag: str) -> Run:
    """Submit every prompt at once and step the engine until all are done."""
    from deepinfer.core.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts = dict.fromkeys(rids, 0)
    steps = 0
    start = time.perf_counter()
    try:
        for rid, ids in zip(rids, prompts):
            engine.add_request(rid, ids, params, prefix_cache=False)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()  # step() returns sampled tokens: the device is done
            steps += 1
            for out in outputs:
                if out.error is not None:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                if out.new_token_ids:
                    first.setdefault(out.request_id, now)
                    last[out.request_id] = now
                    counts[out.request_id] += len(out.new_token_ids)
    except BaseException:
        for rid in rids:  # so that the next cell starts on an empty engine
            engine.abort(rid)
        raise
    end = time.perf_counter()
    tpots = [(last[r] - first[r]) / (counts[r] - 1) for r in rids if counts[r] > 1]
    return Run(ttft_s=max(first.values()) - start, tpot_s=statistics.fmean(tpots) if tpots else 0.0,
               wall_s=end - start, output_tokens=sum(counts.values()), steps=steps)


def region_times(engine: Any) -> dict | None:
    """The backend's own cumulative per-region timings ({region: {"seconds", "calls"}} where
    the backend times them: the Neuron backend with DEEPINFER_NEURON_REGION_TIMING=1), made
    JSON-safe; None where the accelerator has no region_times() or it reports nothing."""
    get = getattr(engine.accelerator, "region_times", None)
    times = get() if callable(get) else None
    return json.loads(json.dumps(times, default=str)) if times else None


def region_delta(before: dict | None, after: dict | None) -> dict | None:
    """after - before for every numeric field of every region: the cell's own share of the
    backend's counters, which run since start-up."""
    if not after:
        return None
    before = before or {}
    out = {}
    for region, fields in after.items():
        if not isinstance(fields, dict):
            out[region] = fields
            continue
        old = before.get(region) or {}
        out[region] = {k: v - old.get(k, 0) if isinstance(v, (int, float)) else v
                       for k, v in fields.items()}
    return out


def bench_cell(engine: Any, batch: int, input_len: int, args: argparse.Namespace,
               vocab_size: int) -> dict:
    """Warm-up once, then args.repeats timed batches of the cell's shape; medians."""
    seed = args.seed + 1000 * batch + input_len  # each cell its own prompts, reproducibly
    cell: dict[str, Any] = {"batch": batch, "input_len": input_len}
    try:
        run_batch(engine, random_prompts(batch, input_len, vocab_size, seed + 1),
                  args.output_len, f"warm-b{batch}-i{input_len}")
        regions_before = region_times(engine)
        runs = [run_batch(engine, random_prompts(batch, input_len, vocab_size, seed + 2 + r),
                          args.output_len, f"b{batch}-i{input_len}-r{r}")
                for r in range(args.repeats)]
    except Exception as exc:  # noqa: BLE001 - one bad cell must not cost the rest of the matrix
        return {**cell, "error": f"{type(exc).__name__}: {exc}"}
    wall = statistics.median(r.wall_s for r in runs)
    cell.update(ttft_ms=1e3 * statistics.median(r.ttft_s for r in runs),
                tpot_ms=1e3 * statistics.median(r.tpot_s for r in runs),
                throughput_tok_s=batch * args.output_len / wall,
                prefill_tok_s=batch * input_len / statistics.median(r.ttft_s for r in runs),
                runs=[r.as_ms() for r in runs])
    regions = region_delta(regions_before, region_times(engine))
    if regions is not None:  # over the cell's timed runs (all repeats together)
        cell["region_times"] = regions
    return cell


# ---- the matrix --------------------------------------------------------------------------------
def build_llm(model: str, args: argparse.Namespace) -> Any:
    from deepinfer.llm import LLM

    options = {"max_num_seqs": max(args.batch_sizes), **dict(args.option)}
    if args.dtype:
        options["dtype"] = args.dtype
    if args.accelerator:
        options["accelerator"] = args.accelerator
    # No tokenizer: prompts are token ids and nothing is detokenized, as on a pure engine.
    return LLM(model, load_tokenizer=False, **options)


def environment() -> dict[str, Any]:
    import torch

    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "machine": platform.machine(),
            "processor": platform.processor(), "logical_cores": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            # Other work on the machine shows here (the benchmark alone keeps ~1 core busy).
            "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
            # The backends' knobs (DEEPINFER_NEURON_DEVICE, ..._MOE_CAPACITY, ...) as run.
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("DEEPINFER_")}}


def run_matrix(model: str, args: argparse.Namespace, tiny: bool) -> dict:
    llm = build_llm(model, args)
    engine = llm.engine
    try:
        info = engine.model
        caps = engine.accelerator.capabilities
        kv_tokens = engine.kv.pool.num_usable * engine.kv.block_size
        result: dict[str, Any] = {
            "benchmark": "examples/neuron/bench_neuron.py",
            "title": "offline engine",
            "backend": engine.accelerator.name,
            "config": {
                "model": TINY_NAME if tiny else model,
                "dtype": info.dtype, "vocab_size": info.vocab_size,
                "max_model_len": info.max_model_len, "batch_sizes": args.batch_sizes,
                "input_lens": args.input_lens, "output_len": args.output_len,
                "repeats": args.repeats, "seed": args.seed, "options": dict(args.option),
                "max_num_seqs": engine.config.scheduler.max_num_seqs,
                "max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens,
                "block_size": engine.kv.block_size, "kv_capacity_tokens": kv_tokens,
                "capabilities": dataclasses.asdict(caps)},
            "machine": environment(),
            "cells": []}
        if tiny:
            result["config"]["tiny_llama"] = TINY_LLAMA
        # The neuron backend on XLA: each bucket's graph as its compiler received it.
        graphs = getattr(engine.accelerator, "graph_report", None)
        if graphs:
            result["graphs"] = graphs
        for batch in args.batch_sizes:
            for input_len in args.input_lens:
                cell = bench_cell(engine, batch, input_len, args, info.vocab_size)
                # A fixed pool admits a request only with room for all of it: beyond the pool,
                # the batch does not run at once and its TTFT includes waiting.
                cell["fits_kv_at_once"] = batch * (input_len + args.output_len) <= kv_tokens
                print(cell_line(cell), flush=True)
                result["cells"].append(cell)
    finally:
        engine.shutdown()
    result["machine"]["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    return result


def cell_line(cell: dict) -> str:
    where = f"batch {cell['batch']:4d} x input {cell['input_len']:6d}"
    if "error" in cell:
        return f"{where}: FAILED {cell['error']}"

    def num(key: str, spec: str) -> str:
        value = cell.get(key)
        return format(value, spec) if isinstance(value, (int, float)) else "-"
    return (f"{where}: TTFT {num('ttft_ms', '9.2f')} ms  TPOT {num('tpot_ms', '8.3f')} ms  "
            f"{num('throughput_tok_s', '9.1f')} output tok/s")


# ---- output ------------------------------------------------------------------------------------
def write_json(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def plot_matrix(result: dict, path: str) -> bool:
    """Two heat maps (TTFT, TPOT), batch size x input length, values written in the cells.
    False (and nothing written) where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    batches, lens = result["config"]["batch_sizes"], result["config"]["input_lens"]
    by_key = {(c["batch"], c["input_len"]): c for c in result["cells"]}
    fig, axes = plt.subplots(1, 2, figsize=(5 + 1.6 * len(lens), 1.6 + 0.7 * len(batches)))
    for ax, (key, label) in zip(axes, (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"))):
        grid = [[by_key.get((b, n), {}).get(key, math.nan) for n in lens] for b in batches]
        # Log colours: the cells span orders of magnitude, a linear map shows only the largest.
        finite = [v for row in grid for v in row if v > 0]
        norm = LogNorm(min(finite), max(finite)) if finite else None
        ax.imshow(grid, cmap="viridis", aspect="auto", norm=norm)
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                text = "failed" if math.isnan(value) else f"{value:.3g}"
                ax.text(j, i, text, ha="center", va="center", color="white",
                        path_effects=_outline())
        ax.set_xticks(range(len(lens)), [str(n) for n in lens])
        ax.set_yticks(range(len(batches)), [str(b) for b in batches])
        ax.set_xlabel("input tokens")
        ax.set_ylabel("batch size")
        ax.set_title(label)
    cfg = result["config"]
    name = os.path.basename(os.path.normpath(str(cfg["model"])))
    fig.suptitle(f"{result['title']}: {result['backend']}, {name}, {cfg.get('dtype', '')}, "
                 f"{cfg['output_len']} output tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _outline() -> list:
    """A dark outline, so that the white labels read on every colour of the map."""
    from matplotlib import patheffects

    return [patheffects.withStroke(linewidth=2, foreground="black")]


def finish(out: str, result: dict) -> int:
    """Write the JSON and the PNG beside it; the exit status: 1 if any cell failed."""
    write_json(out, result)
    drawn = plot_matrix(result, png_path(out))
    print(f"wrote {out}" + (f" and {png_path(out)}" if drawn else
                            " (no PNG: matplotlib is not installed)"))
    return 1 if any("error" in c for c in result["cells"]) else 0


def png_path(json_path: str) -> str:
    return os.path.splitext(json_path)[0] + ".png"


# ---- command line ------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--accelerator", help="backend name (neuron, nvidia, cpu, ...); default: "
                   "DEEPINFER_ACCELERATOR, else the first available")
    p.add_argument("--model", help="HF folder; default: a tiny random llama in a temp folder")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 4, 16])
    p.add_argument("--input-lens", type=int_list, default=[32, 128, 512])
    p.add_argument("--output-len", type=int, default=32, help="tokens per request (>= 2)")
    p.add_argument("--repeats", type=int, default=3, help="timed batches per cell (median)")
    p.add_argument("--dtype", help="float32, bfloat16, float16 (default: the checkpoint's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("-o", "--option", type=engine_option, action="append", default=[],
                   metavar="NAME=VALUE", help="any other engine option, e.g. -o block_size=32")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON path; the PNG goes beside it")
    p.add_argument("--save-tiny-model", metavar="DIR",
                   help="only write the tiny random llama to DIR and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.save_tiny_model:
        os.makedirs(args.save_tiny_model, exist_ok=True)
        print(write_tiny_checkpoint(args.save_tiny_model))
        return 0
    if args.output_len < 2 or args.repeats < 1:
        raise SystemExit("--output-len must be >= 2 (TPOT needs a token after the first) and "
                         "--repeats >= 1")
    with tempfile.TemporaryDirectory(prefix="deepinfer-tiny-") as tmp:
        model = args.model or write_tiny_checkpoint(tmp)
        result = run_matrix(model, args, tiny=args.model is None)
    return finish(args.out, result)


if __name__ == "__main__":
    sys.exit(main())
