"""Chat rendering: a checkpoint's encoding.py wins over its Jinja template."""
from __future__ import annotations

import json

from deepinfer.serve.chat import ChatFormat, render_chat, tool_call_constraint


class _TemplateTokenizer:
    chat_template = "jinja"

    def apply_chat_template(self, messages, **kwargs):
        return "JINJA:" + "|".join(m["content"] for m in messages)


def test_encoding_py_wins_over_the_template(tmp_path):
    (tmp_path / "encoding.py").write_text(
        "def encode_messages(messages, tools=None, **kw):\n"
        "    names = [t['function']['name'] for t in tools or []]\n"
        "    return 'ENC:' + '/'.join(m['content'] for m in messages) + ':' + ','.join(names)\n")
    tools = [{"type": "function", "function": {"name": "f"}}]
    rendered = render_chat(_TemplateTokenizer(), ChatFormat.of(str(tmp_path)),
                           [{"role": "user", "content": "hi"}], tools, "auto")
    assert rendered.prompt == "ENC:hi:f" and rendered.forced_prefix == ""


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
    assert tool_call_constraint(tools, "auto") is None
