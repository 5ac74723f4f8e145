"""DeepSeek-V4: tool calls in DSML, read by serve/chat/dsml_parser.py (reasoning, content and calls,
streamed parameter by parameter). A forced call is the whole answer, shaped by xgrammar's
structural tag for the format (reasoning first in thinking mode, then the tool-calls block);
nothing opens the turn. The answer is read this way with or without tools: its reasoning is
split off all the same.
"""
from __future__ import annotations

from typing import Any

from deepinfer.core.sampling import StructuredOutput
from deepinfer.serve.chat.dsml_parser import DsmlMode, DsmlParser, finish_reason
from deepinfer.serve.chat.tool_parsers.base import (
    CallStream,
    ForcedShape,
    OutputReader,
    ToolParser,
    ToolRequest,
    forced_tools,
    named_function,
)


class DeepSeekV4Parser(ToolParser):
    name = "deepseek_v4"

    def constraint(self, tools: list[dict], tool_choice: Any,
                   shape: ForcedShape) -> StructuredOutput:
        try:
            import xgrammar as xgr
        except ImportError as exc:  # an optional extra
            raise ValueError("forced tool calls need xgrammar: pip install "
                             "'deepinfer[structured]'") from exc
        tag = xgr.get_model_structural_tag(
            "deepseek_v4", tools=forced_tools(tools, tool_choice), tool_choice="required",
            reasoning="enabled" if shape.thinking else "disabled",
            parallel_tool_calls=shape.parallel and named_function(tool_choice) is None)
        return StructuredOutput("structural_tag", tag.model_dump_json())

    def reader(self, request: ToolRequest) -> OutputReader:
        return _DsmlReader(DsmlMode(request.thinking, request.use_tools))


class _DsmlReader(OutputReader):
    def __init__(self, mode: DsmlMode) -> None:
        self.mode = mode

    def stream(self) -> CallStream:
        return _DsmlStream(self.mode.parser())

    def message(self, text: str, engine_reason: str | None) -> tuple[dict, str | None]:
        parsed = self.mode.parse(text)
        return parsed.message(), finish_reason(len(parsed.tool_calls), engine_reason)


class _DsmlStream(CallStream):
    def __init__(self, parser: DsmlParser) -> None:
        self.parser = parser

    def deltas(self, text: str, finished: bool = False,
               engine_reason: str | None = None) -> list[dict]:
        return self.parser.deltas(text, finished)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return finish_reason(self.parser.num_calls, engine_reason)
