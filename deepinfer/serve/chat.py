"""Chat rendering with the checkpoint's own template, and tool calls parsed back out.

Tool calls follow the Hermes/Qwen convention most open chat templates emit:
<tool_call>{"name": ..., "arguments": {...}}</tool_call>. For tool_choice "required" or a named
function the assistant turn is opened with the start of such a call, so the model can only
complete a call; the forced text is put back in front of the output before parsing.
DeepSeek-V4 checkpoints call tools in DSML (deepseek_encoding.py): there a forced call is the
whole answer constrained by xgrammar's structural tag for that format (reasoning first in
thinking mode, then the tool-calls block), and nothing is put in front.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import uuid
from dataclasses import dataclass
from typing import Any

from deepinfer.core.sampling import StructuredOutput
from deepinfer.serve import deepseek_encoding

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
log = logging.getLogger("deepinfer.serve")
_CALL_RE = re.compile(re.escape(TOOL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(TOOL_CLOSE) + r"|$)",
                      re.DOTALL)


@dataclass(frozen=True)
class RenderedChat:
    prompt: str
    forced_prefix: str  # text the assistant turn was opened with (part of the output)


@dataclass(frozen=True)
class ChatFormat:
    """How a checkpoint's chats are rendered and read back, found once when the server starts
    (not per request): its own encoding.py when the user trusts the folder's code (ours for
    DeepSeek-V4), else the tokenizer's Jinja template (encoder None); dsml: its tool calls come
    back in DeepSeek's DSML."""

    encoder: Any = None
    dsml: bool = False
    source: str = "the tokenizer's chat template"  # what renders, for the start-up log

    @classmethod
    def of(cls, model_dir: str, trust_remote_code: bool = False) -> "ChatFormat":
        dsml = deepseek_encoding.uses_dsml(model_dir)
        path = os.path.join(model_dir, "encoding.py")
        if os.path.exists(path) and trust_remote_code:
            return cls(_load_encoding(path), dsml, f"{path} (--trust-remote-code)")
        if dsml:
            # DeepSeek-V4 checkpoints ship their encoder and no usable Jinja template: ours
            # renders the same prompts without running the folder's code.
            return cls(deepseek_encoding, dsml, "DeepInfer's DeepSeek-V4 encoding")
        return cls(None, dsml)

    def describe(self, model_dir: str) -> str:
        """The start-up log line: which renderer, and why a shipped encoder is not it."""
        skipped = os.path.exists(os.path.join(model_dir, "encoding.py")) and \
            not self.source.endswith("(--trust-remote-code)")
        return f"chat format: {self.source}" + (
            "; the model folder's encoding.py is not run (pass --trust-remote-code to use it)"
            if skipped else "")


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
            messages = [_calls_as_text(m) for m in messages]
        extra = {"documents": documents} if documents else {}
        prompt = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final, tokenize=False, **extra,
            **(template_kwargs or {}))
    forced = _forced_prefix(tool_choice) if tools and not chat.dsml else ""
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


