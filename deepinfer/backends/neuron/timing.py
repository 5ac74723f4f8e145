"""Region timing (DEEPINFER_NEURON_REGION_TIMING=1): device time per region of a step, taken
at the graph-split boundaries (attention, router exchange, experts, combine).

Each region waits for the device before and after it, so the times are the device's, not the
host's enqueue time; that serialises the step, which is why it is off by default. Off, a region
is a shared no-op context: zero cost.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, Mapping

from deepinfer.backends.neuron.env import neuron_settings

TIMING_ENV = "DEEPINFER_NEURON_REGION_TIMING"
REGIONS = ("attention", "router_exchange", "experts", "combine")


def timing_requested(environ: Mapping[str, str] | None = None) -> bool:
    return neuron_settings(environ).region_timing


class RegionTimer:
    def __init__(self, enabled: bool, synchronize: Callable[[], None] = lambda: None) -> None:
        self.enabled = enabled
        self.synchronize = synchronize
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._off = contextlib.nullcontext()

    def region(self, name: str):
        return self._timed(name) if self.enabled else self._off

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        self.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            self.calls[name] = self.calls.get(name, 0) + 1

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Totals since start: {region: {"seconds": s, "calls": n}}."""
        return {name: {"seconds": self.seconds[name], "calls": self.calls[name]}
                for name in self.seconds}
