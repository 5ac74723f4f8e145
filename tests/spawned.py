"""Rank processes for multi-process tests: spawn one per argument tuple, collect their results."""
from __future__ import annotations

import multiprocessing as mp
import socket
from typing import Any, Callable, Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(target: Callable, args: Sequence[tuple], timeout_s: float) -> list[Any]:
    """Run target(*args[r], out) in a spawned process per rank; each puts (rank, result) on
    out. Results in rank order; processes still alive after their result are killed."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, out), daemon=True) for a in args]
    for proc in procs:
        proc.start()
    try:
        results = dict(out.get(timeout=timeout_s) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return [results[r] for r in range(len(procs))]
