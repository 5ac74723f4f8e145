"""A request's output constraint, from whichever field names it: OpenAI's `response_format`,
vLLM's `structured_outputs` object, or vLLM's older top-level `guided_*` / `structural_tag`
fields. Each becomes one StructuredOutput kind (core/sampling.py) that the grammar workers
compile with xgrammar; at most one may be given, and a forced tool call is one too.

Nothing here imports xgrammar: the API process only reshapes text (a choice list becomes an
EBNF grammar, a legacy structural tag the current format), the workers compile it.
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from deepinfer.core.sampling import StructuredOutput
from deepinfer.serve.api.errors import APIError

# vLLM's backend names that mean what this server does; any other is refused.
XGRAMMAR_BACKENDS = ("xgrammar", "auto")
# The top-level fields of vLLM's older spelling, in its order of precedence.
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "structural_tag")


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` object: exactly one of its constraint fields."""

    # Its own field names only: a misspelt constraint must not pass as no constraint.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    json_: str | dict[str, Any] | None = Field(None, alias="json")  # BaseModel has .json
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_fallback: bool = False  # no effect: there is no other backend to fall back to
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    backend: str | None = None


def structured_output(field: str, value: Any, param: str | None = None) -> StructuredOutput:
    """One constraint field's value (named as vLLM names it, with or without the `guided_`
    prefix) as a StructuredOutput; a value that cannot be one is a 400 naming `param`."""
    kind = field.removeprefix("guided_")
    param = param or field
    try:
        if kind == "json":
            return StructuredOutput("json_schema", _json_text(value))
        if kind == "json_object":
            return StructuredOutput("json_object")
        if kind == "regex":
            return StructuredOutput("regex", value)
        if kind == "grammar":
            return StructuredOutput("ebnf", value)
        if kind == "choice":
            return StructuredOutput("ebnf", choice_grammar(value))
        if kind == "structural_tag":
            return StructuredOutput("structural_tag", structural_tag_text(value))
    except (TypeError, ValueError) as exc:
        raise APIError(f"{field}: {exc}", param=param) from exc
    raise APIError(f"{field} is not a constraint", param=param)


def _json_text(value: str | dict) -> str:
    """A JSON schema given as an object or as its JSON text."""
    if isinstance(value, str):
        schema = json.loads(value)
        if not isinstance(schema, dict):
            raise ValueError("the JSON schema must be an object")
        return value
    return json.dumps(value)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are the choices, each a literal (JSON string
    escapes are EBNF's too)."""
    if not choices:
        raise ValueError("choice needs at least one string")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def structural_tag_text(value: str | dict) -> str:
    """A structural tag as xgrammar's current JSON; vLLM's older shape ({"structures": [{begin,
    schema, end}], "triggers": [...]}) is converted as xgrammar converts it."""
    tag = json.loads(value) if isinstance(value, str) else value
    if not isinstance(tag, dict):
        raise ValueError("a structural tag must be a JSON object")
    if "structures" not in tag:
        return value if isinstance(value, str) else json.dumps(value)
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list) or not all(
            isinstance(s, dict) for s in structures):
        raise ValueError("structures must be a list of {begin, schema, end} and triggers a "
                         "list of strings")
    return json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": triggers,
        "tags": [{"type": "tag", "begin": s.get("begin"), "end": s.get("end"),
                  "content": {"type": "json_schema", "json_schema": s.get("schema", {})}}
                 for s in structures]}})


def requested_constraint(body: Any) -> tuple[StructuredOutput | None, str]:
    """The body's constraint and the field that named it ("response_format" when none did);
    two fields naming constraints are a 400, as in vLLM."""
    found: list[tuple[StructuredOutput | None, str]] = []
    response_format = declared(body, "response_format")
    if response_format is not None and response_format.type != "text":
        try:
            found.append((response_format.constraint(), "response_format"))
        except ValueError as exc:
            raise APIError(str(exc), param="response_format") from exc
    if declared(body, "structured_outputs") is not None:
        found.append((_from_structured_outputs(body.structured_outputs), "structured_outputs"))
    for name in GUIDED_FIELDS:
        if declared(body, name) is not None:
            found.append((structured_output(name, getattr(body, name)), name))
    if len(found) > 1:
        names = ", ".join(f for _, f in found)
        raise APIError(f"give one output constraint, not several ({names})", param=found[1][1])
    return found[0] if found else (None, "response_format")


def constraint_field(body: BaseModel) -> str:
    """The field that names the body's constraint (after requested_constraint accepted it)."""
    names = ("structured_outputs", *GUIDED_FIELDS)
    return next((n for n in names if declared(body, n) is not None), "response_format")


def declared(body: BaseModel, name: str, default: Any = None) -> Any:
    """A field the body's model declares; never a same-named extra a client sent (getattr
    would return that)."""
    return getattr(body, name) if name in type(body).model_fields else default


def _from_structured_outputs(so: StructuredOutputs) -> StructuredOutput:
    param = "structured_outputs"
    if so.backend is not None and so.backend not in XGRAMMAR_BACKENDS:
        raise APIError(f"structured_outputs.backend {so.backend!r} is not served: this "
                       "server's structured outputs use xgrammar", param=param)
    for flag in ("disable_any_whitespace", "disable_additional_properties"):
        if getattr(so, flag):
            raise APIError(f"structured_outputs.{flag} is not supported", param=param)
    if so.whitespace_pattern is not None:
        raise APIError("structured_outputs.whitespace_pattern is not supported", param=param)
    values = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
              "structural_tag": so.structural_tag, "json_object": so.json_object or None}
    given = [k for k, v in values.items() if v is not None]
    if len(given) != 1:
        raise APIError("structured_outputs needs exactly one of json, regex, choice, grammar, "
                       f"json_object, structural_tag (got {len(given)})", param=param)
    return structured_output(given[0], values[given[0]], param)
