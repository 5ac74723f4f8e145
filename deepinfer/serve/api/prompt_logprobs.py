"""The prompt's logprobs in OpenAI and vLLM response shapes: vLLM's `prompt_logprobs` list,
and completions' `echo` with `logprobs` (the prompt's tokens before the generated ones)."""
from __future__ import annotations

from typing import Callable

from deepinfer.core.batch import TokenLogprobs

# JSON has no -inf; vLLM clamps to this.
MIN_LOGPROB = -9999.0


def vllm_prompt_logprobs(entries: list[TokenLogprobs | None] | None,
                         token_text: Callable[[int], str]) -> list | None:
    """None for the first prompt token (nothing precedes it), then per prompt token
    {token id: {logprob, rank, decoded_token}} for the token itself and its top alternatives,
    as vLLM's responses carry them."""
    if entries is None:
        return None

    def one(token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": max(logprob, MIN_LOGPROB), "rank": rank,
                "decoded_token": token_text(token_id)}

    out: list[dict | None] = [None]
    for entry in entries[1:]:
        listed = {str(entry.token_id): one(entry.token_id, entry.logprob, entry.rank)}
        for rank, (token_id, logprob) in enumerate(entry.top, start=1):
            listed.setdefault(str(token_id), one(token_id, logprob, rank))
        out.append(listed)
    return out


def after_first_token(first_token: str, scored: dict) -> dict:
    """Completions logprobs of the prompt's tokens after the first (and what follows them),
    with the first prompt token put in front: no logprob and no top list (nothing precedes
    it), text_offset counted from its start."""
    return {"tokens": [first_token, *scored["tokens"]],
            "token_logprobs": [None, *scored["token_logprobs"]],
            "top_logprobs": [None, *scored["top_logprobs"]],
            "text_offset": [0, *(o + len(first_token) for o in scored["text_offset"])]}


def continued(logprobs: dict, offset: int) -> tuple[dict, int]:
    """A streamed chunk's completions logprobs with text_offset going on from the choice's
    earlier chunks (`offset` characters), and the offset after this chunk's tokens."""
    logprobs["text_offset"] = [o + offset for o in logprobs["text_offset"]]
    return logprobs, offset + sum(map(len, logprobs["tokens"]))
