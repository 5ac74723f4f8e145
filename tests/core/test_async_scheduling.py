"""Async scheduling changes nothing observable but timing.

With async scheduling the engine launches step N+1 before it reads step N's sampled tokens, so
the outputs of a step come back one `step()` call later, and a request that stops while its
next token is already in flight has that token thrown away. What this file proves, on the
real CPU backend with a tiny random-weight llama, is that none of this shows: for every case
below the async engine gives exactly what the synchronous engine (`async_scheduling=False`,
the reference) gives for every request and sample: token ids, text, finish and stop reasons,
logprobs and cached-token counts; and the greedy case matches transformers as well.

The cases: a greedy batch of prompts and lengths that differ (through `LLM`, against
transformers too); seeded random sampling; EOS, stop token ids, stop strings and min_tokens
ending requests mid-batch; aborts between steps; preemption by a KV pool too small for the
batch; a batch mixing steps that cannot overlap (logprobs, penalties) with ones that can;
chunked prefill with requests arriving while steps are in flight; prefix-cache hits; n > 1
samples. Each run also checks that the streamed deltas add up to the final output, that
nothing comes after a request's finished output (or its abort), and that no KV block or
request state outlives the requests.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from deepinfer import LLM
from deepinfer.backends.cpu.accelerator import CPUAccelerator
from deepinfer.core.batch import TokenLogprobs
from deepinfer.core.config import (
    CacheConfig,
    EngineConfig,
    ModelSpec,
    SchedulerConfig,
    engine_options,
)
from deepinfer.core.engine import Engine
from deepinfer.core.outputs import RequestOutput
from deepinfer.core.sampling import SamplingParams

VOCAB = 256  # the tiny checkpoints' vocabulary (tests/checkpoints.py)
MODEL_EOS = 255  # and their eos_token_id
MAX_STEPS = 2_000

Key = tuple[str, int]  # (request id, sample index)
Requests = dict[str, tuple[list[int], SamplingParams]]  # request id -> (prompt, params)


# ---- a tokenizer for the tiny model: token i is the text "<iii>" --------------------------
def _tokenizer(eos: int = MODEL_EOS) -> PreTrainedTokenizerFast:
    """Every id has a fixed-width, pure-ASCII text, so stop strings can be cut anywhere, even
    across tokens; `eos` is the tokenizer's EOS (the engine stops at it and at the model's)."""
    vocab = {_piece(i): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=_piece(0)))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=_piece(eos),
                                   clean_up_tokenization_spaces=False)


def _piece(token: int) -> str:
    return f"<{token:03d}>"


# ---- engines and runs --------------------------------------------------------------------
@dataclass(frozen=True)
class Completion:
    """Everything a client sees of one sample once it finished."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: str | int | None
    logprobs: list[TokenLogprobs]
    num_cached_tokens: int


def _engine(model_dir: str, async_scheduling: bool, *, tokenizer: Any = None,
            num_blocks: int = 64, block_size: int = 4, budget: int = 64, max_seqs: int = 8,
            prefix_caching: bool = True, **scheduler: Any) -> Engine:
    """`scheduler`: more SchedulerConfig fields."""
    config = EngineConfig(
        model=ModelSpec(model_dir, "float32"),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                          enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                  async_scheduling=async_scheduling, **scheduler))
    engine = Engine(config, CPUAccelerator(), tokenizer=tokenizer or _tokenizer())
    assert engine.config.scheduler.async_scheduling is async_scheduling
    return engine


def _collect(outputs: list[RequestOutput], streams: dict[Key, list[RequestOutput]]) -> None:
    for out in outputs:
        assert out.error is None, out.error
        key = (out.request_id, out.index)
        seen = streams.setdefault(key, [])
        assert not (seen and seen[-1].finished), f"{key} has an output after it finished"
        seen.append(out)


def _drain(engine: Engine, streams: dict[Key, list[RequestOutput]]) -> None:
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            return
        _collect(engine.step(), streams)
    raise AssertionError(f"the engine did not finish in {MAX_STEPS} steps")


