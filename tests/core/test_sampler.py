"""Sampler tests. Every expectation comes from an independent computation: numpy / plain
Python references of the penalized and filtered distribution, compared with greedy choices,
with the support of the samples, or with empirical frequencies over many seeds."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from deepinfer.core.batch import SamplingRow
from deepinfer.core.sampler import Sampler
from deepinfer.core.sampling import SamplingParams

DRAWS = 4000


# ----------------------------------------------------------------------------- references


def np_log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def ref_penalized(logits: Sequence[float], prompt: Sequence[int], output: Sequence[int],
                  repetition: float = 1.0, frequency: float = 0.0,
                  presence: float = 0.0) -> np.ndarray:
    """Plain-Python penalties: repetition over prompt + output, frequency/presence over output."""
    out = [float(x) for x in logits]
    for token in set(prompt) | set(output):
        out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
    for token in set(output):
        count = list(output).count(token)
        out[token] -= frequency * count + presence
    return np.array(out)


def ref_filtered_probs(logits: Sequence[float], temperature: float = 1.0, top_k: int = 0,
                       top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """The distribution a sampled row must follow, built one rule at a time in float64."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    vocab = len(z)
    order = sorted(range(vocab), key=lambda t: -z[t])
    allowed = set(order[:top_k] if top_k > 0 else order)

    def normalized() -> np.ndarray:
        p = np.array([math.exp(z[t] - z.max()) if t in allowed else 0.0 for t in range(vocab)])
        return p / p.sum()

    if top_p < 1.0:
        p, kept, mass = normalized(), set(), 0.0
        for token in order:  # smallest descending prefix whose mass reaches top_p
            if token not in allowed or mass >= top_p:
                break
            kept.add(token)
            mass += p[token]
        allowed = kept
    p = normalized()
    allowed = {t for t in allowed if p[t] >= min_p * p.max()}
    return normalized()


# ----------------------------------------------------------------------------- helpers


def row(params: SamplingParams, seed: int = 0, step: int = 0, prompt: Sequence[int] = (),
        output: Sequence[int] = (), eos: tuple[int, ...] = ()) -> SamplingRow:
    return SamplingRow(params=params, seed=seed, step=step, prompt_token_ids=list(prompt),
                       output_token_ids=list(output), eos_token_ids=eos)


def draw(logits: Sequence[float], params: SamplingParams, n: int = DRAWS, step: int = 0,
         **row_kwargs) -> np.ndarray:
    """n samples of one distribution: the same logits on n rows with seeds 0..n-1."""
    batch = torch.tensor(logits, dtype=torch.float32).repeat(n, 1)
    rows = [row(params, seed=s, step=step, **row_kwargs) for s in range(n)]
    return np.array(Sampler().sample(batch, rows).token_ids)


def greedy_pick(logits: Sequence[float], params: SamplingParams, **row_kwargs) -> int:
    return Sampler().sample(torch.tensor([logits]), [row(params, **row_kwargs)]).token_ids[0]


def chi_square(samples: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    support = expected > 0
    counts = np.bincount(samples, minlength=len(expected))
    wanted = expected[support] * len(samples)
    return float(((counts[support] - wanted) ** 2 / wanted).sum()), int(support.sum()) - 1


def assert_follows(samples: np.ndarray, expected: np.ndarray) -> None:
    """Support is exactly the reference's (never outside, every token reached) and the
    frequencies pass a chi-square bound with p-value ~1e-5 (seeds are fixed, so no flakes)."""
    seen = set(np.unique(samples).tolist())
    assert seen == set(np.flatnonzero(expected > 0).tolist())
    stat, df = chi_square(samples, expected)
    assert stat < df + 8 * math.sqrt(2 * df) + 1, (stat, df)


# Spread-out logits: every kept token has probability >= ~3%, no rule sits near its threshold.
LOGITS = [2.0, 0.3, 1.4, -0.5, 0.9, 1.9, -1.2, 0.0]


# ----------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(top_k=1)])
def test_greedy_fast_path_is_argmax(dtype: torch.dtype, params: SamplingParams) -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0)).to(dtype)
    before = logits.clone()
    out = Sampler().sample(logits, [row(params, seed=s) for s in range(5)])
    assert out.token_ids == np.argmax(logits.float().numpy(), axis=-1).tolist()
    assert out.logprobs == [None] * 5
    assert torch.equal(logits, before)


