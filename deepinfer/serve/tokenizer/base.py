"""The prompt tokenizer contract: exactly the ids of the HF tokenizer's encode, faster."""
from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class PromptTokenizer(Protocol):
    """A backend that turns prompt text into token ids.

    encode(text, add_special_tokens) must equal
    hf_tokenizer.encode(text, add_special_tokens=add_special_tokens) for every input; backends
    that cannot promise it for a tokenizer refuse to build (raise UnsupportedTokenizer).
    """

    name: str

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...


class UnsupportedTokenizer(ValueError):
    """This backend cannot reproduce this tokenizer exactly; the reason says why."""
