"""The embedded default's GGUF on the CPU: DeepInfer (blocks kept packed, and the dequantized
float32 path) against llama.cpp (llama-cpp-python) on the same file and cores, in one run.

    python benchmarks/cpu_gguf.py [--gguf FILE.gguf] [--threads 2]

The two sides take turns, `--rounds` timed runs each, and each side's median is reported
(this shared machine's speed moves by tens of percent from one minute to the next).
llama.cpp runs in a virtual environment of its own (`--llama-venv`, made and filled with
`pip install llama-cpp-python==VERSION` on first use, which builds it from source), so nothing
of it enters DeepInfer's. Both get the same prompt token ids; decode is greedy, 128 tokens, one
sequence; prefill is the whole prompt in one step. The server's memory is the API process
plus its rank process, after it has served the same request: the sum of their RSS, and of their
PSS (each page shared between them counted once). Writes
results/cpu_gguf.json and .png.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from common import (
    RESULTS_DIR,
    free_port,
    log,
    machine_environment,
    pyplot,
    start_server,
    stop_server,
    wait_healthy,
    write_json,
)

LLAMA_CPP_VERSION = "0.3.36"
PROMPT_TEXT = ("The history of the written word begins with marks pressed into clay. Over the "
               "centuries scribes, printers and engineers changed how text is made, stored and "
               "shared, and each change altered who could read and what they could learn. ")

_LLAMA_SCRIPT = r"""
import json, sys, time, resource
from llama_cpp import Llama
args = json.loads(sys.argv[1])
llm = Llama(model_path=args["gguf"], n_ctx=2048, n_batch=512, n_threads=args["threads"],
            n_threads_batch=args["threads"], verbose=False)
def run():
    llm.reset()
    t0 = time.perf_counter(); llm.eval(args["prompt"]); t1 = time.perf_counter()
    tokens = []
    for _ in range(args["max_tokens"]):
        token = llm.sample(top_k=1, temp=0.0)
        tokens.append(int(token))
        llm.eval([token])
    return t1 - t0, time.perf_counter() - t1, tokens
