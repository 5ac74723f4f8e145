"""How long one large request body stalls the API process's event loop.

Starts `deepinfer-serve` twice, with large bodies parsed on the event loop (--large-body-kb past
the body) and in a worker process (the default), and in each posts a /v1/completions body of
~15 MB (a prompt of 2.5M token ids, refused with 400 as longer than the context) while a thread
times GET /health every 10 ms. The loop stall is the worst /health latency during the post,
against its median when idle. Writes benchmarks/results/body_parse_stall.json.

    python benchmarks/body_parse_stall.py [--model DIR] [--posts 3]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

IDS = 2_500_000
RESULTS = os.path.join(os.path.dirname(__file__), "results", "body_parse_stall.json")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: str | None, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "deepinfer.serve.cli", "--port", str(port),
               "--max-request-body-mb", "32", "--log-level", "warning", *extra]
    if model:
        command += ["--model", model]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not start")


def health_latencies(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            client.get(f"{url}/health")
            out.append(time.perf_counter() - t0)
            time.sleep(0.01)


def one_post(url: str, body: bytes) -> dict:
    stop, during = threading.Event(), []
    poller = threading.Thread(target=health_latencies, args=(url, stop, during))
    poller.start()
    time.sleep(0.3)
    idle = list(during)
    t0 = time.perf_counter()
    reply = httpx.post(f"{url}/v1/completions", content=body, timeout=120,
                       headers={"content-type": "application/json"})
    post_s = time.perf_counter() - t0
    time.sleep(0.2)
    stop.set()
    poller.join()
    busy = during[len(idle):]
    return {"status": reply.status_code, "post_s": round(post_s, 3),
            "health_idle_median_ms": round(statistics.median(idle) * 1e3, 2),
            "health_max_during_post_ms": round(max(busy) * 1e3, 2),
            "health_samples_during_post": len(busy)}


def run(model: str | None, extra: list[str], body: bytes, posts: int) -> list[dict]:
    proc, url = start(model, extra)
    try:
        return [one_post(url, body) for _ in range(posts)]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


def plot(results: dict, path: str) -> None:
    """The worst /health latency during each post, on the loop against in the worker."""
    from common import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for k, (key, label) in enumerate((("on_the_loop", "parsed on the event loop"),
                                      ("worker_process", "parsed in the worker process"))):
        stalls = [post["health_max_during_post_ms"] for post in results[key]]
        ax.bar([i + (k - 0.5) * 0.4 for i in range(len(stalls))], stalls, 0.4, label=label)
    ax.axhline(50, color="red", linestyle="--", label="50 ms")
    ax.set_xticks(range(len(results["on_the_loop"])),
                  [f"post {i + 1}" for i in range(len(results["on_the_loop"]))])
    ax.set_ylabel("worst /health latency during the post (ms)")
    ax.set_title(f"a {results['body_bytes'] / 1e6:.1f} MB body of token ids")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--posts", type=int, default=3)
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON")
    args = parser.parse_args()
    if args.replot:
        from common import replot

        replot(RESULTS, plot)
        return
    body = json.dumps({"prompt": [1000] * IDS, "max_tokens": 1}).encode()
    results = {"body_bytes": len(body), "prompt_ids": IDS, "cpus": os.cpu_count(),
               "on_the_loop": run(args.model, ["--large-body-kb", str(64 << 10)], body,
                                  args.posts),
               "worker_process": run(args.model, [], body, args.posts)}
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(results, f, indent=2)
    plot(results, os.path.splitext(RESULTS)[0] + ".png")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
