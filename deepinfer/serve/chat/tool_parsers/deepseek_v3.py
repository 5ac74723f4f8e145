"""DeepSeek-V3 (and R1): a block of calls, each a fenced JSON block after the tool's name:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

DeepSeek-V3.1 writes a call as <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>;
both are read, and a forced call is written in the checkpoint's own variant (its template
says which: V3's fences the JSON). The markers are ordinary tokens of these tokenizers. A
forced call is the whole answer, shaped by a structural tag (the format xgrammar names
deepseek_r1 / deepseek_v3_1, written here as JSON).
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
from deepinfer.serve.chat.tool_parsers.json_calls import Call, JsonCallParser, resolve_name
from deepinfer.serve.chat.tool_parsers.schema import arguments_tag, structural_tag

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
FENCE_OPEN, FENCE_CLOSE = "\n```json\n", "\n```"
_CLOSED = re.compile(re.escape(CALL_BEGIN) + "(.*?)" + re.escape(CALL_END), re.DOTALL)
_FENCED = re.compile(r"\s*function" + re.escape(SEP) + r"([^\n]*)\n```(?:json)?\n(.*?)\n?```\s*",
                     re.DOTALL)


class DeepSeekV3Parser(JsonCallParser):
    name = "deepseek_v3"
    openers = (CALLS_BEGIN, CALL_BEGIN)

    def __init__(self, v3_1: bool = False) -> None:
        self.v3_1 = v3_1  # NAME<｜tool▁sep｜>{...}, no fence

    @classmethod
    def of(cls, template: str) -> "DeepSeekV3Parser":
        return cls(CALL_BEGIN in template and "```json" not in template)

    def describe(self) -> str:
        return self.name + (" (V3.1 form)" if self.v3_1 else "")

    def constraint(self, tools: list[dict], tool_choice: Any,
                   shape: ForcedShape) -> StructuredOutput:
        tags = [self._call_tag(t["function"]) for t in forced_tools(tools, tool_choice)]
        one = named_function(tool_choice) is not None or not shape.parallel
        calls = {"type": "tags_with_separator", "tags": tags, "separator": "" if self.v3_1
                 else "\n", "at_least_one": True, "stop_after_first": one}
        block = {"type": "tag", "begin": CALLS_BEGIN, "content": calls, "end": CALLS_END}
        if shape.thinking:  # the prompt opened <think>: the reasoning ends first
            reasoning = {"type": "tag", "begin": "", "end": THINK_CLOSE, "content": {
                "type": "any_text", "excludes": [THINK_OPEN, THINK_CLOSE]}}
            block = {"type": "sequence", "elements": [reasoning, block]}
        return structural_tag(block)

    def _call_tag(self, function: dict) -> dict:
        if self.v3_1:
            return arguments_tag(f"{CALL_BEGIN}{function['name']}{SEP}", function, CALL_END)
        return arguments_tag(f"{CALL_BEGIN}function{SEP}{function['name']}{FENCE_OPEN}",
                             function, f"{FENCE_CLOSE}{CALL_END}")

    def scan(self, region: str) -> tuple[list[str], str | None]:
        bodies, end = [], 0
        for match in _CLOSED.finditer(region):
            bodies.append(match.group(1))
            end = match.end()
        opened = region.find(CALL_BEGIN, end)
        return bodies, None if opened < 0 else region[opened + len(CALL_BEGIN):]

    def read(self, body: str, request: ToolRequest) -> Call | None:
        fenced = _FENCED.fullmatch(body)
        if fenced is not None:
            name, arguments = fenced.group(1).strip(), fenced.group(2).strip()
        else:
            name, sep, arguments = body.partition(SEP)
            name, arguments = name.strip(), arguments.strip()
            if not sep:
                return None
        try:
            valid = isinstance(json.loads(arguments), dict)
        except json.JSONDecodeError:
            valid = False
        return (name, arguments) if valid and name in request.names else None

    def read_partial(self, body: str, request: ToolRequest) -> Call | None:
        head, sep, rest = body.lstrip().partition(SEP)
        if not sep:
            return None
        if head == "function":  # V3: NAME, a newline, the fence, the JSON
            name, newline, fenced = rest.partition("\n")
            arguments = re.sub(r"^```(?:json)?\n?|^`{1,3}j?s?o?n?$", "", fenced)
            complete = bool(newline)
        else:
            name, arguments, complete = head, rest, True
        name = resolve_name(name.strip(), complete, request)
        arguments = re.sub(r"\n?`{0,3}$", "", arguments).strip()
        return None if name is None else (name, arguments)

    def write_calls(self, calls: list[dict]) -> str:
        def one(call: dict) -> str:
            name, arguments = call["function"]["name"], json.dumps(
                call["function"].get("arguments", {}))
            if self.v3_1:
                return f"{CALL_BEGIN}{name}{SEP}{arguments}{CALL_END}"
            return f"{CALL_BEGIN}function{SEP}{name}{FENCE_OPEN}{arguments}{FENCE_CLOSE}{CALL_END}"

        separator = "" if self.v3_1 else "\n"
        return CALLS_BEGIN + separator.join(one(c) for c in calls) + CALLS_END
