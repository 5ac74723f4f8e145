"""benchmarks/cpu_gguf: the two sides take turns and each side's median run is compared."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from cpu_gguf import interleaved  # noqa: E402


def test_sides_take_turns_and_report_their_medians() -> None:
    order: list[str] = []

    def side(name: str, rates: list[tuple[float, float]]):
        runs = iter(rates)

        def run() -> dict:
            order.append(name)
            decode, prefill = next(runs)
            return {"decode_tok_s": decode, "prefill_tok_s": prefill, "tokens": [name]}
        return run

    peer, ours = interleaved(side("peer", [(100, 400), (140, 300), (120, 500)]),
                             side("ours", [(90, 600), (130, 650), (80, 700)]), rounds=3)
    assert order == ["peer", "ours"] * 3
    assert (peer["decode_tok_s"], peer["prefill_tok_s"]) == (120, 400)  # medians, apart
    assert (ours["decode_tok_s"], ours["prefill_tok_s"]) == (90, 650)
    assert [r["decode_tok_s"] for r in ours["runs"]] == [90, 130, 80]
    assert ours["tokens"] == ["ours"]
