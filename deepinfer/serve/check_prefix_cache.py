"""A/B check of the prefix caches (device and HiCache) on a live server.

    python -m deepinfer.serve.check_prefix_cache --port 8000 --turns 6

A multi-turn chat grows turn by turn (the assistant's answer and a new user message are
appended). Each turn is sent twice, greedy: once with "prefix_cache": false (full prefill) and
once with the caches. The two outputs must match token for token; the table shows both TTFTs
and the cached prompt tokens. The exit status is 1 when any turn differs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Sequence

import httpx

USER_MESSAGES = (
    "List the files you would read first to understand a web server's request path.",
    "Now explain what the second one most likely contains.",
    "Write a short shell command that counts lines in every Python file there.",
    "What would you change if the repository were ten times larger?",
    "Summarise the plan so far in three bullet points.",
    "Which step is the riskiest, and why?",
    "Draft a commit message for the first change.",
    "Name one test you would add before merging.",
)


@dataclass
class Arm:
    """One request of a turn: its streamed tokens, TTFT and cached prompt tokens."""

    tokens: list[str] = field(default_factory=list)
    text: str = ""
    ttft: float = float("nan")
    cached_tokens: int = 0


def run_arm(client: httpx.Client, model: str, prompt_ids: list[int], max_tokens: int,
            prefix_cache: bool, logprobs: int | None = 0, **extra) -> Arm:
    """One streamed greedy request (logprobs None: none asked; `extra`: more body fields)."""
    body = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "prefix_cache": prefix_cache, **extra}
    if logprobs is not None:
        body["logprobs"] = logprobs
    arm, start = Arm(), time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message"))
            if chunk.get("usage"):
                details = chunk["usage"].get("prompt_tokens_details") or {}
                arm.cached_tokens = details.get("cached_tokens", 0)
            for choice in chunk.get("choices", []):
                if arm.ttft != arm.ttft:  # NaN: the first token has not arrived yet
                    arm.ttft = time.perf_counter() - start
                arm.text += choice.get("text", "")
                arm.tokens.extend((choice.get("logprobs") or {}).get("tokens", []))
    return arm


def first_difference(a: Sequence[str], b: Sequence[str]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def system_prompt(words: int) -> str:
    # A long fixed preamble, as agents send: the part every turn shares.
    return "You are a careful coding agent. " + " ".join(
        f"rule{i}: keep change {i} small and tested." for i in range(words // 7))


def check(client: httpx.Client, model: str, turns: int, max_tokens: int, words: int) -> bool:
    messages = [{"role": "system", "content": system_prompt(words)}]
    ok = True
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'ttft off ms':>12} {'ttft on ms':>11} "
          "same")
    for turn in range(turns):
        messages.append({"role": "user", "content": USER_MESSAGES[turn % len(USER_MESSAGES)]})
        tokenized = client.post("/tokenize", json={"model": model, "messages": messages})
        tokenized.raise_for_status()
        ids = tokenized.json()["tokens"]
        off = run_arm(client, model, ids, max_tokens, prefix_cache=False)
        on = run_arm(client, model, ids, max_tokens, prefix_cache=True)
        diff = first_difference(off.tokens, on.tokens)
        same = diff is None
        ok &= same
        print(f"{turn:>4} {len(ids):>7} {on.cached_tokens:>7} {off.ttft * 1e3:>12.1f} "
              f"{on.ttft * 1e3:>11.1f} {'yes' if same else f'NO (first diff at token {diff})'}")
        messages.append({"role": "assistant", "content": on.text})
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--system-words", type=int, default=700,
                   help="length of the shared system prompt, in words")
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=f"http://{args.host}:{args.port}", headers=headers,
                      timeout=args.timeout) as client:
        models = client.get("/v1/models")
        models.raise_for_status()
        model = models.json()["data"][0]["id"]
        ok = check(client, model, args.turns, args.max_tokens, args.system_words)
    print("outputs match token for token" if ok else "outputs DIFFER with the cache on")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
