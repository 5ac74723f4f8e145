"""HiCache logic through the paging fake: host pages are moved slot by slot, so a page loaded into
the wrong block (or not loaded) changes the fake's tokens against the dense reference."""
from __future__ import annotations

import hashlib
import random

import pytest
from fakes import FAKE_PAGE_BYTES, PagedFakeAccelerator, host_gb, reference, write_config

from deepinfer.core.accelerator import Capabilities
from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from deepinfer.core.engine import Engine
from deepinfer.core.kv import hashing
from deepinfer.core.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
SKIPS_NULL = Capabilities(host_page_copy=True, host_copy_skips_null=True)  # sliding windows


def _engine(tmp_path, host_pages=16, num_blocks=64, keep=1, state_slots=0, budget=64,
            **fake) -> Engine:
    config = EngineConfig(
        model=ModelSpec(write_config(str(tmp_path / "fake"))),
        cache=CacheConfig(block_size=4, num_blocks=num_blocks, hicache_size_gb=host_gb(host_pages),
                          hicache_state_slots=state_slots, yoco_keep_tokens=keep),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget))
    return Engine(config, PagedFakeAccelerator(**fake), load_tokenizer=False)


def _run(engine: Engine, rid: str, prompt: list[int], params=GREEDY, prefix_cache=True):
    engine.add_request(rid, prompt, params, prefix_cache=prefix_cache)
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = out
    assert last is not None and last.finished
    assert list(last.token_ids) == reference(prompt, params.max_tokens), "wrong KV was served"
    return last


def _drop_device_cache(engine: Engine) -> None:
    # The device tier forgets (blocks a store still holds stay; finished stores let go
    # here); the host tier keeps its pages.
    engine.hicache.poll()
    engine.kv.reset_prefix_cache()


def _assert_host_clean(engine: Engine) -> None:
    pool = engine.hicache.pool
    assert engine.hicache.num_inflight == 0
    assert pool.num_pinned == 0
    assert pool.num_free + pool.num_evictable == pool.num_total
    assert engine.kv.num_request_blocks() == 0


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 97) for _ in range(n)]


def test_off_by_default(tmp_path):
    config = EngineConfig(model=ModelSpec(write_config(str(tmp_path / "fake"))))
    assert Engine(config, PagedFakeAccelerator(), load_tokenizer=False).hicache is None


def test_multi_turn_hits_host_after_device_eviction(tmp_path):
    engine = _engine(tmp_path, num_blocks=16)  # 15 device pages of 4 tokens: tight
    convo = _prompt(0, 10)
    for turn in range(5):
        before = engine.hicache.stats()
        out = _run(engine, f"t{turn}", convo)
        after = engine.hicache.stats()
        host_hit = after.host_hit_tokens - before.host_hit_tokens
        device_hit = after.device_hit_tokens - before.device_hit_tokens
        assert out.num_cached_tokens == device_hit + host_hit
        if turn > 0:
            assert host_hit > 0, f"turn {turn} should have hit the host tier"
            # Loaded pages are real device prefix-cache entries now: a repeat hits the device.
            _run(engine, f"again{turn}", convo)
            assert engine.hicache.stats().device_hit_tokens - after.device_hit_tokens \
                >= device_hit + host_hit
        # Another conversation fills the device pool and evicts this one's blocks.
        _run(engine, f"other{turn}", _prompt(100 + turn, 54))
        convo = convo + list(out.token_ids) + _prompt(200 + turn, 3)
    assert engine.hicache.stats().stored_pages > 0
    _assert_host_clean(engine)


def test_hit_prefills_only_the_suffix(tmp_path):
    engine = _engine(tmp_path)
    prompt = _prompt(1, 18)  # 4 full pages + 2 tokens
    _run(engine, "a", prompt)
    _drop_device_cache(engine)
    steps = len(engine.accelerator.steps)
    out = _run(engine, "b", prompt)
    assert out.num_cached_tokens == 16
    assert engine.accelerator.steps[steps].query_lens == [2]
    assert engine.accelerator.copied_pages["to_device"] == 4
    stats = engine.hicache.stats()
    assert (stats.host_hit_tokens, stats.loaded_pages, stats.stored_pages) == (16, 4, 4)
    assert stats.load_bytes == stats.store_bytes == 4 * FAKE_PAGE_BYTES


