"""prompt_logprobs on the CPU backend against transformers: each prompt token's logprob given
the tokens before it, its rank and the top-N, from log_softmax of HF's logits at the position
before it; the first prompt token has none. Chunked prefills, prefix-cache hits (a request
that scores its prompt computes it all), preemption and backends that cannot score."""
from __future__ import annotations

import pytest
import torch
import transformers

from deepinfer import LLM
from deepinfer.backends.cpu.accelerator import CPUAccelerator
from deepinfer.core.accelerator import Capabilities
from deepinfer.core.batch import TokenLogprobs
from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from deepinfer.core.engine import Engine
from deepinfer.core.outputs import RequestOutput
from deepinfer.core.sampling import SamplingParams

TOL = 1e-4  # float32 against float32: paged attention sums in another order


@pytest.fixture(scope="module")
def reference(llama_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir,
                                                              dtype=torch.float32).eval()

    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    return logprobs


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(path: str, budget: int = 2048, num_blocks: int = 64,
            caching: bool = True) -> Engine:
    config = EngineConfig(model=ModelSpec(path, "float32"),
                          cache=CacheConfig(16, num_blocks, enable_prefix_caching=caching),
                          scheduler=SchedulerConfig(max_num_batched_tokens=budget,
                                                    prefill_beside_decodes=0))
    return Engine(config, CPUAccelerator(), load_tokenizer=False)


def _run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]
         ) -> dict[str, list[RequestOutput]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
    return outs


def _prompt_entries(outs: list[RequestOutput]) -> list[TokenLogprobs | None]:
    """The one output that carries them (the first), and only that one."""
    carried = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(carried) == 1 and outs[0].prompt_logprobs is carried[0]
    return carried[0]


def _check(entries: list[TokenLogprobs | None], prompt: list[int], ref: torch.Tensor,
           num_top: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for i, entry in enumerate(entries[1:], start=1):
        row = ref[i - 1]  # the logits before token i
        assert entry.token_id == prompt[i]
        assert entry.logprob == pytest.approx(row[prompt[i]].item(), abs=TOL)
        # Its rank among the reference's values (a near tie may fall either way).
        lo = int((row > entry.logprob + TOL).sum()) + 1
        hi = int((row > entry.logprob - TOL).sum()) + 1
        assert lo <= entry.rank <= hi, (i, entry.rank, lo, hi)
        assert len(entry.top) == num_top
        top_values = row.topk(num_top).values.tolist()
        for (tid, value), expected in zip(entry.top, top_values):
            assert value == pytest.approx(expected, abs=TOL)
            assert row[tid].item() == pytest.approx(value, abs=TOL)  # the id holds that value


def test_prompt_logprobs_match_transformers_beside_a_plain_request(llama_dir, reference):
    prompt, other = _prompt(37, 0), _prompt(20, 1)
    outs = _run(_engine(llama_dir), {
        "scored": (prompt, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=5)),
        "plain": (other, SamplingParams(temperature=0.0, max_tokens=3))})
    _check(_prompt_entries(outs["scored"]), prompt, reference(prompt), 5)
    assert all(o.prompt_logprobs is None for o in outs["plain"])
    # Scoring the prompt leaves its own tokens alone: greedy as transformers.
    ref = reference(prompt)
    assert outs["scored"][0].new_token_ids[0] == int(ref[-1].argmax())


def test_chunked_prefill_scores_every_chunk(llama_dir, reference):
    # A 16-token budget cuts the 70-token prompt into five chunks; prompt_logprobs=0 lists
    # the prompt token alone.
    prompt = _prompt(70, 2)
    engine = _engine(llama_dir, budget=16)
    outs = _run(engine, {"0": (prompt, SamplingParams(max_tokens=2, prompt_logprobs=0))})
    _check(_prompt_entries(outs["0"]), prompt, reference(prompt), 0)


def test_prefix_cache_hit_is_not_used_but_pages_are_left(llama_dir, reference):
    prompt = _prompt(40, 3)  # 2.5 pages of 16
    engine = _engine(llama_dir)
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    scored = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    _run(engine, {"warm": (prompt, plain)})
    first = _run(engine, {"a": (prompt, scored)})["a"]
    second = _run(engine, {"b": (prompt, scored)})["b"]
    assert first[-1].num_cached_tokens == second[-1].num_cached_tokens == 0
    a, b = _prompt_entries(first), _prompt_entries(second)
    _check(a, prompt, reference(prompt), 3)
    assert [(e.token_id, e.rank, [t for t, _ in e.top]) for e in b[1:]] == \
        [(e.token_id, e.rank, [t for t, _ in e.top]) for e in a[1:]]
    assert [e.logprob for e in b[1:]] == pytest.approx([e.logprob for e in a[1:]], abs=1e-6)
    # A request that scored its prompt still leaves its pages for the ones that do not.
    fresh = _prompt(40, 4)
    _run(engine, {"c": (fresh, scored)})
    assert _run(engine, {"d": (fresh, plain)})["d"][-1].num_cached_tokens == 32


def test_request_preempted_mid_prompt_scores_each_token_once(llama_dir, reference):
    # 6 usable pages of 16: the scored 64-token prompt, prefilled 15 tokens a step beside
    # the other request's decodes, runs out of pages on its fourth and is preempted; its
    # recompute adds no second entry for the positions it scored before.
    decoding, scored = _prompt(30, 5), _prompt(64, 6)
    engine = _engine(llama_dir, budget=16, num_blocks=7, caching=False)
    outs = _run(engine, {
        "decoding": (decoding, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)),
        "scored": (scored, SamplingParams(max_tokens=2, prompt_logprobs=2))})
    assert engine.scheduler.num_preemptions > 0
    _check(_prompt_entries(outs["scored"]), scored, reference(scored), 2)


def test_llm_generate_exposes_them_as_vllm_does(llama_dir, reference):
    llm = LLM(llama_dir, load_tokenizer=False, dtype="float32", block_size=16, num_blocks=32)
    prompt = _prompt(12, 7)
    out = llm.generate([prompt, prompt[:5]],
                       [SamplingParams(n=2, max_tokens=2, prompt_logprobs=1, seed=0),
                        SamplingParams(max_tokens=2)])
    _check(out[0].prompt_logprobs, prompt, reference(prompt), 1)
    assert out[1].prompt_logprobs is None


def test_a_backend_that_cannot_score_refuses_the_request(llama_dir):
    class NoScoring(CPUAccelerator):
        name = "no-scoring"
        capabilities = Capabilities(dtypes=("float32",))

    config = EngineConfig(model=ModelSpec(llama_dir, "float32"), cache=CacheConfig(16, 16))
    engine = Engine(config, NoScoring(), load_tokenizer=False)
    with pytest.raises(ValueError, match="no-scoring backend does not compute prompt_logprobs"):
        engine.add_request("r", [1, 2, 3], SamplingParams(prompt_logprobs=1))


def test_prompt_logprobs_are_validated():
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs must be an integer"):
        SamplingParams(prompt_logprobs=True)
