"""DeepSeek-V4 output, parsed while it streams: reasoning, content and DSML tool calls.

The model answers (see deepseek_encoding.py; format from DeepSeek's encoding_dsv4.py,
https://huggingface.co/deepseek-ai/DeepSeek-V4-Flash/tree/main/encoding):

    {reasoning}</think>{content}\\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

where the reasoning part is there in thinking mode only (the prompt ended with <think>). A
call's arguments are the JSON object of its parameters, in order: string="true" values become
JSON strings, the others are JSON already. DeepSeek-V3.2's `function_calls` block name is
accepted too.

Text is fed as it is detokenized, split anywhere. What could still be the start of a marker is
held back until it is known, so no content is sent that later turns out to be markup, and the
whitespace before a tool-call block (the blank line the format puts there; at most 64 chars) is
left out of the content. Arguments go out parameter by parameter as each one completes, so
what is sent of a call's arguments always concatenates to a valid JSON prefix of the final
object. Markup that breaks the format ends the call in progress (its arguments are closed) and
is passed on as content from there on. At the end of a cut-off output (max_tokens), an open
call is closed with the parameters it completed and a partial tag is dropped.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from enum import Enum
from typing import Callable

from deepinfer.serve.chat.deepseek_encoding import DSML, THINK_CLOSE, to_json
from deepinfer.serve.chat.stream_markers import WHITESPACE, holdback, trailing_space

BLOCK_NAMES = ("tool_calls", "function_calls")  # DeepSeek-V4's block, and V3.2's
INVOKE_OPEN, INVOKE_CLOSE = f"<{DSML}invoke", f"</{DSML}invoke>"
PARAM_OPEN, PARAM_CLOSE = f"<{DSML}parameter", f"</{DSML}parameter>"
_INVOKE_RE = re.compile(re.escape(INVOKE_OPEN) + r'\s+name="([^"]*)"\s*>')
_PARAM_RE = re.compile(re.escape(PARAM_OPEN)
                       + r'\s+name="([^"]*)"(?:\s+string="(true|false)")?\s*>')
_WS = WHITESPACE
_MAX_TAG = 512  # chars without a closing '>': no tag of this format is that long


@dataclass(frozen=True)
class Text:
    text: str
    reasoning: bool = False  # inside <think>...</think>, not the answer


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str  # the next piece of the call's JSON arguments


Event = Text | CallStart | CallArguments


class _State(Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    BLOCK = "block"  # inside a tool-call block, between calls
    INVOKE = "invoke"  # inside a call, between parameters
    VALUE = "value"  # inside a parameter's value


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class DsmlParser:
    """feed() text as it arrives, flush() once at the end; both return the events that are
    certain by then. Without `tools`, markup is content like any other text."""

    def __init__(self, thinking: bool = False, tools: bool = True,
                 new_id: Callable[[], str] = new_call_id) -> None:
        self._state = _State.REASONING if thinking else _State.CONTENT
        self._openers = [f"<{DSML}{name}>" for name in BLOCK_NAMES] if tools else []
        self._new_id = new_id
        self._buf = ""  # text received and not yet turned into events
        self._block_close = ""  # the closing tag of the open tool-call block
        self._param: tuple[str, str | None] = ("", None)  # open parameter: name, string=
        self._searched = 0  # VALUE: chars of _buf known to start no PARAM_CLOSE
        self.num_calls = 0  # calls started
        self._num_params = 0  # parameters of the open call sent so far

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._run(final=False)

    def flush(self) -> list[Event]:
        return self._run(final=True)

    def deltas(self, text: str, finished: bool = False) -> list[dict]:
        """OpenAI chat-completion chunk deltas for the next piece of text."""
        return openai_deltas(self.feed(text) + (self.flush() if finished else []))

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        steps = {_State.REASONING: self._text_step, _State.CONTENT: self._text_step,
                 _State.BLOCK: self._block_step, _State.INVOKE: self._invoke_step,
                 _State.VALUE: self._value_step}
        while steps[self._state](out, final):
            pass
        return out

    # ---- text: reasoning or content ----------------------------------------------------
    def _text_step(self, out: list[Event], final: bool) -> bool:
        reasoning = self._state is _State.REASONING
        markers = ([THINK_CLOSE] if reasoning else []) + self._openers
        pos, marker = _earliest(self._buf, markers)
        if marker is None:
            keep = 0 if final else holdback(self._buf, markers, bool(self._openers))
            self._emit(out, self._buf[:len(self._buf) - keep], reasoning)
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        before, self._buf = self._buf[:pos], self._buf[pos + len(marker):]
        if marker == THINK_CLOSE:
            self._emit(out, before, reasoning)
            self._state = _State.CONTENT
        else:  # the blank line before a block is part of the block
            self._emit(out, before[:len(before) - trailing_space(before)], reasoning)
            self._block_close = "</" + marker[1:]
            self._state = _State.BLOCK
        return True

    @staticmethod
    def _emit(out: list[Event], text: str, reasoning: bool) -> None:
        if text:
            out.append(Text(text, reasoning))

    # ---- markup ------------------------------------------------------------------------
    def _block_step(self, out: list[Event], final: bool) -> bool:
        self._buf = self._buf.lstrip(_WS)
        if self._buf.startswith(self._block_close):
            self._buf = self._buf[len(self._block_close):]
            self._state = _State.CONTENT
            return True
        tag = self._tag(INVOKE_OPEN, _INVOKE_RE)
        if tag is None:
            return self._wait_or_break(out, [self._block_close, INVOKE_OPEN], final)
        if not tag:
            return self._break(out)
        out.append(CallStart(self.num_calls, self._new_id(), tag[0]))
        self._num_params = 0
        self._state = _State.INVOKE
        return True

    def _invoke_step(self, out: list[Event], final: bool) -> bool:
        self._buf = self._buf.lstrip(_WS)
        if self._buf.startswith(INVOKE_CLOSE):
            self._buf = self._buf[len(INVOKE_CLOSE):]
            self._end_call(out)
            self._state = _State.BLOCK
            return True
        tag = self._tag(PARAM_OPEN, _PARAM_RE)
        if tag is None:
            return self._wait_or_break(out, [INVOKE_CLOSE, PARAM_OPEN], final)
        if not tag:
            return self._break(out)
        self._param = (tag[0], tag[1])
        self._searched = 0
        self._state = _State.VALUE
        return True

    def _value_step(self, out: list[Event], final: bool) -> bool:
        pos = self._buf.find(PARAM_CLOSE, self._searched)
        if pos < 0:
            if final:  # cut off inside a value: the call ends without it
                self._buf = ""
                self._end_call(out)
                self._state = _State.BLOCK
                return False
            self._searched = max(0, len(self._buf) - len(PARAM_CLOSE) + 1)
            return False
        value, self._buf = self._buf[:pos], self._buf[pos + len(PARAM_CLOSE):]
        name, string = self._param
        lead = "{" if self._num_params == 0 else ", "
        out.append(CallArguments(self.num_calls,
                                 f"{lead}{to_json(name)}: {_json_value(value, string)}"))
        self._num_params += 1
        self._state = _State.INVOKE
        return True

    def _tag(self, opener: str, pattern: re.Pattern) -> tuple | None | bool:
        """The groups of the complete tag `opener...>` at the start of the buffer (consumed);
        None while it is not there yet, False when what is there is no such tag."""
        if not self._buf.startswith(opener):
            return None
        end = self._buf.find(">")
        if end < 0:
            return False if len(self._buf) > _MAX_TAG else None
        match = pattern.fullmatch(self._buf, 0, end + 1)
        if match is None:
            return False
        self._buf = self._buf[end + 1:]
        return match.groups()

    def _wait_or_break(self, out: list[Event], tags: list[str], final: bool) -> bool:
        if not self._buf or any(t.startswith(self._buf) or self._buf.startswith(t)
                                for t in tags):
            if final:  # a tag cut off by the end of the output
                self._buf = ""
                self._end_call(out)
            return False
        return self._break(out)

    def _break(self, out: list[Event]) -> bool:
        """Not the format: close the call in progress; the rest is content."""
        self._end_call(out)
        self._state = _State.CONTENT
        return True

    def _end_call(self, out: list[Event]) -> None:
        if self._state in (_State.INVOKE, _State.VALUE):
            out.append(CallArguments(self.num_calls, "}" if self._num_params else "{}"))
            self.num_calls += 1
            self._state = _State.BLOCK


def _earliest(text: str, markers: list[str]) -> tuple[int, str | None]:
    best, found = len(text), None
    for marker in markers:
        pos = text.find(marker, 0, best + len(marker))
        if pos >= 0 and pos < best:
            best, found = pos, marker
    return best, found


def _json_value(value: str, string: str | None) -> str:
    """A parameter's value as JSON text. A value said not to be a string that is no valid JSON
    is sent as a string rather than break the whole arguments object."""
    if string != "true":
        try:
            json.loads(value, parse_constant=_no_constant)
            return value
        except ValueError:
            pass
    return to_json(value)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def openai_deltas(events: list[Event]) -> list[dict]:
    """Events as OpenAI `delta` objects: runs of text merged, a call's first delta carrying
    its index, id, type and name, then arguments deltas carrying the index only."""
    out: list[dict] = []
    for e in events:
        last = out[-1] if out else {}
        if isinstance(e, Text):
            key = "reasoning_content" if e.reasoning else "content"
            if key in last:
                last[key] += e.text
            else:
                out.append({key: e.text})
        elif isinstance(e, CallStart):
            out.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                        "function": {"name": e.name, "arguments": ""}}]})
        else:
            call = (last.get("tool_calls") or [{}])[0]
            if call.get("index") == e.index and "id" not in call:
                call["function"]["arguments"] += e.text
            else:
                out.append({"tool_calls": [{"index": e.index,
                                            "function": {"arguments": e.text}}]})
    return out


def finish_reason(num_calls: int, engine_reason: str | None) -> str | None:
    """"tool_calls" when the answer called tools, unless it was cut off."""
    return "tool_calls" if num_calls and engine_reason not in ("length", "abort") \
        else engine_reason


@dataclass(frozen=True)
class DsmlOutput:
    content: str
    reasoning: str | None  # None outside thinking mode
    tool_calls: list[dict]

    def message(self) -> dict:
        """The OpenAI assistant message."""
        message: dict = {"role": "assistant",
                         "content": self.content or (None if self.tool_calls else "")}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


def parse(text: str, thinking: bool = False, tools: bool = True,
          new_id: Callable[[], str] = new_call_id) -> DsmlOutput:
    """A whole output at once, by the same state machine as streaming."""
    parser = DsmlParser(thinking, tools, new_id)
    content, reasoning, calls = [], [], {}
    for e in parser.feed(text) + parser.flush():
        if isinstance(e, Text):
            (reasoning if e.reasoning else content).append(e.text)
        elif isinstance(e, CallStart):
            calls[e.index] = {"id": e.id, "type": "function",
                              "function": {"name": e.name, "arguments": ""}}
        else:
            calls[e.index]["function"]["arguments"] += e.text
    return DsmlOutput("".join(content), "".join(reasoning) if thinking else None,
                      [calls[i] for i in sorted(calls)])


@dataclass(frozen=True)
class DsmlMode:
    """How one request's output is read: in thinking mode or not, with tools or not."""

    thinking: bool
    tools: bool

    def parser(self) -> DsmlParser:
        return DsmlParser(self.thinking, self.tools)

    def parse(self, text: str) -> DsmlOutput:
        return parse(text, self.thinking, self.tools)
