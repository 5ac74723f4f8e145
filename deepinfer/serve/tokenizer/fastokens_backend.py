"""fastokens backend: a Rust reimplementation of the HF `tokenizers` pipeline.

Built from the loaded HF tokenizer's own serialization (`backend_tokenizer.to_str()`), so tokens
added after loading and the live post-processor (e.g. `add_bos_token`) come along.
"""
from __future__ import annotations

import threading
from typing import Any

from deepinfer.serve.tokenizer.base import UnsupportedTokenizer


class FastokensTokenizer:
    """`hf_tokenizer.encode` through fastokens.

    Raises UnsupportedTokenizer when fastokens is missing, the tokenizer is not backed by
    `tokenizers` (a slow tokenizer), or fastokens rejects a component (e.g. a Metaspace
    pre-tokenizer). Where fastokens raises but HF carries on (a byte with no token in a BPE
    vocabulary without unk: HF drops it, fastokens refuses the text) that prompt is encoded by
    hf_tokenizer instead, and counted as a fallback. `cache_bytes` > 0 turns on fastokens'
    segment cache (same ids; faster on prompts that repeat the text between added tokens of
    earlier prompts).
    """

    name = "fastokens"

    def __init__(self, hf_tokenizer: Any, cache_bytes: int = 0) -> None:
        try:
            import fastokens
        except ImportError as exc:
            raise UnsupportedTokenizer(f"fastokens is not installed ({exc})") from exc
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise UnsupportedTokenizer(
                f"{type(hf_tokenizer).__name__} has no `tokenizers` backend to serialize")
        try:
            tokenizer = fastokens.Tokenizer.from_json_str(backend.to_str())
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # ValueError when unsupported; a Rust panic is BaseException
            raise UnsupportedTokenizer(f"fastokens cannot load this tokenizer: {exc}") from exc
        # HF's encode() turns truncation and padding off unless asked for; so does this backend.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        if cache_bytes > 0:
            tokenizer.enable_segment_cache(cache_bytes)
        self._tokenizer = tokenizer
        self._hf = hf_tokenizer
        self._fallbacks = 0
        self._lock = threading.Lock()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # As HF's encode: the tokenizer's `split_special_tokens` decides whether special added
        # tokens in the text are matched; add_special_tokens runs the same post-processor.
        split = bool(getattr(self._hf, "split_special_tokens", False))
        try:
            encoding = self._tokenizer.encode(
                text, add_special_tokens=add_special_tokens, split_special_tokens=split)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # ValueError("model error: ..."); a Rust panic is a BaseException
            with self._lock:
                self._fallbacks += 1
            return self._hf.encode(text, add_special_tokens=add_special_tokens)
        return encoding.ids

    def stats(self) -> dict[str, Any]:
        return {"fallbacks": self._fallbacks,
                "segment_cache": self._tokenizer.segment_cache_stats()}
