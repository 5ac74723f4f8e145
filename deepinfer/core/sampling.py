"""SamplingParams: what a request asks of the sampler. Validated at construction so that bad
user input becomes a ValueError (HTTP 400 in the server), never a dead engine."""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
INT32_MAX = 2**31 - 1  # counts and token ids: more than any vocabulary or context holds
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 2.0
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values: [-100, 100]
STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "ebnf", "structural_tag")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output text: any JSON object, a JSON schema, a regex, an EBNF
    grammar or an xgrammar structural tag (spec holds the schema as JSON text, the regex, the
    grammar or the tag as JSON text)."""

    kind: str
    spec: str = ""
    # json_schema only: JSON without free whitespace (one space after ':' and ',', as
    # json.dumps writes it). Forced tool calls use it: a model may otherwise spend its tokens
    # on whitespace between JSON tokens. response_format keeps JSON's free whitespace.
    compact: bool = False

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {STRUCTURED_KINDS}")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"structured output {self.kind!r} needs a spec")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Token id -> added to its logit after the penalties, in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]
    # (OpenAI's logit_bias: -100 bans a token in practice, +100 forces it).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # sample only among these ids (vLLM's field)
    logprobs: int | None = None  # number of top logprobs besides the sampled token
    # Per prompt token after the first: its logprob given the tokens before it, its rank and
    # this many top alternatives (None: off). Such a request computes its whole prompt.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        self._check_token_fields()

    def _validate(self) -> None:
        self._check_types()
        checks = [
            (1 <= self.n <= INT32_MAX, f"n must be >= 1, got {self.n}"),
            (0.0 <= self.temperature < math.inf,
             f"temperature must be finite and >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.top_k <= INT32_MAX,
             f"top_k must be -1, 0 or a positive int32, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.max_tokens is None or 1 <= self.max_tokens <= INT32_MAX,
             f"max_tokens must be >= 1, got {self.max_tokens}"),
            (0 <= self.min_tokens <= INT32_MAX, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.seed is None or INT64_MIN <= self.seed <= INT64_MAX,
             f"seed must be a 64-bit integer, got {self.seed}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"),
            (-2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            # Far from 1 the penalty overflows float32 logits (1e-300 divides them to inf).
            (MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
             f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, "
             f"{MAX_REPETITION_PENALTY}], got {self.repetition_penalty}"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty"),
            (all(isinstance(t, int) and 0 <= t <= INT32_MAX for t in self.stop_token_ids),
             "stop_token_ids must be non-negative int32 integers"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def _check_types(self) -> None:
        """Numbers must be numbers: a NaN passes no range check, a bool or str must not
        reach the sampler's tensors."""
        ints: dict[str, int | None] = {"n": self.n, "top_k": self.top_k,
                "min_tokens": self.min_tokens, "max_tokens": self.max_tokens, "seed": self.seed,
                "logprobs": self.logprobs, "prompt_logprobs": self.prompt_logprobs}
        for name, value in ints.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        floats: dict[str, float | None] = {
            "temperature": self.temperature, "top_p": self.top_p, "min_p": self.min_p,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty}
        for name, number in floats.items():
            if isinstance(number, bool) or not isinstance(number, (int, float)) \
                    or not math.isfinite(number):
                raise ValueError(f"{name} must be a finite number, got {number!r}")

    def _check_token_fields(self) -> None:
        """logit_bias and allowed_token_ids hold int32 token ids (whether the model has them is
        the engine's to check); biases are finite numbers within OpenAI's range. Normalized
        to a plain dict of floats and a plain list, an empty bias to None."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise ValueError(f"logit_bias must map token ids to biases, got "
                                 f"{type(self.logit_bias).__name__}")
            bias = dict(self.logit_bias)
            for token, value in bias.items():
                if not _is_token_id(token):
                    raise ValueError(f"logit_bias keys must be non-negative int32 token ids, "
                                     f"got {token!r}")
                # A NaN fails the range check too.
                if isinstance(value, bool) or not isinstance(value, (int, float)) \
                        or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                    raise ValueError(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                                     f"{MAX_LOGIT_BIAS:g}], got {value!r} for token {token}")
            self.logit_bias = {token: float(value) for token, value in bias.items()} or None
        if self.allowed_token_ids is not None:
            if isinstance(self.allowed_token_ids, (str, bytes, Mapping)) \
                    or not isinstance(self.allowed_token_ids, Iterable):
                raise ValueError("allowed_token_ids must be a list of token ids")
            allowed = list(self.allowed_token_ids)
            if not allowed:
                raise ValueError("allowed_token_ids must not be empty")
            if not all(map(_is_token_id, allowed)):
                raise ValueError("allowed_token_ids must be non-negative int32 token ids")
            self.allowed_token_ids = allowed

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def adjusts_logits(self) -> bool:
        """A logit_bias or allowed_token_ids: the raw logits' argmax may not be the token."""
        return self.logit_bias is not None or self.allowed_token_ids is not None


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= INT32_MAX
