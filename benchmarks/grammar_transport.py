"""Compile, serialize and load times of constraints at the server's default limits.

What the grammar workers (serve/grammar/worker.py) and a rank (serve/grammar/rank_grammars.py)
spend on one constraint: the compile, the write-out (budgeted: past it the rank compiles instead),
and the rank's load of what was sent. Measured, never asserted.

    python benchmarks/grammar_transport.py [--model DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import string
import threading
import time

from deepinfer.core.sampling import StructuredOutput
from deepinfer.core.structured import GrammarCompiler


def cases() -> dict[str, StructuredOutput]:
    rng = random.Random(0)
    words = ["".join(rng.choices(string.ascii_letters, k=12)) for _ in range(4096)]

    def tool(i: int) -> dict:
        return {"type": "object", "required": ["name", "arguments"], "properties": {
            "name": {"const": f"tool_{i}"}, "arguments": {
                "type": "object", "required": ["city"],
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}}}}

    out = {"enum of 4,096 words": {"enum": words},
           "enum of 4,096 ints": {"enum": list(range(4096))}}
    for n in (10, 100, 512):
        out[f"forced call, {n} tools"] = {"anyOf": [tool(i) for i in range(n)]}
    return {k: StructuredOutput("json_schema", json.dumps(v)) for k, v in out.items()}


def timed_write(compiled, budget_s: float) -> tuple[str | None, float]:
    box: list[str] = []
    start = time.perf_counter()
    writer = threading.Thread(target=lambda: box.append(compiled.serialize_json()), daemon=True)
    writer.start()
    writer.join(budget_s)
    return (box[0] if box else None), time.perf_counter() - start


def main() -> None:
    from transformers import AutoTokenizer

    from deepinfer.models.default_model import ensure_default_model

    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--write-budget", type=float, default=30.0)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "results", "grammar_transport.json"))
    p.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON")
    args = p.parse_args()
    if args.replot:
        from common import replot

        replot(args.out, plot)
        return
    rows = []
    model = args.model or ensure_default_model(progress=False)
    tokenizer = AutoTokenizer.from_pretrained(model)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    print("| constraint | schema | compile | write-out | written | load |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, spec in cases().items():
        start = time.perf_counter()
        compiled = compiler.compile(spec)
        compile_s = time.perf_counter() - start
        text, write_s = timed_write(compiled, args.write_budget)
        load = "-"
        if text is not None:
            start = time.perf_counter()
            compiler.load(text)
            load = f"{(time.perf_counter() - start) * 1e3:.1f} ms"
        size = f"{len(text) / 1e6:.2f} MB" if text is not None else "-"
        write = f"{write_s:.2f} s" if text is not None else f"> {args.write_budget:g} s"
        print(f"| {name} | {len(spec.spec) / 1e3:.0f} KB | {compile_s:.2f} s | {write} | "
              f"{size} | {load} |", flush=True)
        rows.append({"constraint": name, "schema_bytes": len(spec.spec), "compile_s": compile_s,
                     "write_s": write_s if text is not None else None,
                     "written_bytes": len(text) if text is not None else None,
                     "load_ms": None if load == "-" else float(load.split()[0])})
    from common import write_json

    result = {"write_budget_s": args.write_budget, "rows": rows}
    write_json(args.out, result)
    plot(result, os.path.splitext(args.out)[0] + ".png")


def plot(result: dict, path: str) -> None:
    """Compile, write-out and load seconds per constraint (a write over budget: not drawn)."""
    from common import pyplot

    plt = pyplot()
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for k, (key, label, scale) in enumerate((("compile_s", "compile", 1.0),
                                             ("write_s", "write-out", 1.0),
                                             ("load_ms", "load in the rank", 1e-3))):
        values = [(r[key] or 0.0) * scale for r in rows]
        ax.bar([i + (k - 1) * 0.27 for i in range(len(rows))], values, 0.27, label=label)
    ax.set_xticks(range(len(rows)), [r["constraint"] for r in rows], rotation=20, fontsize=7)
    ax.set_ylabel("seconds")
    ax.set_title(f"write-outs over {result['write_budget_s']:g} s are not drawn")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
