"""Scheduler and engine bookkeeping against a dense reference, through a paging-checking fake."""
from __future__ import annotations

import random

import pytest
from fakes import PagedFakeAccelerator, reference, write_config

from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from deepinfer.core.engine import Engine
from deepinfer.core.sampling import SamplingParams


def _engine(tmp_path, num_blocks=64, block_size=4, budget=32, max_seqs=16,
            caching=True) -> Engine:
    config = EngineConfig(
        model=ModelSpec(write_config(str(tmp_path / "fake"))),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                          enable_prefix_caching=caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs))
    return Engine(config, PagedFakeAccelerator(), load_tokenizer=False)


def _drain(engine: Engine, max_steps: int = 10_000) -> dict[str, list[int]]:
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
    raise AssertionError("engine did not finish")


def _assert_no_leaks(engine: Engine) -> None:
    assert engine.kv.num_request_blocks() == 0
    assert engine.kv.pool.num_free == engine.kv.pool.num_usable
    assert all(b.ref_cnt == 0 for b in engine.kv.pool.blocks)


def test_outputs_match_reference_under_chunking_and_preemption(tmp_path):
    engine = _engine(tmp_path, num_blocks=24, budget=16)  # 23 pages of 4 tokens: tight
    rng = random.Random(0)
    prompts = {str(i): [rng.randrange(1, 97) for _ in range(rng.randrange(3, 30))]
               for i in range(12)}
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    done = _drain(engine)
    assert engine.scheduler.num_preemptions > 0, "the pool should have forced preemption"
    for rid, p in prompts.items():
        assert done[rid] == reference(p, 20)
    _assert_no_leaks(engine)


def test_each_step_respects_budget_and_max_seqs(tmp_path):
    engine = _engine(tmp_path, budget=10, max_seqs=3)
    for i in range(6):
        engine.add_request(str(i), list(range(1, 25)), SamplingParams(max_tokens=5,
                                                                      temperature=0))
    _drain(engine)
    for batch in engine.accelerator.steps:
        assert batch.num_tokens <= 10
        assert batch.num_seqs <= 3


def test_abort_frees_blocks(tmp_path):
    engine = _engine(tmp_path)
    engine.add_request("a", list(range(1, 30)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", list(range(1, 9)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort("a")
    engine.abort("b")
    assert not engine.has_unfinished_requests()
    _assert_no_leaks(engine)


def test_abort_of_waiting_request(tmp_path):
    engine = _engine(tmp_path, max_seqs=1)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=5))
    engine.add_request("b", [1, 2, 3], SamplingParams(max_tokens=5))
    engine.step()
    engine.abort("b")
    _drain(engine)
    _assert_no_leaks(engine)


def test_prefix_hit_reads_shared_pages(tmp_path):
    engine = _engine(tmp_path)
    shared = list(range(1, 18))  # 4 full pages of 4, plus one token
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", shared + [40], params)
    assert _drain(engine)["a"] == reference(shared + [40], 6)
    engine.add_request("b", shared + [41, 42], params)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert outs[-1].num_cached_tokens == 16
    assert outs[-1].token_ids == reference(shared + [41, 42], 6)
    # Only the 3 uncached tokens went through the model for the second request's prefill.
    assert engine.accelerator.steps[-6].query_lens == [3]
    _assert_no_leaks(engine)


def test_prefix_cache_opt_out(tmp_path):
    engine = _engine(tmp_path)
    prompt = list(range(1, 18))
    engine.add_request("a", prompt, SamplingParams(max_tokens=2))
    _drain(engine)
    engine.add_request("b", prompt, SamplingParams(max_tokens=2), prefix_cache=False)
    outs = [o for _ in range(3) for o in engine.step()]
    assert outs[-1].num_cached_tokens == 0


