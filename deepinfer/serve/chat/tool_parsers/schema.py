"""JSON schemas and structural tags for forced calls, built from the request's tools.

Forced calls are compiled without free whitespace: a JSON schema as compact JSON (one space
after ':' and ',', as json.dumps and the chat templates write it), a structural tag's JSON
with runs of at most one whitespace char. Otherwise a model under the constraint may spend
its tokens on whitespace between JSON tokens.
"""
from __future__ import annotations

import json
from typing import Any

from deepinfer.core.sampling import StructuredOutput
from deepinfer.serve.chat.tool_parsers.base import forced_tools

# A structural tag's JSON content: whitespace runs of at most this many chars (xgrammar
# needs a positive bound; 1 still allows the single space json.dumps writes).
TAG_MAX_WHITESPACE = 1


def calls_schema(tools: list[dict], tool_choice: Any, arguments_key: str = "arguments") -> dict:
    """One call of the allowed tools as a JSON object {"name": ..., arguments_key: {...}}."""
    options = [call_schema(t["function"], i, arguments_key)
               for i, t in enumerate(forced_tools(tools, tool_choice))]
    return options[0] if len(options) == 1 else any_of(options)


def compact_json(schema: dict) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema), compact=True)


def any_of(options: list[dict]) -> dict:
    """One of several calls; their definitions (named apart per tool) at the root."""
    defs = {k: v for o in options for k, v in o.get("$defs", {}).items()}
    schema: dict[str, Any] = {"anyOf": [{k: v for k, v in o.items() if k != "$defs"}
                                        for o in options]}
    if defs:
        schema["$defs"] = defs
    return schema


def parameters(function: dict) -> dict:
    found = function.get("parameters") or {"type": "object"}
    if not isinstance(found, dict):
        raise ValueError(f"tools: {function['name']}'s parameters must be a JSON schema object")
    return found


def call_schema(function: dict, index: int = 0, arguments_key: str = "arguments") -> dict:
    """One call's JSON: its name and its arguments by the function's parameters schema. The
    parameters' definitions ($defs, definitions: pydantic writes every nested model there)
    move to the call schema's root, renamed per tool, since `#/$defs/...` references resolve
    from the root and the parameters now sit under properties.<arguments_key>."""
    params = parameters(function)
    defs: dict[str, Any] = {}
    for key in ("$defs", "definitions"):
        found = params.get(key) or {}
        if not isinstance(found, dict):
            raise ValueError(f"tools: {function['name']}'s parameters.{key} must be an object")
        for name, schema in found.items():
            defs[f"{key}/{name}"] = schema
    prefix = f"t{index}_"
    renamed = {f"#/{old}": f"#/$defs/{prefix}{old.split('/', 1)[1]}" for old in defs}
    schema = {"type": "object",
              "properties": {"name": {"const": function["name"]},
                             arguments_key: _rewrite_refs(
                                 {k: v for k, v in params.items()
                                  if k not in ("$defs", "definitions")}, renamed)},
              "required": ["name", arguments_key], "additionalProperties": False}
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


# ---- structural tags (xgrammar's format, written as JSON: nothing to import here) ---------
def arguments_tag(begin: str, function: dict, end: str) -> dict:
    """begin, then the function's arguments as JSON, then end."""
    return {"type": "tag", "begin": begin,
            "content": {"type": "json_schema", "json_schema": parameters(function),
                        "max_whitespace_cnt": TAG_MAX_WHITESPACE},
            "end": end}


def structural_tag(fmt: dict) -> StructuredOutput:
    return StructuredOutput("structural_tag",
                            json.dumps({"type": "structural_tag", "format": fmt}))
