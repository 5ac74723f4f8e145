"""Every request field a client may send, and what this server does with it.

A field the request model holds (serve/api/protocol.py) is implemented. Every other name a body
carries is looked up here, in one table per endpoint (docs/compatibility.md is its prose):

* a Rule: a field of OpenAI's or vLLM's API that this server does not act on. Values that ask
  for nothing this server would have to do (`store: false`, `modalities: ["text"]`,
  `metadata`, ...) are accepted and have no effect; any other value is a 400 naming the field
  and saying why.
* no entry: a name neither OpenAI nor vLLM defines. It is a 400 naming it, unless the server
  runs with --ignore-unknown-fields (UnknownFields): then it is ignored and logged once.

A rule is consulted only while its name is not a field of the request model, so a field that
gains an implementation simply becomes a field.
Further checks tie fields together (stream_options without stream, ...), as vLLM makes them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from pydantic import BaseModel

from deepinfer.serve.api.errors import APIError
from deepinfer.serve.grammar.structured_fields import declared

log = logging.getLogger("deepinfer.serve")

Accepts = Callable[[Any, BaseModel], bool]  # (the value, the whole body) -> no effect needed


@dataclass(frozen=True)
class Rule:
    """A field the server does not act on: values `accepts` passes have no effect here (`why`
    says why); any other value is refused with `refusal`."""

    why: str
    accepts: Accepts
    refusal: str = ""


def unset(value: Any, _body: BaseModel) -> bool:
    return value is None


def anything(_value: Any, _body: BaseModel) -> bool:
    return True


def one_of(*values: Any) -> Accepts:
    """None, or one of `values` (compared as JSON: 1 == 1.0, True is not 1)."""
    return lambda v, _b: v is None or any(type(v) is type(w) and v == w or
                                          _is_number(v) and _is_number(w) and v == w
                                          for w in values)


def empty(value: Any, _body: BaseModel) -> bool:
    return value is None or value in ([], {})


def of_type(*types: type) -> Accepts:
    """None, or a value of `types` (a bool is not a number here, as in JSON)."""
    def accepts(value: Any, _body: BaseModel) -> bool:
        if value is None:
            return True
        return isinstance(value, types) and (bool in types or not isinstance(value, bool))
    return accepts


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _best_of(value: Any, body: BaseModel) -> bool:
    return value is None or _is_number(value) and value == getattr(body, "n", 1)


# ---- the tables ------------------------------------------------------------------------------
NOT_STORED = Rule("this server stores no completions", one_of(False),
                  "is not supported: this server stores no completions")
TEXT_ONLY = "is not supported: this server takes and generates text only"

# Fields both generation endpoints may carry.
_GENERATION: dict[str, Rule] = {
    # OpenAI
    "store": NOT_STORED,
    "metadata": Rule("kept with stored completions, and this server stores none",
                     of_type(dict), "must be an object"),
    "service_tier": Rule("this server has one service tier", of_type(str),
                         "must be a string"),
    "safety_identifier": Rule("an identifier for OpenAI's abuse monitoring",
                              of_type(str), "must be a string"),
    "prompt_cache_retention": Rule("pages stay in the prefix cache until evicted (LRU), "
                                   "whatever the retention asked", of_type(str),
                                   "must be a string"),
    "prompt_cache_options": Rule("pages stay in the prefix cache until evicted (LRU); "
                                 "prefixes are matched page by page, with no breakpoints",
                                 of_type(dict), "must be an object"),
    "best_of": Rule("best_of equal to n returns every sample, as n does", _best_of,
                    "other than n is not supported: this server returns every sample it "
                    "draws (best_of must equal n)"),
    # vLLM
    "use_beam_search": Rule("sampling is the default", one_of(False),
                            "is not supported: this server does not run beam search"),
    "length_penalty": Rule("it applies to beam search only", one_of(1.0),
                           "is not supported: it applies to beam search, which this server "
                           "does not run"),
    "bad_words": Rule("an empty list bans nothing", empty, "is not supported by this server"),
    "spaces_between_special_tokens": Rule(
        "outputs decode as the checkpoint's tokenizer decodes them; a fast tokenizer (the "
        "usual kind) has no such option, so in vLLM too the value changes nothing there",
        of_type(bool), "must be a bool"),
    "priority": Rule("requests are scheduled first come, first served", one_of(0),
                     "is not supported: this server has no priority scheduling (0 only)"),
    "request_id": Rule("responses carry the server's own id", of_type(str),
                       "must be a string"),
    "logits_processors": Rule("", empty, "is not supported: this server runs no "
                                         "client-named logits processors"),
    "return_tokens_as_token_ids": Rule("", one_of(False), "is not supported by this server"),
    "kv_transfer_params": Rule("", empty, "is not supported: this server does no "
                                          "disaggregated prefill"),
    "vllm_xargs": Rule("", empty, "is not supported: this server has no request "
                                  "extensions"),
    "guided_decoding_backend": Rule("this server's structured outputs use xgrammar",
                                    one_of("xgrammar", "auto"),
                                    "is not served: this server's structured outputs use "
                                    "xgrammar"),
    "guided_whitespace_pattern": Rule("", unset, "is not supported by this server"),
    "mm_processor_kwargs": Rule("", empty, TEXT_ONLY),
    "media_io_kwargs": Rule("", empty, TEXT_ONLY),
}

CHAT: dict[str, Rule] = {
    **_GENERATION,
    "modalities": Rule("text is what this server generates", one_of(["text"]), TEXT_ONLY),
    "audio": Rule("", unset, TEXT_ONLY),
    "prediction": Rule("", unset, "is not supported: this server takes no predicted output"),
    "web_search_options": Rule("", unset, "is not supported: this server searches nothing"),
    "moderation": Rule("", unset, "is not supported: this server runs no moderation"),
    "verbosity": Rule("this server's models take no verbosity setting", of_type(str),
                      "must be a string"),
    "functions": Rule("", empty, "is deprecated and not supported: send `tools`"),
    "function_call": Rule("", unset, "is deprecated and not supported: send `tool_choice`"),
    "include_reasoning": Rule("reasoning is returned where the model's format has it",
                              one_of(True), "false is not supported by this server"),
    "chat_template": Rule("", unset, "is refused: a client's template would be arbitrary "
                                     "Jinja run in the server (the checkpoint's template "
                                     "renders; template variables go in "
                                     "chat_template_kwargs)"),
}

COMPLETION: dict[str, Rule] = {
    **_GENERATION,
    "prompt_embeds": Rule("", unset, "is not supported: prompts are text or token ids"),
}

TOKENIZE: dict[str, Rule] = {
    "chat_template": CHAT["chat_template"],
    "mm_processor_kwargs": _GENERATION["mm_processor_kwargs"],
}
DETOKENIZE: dict[str, Rule] = {}

# The tables by request model name (serve/api/protocol.py's classes).
TABLES: dict[str, dict[str, Rule]] = {
    "ChatCompletionRequest": CHAT, "CompletionRequest": COMPLETION,
    "TokenizeRequest": TOKENIZE, "DetokenizeRequest": DETOKENIZE,
}


# ---- unknown names ---------------------------------------------------------------------------
@dataclass
class UnknownFields:
    """What a name no table knows gets: a 400 (the default), or with `ignore`
    (--ignore-unknown-fields) nothing but one log line per name (at most MAX_LOGGED names, so
    a client inventing names cannot grow this)."""

    ignore: bool = False
    logged: set[str] = field(default_factory=set)
    MAX_LOGGED = 1024

    def handle(self, names: list[str]) -> None:
        if not names:
            return
        if not self.ignore:
            listed = ", ".join(f"`{n}`" for n in names[:8])
            raise APIError(f"unrecognized request field{'s' if len(names) > 1 else ''} "
                           f"{listed}: this server refuses fields it does not know rather "
                           "than ignore them (start it with --ignore-unknown-fields to "
                           "have them ignored)", param=names[0])
        for name in names:
            if name not in self.logged and len(self.logged) < self.MAX_LOGGED:
                self.logged.add(name)
                log.warning("ignoring the unknown request field %r (--ignore-unknown-fields); "
                            "it is not logged again", name)


# ---- the screening ---------------------------------------------------------------------------
def screen(body: BaseModel, unknown: UnknownFields) -> None:
    """Refuse (400) what the body asks that this server cannot do: a known field with a value
    it does not act on, an unknown field (unless ignored), fields that contradict each other."""
    table = TABLES.get(type(body).__name__, {})
    strangers = []
    for name, value in (body.model_extra or {}).items():
        rule = table.get(name)
        if rule is None:
            strangers.append(name)
        elif not rule.accepts(value, body):
            raise APIError(f"`{name}` {rule.refusal}", param=name)
    unknown.handle(strangers)
    check_together(body)


def check_together(body: BaseModel) -> None:
    """Fields whose values contradict each other (vLLM's and OpenAI's checks)."""
    options = declared(body, "stream_options")
    if options is not None and not body.stream:
        raise APIError("stream_options can only be given with stream: true",
                       param="stream_options")
    if options is not None and options.continuous_usage_stats:
        raise APIError("stream_options.continuous_usage_stats is not supported: usage comes "
                       "in the last chunk (include_usage)", param="stream_options")
    if declared(body, "continue_final_message") and declared(body, "add_generation_prompt"):
        raise APIError("continue_final_message and add_generation_prompt cannot both be true "
                       "(send add_generation_prompt: false to continue the final message)",
                       param="continue_final_message")
    if type(body).__name__ == "ChatCompletionRequest" and body.return_token_ids and body.stream:
        raise APIError("return_token_ids is served on streamed /v1/completions and on chat "
                       "without stream, not on a chat stream", param="return_token_ids")
    if declared(body, "prompt_logprobs") is not None and body.stream:
        raise APIError("prompt_logprobs are not available with stream: true (as in vLLM: "
                       "they come with the whole response)", param="prompt_logprobs")
    if declared(body, "top_logprobs") and not body.logprobs:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
