"""The reference backend: the HF tokenizer itself."""
from __future__ import annotations

from typing import Any


class HFTokenizer:
    """Encodes with `hf_tokenizer.encode`; exact by definition, and the slowest backend."""

    name = "hf"

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf_tokenizer = hf_tokenizer

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