def test_the_fake_catches_pages_loaded_into_the_wrong_blocks(tmp_path, monkeypatch):
    from deepinfer.core.hicache import HiCache

    load = HiCache.load
    monkeypatch.setattr(HiCache, "load", lambda self, req, hit, blocks:
                        load(self, req, hit, [b[::-1] for b in blocks]))
    engine = _engine(tmp_path)
    prompt = _prompt(1, 18)
    _run(engine, "a", prompt)
    _drop_device_cache(engine)
    with pytest.raises(AssertionError, match="wrong KV"):
        _run(engine, "b", prompt)


def test_miss_and_per_request_opt_out(tmp_path):
    engine = _engine(tmp_path)
    prompt = _prompt(2, 17)
    assert _run(engine, "cold", prompt).num_cached_tokens == 0  # a miss: nothing stored yet
    _drop_device_cache(engine)
    out = _run(engine, "off", prompt, prefix_cache=False)
    assert out.num_cached_tokens == 0
    assert engine.accelerator.copied_pages == {"to_device": 0, "to_host": 4}
    _run(engine, "off2", _prompt(3, 17), prefix_cache=False)  # leaves nothing on the host
    assert engine.hicache.stats().stored_pages == 4
    assert engine.hicache.stats().lookups == 1  # opted-out requests do not count


def test_match_is_capped_to_keep_tokens(tmp_path):
    engine = _engine(tmp_path, keep=10)
    prompt = _prompt(4, 30)  # 7 full pages stored
    _run(engine, "a", prompt)
    _drop_device_cache(engine)
    # At most 30 - 10 = 20 tokens may be hit: 5 pages, leaving 10 tokens to recompute.
    assert _run(engine, "b", prompt).num_cached_tokens == 20


@pytest.mark.parametrize("window", [None, 8])
def test_host_hit_continues_a_device_hit(tmp_path, window):
    # With a window, the device hit's blocks the window no longer reads at 20 are not taken.
    engine = _engine(tmp_path, window=window, capabilities=SKIPS_NULL if window else None)
    prompt = _prompt(5, 22)  # 5 full pages
    _run(engine, "a", prompt)
    pool = engine.kv.pool
    tail = [b for b in pool.blocks if b.block_hash is not None][-3:]
    for block in tail:  # drop the device copy of the last pages only
        pool._evict(block)
    out = _run(engine, "b", prompt)
    stats = engine.hicache.stats()
    assert out.num_cached_tokens == 20
    assert 0 < stats.host_hit_tokens < 20 and stats.device_hit_tokens + stats.host_hit_tokens == 20


def test_snap_to_a_stored_state(tmp_path):
    engine = _engine(tmp_path, keep=8, state_slots=4, state_bytes=64)
    turn1 = _prompt(6, 13)  # 3 full pages: state saved at 12 tokens
    out = _run(engine, "t1", turn1)
    turn2 = turn1 + list(out.token_ids) + _prompt(7, 13)  # 30 tokens: state saved at 28
    out = _run(engine, "t2", turn2)
    fake = engine.accelerator
    assert sorted(fake.host_state.values()) == [12, 28]
    _drop_device_cache(engine)
    turn3 = turn2 + list(out.token_ids)  # 34 tokens: the cap allows 26, snapped down to 12
    assert _run(engine, "t3", turn3).num_cached_tokens == 12
    assert fake.restored == [("t3", 12)]
    _drop_device_cache(engine)
    assert sorted(fake.host_state.values()) == [12, 28, 32]  # t3 saved its own state too
    turn4 = turn3 + _prompt(8, 4)  # 38 tokens: the cap allows 30, snapped down to 28
    assert _run(engine, "t4", turn4).num_cached_tokens == 28
    assert fake.restored[-1] == ("t4", 28)
    _assert_host_clean(engine)


def test_no_state_slot_means_no_host_hit(tmp_path):
    engine = _engine(tmp_path, state_slots=0, state_bytes=64)
    prompt = _prompt(9, 17)
    _run(engine, "a", prompt)
    _drop_device_cache(engine)
    assert _run(engine, "b", prompt).num_cached_tokens == 0
    assert engine.accelerator.restored == []


