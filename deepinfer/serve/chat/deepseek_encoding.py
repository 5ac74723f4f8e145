"""DeepSeek-V4 chat encoding, for checkpoints that ship no encoding.py of their own.

The format follows DeepSeek's reference encoder `encoding/encoding_dsv4.py` in the model
repositories (https://huggingface.co/deepseek-ai/DeepSeek-V4-Flash/tree/main/encoding, also
DeepSeek-V4-Pro), and its predecessor https://huggingface.co/deepseek-ai/DeepSeek-V3.2/blob/main/
encoding/encoding_dsv32.py (which named the tool-call block `function_calls`):

    <｜begin▁of▁sentence｜>{system}\\n\\n{tools prompt}<｜User｜>{user}<｜Assistant｜></think>
    {content}\\n\\n<｜DSML｜tool_calls>\\n<｜DSML｜invoke name="f">\\n
    <｜DSML｜parameter name="k" string="true">v</｜DSML｜parameter>\\n</｜DSML｜invoke>\\n
    </｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>{result}</tool_result>...

Tool results have no role of their own: they join the next user turn as <tool_result> blocks,
in the order of the calls. In thinking mode the assistant turn opens with <think> and the
reasoning ends at </think>; in chat mode it opens with an empty, closed </think>. Reasoning of
earlier turns is dropped unless the conversation has tools (the model then needs its earlier
reasoning about the calls). All of <｜User｜>, <｜Assistant｜>, <think>, </think> and ｜DSML｜
are single tokens of the DeepSeek-V4 tokenizer.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
DSML = "｜DSML｜"
TOOL_CALLS_BLOCK = "tool_calls"
MODEL_TYPE = "deepseek_v4"

# The model was trained on these exact words: any change to them is a change of prompt.
TOOLS_PROMPT = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools \
by writing a "<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types \
(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think_open}), you MUST output your complete \
reasoning inside {think_open}...{think_close} BEFORE any tool calls or final response.

Otherwise, output directly after {think_close} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
RESPONSE_FORMAT_PROMPT = ("## Response Format:\n\nYou MUST strictly adhere to the following "
                          "schema to reply:\n{schema}")
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n")


def checkpoint_model_type(model_dir: str) -> str | None:
    """config.json's model_type, or None when there is no readable one."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config.get("model_type") if isinstance(config, dict) else None


def uses_dsml(model_dir: str) -> bool:
    """True for DeepSeek-V4 checkpoints: they call tools in DSML and think in <think>."""
    return checkpoint_model_type(model_dir) == MODEL_TYPE


def to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def encode_messages(messages: list[dict], tools: list[dict] | None = None,
                    thinking: bool = False, reasoning_effort: str | None = None,
                    drop_thinking: bool = True, add_bos: bool = True,
                    **template_vars: Any) -> str:
    """The prompt for `messages` (OpenAI chat format), ending with the assistant turn opened
    when the last message is a user's (or tool results). Other chat_template_kwargs are
    ignored, as a Jinja template ignores variables it does not use; `enable_thinking` and
    `thinking_mode="thinking"` are taken as aliases of `thinking`."""
    thinking = bool(thinking or template_vars.get("enable_thinking")
                    or template_vars.get("thinking_mode") == "thinking")
    if reasoning_effort not in (None, "high", "max"):
        raise ValueError(f"reasoning_effort must be 'high' or 'max', got {reasoning_effort!r}")
    turns = _order_tool_results(_merge_tool_results(_with_tools(messages, tools)))
    keep = not drop_thinking or any(t.get("tools") for t in turns)
    if thinking and not keep:
        turns = _drop_old_developer_turns(turns)
    chat = _Chat(turns, thinking, keep, _last_user(turns))
    prompt = BOS if add_bos else ""
    if thinking and reasoning_effort == "max":
        prompt += REASONING_EFFORT_MAX
    return prompt + "".join(chat.render(i) for i in range(len(turns)))


def _with_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The tool schemas ride on the leading system message (one is added when there is none)."""
    out = [dict(m) for m in messages]
    if tools:
        if not out or out[0].get("role") != "system":
            out.insert(0, {"role": "system", "content": ""})
        out[0]["tools"] = list(tools)
    return out


def _text(content: Any) -> str:
    if isinstance(content, list):  # content parts: the text ones, joined as DeepSeek does
        return "\n\n".join(p.get("text", "") if p.get("type") == "text"
                           else f"[Unsupported {p.get('type')}]" for p in content)
    return content or ""


def _merge_tool_results(messages: list[dict]) -> list[dict]:
    """Tool messages, and user messages after them, become blocks of one user turn."""
    out: list[dict] = []
    for m in messages:
        role = m.get("role")
        if role == "tool":
            block = {"type": "tool_result", "id": m.get("tool_call_id") or "",
                     "text": _text(m.get("content"))}
        elif role == "user":
            block = {"type": "text", "text": _text(m.get("content"))}
        else:
            out.append(m)
            continue
        if out and out[-1].get("role") == "user":
            out[-1]["blocks"].append(block)
        else:
            out.append({"role": "user", "blocks": [block]})
    return out


def _order_tool_results(turns: list[dict]) -> list[dict]:
    """Put each user turn's tool results in the order of the calls that asked for them."""
    order: dict[str, int] = {}
    for turn in turns:
        if turn.get("role") == "assistant" and turn.get("tool_calls"):
            order = {c["id"]: i for i, c in enumerate(turn["tool_calls"]) if c.get("id")}
        elif turn.get("role") == "user" and order:
            results = sorted((b for b in turn["blocks"] if b["type"] == "tool_result"),
                             key=lambda b: order.get(b["id"], 0))
            it = iter(results)
            turn["blocks"] = [next(it) if b["type"] == "tool_result" else b
                              for b in turn["blocks"]]
    return turns


