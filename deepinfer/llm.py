"""Offline API: LLM(model=...).generate(prompts, SamplingParams) and .chat(messages)."""
from __future__ import annotations

import dataclasses
import itertools
import numbers
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field
from typing import Any, Sequence, TypedDict

from deepinfer.core.batch import TokenLogprobs
from deepinfer.core.config import EngineConfig, check_option_names, engine_config_from_options
from deepinfer.core.engine import Engine
from deepinfer.core.sampling import SamplingParams
from deepinfer.models.default_model import resolve_model_path


class TextPrompt(TypedDict):
    """vLLM's text prompt dict."""

    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's token prompt dict."""

    prompt_token_ids: list[int]


# LLM's keywords besides the engine options (listed in the unknown-option error).
LLM_OWN_OPTIONS = ("load_tokenizer",)

Prompt = str | Sequence[int] | TextPrompt | TokensPrompt
_PROMPT_FORMS = ("a str, a list of int token ids, {'prompt': str} or "
                 "{'prompt_token_ids': list[int]}")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass
class GenerateOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: vLLM's RequestOutput.prompt_logprobs, one entry per
    # prompt token, None for the first; None when not asked for.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


def llm_engine_config(model_path: str, **options: Any) -> EngineConfig:
    """The EngineConfig LLM(model_path, **options) runs (model_path as is, not resolved);
    an unknown option is a TypeError that names it and lists the valid ones."""
    check_option_names(options, extra=LLM_OWN_OPTIONS)
    return engine_config_from_options(model_path, **options)


class LLM:
    """One Engine in this process. `options` are the engine settings by their config field
    names (dtype, block_size, num_blocks, hicache_size_gb, max_num_seqs, seed, ...: every
    field that `deepinfer-serve` has a flag for; see `deepinfer.core.config.engine_options`)."""

    def __init__(self, model: str | None = None, *, load_tokenizer: bool = True,
                 **options: Any) -> None:
        # Built (and so checked) before the model is resolved: a bad option must not wait for
        # the default model's download or a .gguf conversion.
        config = llm_engine_config(model or "", **options)
        if config.parallel.world_size > 1:
            raise ValueError(f"LLM runs one engine in this process (dp={config.parallel.dp} "
                             "asks for more); run deepinfer-serve --dp for data parallel ranks")
        model_spec = dataclasses.replace(config.model, path=resolve_model_path(model))
        self.engine = Engine(dataclasses.replace(config, model=model_spec),
                             load_tokenizer=load_tokenizer)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prefix_cache: bool = True) -> list[GenerateOutput]:
        """`prompts`: one prompt or a list of them, each a str, a list of token ids, or vLLM's
        {"prompt": str} / {"prompt_token_ids": list[int]}; anything else is a TypeError."""
        prompt_list = _as_prompt_list(prompts)
        params = sampling_params or SamplingParams()
        param_list = [params] * len(prompt_list) if isinstance(params, SamplingParams) \
            else list(params)
        if len(param_list) != len(prompt_list):
            raise ValueError("need one SamplingParams per prompt")
        order = []
        for prompt, p in zip(prompt_list, param_list):
            rid = str(next(self._ids))
            self.engine.add_request(rid, prompt, p, prefix_cache=prefix_cache)
            order.append(rid)
        return self._run(order)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None, tools: list[dict] | None = None,
             add_generation_prompt: bool = True, **template_kwargs: Any) -> list[GenerateOutput]:
        """Render each conversation with the checkpoint's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(
            conv, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False,
            **template_kwargs) for conv in conversations]
        # The template already holds BOS where the model wants it: encode without adding more.
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(ids, sampling_params)

    def _run(self, order: list[str]) -> list[GenerateOutput]:
        results: dict[str, GenerateOutput] = {}
        logprobs: dict[tuple[str, int], list[TokenLogprobs]] = {}
        prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}
        failed: dict[str, str] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.error is not None:  # its batch mates go on; raised once all are done
                    failed[out.request_id] = out.error
                    continue
                key = (out.request_id, out.index)
                logprobs.setdefault(key, []).extend(out.new_logprobs)
                if out.prompt_logprobs is not None:  # every sample scores the same prompt
                    prompt_logprobs.setdefault(out.request_id, out.prompt_logprobs)
                if not out.finished:
                    continue
                result = results.setdefault(out.request_id, GenerateOutput(
                    out.request_id, out.prompt_token_ids, [], out.num_cached_tokens,
                    prompt_logprobs.get(out.request_id)))
                result.outputs.append(CompletionOutput(
                    out.index, out.text, list(out.token_ids), out.finish_reason,
                    out.stop_reason, logprobs.pop(key)))
        if failed:
            rid, error = next(iter(failed.items()))
            raise RuntimeError(f"{len(failed)} of {len(order)} request(s) failed in the engine; "
                               f"{rid}: {error}")
        for result in results.values():
            result.outputs.sort(key=lambda c: c.index)
        return [results[rid] for rid in order]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[str | list[int]]:
    """One prompt or a list of them, each as the engine takes it (text or token ids). Every
    prompt is checked here, before any is added: a bad one must not leave its batch mates
    queued in the engine, nor reach it as an int() error deep inside."""
    if isinstance(prompts, (str, Mapping)):
        return [_one_prompt(prompts, "prompt")]
    if not isinstance(prompts, Iterable):
        raise TypeError(f"prompts must be {_PROMPT_FORMS}, or a list of them; "
                        f"got {type(prompts).__name__}")
    items = list(prompts)
    if items and isinstance(items[0], numbers.Number):  # one prompt given as token ids
        return [_token_ids(items, "prompt")]
    return [_one_prompt(p, f"prompt {i}") for i, p in enumerate(items)]


def _one_prompt(prompt: Any, where: str) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        return _dict_prompt(prompt, where)
    # Any ordered iterable of ints (list, tuple, range, a numpy array); not bytes or a set.
    if isinstance(prompt, Iterable) and not isinstance(prompt, (bytes, bytearray, Set)):
        return _token_ids(list(prompt), where)
    raise TypeError(f"{where} must be {_PROMPT_FORMS}; got {type(prompt).__name__}")


def _dict_prompt(prompt: Mapping, where: str) -> str | list[int]:
    """vLLM's TextPrompt / TokensPrompt. Their other keys (multi_modal_data, cache_salt, ...)
    are refused rather than ignored: the output would silently not be what was asked."""
    keys = set(prompt)
    if keys == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    if keys == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], Iterable) \
            and not isinstance(prompt["prompt_token_ids"], (str, bytes, Mapping)):
        return _token_ids(list(prompt["prompt_token_ids"]), f"prompt_token_ids of {where}")
    shown = {k: type(v).__name__ for k, v in prompt.items()}
    raise TypeError(f"{where}: a dict prompt must be exactly {{'prompt': str}} or "
                    f"{{'prompt_token_ids': list[int]}}; got keys and value types {shown}")


def _token_ids(ids: list[Any], where: str) -> list[int]:
    # bool is an int subclass, but True/False as token ids is certainly a mistake.
    bad = next((i for i, t in enumerate(ids)
                if not isinstance(t, numbers.Integral) or isinstance(t, bool)), None)
    if bad is not None:
        raise TypeError(f"{where}: token ids must be ints; item {bad} is "
                        f"{type(ids[bad]).__name__} {ids[bad]!r}")
    return [int(t) for t in ids]
