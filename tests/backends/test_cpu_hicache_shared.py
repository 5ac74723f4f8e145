"""The node's shared HiCache pool on the CPU backend: two ranks (engines) over one pool serve a
conversation whose turns alternate between them, each turn reusing what the other rank stored,
with the greedy tokens of a run with no cache, for llama, a sliding-window model and MLA."""
from __future__ import annotations

import logging

import pytest
from checkpoints import make_checkpoint

from deepinfer.backends.cpu.accelerator import CPUAccelerator
from deepinfer.core.hicache import shared_pool
from deepinfer.core.hicache.shared_pool import SharedPoolPlace
from deepinfer.testing.hicache import check_shared_pool, make_engine

VOCAB = 250


@pytest.mark.parametrize("family", ["llama", "mistral", "deepseek_v3"])
def test_two_ranks_serve_one_conversation_from_one_pool(family, tmp_path):
    overrides = {"sliding_window": 24} if family == "mistral" else {}
    path = make_checkpoint(str(tmp_path / family), family, **overrides)
    stats = check_shared_pool(path, CPUAccelerator, VOCAB, str(tmp_path / "pool"))
    assert all(s.shared for s in stats)


def test_no_room_in_shared_memory_falls_back_to_a_pool_per_rank(llama_dir, tmp_path,
                                                                 monkeypatch, caplog):
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shared_pool.os, "posix_fallocate", full)
    with caplog.at_level(logging.WARNING):
        engine = make_engine(llama_dir, CPUAccelerator(), host_pages=16,
                             shared=SharedPoolPlace(str(tmp_path), 2, 0))
    assert "a host pool per rank, not shared" in caplog.text
    assert not engine.hicache.stats().shared and engine.hicache.layout.num_pages == 16
    engine.shutdown()
