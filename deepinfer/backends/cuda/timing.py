"""Device-side timing for the benchmarks: CUDA events around each call, after a warm-up."""
from __future__ import annotations

from typing import Callable

import torch


def cuda_times_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> list[float]:
    """Milliseconds of each of `reps` calls of fn, measured on the current stream."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times