def test_lru_eviction_drops_tails_first(tmp_path):
    engine = _engine(tmp_path, host_pages=4)
    a, b = _prompt(10, 13), _prompt(11, 13)  # 3 full pages each
    _run(engine, "a", a)
    _run(engine, "b", b)  # 1 free page + a's two tail pages
    assert engine.hicache.stats().evicted_pages == 2
    _drop_device_cache(engine)
    assert _run(engine, "b2", b).num_cached_tokens == 12
    _drop_device_cache(engine)
    assert _run(engine, "a2", a).num_cached_tokens == 4  # a's root page survived
    _assert_host_clean(engine)


def test_pinned_pages_are_never_evicted(tmp_path):
    engine = _engine(tmp_path, host_pages=4, async_copies=True)
    fake = engine.accelerator
    a, b = _prompt(12, 13), _prompt(13, 13)
    _run(engine, "a", a)  # its 3-page store is still in flight: pinned, not yet indexed
    pool = engine.hicache.pool
    assert pool.num_pinned == 3 and engine.hicache.num_inflight == 1
    _run(engine, "b", b)  # only the one free page is available to b
    assert pool.num_pinned == 4 and engine.hicache.stats().evicted_pages == 0
    fake.finish_copies()
    engine.hicache.poll()
    assert engine.hicache.stats().stored_pages == 4
    _drop_device_cache(engine)
    out = _run(engine, "a2", a)  # a's pages survived the pressure; the load pins them again
    assert out.num_cached_tokens == 12
    fake.finish_copies()
    engine.hicache.poll()
    _assert_host_clean(engine)


@pytest.mark.parametrize("window", [None, 8])
def test_no_leaks_after_aborts(tmp_path, window):
    caps = SKIPS_NULL if window else None
    engine = _engine(tmp_path, host_pages=12, num_blocks=24, budget=6, async_copies=True,
                     window=window, capabilities=caps)
    rng = random.Random(0)
    shared = _prompt(14, 12)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i in range(30):
        engine.add_request(str(i), shared + _prompt(20 + i, rng.randrange(1, 14)), params)
        for _ in range(rng.randrange(0, 4)):
            engine.step()
        if rng.random() < 0.5:
            engine.accelerator.finish_copies()
        if rng.random() < 0.5:
            engine.abort(str(rng.randrange(0, i + 1)))
        if rng.random() < 0.25:  # go idle and forget the device tier: the next one hits host
            while engine.has_unfinished_requests():
                engine.step()
            engine.accelerator.finish_copies()
            engine.hicache.poll()
            _drop_device_cache(engine)
    while engine.has_unfinished_requests():
        engine.step()
    engine.accelerator.finish_copies()
    engine.hicache.poll()
    assert engine.hicache.stats().host_hit_tokens > 0
    _assert_host_clean(engine)
    assert all(g.pool.num_free == g.pool.num_usable for g in engine.kv.groups)


def test_abort_during_a_chunked_prefill_after_a_host_load(tmp_path):
    engine = _engine(tmp_path, budget=4, async_copies=True)
    prompt = _prompt(18, 30)
    _run(engine, "a", prompt)
    engine.accelerator.finish_copies()
    _drop_device_cache(engine)
    engine.add_request("b", prompt + _prompt(19, 12), GREEDY)
    engine.step()  # admitted: 7 pages loaded (copy still in flight), first 4-token chunk
    # ... whose page (7) the write-through stores at once (in flight too)
    assert engine.hicache.pool.num_pinned == 8
    engine.step()  # page 8
    engine.abort("b")
    assert engine.hicache.pool.num_pinned == 9  # the copies still run: their pages stay pinned
    engine.accelerator.finish_copies()
    engine.hicache.poll()
    assert engine.hicache.stats().host_hit_tokens == 28
    assert engine.hicache.stats().stored_pages == 9  # a's 7, then b's two chunks
    _assert_host_clean(engine)


