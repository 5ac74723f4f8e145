"""Constraints compile in grammar worker processes: the event loop only waits; a compile past
the time limit is a clean error and its worker is replaced; the grammar the worker sends loads
in a rank (same tokenizer facts) without compiling there; xgrammar's errors read cleanly."""
from __future__ import annotations

import asyncio
import json
import random
import string
import time
from concurrent.futures import Future

import pytest

from deepinfer.core.grammar_errors import clean_message
from deepinfer.core.sampling import SamplingParams, StructuredOutput
from deepinfer.serve.grammar.cache import CompiledConstraint, GrammarCache, InvalidConstraint
from deepinfer.serve.ranks.ipc import AddRequest

xgr = pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def model_dir() -> str:
    from deepinfer.models.default_model import ensure_default_model

    return ensure_default_model(progress=False)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def big_enum(n: int, seed: int) -> StructuredOutput:
    rng = random.Random(seed)
    values = ["".join(rng.choices(string.ascii_letters, k=12)) for _ in range(n)]
    return StructuredOutput("json_schema", json.dumps({"enum": values}))


async def _ticks_while(work) -> tuple[object, int]:
    """work's result, and how often the event loop turned meanwhile (a compile on the loop
    would leave it no turn at all)."""
    task = asyncio.ensure_future(work)
    ticks = 0
    while not task.done():
        await asyncio.sleep(0.005)
        ticks += 1
    return task.result(), ticks


def test_pool_compiles_away_from_the_loop_and_survives_its_time_limit(model_dir, tokenizer):
    from deepinfer.serve.grammar.pool import GrammarError, GrammarPool, GrammarUnavailable
    from deepinfer.serve.grammar.worker import WorkerSetup

    async def scenario() -> None:
        setup = WorkerSetup(model_dir, len(tokenizer), (tokenizer.eos_token_id,))
        pool = GrammarPool(setup, workers=1, timeout_s=60.0)
        try:
            await pool.compile(StructuredOutput("regex", "[ab]+"))  # the worker's start
            spec = big_enum(3000, seed=1)
            compiled, ticks = await _ticks_while(pool.compile(spec))
            assert compiled.serialized and compiled.compile_s > 0.05
            assert ticks >= 3, "the event loop did not run while the constraint compiled"
            hit, _ = await _ticks_while(pool.compile(spec))
            assert hit is compiled  # the cache: no second compile

            pool.timeout_s = 0.02
            start = time.perf_counter()
            with pytest.raises(GrammarError, match="--grammar-compile-timeout"):
                await pool.compile(big_enum(3000, seed=2))
            assert time.perf_counter() - start < 30.0  # not waited out: the worker was killed
            pool.timeout_s = 60.0
            with pytest.raises(GrammarError, match="--grammar-compile-timeout"):
                await pool.compile(big_enum(3000, seed=2))  # refused from the cache, at once
            assert not pool._busy
            ok = await pool.compile(StructuredOutput("regex", "c+"))  # a fresh worker
            assert ok.serialized
            with pytest.raises(GrammarError, match="parenthesis") as bad:
                await pool.compile(StructuredOutput("regex", "(("))
            assert "/project" not in str(bad.value) and ".cc:" not in str(bad.value)
            pool._idle[0].process.kill()  # a worker that dies while idle: the server's fault
            await pool._idle[0].process.wait()
            with pytest.raises(GrammarUnavailable, match="retry"):
                await pool.compile(StructuredOutput("regex", "d+"))
            assert (await pool.compile(StructuredOutput("regex", "d+"))).serialized  # retried
        finally:
            await pool.close()
        assert not pool._idle and not pool._busy

    asyncio.run(scenario())


