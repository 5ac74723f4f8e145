"""TTFT of a long token-id prompt through deepinfer-serve: cold, device prefix-cache hit and
HiCache host-tier hit.

For each repeat, prompt A (random ids) is sent with the caches off (cold), then with them on
(prefilled and stored), then again (a device hit), then a second prompt B of the same length
pushes A's pages out of a device pool sized for one prompt, and A once more is a host-tier hit.
With --disk (and the server's --hicache-disk-dir), a third prompt C is stored, more prompts
push it out of the device and host tiers, its files are written back, synced and dropped from
the OS page cache (posix_fadvise), and C once more is a disk-tier hit: read from the disk as it
is, then loaded. The disk's own read rate is measured beside it (a file written, dropped from
the page cache and read back). Every request streams one token; TTFT is the client's time to
that token, and each hit is reported as a share of cold (a hit still prefills at least the
prompt's last page).

    python benchmarks/hit_ttft.py --tokens 32768 -- --model DIR --load-format dummy \\
        --dtype bfloat16 --hicache-size-gb 12 --num-kv-blocks 300
(everything after `--` goes to deepinfer-serve). Writes hit_ttft.json and hit_ttft.png.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))  # this tree's client, whichever server is measured
from common import (  # noqa: E402
    free_port,
    log,
    percentile,
    pyplot,
    random_prompts,
    start_server,
    stop_server,
    wait_healthy,
    write_json,
)
from serve_overhead import summarize_collapsed  # noqa: E402

from deepinfer.serve.check_prefix_cache import run_arm  # noqa: E402

ARMS = ("cold", "device_hit", "host_hit")
DISK_ARMS = ARMS + ("disk_hit",)


def first_token(client: httpx.Client, model: str, ids: list[int], prefix_cache: bool
                ) -> tuple[float, int]:
    """(seconds to the first streamed token, cached prompt tokens) of one request."""
    arm = run_arm(client, model, ids, 1, prefix_cache, logprobs=None, ignore_eos=True)
    if arm.ttft != arm.ttft:  # NaN: no token came
        raise RuntimeError("the stream ended without a token")
    return arm.ttft, arm.cached_tokens


def repeat(client: httpx.Client, model: str, a: list[int], b: list[int],
           spy_pid: int | None = None, keep: str | None = None, settle: float = 0.0) -> dict:
    """One repeat's three arms; with `spy_pid`, py-spy over the server while its device hit
    runs (the first hit after the prompt was stored), its raw stacks copied to `keep`. Each
    hit follows the request that stored its pages (or pushed them out) after `settle` seconds:
    0 measures a hit behind that request's write-through, more one on an idle server."""
    out, profile = {}, None
    out["cold"] = first_token(client, model, a, prefix_cache=False)
    first_token(client, model, a, prefix_cache=True)  # prefilled and stored
    time.sleep(settle)
    if spy_pid is None:
        out["device_hit"] = first_token(client, model, a, prefix_cache=True)
    else:
        # --idle: a wait (the GPU, a compiler subprocess) shows as the frame that waits.
        profile = spied(spy_pid, lambda: [first_token(client, model, a, prefix_cache=True)],
                        idle=True, keep=keep)
        out["device_hit"] = profile.pop("results")[0]
    first_token(client, model, b, prefix_cache=True)  # A's pages leave the device pool
    time.sleep(settle)
    out["host_hit"] = first_token(client, model, a, prefix_cache=True)
    result = {arm: {"ttft_s": t, "cached_tokens": c} for arm, (t, c) in out.items()}
    if profile is not None:
        result["profile_first_device_hit"] = profile
    return result


def metric(base: str, name: str) -> float:
    """A metric's value summed over its samples (/metrics)."""
    text = httpx.get(f"{base}/metrics", timeout=30.0).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def drop_from_page_cache(folder: str) -> int:
    """Flush and drop every file under folder from the OS page cache (no root needed for
    clean pages): a read that follows comes from the disk. Bytes dropped."""
    os.sync()
    dropped = 0
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                dropped += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return dropped


