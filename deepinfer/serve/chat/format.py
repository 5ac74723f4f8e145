"""Chat rendering with the checkpoint's own template, and the checkpoint's tool-call parser.

How tool calls look is the family's (serve/chat/tool_parsers/): Hermes/Qwen's <tool_call> JSON,
Llama 3's JSON, Mistral's [TOOL_CALLS], DeepSeek-V3's fenced calls, DeepSeek-V4's DSML. For
tool_choice "required" or a named function the parser may open the assistant turn with the
start of a call (Hermes: <tool_call>), so the model can only complete a call; the forced text
is put back in front of the output before it is read.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from deepinfer.serve.chat import deepseek_encoding
from deepinfer.serve.chat.tool_parsers import ToolParser, find_parser, is_forced
from deepinfer.serve.chat.tool_parsers.hermes import HermesParser

log = logging.getLogger("deepinfer.serve")


@dataclass(frozen=True)
class RenderedChat:
    prompt: str
    forced_prefix: str  # text the assistant turn was opened with (part of the output)


@dataclass(frozen=True)
class ChatFormat:
    """How a checkpoint's chats are rendered and read back, found once when the server starts
    (not per request): its own encoding.py when the user trusts the folder's code (ours for
    DeepSeek-V4), else the tokenizer's Jinja template (encoder None); dsml: it answers in
    DeepSeek's DSML; tool_parser: how its tool calls are read and forced."""

    encoder: Any = None
    dsml: bool = False
    source: str = "the tokenizer's chat template"  # what renders, for the start-up log
    tool_parser: ToolParser = field(default_factory=HermesParser)
    parser_reason: str = "the default"  # why this parser, for the start-up log

    @classmethod
    def of(cls, model_dir: str, trust_remote_code: bool = False,
           tool_call_parser: str = "auto") -> "ChatFormat":
        dsml = deepseek_encoding.uses_dsml(model_dir)
        parser, why = find_parser(model_dir, tool_call_parser)
        path = os.path.join(model_dir, "encoding.py")
        if os.path.exists(path) and trust_remote_code:
            return cls(_load_encoding(path), dsml, f"{path} (--trust-remote-code)", parser, why)
        if dsml:
            # DeepSeek-V4 checkpoints ship their encoder and no usable Jinja template: ours
            # renders the same prompts without running the folder's code.
            return cls(deepseek_encoding, dsml, "DeepInfer's DeepSeek-V4 encoding", parser, why)
        return cls(None, dsml, tool_parser=parser, parser_reason=why)

    def describe(self, model_dir: str) -> str:
        """The start-up log line: which renderer and tool-call parser, and why a shipped
        encoder is not the renderer."""
        skipped = os.path.exists(os.path.join(model_dir, "encoding.py")) and \
            not self.source.endswith("(--trust-remote-code)")
        return f"chat format: {self.source}" + (
            "; the model folder's encoding.py is not run (pass --trust-remote-code to use it)"
            if skipped else "") + \
            f"; tool calls: {self.tool_parser.describe()} ({self.parser_reason})"


def render_chat(tokenizer: Any, chat: ChatFormat, messages: list[dict], tools: list[dict] | None,
                tool_choice: Any, add_generation_prompt: bool = True,
                template_kwargs: dict | None = None, continue_final: bool = False,
                documents: list[dict] | None = None) -> RenderedChat:
    """`continue_final`: the last message is left open (no end of turn after its content), so
    the model continues it; `documents`: for templates that render RAG documents."""
    if tool_choice == "none":
        tools = None
    encoder = chat.encoder
    if encoder is not None:
        # DeepSeek checkpoints ship encoding.py: their renderer wins over any Jinja template.
        if documents:
            raise ValueError("documents are rendered by chat templates; this model's chat "
                             "format takes none")
        prompt = encoder.encode_messages(messages, tools=tools, **(template_kwargs or {}))
        if continue_final:
            prompt = open_final_message(prompt, messages[-1].get("content") or "")
    else:
        if tokenizer.chat_template is None:
            raise ValueError("this model has no chat template; use /v1/completions")
        if "tool_calls" not in str(tokenizer.chat_template):
            messages = [_calls_as_text(m, chat.tool_parser) for m in messages]
        extra = {"documents": documents} if documents else {}
        prompt = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final, tokenize=False, **extra,
            **(template_kwargs or {}))
    forced = chat.tool_parser.forced_prefix(tools, tool_choice) \
        if tools and is_forced(tool_choice) else ""
    return RenderedChat(prompt + forced, forced)


def open_final_message(prompt: str, final: str) -> str:
    """The prompt cut right after the final message's content, as transformers'
    continue_final_message cuts a template's output (templates that strip messages: the
    stripped content)."""
    for text in (final, final.strip()):
        at = prompt.rfind(text) if text else -1
        if at >= 0:
            return prompt[:at + len(text)]
    raise ValueError("continue_final_message needs a final message whose content the "
                     "rendered chat contains")


def _calls_as_text(message: dict, parser: ToolParser) -> dict:
    """An assistant turn's tool calls written into its content as the parser reads them, for a
    template that renders no tool_calls: an agent's earlier calls stay in the prompt instead
    of vanishing."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    text = parser.write_calls(calls)
    content = message.get("content") or ""
    return {**message, "content": f"{content}\n{text}" if content else text}


def _load_encoding(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("deepinfer_checkpoint_encoding", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "encode_messages"):
        raise ValueError(f"{path} defines no encode_messages(messages, tools=...)")
    return module
