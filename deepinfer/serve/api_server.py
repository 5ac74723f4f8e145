"""API process 0: starts the ranks and the other API processes (api_workers.py), then serves
as every API process does (http_server.py) until a signal drains it."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from typing import TYPE_CHECKING

from deepinfer.serve.flags import engine_config, rank_health
from deepinfer.serve.http_server import (
    STARTED,
    close_tokenizers,
    http_stop_time,
    load_tokenizers,
    serve_http,
)
from deepinfer.serve.settings import metrics_dir_set, serve_settings

if TYPE_CHECKING:
    from deepinfer.serve.ranks.ipc import Ready


log = logging.getLogger("deepinfer.serve")


def log_hicache(ready: list[Ready]) -> None:
    """The host tier's size: the node's shared pool, and the ranks with a pool of their own."""
    shared = [r for r in ready if r.stats is not None and r.stats.hicache_shared]
    own = [r for r in ready if r.stats is None or not r.stats.hicache_shared]
    if shared:
        log.info("HiCache: one host pool of %d pages of %d tokens, shared by %d of %d ranks",
                 shared[0].hicache_pages, shared[0].block_size, len(shared), len(ready))
    if own:
        log.info("HiCache: %d host pages of %d tokens per rank (%d ranks)",
                 own[0].hicache_pages, own[0].block_size, len(own))


async def serve(args: argparse.Namespace, model_dir: str, listener: socket.socket) -> None:
    """API process 0: the ranks, the other API processes, and its own HTTP server."""
    from deepinfer.serve.api_workers import start_workers, stop_workers
    from deepinfer.serve.ranks.supervisor import RankSupervisor
    from deepinfer.serve.tokenizer.hf import import_transformers

    import_transformers()  # torch-free, before the tokenizer's thread and the ranks start
    supervisor = RankSupervisor(engine_config(args, model_dir), args.dp, routing=args.routing,
                                health=rank_health(args), stream_interval=args.stream_interval,
                                api_servers=args.api_server_count)
    # The tokenizer loads and probes its backends (seconds) while the ranks start (longer):
    # this process only waits on them meanwhile.
    loading = asyncio.ensure_future(asyncio.to_thread(load_tokenizers, args, model_dir))
    workers = []
    try:
        ready = await supervisor.start()
        log.info("%d rank(s) ready on %s: %d KV blocks of %d tokens, context %d (%.0f s after "
                 "start)", len(ready), ready[0].accelerator, ready[0].num_blocks,
                 ready[0].block_size, ready[0].max_model_len, time.monotonic() - STARTED)
        if ready[0].hicache_pages:
            log_hicache(ready)
        tokenizer, prompt_tokenizer = await loading
        workers = await start_workers(args, model_dir, supervisor, ready, listener)
        if workers:
            log.info("%d API processes serve port %d", len(workers) + 1, args.port)
        _stop_if_any_exits(workers)
        await serve_http(args, model_dir, supervisor, ready, tokenizer, prompt_tokenizer,
                         listener, on_stop=lambda: _stop_with(workers))
    finally:
        listener.close()
        _stop_with(workers)
        await stop_workers(workers, http_stop_time(args))
        await supervisor.shutdown()
        await close_tokenizers(loading)


def _stop_with(workers: list) -> None:
    """The other API processes drain and stop along with this one (SIGTERM)."""
    for process in workers:
        asyncio.get_running_loop().remove_reader(process.sentinel)  # stopped on purpose
        if process.is_alive():
            process.terminate()


def _stop_if_any_exits(workers: list) -> None:
    """An API process that dies takes the server down (its port share would go unserved)."""
    loop = asyncio.get_running_loop()

    def exited(process) -> None:
        loop.remove_reader(process.sentinel)
        process.join(timeout=1.0)  # over at once: the sentinel fires as the process ends
        log.error("API process %s (pid %s) exited with code %s; stopping the server",
                  process.name, process.pid, process.exitcode)
        os.kill(os.getpid(), signal.SIGTERM)
    for process in workers:
        loop.add_reader(process.sentinel, exited, process)


@contextlib.contextmanager
def metrics_files(api_servers: int):
    """Several API processes share their metrics through prometheus_client's multiprocess
    files: the folder is named before any process imports the library (the others inherit
    it) and removed at the end."""
    if api_servers <= 1 or serve_settings().metrics_dir:
        yield
        return
    folder = tempfile.mkdtemp(prefix="deepinfer-metrics-")
    try:
        with metrics_dir_set(folder):
            yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)
