"""HiCache on the CPU backend with a random-weight llama: host pages round-trip bit for bit, and a
multi-turn conversation whose device pages are evicted between turns decodes the same greedy
tokens with the host tier on and off, with the hits coming from the host."""
from __future__ import annotations

import random

import torch

from deepinfer.backends.cpu.accelerator import CPUAccelerator
from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from deepinfer.core.engine import Engine
from deepinfer.core.sampling import SamplingParams

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _engine(path: str, host_pages: int, num_blocks: int = 14) -> Engine:
    page_bytes = 2 * 2 * BLOCK * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, float32
    config = EngineConfig(
        model=ModelSpec(path, "float32"),
        cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks, yoco_keep_tokens=8,
                          hicache_size_gb=host_pages * page_bytes / (1 << 30)),
        scheduler=SchedulerConfig(max_num_batched_tokens=256))
    return Engine(config, CPUAccelerator(), load_tokenizer=False)


def _generate(engine: Engine, rid: str, prompt: list[int]):
    engine.add_request(rid, prompt, GREEDY)
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = out
    return last


def _conversation(engine: Engine, turns: int = 6) -> tuple[list[list[int]], list[int]]:
    """Each turn appends the previous answer and new user tokens; another user's long prompt
    runs between turns and takes the device pool (13 pages of 16), evicting earlier turns."""
    rng = random.Random(0)
    convo = [rng.randrange(2, 250) for _ in range(40)]
    outputs, cached = [], []
    for turn in range(turns):
        out = _generate(engine, f"t{turn}", convo)
        outputs.append(list(out.token_ids))
        cached.append(out.num_cached_tokens)
        other = [rng.randrange(2, 250) for _ in range(180)]
        _generate(engine, f"other{turn}", other)
        convo = convo + list(out.token_ids) + [rng.randrange(2, 250) for _ in range(12)]
    return outputs, cached


def test_host_pages_round_trip(llama_dir):
    engine = _engine(llama_dir, host_pages=8)
    acc = engine.accelerator
    for cache in acc.attention.k_cache + acc.attention.v_cache:
        cache.normal_()
    k0 = [c.clone() for c in acc.attention.k_cache]
    v0 = [c.clone() for c in acc.attention.v_cache]
    acc.copy_pages([5, 2], [3, 7], to_device=False)
    acc.copy_pages([5, 2], [9, 1], to_device=True)
    for layer in range(len(k0)):
        for new, old in ((acc.attention.k_cache[layer], k0[layer]),
                         (acc.attention.v_cache[layer], v0[layer])):
            paged_new, paged_old = new.view(-1, BLOCK, 2, 16), old.view(-1, BLOCK, 2, 16)
            assert torch.equal(paged_new[9], paged_old[3])
            assert torch.equal(paged_new[1], paged_old[7])
            assert torch.equal(paged_new[3], paged_old[3])  # sources untouched
    assert engine.hicache.layout.page_bytes == acc.host_page_bytes() == 2 * 2 * BLOCK * 2 * 16 * 4


def test_multi_turn_conversation_same_tokens_with_host_tier(llama_dir):
    off = _engine(llama_dir, host_pages=0)
    assert off.hicache is None
    want, cached_off = _conversation(off)
    on = _engine(llama_dir, host_pages=64)
    got, cached_on = _conversation(on)
    assert got == want
    stats = on.hicache.stats()
    assert stats.host_hit_tokens > 0 and stats.loaded_pages > 0
    assert sum(cached_on) > sum(cached_off)  # the host tier served what the device lost
    # The other users' random prompts hit nothing, so every hit belongs to the conversation.
    assert sum(cached_on) == stats.device_hit_tokens + stats.host_hit_tokens
    assert on.hicache.pool.num_pinned == 0 and on.kv.num_request_blocks() == 0