def test_greedy_rows_in_mixed_batch_take_argmax() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    rows = [row(SamplingParams(temperature=0.0)), row(SamplingParams(temperature=1.5), seed=3),
            row(SamplingParams(top_k=1, temperature=2.0)), row(SamplingParams(), seed=9)]
    out = Sampler().sample(logits, rows)
    expected = np.argmax(logits.numpy(), axis=-1)
    assert out.token_ids[0] == expected[0] and out.token_ids[2] == expected[2]


def test_empty_batch_and_shape_mismatch() -> None:
    assert Sampler().sample(torch.zeros(0, 10), []).token_ids == []
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(2, 10), [row(SamplingParams())])


def test_input_logits_are_not_modified() -> None:
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    params = SamplingParams(temperature=0.8, top_k=5, repetition_penalty=1.3,
                            presence_penalty=0.5, min_tokens=3, logprobs=2)
    Sampler().sample(logits, [row(params, prompt=[1, 2], output=[3], eos=(4,)),
                              row(params, seed=1, output=[5])])
    assert torch.equal(logits, before)


# ----------------------------------------------------------------------------- distributions


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
def test_temperature_matches_reference(temperature: float) -> None:
    samples = draw(LOGITS, SamplingParams(temperature=temperature))
    assert_follows(samples, ref_filtered_probs(LOGITS, temperature=temperature))


def test_distribution_check_detects_wrong_temperature() -> None:
    # Guards the guard: the chi-square bound must reject a visibly different temperature.
    samples = draw(LOGITS, SamplingParams(temperature=0.5))
    stat, df = chi_square(samples, ref_filtered_probs(LOGITS, temperature=1.0))
    assert stat > 10 * (df + 8 * math.sqrt(2 * df) + 1)


@pytest.mark.parametrize("top_k", [2, 3, 5])
def test_top_k_matches_reference(top_k: int) -> None:
    samples = draw(LOGITS, SamplingParams(top_k=top_k, temperature=1.3))
    assert_follows(samples, ref_filtered_probs(LOGITS, temperature=1.3, top_k=top_k))


def test_top_k_larger_than_vocab_keeps_everything() -> None:
    samples = draw(LOGITS, SamplingParams(top_k=1000))
    assert_follows(samples, ref_filtered_probs(LOGITS))


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.85])
def test_top_p_matches_reference(top_p: float) -> None:
    samples = draw(LOGITS, SamplingParams(top_p=top_p))
    assert_follows(samples, ref_filtered_probs(LOGITS, top_p=top_p))


def test_tiny_top_p_keeps_the_top_token() -> None:
    assert set(draw(LOGITS, SamplingParams(top_p=1e-6), n=200).tolist()) == {0}


@pytest.mark.parametrize("min_p", [0.1, 0.3, 0.7])
def test_min_p_matches_reference(min_p: float) -> None:
    samples = draw(LOGITS, SamplingParams(min_p=min_p, temperature=0.9))
    assert_follows(samples, ref_filtered_probs(LOGITS, temperature=0.9, min_p=min_p))


def test_filters_combined_match_reference() -> None:
    params = SamplingParams(temperature=1.7, top_k=6, top_p=0.8, min_p=0.3)
    expected = ref_filtered_probs(LOGITS, temperature=1.7, top_k=6, top_p=0.8, min_p=0.3)
    assert 2 <= (expected > 0).sum() < 6  # every filter matters here
    assert_follows(draw(LOGITS, params), expected)


@settings(max_examples=40, deadline=None)
@given(logits=st.lists(st.floats(-4, 4), min_size=2, max_size=24),
       temperature=st.floats(0.2, 3.0), top_k=st.integers(0, 30),
       top_p=st.floats(0.05, 1.0), min_p=st.floats(0.0, 0.9))
