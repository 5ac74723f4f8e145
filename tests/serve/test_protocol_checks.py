"""The request body's pre-validation (check_json_value) against a plain recursive reference,
and the completion prompt's union: each JSON shape keeps its meaning whatever the order."""
from __future__ import annotations

from typing import Any

import pytest

from deepinfer.serve.api.protocol import MAX_NESTING, CompletionRequest, check_json_value


def reference(value: Any, depth: int = 0) -> str | None:
    """The first problem found the obvious way: every value visited, scalars included."""
    if depth > MAX_NESTING:
        return "nests"
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "surrogate"
        return None
    items = list(value.items()) + [(k, k) for k in value] if isinstance(value, dict) else \
        list(enumerate(value)) if isinstance(value, list) else []
    return next((p for p in (reference(v, depth + 1) for _, v in items) if p), None)


def verdict(value: Any) -> str | None:
    try:
        check_json_value(value)
    except ValueError as exc:
        return "nests" if "nests" in str(exc) else "surrogate"
    return None


def nest(depth: int, leaf: Any) -> Any:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


LEAVES = [1, 2.5, True, None, "a", "\ud800", [], [1, 2, 3], [1, "\udc00"], {}, {"k": [1, 2]},
          {"\ud800": 1}, [[1], [2, 3]]]


@pytest.mark.parametrize("leaf", LEAVES, ids=repr)
def test_check_json_value_matches_the_reference(leaf: Any) -> None:
    for depth in range(MAX_NESTING - 3, MAX_NESTING + 2):
        for value in (nest(depth, leaf), {"prompt": nest(depth, leaf)}):
            assert verdict(value) == reference(value), (depth, leaf)


def test_token_ids_past_the_depth_limit_are_refused() -> None:
    """The ids of a list at depth MAX_NESTING lie one level past it."""
    with pytest.raises(ValueError, match="nests deeper"):
        check_json_value(nest(MAX_NESTING, list(range(5))))
    check_json_value(nest(MAX_NESTING - 1, list(range(5))))


@pytest.mark.parametrize("prompt", ["abc", ["a", "b"], [1, 2], [[1, 2], [3]]], ids=repr)
def test_prompt_shapes_keep_their_meaning(prompt: Any) -> None:
    body = CompletionRequest.model_validate({"prompt": prompt})
    assert body.prompt == prompt and type(body.prompt) is type(prompt)
    expected = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
    assert body.prompts() == expected


@pytest.mark.parametrize("prompt", [[], [1.5], [True, False], ["a", 1], [[1], "a"]], ids=repr)
def test_bad_prompts_are_refused(prompt: Any) -> None:
    with pytest.raises(ValueError):
        CompletionRequest.model_validate({"prompt": prompt})


def test_logit_bias_keys_become_token_ids_and_the_limit_bounds_both_fields() -> None:
    """OpenAI's logit_bias arrives with string keys; the server's bound (by default the
    vocabulary's size) counts distinct ids, and each field is refused under its own name."""
    from deepinfer.serve.api.errors import APIError
    from deepinfer.serve.api.limits import RequestLimits
    from deepinfer.serve.api.routes_openai import _check_token_fields

    body = CompletionRequest.model_validate(
        {"prompt": "x", "logit_bias": {"7": -100, "007": 5, "12": 0.5},
         "allowed_token_ids": [3, 4, 4]})
    params = body.to_sampling_params()
    assert params.logit_bias == {7: 5.0, 12: 0.5} and params.allowed_token_ids == [3, 4, 4]
    _check_token_fields(RequestLimits(), body, vocab=13)
    _check_token_fields(RequestLimits(max_biased_tokens=3), body, vocab=13)
    for limits, vocab, param in ((RequestLimits(), 12, "logit_bias"),
                                 (RequestLimits(max_biased_tokens=2), 100, "allowed_token_ids"),
                                 (RequestLimits(max_biased_tokens=1), 100, "logit_bias")):
        with pytest.raises(APIError) as info:
            _check_token_fields(limits, body, vocab)
        assert info.value.param == param and info.value.status == 400
    with pytest.raises(ValueError):
        RequestLimits(max_biased_tokens=0)


@pytest.mark.parametrize("bias", [{"1.5": 1}, {" 1": 1}, {"+1": 1}, {"-1": 1}, {"1e3": 1},
                                  {"\u0661": 1}, {"12345678901": 1}, {"1": 100.01},
                                  {"1": -101}, {"1": "5"}, {"1": True}, [1, 2]], ids=repr)
def test_bad_logit_bias_is_refused_at_the_schema(bias: Any) -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        CompletionRequest.model_validate({"prompt": "x", "logit_bias": bias})