run()  # warm-up
prefill, decode, tokens = run()
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"prefill_s": prefill, "decode_s": decode, "tokens": tokens, "peak_rss": rss}))
"""


def llama_python(venv: str) -> str:
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        log(f"making {venv} with llama-cpp-python=={LLAMA_CPP_VERSION} (built from source)")
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q",
                        f"llama-cpp-python=={LLAMA_CPP_VERSION}"], check=True)
    return python


def run_llama_cpp(python: str, gguf: str, prompt: list[int], args) -> dict:
    payload = json.dumps({"gguf": gguf, "prompt": prompt, "threads": args.threads,
                          "max_tokens": args.max_tokens})
    out = subprocess.run([python, "-c", _LLAMA_SCRIPT, payload], check=True,
                         capture_output=True, text=True)
    return _rates(json.loads(out.stdout.strip().splitlines()[-1]), len(prompt), args.max_tokens)


def _rates(result: dict, prompt_len: int, max_tokens: int) -> dict:
    result["prefill_tok_s"] = prompt_len / result["prefill_s"]
    result["decode_tok_s"] = max_tokens / result["decode_s"]
    return result


class DeepInferRun:
    """Greedy decode and prefill through LLM, as a user runs it (the engine's own step loop);
    the model loaded and warmed once, timed as often as asked."""

    def __init__(self, folder: str, quantization: str, prompt: list[int], args) -> None:
        from deepinfer import LLM, SamplingParams

        self.llm, self.prompt, self.max_tokens = LLM(model=folder, quantization=quantization), \
            prompt, args.max_tokens
        self.first = SamplingParams(temperature=0, max_tokens=1)
        self.full = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        self.llm.generate([prompt], self.full, prefix_cache=False)  # warm-up

    def __call__(self) -> dict:
        t0 = time.perf_counter()
        self.llm.generate([self.prompt], self.first, prefix_cache=False)
        t1 = time.perf_counter()
        out = self.llm.generate([self.prompt], self.full, prefix_cache=False)
        t2 = time.perf_counter()
        prefill = t1 - t0
        # decode: the full run less its prefill and first token, over the tokens after it
        result = {"prefill_s": prefill, "decode_s": (t2 - t1 - prefill) * self.max_tokens
                  / (self.max_tokens - 1), "tokens": list(out[0].outputs[0].token_ids)}
        return _rates(result, len(self.prompt), self.max_tokens)

    def close(self) -> None:
        self.llm.engine.shutdown()


def interleaved(peer, ours, rounds: int) -> tuple[dict, dict]:
    """Each side timed `rounds` times, taking turns, so that a slow spell of a shared machine
    falls on both; each side's median run (by decode rate) with every run's rates."""
    runs: tuple[list, list] = ([], [])
    for _ in range(rounds):
        for side, run in zip(runs, (peer, ours)):
            side.append(run())
    return tuple(_median_run(side) for side in runs)


def _median_run(runs: list[dict]) -> dict:
    ordered = sorted(runs, key=lambda r: r["decode_tok_s"])
    median = dict(ordered[len(ordered) // 2])
    median["prefill_tok_s"] = sorted(r["prefill_tok_s"] for r in runs)[len(runs) // 2]
    median["runs"] = [{k: r[k] for k in ("decode_tok_s", "prefill_tok_s")} for r in runs]
    return median


def server_rss(folder: str, prompt: list[int], args) -> dict:
    """Resident bytes of deepinfer-serve (API process + ranks) after one request."""
    import tempfile

    import httpx
    import psutil

    port = free_port()
    log_path = os.path.join(tempfile.mkdtemp(prefix="cpu-gguf-"), "server.log")
    proc = start_server([sys.executable, "-m", "deepinfer.serve.cli", "--model", folder,
                         "--port", str(port)], log_path)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base, log_path)
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
        httpx.post(f"{base}/v1/completions", json=body, timeout=600).raise_for_status()
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        # RSS counts a page in every process that maps it: the API and rank processes share
        # torch's libraries (~150 MB). PSS splits each shared page between its processes, so
        # their sum is the memory the server holds.
        full = [p.memory_full_info() for p in tree]
        return {"rss": sum(m.rss for m in full), "pss": sum(m.pss for m in full),
                "processes": len(tree)}
    finally:
        stop_server(proc)


def agreement(a: list[int], b: list[int]) -> dict:
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return {"identical": a == b, "first_difference": first,
            "matching": sum(x == y for x, y in zip(a, b))}


def default_gguf() -> tuple[str, str]:
    from deepinfer.models.default_model import ensure_default_model

    folder = ensure_default_model(progress=False)
    return folder, os.path.join(folder, "model.gguf")


def prompt_ids(folder: str, length: int) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder)(PROMPT_TEXT * 40)["input_ids"]
    return ids[:length]


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    runs = [("llama.cpp", result["llama_cpp"]), ("DeepInfer GGUF", result["deepinfer_gguf"]),
            ("DeepInfer fp32", result["deepinfer_fp32"])]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "decode_tok_s", "batch-1 decode (tok/s)"),
                           (axes[1], "prefill_tok_s", f"{result['prompt_tokens']}-token "
                                                      f"prefill (tok/s)")):
        values = [run[key] for _, run in runs]
        bars = ax.bar([name for name, _ in runs], values, color=["#999", "#1f77b4", "#aec7e8"])
        ax.bar_label(bars, fmt="%.1f")
        ax.set_title(title)
    rss, pss = result.get("server_rss_mb"), result.get("server_pss_mb")
    fig.suptitle(f"SmolLM2-135M Q4_1 GGUF, {result['threads']} threads"
                 + (f"; DeepInfer server RSS {rss:.0f} MB, PSS {pss:.0f} MB" if rss else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", help="a converted folder's model.gguf (default: the "
                                       "embedded default model's)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--llama-venv", default=os.path.expanduser(
        "~/.cache/deepinfer/bench/llama-cpp-venv"))
    parser.add_argument("--rounds", type=int, default=5,
                        help="timed runs of each side, taking turns (medians are reported)")
    parser.add_argument("--skip-server", action="store_true")
    parser.add_argument("--out", default=RESULTS_DIR)
    args = parser.parse_args()
    os.environ["DEEPINFER_CPU_THREADS"] = str(args.threads)
    os.makedirs(args.out, exist_ok=True)
    folder, gguf = (os.path.dirname(args.gguf), args.gguf) if args.gguf else default_gguf()
    prompt = prompt_ids(folder, args.prompt_tokens)
    result = {"environment": machine_environment(), "threads": args.threads,
              "prompt_tokens": len(prompt), "max_tokens": args.max_tokens, "gguf": gguf,
              "rounds": args.rounds}
    python = llama_python(args.llama_venv)
    log(f"llama.cpp and DeepInfer's GGUF blocks, {args.rounds} rounds taking turns ...")
    ours = DeepInferRun(folder, "auto", prompt, args)
    result["llama_cpp"], result["deepinfer_gguf"] = interleaved(
        lambda: run_llama_cpp(python, gguf, prompt, args), ours, args.rounds)
    ours.close()
    log("DeepInfer, dequantized float32 ...")
    fp32 = DeepInferRun(folder, "none", prompt, args)
    result["deepinfer_fp32"] = fp32()
    fp32.close()
    ours, peer, fp32 = result["deepinfer_gguf"], result["llama_cpp"], result["deepinfer_fp32"]
    result["ratios"] = {"decode_vs_llama_cpp": ours["decode_tok_s"] / peer["decode_tok_s"],
                        "prefill_vs_llama_cpp": ours["prefill_tok_s"] / peer["prefill_tok_s"]}
    result["tokens_vs_llama_cpp"] = agreement(ours["tokens"], peer["tokens"])
    result["tokens_vs_fp32"] = agreement(ours["tokens"], fp32["tokens"])
    log(json.dumps({k: result[k] for k in ("ratios", "tokens_vs_llama_cpp", "tokens_vs_fp32")}))
    if not args.skip_server:
        log("deepinfer-serve resident memory ...")
        served = server_rss(folder, prompt, args)
        result["server_rss_mb"] = served["rss"] / 1e6
        result["server_pss_mb"] = served["pss"] / 1e6
    write_json(os.path.join(args.out, "cpu_gguf.json"), result)
    plot(result, os.path.join(args.out, "cpu_gguf.png"))
    for name in ("llama_cpp", "deepinfer_gguf", "deepinfer_fp32"):
        run = result[name]
        print(f"{name:15s} decode {run['decode_tok_s']:7.1f} tok/s  prefill "
              f"{run['prefill_tok_s']:7.1f} tok/s")
    print(json.dumps({k: result[k] for k in ("ratios", "tokens_vs_llama_cpp", "tokens_vs_fp32")
                      + (("server_rss_mb", "server_pss_mb") if "server_rss_mb" in result
                         else ())}, indent=1))


if __name__ == "__main__":
    main()
