"""A fault in one request fails that request, never its batch mates or the engine.

The real CPU backend on a tiny random llama, with a fault injected into sampling for one
seed: the other requests of the same batches must get exactly the tokens they get without
the faulty request, and nothing may stay allocated.
"""
from __future__ import annotations

import pytest

from deepinfer.backends.cpu.accelerator import CPUAccelerator
from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from deepinfer.core.engine import MAX_BROKEN_STEPS, Engine, EngineDeadError
from deepinfer.core.sampling import SamplingParams

BAD_SEED = 666
PROMPTS = [[1, 5, 9, 13], [2, 4, 6, 8, 10, 12], [3, 3, 3], [7, 11, 19, 23, 29]]


class _FaultyCPU(CPUAccelerator):
    """Raises inside execute (and launch) whenever a row to sample carries BAD_SEED (or always)."""

    def __init__(self, always: bool = False) -> None:
        super().__init__()
        self.always = always

    def execute(self, batch):
        self._fault(batch)
        return super().execute(batch)

    def launch(self, batch):  # the async path: a fault here sends the step down the sync one
        self._fault(batch)
        return super().launch(batch)

    def _fault(self, batch) -> None:
        if self.always or any(row.seed == BAD_SEED for row in batch.sampling):
            raise RuntimeError("injected sampling fault")


def _engine(model_dir: str, always: bool = False) -> Engine:
    config = EngineConfig(model=ModelSpec(model_dir, "float32"),
                          cache=CacheConfig(block_size=4, num_blocks=64),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8))
    return Engine(config, _FaultyCPU(always), load_tokenizer=False)


def _run(engine: Engine) -> dict[str, list]:
    """Every output of every request id until the engine is idle."""
    outs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def _params(seed: int, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=0.8, seed=seed, max_tokens=12, ignore_eos=True)


def _tokens(outs: list) -> dict[int, list[int]]:
    return {o.index: o.token_ids for o in outs if o.finished}


def _assert_idle(engine: Engine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.kv.usage == 0.0 and not engine._samples and not engine._children


@pytest.mark.parametrize("n", [1, 3])
def test_a_faulty_request_fails_alone_and_its_batch_mates_finish(llama_dir, n):
    clean = _engine(llama_dir)
    for i, prompt in enumerate(PROMPTS):
        clean.add_request(f"r{i}", prompt, _params(100 + i, n))
    expected = _run(clean)

    engine = _engine(llama_dir)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, _params(100 + i, n))
        if i == 1:  # sample n-1 of this request hits the fault
            engine.add_request("bad", prompt, _params(BAD_SEED - (n - 1), n))
    got = _run(engine)

    errors = [o for o in got.pop("bad") if o.error is not None]
    assert len(errors) == 1 and errors[0].finished and errors[0].finish_reason == "error"
    assert "injected sampling fault" in errors[0].error
    assert all(o.error is None for outs in got.values() for o in outs)
    assert {rid: _tokens(o) for rid, o in got.items()} == \
        {rid: _tokens(o) for rid, o in expected.items()}
    _assert_idle(engine)


def test_abort_after_one_sample_finished(llama_dir):
    # Half the vocabulary stops a sample, so the 4 samples end at different steps.
    params = SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=40,
                            stop_token_ids=list(range(0, 256, 2)))
    engine = _engine(llama_dir)
    engine.add_request("r", PROMPTS[0], params)
    finished: set[int] = set()
    while engine.has_unfinished_requests() and not finished:
        finished = {o.index for o in engine.step() if o.finished}
    assert 0 < len(finished) < 4, "the samples should not all end in one step"
    engine.abort("r")  # the client left once a sample had its finish_reason
    _assert_idle(engine)


def test_a_broken_device_stops_the_engine(llama_dir):
    engine = _engine(llama_dir, always=True)
    for step in range(MAX_BROKEN_STEPS):
        engine.add_request(f"r{step}", PROMPTS[0], _params(1))
        engine.add_request(f"s{step}", PROMPTS[1], _params(2))
        if step + 1 < MAX_BROKEN_STEPS:
            outs = _run(engine)
            assert all(o[-1].finish_reason == "error" for o in outs.values())
    with pytest.raises(EngineDeadError):
        _run(engine)


def test_offline_llm_raises_once_the_others_finished(llama_dir, monkeypatch):
    from deepinfer import LLM

    llm = LLM(llama_dir, dtype="float32", block_size=4, num_blocks=64, load_tokenizer=False)
    accelerator = llm.engine.accelerator

    def faulty(healthy):
        def run(batch):
            if any(row.seed == BAD_SEED for row in batch.sampling):
                raise RuntimeError("injected sampling fault")
            return healthy(batch)
        return run

    for entry in ("execute", "launch"):  # the sync and the async path
        monkeypatch.setattr(accelerator, entry, faulty(getattr(accelerator, entry)))
    with pytest.raises(RuntimeError, match="1 of 2 request.*injected sampling fault"):
        llm.generate([PROMPTS[0], PROMPTS[1]], [_params(1), _params(BAD_SEED)])
    _assert_idle(llm.engine)


def test_prompt_logprobs_survive_a_batch_mates_fault(llama_dir):
    # [plain, bad, scored] in one step: the scored request reruns alone (its index 0 there),
    # and its entries reach it at its own index among the survivors (1).
    scored = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2)
    clean = _engine(llama_dir)
    clean.add_request("s", PROMPTS[3], scored)
    expected = _run(clean)["s"][0].prompt_logprobs
    engine = _engine(llama_dir)
    engine.add_request("a", PROMPTS[1], _params(100))
    engine.add_request("bad", PROMPTS[0], _params(BAD_SEED))
    engine.add_request("s", PROMPTS[3], scored)
    got = _run(engine)
    assert got["bad"][-1].finish_reason == "error"
    entries = got["s"][0].prompt_logprobs
    assert len(entries) == len(PROMPTS[3]) and entries[0] is None
    assert [(e.token_id, e.rank, [t for t, _ in e.top]) for e in entries[1:]] == \
        [(e.token_id, e.rank, [t for t, _ in e.top]) for e in expected[1:]]
    assert [e.logprob for e in entries[1:]] == \
        pytest.approx([e.logprob for e in expected[1:]], abs=1e-5)
    _assert_idle(engine)
