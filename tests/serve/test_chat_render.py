"""Chat rendering: a checkpoint's encoding.py runs only with --trust-remote-code, and then wins
over its Jinja template."""
from __future__ import annotations

import json

import pytest

from deepinfer.serve.chat import ChatFormat, render_chat, tool_call_constraint
from deepinfer.serve.deepseek_encoding import BOS


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
    assert tool_call_constraint(tools, "auto") is None