def _completions(streams: dict[Key, list[RequestOutput]]) -> dict[Key, Completion]:
    """The finished samples, each checked: its streamed deltas add up to its final output."""
    done = {}
    for key, outs in streams.items():
        last = outs[-1]
        if not last.finished:
            continue  # aborted: the caller checks what it got
        assert [t for o in outs for t in o.new_token_ids] == last.token_ids, key
        assert "".join(o.new_text for o in outs) == last.text, key
        done[key] = Completion(list(last.token_ids), last.text, last.finish_reason,
                               last.stop_reason, [lp for o in outs for lp in o.new_logprobs],
                               last.num_cached_tokens)
    return done


def _generate(engine: Engine, requests: Requests) -> dict[Key, Completion]:
    """Add every request, step until the engine is idle; every sample must finish."""
    streams: dict[Key, list[RequestOutput]] = {}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    _drain(engine, streams)
    done = _completions(streams)
    expected = {(rid, i) for rid, (_, params) in requests.items() for i in range(params.n)}
    assert set(done) == expected
    return done


def _assert_idle(engine: Engine) -> None:
    """No request, sample or KV block outlives the requests (nor does a step in flight that
    still has a live request: has_unfinished_requests() stays True while there is one)."""
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.num_unfinished == 0
    assert not engine._samples and not engine._children
    assert engine.kv.num_request_blocks() == 0
    assert engine.kv.usage == 0.0
    assert engine.kv.pool.num_free == engine.kv.pool.num_usable
    assert all(b.ref_cnt == 0 for b in engine.kv.pool.blocks)


def _sync_and_async(model_dir: str, requests: Requests, **engine_options: Any
                    ) -> tuple[dict[Key, Completion], dict[Key, Completion], Engine, Engine]:
    """The same requests through a synchronous and an async engine, both left idle."""
    results, engines = [], []
    for async_scheduling in (False, True):
        engine = _engine(model_dir, async_scheduling, **engine_options)
        results.append(_generate(engine, requests))
        _assert_idle(engine)
        engines.append(engine)
    assert engines[0].num_overlapped_steps == 0
    # A launch that raised would have run synchronously and hidden an async bug: none may.
    assert engines[1].num_sync_fallbacks == 0
    return results[0], results[1], engines[0], engines[1]


def _assert_same(sync: dict[Key, Completion], async_: dict[Key, Completion],
                 logprob_tol: float = 0.0) -> None:
    assert set(sync) == set(async_)
    for key in sorted(sync):
        expected, got = sync[key], async_[key]
        if logprob_tol:  # ids and ranks exactly, values up to float noise of other batches
            _assert_logprobs_close(expected.logprobs, got.logprobs, logprob_tol, key)
            expected = _without_logprobs(expected)
            got = _without_logprobs(got)
        assert got == expected, f"sample {key} differs under async scheduling"


def _without_logprobs(c: Completion) -> Completion:
    return Completion(c.token_ids, c.text, c.finish_reason, c.stop_reason, [],
                      c.num_cached_tokens)


def _assert_logprobs_close(expected: list[TokenLogprobs], got: list[TokenLogprobs],
                           tol: float, key: Key) -> None:
    assert len(got) == len(expected), key
    for e, g in zip(expected, got):
        assert (g.token_id, g.rank, [t for t, _ in g.top]) == \
            (e.token_id, e.rank, [t for t, _ in e.top]), key
        assert g.logprob == pytest.approx(e.logprob, abs=tol), key
        assert [p for _, p in g.top] == pytest.approx([p for _, p in e.top], abs=tol), key


def _prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB - 6, (n,), generator=g).tolist() for n in lengths]


def _greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def _reference_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy decoding (a full forward per token), no EOS (as ignore_eos)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


# ---- the cases ---------------------------------------------------------------------------
def test_on_by_default_off_by_option_and_flag():
    option = {o.name: o for o in engine_options()}["async_scheduling"]
    assert option.default is True and option.flag == "--no-async-scheduling"
    assert SchedulerConfig().async_scheduling is True


