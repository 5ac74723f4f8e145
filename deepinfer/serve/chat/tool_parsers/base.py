"""The interface every tool-call parser has, and what they share.

A parser knows one family's chat format for tool calls. It reads a whole answer into OpenAI
`content` + `tool_calls`, reads it incrementally while it streams (text that may still become
a call is held back; calls go out as they complete), and, for a forced call (tool_choice
"required" or a named function), says what the assistant turn is opened with and the
constraint that makes the rest of the answer exactly a call.
"""
from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from deepinfer.core.sampling import StructuredOutput


@dataclass(frozen=True)
class ForcedShape:
    """How an answer that must call a tool is shaped: thinking (the prompt opened <think>, so
    reasoning comes first where the format has it) and whether several calls may follow."""

    thinking: bool = False
    parallel: bool = True


@dataclass(frozen=True)
class ToolRequest:
    """One request's tools, as its answer is read."""

    names: frozenset[str]  # the tools a call may name
    forced: str = ""  # text the assistant turn was opened with (part of the answer)
    named: str | None = None  # the function tool_choice names, if it names one
    thinking: bool = False  # the prompt opened <think>
    use_tools: bool = True  # False: tool_choice "none" or no tools


def named_function(tool_choice: Any) -> str | None:
    if isinstance(tool_choice, dict):
        return tool_choice.get("function", {}).get("name")
    return None


def is_forced(tool_choice: Any) -> bool:
    return tool_choice == "required" or named_function(tool_choice) is not None


def forced_tools(tools: list[dict], tool_choice: Any) -> list[dict]:
    """The tools a forced call may name: the named one, or all."""
    wanted = named_function(tool_choice)
    return [t for t in tools if wanted is None or t["function"]["name"] == wanted]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(num_calls: int, engine_reason: str | None) -> str | None:
    """"tool_calls" when the answer called tools, unless it was cut off (then the calls carry
    the arguments written so far, as OpenAI returns them)."""
    return "tool_calls" if num_calls and engine_reason not in ("length", "abort") \
        else engine_reason


class CallStream(ABC):
    """One choice's answer read while it streams."""

    @abstractmethod
    def deltas(self, text: str, finished: bool = False,
               engine_reason: str | None = None) -> list[dict]:
        """OpenAI chat-completion chunk deltas for the next piece of the answer."""

    @abstractmethod
    def finish_reason(self, engine_reason: str | None) -> str | None:
        ...


class OutputReader(ABC):
    """How one request's answers are read: streamed (a CallStream per choice) or whole."""

    @abstractmethod
    def stream(self) -> CallStream:
        ...

    def message(self, text: str, engine_reason: str | None) -> tuple[dict, str | None]:
        """The OpenAI assistant message and finish reason of a whole answer: the streamed
        deltas folded, so streaming and not give the same result."""
        stream = self.stream()
        return fold(stream.deltas(text, True, engine_reason)), \
            stream.finish_reason(engine_reason)


def fold(deltas: list[dict]) -> dict:
    content: list[str] = []
    calls: dict[int, dict] = {}
    for delta in deltas:
        content.append(delta.get("content") or "")
        for call in delta.get("tool_calls", ()):
            entry = calls.setdefault(call["index"], {
                "id": call.get("id"), "type": "function",
                "function": {"name": call["function"].get("name"), "arguments": ""}})
            entry["function"]["arguments"] += call["function"].get("arguments", "")
    text = "".join(content)
    message: dict = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


class ToolParser(ABC):
    """One family's tool-call format. Holds no request state: found once when the server
    starts (ChatFormat), shared by every request."""

    name: ClassVar[str]

    @classmethod
    def of(cls, template: str) -> "ToolParser":
        """The parser for a checkpoint whose chat template is `template` (a family may have
        variants, told apart by what its template writes)."""
        return cls()

    def describe(self) -> str:
        return self.name

    def forced_prefix(self, tools: list[dict], tool_choice: Any) -> str:
        """Text the assistant turn is opened with for a forced call ("" where the constraint
        alone shapes the call)."""
        return ""

    @abstractmethod
    def constraint(self, tools: list[dict], tool_choice: Any,
                   shape: ForcedShape) -> StructuredOutput:
        """For a forced call: what makes the rest of the answer (after forced_prefix) exactly
        a call of one of the allowed tools. ValueError for tools that cannot be constrained."""

    @abstractmethod
    def reader(self, request: ToolRequest) -> OutputReader | None:
        """How the request's answers are read; None: as plain text."""

    def write_calls(self, calls: list[dict]) -> str:
        """OpenAI tool calls as this format writes them in an assistant turn (for templates
        that render no tool_calls: the calls stay in the prompt as text)."""
        # Only DeepSeek-V4's DSML has none: its own encoder renders tool turns, no template.
        raise ValueError(f"the {self.name} tool-call format cannot be written into a chat "
                         "template that renders no tool_calls; pick another --tool-call-parser")
