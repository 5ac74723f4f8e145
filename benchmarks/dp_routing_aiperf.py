"""Data-parallel routing under aiperf's multi-turn chat: `--routing affinity` vs `least-loaded`.

For each routing policy (alternating order per repeat) the script starts `deepinfer-serve --dp 2`
(embedded SmolLM2-135M-Instruct in float32, one torch thread per rank, a small device KV pool and
a HiCache host tier per rank), runs aiperf's user-centric multi-turn chat replay against it:

    aiperf profile --endpoint-type chat --endpoint /v1/chat/completions --streaming
        --use-server-token-count --user-centric-rate R --num-users U
        --conversation-turn-mean T --isl I --osl O --request-count N ...

Each aiperf user is a conversation whose turns carry the whole history (the previous answers
included) and the same X-Correlation-ID header, which the affinity router keys on. Then the
script scrapes /metrics (HiCache hit tokens per tier, prompt tokens looked up, router decisions
per rank) and stops the server. Writes results/dp_routing.json (every run, medians per policy)
and results/dp_routing.png.

    python benchmarks/dp_routing_aiperf.py                     # 3 repeats per policy, ~12 min
    python benchmarks/dp_routing_aiperf.py --repeats 1 --requests 16 --out /tmp/dp   # smoke
    python benchmarks/dp_routing_aiperf.py --replot benchmarks/results/dp_routing.json

aiperf is a separate install (its own virtual environment is fine): `pip install aiperf`, then
pass `--aiperf /path/to/venv/bin/aiperf` unless `aiperf` is on PATH.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # `common`, also when run from another folder
from common import (  # noqa: E402
    free_port,
    log,
    machine_environment,
    pyplot,
    replot,
    start_server,
    stop_server,
    wait_healthy,
    write_json,
)

POLICIES = ("affinity", "least-loaded")
METRIC_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="runs per policy")
    # Odd on purpose: aiperf replays the users' turns in a fixed round, and with an even number
    # of users and two ranks a round-robin (least-loaded among idle ranks) would pin every user
    # to one rank by coincidence.
    p.add_argument("--num-users", type=int, default=9, help="concurrent conversations")
    p.add_argument("--rate", type=float, default=0.6, help="requests/s over all users")
    p.add_argument("--turns", type=int, default=5, help="turns per conversation")
    p.add_argument("--isl", type=int, default=150, help="new user tokens per turn")
    p.add_argument("--osl", type=int, default=12, help="answer tokens per turn")
    p.add_argument("--requests", type=int, default=40, help="requests per run")
    p.add_argument("--num-kv-blocks", type=int, default=64,
                   help="device KV blocks per rank: about one conversation's worth, so most "
                        "hits come from the host tier")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hicache-size-gb", type=float, default=0.5, help="host tier per rank")
    p.add_argument("--max-num-seqs", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--model", default=None, help="HF folder; default: the embedded SmolLM2")
    p.add_argument("--aiperf", default=shutil.which("aiperf") or "aiperf")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--note", default="")
    p.add_argument("--replot", default=None, help="redraw the PNG from this JSON and exit")
    return p.parse_args(argv)


# ---- one run -------------------------------------------------------------------------------
def server_command(args: argparse.Namespace, port: int, routing: str) -> list[str]:
    cmd = [sys.executable, "-m", "deepinfer.serve.cli", "--port", str(port), "--dp", "2",
           "--routing", routing, "--dtype", "float32", "--block-size", str(args.block_size),
           "--num-kv-blocks", str(args.num_kv_blocks), "--hicache-size-gb",
           str(args.hicache_size_gb), "--max-num-seqs", str(args.max_num_seqs),
           "--seed", str(args.seed), "--log-level", "warning"]
    return cmd + (["--model", args.model] if args.model else [])


def aiperf_command(args: argparse.Namespace, url: str, model_name: str, tokenizer: str,
                   artifacts: str) -> list[str]:
    return [args.aiperf, "profile", "--model", model_name, "--tokenizer", tokenizer,
            "--url", url, "--endpoint-type", "chat", "--endpoint", "/v1/chat/completions",
            "--streaming", "--use-server-token-count",
            "--user-centric-rate", str(args.rate), "--num-users", str(args.num_users),
            # More conversations than the run can finish, so --request-count ends it (aiperf
            # starts some users part-way into their conversation).
            "--conversation-num", str(2 * max(args.num_users, args.requests // args.turns)),
            "--conversation-turn-mean", str(args.turns), "--conversation-turn-stddev", "0",
            "--isl", str(args.isl), "--osl", str(args.osl),
            "--request-count", str(args.requests), "--random-seed", str(args.seed),
            "--extra-inputs", "temperature:0", "--extra-inputs", "ignore_eos:true",
            "--export-http-trace",
            "--workers-max", "1", "--record-processors", "1", "--ui", "none",
            "--no-server-metrics", "--no-gpu-telemetry", "--artifact-dir", artifacts]


def run_policy(args: argparse.Namespace, routing: str, repeat: int, model_dir: str) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    name = os.path.basename(os.path.normpath(model_dir))
    tag = f"{routing}-{repeat}"
    artifacts = os.path.join(args.out, "dp_routing_aiperf", tag)
    shutil.rmtree(artifacts, ignore_errors=True)
    os.makedirs(artifacts)
    server_log = os.path.join(artifacts, "server.log")
    cmd = server_command(args, port, routing)
    server = start_server(cmd, server_log, env={"DEEPINFER_CPU_THREADS": str(args.threads),
                                                "TOKENIZERS_PARALLELISM": "false"})
    try:
        wait_healthy(server, base, server_log)
        bench = aiperf_command(args, base, name, model_dir, artifacts)
        log(f"[{tag}] {' '.join(bench)}")
        t0 = time.monotonic()
        with open(os.path.join(artifacts, "aiperf.log"), "w") as out:
            rc = subprocess.run(bench, stdout=out, stderr=subprocess.STDOUT).returncode
        wall = time.monotonic() - t0
        metrics = scrape(base)
    finally:
        stop_server(server)
    if rc != 0:
        raise RuntimeError(f"aiperf exited with {rc}; see {artifacts}/aiperf.log")
    run = {"routing": routing, "repeat": repeat, "aiperf_wall_s": round(wall, 1),
           # Other work on the machine would show here (this benchmark alone keeps it near 1).
           "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
           "server_cmd": cmd, "aiperf_cmd": bench, **summarize(artifacts, metrics)}
    log(f"[{tag}] TTFT p50 {run['ttft_ms']['p50']:.0f} ms, p90 {run['ttft_ms']['p90']:.0f} ms, "
        f"host-tier hit rate {run['cache']['host_hit_rate']:.1%}")
    return run


def scrape(base: str) -> dict[tuple[str, str], float]:
    """/metrics as {(name, labels): value}."""
    import httpx

    out = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        m = METRIC_RE.match(line)
        if m and not m.group(1).endswith("_created"):
            out[m.group(1), m.group(2) or ""] = float(m.group(3))
    return out


def _sum(metrics: dict, name: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for (n, lab), v in metrics.items() if n == name and all(w in lab for w in want))


# ---- what a run measured -------------------------------------------------------------------
def summarize(artifacts: str, metrics: dict) -> dict[str, Any]:
    with open(os.path.join(artifacts, "profile_export_aiperf.json")) as f:
        agg = json.load(f)
    records = read_records(os.path.join(artifacts, "profile_export.jsonl"))
    prompt = _sum(metrics, "vllm:prefix_cache_queries_total")
    device = _sum(metrics, "deepinfer:hicache_hit_tokens_total", tier="device")
    host = _sum(metrics, "deepinfer:hicache_hit_tokens_total", tier="host")
    by_turn: dict[int, list[float]] = {}
    for r in records:
        by_turn.setdefault(r["turn"], []).append(r["ttft_ms"])
    sessions: dict[str, list] = {}  # conversation -> the rank of each of its turns
    for r in records:
        sessions.setdefault(r["session"], []).append(r["rank"])
    multi_turn = [set(ranks) for ranks in sessions.values() if len(ranks) > 1]
    return {
        "requests": len(records),
        "errors": agg.get("error_summary") or [],
        "ttft_ms": {k: agg["time_to_first_token"][k] for k in ("avg", "p50", "p90", "p99")},
        "itl_ms_p50": agg["inter_token_latency"]["p50"],
        "isl_avg": agg["input_sequence_length"]["avg"],
        "ttft_ms_p50_by_turn": {str(t): statistics.median(v) for t, v in sorted(by_turn.items())},
        "cache": {
            "prompt_tokens": prompt, "device_hit_tokens": device, "host_hit_tokens": host,
            "host_hit_rate": host / prompt if prompt else 0.0,
            "total_hit_rate": (device + host) / prompt if prompt else 0.0,
            "server_cached_pct": agg.get("overall_usage_prompt_cache_read_pct", {}).get("avg"),
            "stored_pages": _sum(metrics, "deepinfer:hicache_stored_pages_total"),
            "loaded_pages": _sum(metrics, "deepinfer:hicache_loaded_pages_total"),
        },
        "ranks": {
            "requests": {r: _sum(metrics, "deepinfer:router_decisions_total", rank=str(r))
                         for r in (0, 1)},
            "decisions": {reason: _sum(metrics, "deepinfer:router_decisions_total",
                                       reason=reason)
                          for reason in ("affinity", "fallback_overloaded", "least_loaded",
                                         "rerouted_dead")},
            "prompt_tokens": {r: _sum(metrics, "deepinfer:rank_prefix_cache_queries_total",
                                      rank=str(r)) for r in (0, 1)},
            "sessions": len(sessions),
            "multi_turn_sessions": len(multi_turn),
            "multi_turn_sessions_on_one_rank": sum(len(s) == 1 for s in multi_turn),
        },
    }


def read_records(path: str) -> list[dict]:
    """Per request: session, turn, TTFT and the serving rank (x-deepinfer-rank header)."""
    out = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            meta, m = r["metadata"], r["metrics"]
            if "time_to_first_token" not in m:
                continue
            out.append({"session": meta.get("x_correlation_id"), "turn": meta["turn_index"],
                        "ttft_ms": m["time_to_first_token"]["value"],
                        "rank": _rank_header(r.get("trace_data") or {})})
    return out


def _rank_header(trace: dict) -> int | None:
    headers = trace.get("response_headers") or {}
    value = {k.lower(): v for k, v in headers.items()}.get("x-deepinfer-rank")
    return int(value) if value is not None else None


# ---- report --------------------------------------------------------------------------------
def medians(runs: list[dict]) -> dict[str, dict]:
    out = {}
    for policy in POLICIES:
        mine = [r for r in runs if r["routing"] == policy]
        if not mine:
            continue
        med = lambda f: statistics.median(f(r) for r in mine)  # noqa: E731
        out[policy] = {
            "runs": len(mine),
            "ttft_ms_p50": med(lambda r: r["ttft_ms"]["p50"]),
            "ttft_ms_p90": med(lambda r: r["ttft_ms"]["p90"]),
            "host_hit_rate": med(lambda r: r["cache"]["host_hit_rate"]),
            "total_hit_rate": med(lambda r: r["cache"]["total_hit_rate"]),
            "prompt_tokens": med(lambda r: r["cache"]["prompt_tokens"]),
            "multi_turn_sessions_on_one_rank_pct": med(
                lambda r: 100 * r["ranks"]["multi_turn_sessions_on_one_rank"]
                / max(1, r["ranks"]["multi_turn_sessions"])),
        }
    return out


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    med, runs = result["medians"], result["runs"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(13, 4))
    for i, policy in enumerate(med):
        for j, key in enumerate(("ttft_ms_p50", "ttft_ms_p90")):
            x = i * 3 + j
            ax1.bar(x, med[policy][key], color=f"C{i}", alpha=0.6 if j else 1.0,
                    label=f"{policy} {key[-3:]}")
            ax1.plot([x] * sum(r["routing"] == policy for r in runs),
                     [r["ttft_ms"][key[-3:]] for r in runs if r["routing"] == policy], "k.")
        ax2.bar([i * 3, i * 3 + 1], [100 * med[policy]["host_hit_rate"],
                                     100 * med[policy]["total_hit_rate"]], color=f"C{i}")
        turns = [r["ttft_ms_p50_by_turn"] for r in runs if r["routing"] == policy]
        keys = sorted({int(t) for d in turns for t in d})
        ax3.plot([k + 1 for k in keys],
                 [statistics.median(d[str(k)] for d in turns if str(k) in d) for k in keys],
                 "o-", color=f"C{i}", label=policy)
        ax3.set_xticks([k + 1 for k in keys])
    ax1.set_xticks([0.5, 3.5], list(med))
    ax1.set_ylabel("TTFT, ms (bars: median of runs; dots: runs)")
    ax1.set_title("TTFT p50 (solid) and p90 (light)")
    ax2.set_xticks([0, 1, 3, 4], ["host tier", "all tiers"] * 2)
    ax2.set_ylabel("% of prompt tokens served from cache")
    ax2.set_title("cache hit rate: " + " | ".join(med))
    ax3.set_xlabel("turn of the conversation")
    ax3.set_ylabel("TTFT p50, ms")
    ax3.set_title("TTFT by turn")
    ax3.legend()
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
    fig.suptitle("deepinfer-serve --dp 2 (SmolLM2-135M float32, CPU, 1 thread/rank), "
                 "aiperf multi-turn chat")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:
        return replot(args.replot, plot)
    from deepinfer.models.default_model import resolve_model_path

    model_dir = resolve_model_path(args.model)
    runs = []
    for repeat in range(args.repeats):
        order = POLICIES if repeat % 2 == 0 else POLICIES[::-1]
        runs += [run_policy(args, routing, repeat, model_dir) for routing in order]
    result = {"environment": machine_environment(), "note": args.note,
              "settings": {k: v for k, v in vars(args).items() if k not in ("replot",)},
              "medians": medians(runs), "runs": runs}
    path = write_json(os.path.join(args.out, "dp_routing.json"), result)
    plot(result, os.path.join(args.out, "dp_routing.png"))
    print(json.dumps(result["medians"], indent=1))
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
