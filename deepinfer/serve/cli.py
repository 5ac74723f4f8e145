"""deepinfer-serve's entry point: parse the flags, check them, run the server (the flags:
serve/flags.py; the server: serve/api_server.py)."""
from __future__ import annotations

import argparse
import logging
import socket
import sys
from typing import Sequence

from deepinfer.serve.api_server import metrics_files, serve
from deepinfer.serve.flags import build_parser
from deepinfer.serve.http_server import run_event_loop

log = logging.getLogger("deepinfer.serve")


class _Exit(Exception):
    """A start that cannot go on: the exit status; its message is already printed."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def main(argv: Sequence[str] | None = None) -> int:
    from deepinfer.core.plugins import load_plugins

    registry = load_plugins()
    parser = build_parser()
    registry.add_cli_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.list_accelerators:
        from deepinfer.cli import print_plugins

        print_plugins(registry)
        return 0
    try:
        listener = _preflight(args, sys.argv[1:] if argv is None else list(argv))
        model_dir = _model_dir(args, listener)
    except _Exit as exc:
        return exc.status
    return _run(args, model_dir, listener)


def _preflight(args: argparse.Namespace, argv: list[str]) -> socket.socket:
    """The flags checked, the accelerator resolved (args.accelerator: its exact name, which
    the ranks then load), the API key read and the port bound."""
    from deepinfer.serve.preflight import (
        PreflightError,
        api_key,
        bind_listener,
        check_args,
        raise_open_file_limit,
    )

    files = raise_open_file_limit()
    if files < 4096:
        log.warning("at most %d open files (ulimit -n): fewer concurrent streams", files)
    try:
        args.accelerator = check_args(args)
        args.api_key = api_key(args, argv)
        return bind_listener(args.host, args.port)
    except PreflightError as exc:
        print(f"deepinfer-serve: error: {exc}", file=sys.stderr)
        raise _Exit(2) from exc


def _model_dir(args: argparse.Namespace, listener: socket.socket) -> str:
    from deepinfer.models.default_model import resolve_model_path

    try:
        return resolve_model_path(args.model)
    except (RuntimeError, FileNotFoundError, ValueError) as exc:
        print(f"deepinfer-serve: error: {exc}", file=sys.stderr)
        listener.close()
        raise _Exit(2) from exc


def _run(args: argparse.Namespace, model_dir: str, listener: socket.socket) -> int:
    from deepinfer.serve.ranks.rank import RankStartError

    try:
        with metrics_files(args.api_server_count):
            run_event_loop(serve(args, model_dir, listener))
    except RankStartError as exc:
        log.debug("the rank's traceback:\n%s", exc.details)
        print(f"deepinfer-serve: error: {exc} (--log-level debug shows the rank's traceback)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