def test_waiting_requests_are_served_in_arrival_order(tmp_path):
    # One slot, a stream of short requests arriving behind a long one: the long one
    # (first in) must finish first, and every request finishes.
    engine = _engine(tmp_path, max_seqs=1)
    engine.add_request("long", list(range(1, 40)), SamplingParams(max_tokens=30,
                                                                  ignore_eos=True))
    finished = []
    for i in range(20):
        engine.add_request(f"s{i}", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
        finished += [o.request_id for o in engine.step() if o.finished]
    finished += list(_drain(engine))
    assert finished[0] == "long"
    assert finished[1:] == [f"s{i}" for i in range(20)]


def test_stop_conditions(tmp_path):
    engine = _engine(tmp_path)
    prompt = [3, 1, 4, 1, 5]
    free_run = reference(prompt, 40)
    stop_tok = free_run[5]
    first = free_run.index(stop_tok)
    engine.add_request("stop", prompt, SamplingParams(max_tokens=40, stop_token_ids=[stop_tok],
                                                      ignore_eos=True))
    engine.add_request("min", prompt, SamplingParams(max_tokens=40, stop_token_ids=[stop_tok],
                                                     min_tokens=first + 2, ignore_eos=True))
    engine.add_request("len", prompt, SamplingParams(max_tokens=7, ignore_eos=True))
    done = _drain(engine)
    assert done["stop"] == free_run[: first + 1]
    later = free_run.index(stop_tok, first + 2) if stop_tok in free_run[first + 2:] else 40
    assert done["min"] == free_run[: later + 1]
    assert done["len"] == free_run[:7]


def test_eos_ends_unless_ignored(tmp_path):
    engine = _engine(tmp_path)
    prompt = [2, 7, 1, 8]
    run = reference(prompt, 60)
    eos = run[3]
    engine.eos_token_ids  # the fake config's eos is 0; add ours through the request
    engine.add_request("a", prompt, SamplingParams(max_tokens=60, stop_token_ids=[eos]))
    engine.add_request("b", prompt, SamplingParams(max_tokens=60, ignore_eos=True))
    done = _drain(engine)
    assert done["a"] == run[: run.index(eos) + 1]
    assert len(done["b"]) == 60


def test_prompt_longer_than_context_is_rejected(tmp_path):
    engine = _engine(tmp_path, num_blocks=5)  # 4 usable pages of 4 = 16 tokens
    with pytest.raises(ValueError, match="context length"):
        engine.add_request("a", list(range(1, 17)), SamplingParams())
    engine.add_request("b", list(range(1, 15)), SamplingParams(max_tokens=100, ignore_eos=True))
    done = _drain(engine)
    assert len(done["b"]) == 2  # capped by the 16-token pool
    _assert_no_leaks(engine)


def test_n_samples_share_one_request_id(tmp_path):
    engine = _engine(tmp_path)
    engine.add_request("x", [1, 2, 3], SamplingParams(n=3, max_tokens=4, ignore_eos=True))
    indices = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "x"
            indices.add(out.index)
    assert indices == {0, 1, 2}
    _assert_no_leaks(engine)


def test_request_times_survive_preemption(tmp_path):
    """A request's first step is its first admission, a preemption's re-admission does not
    move it; its moments are ordered and come with its last output."""
    import time

    engine = _engine(tmp_path, num_blocks=24, budget=16)  # tight: preempts
    rng = random.Random(1)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i in range(12):
        engine.add_request(str(i), [rng.randrange(1, 97) for _ in range(rng.randrange(3, 30))],
                           params)
    first_seen: dict[str, tuple[float, float]] = {}  # the step it was first seen running in
    times = {}
    while engine.has_unfinished_requests():
        before = time.monotonic()
        outputs = engine.step()
        after = time.monotonic()
        for req in engine.scheduler.running:
            first_seen.setdefault(req.request_id, (before, after))
        times.update({o.request_id: o.times for o in outputs if o.finished})
        assert all(o.times is None for o in outputs if not o.finished)
    assert engine.scheduler.num_preemptions > 0
    assert len(times) == 12
    for rid, t in times.items():
        assert t.arrival <= t.first_scheduled <= t.first_token <= t.last_token
        before, after = first_seen[rid]
        assert before <= t.first_scheduled <= after, rid


def test_step_tokens_count_every_computed_token(tmp_path):
    """Without the prefix cache a request computes its prompt, then each output token but its
    last."""
    engine = _engine(tmp_path, caching=False)
    prompts = [list(range(1, n)) for n in (5, 17, 30)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=6, ignore_eos=True))
    _drain(engine)
    assert engine.step_tokens.total == sum(len(p) + 6 - 1 for p in prompts)
    assert sum(engine.step_tokens.counts) >= 6
