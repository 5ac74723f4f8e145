"""What one API request may ask for: the server's own limits (defaults of their CLI flags).

Each bound keeps one request from holding the API process or a rank for long: `n` samples and
prompts per request multiply the work, stop strings are checked at every token, logit_bias and
allowed_token_ids are applied at every step, and a body is parsed whole before anything is
validated. A constraint (response_format, a forced tool call) is compiled into a grammar whose
cost grows with its size and its alternatives: it is bounded before any compile, and the
compile itself by a time limit.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = 16  # samples per prompt (the `n` field)
    max_prompts: int = 64  # prompts in one /v1/completions request
    max_stop: int = 16  # stop strings (and, separately, stop token ids) per request
    max_body_mb: float = 16.0  # request body; a 160K-token prompt is about 0.7 MB of text
    max_tools: int = 512  # tools in one chat request
    max_schema_kb: int = 512  # a constraint's text (schema, regex, grammar, forced tools' schema)
    max_enum_values: int = 4096  # enum values and anyOf/oneOf branches in one constraint
    grammar_compile_timeout_s: float = 10.0  # one constraint's compile
    # logit_bias entries (and, separately, allowed_token_ids) per request; None: the
    # vocabulary's size. The sampler scatters each of them at every step of the request.
    max_biased_tokens: int | None = None

    def __post_init__(self) -> None:
        if min(self.max_n, self.max_prompts, self.max_stop, self.max_tools, self.max_schema_kb,
               self.max_enum_values) < 1 or min(self.max_body_mb,
                                                self.grammar_compile_timeout_s) <= 0:
            raise ValueError("request limits must be positive")
        if self.max_biased_tokens is not None and self.max_biased_tokens < 1:
            raise ValueError("request limits must be positive")

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * (1 << 20))
