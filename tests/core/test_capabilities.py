"""The scheduler honours a backend's Capabilities: it pads steps to static buckets with rows that
touch only the null block, never outgrows a fixed KV pool (so nothing is preempted), and keeps a
prefill whole on a backend without chunked prefill. Sliding-window KV groups free the blocks
that fell out of the window. The fake model reads its context back through the block tables, so
any wrong block, slot or padding row changes its tokens against the dense reference."""
from __future__ import annotations

import random

import pytest
from fakes import PagedFakeAccelerator, reference, write_config

from deepinfer.core.accelerator import Capabilities
from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from deepinfer.core.engine import Engine
from deepinfer.core.padding import Buckets, pad_batch
from deepinfer.core.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _engine(tmp_path, caps: Capabilities | None = None, num_blocks: int = 256,
            budget: int = 64, window: int | None = None, max_seqs: int = 16) -> Engine:
    config = EngineConfig(
        model=ModelSpec(write_config(str(tmp_path / "fake"))),
        cache=CacheConfig(block_size=4, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs))
    return Engine(config, PagedFakeAccelerator(window=window, capabilities=caps),
                  load_tokenizer=False)


def _prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 97) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _run(engine: Engine, prompts: list[list[int]], params=GREEDY) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
    assert engine.kv.num_request_blocks() == 0
    return done


def test_steps_are_padded_to_the_buckets(tmp_path):
    caps = Capabilities(token_buckets=(16, 32, 64), batch_buckets=(1, 2, 4, 8))
    engine = _engine(tmp_path, caps)
    prompts = _prompts(6, seed=1)
    done = _run(engine, prompts)
    assert all(done[str(i)] == reference(p, 24) for i, p in enumerate(prompts))
    steps = engine.accelerator.steps
    decodes = [b for b in steps if b.is_decode_only]
    assert all(b.num_tokens in (16, 32, 64) for b in steps if not b.is_decode_only)
    assert decodes and all(b.num_seqs in (1, 2, 4, 8) for b in decodes)
    assert any(b.num_padding_seqs for b in steps)
    for b in steps:  # padding rows write and read only the null block, and are never sampled
        real = b.num_seqs - b.num_padding_seqs
        assert all(i < real for i in b.sample_indices)
        assert all(t == [0] * len(t) for t in b.block_tables[real:])


def test_budget_is_capped_at_the_largest_token_bucket(tmp_path):
    engine = _engine(tmp_path, Capabilities(token_buckets=(8, 16)), budget=64)
    prompts = _prompts(3, seed=2, lo=30, hi=40)
    done = _run(engine, prompts)
    assert all(done[str(i)] == reference(p, 24) for i, p in enumerate(prompts))
    assert max(b.num_tokens for b in engine.accelerator.steps) == 16


def test_buckets_are_checked():
    from deepinfer.core.padding import _with_padding, dummy_batch

    with pytest.raises(ValueError, match="increasing"):
        Buckets(tokens=(16, 8))
    one = dummy_batch(1, 4)
    assert pad_batch(one, Buckets(batch=(1, 2)), 4) is one  # already at a bucket
    assert pad_batch(one, Buckets(batch=(2,)), 4).num_seqs == 2
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        pad_batch(_with_padding(one, [1], 4), Buckets(batch=(1,)), 4)


def test_a_fixed_pool_is_never_outgrown(tmp_path):
    # 24 usable blocks of 4 tokens: prompts of up to 40 + 24 generated tokens need up to 16
    # blocks each, so without reservations several would start and then preempt each other.
    prompts = _prompts(8, seed=3, lo=20, hi=40)
    growing = _engine(tmp_path, num_blocks=25)
    assert _run(growing, prompts) == {str(i): reference(p, 24) for i, p in enumerate(prompts)}
    assert growing.scheduler.num_preemptions > 0
    fixed = _engine(tmp_path, Capabilities(fixed_kv_pool=True), num_blocks=25)
    assert _run(fixed, prompts) == {str(i): reference(p, 24) for i, p in enumerate(prompts)}
    assert fixed.scheduler.num_preemptions == 0