def test_greedy_batch_matches_sync_and_transformers(llama_dir):
    """Through the offline API: the `async_scheduling` option, on by default."""
    prompts = _prompts((3, 9, 17, 30))
    params = [_greedy(n, ignore_eos=True) for n in (5, 12, 8, 16)]
    outputs, llms = [], []
    for option in ({"async_scheduling": False}, {}):
        llm = LLM(llama_dir, dtype="float32", accelerator="cpu", block_size=4, num_blocks=64,
                  load_tokenizer=False, **option)
        outputs.append(llm.generate(prompts, params))
        _assert_idle(llm.engine)
        llms.append(llm)
    sync_llm, async_llm = llms
    assert sync_llm.engine.config.scheduler.async_scheduling is False
    assert async_llm.engine.config.scheduler.async_scheduling is True
    assert async_llm.engine.accelerator.capabilities.async_output
    assert sync_llm.engine.num_overlapped_steps == 0
    assert async_llm.engine.num_overlapped_steps > 0
    assert outputs[1] == outputs[0]
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        llama_dir, dtype=torch.float32).eval()
    for prompt, p, out in zip(prompts, params, outputs[1]):
        (sample,) = out.outputs
        assert sample.finish_reason == "length"
        assert sample.token_ids == _reference_greedy(reference, prompt, p.max_tokens)


def test_seeded_sampling_is_unchanged(llama_dir):
    prompts = _prompts((4, 11, 7, 20), seed=1)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.95, top_k=20, seed=12, max_tokens=9,
                       ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=0.05, seed=13, max_tokens=12, ignore_eos=True),
        # Unseeded: its seed is drawn from the engine's seed, the same in both engines.
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, ignore_eos=True),
    ]
    requests = {f"r{i}": (p, sp) for i, (p, sp) in enumerate(zip(prompts, params))}
    sync, async_, _, async_engine = _sync_and_async(llama_dir, requests)
    _assert_same(sync, async_)
    assert async_engine.num_overlapped_steps > 0
    greedy = _generate(_engine(llama_dir, False), {k: (p, _greedy(14, ignore_eos=True))
                                                   for k, (p, _) in requests.items()})
    assert any(sync[k].token_ids != greedy[k].token_ids for k in sync), "nothing was sampled"


def test_stops_end_requests_mid_batch(llama_dir):
    """EOS (the tokenizer's and the model's), a stop token id, a stop string across two
    tokens and min_tokens, each taken from where the free-running output goes, end their
    requests at different steps while the others keep going."""
    prompts = _prompts((5, 8, 6, 10, 7), seed=2)
    free = _generate(_engine(llama_dir, False), {
        str(i): (p, _greedy(16, ignore_eos=True)) for i, p in enumerate(prompts)})
    free_ids = [free[(str(i), 0)].token_ids for i in range(len(prompts))]
    eos = free_ids[0][5]
    stop_id = free_ids[1][4]
    stop_str = _piece(free_ids[2][3])[-2:] + _piece(free_ids[2][4])[:3]  # e.g. "7><123"
    # A token new at index k >= 3 of the last free run, allowed from index k on: it ends
    # the request there exactly (not a step later, not banned one step too long).
    k = next(i for i in range(3, 16) if free_ids[4][i] not in free_ids[4][:i])
    requests: Requests = {
        "eos": (prompts[0], _greedy(16)),
        "stop_id": (prompts[1], _greedy(16, stop_token_ids=[stop_id], ignore_eos=True)),
        "stop_str": (prompts[2], _greedy(16, stop=[stop_str], ignore_eos=True)),
        "stop_str_kept": (prompts[2], _greedy(16, stop=[stop_str], ignore_eos=True,
                                              include_stop_str_in_output=True)),
        # The model's own EOS as its very first token: done after the prefill step.
        "model_eos": (prompts[1], _greedy(16)),
        # The same prompt, its EOS held off by min_tokens (those steps cannot overlap).
        "min_tokens": (prompts[1], _greedy(16, min_tokens=3, stop_token_ids=[stop_id])),
        "min_tokens_exact": (prompts[4], _greedy(16, min_tokens=k, ignore_eos=True,
                                                 stop_token_ids=[free_ids[4][k]])),
        "runs_on": (prompts[4], _greedy(16, ignore_eos=True)),
    }
    sync, async_, _, async_engine = _sync_and_async(llama_dir, requests,
                                                    tokenizer=_tokenizer(eos=eos))
    _assert_same(sync, async_)
    assert async_engine.num_overlapped_steps > 0
    for rid in ("eos", "stop_id", "stop_str", "stop_str_kept"):
        c = async_[(rid, 0)]
        assert c.finish_reason == "stop" and len(c.token_ids) < 16, rid
    assert async_[("eos", 0)].stop_reason == eos
    assert async_[("stop_id", 0)].stop_reason == stop_id
    assert async_[("stop_str", 0)].stop_reason == stop_str
    assert stop_str not in async_[("stop_str", 0)].text
    assert async_[("stop_str_kept", 0)].text.endswith(stop_str)
    assert free_ids[1][0] == MODEL_EOS, "this checkpoint and prompt start with the model's EOS"
    assert async_[("model_eos", 0)].token_ids == [MODEL_EOS]
    assert async_[("model_eos", 0)].finish_reason == "stop"
    assert len(async_[("min_tokens", 0)].token_ids) >= 3
    assert async_[("min_tokens_exact", 0)].token_ids == free_ids[4][:k + 1]
    assert async_[("runs_on", 0)].finish_reason == "length"
    assert len(async_[("runs_on", 0)].token_ids) == 16


