"""Llama 3.1+ JSON tool calls: {"name": ..., "parameters": {...}}, the whole answer, after
<|python_tag|> where the special tokens are kept (it is one; skipped by default, and Llama
3.1's template writes custom-tool calls without it). Several calls are separated by ';'.

A forced call opens nothing: the answer is the call's JSON object by its schema.
"""
from __future__ import annotations

import json
from typing import Any

from deepinfer.core.sampling import StructuredOutput
from deepinfer.serve.chat.tool_parsers.base import ForcedShape, ToolRequest
from deepinfer.serve.chat.tool_parsers.json_calls import (
    Call,
    JsonCallParser,
    json_objects,
    object_call,
    partial_object_call,
)
from deepinfer.serve.chat.tool_parsers.schema import calls_schema, compact_json

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(JsonCallParser):
    name = "llama3_json"
    openers = (PYTHON_TAG,)

    def leads(self, text: str, request: ToolRequest) -> bool | None:
        start = text.lstrip()
        if not start or PYTHON_TAG.startswith(start):
            return None
        return start.startswith("{")

    def constraint(self, tools: list[dict], tool_choice: Any,
                   shape: ForcedShape) -> StructuredOutput:
        return compact_json(calls_schema(tools, tool_choice, "parameters"))

    def scan(self, region: str) -> tuple[list[str], str | None]:
        text = region.lstrip()
        return json_objects(text.removeprefix(PYTHON_TAG), " \t\r\n;")

    def read(self, body: str, request: ToolRequest) -> Call | None:
        return object_call(body, request)

    def read_partial(self, body: str, request: ToolRequest) -> Call | None:
        return partial_object_call(body, request)

    def write_calls(self, calls: list[dict]) -> str:
        return "; ".join(json.dumps({"name": c["function"]["name"],
                                     "parameters": c["function"].get("arguments", {})})
                         for c in calls)