def test_no_chunked_prefill_keeps_prompts_whole(tmp_path):
    engine = _engine(tmp_path, Capabilities(chunked_prefill=False), budget=48)
    prompts = _prompts(5, seed=4, lo=30, hi=45)
    done = _run(engine, prompts)
    assert all(done[str(i)] == reference(p, 24) for i, p in enumerate(prompts))
    for b in engine.accelerator.steps:  # every prefill row is a whole prompt
        for q, s in zip(b.query_lens, b.seq_lens):
            assert q == 1 or q == s


def test_sliding_window_frees_blocks_and_keeps_tokens(tmp_path):
    # The fake reads only the last 6 tokens; blocks before that are freed and null in tables.
    prompts = _prompts(4, seed=5, lo=60, hi=90)
    engine = _engine(tmp_path, window=6, num_blocks=40, budget=16)
    peak = 0
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
        held = sum(1 for ids in engine.kv.groups[0].ids.values() for b in ids if b != 0)
        peak = max(peak, held)
    assert done == {str(i): reference(p, 24) for i, p in enumerate(prompts)}
    # Four sequences of up to 113 tokens would hold 29 blocks each; windows keep a few each.
    assert peak <= 4 * 7
    assert engine.kv.pool.num_free == engine.kv.pool.num_usable


def test_sliding_window_prefix_hit_matches_reference(tmp_path):
    engine = _engine(tmp_path, window=6)
    shared = _prompts(1, seed=6, lo=50, hi=51)[0]
    _run(engine, [shared + [1, 2]])
    hits_before = engine.kv.stats.hits
    assert _run(engine, [shared + [3, 4, 5]])["0"] == reference(shared + [3, 4, 5], 24)
    assert engine.kv.stats.hits - hits_before == 48  # 12 pages, though only 2-3 are visible


def test_dummy_step_touches_only_the_null_block(tmp_path):
    engine = _engine(tmp_path)
    engine.dummy_step()
    (batch,) = engine.accelerator.steps
    assert batch.num_padding_seqs == 1 and not batch.sample_indices
    assert batch.block_tables == [[0]]


def test_without_chunked_prefill_a_prompt_over_the_budget_is_refused(tmp_path):
    engine = _engine(tmp_path, Capabilities(chunked_prefill=False), budget=16)
    with pytest.raises(ValueError, match="without chunked prefill"):
        engine.add_request("long", list(range(1, 20)), GREEDY)
    assert not engine.has_unfinished_requests()


def test_unset_step_limits_are_the_backends_and_set_ones_win(tmp_path):
    caps = Capabilities(max_num_seqs=3, max_num_batched_tokens=24)
    prompts = _prompts(8, seed=4)
    for scheduler, seqs, tokens in ((SchedulerConfig(), 3, 24),
                                    (SchedulerConfig(max_num_seqs=5), 5, 24),
                                    (SchedulerConfig(max_num_batched_tokens=40), 3, 40)):
        config = EngineConfig(model=ModelSpec(write_config(str(tmp_path / "fake"))),
                              cache=CacheConfig(block_size=4, num_blocks=256),
                              scheduler=scheduler)
        engine = Engine(config, PagedFakeAccelerator(capabilities=caps), load_tokenizer=False)
        assert (engine.config.scheduler.max_num_seqs,
                engine.config.scheduler.max_num_batched_tokens) == (seqs, tokens)
        done = _run(engine, prompts)
        assert all(done[str(i)] == reference(p, 24) for i, p in enumerate(prompts))
        steps = engine.accelerator.steps
        assert max(b.num_seqs for b in steps) == seqs  # reached, never passed
        assert max(b.num_tokens for b in steps) <= tokens
        assert any(b.num_tokens > tokens - 4 for b in steps)  # the budget filled
