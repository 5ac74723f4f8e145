"""A histogram of counts kept as running totals, so a rank can report it whole and the reader
exposes it as it is (a Prometheus histogram's buckets and sum are running totals too)."""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Tokens per engine step: the buckets vLLM gives vllm:iteration_tokens_total.
STEP_TOKEN_BOUNDS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class CountHistogram:
    bounds: tuple[int, ...]
    # Observations per bucket (not cumulative): counts[i] for values in (bounds[i-1],
    # bounds[i]], the last for values above every bound.
    counts: list[int] = field(default_factory=list)
    total: int = 0  # the sum of the values observed

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: int) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
