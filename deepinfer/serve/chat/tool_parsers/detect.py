"""Which tool-call parser a checkpoint needs, found from its files when the server starts:
what its chat template writes for a call, else the special tokens its tokenizer has, else its
config's model_type; Hermes where nothing tells (the form this server writes into templates
that render no tool calls)."""
from __future__ import annotations

import json
import os
from typing import Any

from deepinfer.serve.chat.deepseek_encoding import uses_dsml

# Markers a family writes, most specific first (a DeepSeek template also speaks of JSON).
MARKERS = (("<｜tool▁calls▁begin｜>", "deepseek_v3"), ("<｜tool▁call▁begin｜>", "deepseek_v3"),
           ("[TOOL_CALLS]", "mistral"), ("<tool_call>", "hermes"),
           ("<|python_tag|>", "llama3_json"))
MODEL_TYPES = {"deepseek_v3": "deepseek_v3", "qwen2": "hermes", "qwen2_moe": "hermes",
               "qwen3": "hermes", "qwen3_moe": "hermes"}
DEFAULT = "hermes"


def detect(model_dir: str) -> tuple[str, str]:
    """The parser's name and why it was picked (for the start-up log)."""
    if uses_dsml(model_dir):
        return "deepseek_v4", "the checkpoint answers in DSML"
    template = chat_template(model_dir)
    for marker, name in MARKERS:
        if marker in template:
            return name, f"the chat template writes {marker}"
    tokens = special_tokens(model_dir)
    for marker, name in MARKERS:
        if marker in tokens:
            return name, f"the tokenizer has {marker}"
    model_type = _config(model_dir).get("model_type")
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type], f"model_type {model_type}"
    return DEFAULT, "the default: nothing in the checkpoint names a format"


def chat_template(model_dir: str) -> str:
    """The text of every chat template the checkpoint ships ("" if none)."""
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = _json(os.path.join(model_dir, "tokenizer_config.json")).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        return "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return template if isinstance(template, str) else ""


def special_tokens(model_dir: str) -> set[str]:
    tokens = {t.get("content") for t in _json(os.path.join(model_dir, "tokenizer.json")).get(
        "added_tokens", []) if isinstance(t, dict)}
    decoder = _json(os.path.join(model_dir, "tokenizer_config.json")).get(
        "added_tokens_decoder", {})
    if isinstance(decoder, dict):
        tokens |= {t.get("content") for t in decoder.values() if isinstance(t, dict)}
    return {t for t in tokens if isinstance(t, str)}


def _config(model_dir: str) -> dict:
    return _json(os.path.join(model_dir, "config.json"))


def _json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            found = json.load(f)
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}
