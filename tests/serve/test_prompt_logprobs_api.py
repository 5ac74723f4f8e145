"""The prompt's logprobs over HTTP, called with the `openai` client on the tiny server:
completions' echo with logprobs (the prompt's tokens first, the first with none, text_offset
from the echoed prompt's start) and vLLM's `prompt_logprobs` (extra_body) on completions and
chat, checked against transformers on the server's own checkpoint."""
from __future__ import annotations

import openai
import pytest
import torch
import transformers

MODEL = "tiny-chat"
PROMPT = "Roses are red, violets are"
TOL = 1e-4


@pytest.fixture(scope="module")
def reference(module_servers):
    """log_softmax of transformers' logits at every position of a token list."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        module_servers._tiny_checkpoint(), dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return logprobs


@pytest.fixture(scope="module")
def prompt_ids(http) -> list[int]:
    r = http.post("/tokenize", json={"prompt": PROMPT})  # as completions encode it (BOS too)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _complete(client, **kwargs):
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                     **kwargs)


def test_echo_with_logprobs_covers_the_prompt(client, prompt_ids, reference):
    echoed = _complete(client, echo=True, logprobs=2)
    plain = _complete(client, logprobs=2)
    lp, gen = echoed.choices[0].logprobs, plain.choices[0].logprobs
    n = len(prompt_ids)
    assert echoed.usage.prompt_tokens == n
    total = n + echoed.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) \
        == len(lp.text_offset) == total
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    # text_offset counts characters from the start of the echoed prompt.
    assert lp.text_offset[0] == 0
    assert all(lp.text_offset[i + 1] == lp.text_offset[i] + len(lp.tokens[i])
               for i in range(total - 1))
    # The generated part is what the request without echo gets.
    assert lp.tokens[n:] == gen.tokens
    assert lp.token_logprobs[n:] == pytest.approx(gen.token_logprobs, abs=TOL)
    # The prompt part: each token's logprob given the tokens before it.
    ref = reference(prompt_ids)
    for i in range(1, n):
        assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, prompt_ids[i]].item(), abs=TOL)
        assert 1 <= len(lp.top_logprobs[i]) <= 3  # keys are token texts: equal texts merge
        assert max(lp.top_logprobs[i].values()) == pytest.approx(ref[i - 1].max().item(),
                                                                 abs=TOL)
    # Streamed, the same lists, text_offset going on across the chunks.
    chunks = list(_complete(client, echo=True, logprobs=2, stream=True))
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for c in chunk.choices:
            for key in streamed:
                streamed[key] += getattr(c.logprobs, key)
    assert streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset
    assert streamed["token_logprobs"][0] is None
    assert streamed["token_logprobs"][1:] == pytest.approx(lp.token_logprobs[1:], abs=TOL)


def test_completions_prompt_logprobs_in_extra_body(client, prompt_ids, reference):
    r = _complete(client, extra_body={"prompt_logprobs": 3})
    entries = r.choices[0].prompt_logprobs
    assert len(entries) == len(prompt_ids) == r.usage.prompt_tokens and entries[0] is None
    ref = reference(prompt_ids)
    for i, listed in enumerate(entries[1:], start=1):
        row, token = ref[i - 1], prompt_ids[i]
        mine = listed[str(token)]
        assert mine["logprob"] == pytest.approx(row[token].item(), abs=TOL)
        lo, hi = (int((row > row[token] + d).sum()) + 1 for d in (TOL, -TOL))
        assert lo <= mine["rank"] <= hi  # a near tie may fall either way
        # The prompt token and the top 3 (one entry when it is among them).
        assert 3 <= len(listed) <= 4
        top = sorted((e for e in listed.values() if e["rank"] <= 3), key=lambda e: e["rank"])
        assert [e["logprob"] for e in top] == pytest.approx(row.topk(3).values.tolist(),
                                                            abs=TOL)
        assert all(isinstance(e["decoded_token"], str) for e in listed.values())
    assert r.choices[0].logprobs is None  # the completion's own logprobs were not asked for


def test_chat_prompt_logprobs_in_extra_body(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi there"}], max_tokens=3,
        temperature=0, extra_body={"prompt_logprobs": 0})
    entries = r.prompt_logprobs
    assert len(entries) == r.usage.prompt_tokens and entries[0] is None
    assert all(len(listed) == 1 for listed in entries[1:])  # the prompt token alone
    assert all(e["logprob"] <= 0.0 and e["rank"] >= 1
               for listed in entries[1:] for e in listed.values())
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi there"}], max_tokens=3,
        temperature=0)
    assert plain.prompt_logprobs is None
    assert plain.choices[0].message.content == r.choices[0].message.content


@pytest.mark.parametrize("extra", [{"prompt_logprobs": 21}, {"prompt_logprobs": -1},
                                   {"prompt_logprobs": 2, "stream": True}])
def test_bad_prompt_logprobs_are_refused(client, extra):
    with pytest.raises(openai.BadRequestError) as err:
        _complete(client, extra_body=extra)
    assert err.value.body["param"] == "prompt_logprobs"
