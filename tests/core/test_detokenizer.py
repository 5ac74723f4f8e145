"""IncrementalDetokenizer on real tokenizers built offline with the `tokenizers` library.

The main tokenizer is a byte-level BPE (as GPT-2, Llama 3, Qwen, SmolLM2) trained here on a
small corpus, so emoji, CJK and accented letters are split over several tokens. Token
boundaries that a test depends on are fixed by encoding the text in pieces: the ids of
``encode(a) + encode(b)`` decode to ``a + b`` with a token boundary between the two.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from deepinfer.core.detokenizer import IncrementalDetokenizer
from deepinfer.core.sampling import SamplingParams

EOS, IM_START = "<|endoftext|>", "<|im_start|>"
CORPUS = [
    "Hello world, this is a test of the tokenizer.",
    "The quick brown fox jumps over the lazy dog. STOP here and stop there.",
    "café naïve résumé façade Zoë über straße",
    "日本語のテキストです。你好世界，中文文本。한국어 텍스트",
    "emoji 😀 🎉 👍🏽 family 👨‍👩‍👧 flags 🇫🇷 🇯🇵",
    "User: hi\nAssistant: hello\n\nUser: bye",
]
# Characters for random texts: ASCII, accents, CJK, emoji (incl. ZWJ/skin-tone parts).
ALPHABET = "abcdeSTOP .,\n" + "éèüßñ" + "日本語你好世界" + "😀🎉👍🏽👨\u200d👩🇫🇷"


def _byte_level_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=[EOS, IM_START], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False)


TOK = _byte_level_tokenizer()
PROMPT = TOK.encode("User: hi\nAssistant:", add_special_tokens=False)


def enc(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def pieces(*texts: str) -> list[int]:
    """Ids of the concatenated texts, with a token boundary between consecutive texts."""
    return [i for text in texts for i in enc(text)]


def run(ids: list[int], prompt: list[int] | None = None, tokenizer=TOK,
        **params) -> tuple[list[str], str, IncrementalDetokenizer]:
    """Feeds ids one by one; returns the add_token deltas, the flush remainder, the detok."""
    detok = IncrementalDetokenizer(tokenizer, PROMPT if prompt is None else prompt,
                                   SamplingParams(**params))
    deltas = []
    for i in ids:
        delta = detok.add_token(i)
        assert delta != ""  # None, never "", means nothing to emit
        if delta is not None:
            deltas.append(delta)
    return deltas, detok.flush(), detok


def streamed(ids: list[int], **kwargs) -> str:
    deltas, rest, _ = run(ids, **kwargs)
    return "".join(deltas) + rest


def test_multibyte_characters_are_split_over_tokens():
    # The premise of the UTF-8 tests: these characters do not decode token by token.
    for text in ["😀", "👨\u200d👩", "日本語", "🇫🇷"]:
        tokens = TOK.convert_ids_to_tokens(enc(text))
        assert any(TOK.convert_tokens_to_string([t]).endswith("\ufffd") for t in tokens)


@pytest.mark.parametrize("text", [
    "Hello world",
    "emoji 😀 🎉 👍🏽 and a family 👨\u200d👩\u200d👧 🇫🇷🇯🇵",
    "日本語のテキスト 你好世界 한국어",
    "café naïve résumé Zoë straße",
    "mixed: 日本😀é\n\n  spaces   and\ttabs",
])
@pytest.mark.parametrize("prompt", [None, []])
def test_deltas_concatenate_to_decode(text, prompt):
    ids = enc(text)
    deltas, rest, detok = run(ids, prompt=prompt)
    assert "".join(deltas) + rest == TOK.decode(ids) == text
    assert rest == ""  # no stop strings: nothing is held back
    assert not any("\ufffd" in d for d in deltas)
    assert detok.text == text and detok.stopped_by is None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(alphabet=ALPHABET, max_size=40), skip=st.booleans())
def test_random_text_roundtrip(text, skip):
    ids = enc(text)
    deltas, rest, _ = run(ids, skip_special_tokens=skip)
    assert "".join(deltas) + rest == TOK.decode(ids, skip_special_tokens=skip) == text
    assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(0, len(TOK) - 1), max_size=30), skip=st.booleans())
def test_arbitrary_ids_roundtrip(ids, skip):
    # Even ids that do not form valid UTF-8 (as a sampler may produce) stream to what decode
    # gives; an incomplete character at the end comes out of flush() as "\ufffd".
    assert streamed(ids, skip_special_tokens=skip) == TOK.decode(ids, skip_special_tokens=skip)


def test_emoji_waits_for_its_last_byte():
    ids = pieces("a", "😀")
    assert len(ids) > 2
    detok = IncrementalDetokenizer(TOK, PROMPT, SamplingParams())
    assert detok.add_token(ids[0]) == "a"
    for i in ids[1:-1]:
        assert detok.add_token(i) is None
    assert detok.add_token(ids[-1]) == "😀"


def test_incomplete_character_at_end_is_flushed_as_replacement():
    ids = enc("😀")[:-1]
    deltas, rest, _ = run(ids)
    assert deltas == [] and rest == TOK.decode(ids) and rest.endswith("\ufffd")


def test_stop_string_spanning_tokens_truncates():
    ids = pieces("Hello wo", "rld. ST", "OP and more", " text")
    deltas, rest, detok = run(ids, stop=["STOP"])
    assert detok.stopped_by == "STOP"
    assert "".join(deltas) + rest == detok.text == "Hello world. "
    assert rest == ""


def test_stop_string_spanning_three_tokens_with_emoji():
    ids = pieces("see ", "😀", " now")  # 😀 alone is 3 tokens
    deltas, rest, detok = run(ids, stop=["e 😀 n"])
    assert detok.stopped_by == "e 😀 n"
    assert "".join(deltas) + rest == detok.text == "se"


def test_include_stop_str_in_output():
    detok = IncrementalDetokenizer(
        TOK, PROMPT, SamplingParams(stop=["STOP"], include_stop_str_in_output=True))
    out = ["".join(filter(None, map(detok.add_token, enc(piece))))
           for piece in ["Hello wo", "rld. ST", "OP and more"]]
    # A kept stop string needs no hold-back: text is emitted as soon as it is decoded.
    assert out == ["Hello wo", "rld. ST", "OP"]
    assert detok.flush() == "" and detok.text == "Hello world. STOP"
    assert detok.stopped_by == "STOP"


def test_stop_at_the_very_first_token():
    ids = pieces("User", " world")
    assert len(enc("User")) == 1
    detok = IncrementalDetokenizer(TOK, PROMPT, SamplingParams(stop=["User"]))
    assert detok.add_token(ids[0]) is None
    assert detok.stopped_by == "User" and detok.text == ""
    assert detok.add_token(ids[1]) is None  # tokens after a stop are ignored
    assert detok.flush() == "" and detok.text == ""

    deltas, rest, detok = run(ids, stop=["User"], include_stop_str_in_output=True)
    assert deltas == ["User"] and rest == "" and detok.text == "User"


def test_stop_inside_one_token():
    ids = enc("Hello world")
    deltas, rest, detok = run(ids, stop=["ell"])
    assert "".join(deltas) + rest == detok.text == "H"


def test_multiple_stop_strings_earliest_wins():
    ids = pieces("one two ", "three four")
    # Both complete in the same token; "two" starts first.
    _, _, detok = run(ids, stop=["four", "two three"])
    assert detok.stopped_by == "two three" and detok.text == "one "
    # "three" completes a token before "four" is decoded.
    _, _, detok = run(ids, stop=["four", "three"])
    assert detok.stopped_by == "three" and detok.text == "one two "
    # Same start: the shorter one completed first.
    _, _, detok = run(enc("abcdef"), stop=["bcd", "bc"], include_stop_str_in_output=True)
    assert detok.stopped_by == "bc" and detok.text == "abc"


def test_held_back_text_is_emitted_by_flush():
    ids = pieces("The end. ", "ST")
    deltas, rest, detok = run(ids, stop=["STOP"])
    assert "".join(deltas) == "The end. " and rest == "ST"
    assert detok.stopped_by is None and detok.text == "The end. ST"
    assert detok.flush() == ""  # flush is idempotent


def test_held_back_text_is_released_when_it_cannot_start_a_stop():
    detok = IncrementalDetokenizer(TOK, PROMPT, SamplingParams(stop=["\n\nUser:"]))
    # Per piece of text (each one or more tokens): what add_token returned, joined.
    out = ["".join(filter(None, map(detok.add_token, enc(piece))))
           for piece in ["Sure", ".\n", "\n", "Use", "d it"]]
    assert out[0] == "Sure"  # no tail of "Sure" can start the stop string: no wait
    assert out[1:4] == [".", "", ""]
    assert out[4] == "\n\nUsed it"


def test_skip_special_tokens():
    im_start = TOK.convert_tokens_to_ids(IM_START)
    ids = pieces("hi") + [im_start] + pieces(" there") + [TOK.eos_token_id]
    assert streamed(ids, skip_special_tokens=True) == TOK.decode(ids, skip_special_tokens=True) \
        == "hi there"
    assert streamed(ids, skip_special_tokens=False) == TOK.decode(ids) \
        == f"hi{IM_START} there{EOS}"
    # A special token can only match a stop string when it is part of the text.
    _, _, detok = run(ids, stop=[IM_START], skip_special_tokens=False)
    assert detok.stopped_by == IM_START and detok.text == "hi"
    _, _, detok = run(ids, stop=[IM_START], skip_special_tokens=True)
    assert detok.stopped_by is None and detok.text == "hi there"


def test_special_token_between_the_bytes_of_a_character():
    emoji = enc("😀")
    ids = emoji[:1] + [TOK.eos_token_id] + emoji[1:]
    assert streamed(ids, skip_special_tokens=True) == TOK.decode(ids, skip_special_tokens=True) \
        == "😀"
    assert streamed(ids, skip_special_tokens=False) == TOK.decode(ids)


def test_prompt_ending_inside_a_character():
    emoji = enc("😀")
    prompt, output = PROMPT + emoji[:1], emoji[1:] + enc(" ok")
    assert streamed(output, prompt=prompt) == TOK.decode(output)


def _expected_with_stops(ids: list[int], stops: list[str], include: bool) -> tuple[str, str | None]:
    """Oracle: after each token, the text decoded so far (complete characters only) is
    searched for the stop strings; the first token to complete a match ends the output at the
    earliest-starting match (at one position the shortest stop string)."""
    text = ""
    for k in range(1, len(ids) + 1):
        decoded = TOK.decode(ids[:k])
        if decoded.endswith("\ufffd"):
            continue
        text = decoded
        found = [(text.find(s), len(s), s) for s in stops if s in text]
        if found:
            pos, length, stop = min(found)
            return text[:pos + length if include else pos], stop
    return TOK.decode(ids), None


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunks=st.lists(st.text(alphabet="abST .😀日é", max_size=4), max_size=10),
       stops=st.lists(st.text(alphabet="abST .😀日é", min_size=1, max_size=4), max_size=3),
       include=st.booleans())
def test_stop_strings_match_oracle(chunks, stops, include):
    ids = pieces(*chunks)
    deltas, rest, detok = run(ids, stop=stops, include_stop_str_in_output=include)
    expected, stopped_by = _expected_with_stops(ids, stops, include)
    # What was streamed is never taken back: the deltas add up to the final, truncated text.
    assert "".join(deltas) + rest == detok.text == expected
    assert detok.stopped_by == stopped_by
    assert not any("\ufffd" in d for d in deltas)


def test_add_token_after_flush_raises():
    detok = IncrementalDetokenizer(TOK, PROMPT, SamplingParams())
    detok.add_token(enc("a")[0])
    detok.flush()
    with pytest.raises(RuntimeError):
        detok.add_token(enc("b")[0])


def test_metaspace_tokenizer_keeps_leading_space_after_prompt():
    # SentencePiece-style tokenizers drop the leading space of the first token when decoding
    # on their own; decoded after prompt context, the first output token keeps it (as vLLM).
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    sp = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)
    prompt = sp.encode("Hello", add_special_tokens=False)
    output = sp.encode("Hello world, this is a test", add_special_tokens=False)[1:]
    assert sp.decode(output) == "world, this is a test"
    assert streamed(output, prompt=prompt, tokenizer=sp) == " world, this is a test"
    assert streamed(output, prompt=[], tokenizer=sp) == sp.decode(output)


def test_real_smollm2_tokenizer_roundtrip(smollm2_dir):
    """The embedded default model's byte-level BPE tokenizer (converted from its GGUF)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    text = "Streaming 😀 emoji, 日本語 and café; then STOP."
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("Say something:", add_special_tokens=False)
    assert streamed(ids, prompt=prompt, tokenizer=tok) == tok.decode(ids)
    _, _, detok = run(ids, prompt=prompt, tokenizer=tok, stop=["STOP"])
    assert detok.text == text[:text.index("STOP")]
