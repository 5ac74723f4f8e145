"""Data-parallel request routing: which engine rank serves a request.

Two policies:

* ``affinity`` (default): rendezvous (highest-random-weight) hashing of a per-conversation key
  over the live ranks, so every turn of a conversation lands on the rank that already holds its
  prefix in cache. Keys spread evenly, and when a rank dies only its keys move (each to the
  rank that scores next-highest for it); the other keys stay put. When the chosen rank is
  overloaded (its queued + running tokens exceed ``overload_factor`` x the mean load of the
  other live ranks + ``overload_min_tokens``) the request goes to the least-loaded live rank
  instead.
* ``least-loaded``: the live rank with the fewest queued + running tokens; ties go round-robin,
  so requests that find every rank idle take turns instead of all landing on rank 0.

Load is what the caller reports through :meth:`Router.started` / :meth:`Router.finished`.
Hashing uses blake2b, so the mapping is the same in every process and across restarts.

Backend-neutral: imports nothing from deepinfer.serve or deepinfer.backends.
"""
from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping

POLICIES = ("affinity", "least-loaded")
AFFINITY_HEADERS = ("x-session-affinity", "x-correlation-id")
PROMPT_KEY_LEN = 256  # chars of a text prompt / ids of a token prompt that make its key
DECISIONS = ("affinity", "fallback_overloaded", "least_loaded", "rerouted_dead")


class NoLiveRankError(RuntimeError):
    """Every rank is marked dead; no request can be routed."""


@dataclass(frozen=True)
class RouteKey:
    """A routing key and where it came from (header, user, message, prompt or none)."""

    value: str
    source: str

    def __str__(self) -> str:
        return self.value


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def route_key(headers: Mapping[str, str] | None, user: str | None = None,
              messages: list[dict] | None = None,
              prompt: str | list[int] | None = None) -> RouteKey:
    """The request's affinity key with its source; see :func:`affinity_key`."""
    if headers:
        lowered = {str(k).lower(): v for k, v in headers.items()}
        for name in AFFINITY_HEADERS:
            value = lowered.get(name)
            if value:
                return RouteKey(f"h:{value}", "header")
    if user:
        return RouteKey(f"u:{user}", "user")
    for message in messages or ():
        if isinstance(message, dict) and message.get("role") == "user":
            # The first user turn identifies the conversation: later turns only append, and a
            # system prompt or tool list shared by many sessions must not collapse them.
            return RouteKey(f"m:{_content_text(message.get('content'))}", "message")
    if prompt is not None and len(prompt) > 0:
        if isinstance(prompt, str):
            return RouteKey(f"p:{prompt[:PROMPT_KEY_LEN]}", "prompt")
        return RouteKey("t:" + ",".join(str(int(t)) for t in prompt[:PROMPT_KEY_LEN]), "prompt")
    return RouteKey("", "none")


def affinity_key(headers: Mapping[str, str] | None, user: str | None = None,
                 messages: list[dict] | None = None,
                 prompt: str | list[int] | None = None) -> str:
    """The key that pins a request's conversation to a rank.

    In order: the ``X-Session-Affinity`` or ``X-Correlation-ID`` header (case-insensitive
    names), else the request's ``user`` field, else the content of the first *user* message,
    else the first 256 chars (or token ids) of the prompt. "" when there is nothing to go by
    (the router then picks the least-loaded rank).
    """
    return route_key(headers, user, messages, prompt).value


