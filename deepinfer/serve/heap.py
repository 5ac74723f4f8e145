"""The garbage collector in the serving processes."""
from __future__ import annotations

import gc

# Allocations between young-generation collections (CPython's default: 700). A request in
# flight holds many small objects (its queue, events, dicts, SSE chunks) that reference
# counting frees; at the default a wave of requests runs a young collection every few hundred
# of them, and each also advances the older generations toward a full collection.
YOUNG_COLLECTION_EVERY = 20_000


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now (the app, the tokenizers, the model and
    engine in a rank) into the collector's permanent generation, as vLLM does once its engine
    is up, and collect the young generation less often. Those objects live as long as the
    process; without this each full collection traverses all of them again, and under load
    full collections are frequent. Measured in benchmarks/api_cpu_nonstream.py
    (docs/benchmarks.md)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_EVERY)
