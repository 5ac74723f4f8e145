"""Compile, serialize and load times of constraints at the server's default limits.

What the grammar workers (serve/grammar_worker.py) and a rank (serve/rank_grammars.py) spend on
one constraint: the compile, the write-out (budgeted: past it the rank compiles instead), and
the rank's load of what was sent. Measured, never asserted.

    python benchmarks/grammar_transport.py [--model DIR]
"""
from __future__ import annotations

import argparse
import json
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
    args = p.parse_args()
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


if __name__ == "__main__":
    main()