def test_rank_loads_the_sent_grammar_without_compiling(tokenizer):
    from deepinfer.core.structured import GrammarCompiler
    from deepinfer.serve.grammar.rank_grammars import PendingGrammars
    from deepinfer.serve.grammar.worker import compile_one

    vocab, stops = len(tokenizer), (tokenizer.eos_token_id,)
    spec = StructuredOutput("json_schema", json.dumps({"enum": ["yes", "no"]}))
    worker = GrammarCompiler(tokenizer, vocab, stops)
    sent = compile_one(worker._compiler, spec)
    assert sent.serialized and sent.error is None

    class Engine:  # the rank's engine as PendingGrammars uses it
        def __init__(self) -> None:
            self.grammars = None

        def grammar_compiler(self) -> GrammarCompiler:
            if self.grammars is None:
                self.grammars = GrammarCompiler(tokenizer, vocab, stops)
                self.grammars.compile = _no_compile
            return self.grammars

    def _no_compile(_spec):
        raise AssertionError("the rank compiled a grammar it was sent")

    engine = Engine()
    pending = PendingGrammars(engine)
    params = SamplingParams(structured=spec)
    assert not pending.hold(AddRequest("plain", [1], SamplingParams()))
    assert pending.hold(AddRequest("a", [1], params, grammar=sent.serialized))
    ready = _wait_ready(pending)
    (message, compiled), = ready
    assert message.request_id == "a" and not isinstance(compiled, BaseException)
    matcher = engine.grammars.matcher_of(compiled)
    allowed = matcher.next_bitmask()
    quote = tokenizer.encode('"', add_special_tokens=False)[0]
    assert allowed[quote // 32] >> (quote % 32) & 1  # the answer opens with a quote
    # The same constraint again: the rank's cache, no load and no compile.
    assert pending.hold(AddRequest("b", [1], params, grammar=None))
    assert pending._pending["b"].future.done()
    assert [m.request_id for m, _ in pending.ready()] == ["b"]


def test_pending_grammar_does_not_block_and_abort_drops_it():
    from deepinfer.serve.grammar.rank_grammars import PendingGrammars

    gate = Future()

    class Engine:
        grammars = None

        class grammar_compiler_cls:
            def compile(self, spec):
                return gate.result(timeout=5)

        def grammar_compiler(self):
            return self.grammar_compiler_cls()

    pending = PendingGrammars(Engine())
    params = SamplingParams(structured=StructuredOutput("regex", "a+"))
    assert pending.hold(AddRequest("slow", [1], params))
    assert pending.ready() == [] and pending.waiting == 1  # the step loop goes on
    assert pending.drop("slow") and pending.waiting == 0
    assert pending.hold(AddRequest("held", [1], params)) and pending.hold(
        AddRequest("also", [1], params))
    assert sorted(pending.drop_all()) == ["also", "held"] and pending.waiting == 0  # regroup
    gate.set_result("compiled")


def _wait_ready(pending, timeout: float = 30.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = pending.ready()
        if ready:
            return ready
        time.sleep(0.01)
    raise AssertionError("the grammar was not prepared")


def test_clean_message_strips_source_locations():
    exc = RuntimeError('[08:09:52] /project/cpp/json_schema_converter.cc:5077: Check failed: '
                       '(error.empty()) is false: Failed to parse JSON: syntax error\n')
    assert clean_message(exc) == "Failed to parse JSON: syntax error"
    assert clean_message(RuntimeError("x" * 1000)).endswith("...")


def test_cache_bounds_entries_and_bytes():
    cache = GrammarCache(max_entries=2, max_bytes=10)
    a, b, c = (StructuredOutput("regex", s) for s in "abc")
    cache.put(a, CompiledConstraint("1234"))
    cache.put(b, InvalidConstraint("bad"))
    cache.put(c, CompiledConstraint("123456"))
    assert cache.get(a) is None and len(cache) == 2 and cache.nbytes == 6
    cache.put(a, CompiledConstraint("12345"))  # 11 bytes with c: c goes
    assert cache.get(c) is None and cache.nbytes == 5
    cache.put(c, CompiledConstraint("x" * 11))  # larger than the whole cache: not kept
    assert cache.get(c) is None
