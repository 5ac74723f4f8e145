"""Prefill-any-interval: a request that arrives while others decode, or while a long prompt is
being prefilled in chunks, starts its prefill in the very next step."""
from __future__ import annotations

import dataclasses
import random

from fakes import PagedFakeAccelerator, reference, write_config

from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from deepinfer.core.engine import Engine
from deepinfer.core.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _engine(tmp_path, budget: int = 32, beside: int | None = None) -> Engine:
    config = EngineConfig(
        model=ModelSpec(write_config(str(tmp_path / "fake"))),
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16,
                                  prefill_beside_decodes=beside))
    return Engine(config, PagedFakeAccelerator(), load_tokenizer=False)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 97) for _ in range(n)]


def _step(engine: Engine) -> dict[str, int]:
    """One step; {request id: tokens it computed in that step}."""
    before = {rid: s.request.num_computed_tokens for rid, s in engine._samples.items()}
    outputs = {o.request_id: o for o in engine.step()}
    return {rid: engine._samples[rid].request.num_computed_tokens - n
            if rid in engine._samples else -1 if rid in outputs else 0
            for rid, n in before.items()}


def test_new_request_prefills_in_the_next_step_while_others_decode(tmp_path):
    engine = _engine(tmp_path)
    for i in range(3):
        engine.add_request(f"old{i}", _prompt(6, i), GREEDY)
    for _ in range(3):  # all three are decoding now
        engine.step()
    assert all(s.request.output_token_ids for s in engine._samples.values())
    new = _prompt(12, 99)
    engine.add_request("new", new, GREEDY)
    computed = _step(engine)
    assert computed["new"] == len(new)  # its whole prompt, in this very step
    assert all(computed[f"old{i}"] == 1 for i in range(3))  # and nobody's decode waited
    assert engine._samples["new"].request.output_token_ids == reference(new, 1)


def test_long_prefill_in_progress_leaves_room_for_a_new_request(tmp_path):
    engine = _engine(tmp_path, budget=32)
    engine.add_request("decoder", _prompt(5, 1), GREEDY)
    engine.step()  # decoding from now on
    engine.add_request("long", _prompt(300, 2), GREEDY)
    engine.step()  # the long prompt starts its chunked prefill
    short = _prompt(10, 3)
    engine.add_request("short", short, GREEDY)
    computed = _step(engine)
    assert computed["short"] == len(short)  # not after the remaining ~270 prompt tokens
    assert computed["decoder"] == 1
    assert computed["long"] >= 16  # the long prefill still moved (at least half the rest)
    assert sum(computed.values()) <= 32
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: list(o.token_ids) for o in engine.step() if o.finished})
    assert done["long"] == reference(_prompt(300, 2), 40)
    assert done["short"] == reference(short, 40)


def test_queue_keeps_arrival_order_under_the_reserve(tmp_path):
    engine = _engine(tmp_path, budget=16)
    engine.add_request("long", _prompt(200, 4), GREEDY)
    engine.step()
    for i in range(3):
        engine.add_request(f"q{i}", _prompt(8, 10 + i), GREEDY)
    started = []
    for _ in range(6):
        computed = _step(engine)
        started += [rid for rid in ("q0", "q1", "q2") if computed.get(rid, 0) > 0
                    and rid not in started]
        assert computed["long"] > 0  # never starved by newcomers
    assert started == ["q0", "q1", "q2"]


def test_prompt_ids_are_checked_and_taken_as_ints(tmp_path):
    """Ids out of the vocabulary are refused (naming them); ids of other int types (numpy's,
    bools) serve as the plain ints they equal."""
    import numpy as np
    import pytest

    engine = _engine(tmp_path)
    vocab = engine.model.vocab_size
    for bad, named in (([1, vocab, 2], f"[{vocab}]"), ([-1, 3], "[-1]")):
        with pytest.raises(ValueError, match=f"out of range .*: \\{named}"):
            engine.add_request("bad", bad, GREEDY)
    prompt = _prompt(9, 3)
    engine.add_request("plain", prompt, GREEDY)
    engine.add_request("numpy", np.array(prompt, dtype=np.int64), GREEDY)
    engine.add_request("bools", [True, False, *prompt[2:]], GREEDY)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs["numpy"].token_ids == outs["plain"].token_ids == reference(prompt, 40)
    assert outs["bools"].prompt_token_ids == [1, 0, *prompt[2:]]
    assert all(type(t) is int for t in outs["numpy"].prompt_token_ids)


def test_a_decoding_step_carries_at_most_the_cap_of_prefill(tmp_path):
    """With prefill_beside_decodes, a long prompt is prefilled in cap-sized pieces while others
    decode (each decode still gets its token every step), at the whole budget once alone; the
    tokens are the reference's either way."""
    engine = _engine(tmp_path, budget=64, beside=8)
    engine.add_request("decoder", _prompt(5, 1), dataclasses.replace(GREEDY, max_tokens=6))
    engine.step()
    long = _prompt(100, 2)
    engine.add_request("long", long, GREEDY)
    pieces = []
    while engine._samples["long"].request.num_computed_tokens < len(long):
        computed = _step(engine)
        pieces.append(computed["long"])
        if "decoder" in engine._samples:
            assert computed["decoder"] in (1, -1)  # a token every step, or its end
    # 8 a step while the decoder runs; once it ended, the rest at once (within the budget).
    assert len(pieces) > 3 and set(pieces[:-1]) == {8} and pieces[-1] == len(long) - sum(
        pieces[:-1]) > 8
    while engine.has_unfinished_requests():
        engine.step()


def test_the_backend_picks_the_cap_unless_the_config_does(tmp_path):
    class Capped(PagedFakeAccelerator):
        capabilities = dataclasses.replace(PagedFakeAccelerator.capabilities,
                                           prefill_beside_decodes=16)

    def cap(beside):
        config = EngineConfig(model=ModelSpec(write_config(str(tmp_path / "fake"))),
                              cache=CacheConfig(block_size=4, num_blocks=256),
                              scheduler=SchedulerConfig(prefill_beside_decodes=beside))
        return Engine(config, Capped(), load_tokenizer=False).scheduler.config \
            .prefill_beside_decodes

    assert (cap(None), cap(0), cap(4)) == (16, 0, 4)


def test_logit_bias_and_allowed_ids_outside_the_vocabulary_are_refused(tmp_path):
    """Ids the model does not have are a ValueError naming the field, before anything is
    queued; the last id of the vocabulary is taken."""
    import pytest

    engine = _engine(tmp_path)
    vocab = engine.model.vocab_size
    prompt = _prompt(5, 1)
    for field, value in (("logit_bias", {3: 1.0, vocab: -100.0}),
                         ("allowed_token_ids", [1, vocab + 7])):
        params = dataclasses.replace(GREEDY, **{field: value})
        with pytest.raises(ValueError, match=f"{field} .*out of range \\[0, {vocab}\\)"):
            engine.add_request(field, prompt, params)
        assert not engine.has_unfinished_requests()
    engine.add_request("edge", prompt, dataclasses.replace(
        GREEDY, max_tokens=2, logit_bias={vocab - 1: 1.0}, allowed_token_ids=[vocab - 1]))
    assert engine.has_unfinished_requests()
