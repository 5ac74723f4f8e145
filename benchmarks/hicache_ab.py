"""HiCache A/B on the CPU: `deepinfer.serve.check_prefix_cache` against a live `deepinfer-serve`.

Starts `deepinfer-serve --dtype float32 --hicache-size-gb 1 --kv-cache-memory-gb G --block-size
128` (embedded SmolLM2-135M-Instruct) on a free port, runs the check (each turn of a growing chat
is sent twice, greedy: `prefix_cache: false`, then with the caches; outputs must match token for
token), scrapes `/metrics` before and after every request for the `deepinfer:hicache_*` counters
(so each cached request gets its own load bytes / seconds), writes the raw output, a JSON with
per-turn numbers and a PNG, and stops the server with SIGTERM.

The device pool is kept small, just above the largest prompt, so that the cache-off request of
a turn (a full prefill) evicts the previous turn's blocks from the device and the cache-on
request's hit comes from the host tier.

    python benchmarks/hicache_ab.py                       # 6 turns, ~1.9K -> ~2.6K tokens, ~3.5 min
    python benchmarks/hicache_ab.py --turns 3 --max-tokens 32 --out /tmp/h   # smoke run
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import re
import sys
import time

import httpx

import deepinfer.serve.check_prefix_cache as cpc

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # `common`, also when run from another folder
from common import free_port, pyplot, start_server, stop_server, wait_healthy, write_json  # noqa: E402

HEALTH_TIMEOUT_S = 300.0
COUNTERS = ("lookups", "stored_pages", "loaded_pages", "evicted_pages", "load_bytes",
            "store_bytes", "load_seconds", "store_seconds")
METRIC_RE = re.compile(r'^(deepinfer:hicache_\w+?)(?:_total)?(\{[^}]*\})?\s+([0-9.eE+-]+)$')


def scrape(client: httpx.Client) -> dict[str, float]:
    """deepinfer:hicache_* totals (device/host hit tokens keyed by tier)."""
    out: dict[str, float] = {}
    for line in client.get("/metrics").text.splitlines():
        m = METRIC_RE.match(line)
        if not m or line.endswith("_created") or "_created{" in line:
            continue
        name, labels, value = m.group(1)[len("deepinfer:hicache_"):], m.group(2) or "", m.group(3)
        if name.endswith("_created"):
            continue
        tier = re.search(r'tier="(\w+)"', labels)
        out[f"{name}_{tier.group(1)}" if tier else name] = float(value)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=160,
                   help="answer length per turn; the chat grows by about this much per turn")
    p.add_argument("--system-words", type=int, default=1000)
    p.add_argument("--kv-cache-memory-gb", type=float, default=0.15,
                   help="device pool (0.15 GB = 27 blocks of 128 tokens of SmolLM2 float32)")
    p.add_argument("--hicache-size-gb", type=float, default=1.0)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    port = args.port or free_port()
    cmd = ["deepinfer-serve", "--port", str(port), "--dtype", args.dtype,
           "--hicache-size-gb", str(args.hicache_size_gb),
           "--kv-cache-memory-gb", str(args.kv_cache_memory_gb),
           "--block-size", str(args.block_size)]
    check_cmd = [sys.executable, "-m", "deepinfer.serve.check_prefix_cache", "--port", str(port),
                 "--turns", str(args.turns), "--max-tokens", str(args.max_tokens),
                 "--system-words", str(args.system_words)]
    log_path = os.path.join(args.out, "hicache_server.log")
    server = start_server(cmd, log_path)
    base = f"http://127.0.0.1:{port}"
    requests: list[dict] = []
    t_start = time.time()
    try:
        wait_healthy(server, base, log_path, HEALTH_TIMEOUT_S)

        # Run the check itself (same code as `python -m deepinfer.serve.check_prefix_cache`),
        # with run_arm wrapped to scrape /metrics around each request.
        orig = cpc.run_arm

        def run_arm(client, model, prompt_ids, max_tokens, prefix_cache):
            before = scrape(client)
            arm = orig(client, model, prompt_ids, max_tokens, prefix_cache)
            time.sleep(0.2)
            after = scrape(client)
            delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
            requests.append({"prefix_cache": prefix_cache, "prompt_tokens": len(prompt_ids),
                             "cached_tokens": arm.cached_tokens, "ttft_s": arm.ttft,
                             "output_tokens": len(arm.tokens), "tokens": arm.tokens,
                             "hicache_delta": delta})
            return arm

        cpc.run_arm = run_arm
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = cpc.main(check_cmd[3:])
        cpc.run_arm = orig
        output = buf.getvalue()
        print(output, end="")
        with httpx.Client(base_url=base) as c:
            metrics_text = c.get("/metrics").text
            totals = scrape(c)
    finally:
        stop_server(server)

    turns = []
    for i in range(0, len(requests) - 1, 2):
        off, on = requests[i], requests[i + 1]
        d = on["hicache_delta"]
        lb, ls = d.get("load_bytes", 0.0), d.get("load_seconds", 0.0)
        diff = cpc.first_difference(off["tokens"], on["tokens"])
        turns.append({
            "turn": i // 2, "prompt_tokens": on["prompt_tokens"],
            "cached_tokens": on["cached_tokens"],
            "host_hit_tokens": d.get("hit_tokens_host", 0.0),
            "device_hit_tokens": d.get("hit_tokens_device", 0.0),
            "ttft_off_s": off["ttft_s"], "ttft_on_s": on["ttft_s"],
            "ttft_ratio_off_over_on": off["ttft_s"] / on["ttft_s"],
            "same_tokens": diff is None, "first_diff": diff,
            "output_tokens": on["output_tokens"],
            "load_pages": d.get("loaded_pages", 0.0), "load_bytes": lb, "load_seconds": ls,
            "load_gb_per_s": lb / ls / 1e9 if ls else None,
            "store_bytes_off_request": off["hicache_delta"].get("store_bytes", 0.0),
            "store_seconds_off_request": off["hicache_delta"].get("store_seconds", 0.0),
            "store_bytes_on_request": d.get("store_bytes", 0.0),
            "store_seconds_on_request": d.get("store_seconds", 0.0),
        })
    sb, ss = totals.get("store_bytes", 0.0), totals.get("store_seconds", 0.0)
    lb, ls = totals.get("load_bytes", 0.0), totals.get("load_seconds", 0.0)
    result = {
        "server_cmd": cmd, "check_cmd": check_cmd, "exit_status": rc,
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime(t_start)),
        "wall_s": time.time() - t_start, "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "turns": turns,
        "totals": {**totals, "load_gb_per_s": lb / ls / 1e9 if ls else None,
                   "store_gb_per_s": sb / ss / 1e9 if ss else None},
        "requests": requests,
    }
    with open(os.path.join(args.out, "hicache_check.txt"), "w") as f:
        f.write("$ " + " ".join(cmd) + "\n$ " + " ".join(check_cmd) + "\n" + output)
        f.write("\n# /metrics after the run (deepinfer:hicache_*)\n")
        f.write("\n".join(line for line in metrics_text.splitlines()
                          if line.startswith("deepinfer:hicache") and "_created" not in line)
                + "\n")
    write_json(os.path.join(args.out, "hicache_check.json"), result, indent=1)
    plot(turns, os.path.join(args.out, "hicache_check.png"))
    return rc


def plot(turns: list[dict], path: str) -> None:
    plt = pyplot()

    x = [t["prompt_tokens"] for t in turns]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [t["ttft_off_s"] for t in turns], "o-", label="cache off (full prefill)")
    ax.plot(x, [t["ttft_on_s"] for t in turns], "s-", label="cache on (device + host-tier hits)")
    for t in turns:
        ax.annotate(f"{t['ttft_ratio_off_over_on']:.0f}x", (t["prompt_tokens"], t["ttft_on_s"]),
                    textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xlabel("prompt tokens (turn)")
    ax.set_ylabel("TTFT, s")
    ax.set_yscale("log")
    ax.set_title("HiCache A/B, SmolLM2-135M float32, 2-core CPU")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
