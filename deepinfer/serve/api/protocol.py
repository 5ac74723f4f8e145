"""OpenAI request bodies (pydantic), and their translation into SamplingParams."""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deepinfer.core.sampling import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    SamplingParams,
    StructuredOutput,
)
from deepinfer.serve.grammar.structured_fields import (
    StructuredOutputs,
    requested_constraint,
    structural_tag_text,
)

MAX_NESTING = 64  # JSON depth of a body; deeper ones would only exhaust recursion downstream
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]  # token counts and ids: int32 range
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
_TOKEN_KEY = re.compile(r"[0-9]{1,10}")  # a logit_bias key: a token id in decimal digits


_SCALARS = {int, float, bool, type(None)}  # what json.loads makes besides str, list, dict


def check_json_value(value: Any) -> None:
    """Refuse what JSON can carry but text cannot: lone surrogates (\\ud800 escapes) in any
    string, and nesting past MAX_NESTING. Iterative, so no depth can exhaust the stack."""
    stack: list[tuple[Any, str, int]] = [(value, "body", 0)]
    while stack:
        item, where, depth = stack.pop()
        if depth > MAX_NESTING:
            raise ValueError(f"the body nests deeper than {MAX_NESTING} levels")
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"{where} is not valid Unicode text (a lone surrogate)") \
                    from None
        elif isinstance(item, dict):
            stack.extend((v, f"{where}.{k}" if where != "body" else str(k), depth + 1)
                         for k, v in item.items())
            stack.extend((k, f"a key in {where}", depth + 1) for k in item)
        elif isinstance(item, list):
            if set(map(type, item)) <= _SCALARS:
                # Token ids: nothing to check past the depth, and no Python per element (a
                # label per id is the whole check's cost on a long prompt).
                if item and depth + 1 > MAX_NESTING:
                    raise ValueError(f"the body nests deeper than {MAX_NESTING} levels")
                continue
            stack.extend((v, f"{where}.{i}", depth + 1) for i, v in enumerate(item))


class _Body(BaseModel):
    # Fields the model does not hold are kept (model_extra) for serve/api/request_fields.py to
    # judge: a known field asking nothing this server does is accepted, others are refused.
    # Infinity and NaN (which Python's JSON reader accepts) are never valid numbers here.
    # Strict: a string is not a number and a number is not a bool ("2" for n, true for
    # temperature, [true, false] as token ids are refused, not converted); ints still fill
    # float fields.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        check_json_value(data)
        return data


class _Request(_Body):
    model: str | None = None
    n: int = Field(1, ge=1, le=INT32_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[Count] | None = None
    # As OpenAI sends it: token ids as JSON object keys (strings) -> a bias in [-100, 100].
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: Annotated[list[Count], Field(min_length=1)] | None = None
    seed: Seed | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: Count = 0
    stream: bool = False
    stream_options: "StreamOptions | None" = None
    user: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prefix_cache: bool = True  # False: this request neither reuses nor leaves cached pages
    # vLLM's extensions and OpenAI fields that act here (docs/compatibility.md)
    return_token_ids: bool = False  # token ids beside the text: choices' and the prompt's
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)  # the last k; -1: all
    truncation_side: Literal["left", "right"] | None = None  # "right": keep the first k instead
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: str | None = None
    cache_salt: str | None = Field(None, min_length=1)  # isolates the request's prefix cache
    prompt_cache_key: str | None = None  # pins a conversation to a rank, as `user` does
    # Each prompt token's logprob, rank and this many top alternatives, in the response (a
    # whole body's field: not with stream, as in vLLM; request_fields.check_together).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def uses_prefix_cache(self) -> bool:
        """A salted request shares no cached pages: this server keeps no cache per salt, so
        it neither reuses nor leaves any (stronger isolation than one cache per salt)."""
        return self.prefix_cache and self.cache_salt is None

    def constraint(self) -> StructuredOutput | None:
        return requested_constraint(self)[0]

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """`defaults` (the checkpoint's generation config) fill the fields left unset."""
        base = SamplingParams()
        fill = {**{k: getattr(base, k) for k in _DEFAULTED}, **(defaults or {})}

        def pick(name: str) -> Any:
            value = getattr(self, name)
            return fill[name] if value is None else value

        return SamplingParams(
            n=self.n, max_tokens=max_tokens, temperature=pick("temperature"),
            top_p=pick("top_p"), top_k=pick("top_k"), min_p=pick("min_p"), seed=self.seed,
            min_tokens=self.min_tokens, stop=self.stop_list(),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            presence_penalty=pick("presence_penalty"),
            frequency_penalty=pick("frequency_penalty"),
            repetition_penalty=pick("repetition_penalty"), logit_bias=self.token_bias(),
            allowed_token_ids=self.allowed_token_ids, logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens)

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not _TOKEN_KEY.fullmatch(key):
                raise ValueError(f"logit_bias keys must be token ids (digits), got {key!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}], got {bias} for token {key}")
        return v

    def token_bias(self) -> dict[int, float] | None:
        """logit_bias with its keys as the token ids they spell."""
        return None if self.logit_bias is None else \
            {int(key): bias for key, bias in self.logit_bias.items()}