def test_hash_collisions_are_rejected(tmp_path, monkeypatch):
    # Every chain collides: a page's hash depends on its position only.
    monkeypatch.setattr(hashing, "hash_block", lambda parent, tokens, extra=b"":
                        hashlib.blake2b(parent or b"root", digest_size=16).digest())
    engine = _engine(tmp_path)
    a, b = _prompt(15, 13), _prompt(16, 13)
    _run(engine, "a", a)
    _drop_device_cache(engine)
    assert _run(engine, "b", b).num_cached_tokens == 0  # same hashes, other tokens: a miss
    assert engine.accelerator.copied_pages["to_device"] == 0
    assert engine.hicache.stats().stored_pages == 3  # b could not take a's hashes either
    _drop_device_cache(engine)
    assert _run(engine, "a2", a).num_cached_tokens == 12


def test_reset_drops_host_pages(tmp_path):
    engine = _engine(tmp_path)
    _run(engine, "a", _prompt(17, 13))
    # 4 device pages (prompt and output computed) + the 3 full prompt pages on the host.
    assert engine.reset_prefix_cache() == 4 + 3
    assert engine.hicache.pool.num_used == 0


def test_backend_without_host_copy_is_refused(tmp_path):
    class NoHost(PagedFakeAccelerator):
        capabilities = PagedFakeAccelerator.capabilities.__class__(host_page_copy=False)

    config = EngineConfig(model=ModelSpec(write_config(str(tmp_path / "fake"))),
                          cache=CacheConfig(block_size=4, num_blocks=8, hicache_size_gb=1.0))
    with pytest.raises(ValueError, match="cannot copy KV pages"):
        Engine(config, NoHost(), load_tokenizer=False)


# ---- sliding-window models: the write-through finds the window's old pages freed ----------


def _table_after_admission(engine: Engine, rid: str, prompt: list[int]) -> list[int]:
    """The request's block table once its first step ran (before the next step frees what
    left the window), and then the request run to its end."""
    engine.add_request(rid, prompt, GREEDY)
    engine.step()
    table = list(engine.kv.block_ids(rid))
    while engine.has_unfinished_requests():
        engine.step()
    return table


def test_sliding_window_hit_loads_only_the_window(tmp_path):
    """One-chunk prefill: every page is stored whole. The hit (capped at 21 tokens: 5 pages)
    loads only the pages the 6-token window reads at 20 (3 and 4); pages 0-2 stay the null
    block, as a cold prefill would have freed them."""
    engine = _engine(tmp_path, window=6, capabilities=SKIPS_NULL)
    prompt = _prompt(20, 22)
    _run(engine, "a", prompt)
    _drop_device_cache(engine)
    table = _table_after_admission(engine, "b", prompt)
    assert table[:3] == [0, 0, 0] and 0 not in table[3:]
    assert engine.hicache.stats().host_hit_tokens == 20
    assert _run(engine, "c", prompt).num_cached_tokens == 20  # now a device hit
    _assert_host_clean(engine)


@pytest.mark.parametrize("keep, hit", [(1, 20), (3, 16), (7, 12), (11, 8)])
def test_sliding_window_chunks_are_stored_before_they_leave_the_window(tmp_path, keep, hit):
    """8-token chunks: each chunk's pages are stored right after it runs, before the next step
    frees what left the 6-token window, so every page is stored whole and a hit resumes at
    any page end the keep_tokens cap allows (22 - keep, down to a page end)."""
    engine = _engine(tmp_path, window=6, capabilities=SKIPS_NULL, budget=8, keep=keep)
    prompt = _prompt(21, 22)
    _run(engine, "a", prompt)
    assert _stored_whole(engine, prompt) == [True] * 5
    _drop_device_cache(engine)
    assert _run(engine, "b", prompt).num_cached_tokens == hit
    _assert_host_clean(engine)


def _stored_whole(engine: Engine, prompt: list[int]) -> list[bool]:
    """Per full page of the prompt, whether the host page holding its tokens is complete."""
    pages = {p.token_ids: p for p in engine.hicache.pool.pages if p.block_hash is not None}
    return [pages[tuple(prompt[i:i + 4])].complete for i in range(0, len(prompt) - 3, 4)]


