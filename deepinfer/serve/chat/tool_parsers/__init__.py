"""Tool-call parsers, one per chat-format family (see base.py for the interface)."""
from __future__ import annotations

from deepinfer.serve.chat.tool_parsers.base import (
    CallStream,
    ForcedShape,
    OutputReader,
    ToolParser,
    ToolRequest,
    is_forced,
    named_function,
)
from deepinfer.serve.chat.tool_parsers.deepseek_v3 import DeepSeekV3Parser
from deepinfer.serve.chat.tool_parsers.deepseek_v4 import DeepSeekV4Parser
from deepinfer.serve.chat.tool_parsers.detect import chat_template, detect
from deepinfer.serve.chat.tool_parsers.hermes import HermesParser
from deepinfer.serve.chat.tool_parsers.llama3_json import Llama3JsonParser
from deepinfer.serve.chat.tool_parsers.mistral import MistralParser

PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesParser, Llama3JsonParser, MistralParser, DeepSeekV3Parser, DeepSeekV4Parser)}
CHOICES = ("auto", *PARSERS)

__all__ = ["CHOICES", "PARSERS", "CallStream", "ForcedShape", "OutputReader", "ToolParser",
           "ToolRequest", "find_parser", "is_forced", "named_function"]


def find_parser(model_dir: str, requested: str = "auto") -> tuple[ToolParser, str]:
    """The checkpoint's parser (`requested`, or found from its files) and why, for the log."""
    if requested == "auto":
        name, why = detect(model_dir)
    elif requested in PARSERS:
        name, why = requested, "--tool-call-parser"
    else:
        raise ValueError(f"unknown tool-call parser {requested!r}; one of {CHOICES}")
    return PARSERS[name].of(chat_template(model_dir)), why