# The sampling fields a request may leave unset (None) to take the server's default.
_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
              "frequency_penalty", "repetition_penalty")


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; refused when true (request_fields.py)
    include_obfuscation: bool | None = None  # OpenAI's padding of chunks: none here


class FunctionDef(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: dict[str, str]


class ResponseFormat(BaseModel):
    # Extra keys are a structural tag's (vLLM's type "structural_tag": format, or the older
    # structures and triggers).
    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema", "structural_tag"] = "text"
    json_schema: dict[str, Any] | None = None

    def constraint(self) -> StructuredOutput | None:
        if self.type == "structural_tag":
            return StructuredOutput("structural_tag", structural_tag_text(
                {"type": "structural_tag", **(self.model_extra or {})}))
        if self.type == "json_object":
            return StructuredOutput("json_object")
        if self.type == "json_schema":
            schema = (self.json_schema or {}).get("schema")
            if not isinstance(schema, dict):
                raise ValueError("response_format.json_schema.schema must be a JSON schema object")
            return StructuredOutput("json_schema", json.dumps(schema))
        return None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v: Any) -> Any:
        for part in v if isinstance(v, list) else ():
            kind = part.get("type")
            if kind != "text":
                raise ValueError(f"content part type {kind!r} is not supported: this model "
                                 "takes text only")
            if not isinstance(part.get("text"), str):
                raise ValueError("a text content part needs a string `text`")
        return v

    def for_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        # An assistant turn that only called tools has no content (null or absent); templates
        # read message['content'] all the same.
        message.setdefault("content", "")
        if isinstance(self.content, list):  # text parts only: this server serves text models
            message["content"] = "".join(p.get("text", "") for p in self.content
                                         if p.get("type") == "text")
        for call in message.get("tool_calls", []):
            # Templates index arguments as a mapping; OpenAI clients send a JSON string.
            fn = call.get("function", {})
            if isinstance(fn.get("arguments"), str):
                import json

                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    pass
        return message


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's chat extensions
    continue_final_message: bool = False  # the last message is left open to be continued
    echo: bool = False  # the last message's content leads the answer when its role is the reply's
    add_special_tokens: bool = False  # BOS etc. on top of what the template renders
    documents: list[dict[str, str]] | None = None  # for templates that render RAG documents
    reasoning_effort: str | None = None  # a template variable, for templates that read it

    @field_validator("top_logprobs")
    @classmethod
    def _top(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= 20:
            raise ValueError("top_logprobs must be between 0 and 20")
        return v

    def to_sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        params = self.sampling_params(max_tokens, logprobs, defaults)
        params.structured = self.constraint()
        return params


class CompletionRequest(_Request):
    # Token ids first: smart-mode unions try members in order, and a long id prompt tried as
    # list[str] first pays for a failed match per element; a match is the same either way.
    prompt: list[int] | str | list[str] | list[list[int]]
    max_tokens: Count | None = 16
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    response_format: ResponseFormat | None = None
    add_special_tokens: bool = True  # BOS etc. before a text prompt

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)

    def to_sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        params = self.sampling_params(self.max_tokens, self.logprobs, defaults)
        if self.echo and self.logprobs is not None and params.prompt_logprobs is None:
            # The echoed prompt's tokens carry logprobs too (as vLLM does).
            params = dataclasses.replace(params, prompt_logprobs=self.logprobs)
        params.structured = self.constraint()
        return params


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    # vLLM's: the chat rendered as /v1/chat/completions renders it, and the tokens' strings
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Count]
