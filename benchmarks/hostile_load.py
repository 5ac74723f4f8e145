"""What one hostile client costs everyone else: a small streamed chat request's latency while
each hostile case runs against the same server, on a busy host (CPU-burning processes beside
the server), against the same request's latency with no hostile case running.

    python benchmarks/hostile_load.py [--model DIR] [--burners 2] [--cases enum5000 ...]

Cases: enum5000 / enum10000 (a response_format schema with one enum of that many values),
tools10000 (10,000 tools, tool_choice required), anyof10000 (a schema of 10,000 anyOf
branches), ids15mb (/v1/completions with a 15 MB list of token ids), unread300 (300 streams
opened and never read), slowloris500 (500 connections sending their headers at 1 byte/s).
Each case's own answer (status or what happened) is recorded beside the probe's latencies.
Writes results/hostile_load.json and .png; the target is < 1 s added to the probe's worst
latency per case."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
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
)

PROBE = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
         "temperature": 0, "stream": True}
CASES = ("enum5000", "enum10000", "tools10000", "anyof10000", "ids15mb", "unread300",
         "slowloris500")


def _chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "Pick one."}], "max_tokens": 8, **fields}


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def hostile_body(case: str) -> tuple[str, bytes]:
    """(path, body) of a hostile request case."""
    if case.startswith("enum"):
        values = [f"value-{i}" for i in range(int(case[4:]))]
        body = _chat(response_format=_schema_format(
            {"type": "object", "properties": {"v": {"enum": values}}, "required": ["v"]}))
    elif case == "tools10000":
        tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {
            "type": "object", "properties": {"x": {"type": "integer"}}}}} for i in range(10_000)]
        body = _chat(tools=tools, tool_choice="required")
    elif case == "anyof10000":
        branches = [{"type": "object", "properties": {f"k{i}": {"type": "string"}},
                     "required": [f"k{i}"]} for i in range(10_000)]
        body = _chat(response_format=_schema_format({"anyOf": branches}))
    elif case == "ids15mb":
        ids = [1000 + i % 40000 for i in range(2_150_000)]
        return "/v1/completions", json.dumps({"prompt": ids, "max_tokens": 1}).encode()
    else:
        raise ValueError(case)
    return "/v1/chat/completions", json.dumps(body).encode()


async def _request(port: int, path: str, body: bytes, timeout: float) -> str:
    """One raw HTTP/1.1 request; its status line (or what went wrong)."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout)
        writer.close()
        return line.decode(errors="replace").strip() or "closed"
    except asyncio.TimeoutError:
        return f"no answer in {timeout:.0f} s"
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


async def _unread_streams(port: int, count: int, hold_s: float) -> str:
    body = json.dumps({**PROBE, "max_tokens": 4000, "ignore_eos": True}).encode()
    writers = []
    for _ in range(count):
        # A small receive buffer: the kernel would otherwise read megabytes on its behalf.
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            _, writer = await asyncio.open_connection(sock=sock)
        except OSError as exc:
            sock.close()
            return f"connection {len(writers)} refused: {exc}"
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     f"application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
        writers.append(writer)
    await asyncio.sleep(hold_s)  # never read
    closed = sum(w.transport.is_closing() for w in writers)
    for w in writers:
        w.close()
    return f"{count} opened, never read; {closed} closed by the server"


async def _slowloris(port: int, count: int, hold_s: float) -> str:
    writers = []
    for _ in range(count):
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            break
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\n")
        writers.append((reader, writer))
    header = b"x-slow: " + b"a" * 100
    end = time.monotonic() + hold_s
    i = 0
    while time.monotonic() < end:  # one byte a second on every connection
        for _, writer in writers:
            if not writer.transport.is_closing():
                writer.write(header[i % len(header):i % len(header) + 1])
        i += 1
        await asyncio.sleep(1.0)
    closed = sum(r.at_eof() or w.transport.is_closing() for r, w in writers)
    for _, w in writers:
        w.close()
    return f"{len(writers)} opened; {closed} closed by the server within {hold_s:.0f} s"


async def hostile(case: str, port: int, hold_s: float) -> str:
    if case == "unread300":
        return await _unread_streams(port, 300, hold_s)
    if case == "slowloris500":
        return await _slowloris(port, 500, hold_s)
    path, body = hostile_body(case)
    return await _request(port, path, body, timeout=hold_s + 60)


async def probe_latencies(base: str, seconds: float) -> list[float]:
    """Back-to-back small streamed requests for `seconds`; each one's time to its end."""
    import httpx

    out = []
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.monotonic()
            async with client.stream("POST", "/v1/chat/completions", json=PROBE) as r:
                async for _ in r.aiter_bytes():
                    pass
            out.append(time.monotonic() - t0)
    return out


async def run_case(case: str | None, port: int, seconds: float) -> dict:
    base = f"http://127.0.0.1:{port}"
    task = asyncio.create_task(hostile(case, port, seconds)) if case else None
    await asyncio.sleep(0.5 if case else 0)  # the hostile work is under way
    latencies = await probe_latencies(base, seconds)
    outcome = await task if task else "none"
    return {"case": case or "baseline", "outcome": outcome, "probes": len(latencies),
            "worst_s": max(latencies), "median_s": sorted(latencies)[len(latencies) // 2]}


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    cases = [c for c in result["cases"] if c["case"] != "baseline"]  # (both baselines)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([c["case"] for c in cases], [c["added_worst_s"] for c in cases])
    ax.axhline(1.0, color="red", linestyle="--", label="target: 1 s")
    ax.set_ylabel("added to the probe's worst latency (s)")
    ax.tick_params(axis="x", labelrotation=30)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded one)")
    parser.add_argument("--burners", type=int, default=2, help="CPU-burning processes beside")
    parser.add_argument("--seconds", type=float, default=15.0, help="probing per case")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--server-args", default="", help="extra deepinfer-serve flags")
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, "hostile_load"))
    args = parser.parse_args()
    port = free_port()
    log_path = os.path.join(tempfile.mkdtemp(prefix="hostile-"), "server.log")
    cmd = [sys.executable, "-m", "deepinfer.serve.cli", "--port", str(port),
           *(["--model", args.model] if args.model else []), *args.server_args.split()]
    server = start_server(cmd, log_path)
    burners: list[subprocess.Popen] = []
    try:
        wait_healthy(server, f"http://127.0.0.1:{port}", log_path)
        asyncio.run(probe_latencies(f"http://127.0.0.1:{port}", 3.0))  # warm: first requests
        burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                   for _ in range(args.burners)]
        cases = []
        for case in [None, *args.cases, None]:  # a baseline before and after the cases
            cases.append(asyncio.run(run_case(case, port, args.seconds)))
            log(f"{cases[-1]}")
    finally:
        for b in burners:
            b.kill()
        stop_server(server)
    # Against the worse of the two baselines: the host's own noise is not the case's doing.
    baseline = max(cases[0]["worst_s"], cases[-1]["worst_s"])
    for c in cases:
        c["added_worst_s"] = c["worst_s"] - baseline
    with open(log_path) as f:
        tracebacks = f.read().count("Traceback")
    result = {"burners": args.burners, "seconds_per_case": args.seconds, "cases": cases,
              "server_tracebacks": tracebacks, "environment": machine_environment()}
    from common import write_json

    write_json(args.out + ".json", result)
    plot(result, args.out + ".png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
