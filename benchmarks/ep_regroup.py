"""Expert-parallel rank loss: how long a `deepinfer-serve --dp 2` MoE server answers 503 after
one of its ranks is SIGKILLed, against how long one rank takes to start.

Per repeat a fresh server on the tiny random Qwen3-MoE checkpoint of the expert-parallel server
tests (8 experts, top-2, one MoE layer, the SmolLM2 tokenizer; --dp 2 is expert parallel for an
MoE checkpoint) with the default rank-health flags (restart backoff 1 s before a rank's first
restart). Once it serves, rank 1 is SIGKILLed and, from the kill, a 2-token greedy completion is
sent every 50 ms (each one waited for) and /health is read after each:

- outage_s: the kill to the first answered (200) completion;
- spawn_seen_s / serving_seen_s: when /health first shows rank 1 with a new pid, and `serving`;
- rank_start_s: the server log's "ready N s after its spawn" for the restarted rank (spawn to
  Ready, which the API process measures; absent on servers that do not log it);
- survivor_restarted: whether rank 0's pid changed.

With --busy N, N processes spin on the CPU for the whole run (cores shared with other work).
Writes results/ep_regroup.json (every repeat and the medians).

    python benchmarks/ep_regroup.py                       # 3 repeats, ~2 min on 2 cores
    python benchmarks/ep_regroup.py --busy 2 --out benchmarks/results/ep_regroup_busy.json
    python benchmarks/ep_regroup.py --repeats 1 --out /tmp/ep.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # `common`, also when run from another folder
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # checkpoints.make_checkpoint
from common import (  # noqa: E402
    free_port,
    log,
    machine_environment,
    start_server,
    stop_server,
    wait_healthy,
    write_json,
)

POLL_S = 0.05
PROMPT = [100 + 13 * j for j in range(9)]
SERVER_FLAGS = ["--served-model-name", "tiny-moe", "--dtype", "float32", "--block-size", "16",
                "--num-kv-blocks", "128", "--max-num-seqs", "8", "--dp", "2"]
READY_LOG = re.compile(r"engine rank 1 \(pid \d+\).* ready ([0-9.]+) s after its spawn")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="fresh servers, one kill each")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for recovery")
    p.add_argument("--out", default=os.path.join(HERE, "results", "ep_regroup.json"))
    p.add_argument("--busy", type=int, default=0, help="processes spinning on the CPU")
    p.add_argument("--note", default="")
    p.add_argument("--plot", nargs="+", metavar="JSON",
                   help="draw these results side by side (ep_regroup.png beside the first) "
                        "instead of running")
    return p.parse_args(argv)


def _median(result: dict, key: str) -> float:
    """A median of the result; a whole-group restart logs no rank's start: its ranks' start
    as /health saw it (a new pid starting, to serving)."""
    median = result["median"]
    if key == "rank_start_s" and median.get(key) is None:
        return median["serving_seen_s"] - median["spawn_seen_s"]
    return median.get(key) or 0.0


def plot(paths: list[str]) -> str:
    """Median outage and one rank's start of each result file; the PNG's path."""
    from common import pyplot

    plt = pyplot()
    results = []
    for path in paths:
        with open(path) as f:
            results.append(json.load(f))
    labels = [f"{(r['note'] or os.path.basename(p)).split(',')[0].split(':')[0]}\n"
              f"{'busy' if r['busy'] else 'quiet'} cores" for r, p in zip(results, paths)]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for k, (key, label) in enumerate((("outage_s", "outage (kill to first answer)"),
                                      ("rank_start_s", "rank start (whole group: all "
                                                       "ranks')"))):
        ax.bar([i + (k - 0.5) * 0.4 for i in range(len(results))],
               [_median(r, key) for r in results], 0.4, label=label)
    ax.set_xticks(range(len(results)), labels, fontsize=8)
    ax.set_ylabel("seconds (median)")
    ax.set_title("main: the whole group restarts; regroup: only the killed rank")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = os.path.join(os.path.dirname(paths[0]), "ep_regroup.png")
    fig.savefig(out, dpi=120)
    return out


def make_moe_checkpoint(path: str) -> str:
    """The expert-parallel server tests' checkpoint: tiny random Qwen3-MoE, SmolLM2 tokenizer."""
    from checkpoints import make_moe_chat_checkpoint

    return make_moe_chat_checkpoint(path)