def test_samples_stay_inside_reference_support(logits: list[float], temperature: float,
                                               top_k: int, top_p: float, min_p: float) -> None:
    logits = np.float32(logits).tolist()  # the sampler sees float32 values; so does the reference
    z = np.array(logits) / temperature
    assume(len(set(np.round(z, 3))) == len(z))  # no ties: top-k's kept set is unambiguous
    # Stay clear of thresholds where float32 and float64 could honestly disagree.
    before_top_p = ref_filtered_probs(logits, temperature, top_k)
    cumulative = np.cumsum(np.sort(before_top_p)[::-1])
    assume(top_p >= 1.0 or np.abs(cumulative - top_p).min() > 1e-4)
    before_min_p = ref_filtered_probs(logits, temperature, top_k, top_p)
    ratios = before_min_p[before_min_p > 0] / before_min_p.max()
    assume(min_p == 0.0 or np.abs(ratios - min_p).min() > 1e-4)
    expected = ref_filtered_probs(logits, temperature, top_k, top_p, min_p)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    samples = draw(logits, params, n=64)
    assert set(samples.tolist()) <= set(np.flatnonzero(expected > 0).tolist())


# ----------------------------------------------------------------------------- penalties

GREEDY = dict(temperature=0.0)


@pytest.mark.parametrize("penalty, expected", [(1.0, 0), (1.2, 0), (1.5, 1)])
def test_repetition_penalty_divides_positive_logits(penalty: float, expected: int) -> None:
    # 2.0 / 1.2 = 1.67 still beats 1.5; 2.0 / 1.5 = 1.33 does not. Prompt tokens count.
    params = SamplingParams(repetition_penalty=penalty, **GREEDY)
    assert greedy_pick([2.0, 1.5, 0.0], params, prompt=[0]) == expected


@pytest.mark.parametrize("penalty, expected", [(1.0, 0), (1.05, 0), (1.2, 1)])
def test_repetition_penalty_multiplies_negative_logits(penalty: float, expected: int) -> None:
    # -1.0 * 1.05 = -1.05 still beats -1.1; -1.0 * 1.2 = -1.2 does not. Output tokens count.
    params = SamplingParams(repetition_penalty=penalty, **GREEDY)
    assert greedy_pick([-1.0, -1.1, -3.0], params, output=[0]) == expected


def test_repetition_penalty_below_one_boosts_seen_tokens() -> None:
    params = SamplingParams(repetition_penalty=0.5, **GREEDY)
    assert greedy_pick([1.0, 1.9, 0.0], params, prompt=[0]) == 0  # 1.0 / 0.5 = 2.0 > 1.9


@pytest.mark.parametrize("penalty, expected", [(0.4, 0), (0.6, 1), (-0.5, 0)])
def test_frequency_penalty_scales_with_output_count(penalty: float, expected: int) -> None:
    # Token 0 appears twice: 3.0 - 2 * 0.4 = 2.2 > 2.0, 3.0 - 2 * 0.6 = 1.8 < 2.0.
    params = SamplingParams(frequency_penalty=penalty, **GREEDY)
    assert greedy_pick([3.0, 2.0, 0.0], params, output=[0, 2, 0]) == expected


def test_frequency_and_presence_ignore_the_prompt() -> None:
    params = SamplingParams(frequency_penalty=2.0, presence_penalty=2.0, **GREEDY)
    assert greedy_pick([3.0, 2.0, 0.0], params, prompt=[0, 0, 0]) == 0


@pytest.mark.parametrize("penalty, expected", [(0.9, 0), (1.1, 1)])
def test_presence_penalty_ignores_count(penalty: float, expected: int) -> None:
    # Five occurrences cost the same as one: 3.0 - 0.9 = 2.1 > 2.0, 3.0 - 1.1 = 1.9 < 2.0.
    params = SamplingParams(presence_penalty=penalty, **GREEDY)
    assert greedy_pick([3.0, 2.0, 0.0], params, output=[0] * 5) == expected


@settings(max_examples=60, deadline=None)
@given(data=st.data(), vocab=st.integers(2, 12), repetition=st.floats(0.5, 2.0),
       frequency=st.floats(-2.0, 2.0), presence=st.floats(-2.0, 2.0))
