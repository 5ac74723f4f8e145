"""What one API request may ask for: the server's own limits (defaults of their CLI flags).

Each bound keeps one request from holding the API process or a rank for long: `n` samples and
prompts per request multiply the work, stop strings are checked at every token, and a body is
parsed whole before anything is validated.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = 16  # samples per prompt (the `n` field)
    max_prompts: int = 64  # prompts in one /v1/completions request
    max_stop: int = 16  # stop strings (and, separately, stop token ids) per request
    max_body_mb: float = 16.0  # request body; a 160K-token prompt is about 0.7 MB of text

    def __post_init__(self) -> None:
        if min(self.max_n, self.max_prompts, self.max_stop) < 1 or self.max_body_mb <= 0:
            raise ValueError("request limits must be positive")

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * (1 << 20))
