"""Chat rendering: a checkpoint's encoding.py runs only with --trust-remote-code, and then wins
over its Jinja template."""
from __future__ import annotations

import json

import pytest

from deepinfer.serve.chat.deepseek_encoding import BOS
from deepinfer.serve.chat.format import ChatFormat, render_chat
from deepinfer.serve.chat.tool_parsers import ForcedShape, is_forced
from deepinfer.serve.chat.tool_parsers.hermes import HermesParser


def tool_call_constraint(tools, tool_choice):
    return HermesParser().constraint(tools, tool_choice, ForcedShape())


class _TemplateTokenizer:
    chat_template = "jinja"

    def apply_chat_template(self, messages, **kwargs):
        return "JINJA:" + "|".join(m["content"] for m in messages)


def _plant_encoder(folder, marker) -> None:
    """An encoding.py that leaves a file behind the moment it is imported."""
    (folder / "encoding.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "def encode_messages(messages, tools=None, **kw):\n"
        "    names = [t['function']['name'] for t in tools or []]\n"
        "    return 'ENC:' + '/'.join(m['content'] for m in messages) + ':' + ','.join(names)\n")


def test_encoding_py_wins_over_the_template_when_trusted(tmp_path):
    marker = tmp_path / "ran"
    _plant_encoder(tmp_path, marker)
    tools = [{"type": "function", "function": {"name": "f"}}]
    chat = ChatFormat.of(str(tmp_path), trust_remote_code=True)
    assert marker.exists()
    rendered = render_chat(_TemplateTokenizer(), chat,
                           [{"role": "user", "content": "hi"}], tools, "auto")
    assert rendered.prompt == "ENC:hi:f" and rendered.forced_prefix == ""
    assert "--trust-remote-code" in chat.describe(str(tmp_path))


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v4"])
def test_encoding_py_never_runs_untrusted(tmp_path, model_type):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    marker = tmp_path / "ran"
    _plant_encoder(tmp_path, marker)
    chat = ChatFormat.of(str(tmp_path))
    rendered = render_chat(_TemplateTokenizer(), chat, [{"role": "user", "content": "hi"}],
                           None, None)
    assert not marker.exists()
    # llama: the tokenizer's template; DeepSeek-V4: DeepInfer's own encoding of its turns.
    assert rendered.prompt == ("JINJA:hi" if model_type == "llama"
                               else BOS + "<｜User｜>hi<｜Assistant｜></think>")
    assert "encoding.py is not run (pass --trust-remote-code" in chat.describe(str(tmp_path))


def test_template_used_without_encoding_py(tmp_path):
    rendered = render_chat(_TemplateTokenizer(), ChatFormat.of(str(tmp_path)),
                           [{"role": "user", "content": "hi"}], None, None)
    assert rendered.prompt == "JINJA:hi"


def test_named_tool_choice_forces_the_call_and_its_schema(tmp_path):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}},
             {"type": "function", "function": {"name": "g"}}]
    choice = {"type": "function", "function": {"name": "f"}}
    rendered = render_chat(_TemplateTokenizer(), ChatFormat.of(str(tmp_path)),
                           [{"role": "user", "content": "hi"}], tools, choice)
    assert rendered.prompt.endswith("<tool_call>\n")
    schema = json.loads(tool_call_constraint(tools, choice).spec)
    assert schema["properties"]["name"] == {"const": "f"}
    assert schema["properties"]["arguments"]["properties"]["x"] == {"type": "integer"}
    both = json.loads(tool_call_constraint(tools, "required").spec)
    assert [o["properties"]["name"]["const"] for o in both["anyOf"]] == ["f", "g"]
    assert not is_forced("auto") and tool_call_constraint(tools, choice).compact


def test_tool_schemas_with_defs_resolve_from_the_call_schema():
    """pydantic writes nested models to $defs; under properties.arguments their #/$defs refs
    would dangle, so they move to the root, named apart per tool."""
    import xgrammar as xgr

    def tool(name, field):
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}},
            "required": ["where"],
            "$defs": {"Place": {"type": "object", "properties": {field: {"type": "string"}},
                                "required": [field]}}}}}

    tools = [tool("f", "city"), tool("g", "street")]
    for choice in ("required", {"type": "function", "function": {"name": "g"}}):
        schema = json.loads(tool_call_constraint(tools, choice).spec)
        xgr.Grammar.from_json_schema(json.dumps(schema))  # every $ref resolves
    both = json.loads(tool_call_constraint(tools, "required").spec)
    assert set(both["$defs"]) == {"t0_Place", "t1_Place"}
    refs = [o["properties"]["arguments"]["properties"]["where"]["$ref"] for o in both["anyOf"]]
    assert refs == ["#/$defs/t0_Place", "#/$defs/t1_Place"]
    assert both["$defs"]["t1_Place"]["required"] == ["street"]


class _ContentTemplate:
    """Reads message['content'] of every turn and knows nothing of tool calls (as SmolLM2's)."""
    chat_template = "{{ message['content'] }}"

    def apply_chat_template(self, messages, **kwargs):
        return "|".join(f"{m['role']}:{m['content']}" for m in messages)


def test_an_agents_tool_turn_renders_with_a_template_that_knows_no_tool_calls(tmp_path):
    from deepinfer.serve.api.protocol import ChatMessage

    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    turns = [ChatMessage(role="user", content="Weather?"),
             ChatMessage(role="assistant", content=None, tool_calls=[call]),
             ChatMessage(role="tool", tool_call_id="c1", content="Sunny")]
    rendered = render_chat(_ContentTemplate(), ChatFormat.of(str(tmp_path)),
                           [t.for_template() for t in turns], None, None)
    assert rendered.prompt == ('user:Weather?|assistant:<tool_call>\n{"name": "get_weather", '
                               '"arguments": {"city": "Paris"}}\n</tool_call>|tool:Sunny')


def test_malformed_definitions_in_tool_parameters_are_a_value_error():
    """A user error (the route answers 400), not an AttributeError (a 500)."""
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"$defs": ["x"]}}}]
    with pytest.raises(ValueError, match=r"f's parameters.\$defs must be an object"):
        tool_call_constraint(bad, "required")