def test_penalized_greedy_matches_reference(data: st.DataObject, vocab: int, repetition: float,
                                            frequency: float, presence: float) -> None:
    logits = data.draw(st.lists(st.floats(-3, 3), min_size=vocab, max_size=vocab))
    tokens = st.lists(st.integers(0, vocab - 1), max_size=8)
    prompt, output = data.draw(tokens), data.draw(tokens)
    logits32 = np.float32(logits).tolist()
    reference = ref_penalized(logits32, prompt, output, repetition, frequency, presence)
    top_two = np.sort(reference)[-2:]
    assume(top_two[1] - top_two[0] > 1e-4)  # a unique winner, robust to float32 rounding
    params = SamplingParams(repetition_penalty=repetition, frequency_penalty=frequency,
                            presence_penalty=presence, **GREEDY)
    assert greedy_pick(logits32, params, prompt=prompt, output=output) == np.argmax(reference)


def test_penalties_shape_the_sampled_distribution() -> None:
    prompt, output = [1, 4], [0, 0, 5]
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3,
                            temperature=0.8, top_k=6)
    penalized = ref_penalized(LOGITS, prompt, output, 1.3, 0.4, 0.3)
    expected = ref_filtered_probs(penalized, temperature=0.8, top_k=6)
    assert_follows(draw(LOGITS, params, prompt=prompt, output=output), expected)


# ----------------------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = [5.0, 4.0, 3.0, 1.0]  # eos 0 is the favourite, then stop id 1, then token 2
    params = SamplingParams(min_tokens=3, stop_token_ids=[1], **GREEDY)
    assert greedy_pick(logits, params, output=[3, 3], eos=(0,)) == 2
    assert greedy_pick(logits, params, output=[3, 3, 3], eos=(0,)) == 0
    assert greedy_pick(logits, SamplingParams(stop_token_ids=[1], **GREEDY),
                       eos=(0,)) == 0  # min_tokens 0: nothing is masked


def test_min_tokens_masks_sampled_rows_and_keeps_the_rest_of_the_distribution() -> None:
    logits = [3.0, 0.5, 1.0, 0.0]
    params = SamplingParams(min_tokens=2, stop_token_ids=[2])
    masked = draw(logits, params, output=[3], eos=(0,))
    assert_follows(masked, ref_filtered_probs([-np.inf, 0.5, -np.inf, 0.0]))
    reached = draw(logits, params, n=500, output=[3, 3], eos=(0,))
    assert {0, 2} <= set(reached.tolist())


# ----------------------------------------------------------------------------- seeds


def test_seed_is_batch_and_position_independent() -> None:
    gen = torch.Generator().manual_seed(3)
    target = torch.randn(1, 1000, generator=gen)
    params = SamplingParams(temperature=1.0, top_p=0.95)
    for seed, step in [(1234, 0), (1234, 7), (42, 3)]:
        alone = Sampler().sample(target, [row(params, seed=seed, step=step)]).token_ids[0]
        others = torch.randn(3, 1000, generator=gen)
        batch = torch.cat([others[:2], target, others[2:]])
        rows = [row(SamplingParams(temperature=0.7), seed=seed + 1, step=step),
                row(SamplingParams(temperature=0.0, logprobs=3), seed=seed, step=step),
                row(params, seed=seed, step=step),
                row(SamplingParams(top_k=5, presence_penalty=1.0), seed=seed, step=step + 1,
                    output=[1, 2])]
        assert Sampler().sample(batch, rows).token_ids[2] == alone


def test_same_seed_and_step_repeat_across_calls() -> None:
    logits = torch.zeros(1, 500)
    params = SamplingParams()
    picks = {Sampler().sample(logits, [row(params, seed=77, step=5)]).token_ids[0]
             for _ in range(5)}
    assert len(picks) == 1


