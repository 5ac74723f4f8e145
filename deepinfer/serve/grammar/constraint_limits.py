"""A request's constraint against the server's limits, checked before anything compiles it.

A grammar's compile time grows with the constraint's text and, most steeply, with its
alternatives (enum values, anyOf/oneOf branches): both are bounded here, as is the number of
tools (a forced call's grammar has one alternative per tool)."""
from __future__ import annotations

import json
from typing import Any

from deepinfer.core.sampling import StructuredOutput
from deepinfer.serve.api.errors import APIError
from deepinfer.serve.api.limits import RequestLimits

_JSON_KINDS = ("json_schema", "structural_tag")
_BRANCHES = ("anyOf", "oneOf")


def check_tools(limits: RequestLimits, tools: list | None) -> None:
    if tools and len(tools) > limits.max_tools:
        raise APIError(f"at most {limits.max_tools} tools per request on this server "
                       f"(--max-tools), got {len(tools)}", param="tools")


def check_constraint(limits: RequestLimits, spec: StructuredOutput, param: str) -> None:
    size = len(spec.spec.encode())
    if size > limits.max_schema_kb * 1024:
        raise APIError(f"the {spec.kind} constraint is {size} bytes; at most "
                       f"{limits.max_schema_kb} KB on this server (--max-schema-kb)",
                       param=param)
    if spec.kind not in _JSON_KINDS:
        return
    try:
        schema = json.loads(spec.spec)
    except ValueError:
        return  # not JSON: the compile says so
    count = count_alternatives(schema)
    if count > limits.max_enum_values:
        raise APIError(f"the {spec.kind} constraint has {count} enum values and anyOf/oneOf "
                       f"branches; at most {limits.max_enum_values} on this server "
                       "(--max-enum-values)", param=param)


def count_alternatives(schema: Any) -> int:
    """Enum values and anyOf/oneOf branches anywhere in a JSON document."""
    count, todo = 0, [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if isinstance(value, list) and (key == "enum" or key in _BRANCHES):
                    count += len(value)
                if isinstance(value, (dict, list)):
                    todo.append(value)
        elif isinstance(node, list):
            todo.extend(v for v in node if isinstance(v, (dict, list)))
    return count