def test_abort_between_steps(llama_dir):
    """Aborts at three moments: before any step ("d"), after the first step call, its prefill
    just launched ("e", c's twin), and once it has streamed 3 tokens ("a"). An aborted request
    streams nothing after its abort, only tokens of its own greedy output; "a" streamed the
    same 3 tokens in both engines; its batch mates are unchanged; nothing leaks."""
    prompts = _prompts((6, 9, 13), seed=3)
    requests: Requests = {"a": (prompts[0], _greedy(16, ignore_eos=True)),
                          "b": (prompts[1], _greedy(12, ignore_eos=True)),
                          "c": (prompts[2], _greedy(14, ignore_eos=True)),
                          "d": (prompts[1], _greedy(8, ignore_eos=True)),
                          "e": (prompts[2], _greedy(14, ignore_eos=True))}
    runs = []
    for async_scheduling in (False, True):
        engine = _engine(llama_dir, async_scheduling)
        for rid, (prompt, params) in requests.items():
            engine.add_request(rid, prompt, params)
        engine.abort("d")
        streams: dict[Key, list[RequestOutput]] = {}
        streamed_at_abort: dict[str, int] = {}

        def abort(rid: str) -> None:
            engine.abort(rid)
            streamed_at_abort[rid] = len(streams.get((rid, 0), []))

        for step in range(MAX_STEPS):
            if not engine.has_unfinished_requests():
                break
            _collect(engine.step(), streams)
            if step == 0:
                abort("e")
            a_out = streams.get(("a", 0), [])
            if "a" not in streamed_at_abort and a_out and len(a_out[-1].token_ids) >= 3:
                abort("a")
        _assert_idle(engine)
        assert ("d", 0) not in streams
        for rid, count in streamed_at_abort.items():
            outs = streams.get((rid, 0), [])
            assert len(outs) == count, f"{rid} has an output after its abort"
            assert not any(o.finished for o in outs)
        done = _completions(streams)
        e_tokens = streams[("e", 0)][-1].token_ids if ("e", 0) in streams else []
        assert e_tokens == done[("c", 0)].token_ids[:len(e_tokens)]
        runs.append((streams[("a", 0)][-1].token_ids, done, engine))
    (sync_a, sync, _), (async_a, async_, async_engine) = runs
    assert len(sync_a) == 3 and async_a == sync_a
    assert set(async_) == {("b", 0), ("c", 0)}
    _assert_same(sync, async_)
    assert async_engine.num_overlapped_steps > 0


