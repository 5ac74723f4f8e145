"""Block pool and KV manager: ref counts, LRU order, hash-chain hits with token checks."""
from __future__ import annotations

import pytest

from deepinfer.core.kv.block_pool import BlockPool, NoFreeBlocks
from deepinfer.core.kv.hashing import hash_block
from deepinfer.core.kv.manager import KVCacheManager
from deepinfer.core.request import Request
from deepinfer.core.sampling import SamplingParams


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), seed=0, max_tokens=8)


def test_null_block_is_never_allocated():
    pool = BlockPool(5)
    ids = {b.block_id for b in pool.allocate(4)}
    assert ids == {1, 2, 3, 4}
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)


def test_free_list_is_lru():
    pool = BlockPool(6)
    a, b, c, d, e = pool.allocate(5)
    pool.release([c, a, e])
    pool.release([b])
    # Least recently freed first.
    assert [x.block_id for x in pool.allocate(4)] == [c.block_id, a.block_id, e.block_id,
                                                      b.block_id]


def test_evicts_least_recently_freed_cached_page():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache(a, b"h-a", [1, 2])
    pool.cache(b, b"h-b", [3, 4])
    pool.release([a])
    pool.release([b])
    (fresh,) = pool.allocate(1)
    assert fresh is a
    assert pool.lookup(b"h-a", [1, 2]) is None
    assert pool.lookup(b"h-b", [3, 4]) is b


def test_hit_requires_equal_tokens():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.cache(a, b"same-hash", [1, 2, 3])
    assert pool.lookup(b"same-hash", [1, 2, 3]) is a
    # A forged collision: same hash, other tokens, must miss.
    assert pool.lookup(b"same-hash", [1, 2, 4]) is None


def test_hash_chain_depends_on_every_earlier_page():
    h1 = hash_block(None, [1, 2])
    assert hash_block(h1, [3, 4]) != hash_block(hash_block(None, [9, 2]), [3, 4])
    assert hash_block(None, [1, 2], b"salt") != h1
    assert hash_block(None, [1, 2]) == h1


def test_manager_shares_prefix_pages_and_frees_everything():
    kv = KVCacheManager(num_blocks=9, block_size=4)
    first = _req("a", list(range(10)))
    assert kv.allocate(first, 10)
    first.num_computed_tokens = 10
    kv.cache_computed_pages(first)
    second = _req("b", list(range(8)) + [50, 51, 52])
    (hit,) = kv.find_cached_prefix(second)  # one KV group
    assert [b.block_id for b in hit] == kv.block_ids("a")[:2]
    assert kv.allocate(second, 3, [hit])
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert hit[0].ref_cnt == 2
    kv.free(first)
    kv.free(second)
    assert kv.pool.num_free == kv.pool.num_usable
    assert kv.num_request_blocks() == 0


def test_whole_prompt_hit_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=9, block_size=4)
    first = _req("a", list(range(8)))
    kv.allocate(first, 8)
    first.num_computed_tokens = 8
    kv.cache_computed_pages(first)
    again = _req("b", list(range(8)))
    assert len(kv.find_cached_prefix(again)[0]) == 1  # not 2: the last token must run


def test_allocation_failure_takes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    big = _req("a", list(range(20)))
    assert not kv.allocate(big, 20)
    assert kv.pool.num_free == 3 and kv.block_ids("a") == []


def test_state_slots_are_per_request_and_come_back():
    from deepinfer.core.kv.spec import KVSpec, kv_heads_layer

    spec = KVSpec((kv_heads_layer(1, 4),), state_bytes=64)
    kv = KVCacheManager(num_blocks=16, block_size=4, spec=spec, num_state_slots=2)
    a, b = _req("a", list(range(6))), _req("b", list(range(9)))
    assert kv.allocate(a, 6) and kv.allocate(b, 9)
    assert {kv.state_slot("a"), kv.state_slot("b")} == {0, 1}
    slot_a = kv.state_slot("a")
    a.num_computed_tokens = 6
    assert kv.allocate(a, 1) and kv.state_slot("a") == slot_a  # kept while it runs
    kv.free(a)
    assert kv.state_slot("a") is None
    c = _req("c", [1, 2, 3])
    assert kv.allocate(c, 3) and kv.state_slot("c") == slot_a  # freed slots are reused


def test_models_with_state_take_no_device_prefix_hits():
    """Cached pages alone cannot resume a model with per-request state (no state snapshots on
    the device yet): the same prompt again is a miss."""
    from deepinfer.core.kv.spec import KVSpec, kv_heads_layer

    spec = KVSpec((kv_heads_layer(1, 4),), state_bytes=64)
    kv = KVCacheManager(num_blocks=9, block_size=4, spec=spec, num_state_slots=2)
    first = _req("a", list(range(10)))
    assert kv.allocate(first, 10)
    first.num_computed_tokens = 10
    kv.cache_computed_pages(first)
    assert kv.find_cached_prefix(_req("b", list(range(10)))) == [[]]
