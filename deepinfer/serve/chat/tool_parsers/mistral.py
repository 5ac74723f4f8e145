"""Mistral: [TOOL_CALLS] then a JSON array of {"name": ..., "arguments": {...}} (v0.3 to
v7 tokenizers), or, in the newer form, [TOOL_CALLS]NAME[ARGS]{...} per call (v11+; an
[CALL_ID]id before [ARGS] is read too). Which form a checkpoint writes is told by its chat
template.

[TOOL_CALLS] and [ARGS] are special tokens, left out of the text by default: an answer that
opens with a JSON array of calls is read as calls without the marker, and in the newer form
a known tool's name followed by its JSON arguments is. A forced call opens the turn with
[TOOL_CALLS] (and, for a named function in the newer form, its name and [ARGS]).
"""
from __future__ import annotations

import json
import re
from typing import Any

from deepinfer.core.sampling import StructuredOutput
from deepinfer.serve.chat.tool_parsers.base import (
    ForcedShape,
    ToolRequest,
    forced_tools,
    named_function,
)
from deepinfer.serve.chat.tool_parsers.json_calls import (
    Call,
    JsonCallParser,
    json_objects,
    object_call,
    partial_object_call,
    resolve_name,
)
from deepinfer.serve.chat.tool_parsers.schema import (
    arguments_tag,
    calls_schema,
    compact_json,
    parameters,
    structural_tag,
)

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_WS = " \t\r\n"
# NAME, an optional [CALL_ID]id, an optional [ARGS], then the arguments (newer form).
_NAMED_CALL = re.compile(r"\s*([^\s\[{]*)(\[CALL_ID\][^\[{]*)?(\[ARGS\])?(.*)", re.DOTALL)


class MistralParser(JsonCallParser):
    name = "mistral"
    openers = (TOOL_CALLS,)

    def __init__(self, args_form: bool = False) -> None:
        self.args_form = args_form  # the newer NAME[ARGS]{...} form

    @classmethod
    def of(cls, template: str) -> "MistralParser":
        return cls(ARGS in template)

    def describe(self) -> str:
        return self.name + (" (NAME[ARGS] form)" if self.args_form else "")

    def leads(self, text: str, request: ToolRequest) -> bool | None:
        start = text.lstrip(_WS)
        if not start:
            return None
        if self.args_form and start[0] != "[":
            return _leads_with_name(start, request.names)
        if start[0] != "[":
            return False
        rest = start[1:].lstrip(_WS)
        return None if not rest else rest[0] == "{"

    def forced_prefix(self, tools: list[dict], tool_choice: Any) -> str:
        name = named_function(tool_choice)
        if self.args_form and name is not None:
            return f"{TOOL_CALLS}{name}{ARGS}"
        return TOOL_CALLS

    def constraint(self, tools: list[dict], tool_choice: Any,
                   shape: ForcedShape) -> StructuredOutput:
        if not self.args_form:
            calls = {"type": "array", "items": calls_schema(tools, tool_choice),
                     "minItems": 1}
            if not shape.parallel:
                calls["maxItems"] = 1
            return compact_json(calls)
        allowed = forced_tools(tools, tool_choice)
        if named_function(tool_choice) is not None:  # the prefix named it
            return compact_json(parameters(allowed[0]["function"]))
        # [ARGS] is a special token a grammar does not write: the name, then the arguments.
        return structural_tag({"type": "or", "elements": [
            arguments_tag(t["function"]["name"], t["function"], "") for t in allowed]})

    def scan(self, region: str) -> tuple[list[str], str | None]:
        text = region.lstrip(_WS).removeprefix(TOOL_CALLS).lstrip(_WS)
        if text.startswith("["):  # the JSON array form
            bodies, rest = json_objects(text[1:], _WS + ",")
            return bodies, None if rest is None or rest.startswith("]") else rest
        parts = text.split(TOOL_CALLS)
        for k, part in enumerate(parts):
            match = _NAMED_CALL.match(part)
            if not json_objects(match.group(4))[0]:
                return parts[:k], part  # the first part whose arguments are not complete
        return parts, None

    def read(self, body: str, request: ToolRequest) -> Call | None:
        if body.lstrip(_WS).startswith("{"):
            return object_call(body, request)
        match = _NAMED_CALL.match(body)
        arguments, _ = json_objects(match.group(4))
        if not arguments or match.group(1) not in request.names:
            return None
        try:
            valid = isinstance(json.loads(arguments[0]), dict)
        except json.JSONDecodeError:
            valid = False
        return (match.group(1), arguments[0]) if valid else None

    def read_partial(self, body: str, request: ToolRequest) -> Call | None:
        if body.lstrip(_WS).startswith("{"):
            return partial_object_call(body, request)
        match = _NAMED_CALL.match(body)
        # The name is complete once anything follows it.
        complete = any(match.group(k) for k in (2, 3, 4))
        name = resolve_name(match.group(1), complete, request)
        return None if name is None else (name, match.group(4).strip(_WS))

    def write_calls(self, calls: list[dict]) -> str:
        if self.args_form:
            return "".join(f"{TOOL_CALLS}{c['function']['name']}{ARGS}"
                           + json.dumps(c["function"].get("arguments", {})) for c in calls)
        return f"{TOOL_CALLS} " + json.dumps([{"name": c["function"]["name"],
                                               "arguments": c["function"].get("arguments", {})}
                                              for c in calls])


def _leads_with_name(start: str, names: frozenset[str]) -> bool | None:
    """The newer form without its special tokens: a tool's name, then [ or {."""
    undecided = False
    for name in names:
        if start.startswith(name) and len(start) > len(name):
            if start[len(name)] in "[{":
                return True
        elif name.startswith(start):
            undecided = True
    return None if undecided else False
