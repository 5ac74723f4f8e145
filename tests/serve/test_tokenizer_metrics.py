"""The prompt tokenizer's verification, as /metrics shows it."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from deepinfer.serve.metrics.tokenizer import TokenizerCollector
from deepinfer.serve.tokenizer import HFTokenizer, VerifiedTokenizer


class _WrongIds(HFTokenizer):
    """A backend that corrupts every prompt containing 'cat'."""

    name = "fastokens"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = super().encode(text, add_special_tokens)
        return ids[:-1] if "cat" in text else ids


def _sample(text: str, metric: str) -> float:
    for line in text.splitlines():
        if line.startswith(metric):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{metric} not in metrics")


def test_forced_mismatch_switches_to_hf_and_shows_in_metrics(smollm2_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2_dir)
    tok = VerifiedTokenizer(_WrongIds(hf), hf, rate=1.0, seed=0)
    registry = CollectorRegistry()
    registry.register(TokenizerCollector(tok, "m"))
    try:
        tok.encode("a dog", False)
        tok.encode("a cat", False)  # wrong ids served once, caught in the background
        assert tok.wait_idle(30)
        text = generate_latest(registry).decode()
        assert _sample(text, 'deepinfer_tokenizer:backend{backend="hf",model_name="m"}') == 1
        assert _sample(text, 'deepinfer_tokenizer:verify_mismatches_total') == 1
        assert _sample(text, 'deepinfer_tokenizer:verify_checks_total') == 2
        assert _sample(text, 'deepinfer_tokenizer:encode_seconds_count') == 2
        assert tok.encode("a cat", False) == hf.encode("a cat", add_special_tokens=False)
    finally:
        tok.close()
