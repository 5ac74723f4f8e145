"""The reference backend: the HF tokenizer itself."""
from __future__ import annotations

import sys
from typing import Any

from deepinfer.serve.settings import transformers_quiet


def import_transformers() -> None:
    """Import transformers' tokenizer classes with torch hidden, unless either is loaded
    already: transformers imports torch whenever it is installed (~200 MB resident), and the
    API process runs no model. transformers then caches torch as unavailable; torch itself
    stays importable (xgrammar's grammar compiler needs it for constrained requests). Call it
    before other threads start: it changes sys.modules for the whole process meanwhile."""
    if "torch" in sys.modules or "transformers" in sys.modules:
        return
    sys.modules["torch"] = None  # find_spec and import both see no torch
    try:
        # Its "PyTorch was not found" advice would tell a user torch is missing when it is not.
        with transformers_quiet():
            from transformers import AutoTokenizer  # noqa: F401 - the import is the point
    finally:
        del sys.modules["torch"]


class HFTokenizer:
    """Encodes with `hf_tokenizer.encode`; exact by definition, and the slowest backend."""

    name = "hf"

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf_tokenizer = hf_tokenizer

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
