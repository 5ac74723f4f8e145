"""Large bodies are parsed in a worker process (serve/api/body_parse.py), which refuses a prompt of
token ids longer than the context itself."""
from __future__ import annotations

import asyncio
import json

from pydantic import BaseModel

from deepinfer.serve.api.body_parse import BodyRefused, LargeBodyParser
from deepinfer.serve.api.protocol import CompletionRequest


def _parse_all(raws: list[bytes], max_model_len: int = 512) -> list:
    async def run() -> list:
        parser = LargeBodyParser(1, max_model_len)
        try:
            return [await parser.parse(CompletionRequest, raw) for raw in raws]
        finally:
            parser.close()
    return asyncio.run(run())


def test_the_worker_validates_and_refuses_while_this_process_parses_nothing(monkeypatch):
    def here(*_args, **_kwargs):
        raise AssertionError("parsed in the API process")

    # Only this process is patched: the spawned worker imports pydantic afresh.
    monkeypatch.setattr(BaseModel, "model_validate_json", classmethod(here))
    fits = json.dumps({"model": "m", "prompt": list(range(100)), "max_tokens": 3}).encode()
    huge = json.dumps({"model": "m", "prompt": list(range(300_000))}).encode()
    invalid = json.dumps({"model": "m", "prompt": [], "max_tokens": -1}).encode()
    body, refused, wrong = _parse_all([fits, huge, invalid])
    assert isinstance(body, CompletionRequest) and body.prompt == list(range(100))
    assert body.max_tokens == 3
    assert refused == BodyRefused(message="This model's maximum context length is 512 tokens. "
                                          "However, your prompt has 300000 tokens.",
                                  param="prompt")
    assert isinstance(wrong, BodyRefused) and wrong.errors
    assert all(set(e) == {"loc", "msg", "type"} for e in wrong.errors)  # no inputs sent back


def test_only_id_prompts_count_against_the_context():
    prompts = [[[1] * 600, [2]], "text", ["a", "b"], [[1] * 511]]
    parsed = _parse_all([json.dumps({"prompt": p}).encode() for p in prompts])
    assert [isinstance(p, BodyRefused) for p in parsed] == [True, False, False, False]
