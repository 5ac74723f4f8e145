"""An API process at work: process 0 starts the ranks and the other API processes, and every
API process serves the app on the shared listening socket until a signal drains it."""
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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from deepinfer.serve.api.connections import ConnectionLimits
from deepinfer.serve.flags import connection_limits, engine_config, rank_health, request_limits
from deepinfer.serve.settings import metrics_dir_set, serve_settings

if TYPE_CHECKING:
    from deepinfer.serve.ranks.supervisor import RankSupervisor

_STARTED = time.monotonic()  # this process's start, near enough: for the "ready" log line

log = logging.getLogger("deepinfer.serve")


def grammar_pool(args: argparse.Namespace, model_dir: str, ready: Any):
    """The API process's grammar workers, compiling against the ranks' tokenizer facts."""
    from deepinfer.serve.grammar.pool import GrammarPool
    from deepinfer.serve.grammar.worker import WorkerSetup

    setup = WorkerSetup(model_dir, ready.vocab_size, tuple(ready.stop_token_ids),
                        args.trust_remote_code)
    return GrammarPool(setup, args.grammar_workers, args.grammar_compile_timeout)


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
                 ready[0].block_size, ready[0].max_model_len, time.monotonic() - _STARTED)
        if ready[0].hicache_pages:
            log.info("HiCache: %d host pages of %d tokens per rank", ready[0].hicache_pages,
                     ready[0].block_size)
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
        await _close_tokenizers(loading)


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


async def serve_http(args: argparse.Namespace, model_dir: str, supervisor: RankSupervisor,
                     ready: list,
                     tokenizer, prompt_tokenizer, listener: socket.socket,
                     observes_engine: bool = True,
                     on_stop: Callable[[], None] = lambda: None) -> None:
    """This API process's app on the listening socket until a signal stops it (then it
    drains: serve/api/shutdown.py; `on_stop` runs as the drain begins). Its requests on the
    ranks go through a RequestStream of its own over `supervisor`."""
    import time

    import uvicorn

    from deepinfer.serve.api.app import create_app
    from deepinfer.serve.api.body_parse import LargeBodyParser
    from deepinfer.serve.api.connections import guarded_protocol
    from deepinfer.serve.api.request_fields import UnknownFields
    from deepinfer.serve.api.shutdown import Drain, GracefulServer
    from deepinfer.serve.api.state import ServerState
    from deepinfer.serve.heap import freeze_startup_heap
    from deepinfer.serve.metrics.engine import EngineCollector, cache_config_labels
    from deepinfer.serve.metrics.moe import MoECollector
    from deepinfer.serve.metrics.ranks import RankCollector
    from deepinfer.serve.metrics.server import ServerMetrics
    from deepinfer.serve.metrics.tokenizer import TokenizerCollector
    from deepinfer.serve.ranks.inbox import RequestAborted
    from deepinfer.serve.ranks.request_stream import RequestStream

    name = args.served_model_name or os.path.basename(os.path.normpath(args.model or model_dir))
    metrics = ServerMetrics(name, observes_engine, len(ready), ready[0].max_model_len)
    metrics.registry.register(EngineCollector(
        supervisor.ranks, name, [cache_config_labels(supervisor.config.cache, r)
                                 for r in ready]))
    metrics.registry.register(TokenizerCollector(prompt_tokenizer, name))
    metrics.registry.register(RankCollector(supervisor.ranks, supervisor.router, name))
    metrics.registry.register(MoECollector(supervisor.ranks, name))
    requests = RequestStream(supervisor, args.max_stream_backlog)
    state = ServerState(supervisor, requests, tokenizer, name, model_dir,
                        ready[0].max_model_len, metrics, args.api_key, int(time.time()),
                        prompt_tokenizer=prompt_tokenizer, limits=request_limits(args),
                        sampling_defaults=sampling_defaults(args, model_dir),
                        metrics_public=args.metrics_public,
                        trust_remote_code=args.trust_remote_code,
                        tool_call_parser=args.tool_call_parser,
                        grammars=grammar_pool(args, model_dir, ready[0]),
                        large_bodies=LargeBodyParser(int(args.large_body_kb * 1024),
                                                     ready[0].max_model_len),
                        drain=Drain(args.shutdown_timeout),
                        unknown_fields=UnknownFields(args.ignore_unknown_fields))
    if observes_engine:  # once per server, not once per API process
        log.info(state.chat_format.describe(model_dir))
        # Benchmark clients (aiperf, genai-perf, vllm bench) load a tokenizer by the model's
        # name, which offline finds nothing: this is the folder to give them.
        log.info("tokenizer for clients that load one by model name: %s (aiperf --tokenizer)",
                 model_dir)
    limits = connection_limits(args)
    # uvicorn's own shutdown runs after the drain (serve/api/shutdown.py): its timeout only has
    # to outlast a write or a body that is still blocked.
    config = uvicorn.Config(create_app(state), host=args.host, port=args.port,
                            log_level=args.log_level, ws="none",
                            http=guarded_protocol(limits, metrics.connection_closed),
                            timeout_graceful_shutdown=_http_stop_grace(limits),
                            timeout_keep_alive=args.timeout_keep_alive)
    server = GracefulServer(config, state.drain, lambda: requests.end_requests(
        RequestAborted("the server is shutting down", 503)), on_stop)
    # uvicorn handles SIGINT/SIGTERM while it serves, then restores the previous handlers
    # and re-raises the signal; with the default handlers that kills the process before
    # the caller's `finally` can stop the ranks (orphaned ranks, leaked IPC folder).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _swallow_signal)
    refresh = asyncio.ensure_future(_refresh_engine_metrics(metrics, supervisor)) \
        if metrics.multiprocess and observes_engine else None
    freeze_startup_heap()
    try:
        await server.serve(sockets=[listener])
    finally:
        if refresh is not None:
            refresh.cancel()
        await state.grammars.close()
        await asyncio.to_thread(state.large_bodies.close)


