"""The package's shape in numbers: files per package, imports that point back up the layers,
module import cycles, the places that read the environment, and the methods a third-party
backend must write. Reads source only (nothing is imported except for the abstract-method
count, which imports the seam's base classes).

    python scripts/layout_report.py [--root TREE] [--out report.json]
"""
from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

# Lower layers never import higher ones: core < models < backends < serve.
LAYERS = {"core": 0, "models": 1, "backends": 2, "testing": 2, "serve": 3}
ENV_READ = re.compile(r"os\.environ(?!\s*\[[^]]*\]\s*=)|os\.getenv")


def modules(root: Path) -> dict[str, Path]:
    pkg = root / "deepinfer"
    found = {}
    for path in sorted(pkg.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The deepinfer modules `name` imports at module level or inside functions."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def layer(name: str) -> int | None:
    parts = name.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(10000)

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def env_reads(found: dict[str, Path], root: Path) -> dict[str, int]:
    reads: Counter[str] = Counter()
    for path in found.values():
        for line in path.read_text().splitlines():
            if ENV_READ.search(line.split("#")[0]):
                reads[str(path.relative_to(root))] += 1
    return dict(sorted(reads.items()))


def abstract_methods(root: Path) -> dict[str, list[str]]:
    """The abstract methods of the seam's base classes, as the tree at `root` defines them."""
    probe = (
        "import inspect, json, importlib\n"
        "out = {}\n"
        "for mod, cls in [('deepinfer.core.accelerator', 'Accelerator'),\n"
        "                 ('deepinfer.models.ops', 'ModelOps')]:\n"
        "    klass = getattr(importlib.import_module(mod), cls)\n"
        "    out[cls] = sorted(klass.__abstractmethods__)\n"
        "print(json.dumps(out))\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    return json.loads(result.stdout) if result.returncode == 0 else {"error": result.stderr[-300:]}


def report(root: Path) -> dict:
    found = modules(root)
    graph = {name: imports_of(name, path, found) for name, path in found.items()}
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                    if layer(a) is not None and layer(b) is not None and layer(b) > layer(a))
    per_package: dict[str, int] = defaultdict(int)
    for name, path in found.items():
        per_package[str(path.parent.relative_to(root))] += 1
    reads = env_reads(found, root)
    return {"files_per_package": dict(sorted(per_package.items())),
            "modules": len(found),
            "upward_imports": upward,
            "cycles": cycles(graph),
            "env_read_files": len(reads), "env_reads": reads,
            "abstract_methods": abstract_methods(root)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = report(args.root.resolve())
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