def disk_read_rate(folder: str, nbytes: int = 2 << 30) -> float:
    """Bytes per second the disk under folder reads a file not in the page cache."""
    path = os.path.join(folder, "read-rate.bin")
    block = os.urandom(16 << 20)
    with open(path, "wb") as f:
        for _ in range(nbytes // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    try:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        while os.read(fd, 16 << 20):
            pass
        elapsed = time.perf_counter() - t0
        os.close(fd)
    finally:
        os.unlink(path)
    return nbytes / elapsed


def disk_hit(client: httpx.Client, model: str, base: str, c: list[int], pushers: list[list[int]],
             disk_dir: str) -> tuple[float, int]:
    """C stored, pushed out of the device and host tiers, on disk only (not in the page
    cache); then C's TTFT and cached tokens."""
    first_token(client, model, c, prefix_cache=True)
    for p in pushers:
        first_token(client, model, p, prefix_cache=True)
    deadline = time.monotonic() + 600
    while metric(base, "deepinfer:hicache_disk_write_queue") > 0:
        if time.monotonic() > deadline:
            raise RuntimeError("the disk write-back queue did not drain")
        time.sleep(0.2)
    drop_from_page_cache(disk_dir)
    return first_token(client, model, c, prefix_cache=True)


def spied(pid: int, run, idle: bool = False, keep: str | None = None) -> dict:
    """py-spy over the server and its ranks while `run()` runs: its stacks by frame (with
    `idle`, threads off the CPU too), and run()'s return value under "results"."""
    spy = shutil.which("py-spy")
    if spy is None:
        return {"error": "py-spy not found (pip install py-spy)", "results": run()}
    raw = os.path.join(tempfile.mkdtemp(), "hits.txt")
    proc = subprocess.Popen([spy, "record", "--pid", str(pid), "--subprocesses", "--rate", "500",
                             "--format", "raw", "--nonblocking", "--output", raw,
                             *(["--idle"] if idle else [])],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # let py-spy attach
    t0 = time.perf_counter()
    results = run()
    wall = time.perf_counter() - t0
    proc.send_signal(2)  # SIGINT: py-spy writes what it has and exits
    _, err = proc.communicate(timeout=60)
    if keep and os.path.exists(raw):
        shutil.copy(raw, keep)
    try:
        summary = summarize_collapsed(raw, top=40)
    except (OSError, ValueError) as exc:
        summary = {"error": f"{exc}; py-spy: {err.decode(errors='replace')[-500:]}"}
    summary.update(results=results, wall_s=wall, rate_hz=500)
    return summary


def pushers_for(host_pages: float, tokens: int, server_args: list[str]) -> int:
    """Prompts of `tokens` that fill a host tier of host_pages pages, and one more."""
    block = int(server_args[server_args.index("--block-size") + 1]) \
        if "--block-size" in server_args else 16
    return int(host_pages) // max(1, tokens // block) + 1


def profile_hits(client: httpx.Client, model: str, ids: list[int], pid: int, count: int
                 ) -> dict:
    """py-spy over the server and its ranks while `count` device hits of `ids` run back to
    back: where the host time of a hit goes (stacks of both processes, by frame)."""
    summary = spied(pid, lambda: [first_token(client, model, ids, prefix_cache=True)[0]
                                  for _ in range(count)])
    ttfts = summary.pop("results")
    summary.update(hits=count, ttft_p50_s=percentile(ttfts, 50))
    return summary


def summarize(runs: list[dict], tokens: int) -> dict:
    summary: dict = {}
    arms = DISK_ARMS if runs and "disk_hit" in runs[0] else ARMS
    for arm in arms:
        times = [r[arm]["ttft_s"] for r in runs]
        summary[arm] = {"ttft_p50_s": percentile(times, 50), "ttft_min_s": min(times),
                        "cached_tokens": [r[arm]["cached_tokens"] for r in runs]}
    cold = summary["cold"]["ttft_p50_s"]
    for arm in arms[1:]:
        summary[arm]["share_of_cold"] = summary[arm]["ttft_p50_s"] / cold
    summary["tokens"] = tokens
    return summary


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    s = result["summary"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    arms = [arm for arm in DISK_ARMS if arm in s]
    values = [s[arm]["ttft_p50_s"] * 1e3 for arm in arms]
    ax.bar(arms, values, color=["#999999", "#1f77b4", "#ff7f0e", "#2ca02c"][:len(arms)])
    for i, v in enumerate(values):
        ax.annotate(f"{v:.0f} ms", (i, v), ha="center", va="bottom")
    # The targets: a device hit within 40 ms, a host-tier hit within 10% of cold.
    for i, target in ((1, 40.0), (2, 0.1 * values[0])):
        ax.hlines(target, i - 0.4, i + 0.4, colors="k", linestyles="dashed")
        ax.annotate("target", (i + 0.4, target), ha="right", va="bottom", fontsize=8)
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_title(f"{s['tokens']}-token prompt through deepinfer-serve")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--vocab", type=int, default=32000, help="ids are drawn below this")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--health-timeout", type=float, default=600.0)
    p.add_argument("--profile-hits", type=int, default=0,
                   help="then this many device hits under py-spy (server and ranks)")
    p.add_argument("--profile-first-hit", action="store_true",
                   help="py-spy over the first repeat's device hit (the first after a store)")
    p.add_argument("--settle", type=float, default=0.0,
                   help="seconds between the request that stores a prompt (or evicts it) and "
                        "the hit that follows (0: right behind its write-through)")
    p.add_argument("--disk", action="store_true",
                   help="a disk-tier hit too (adds --hicache-disk-dir, a fresh folder, unless "
                        "the server arguments name one)")
    p.add_argument("server_args", nargs=argparse.REMAINDER,
                   help="-- then deepinfer-serve's arguments")
    args = p.parse_args(argv)
    server_args = [a for a in args.server_args if a != "--"]
    disk_dir = None
    if args.disk:
        if "--hicache-disk-dir" not in server_args:
            server_args += ["--hicache-disk-dir", tempfile.mkdtemp(prefix="hit-ttft-disk-")]
        disk_dir = server_args[server_args.index("--hicache-disk-dir") + 1]
    os.makedirs(args.out, exist_ok=True)
    port = free_port()
    log_path = os.path.join(args.out, "hit_ttft_server.log")
    server = start_server([sys.executable, "-m", "deepinfer.serve.cli", "--port", str(port),
                           *server_args], log_path)
    base = f"http://127.0.0.1:{port}"
    runs, profile = [], None
    try:
        wait_healthy(server, base, log_path, args.health_timeout)
        with httpx.Client(base_url=base, timeout=600.0) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            # A prompt of the measured length, caches off: the first long prompt compiles
            # and captures what a 32K prefill needs (it took 2.9-3.2 s against 1.3 s after),
            # which would otherwise land in the first repeat's cold TTFT.
            warm = random_prompts(1, args.tokens, args.vocab, seed=999)[0]
            first_token(client, model, warm, prefix_cache=False)
            # Prompts that push a disk arm's prompt out of the host tier: one more than it holds.
            pages = metric(base, "deepinfer:hicache_pages_total")
            for r in range(args.repeats):
                a, b = random_prompts(2, args.tokens, args.vocab, seed=r)
                spy = server.pid if args.profile_first_hit and r == 0 else None
                runs.append(repeat(client, model, a, b, spy,
                                   os.path.join(args.out, "first_hit_pyspy_raw.txt"),
                                   args.settle))
                if disk_dir is not None:
                    c, *pushers = random_prompts(1 + pushers_for(pages, args.tokens,
                                                                 server_args),
                                                 args.tokens, args.vocab, seed=100 + r)
                    t, cached = disk_hit(client, model, base, c, pushers, disk_dir)
                    runs[-1]["disk_hit"] = {"ttft_s": t, "cached_tokens": cached}
                log(f"repeat {r}: " + ", ".join(f"{k} {v['ttft_s'] * 1e3:.0f} ms "
                                               f"({v['cached_tokens']} cached)"
                                               for k, v in runs[-1].items()
                                               if isinstance(v, dict) and "ttft_s" in v))
            if args.profile_hits:
                profile = profile_hits(client, model, a, server.pid, args.profile_hits)
    finally:
        stop_server(server)
    result = {"server_args": server_args, "settle_s": args.settle, "runs": runs,
              "summary": summarize(runs, args.tokens), "profile_device_hits": profile}
    if disk_dir is not None:
        result["disk_read_bytes_per_s"] = disk_read_rate(disk_dir)
        print(f"the disk under {disk_dir} reads {result['disk_read_bytes_per_s'] / 1e9:.2f} "
              "GB/s (a file not in the page cache)")
    write_json(os.path.join(args.out, "hit_ttft.json"), result)
    plot(result, os.path.join(args.out, "hit_ttft.png"))
    for arm in [a for a in DISK_ARMS if a in result["summary"]]:
        s = result["summary"][arm]
        share = f", {s['share_of_cold']:.1%} of cold" if "share_of_cold" in s else ""
        print(f"{arm:11s} TTFT p50 {s['ttft_p50_s'] * 1e3:8.1f} ms{share}; cached "
              f"{s['cached_tokens']}")
    if profile and "top_inclusive_pct" in profile:
        print(f"py-spy over {profile['hits']} device hits ({profile['samples']} samples):")
        for frame, pct in profile["top_inclusive_pct"]:
            print(f"  {pct:5.1f}% {frame}")
    first = runs[0].get("profile_first_device_hit") if runs else None
    if first and "top_inclusive_pct" in first:
        print(f"py-spy over the first device hit ({first['samples']} samples, idle too):")
        for frame, pct in first["top_inclusive_pct"]:
            print(f"  {pct:5.1f}% {frame}")
        for frame, pct in first["top_self_pct"]:
            print(f"  self {pct:5.1f}% {frame}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