def _http_stop_grace(limits: ConnectionLimits) -> float:
    """uvicorn's wait, after the drain, for a response write or a body still blocked."""
    return max(limits.write_timeout_s, limits.body_timeout_s) + 1.0


def http_stop_time(args: argparse.Namespace) -> float:
    """The longest an API process's stop may take: the drain, its grace for the requests it
    ended, then uvicorn's own wait."""
    from deepinfer.serve.api.shutdown import END_GRACE_S

    return args.shutdown_timeout + END_GRACE_S + _http_stop_grace(connection_limits(args))


async def _refresh_engine_metrics(metrics, supervisor: RankSupervisor) -> None:
    """Several API processes: the engine series in the shared files stay fresh whichever
    process is scraped."""
    while True:
        metrics.observe_engine(supervisor.stats())
        await asyncio.sleep(1.0)


async def _close_tokenizers(loading: asyncio.Future) -> None:
    """Close the prompt tokenizer; a load the ranks' failure left running is waited out
    first. A load that failed has nothing to close (its error, or the ranks', is raised)."""
    if loading.done() and (loading.cancelled() or loading.exception() is not None):
        return
    try:
        _, prompt_tokenizer = await loading
    except Exception:  # noqa: BLE001 - the error already being raised is the one to report
        return
    prompt_tokenizer.close()


def load_tokenizers(args: argparse.Namespace, model_dir: str) -> tuple[Any, Any]:
    """The checkpoint's HF tokenizer and the prompt tokenizer chosen against it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir,
                                              trust_remote_code=args.trust_remote_code)
    return tokenizer, build_prompt_tokenizer(args, tokenizer)


def _swallow_signal(signum: int, frame: object) -> None:
    log.info("stopping on signal %d", signum)


def sampling_defaults(args: argparse.Namespace, model_dir: str) -> dict:
    from deepinfer.serve.chat.generation_config import load_sampling_defaults

    if args.generation_config == "none":
        return {}
    defaults = load_sampling_defaults(model_dir)
    if defaults:
        log.info("sampling defaults from the checkpoint's generation_config.json (for "
                 "requests that leave them unset): %s", defaults)
    return defaults


def build_prompt_tokenizer(args: argparse.Namespace, tokenizer):
    """Probe the prompt tokenizer backends and wrap the winner in live verification."""
    from deepinfer.serve.tokenizer import VerifiedTokenizer, select_prompt_tokenizer

    primary, probes = select_prompt_tokenizer(tokenizer, args.tokenizer_backend,
                                              cache_bytes=args.tokenizer_cache_mb << 20)
    for probe in probes:
        log.info("tokenizer backend %s: %s%s", probe.backend, "ok" if probe.ok else "rejected",
                 f" ({probe.reason})" if probe.reason else "")
    log.info("prompt tokenizer: %s (verify rate %g)", primary.name, args.tokenizer_verify_rate)
    return VerifiedTokenizer(primary, tokenizer, rate=args.tokenizer_verify_rate,
                             on_mismatch=lambda m: log.error(
                                 "prompt tokenizer %s mismatched hf; now serving with hf",
                                 m.backend))


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


def run_event_loop(main_coro) -> None:
    """Run on uvloop where it is installed (a faster event loop for many streams)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main_coro)
        return
    uvloop.run(main_coro)

