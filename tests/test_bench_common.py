"""benchmarks/common.exposed_by_name: the time each name's intervals add to their union."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from common import exposed_by_name  # noqa: E402


def test_overlapped_kernels_count_only_what_they_add() -> None:
    """A kernel launched early (PDL) that ends 2 us after the one ahead adds 2 us; one wholly
    inside another adds nothing; a gap is nobody's; sorted by start whatever the order given."""
    spans = [(10.0, 14.0, "norm"), (0.0, 10.0, "gemv"), (8.0, 12.0, "rotary"),
             (9.0, 9.5, "tiny"), (20.0, 25.0, "gemv")]
    got = exposed_by_name(spans)
    assert got == pytest.approx({"gemv": 15.0, "rotary": 2.0, "tiny": 0.0, "norm": 2.0})
    assert sum(got.values()) == pytest.approx(19.0)  # the union: [0, 14] and [20, 25]


def test_no_spans() -> None:
    assert exposed_by_name([]) == {}
