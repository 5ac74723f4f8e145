"""Where a checkpoint tensor goes: the types a model's name mapping returns (weights.py reads
them; packed weights and MoE layers take an expert slot's rows)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class SlotRows:
    """One expert slot of a stacked [S, ...] expert parameter, and rows [start, end) within it
    (None: all of them). `source` (axis, start, end): only that part of the checkpoint tensor
    loads here (a shared expert of several experts' width split over as many slots); None:
    all of it."""

    slot: int
    rows: tuple[int, int] | None = None
    source: tuple[int, int, int] | None = None


# checkpoint name -> (parameter name, rows [start, end) of it, an expert slot's rows, or None
# for all of it); a list when the tensor has several places (an expert replicated on this
# rank), [] or None to skip
Target = tuple[str, tuple[int, int] | SlotRows | None]
Mapper = Callable[[str], Target | list[Target] | None]