def _score(key: str, rank: int) -> int:
    digest = hashlib.blake2b(f"{rank}\x00{key}".encode("utf-8", "surrogatepass"),
                             digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass
class Route:
    """A request's rank, counted in the router's load from the pick until :meth:`release`
    (idempotent, so every path that may end the request can call it)."""

    rank: int
    tokens: int
    router: Router
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.router.finished(self.rank, self.tokens)


class Router:
    def __init__(self, num_ranks: int, policy: str = "affinity", overload_factor: float = 2.0,
                 overload_min_tokens: int = 8192) -> None:
        if num_ranks < 1:
            raise ValueError("num_ranks must be at least 1")
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose from {POLICIES}")
        if overload_factor < 1.0:
            raise ValueError("overload_factor must be >= 1")
        self.num_ranks = num_ranks
        self.policy = policy
        self.overload_factor = overload_factor
        self.overload_min_tokens = overload_min_tokens
        self.load = [0] * num_ranks  # queued + running tokens per rank
        self.requests = [0] * num_ranks  # in-flight requests per rank
        self.alive = [True] * num_ranks
        self._next_tie = 0  # where the round-robin among equally loaded ranks resumes
        self.decisions: Counter[str] = Counter({d: 0 for d in DECISIONS})
        # The same decisions by (reason, rank), for the per-rank router metric.
        self.decisions_by_rank: Counter[tuple[str, int]] = Counter()

    # ---- state -----------------------------------------------------------------------------
    def started(self, rank: int, tokens: int) -> None:
        self.load[rank] += tokens
        self.requests[rank] += 1

    def finished(self, rank: int, tokens: int) -> None:
        self.load[rank] = max(0, self.load[rank] - tokens)
        self.requests[rank] = max(0, self.requests[rank] - 1)

    def mark_dead(self, rank: int) -> None:
        self.alive[rank] = False

    def mark_alive(self, rank: int) -> None:
        self.alive[rank] = True

    def live_ranks(self) -> list[int]:
        return [r for r in range(self.num_ranks) if self.alive[r]]

    def dead_ranks(self) -> list[int]:
        return [r for r in range(self.num_ranks) if not self.alive[r]]

    # ---- decisions -------------------------------------------------------------------------
    def _live(self) -> list[int]:
        live = self.live_ranks()
        if not live:
            raise NoLiveRankError(f"no live engine rank: all {self.num_ranks} rank(s) are dead")
        return live

    def _least_loaded(self, live: list[int]) -> int:
        best = min((self.load[r], self.requests[r]) for r in live)
        tied = [r for r in live if (self.load[r], self.requests[r]) == best]
        chosen = next((r for r in tied if r >= self._next_tie), tied[0])
        self._next_tie = chosen + 1
        return chosen

    def home(self, key: str) -> int:
        """The rank `key` hashes to when every rank is alive."""
        return max(range(self.num_ranks), key=lambda r: _score(key, r))

    def reserve(self, key: str, prompt_tokens: int = 0) -> Route:
        """Pick a rank and count the request there at once, so that requests routed before
        this one starts still see its load."""
        rank = self.pick(key, prompt_tokens)
        self.started(rank, prompt_tokens)
        return Route(rank, prompt_tokens, self)

    def _decide(self, reason: str, rank: int) -> int:
        self.decisions[reason] += 1
        self.decisions_by_rank[reason, rank] += 1
        return rank

    def pick(self, key: str, prompt_tokens: int = 0) -> int:
        """The rank for a request with affinity `key` and `prompt_tokens` prompt tokens.

        Does not count the request as started: call :meth:`started` once it is sent."""
        live = self._live()
        if self.policy == "least-loaded" or not key:
            return self._decide("least_loaded", self._least_loaded(live))
        chosen = max(live, key=lambda r: _score(key, r))
        # The mean over the *other* live ranks: over all of them (the chosen one included) a
        # single busy rank could never exceed 2x the mean with two ranks.
        others = [r for r in live if r != chosen]
        mean = sum(self.load[r] for r in others) / len(others) if others else 0.0
        if others and \
                self.load[chosen] > self.overload_factor * mean + self.overload_min_tokens:
            fallback = self._least_loaded(live)
            if fallback != chosen:
                return self._decide("fallback_overloaded", fallback)
        if len(live) < self.num_ranks and self.home(key) != chosen:
            return self._decide("rerouted_dead", chosen)
        return self._decide("affinity", chosen)
