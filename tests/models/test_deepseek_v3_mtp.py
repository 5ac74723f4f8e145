"""Speculative decoding with DeepSeek-V3's MTP layer as the draft, on the CPU backend: outputs
equal plain decoding (and transformers') for k = 1..3, with drafts that are never, always or
partly right; stops inside an accepted run; aborts free every block; the draft layer's logits
equal a reference built from transformers' own decoder layer; clear refusals."""
from __future__ import annotations

import os

import pytest
import torch
import transformers
from safetensors.torch import load_file

from deepinfer.core.sampling import SamplingParams
from deepinfer.llm import LLM
from tests.checkpoints import make_checkpoint
from tests.models.mtp_checkpoints import add_mtp, add_word_tokenizer, make_successor_model
from tests.models.oracle_drafts import OracleSpeculator, cpu_draft_logits, prefill_batch
from tests.models.test_deepseek_v3_parity import (
    DIMS,
    _prompts,
    _reference_greedy,
    _reference_model,
    make_deepseek,
)

N = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
LENGTHS = (5, 23, 41)


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory) -> str:
    """The "v3" parity checkpoint (its reference greedy paths have safe margins) + an MTP."""
    return add_mtp(make_deepseek(str(tmp_path_factory.mktemp("v3_mtp")), "v3"), seed=5)


@pytest.fixture(scope="module")
def plain(mtp_path) -> list[list[int]]:
    """Plain decoding's tokens for the LENGTHS prompts, checked against transformers."""
    prompts = _prompts(LENGTHS, seed=1)
    outs = [o.outputs[0].token_ids for o in _llm(mtp_path, 0).generate(prompts, GREEDY)]
    ref = _reference_model(mtp_path)
    assert outs == [_reference_greedy(ref, p, N) for p in prompts]
    return outs


@pytest.fixture(scope="module")
def successor(tmp_path_factory) -> tuple[str, list[int]]:
    return make_successor_model(str(tmp_path_factory.mktemp("successor")), DIMS)


