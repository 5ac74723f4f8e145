"""A rate measured as the server runs (the disk tier's reads, the engine's prefill), for choices
that weigh one against the other."""
from __future__ import annotations

from dataclasses import dataclass

# Weight of the newest sample: a few samples follow a changed disk or load, one odd one does not
# decide alone.
NEW_WEIGHT = 0.3


@dataclass
class Rate:
    """Units a second, an exponentially weighted mean of samples (units, seconds); None until
    the first sample."""

    value: float | None = None

    def add(self, units: float, seconds: float) -> None:
        if units <= 0 or seconds <= 0:
            return
        sample = units / seconds
        self.value = sample if self.value is None else \
            (1 - NEW_WEIGHT) * self.value + NEW_WEIGHT * sample

    def seconds_for(self, units: float) -> float | None:
        """How long `units` take at this rate; None while it is unknown."""
        return None if self.value is None else units / self.value
