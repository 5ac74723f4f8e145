"""Closed-loop streaming clients spread over processes.

At a few thousand streamed tokens a second one Python client process saturates its core and
times itself, not the server (docs/benchmarks.md, "API-layer overhead"): the requests and the
clients are dealt to `processes` spawned processes, which start together and each keep their
share of the clients busy (a client sends its next request as soon as its last one ends).

    closed_loop(base, model, prompts, outputs, clients, processes) -> (seconds, tokens)
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import time

START_DELAY_S = 2.0  # every process has started and connected by then


def closed_loop(base: str, model: str, prompts: list[list[int]], outputs: list[int],
                clients: int, processes: int) -> tuple[float, list[int]]:
    """Every request (prompt ids, output tokens) streamed from /v1/completions, `clients` at a
    time: (seconds from the common start to the last stream's end, the completion tokens each
    request reported, in request order)."""
    processes = max(1, min(processes, clients, len(prompts)))
    start_at = time.perf_counter() + START_DELAY_S
    parts = [(base, model, prompts[i::processes], outputs[i::processes],
              clients // processes + (i < clients % processes), start_at)
             for i in range(processes)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        done = pool.starmap(_part, parts)
    tokens: list[int] = [0] * len(prompts)
    for i, (_, _, got) in enumerate(done):
        tokens[i::processes] = got
    return max(d[1] for d in done) - min(d[0] for d in done), tokens


def _part(base: str, model: str, prompts: list[list[int]], outputs: list[int], clients: int,
          start_at: float) -> tuple[float, float, list[int]]:
    """One process's share: (its start, its end, tokens per request)."""
    return asyncio.run(_share(base, model, prompts, outputs, clients, start_at))


async def _share(base: str, model: str, prompts: list[list[int]], outputs: list[int],
                 clients: int, start_at: float) -> tuple[float, float, list[int]]:
    import httpx

    queue = list(range(len(prompts)))[::-1]
    got = [0] * len(prompts)

    async def client(http: httpx.AsyncClient) -> None:
        while queue:
            i = queue.pop()
            body = {"model": model, "prompt": prompts[i], "max_tokens": outputs[i],
                    "ignore_eos": True, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with http.stream("POST", f"{base}/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and "completion_tokens" in line:
                        got[i] = json.loads(line[6:])["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        # Keep-alive connections first: the run then times no TCP set-up.
        await asyncio.gather(*(http.get(f"{base}/health") for _ in range(clients)))
        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(min(clients, len(prompts)))))
        end = time.perf_counter()
    return start, end, got