def _llm(path: str, k: int, **options) -> LLM:
    options = {"load_tokenizer": False, **options}
    return LLM(path, dtype="float32", accelerator="cpu", block_size=16,
               kv_cache_memory_gb=0.05, num_speculative_tokens=k, **options)


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list, int]:
    """(each request's final output, engine steps taken)."""
    engine, steps, done = llm.engine, 0, {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        steps += 1
        done.update({out.request_id: out for out in engine.step() if out.finished})
    return [done[str(i)] for i in range(len(prompts))], steps


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_equals_plain_decoding_and_transformers(mtp_path, plain, k):
    # A 16-token budget chunks the longer prompts while the short one already verifies drafts.
    llm = _llm(mtp_path, k, max_num_batched_tokens=16)
    outs = llm.generate(_prompts(LENGTHS, seed=1), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain
    stats = llm.engine.scheduler.spec_stats
    assert stats.draft_tokens > 0 and 0 <= stats.accepted_tokens <= stats.draft_tokens
    assert sum(stats.accepted_per_position) == stats.accepted_tokens
    assert llm.engine.kv.num_request_blocks() == 0


def test_prompt_logprobs_under_speculation(mtp_path, plain):
    # A 16-token budget scores the longer prompts chunk by chunk while the short one verifies
    # drafts; the entries are transformers' and the tokens plain decoding's.
    prompts = _prompts(LENGTHS, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, prompt_logprobs=2)
    outs = _llm(mtp_path, 2, max_num_batched_tokens=16).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    ref = _reference_model(mtp_path)
    for out, prompt in zip(outs, prompts):
        with torch.no_grad():
            logp = ref(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        entries = out.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        for i, entry in enumerate(entries[1:], start=1):
            assert entry.token_id == prompt[i]
            assert entry.logprob == pytest.approx(logp[i - 1, prompt[i]].item(), abs=1e-4)
            assert [v for _, v in entry.top] == pytest.approx(
                logp[i - 1].topk(2).values.tolist(), abs=1e-4)


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(
    temperature=0.9, top_p=0.95, seed=7, max_tokens=N, ignore_eos=True, logprobs=2,
    repetition_penalty=1.3)], ids=["greedy", "seeded"])
def test_right_drafts_are_all_accepted_and_save_steps(mtp_path, params):
    prompts = _prompts(LENGTHS, seed=1)
    base, plain_steps = _run(_llm(mtp_path, 0), prompts, params)
    outputs = {tuple(p): o.token_ids for p, o in zip(prompts, base)}
    for wrong_second in (False, True):
        llm = _llm(mtp_path, 3)
        acc = llm.engine.accelerator
        acc.speculator = OracleSpeculator(acc.speculator, outputs, 1 if wrong_second else None,
                                          DIMS["vocab_size"])
        outs, steps = _run(llm, prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in base]
        stats = llm.engine.scheduler.spec_stats
        if params.logprobs:
            logprobs = _logprobs(llm, prompts, params)
            assert logprobs == pytest.approx(_logprobs(_llm(mtp_path, 0), prompts, params))
        if not wrong_second:
            assert stats.accepted_tokens == stats.draft_tokens > 0
            assert steps < plain_steps / 2  # 4 tokens a step once drafting
        else:
            assert stats.accepted_per_position[1] == 0
            assert stats.accepted_per_position[0] >= stats.accepted_tokens / 2 > 0


def _logprobs(llm: LLM, prompts, params) -> list[float]:
    return [lp.logprob for o in llm.generate(prompts, params) for lp in o.outputs[0].logprobs]


def _chain(succ: list[int], start: int, n: int) -> list[int]:
    out = [succ[start]]
    while len(out) < n:
        out.append(succ[out[-1]])
    return out


def test_mtp_layer_drafts_right_tokens_of_a_successor_model(successor):
    path, succ = successor
    prompts = [[3, 9], [17, 4, 8, 30, 2, 11, 60, 7, 91]]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm = _llm(path, 3)
    outs, steps = _run(llm, prompts, params)
    assert [o.token_ids for o in outs] == [_chain(succ, p[-1], 20) for p in prompts]
    stats = llm.engine.scheduler.spec_stats
    assert stats.accepted_tokens == stats.draft_tokens > 0
    # Every draft verified was accepted; the last steps verify fewer (max_tokens is near).
    per_position = stats.accepted_per_position
    assert per_position[0] == stats.drafts and per_position == sorted(per_position)[::-1]
    assert steps <= 20 // 4 + 1  # the prefill's token, then 4 a step


@pytest.mark.parametrize("params, n, reason", [
    # Steps give 1 (prefill), 4, 4 tokens: the chain's 7th is the second of a run of four.
    (dict(stop_token_ids=[None]), 7, "stop"),
    (dict(max_tokens=7), 7, "length"),
    # The stop token is banned until min_tokens: the sampler picks another token there.
    (dict(max_tokens=10, min_tokens=9, stop_token_ids=[None]), None, "length"),
])
def test_stops_inside_an_accepted_run(successor, params, n, reason):
    path, succ = successor
    prompt = [5, 12, 40]
    chain = _chain(succ, prompt[-1], 12)
    options = {"max_tokens": 12, "ignore_eos": True, "temperature": 0.0, **params}
    if "stop_token_ids" in params:
        options["stop_token_ids"] = [chain[6]]
    sampling = SamplingParams(**options)
    (plain_out,), _ = _run(_llm(path, 0), [prompt], sampling)
    llm = _llm(path, 3)
    (out,), _ = _run(llm, [prompt], sampling)
    assert (out.token_ids, out.finish_reason, out.stop_reason) == \
        (plain_out.token_ids, plain_out.finish_reason, plain_out.stop_reason)
    assert out.finish_reason == reason and len(out.token_ids) == (n or options["max_tokens"])
    if n is not None:
        assert out.token_ids == chain[:n]
    assert llm.engine.scheduler.spec_stats.accepted_tokens > 0


def test_a_stop_string_inside_an_accepted_run_ends_it_there(successor):
    """Decoded text ends at a stop string found in the middle of a step's run of accepted
    tokens: the tokens after it are neither output nor kept, as in plain decoding."""
    path, succ = successor
    add_word_tokenizer(path, DIMS["vocab_size"])
    prompt = [5, 12, 40]
    chain = _chain(succ, prompt[-1], 12)
    assert chain[6] not in chain[:6]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                            stop=[f"<{chain[6]}>"])
    outs = [_run(_llm(path, k, load_tokenizer=True), [prompt], params)[0][0] for k in (0, 3)]
    plain, spec = outs
    assert (spec.token_ids, spec.text, spec.finish_reason, spec.stop_reason) == \
        (plain.token_ids, plain.text, plain.finish_reason, plain.stop_reason)
    assert spec.token_ids == chain[:7] and spec.stop_reason == f"<{chain[6]}>"
    assert f"<{chain[5]}>" in spec.text and f"<{chain[7]}>" not in spec.text