def complete(http, base: str) -> int:
    reply = http.post(f"{base}/v1/completions", json={"model": "tiny-moe", "prompt": PROMPT,
                                                      "max_tokens": 2, "temperature": 0})
    return reply.status_code


def kill_and_recover(http, base: str, timeout: float) -> dict[str, Any]:
    before = http.get(f"{base}/health").json()["ranks"]
    killed = time.monotonic()
    os.kill(before[1]["pid"], signal.SIGKILL)
    seen: dict[str, float] = {}
    outage = None
    while time.monotonic() - killed < timeout:
        status = complete(http, base)
        now = time.monotonic() - killed
        if status == 200 and outage is None:
            outage = now
        rank1 = http.get(f"{base}/health").json()["ranks"][1]
        if rank1["pid"] != before[1]["pid"]:
            seen.setdefault("spawn_seen_s", now)
            if rank1["state"] == "serving":
                seen.setdefault("serving_seen_s", now)
        if outage is not None and "serving_seen_s" in seen:
            break
        time.sleep(POLL_S)
    if outage is None:
        raise TimeoutError(f"no answer within {timeout:.0f} s of the kill")
    after = http.get(f"{base}/health").json()["ranks"]
    return {"outage_s": round(outage, 3), **{k: round(v, 3) for k, v in seen.items()},
            "survivor_restarted": after[0]["pid"] != before[0]["pid"],
            "restarts": [r["restarts"] for r in after]}


def run_once(ckpt: str, workdir: str, repeat: int, timeout: float) -> dict[str, Any]:
    import httpx

    port, log_path = free_port(), os.path.join(workdir, f"server-{repeat}.log")
    cmd = [sys.executable, "-m", "deepinfer.serve.cli", "--port", str(port), "--model", ckpt,
           *SERVER_FLAGS]
    proc = start_server(cmd, log_path)
    base = f"http://127.0.0.1:{port}"
    try:
        cold = wait_healthy(proc, base, log_path)
        with httpx.Client(timeout=30) as http:
            assert complete(http, base) == 200
            result = kill_and_recover(http, base, timeout)
    finally:
        stop_server(proc)
    with open(log_path) as f:
        starts = READY_LOG.findall(f.read())
    result["cold_start_s"] = round(cold, 2)
    result["rank_start_s"] = float(starts[-1]) if starts else None
    if result["rank_start_s"] is not None:
        result["outage_minus_rank_start_s"] = round(result["outage_s"] - result["rank_start_s"], 3)
    log(f"repeat {repeat}: {result}")
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot:
        log(f"wrote {plot(args.plot)}")
        return 0
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(args.busy)]
    try:
        with tempfile.TemporaryDirectory(prefix="ep-regroup-") as workdir:
            ckpt = make_moe_checkpoint(os.path.join(workdir, "tiny-moe"))
            runs = [run_once(ckpt, workdir, i, args.timeout) for i in range(args.repeats)]
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    keys = ("outage_s", "rank_start_s", "outage_minus_rank_start_s", "spawn_seen_s",
            "serving_seen_s", "cold_start_s")
    medians = {k: statistics.median(vals) for k in keys
               if (vals := [r[k] for r in runs if r.get(k) is not None])}
    out = {"machine": machine_environment(), "load_avg_1m": os.getloadavg()[0],
           "note": args.note, "busy": args.busy, "flags": SERVER_FLAGS, "runs": runs,
           "median": medians}
    log(f"median: {medians}; wrote {write_json(args.out, out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