def test_different_seeds_and_steps_differ() -> None:
    vocab, n = 1000, 200  # uniform: repeated tokens would mean repeated noise
    by_seed = draw([0.0] * vocab, SamplingParams(), n=n)
    assert len(set(by_seed.tolist())) > 150
    logits = torch.zeros(n, vocab)
    by_step = Sampler().sample(logits, [row(SamplingParams(), seed=5, step=s) for s in range(n)])
    assert len(set(by_step.token_ids)) > 150


# ----------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_come_from_raw_logits(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    # Distinct values 0.1 apart (still distinct in bfloat16), so ranks and top lists are unique.
    logits = torch.stack([torch.randperm(40, generator=gen) * 0.1 - 2.0 for _ in range(6)])
    logits = logits.to(dtype)
    raw = logits.float().numpy()
    processed = dict(temperature=3.0, top_k=20, repetition_penalty=1.5, presence_penalty=1.0)
    params = [SamplingParams(logprobs=5, **processed), SamplingParams(logprobs=0),
              SamplingParams(), SamplingParams(logprobs=20, temperature=0.0, min_tokens=2),
              SamplingParams(logprobs=1, temperature=5.0), SamplingParams(logprobs=3)]
    rows = [row(p, seed=i, prompt=[1, 2, 3], output=[4], eos=(7,)) for i, p in enumerate(params)]
    out = Sampler().sample(logits, rows)
    assert out.logprobs[2] is None
    for i, p in enumerate(params):
        if p.logprobs is None:
            continue
        ref, info, token = np_log_softmax(raw[i]), out.logprobs[i], out.token_ids[i]
        assert info.token_id == token
        assert info.logprob == pytest.approx(ref[token], abs=1e-5)
        assert info.rank == 1 + int((ref > ref[token]).sum())
        top_ids = np.argsort(-ref, kind="stable")[:p.logprobs].tolist()
        assert [t for t, _ in info.top] == top_ids
        assert [lp for _, lp in info.top] == pytest.approx(ref[top_ids].tolist(), abs=1e-5)
    assert out.logprobs[1].top == []


def test_logprob_rank_of_sampled_tokens() -> None:
    logits = [1.0, 0.8, 0.6, 0.4, 0.2, 0.0]
    batch = torch.tensor(logits).repeat(300, 1)
    params = SamplingParams(logprobs=2, temperature=2.0)
    out = Sampler().sample(batch, [row(params, seed=s) for s in range(300)])
    for token, info in zip(out.token_ids, out.logprobs):
        assert info.rank == token + 1  # logits are already in descending order
    assert {info.rank for info in out.logprobs} == set(range(1, 7))


# ----------------------------------------------------------------------------- params


@pytest.mark.parametrize("kwargs", [
    dict(n=0), dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_p=0.0),
    dict(top_p=1.5), dict(top_k=-2), dict(min_p=-0.1), dict(min_p=1.1), dict(max_tokens=0),
    dict(min_tokens=-1), dict(min_tokens=5, max_tokens=4), dict(presence_penalty=2.5),
    dict(frequency_penalty=-2.5), dict(repetition_penalty=0.0), dict(logprobs=21),
    dict(logprobs=-1), dict(stop=[""]), dict(stop_token_ids=[-1]),
])
def test_sampling_params_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_sampling_params_normalizes_and_accepts_edges() -> None:
    params = SamplingParams(top_k=-1, stop="END", max_tokens=None, min_tokens=100, logprobs=20)
    assert params.top_k == 0 and params.stop == ["END"]
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams().greedy and not SamplingParams().uses_penalties


