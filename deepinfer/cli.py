"""The `deepinfer` console script. `deepinfer plugins` lists backends and plugin failures."""
from __future__ import annotations

import argparse
import sys
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "plugins":
        print_plugins(load_plugins())
    return 0


if __name__ == "__main__":
    sys.exit(main())