@pytest.mark.parametrize("with_stops", [False, True], ids=["length", "stop_tokens"])
def test_preemption_by_a_small_kv_pool(llama_dir, with_stops):
    """15 pages of 4 tokens for 6 requests of up to 9 pages each: requests are preempted and
    recomputed, some with a token still in flight (with_stops: a token that ends them)."""
    prompts = _prompts((10, 14, 7, 18, 12, 9), seed=4)
    requests: Requests = {}
    for i, p in enumerate(prompts):
        params = _greedy(16, ignore_eos=True) if i % 2 else SamplingParams(
            temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=16, ignore_eos=True)
        requests[f"r{i}"] = (p, params)
    if with_stops:  # each request stops at its free-running output's 11th token
        free = _generate(_engine(llama_dir, False), requests)
        requests = {rid: (p, dataclasses.replace(params, stop_token_ids=[
            free[(rid, 0)].token_ids[10]])) for rid, (p, params) in requests.items()}
    sync, async_, sync_engine, async_engine = _sync_and_async(
        llama_dir, requests, num_blocks=16, budget=32)
    assert sync_engine.scheduler.num_preemptions > 0
    assert async_engine.scheduler.num_preemptions > 0, "the pool should force preemption"
    assert async_engine.num_overlapped_steps > 0
    _assert_same(sync, async_)
    if with_stops:
        assert all(c.finish_reason == "stop" for c in async_.values())
    # And preemption itself changes nothing: a pool with room for all gives the same.
    roomy_engine = _engine(llama_dir, True)
    roomy = _generate(roomy_engine, requests)
    assert roomy_engine.scheduler.num_preemptions == 0
    _assert_same(roomy, async_)


NOT_OVERLAPPABLE = {
    "logprobs": _greedy(5, logprobs=3, ignore_eos=True),
    "sampled_logprobs": SamplingParams(temperature=0.9, seed=22, logprobs=2, max_tokens=4,
                                       ignore_eos=True),
    "penalties": SamplingParams(temperature=0.8, seed=21, repetition_penalty=1.3,
                                presence_penalty=0.5, frequency_penalty=0.4, max_tokens=6,
                                ignore_eos=True),
    # Strong enough to change what greedy picks: every step must count the newest token.
    "greedy_penalties": _greedy(10, presence_penalty=2.0, frequency_penalty=2.0,
                                ignore_eos=True),
    "repetition": _greedy(8, repetition_penalty=2.0, ignore_eos=True),
}


@pytest.mark.parametrize("special", list(NOT_OVERLAPPABLE))
def test_mixed_batch_with_steps_that_cannot_overlap(llama_dir, special):
    """A request whose steps cannot overlap (logprobs, penalties) beside plain ones: all get
    what they get synchronously, and the plain ones overlap once it finished."""
    prompts = _prompts((12, 7, 15), seed=5)
    params = NOT_OVERLAPPABLE[special]
    requests: Requests = {
        special: (prompts[0], params),
        "plain": (prompts[1], _greedy(16, ignore_eos=True)),
        "plain_sampled": (prompts[2], SamplingParams(temperature=0.8, top_p=0.9, seed=23,
                                                     max_tokens=14, ignore_eos=True)),
    }
    sync, async_, _, async_engine = _sync_and_async(llama_dir, requests)
    _assert_same(sync, async_, logprob_tol=1e-5)
    c = async_[(special, 0)]
    if params.logprobs is not None:
        assert [lp.token_id for lp in c.logprobs] == c.token_ids
        assert all(len(lp.top) == params.logprobs for lp in c.logprobs)
    assert async_[("plain", 0)].logprobs == []
    assert async_engine.num_overlapped_steps > 0
    if special == "greedy_penalties":
        free = _generate(_engine(llama_dir, False), {"free": (prompts[0], _greedy(10))})
        assert c.token_ids != free[("free", 0)].token_ids, "the penalties should matter"


