"""Agent sessions against `deepinfer-serve`, per cache setting: TTFT over turns, cached share, wall.

N sessions x T turns, all sessions at once, streamed (/v1/completions with token-id prompts and
`stream_options.include_usage`): a shared system prompt, a per-session context, then each turn
adds new user tokens and generates a fixed number (ignore_eos); the next turn's prompt is the
last prompt + its answer + new tokens. Each session sends `X-Session-Affinity`. Settings:

  off          --no-prefix-caching
  device       the device prefix cache only
  host         device + HiCache host tier (--hicache-size-gb)
  disk         device + host + disk tier (--hicache-disk-dir, a fresh folder)
  restart      as disk, but the server is stopped after the first turn and a new one started
               over the same folder: the second turn's hits come from disk
  least        as host, with --routing least-loaded (with --dp 2: sessions move between ranks,
               and find their pages in the node's shared host pool)
  least_private  as least, with a host pool per rank (--no-hicache-shared): a session that
               moved finds its pages only where the disk tier has them
  least_disk   as least_private, with the disk tier: the ranks share its folder

    python benchmarks/agent_sessions.py                    # CPU, embedded SmolLM2, tiny sizes
    python benchmarks/agent_sessions.py --settings off,host,restart --sessions 64 --turns 6 \\
        --system 2048 --context 1024 --new 512 --output 128 --vocab 128000 \\
        --server-args "--model /path/llama3-8b --load-format dummy --hicache-size-gb 64"

Writes agent_sessions.json and agent_sessions.png (TTFT mean per turn, one line per setting).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import sys
import tempfile
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import (  # noqa: E402
    free_port,
    machine_environment,
    percentile,
    pyplot,
    start_server,
    stop_server,
    wait_healthy,
    write_json,
)

SETTINGS = {
    "off": ["--no-prefix-caching"],
    "device": [],
    "host": ["HOST"],
    "disk": ["HOST", "DISK"],
    "restart": ["HOST", "DISK"],
    "least": ["HOST", "--routing", "least-loaded"],
    "least_private": ["HOST", "--no-hicache-shared", "--routing", "least-loaded"],
    "least_disk": ["HOST", "DISK", "--no-hicache-shared", "--routing", "least-loaded"],
}


class Server:
    def __init__(self, args: argparse.Namespace, flags: list[str], log_path: str) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "deepinfer.serve.cli", "--port", str(self.port),
               *shlex.split(args.server_args), *flags]
        self.log_path = log_path
        self.proc = start_server(cmd, log_path)
        self.base = f"http://127.0.0.1:{self.port}"
        wait_healthy(self.proc, self.base, log_path)
        self.model = httpx.get(f"{self.base}/v1/models", timeout=10.0).json()["data"][0]["id"]

    def stop(self) -> None:
        stop_server(self.proc)


async def one_turn(client: httpx.AsyncClient, model: str, session: int, prompt: list[int],
                   output: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": output, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    t0 = time.perf_counter()
    ttft, answer, usage = None, [], {}
    async with client.stream("POST", "/v1/completions", json=body,
                             headers={"X-Session-Affinity": f"s{session}"}) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                ids = choice.get("token_ids") or []
                if ids and ttft is None:
                    ttft = time.perf_counter() - t0
                answer.extend(ids)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"ttft_s": ttft if ttft is not None else time.perf_counter() - t0,
            "prompt_tokens": usage.get("prompt_tokens", len(prompt)), "cached_tokens": cached,
            "answer": answer}


def workload(args: argparse.Namespace) -> tuple[list[int], list[list[int]], list[list[list[int]]]]:
    rng = random.Random(args.seed)
    tok = lambda n: [rng.randrange(100, args.vocab) for _ in range(n)]  # noqa: E731
    system = tok(args.system)
    contexts = [tok(args.context) for _ in range(args.sessions)]
    news = [[tok(args.new) for _ in range(args.turns)] for _ in range(args.sessions)]
    return system, contexts, news


async def run_turns(server: Server, prompts: list[list[int]], news, turns: range, output: int,
                    records: list[list[dict]]) -> None:
    """Turns `turns` of every session, all sessions at once per turn; prompts grow in place,
    by each turn's new tokens and then its answer (the generated ids, as an agent sends the
    model's reply back)."""
    limits = httpx.Limits(max_connections=len(prompts) + 8)
    async with httpx.AsyncClient(base_url=server.base, timeout=600.0, limits=limits) as client:
        for t in turns:
            for s, prompt in enumerate(prompts):
                prompt.extend(news[s][t])
            rows = await asyncio.gather(*(one_turn(client, server.model, s, list(p), output)
                                          for s, p in enumerate(prompts)))
            records[t] = [{k: v for k, v in r.items() if k != "answer"} for r in rows]
            for prompt, row in zip(prompts, rows):
                prompt.extend(row["answer"])


