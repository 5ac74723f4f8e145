"""The `deepinfer` console script.

    deepinfer plugins                             backends and plugin failures
    deepinfer server start|stop|status [args]     a background deepinfer-serve (serve/server.sh)
    deepinfer server path                         where server.sh is, to call it directly
"""
from __future__ import annotations

import argparse
import os
import sys
from importlib import resources
from typing import Sequence

from deepinfer.core.plugins import AcceleratorRow, PluginRegistry, describe, load_plugins


def format_table(rows: list[AcceleratorRow]) -> str:
    header = ("NAME", "ALIASES", "PRIORITY", "STATUS", "DESCRIPTION")
    cells = [header] + [(r.name, ",".join(r.aliases) or "-", str(r.priority), r.status,
                         r.description) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def print_plugins(registry: PluginRegistry) -> None:
    print(format_table(describe(registry)))
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
        "group (pid and log files under $DEEPINFER_RUN_DIR, default ~/.cache/deepinfer/run)")
    server.add_argument("action", choices=["start", "stop", "status", "path"])
    server.add_argument("serve_args", nargs=argparse.REMAINDER,
                        help="deepinfer-serve arguments (start only)")
    return parser


def server_script() -> str:
    return str(resources.files("deepinfer.serve").joinpath("server.sh"))


def run_server_script(action: str, serve_args: list[str]) -> int:
    """Replace this process with server.sh, which runs deepinfer-serve with this interpreter."""
    script = server_script()
    if action == "path":
        print(script)
        return 0
    env = dict(os.environ)
    env.setdefault("DEEPINFER_PYTHON", sys.executable)
    os.execvpe("bash", ["bash", script, action, *serve_args], env)
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
