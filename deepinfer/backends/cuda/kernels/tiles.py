"""How many rows (tokens, heads) a program of a row-wise kernel takes: one on a GPU, where a
program a row keeps every SM busy; under Triton's interpreter, whose cost is per program
rather than per element, as many as fill INTERPRETED_TILE elements."""
from __future__ import annotations

import triton

from deepinfer.backends.cuda.settings import interpreted

INTERPRETED_TILE = 65536  # elements a program holds under the interpreter


def rows_per_program(rows: int, row_elements: int) -> int:
    if not interpreted():
        return 1
    return max(1, min(triton.next_power_of_2(rows), INTERPRETED_TILE // row_elements))