def warm_up(server: Server, args: argparse.Namespace) -> None:
    """One turn of other sessions' prompts (other random tokens), then the caches reset: the
    kernels the workload's shapes need are compiled before anything is timed, and the first
    setting measured is not the one that pays for them."""
    rng = random.Random(args.seed + 1)
    length = args.system + args.context + args.new
    prompts = [[rng.randrange(1, args.vocab) for _ in range(length)]
               for _ in range(args.sessions)]
    no_news = [[[]] for _ in prompts]  # turn 0 adds nothing to the prompts
    asyncio.run(run_turns(server, prompts, no_news, range(1), args.output, [[]]))
    r = httpx.post(f"{server.base}/reset_prefix_cache", timeout=60.0)
    r.raise_for_status()


def summarize(records: list[list[dict]]) -> list[dict]:
    out = []
    for rows in records:
        ttfts = [r["ttft_s"] for r in rows]
        prompt = sum(r["prompt_tokens"] for r in rows)
        out.append({"ttft_mean_s": sum(ttfts) / len(ttfts), "ttft_p50_s": percentile(ttfts, 50),
                    "ttft_p99_s": percentile(ttfts, 99),
                    "cached_share": sum(r["cached_tokens"] for r in rows) / max(1, prompt)})
    return out


def run_setting(name: str, args: argparse.Namespace, scratch: str) -> dict:
    flags: list[str] = []
    disk_dir = os.path.join(scratch, f"disk-{name}")
    for flag in SETTINGS[name]:
        flags += {"HOST": ["--hicache-size-gb", str(args.host_gb)],
                  "DISK": ["--hicache-disk-dir", disk_dir]}.get(flag, [flag])
    system, contexts, news = workload(args)
    prompts = [system + c for c in contexts]
    records: list[list[dict]] = [[] for _ in range(args.turns)]
    log_path = os.path.join(args.out, f"agent_sessions_{name}.log")
    t0 = time.perf_counter()
    server = Server(args, flags, log_path)
    start_s = time.perf_counter() - t0
    if args.warmup:
        warm_up(server, args)
    t0, restart_s = time.perf_counter(), 0.0
    try:
        if name == "restart":
            asyncio.run(run_turns(server, prompts, news, range(1), args.output, records))
            server.stop()
            t_restart = time.perf_counter()
            server = Server(args, flags, log_path + ".2")
            restart_s = time.perf_counter() - t_restart
            asyncio.run(run_turns(server, prompts, news, range(1, args.turns), args.output,
                                  records))
        else:
            asyncio.run(run_turns(server, prompts, news, range(args.turns), args.output,
                                  records))
    finally:
        server.stop()
    wall = time.perf_counter() - t0 - restart_s  # the requests' time, not the new start's
    turns = summarize(records)
    rows = [r for turn in records for r in turn]
    share = sum(r["cached_tokens"] for r in rows) / max(1, sum(r["prompt_tokens"] for r in rows))
    print(f"{name:8s} wall {wall:7.1f} s  cached {share:6.1%}  TTFT mean by turn: "
          + " ".join(f"{t['ttft_mean_s']:.2f}" for t in turns), flush=True)
    return {"flags": flags, "server_start_s": start_s, "restart_s": restart_s, "wall_s": wall,
            "cached_share": share, "turns": turns}


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    w = result["workload"]
    for name, r in result["settings"].items():
        ax.plot(range(1, len(r["turns"]) + 1), [t["ttft_mean_s"] for t in r["turns"]],
                marker="o", label=f"{name} ({r['cached_share']:.0%} cached, {r['wall_s']:.0f} s)")
    ax.set_xticks(range(1, w["turns"] + 1))
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT mean (s)")
    ax.set_title(f"{w['sessions']} agent sessions x {w['turns']} turns "
                 f"({w['system']}+{w['context']} then +{w['new']} / {w['output']} out)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default="off,device,host,restart")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system", type=int, default=512, help="shared system prompt tokens")
    p.add_argument("--context", type=int, default=256, help="per-session context tokens")
    p.add_argument("--new", type=int, default=128, help="new user tokens per turn")
    p.add_argument("--output", type=int, default=16, help="generated tokens per turn")
    p.add_argument("--vocab", type=int, default=30000, help="prompt token ids are drawn below")
    p.add_argument("--host-gb", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="measure from the first request (the first setting then pays for "
                        "compiling the kernels its shapes need)")
    p.add_argument("--server-args", default="--dtype float32 --block-size 64 "
                   "--num-kv-blocks 96 --max-num-seqs 8",
                   help="deepinfer-serve flags common to every setting (the CPU default: the "
                        "embedded model, a device pool of a third of the sessions' tokens)")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args(argv)
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        p.error(f"unknown settings {unknown}; known: {', '.join(SETTINGS)}")
    os.makedirs(args.out, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="agent-sessions-")
    try:
        result = {"workload": {k: getattr(args, k) for k in
                               ("sessions", "turns", "system", "context", "new", "output",
                                "vocab", "host_gb", "server_args")},
                  "environment": machine_environment(),
                  "settings": {name: run_setting(name, args, scratch) for name in names}}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    write_json(os.path.join(args.out, "agent_sessions.json"), result)
    plot(result, os.path.join(args.out, "agent_sessions.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