def _calls_as_text(message: dict) -> dict:
    """An assistant turn's tool calls written into its content as the calls this server
    forces and parses (TOOL_OPEN {...} TOOL_CLOSE), for a template that renders no
    tool_calls: an agent's earlier calls stay in the prompt instead of vanishing."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    text = "".join(f"{TOOL_OPEN}\n" + json.dumps(
        {"name": c.get("function", {}).get("name"),
         "arguments": c.get("function", {}).get("arguments", {})}) + f"\n{TOOL_CLOSE}"
        for c in calls)
    content = message.get("content") or ""
    return {**message, "content": f"{content}\n{text}" if content else text}


def _forced_prefix(tool_choice: Any) -> str:
    if tool_choice == "required" or _named(tool_choice):
        return TOOL_OPEN + "\n"
    return ""


def _named(tool_choice: Any) -> str | None:
    if isinstance(tool_choice, dict):
        return tool_choice.get("function", {}).get("name")
    return None


def tool_call_constraint(tools: list[dict] | None, tool_choice: Any,
                         dsml: DsmlCalls | None = None) -> StructuredOutput | None:
    """For tool_choice "required" or a named function: the JSON of one call, as a schema
    (DSML models: the answer's format, as a structural tag).

    The assistant turn was opened with TOOL_OPEN (see _forced_prefix), so the constrained text
    is exactly the call's {"name": ..., "arguments": {...}} object.
    """
    if not tools or not (tool_choice == "required" or _named(tool_choice)):
        return None
    if dsml is not None:
        return _dsml_constraint(tools, tool_choice, dsml)
    wanted = _named(tool_choice)
    options = [_call_schema(t["function"], i) for i, t in enumerate(tools)
               if wanted is None or t["function"]["name"] == wanted]
    schema = options[0] if len(options) == 1 else _any_of(options)
    return StructuredOutput("json_schema", json.dumps(schema))


def _any_of(options: list[dict]) -> dict:
    """One of several calls; their definitions (named apart per tool) at the root."""
    defs = {k: v for o in options for k, v in o.get("$defs", {}).items()}
    schema: dict[str, Any] = {"anyOf": [{k: v for k, v in o.items() if k != "$defs"}
                                        for o in options]}
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass(frozen=True)
class DsmlCalls:
    """How a DSML answer that must call a tool is shaped: thinking (the prompt opened <think>,
    so reasoning and </think> come first) and whether several calls may follow one another."""

    thinking: bool
    parallel: bool = True


def _dsml_constraint(tools: list[dict], tool_choice: Any, calls: DsmlCalls) -> StructuredOutput:
    """xgrammar's structural tag for DeepSeek-V4 (its format table, not a grammar of ours): the
    tool-calls block with one invoke per call, parameters typed by each tool's JSON schema."""
    try:
        import xgrammar as xgr
    except ImportError as exc:  # an optional extra
        raise ValueError("forced tool calls need xgrammar: pip install 'deepinfer[structured]'"
                         ) from exc
    wanted = _named(tool_choice)
    if wanted is not None:
        tools = [t for t in tools if t["function"]["name"] == wanted]
    tag = xgr.get_model_structural_tag(
        "deepseek_v4", tools=tools, tool_choice="required",
        reasoning="enabled" if calls.thinking else "disabled",
        parallel_tool_calls=calls.parallel and wanted is None)
    return StructuredOutput("structural_tag", tag.model_dump_json())


def _call_schema(function: dict, index: int = 0) -> dict:
    """One call's JSON: its name and its arguments by the function's parameters schema. The
    parameters' definitions ($defs, definitions: pydantic writes every nested model there)
    move to the call schema's root, renamed per tool, since `#/$defs/...` references resolve
    from the root and the parameters now sit under properties.arguments."""
    parameters = function.get("parameters") or {"type": "object"}
    defs: dict[str, Any] = {}
    if not isinstance(parameters, dict):
        raise ValueError(f"tools: {function['name']}'s parameters must be a JSON schema object")
    for key in ("$defs", "definitions"):
        found = parameters.get(key) or {}
        if not isinstance(found, dict):
            raise ValueError(f"tools: {function['name']}'s parameters.{key} must be an object")
        for name, schema in found.items():
            defs[f"{key}/{name}"] = schema
    prefix = f"t{index}_"
    renamed = {f"#/{old}": f"#/$defs/{prefix}{old.split('/', 1)[1]}" for old in defs}
    schema = {"type": "object",
              "properties": {"name": {"const": function["name"]},
                             "arguments": _rewrite_refs(
                                 {k: v for k, v in parameters.items()
                                  if k not in ("$defs", "definitions")}, renamed)},
              "required": ["name", "arguments"], "additionalProperties": False}
    if defs:
        schema["$defs"] = {f"{prefix}{old.split('/', 1)[1]}": _rewrite_refs(d, renamed)
                           for old, d in defs.items()}
    return schema


def _rewrite_refs(node: Any, renamed: dict[str, str]) -> Any:
    if isinstance(node, dict):
        return {k: (renamed.get(v, v) if k == "$ref" and isinstance(v, str)
                    else _rewrite_refs(v, renamed)) for k, v in node.items()}
    if isinstance(node, list):
        return [_rewrite_refs(v, renamed) for v in node]
    return node


def _load_encoding(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("deepinfer_checkpoint_encoding", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "encode_messages"):
        raise ValueError(f"{path} defines no encode_messages(messages, tools=...)")
    return module


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[dict]


def parse_tool_calls(text: str, tool_names: set[str]) -> ParsedOutput:
    """Split model output into plain content and OpenAI tool_calls."""
    calls = []
    for body in _CALL_RE.findall(text):
        call = _as_call(body, tool_names)
        if call is not None:
            calls.append(call)
    if not calls:
        return ParsedOutput(text, [])
    content = text[: text.index(TOOL_OPEN)].strip()
    return ParsedOutput(content or None, calls)


def _as_call(body: str, tool_names: set[str]) -> dict | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in tool_names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"],
                         "arguments": arguments if isinstance(arguments, str)
                         else json.dumps(arguments)}}


def may_become_tool_call(text: str) -> bool:
    """True while `text` ends with something that could still grow into TOOL_OPEN."""
    if TOOL_OPEN in text:
        return True
    return any(text.endswith(TOOL_OPEN[:i]) for i in range(1, len(TOOL_OPEN)))