def test_token_bitmask_limits_greedy_and_sampled_choices():
    from deepinfer.core.sampler import unpack_bitmask

    vocab = 70
    allowed = [3, 31, 32, 64, 69]
    words = [0, 0, 0]
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    # int32 words, as grammar libraries pack them (bit 31 makes a word negative)
    packed = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words],
                          dtype=torch.int32)
    assert unpack_bitmask(packed, vocab).nonzero().flatten().tolist() == allowed
    logits = torch.randn(1, vocab)
    logits[0, 5] = 100.0  # the unconstrained favourite is not allowed
    greedy = SamplingRow(SamplingParams(temperature=0), seed=0, step=0, prompt_token_ids=[],
                         output_token_ids=[], token_bitmask=packed)
    expected = max(allowed, key=lambda t: logits[0, t].item())
    assert Sampler().sample(logits, [greedy]).token_ids == [expected]
    seen = set()
    for step in range(200):
        row = SamplingRow(SamplingParams(temperature=1.0), seed=1, step=step,
                          prompt_token_ids=[], output_token_ids=[], token_bitmask=packed)
        seen.update(Sampler().sample(torch.zeros(1, vocab), [row]).token_ids)
    assert seen == set(allowed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_stage_argmax_equals_torch_argmax(dtype):
    """Ties (few distinct values) and NaN rows resolve exactly as torch.argmax does."""
    from deepinfer.core.sampler import argmax_rows

    g = torch.Generator().manual_seed(0)
    for trial in range(50):
        vocab = 128 * int(torch.randint(16, 40, (), generator=g))
        x = torch.randint(-3, 3, (3, vocab), generator=g).to(dtype)
        if trial % 5 == 0:
            x[1, int(torch.randint(0, vocab, (), generator=g))] = float("nan")
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    odd = torch.randn(2, 1000, generator=g)  # no equal split: plain argmax
    assert torch.equal(argmax_rows(odd), odd.argmax(dim=-1))


# ----------------------------------------------------------------------------- logit_bias


def biased(logits: Sequence[float], bias: dict[int, float]) -> list[float]:
    return [x + bias.get(t, 0.0) for t, x in enumerate(logits)]


def only(logits: Sequence[float], allowed: Sequence[int]) -> list[float]:
    return [x if t in allowed else -np.inf for t, x in enumerate(logits)]


def test_logit_bias_samples_the_softmax_of_the_biased_logits() -> None:
    bias = {1: 1.5, 0: -2.0, 6: 3.0}
    params = SamplingParams(logit_bias=bias, temperature=0.8, top_p=0.9)
    expected = ref_filtered_probs(biased(LOGITS, bias), temperature=0.8, top_p=0.9)
    assert_follows(draw(LOGITS, params), expected)


@pytest.mark.parametrize("bias", [0.8, 0.4, -0.3])
def test_logit_bias_is_added_after_the_penalties(bias: float) -> None:
    """Token 0 was seen: the repetition penalty halves its logit (2.0 -> 1.0), then the bias
    is added; with 0.8 it beats token 1's 1.5 only in that order ((2.0 + 0.8) / 2 = 1.4)."""
    logits = [2.0, 1.5, 0.0, -1.0]
    params = SamplingParams(logit_bias={0: bias}, repetition_penalty=2.0, presence_penalty=0.1,
                            **GREEDY)
    reference = biased(ref_penalized(logits, [0], [2], repetition=2.0, presence=0.1), {0: bias})
    assert greedy_pick(logits, params, prompt=[0], output=[2]) == int(np.argmax(reference))


def test_bias_of_minus_100_bans_and_plus_100_forces_under_greedy() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 50, generator=gen) * 3
    top = logits.argmax(dim=-1).tolist()
    rows = [row(SamplingParams(**GREEDY)),
            row(SamplingParams(logit_bias={top[1]: -100}, **GREEDY)),
            row(SamplingParams(logit_bias={7: 100}, **GREEDY)),
            # an id past the logits' width is skipped, the rest still applies
            row(SamplingParams(logit_bias={50 + 3: 100, 9: 100}, **GREEDY)),
            # a bias never lifts a mask: EOS stays banned until min_tokens
            row(SamplingParams(logit_bias={top[4]: 100}, min_tokens=2, **GREEDY),
                output=[1], eos=(top[4],))]
    out = Sampler().sample(logits, rows)
    second = [t for t in logits[1].argsort(descending=True).tolist() if t != top[1]][0]
    without_eos = [t for t in logits[4].argsort(descending=True).tolist() if t != top[4]][0]
    assert out.token_ids == [top[0], second, 7, 9, without_eos]
    assert Sampler().sample_tokens(logits, rows).tolist() == out.token_ids  # the async path


# ----------------------------------------------------------------------------- allowed ids


