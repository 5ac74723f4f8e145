"""HiCache on the CPU backend with a random-weight llama: host pages round-trip bit for bit, and a
multi-turn conversation whose device pages are evicted between turns decodes the same greedy
tokens with the host tier on and off, with the hits coming from the host."""
from __future__ import annotations

import torch

from deepinfer.backends.cpu.accelerator import CPUAccelerator
from deepinfer.core.engine import Engine
from deepinfer.testing.hicache import BLOCK, check_host_tier, make_engine


def _engine(path: str, host_pages: int) -> Engine:
    return make_engine(path, CPUAccelerator(), host_pages)


def test_host_pages_round_trip(llama_dir):
    engine = _engine(llama_dir, host_pages=8)
    acc = engine.accelerator
    chunks = [tensor for _, tensor in acc.runner.cache.chunk_tensors()]
    assert len(chunks) == 2 * 2  # K and V of 2 layers
    for tensor in chunks:
        tensor.normal_()
    before = [t.clone() for t in chunks]
    acc.copy_pages([5, 2], [[3, 7]], to_device=False)
    acc.copy_pages([5, 2], [[9, 1]], to_device=True)
    for new, old in zip(chunks, before):
        paged_new, paged_old = new.view(-1, BLOCK, 2, 16), old.view(-1, BLOCK, 2, 16)
        assert torch.equal(paged_new[9], paged_old[3])
        assert torch.equal(paged_new[1], paged_old[7])
        assert torch.equal(paged_new[3], paged_old[3])  # sources untouched
    assert engine.hicache.layout.page_bytes == acc.host_page_bytes() == 2 * 2 * BLOCK * 2 * 16 * 4


def test_null_blocks_are_left_out(llama_dir):
    """A null block (a sliding group's freed page) is neither stored nor written to."""
    engine = _engine(llama_dir, host_pages=8)
    acc = engine.accelerator
    chunks = [tensor for _, tensor in acc.runner.cache.chunk_tensors()]
    for tensor in chunks:
        tensor.normal_()
    acc.host_pool.pages.fill_(7.0)
    acc.copy_pages([5, 2], [[3, 0]], to_device=False)
    assert (acc.host_pool.pages[2] == 7.0).all() and not (acc.host_pool.pages[5] == 7.0).any()
    before = [t.clone() for t in chunks]
    acc.copy_pages([5, 2], [[0, 9]], to_device=True)
    for new, old in zip(chunks, before):
        paged_new, paged_old = new.view(-1, BLOCK, 2, 16), old.view(-1, BLOCK, 2, 16)
        assert torch.equal(paged_new[0], paged_old[0])  # the null block is never written
        assert (paged_new[9] == 7.0).all()


def test_multi_turn_conversation_same_tokens_with_host_tier(llama_dir):
    stats = check_host_tier(llama_dir, CPUAccelerator, vocab=250)
    assert stats.stored_pages > 0