def test_sliding_window_hit_snaps_to_pages_stored_whole(tmp_path):
    """Pages whose window blocks were freed before the host got them are stored without them.
    a runs with 8-token chunks; the host tier then forgets it (the device keeps its pages);
    b, the same prompt, is a device hit of 20 tokens whose table holds only the pages the
    6-token window reads there (3 and 4): its write-through stores pages 0-2 incomplete.
    After the device forgets too, c (the same prompt) resumes from the host at 20 (it needs
    pages 3 and 4), and d, which shares only the first 4 pages, gets no hit: ending at 4 pages
    needs page 2, at 3 page 1, ..., all incomplete."""
    engine = _engine(tmp_path, window=6, capabilities=SKIPS_NULL, budget=8)
    prompt = _prompt(21, 22)
    _run(engine, "a", prompt)
    engine.hicache.poll()
    engine.hicache.reset()
    assert _run(engine, "b", prompt).num_cached_tokens == 20
    assert _stored_whole(engine, prompt) == [False] * 3 + [True] * 2
    _drop_device_cache(engine)
    assert _run(engine, "c", prompt).num_cached_tokens == 20
    _drop_device_cache(engine)
    assert _run(engine, "d", prompt[:16] + _prompt(22, 6)).num_cached_tokens == 0
    _assert_host_clean(engine)


def test_sliding_window_needs_a_copy_that_skips_freed_pages(tmp_path):
    config = EngineConfig(model=ModelSpec(write_config(str(tmp_path / "fake"))),
                          cache=CacheConfig(block_size=4, num_blocks=8, hicache_size_gb=1.0))
    with pytest.raises(ValueError, match="sliding window's freed pages"):
        Engine(config, PagedFakeAccelerator(window=6), load_tokenizer=False)


@pytest.mark.parametrize("window", [None, 8])
def test_a_store_holds_its_device_blocks_until_it_has_run(tmp_path, window):
    """A store that reads its blocks only when it runs (a backend's copy stream): the request
    ends and later requests allocate meanwhile, but the stored pages' blocks stay out of the
    pool until the copy is done, so the host tier gets the request's KV and a host hit serves
    it (without the hold, c takes a's freed page blocks first and the hit is c's tokens). c
    finds the pool short while a's and b's stores hold six blocks: the scheduler waits the
    stores out instead of stalling."""
    caps = SKIPS_NULL if window else None
    engine = _engine(tmp_path, num_blocks=10, deferred_stores=True, window=window,
                     capabilities=caps)
    fake, pool = engine.accelerator, engine.kv.groups[0].pool
    a, b, c = _prompt(40, 13), _prompt(41, 13), _prompt(42, 13)  # 3 full pages each
    _run(engine, "a", a)
    held = pool.num_usable - pool.num_free
    assert held == 3  # the pages a's store copies
    _run(engine, "b", b)
    _run(engine, "c", c)  # the front of the free list: a's pages, had they been freed
    fake.finish_copies()
    engine.hicache.poll()
    assert pool.num_free == pool.num_usable
    _drop_device_cache(engine)
    assert _run(engine, "a2", a).num_cached_tokens > 0
    fake.finish_copies()
    engine.hicache.poll()
    _assert_host_clean(engine)


def test_a_prompt_back_before_its_store_is_done_is_not_stored_twice(tmp_path):
    """The next turn (here: the same prompt, a device hit, then a longer one) arrives while
    the first store is still copying: its store copies only the pages nobody is writing yet,
    the pending pages are indexed once, and a host hit then serves all of them."""
    engine = _engine(tmp_path, deferred_stores=True)
    fake = engine.accelerator
    a = _prompt(50, 13)  # 3 full pages
    _run(engine, "a", a)
    assert fake.copied_pages["to_host"] == 3
    assert _run(engine, "a-again", a).num_cached_tokens == 12
    assert fake.copied_pages["to_host"] == 3  # nothing new to store
    longer = a + _prompt(51, 8)  # 5 full pages: 2 new
    _run(engine, "a-longer", longer)
    assert fake.copied_pages["to_host"] == 5
    fake.finish_copies()
    engine.hicache.poll()
    assert engine.hicache.stats().stored_pages == 5
    _drop_device_cache(engine)
    assert _run(engine, "a-host", longer).num_cached_tokens == 20
    fake.finish_copies()
    engine.hicache.poll()
    _assert_host_clean(engine)