def _drop_old_developer_turns(turns: list[dict]) -> list[dict]:
    last = _last_user(turns)
    return [t for i, t in enumerate(turns) if t.get("role") != "developer" or i >= last]


def _last_user(turns: list[dict]) -> int:
    return max((i for i, t in enumerate(turns) if t.get("role") in ("user", "developer")),
               default=-1)


@dataclass(frozen=True)
class _Chat:
    turns: list[dict]
    thinking: bool
    keep_thinking: bool  # reasoning of every assistant turn stays, not only the latest
    last_user: int  # index of the last user (or developer) turn

    def render(self, i: int) -> str:
        turn = self.turns[i]
        role = turn.get("role")
        if role == "system":
            text = _text(turn.get("content")) + _extras(turn)
        elif role == "developer":
            text = USER + _text(turn.get("content")) + _extras(turn)
        elif role == "user":
            text = USER + "\n\n".join(_block(b) for b in turn["blocks"])
        elif role == "assistant":
            text = self._assistant(i, turn)
        else:
            raise ValueError(f"unknown message role {role!r}")
        return text + self._opening(i)

    def _assistant(self, i: int, turn: dict) -> str:
        reasoning = ""
        if self.thinking and (self.keep_thinking or i > self.last_user):
            reasoning = (turn.get("reasoning_content") or "") + THINK_CLOSE
        calls = turn.get("tool_calls") or []
        block = f"\n\n{dsml_tool_calls(calls)}" if calls else ""
        return reasoning + _text(turn.get("content")) + block + EOS

    def _opening(self, i: int) -> str:
        """The assistant turn's opening after a user turn that an answer follows."""
        nxt = self.turns[i + 1].get("role") if i + 1 < len(self.turns) else None
        if nxt not in (None, "assistant") or self.turns[i].get("role") not in ("user",
                                                                              "developer"):
            return ""
        think = self.thinking and (self.keep_thinking or i >= self.last_user)
        return ASSISTANT + (THINK_OPEN if think else THINK_CLOSE)


def _extras(turn: dict) -> str:
    text = ""
    if turn.get("tools"):
        schemas = "\n".join(to_json(t.get("function", t)) for t in turn["tools"])
        text += "\n\n" + TOOLS_PROMPT.format(dsml=DSML, think_open=THINK_OPEN,
                                             think_close=THINK_CLOSE, schemas=schemas)
    if turn.get("response_format"):
        text += "\n\n" + RESPONSE_FORMAT_PROMPT.format(schema=to_json(turn["response_format"]))
    return text


def _block(block: dict) -> str:
    if block["type"] == "tool_result":
        return f"<tool_result>{block['text']}</tool_result>"
    return block["text"]


def dsml_tool_calls(calls: list[dict]) -> str:
    """OpenAI tool_calls as one DSML block (without the blank line that precedes it)."""
    invokes = "\n".join(f'<{DSML}invoke name="{c["function"]["name"]}">\n'
                        f'{_dsml_parameters(c["function"].get("arguments"))}\n</{DSML}invoke>'
                        for c in calls)
    return f"<{DSML}{TOOL_CALLS_BLOCK}>\n{invokes}\n</{DSML}{TOOL_CALLS_BLOCK}>"


def _dsml_parameters(arguments: Any) -> str:
    # Requests carry arguments as a JSON string, or (decoded for templates) as a mapping; text
    # that is no JSON object is passed on whole, as DeepSeek's encoder does.
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except ValueError:
            decoded = None
        arguments = decoded if isinstance(decoded, dict) else {"arguments": arguments}
    elif arguments is not None and not isinstance(arguments, dict):
        arguments = {"arguments": arguments}
    params = []
    for key, value in (arguments or {}).items():
        text, is_str = (value, "true") if isinstance(value, str) else (to_json(value), "false")
        params.append(f'<{DSML}parameter name="{key}" string="{is_str}">{text}'
                      f'</{DSML}parameter>')
    return "\n".join(params)