@pytest.mark.parametrize("filters", [{}, {"top_k": 2}, {"min_p": 0.4, "temperature": 1.4}])
def test_allowed_token_ids_sample_only_the_set(filters: dict) -> None:
    """Seeded samples never leave the set and follow the softmax of the masked logits (the
    filters then apply within the set)."""
    allowed = [1, 3, 4, 6]
    params = SamplingParams(allowed_token_ids=allowed, **filters)
    samples = draw(LOGITS, params)
    assert set(samples.tolist()) <= set(allowed)
    assert_follows(samples, ref_filtered_probs(only(LOGITS, allowed), **filters))


def test_allowed_token_ids_greedy_takes_the_best_allowed_in_a_mixed_batch() -> None:
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 64, generator=gen)
    allowed = [2, 17, 40]
    rows = [row(SamplingParams(allowed_token_ids=allowed, **GREEDY)),
            row(SamplingParams(**GREEDY)),
            row(SamplingParams(allowed_token_ids=[63], logit_bias={5: 100}, **GREEDY))]
    out = Sampler().sample(logits, rows).token_ids
    assert out[0] == max(allowed, key=lambda t: logits[0, t].item())
    assert out[1] == logits[1].argmax().item()
    assert out[2] == 63  # a bias cannot bring back a token the set leaves out


def test_logprobs_stay_raw_under_bias_and_allowed_ids() -> None:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randperm(30, generator=gen).float().unsqueeze(0) * 0.1
    raw = np_log_softmax(logits[0].numpy())
    for params in (SamplingParams(logit_bias={4: 100.0}, logprobs=3, **GREEDY),
                   SamplingParams(allowed_token_ids=[4, 9], logprobs=3, temperature=1.0)):
        out = Sampler().sample(logits, [row(params, seed=3)])
        info, token = out.logprobs[0], out.token_ids[0]
        assert token in (4, 9) and info.token_id == token
        assert info.logprob == pytest.approx(raw[token], abs=1e-5)
        assert info.rank == 1 + int((raw > raw[token]).sum())
        assert [t for t, _ in info.top] == np.argsort(-raw)[:3].tolist()


def test_bias_and_allowed_ids_are_never_plain_greedy() -> None:
    from deepinfer.core.sampler import all_plain_greedy

    assert all_plain_greedy([row(SamplingParams(**GREEDY))])
    assert not all_plain_greedy([row(SamplingParams(logit_bias={1: 0.5}, **GREEDY))])
    assert not all_plain_greedy([row(SamplingParams(allowed_token_ids=[1], **GREEDY))])
    assert all_plain_greedy([row(SamplingParams(logit_bias={}, **GREEDY))])  # no bias at all


@pytest.mark.parametrize("kwargs, field", [
    (dict(logit_bias={1: 100.5}), "logit_bias"), (dict(logit_bias={1: -101}), "logit_bias"),
    (dict(logit_bias={1: float("nan")}), "logit_bias"),
    (dict(logit_bias={1: float("inf")}), "logit_bias"),
    (dict(logit_bias={1: "2"}), "logit_bias"), (dict(logit_bias={1: True}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(logit_bias={2**31: 1.0}), "logit_bias"), (dict(logit_bias={True: 1.0}), "logit_bias"),
    (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[3, -1]), "allowed_token_ids"),
    (dict(allowed_token_ids=[2**31]), "allowed_token_ids"),
    (dict(allowed_token_ids=["1"]), "allowed_token_ids"),
    (dict(allowed_token_ids="12"), "allowed_token_ids"),
    (dict(allowed_token_ids=5), "allowed_token_ids"),
])
def test_sampling_params_refuse_bad_token_fields(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_take_token_fields_at_their_edges() -> None:
    params = SamplingParams(logit_bias={0: 100, 2**31 - 1: -100.0},
                            allowed_token_ids=(0, 2**31 - 1))
    assert params.logit_bias == {0: 100.0, 2**31 - 1: -100.0}
    assert params.allowed_token_ids == [0, 2**31 - 1] and params.adjusts_logits
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert not SamplingParams().adjusts_logits
