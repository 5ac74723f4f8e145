"""What every API process runs: its HTTP server on the shared listening socket (the app, its
grammar workers, metrics and tokenizers) until a signal drains it, and the event loop."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from deepinfer.serve.api.connections import ConnectionLimits
from deepinfer.serve.flags import connection_limits, request_limits

if TYPE_CHECKING:
    from deepinfer.serve.ranks.supervisor import RankSupervisor


STARTED = time.monotonic()  # this process's start, near enough: for the "ready" log line

log = logging.getLogger("deepinfer.serve")


def grammar_pool(args: argparse.Namespace, model_dir: str, ready: Any):
    """The API process's grammar workers, compiling against the ranks' tokenizer facts."""
    from deepinfer.serve.grammar.pool import GrammarPool
    from deepinfer.serve.grammar.worker import WorkerSetup

    setup = WorkerSetup(model_dir, ready.vocab_size, tuple(ready.stop_token_ids),
                        args.trust_remote_code)
    return GrammarPool(setup, args.grammar_workers, args.grammar_compile_timeout)


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


async def close_tokenizers(loading: asyncio.Future) -> None:
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


def run_event_loop(main_coro) -> None:
    """Run on uvloop where it is installed (a faster event loop for many streams)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main_coro)
        return
    uvloop.run(main_coro)