def test_abort_mid_generation_frees_every_block(successor):
    path, _ = successor
    llm = _llm(path, 3)
    engine = llm.engine
    for i in range(2):
        engine.add_request(str(i), _prompts((20 + 9 * i,), seed=i)[0], GREEDY)
    for _ in range(3):
        engine.step()
    assert engine.kv.num_request_blocks() > 0 and engine.scheduler.spec_stats.drafts > 0
    for i in range(2):
        engine.abort(str(i))
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_request_blocks() == 0
    assert engine.kv.pool.num_free == engine.kv.pool.num_usable


def test_moe_mtp_layer_equals_plain_decoding(tmp_path):
    path = add_mtp(make_checkpoint(str(tmp_path), "deepseek_v3_moe"), seed=3)
    prompts = _prompts((7, 30), seed=2)
    plain_out = [o.outputs[0].token_ids for o in _llm(path, 0).generate(prompts, GREEDY)]
    llm = _llm(path, 2)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == plain_out
    assert llm.engine.accelerator.runner.model.mtp.moe is not None


def test_draft_logits_match_a_transformers_built_reference(mtp_path):
    prompt = _prompts((37,), seed=4)[0]
    nxt = 77  # the token after the prompt
    ours = cpu_draft_logits(mtp_path, prompt, nxt, 8, 16,
                            lambda spec: prefill_batch(prompt, [3, 1, 5], 16, spec, []))
    ref = _reference_draft_logits(mtp_path, prompt, nxt)
    assert (ours - ref).abs().max().item() < 1e-4


def _reference_draft_logits(path: str, prompt: list[int], nxt: int) -> torch.Tensor:
    """The MTP of DeepSeek-V3 (as vLLM runs it) over transformers' decoder layer and hidden
    states."""
    model = _reference_model(path)
    config = model.config
    layers = config.num_hidden_layers
    mtp = {k.removeprefix(f"model.layers.{layers}."): v for k, v in
           load_file(os.path.join(path, "mtp.safetensors")).items()}
    block = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer(
        config, layers).eval()
    block.load_state_dict({k: v for k, v in mtp.items() if "." in k and k.split(".")[0] in
                           ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")})
    n, eps = len(prompt), config.rms_norm_eps
    with torch.no_grad():
        hidden = model.model(torch.tensor([prompt])).last_hidden_state[0]
        embeds = mtp["embed_tokens.weight"][torch.tensor(prompt[1:] + [nxt])]
        embeds[0] = 0.0  # position 0
        joined = torch.cat((_rms(embeds, mtp["enorm.weight"], eps),
                            _rms(hidden, mtp["hnorm.weight"], eps)), dim=-1)
        x = (joined @ mtp["eh_proj.weight"].T)[None]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = block(x, attention_mask=mask, position_ids=positions,
                    position_embeddings=model.model.rotary_emb(x, positions))
        out = out[0] if isinstance(out, tuple) else out
        normed = _rms(out[0], mtp["shared_head.norm.weight"], eps)
        return normed @ mtp["shared_head.head.weight"].T


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def test_refusals_name_the_missing_piece(tmp_path):
    no_mtp = make_deepseek(str(tmp_path / "v3"), "v3")
    with pytest.raises(ValueError, match="no weights for its multi-token-prediction layer"):
        _llm(no_mtp, 1)
    llama = make_checkpoint(str(tmp_path / "llama"), "llama")
    with pytest.raises(ValueError, match="LlamaForCausalLM has none here"):
        _llm(llama, 2)