def test_chunked_prefill_and_arrivals_between_steps(llama_dir):
    """Requests arrive while steps are in flight. A long prompt is prefilled 4 tokens a step
    beside decodes, and short prompts arriving later are admitted whole behind its chunk, so
    a step's sampled rows are not its sequences' order (one of them, max_tokens=1, is done
    with its first token, while the next step is already in flight)."""
    prompts = _prompts((5, 40, 3, 2, 4, 9, 6), seed=8)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=41, max_tokens=8,
                            ignore_eos=True)
    params = [_greedy(10, ignore_eos=True), _greedy(6, ignore_eos=True),
              _greedy(10, ignore_eos=True), _greedy(1, ignore_eos=True), seeded,
              _greedy(7, ignore_eos=True), dataclasses.replace(seeded, seed=42)]
    arrivals = {0: [0, 1], 2: [2, 3], 3: [4], 5: [5, 6]}  # step call -> requests added before
    results = []
    for async_scheduling in (False, True):
        engine = _engine(llama_dir, async_scheduling, budget=16, long_prefill_token_threshold=4)
        streams: dict[Key, list[RequestOutput]] = {}
        for step in range(MAX_STEPS):
            for i in arrivals.get(step, []):
                engine.add_request(f"r{i}", prompts[i], params[i])
            if step > max(arrivals) and not engine.has_unfinished_requests():
                break
            _collect(engine.step(), streams)
        _assert_idle(engine)
        results.append((_completions(streams), engine))
    (sync, _), (async_, async_engine) = results
    assert set(async_) == {(f"r{i}", 0) for i in range(len(prompts))}
    _assert_same(sync, async_)
    assert len(async_[("r3", 0)].token_ids) == 1
    assert async_engine.num_overlapped_steps > 0


def test_prefix_cache_hits(llama_dir):
    """The same prompt again, a prompt sharing its prefix, and one that continues the first
    request's prompt and output, each once the first finished: same cached-token counts."""
    (shared,) = _prompts((14,), seed=6)
    params = _greedy(10, ignore_eos=True)
    results, engines = [], []
    for async_scheduling in (False, True):
        engine = _engine(llama_dir, async_scheduling)
        first = _generate(engine, {"first": (shared, params)})[("first", 0)]
        continued = shared + first.token_ids + [42]
        later = {"again": (shared, params), "shared": (shared[:9] + [7, 8, 9], params),
                 "continued": (continued, params)}
        got = {("first", 0): first}
        for rid, request in later.items():  # one by one: each after the last finished
            got.update(_generate(engine, {rid: request}))
        _assert_idle(engine)
        results.append(got)
        engines.append(engine)
    sync, async_ = results
    assert engines[0].num_overlapped_steps == 0 < engines[1].num_overlapped_steps
    _assert_same(sync, async_)
    assert async_[("first", 0)].num_cached_tokens == 0
    assert async_[("again", 0)].num_cached_tokens == 12  # three full pages of 4
    assert async_[("shared", 0)].num_cached_tokens == 8
    assert async_[("continued", 0)].num_cached_tokens >= 12
    assert async_[("again", 0)].token_ids == async_[("first", 0)].token_ids


def test_several_samples_of_one_prompt(llama_dir):
    prompts = _prompts((6, 10), seed=7)
    requests: Requests = {
        "seeded": (prompts[0], SamplingParams(n=3, temperature=0.9, top_p=0.95, seed=31,
                                              max_tokens=10, ignore_eos=True)),
        "unseeded": (prompts[1], SamplingParams(n=2, temperature=0.8, max_tokens=8,
                                                ignore_eos=True)),
        "greedy": (prompts[1], _greedy(6, ignore_eos=True)),
    }
    sync, async_, _, async_engine = _sync_and_async(llama_dir, requests)
    _assert_same(sync, async_)
    assert async_engine.num_overlapped_steps > 0
    seeded = [async_[("seeded", i)].token_ids for i in range(3)]
    assert len({tuple(s) for s in seeded}) > 1, "sample i is seeded with seed + i"
