"""The offline API on the real embedded model (SmolLM2-135M-Instruct) against transformers."""
from __future__ import annotations

import pytest
import torch
import transformers

from deepinfer import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(smollm2_dir) -> LLM:
    return LLM(smollm2_dir, dtype="float32", block_size=16, kv_cache_memory_gb=0.25)


def test_greedy_matches_transformers_on_the_real_model(llm, smollm2_dir):
    prompt = "The three primary colours are"
    ours = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    ids = llm.tokenizer(prompt, return_tensors="pt").input_ids
    ref = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    assert ours[0].outputs[0].token_ids == ref
    assert ours[0].outputs[0].text == llm.tokenizer.decode(ref)


def test_chat_renders_the_template_and_answers(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=20))
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"


def test_stop_string_cuts_the_text(llm):
    free = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=20,
                                                          ignore_eos=True))[0].outputs[0]
    stop = free.text[5:8]
    cut = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=20,
                                                         stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == free.text[: free.text.index(stop)]


def test_seeded_samples_repeat_and_differ(llm):
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    a = llm.generate("Once upon a time", params)[0].outputs
    b = llm.generate("Once upon a time", params)[0].outputs
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert a[0].token_ids != a[1].token_ids  # sample i uses seed + i


def test_logprobs_match_a_dense_forward(llm, smollm2_dir):
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3, logprobs=2,
                                               ignore_eos=True))[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    for k, item in enumerate(out.outputs[0].logprobs):
        row = logp[len(out.prompt_token_ids) - 1 + k]
        # The GGUF blocks' batch-1 GEMV rounds x to int16 per 32 columns: ~2e-4 here.
        assert item.logprob == pytest.approx(row[item.token_id].item(), abs=1e-3)
        assert [t for t, _ in item.top] == row.topk(2).indices.tolist()


def test_logit_bias_forces_a_token_and_logprobs_stay_raw(llm):
    """+100 on the second most likely token makes greedy decoding take it at every step (the
    async path: no logprobs) while its logprob and rank stay the unbiased model's."""
    prompt = "The three primary colours are"
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=2))
    first = plain[0].outputs[0].logprobs[0]
    (top1, _), (second, second_logprob) = first.top
    forced = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                            logit_bias={second: 100.0, top1: -100.0})
    assert llm.generate(prompt, forced)[0].outputs[0].token_ids == [second] * 4
    forced.logprobs, forced.max_tokens = 2, 1
    item = llm.generate(prompt, forced)[0].outputs[0].logprobs[0]
    assert (item.token_id, item.rank) == (second, 2)
    assert item.logprob == pytest.approx(second_logprob, abs=1e-5)
    assert [t for t, _ in item.top] == [top1, second]
    assert [lp for _, lp in item.top] == pytest.approx([lp for _, lp in first.top], abs=1e-5)


def test_allowed_token_ids_bound_seeded_samples_and_unknown_ids_are_refused(llm):
    allowed = llm.tokenizer.encode(" red green blue", add_special_tokens=False)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True,
                            allowed_token_ids=allowed)
    out = llm.generate("My favourite colour is", params)[0].outputs[0]
    assert len(out.token_ids) == 12 and set(out.token_ids) <= set(allowed)
    vocab = llm.engine.model.vocab_size
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate("Hi", SamplingParams(allowed_token_ids=[vocab]))
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate("Hi", SamplingParams(logit_bias={vocab + 1: 5.0}))


def test_prefix_cache_reuses_pages_across_calls(llm):
    system = "You are a helpful assistant. " * 8
    llm.generate(system + "Hi", SamplingParams(max_tokens=2))
    again = llm.generate(system + "Hello", SamplingParams(max_tokens=2))[0]
    assert again.num_cached_tokens >= 16


def test_hicache_option_gives_the_engine_a_host_tier(llama_dir):
    """An option LLM's old hand-written signature lacked reaches the engine."""
    llm = LLM(llama_dir, dtype="float32", accelerator="cpu", block_size=4, num_blocks=64,
              hicache_size_gb=0.01, long_prefill_token_threshold=8, load_tokenizer=False)
    assert llm.engine.hicache is not None and llm.engine.hicache.stats().pages_total > 0
    assert llm.engine.config.scheduler.long_prefill_token_threshold == 8
    out = llm.generate([list(range(1, 20))], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match="'max_num_sequences'.*max_num_seqs"):
        LLM("/no/such/model", max_num_sequences=4)
