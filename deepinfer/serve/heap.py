"""The garbage collector in the serving processes."""
from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now (the app, the tokenizers, the model and
    engine in a rank) into the collector's permanent generation, as vLLM does once its engine
    is up. Those objects live as long as the process; without this each full collection
    traverses all of them again, and under load full collections are frequent: a wave of
    requests allocates many short-lived objects. Measured in benchmarks/api_cpu_nonstream.py
    (docs/benchmarks.md)."""
    gc.collect()
    gc.freeze()
