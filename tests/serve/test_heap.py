"""freeze_startup_heap: what a serving process does to its collector once it serves."""
from __future__ import annotations

import gc

from deepinfer.serve.heap import YOUNG_COLLECTION_EVERY, freeze_startup_heap


def test_freezes_the_live_heap_and_collects_the_young_less_often() -> None:
    threshold = gc.get_threshold()
    marker = [object()]  # alive at the call: must end up frozen
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold()[0] == YOUNG_COLLECTION_EVERY
        assert gc.get_threshold()[1:] == threshold[1:]
        assert not any(obj is marker for obj in gc.get_objects())  # frozen: not tracked
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
    assert any(obj is marker for obj in gc.get_objects())
