"""LLM.generate takes vLLM's prompt dicts ({"prompt": str}, {"prompt_token_ids": [...]}) as well
as plain text and token lists, singly or in a list, and refuses anything else with a TypeError
before any request reaches the engine."""
from __future__ import annotations

import pytest
from test_llm import llm  # noqa: F401  (the module-scoped LLM on the embedded model)

from deepinfer import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_token_prompt_dict_alone(llm):  # noqa: F811
    ids = llm.tokenizer.encode("The sky is", add_special_tokens=True)
    [out] = llm.generate({"prompt_token_ids": ids}, GREEDY)
    assert out.prompt_token_ids == ids
    assert _tokens([out]) == _tokens(llm.generate(ids, GREEDY))


def test_every_form_in_one_list(llm):  # noqa: F811
    ids = llm.tokenizer.encode("Hello there", add_special_tokens=True)
    outs = llm.generate([{"prompt": "Hello there"}, {"prompt_token_ids": ids}, "Hello there",
                         tuple(ids)], GREEDY)
    assert [o.prompt_token_ids for o in outs] == [ids] * 4
    assert len(set(map(tuple, _tokens(outs)))) == 1  # greedy: one answer for one prompt
    [text] = llm.generate({"prompt": "Hello there"}, GREEDY)
    assert text.prompt_token_ids == ids


BAD = {
    "dict with an extra key": {"prompt": "hi", "multi_modal_data": {}},
    "dict with another key": {"text": "hi"},
    "empty dict": {},
    "prompt not a str": {"prompt": 5},
    "prompt_token_ids of floats": {"prompt_token_ids": [1.5, 2.0]},
    "prompt_token_ids a str": {"prompt_token_ids": "1 2"},
    "a float": 1.5,
    "None": None,
    "a list of floats": [1.0, 2.0],
    "token ids with a str": [1, "a"],
    "token ids of bools": [True, False],
    "nested list of mixed types": [[1, 2], "a", 3.0],
    "a list with a dict of the wrong shape": ["ok", {"prompt": ["x"]}],
    "a set of ids": [{1, 2}],
}


@pytest.mark.parametrize("prompts", BAD.values(), ids=BAD.keys())
def test_other_prompts_are_a_type_error_and_queue_nothing(llm, prompts):  # noqa: F811
    with pytest.raises(TypeError, match="prompt"):
        llm.generate(prompts, GREEDY)
    assert not llm.engine.has_unfinished_requests()
