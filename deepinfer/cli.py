"""The `deepinfer` console script.

    deepinfer plugins                             backends and plugin failures
    deepinfer server start [serve args]           a background deepinfer-serve (serve/server.sh)
    deepinfer server stop|status [--port N]       the one on port N (default 8000)
    deepinfer server path                         where server.sh is, to call it directly
"""
from __future__ import annotations

import argparse
import os
import sys
from importlib import resources
from typing import Sequence

from deepinfer.core.plugins import AcceleratorRow, PluginRegistry, describe, load_plugins
from deepinfer.serve.settings import process_env


def format_table(rows: list[AcceleratorRow]) -> str:
    header = ("NAME", "ALIASES", "PRIORITY", "STATUS", "DESCRIPTION")
    cells = [header] + [(r.name, ",".join(r.aliases) or "-", str(r.priority), r.status,
                         r.description) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def print_plugins(registry: PluginRegistry) -> None:
    rows = describe(registry)
    print(format_table(rows))
    for row in rows:
        if row.why_unavailable:
            print(f"\n{row.name} is unavailable: {row.why_unavailable}")
    names = [name for name, _ in registry.pm.list_name_plugin()]
    print(f"\nplugins loaded: {', '.join(sorted(names)) or 'none'}")
    if registry.failures:
        print("failed plugins:")
        for failure in registry.failures:
            print(f"  {failure.name}: {failure.error}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description="DeepInfer LLM serving engine")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("plugins", help="list accelerator backends and plugin load failures")
    server = commands.add_parser(
        "server", help="start, stop or show a background deepinfer-serve in its own process "
        "group (pid and log files per port, under $DEEPINFER_CACHE_DIR/run/port-<port>, "
        "default ~/.cache/deepinfer/run/port-<port>; $DEEPINFER_RUN_DIR overrides)")
    server.add_argument("action", choices=["start", "stop", "status", "path"])
    server.add_argument("serve_args", nargs=argparse.REMAINDER,
                        help="start: deepinfer-serve arguments; stop, status: [--port N], "
                        "which server (default 8000)")
    return parser


def script_args(action: str, args: list[str]) -> list[str]:
    """What server.sh gets after the action. start passes deepinfer-serve's arguments through
    (its --port keys the run files); stop and status take only --port, checked here so that a
    typo fails with argparse's message instead of server.sh's usage line."""
    if action == "start":
        return args
    parser = argparse.ArgumentParser(prog=f"deepinfer server {action}")
    # No default: without --port server.sh picks 8000's files, or with DEEPINFER_RUN_DIR set,
    # whichever server that folder holds.
    parser.add_argument("--port", type=int, help="the server's port (default 8000)")
    port = parser.parse_args(args).port
    return [] if port is None else ["--port", str(port)]


def server_script() -> str:
    return str(resources.files("deepinfer.serve").joinpath("server.sh"))


def run_server_script(action: str, serve_args: list[str]) -> int:
    """Replace this process with server.sh, which runs deepinfer-serve with this interpreter."""
    script = server_script()
    if action == "path":
        print(script)
        return 0
    argv = ["bash", script, action, *script_args(action, serve_args)]
    env = process_env()
    env.setdefault("DEEPINFER_PYTHON", sys.executable)
    os.execvpe("bash", argv, env)
    return 1  # not reached


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "plugins":
        print_plugins(load_plugins())
    elif args.command == "server":
        return run_server_script(args.action, args.serve_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
