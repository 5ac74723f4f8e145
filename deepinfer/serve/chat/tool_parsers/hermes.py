"""Hermes / Qwen2.5 / Qwen3: <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>.

The default where a checkpoint's template says nothing of tool calls. A forced call opens
the assistant turn with <tool_call>; the rest is the call's JSON object by its schema (a
model may still name "parameters" for "arguments"; both are read).
"""
from __future__ import annotations

import json
import re
from typing import Any

from deepinfer.core.sampling import StructuredOutput
from deepinfer.serve.chat.tool_parsers.base import ForcedShape, ToolRequest
from deepinfer.serve.chat.tool_parsers.json_calls import (
    Call,
    JsonCallParser,
    object_call,
    partial_object_call,
)
from deepinfer.serve.chat.tool_parsers.schema import calls_schema, compact_json

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_CLOSED = re.compile(re.escape(TOOL_OPEN) + "(.*?)" + re.escape(TOOL_CLOSE), re.DOTALL)


class HermesParser(JsonCallParser):
    name = "hermes"
    openers = (TOOL_OPEN,)

    def forced_prefix(self, tools: list[dict], tool_choice: Any) -> str:
        return TOOL_OPEN + "\n"

    def constraint(self, tools: list[dict], tool_choice: Any,
                   shape: ForcedShape) -> StructuredOutput:
        return compact_json(calls_schema(tools, tool_choice))

    def scan(self, region: str) -> tuple[list[str], str | None]:
        bodies, end = [], 0
        for match in _CLOSED.finditer(region):
            bodies.append(match.group(1))
            end = match.end()
        opened = region.find(TOOL_OPEN, end)
        return bodies, None if opened < 0 else region[opened + len(TOOL_OPEN):]

    def read(self, body: str, request: ToolRequest) -> Call | None:
        return object_call(body.strip(), request)

    def read_partial(self, body: str, request: ToolRequest) -> Call | None:
        return partial_object_call(body, request)

    def write_calls(self, calls: list[dict]) -> str:
        return "".join(f"{TOOL_OPEN}\n" + json.dumps(
            {"name": c.get("function", {}).get("name"),
             "arguments": c.get("function", {}).get("arguments", {})}) + f"\n{TOOL_CLOSE}"
            for c in calls)
