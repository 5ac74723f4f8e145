"""The `segment` backend: HF ids, with each piece between added tokens encoded once and cached.

HF (tokenizers' AddedVocabulary.extract_and_normalize) first cuts the raw text at added tokens,
special or not, then normalizes, pre-tokenizes and encodes every piece on its own: splitting the
same way and encoding the pieces alone gives the same ids, unless a setting makes a piece depend
on its place in the text (check_exact refuses those). Clients resend the whole conversation each
turn: earlier pieces come from a byte-bounded LRU cache, only what the turn adds is encoded.
"""
from __future__ import annotations

import json
import re
import sys
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Tokenizer

from deepinfer.serve.tokenizer.base import UnsupportedTokenizer

# What lstrip/rstrip tokens swallow: Rust regex `\s` = White_Space (str.isspace adds U+001C-1F).
_WHITESPACE = frozenset("\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000"
                        + "".join(map(chr, range(0x2000, 0x200B))))
_LEADING_SPACE = re.compile(f"[{re.escape(''.join(sorted(_WHITESPACE)))}]*")
# HF's encode path; a tokenizer class that overrides it in Python may change the text first.
_HF_ENCODE_MODULES = ("transformers.tokenization_utils_base",
                      "transformers.tokenization_utils_tokenizers")


@dataclass(frozen=True)
class _Matcher:
    """One pass of HF's added-token split: leftmost-longest matching, as its Aho-Corasick does."""

    pattern: re.Pattern[str]
    ids: dict[str, int]
    lstrip: frozenset[str]
    rstrip: frozenset[str]

    @classmethod
    def build(cls, tokens: list[AddedToken], backend: Tokenizer) -> _Matcher | None:
        if not tokens:
            return None
        return cls(re.compile(_trie_pattern([t.content for t in tokens])),
                   {t.content: backend.token_to_id(t.content) for t in tokens},  # as HF maps it
                   frozenset(t.content for t in tokens if t.lstrip),
                   frozenset(t.content for t in tokens if t.rstrip))

    def split(self, text: str) -> list[str | int]:
        """text's pieces (str) and added-token ids (int), mirroring HF's find_matches."""
        out: list[str | int] = []
        pos = 0
        for match in self.pattern.finditer(text):
            start, stop = match.span()
            content = match.group()
            if content in self.lstrip:  # takes the whitespace before it that no match took yet
                while start > pos and text[start - 1] in _WHITESPACE:
                    start -= 1
            if content in self.rstrip:
                stop = _LEADING_SPACE.match(text, stop).end()
            if pos < start:
                out.append(text[pos:start])
            out.append(self.ids[content])
            pos = stop
        if pos < len(text):
            out.append(text[pos:])
        return out


def _trie_pattern(words: list[str]) -> str:
    """Leftmost-longest match of any word; prefixes shared, so the regex engine does not try
    every word at every position as it would a flat alternation."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}

    def emit(node: dict[str, Any]) -> str:
        alternatives = [re.escape(c) + emit(child) for c, child in sorted(node.items()) if c]
        body = "|".join(alternatives) if len(alternatives) < 2 else f"(?:{'|'.join(alternatives)})"
        return f"(?:{body})?" if "" in node and body else body  # greedy: a longer token wins

    return emit(trie)


def _is_identity(normalizer: dict[str, Any]) -> bool:
    """An empty Sequence of normalizers (DeepSeek-V4's), or one of only such Sequences."""
    return normalizer["type"] == "Sequence" and all(map(_is_identity, normalizer["normalizers"]))


@dataclass(frozen=True)
class _Plan:
    backend: Tokenizer
    passes: tuple[_Matcher, ...]
    prefix: list[int]
    suffix: list[int]


def _plan(hf_tokenizer: Any) -> _Plan | str:
    """The split plan for hf_tokenizer, or why splitting it at added tokens would not be exact."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        return "not a fast tokenizer (no tokenizers backend)"
    for method in ("encode", "_encode_plus"):
        owner = next(c for c in type(hf_tokenizer).__mro__ if method in vars(c))
        if owner.__module__ not in _HF_ENCODE_MODULES:
            return f"{owner.__name__} overrides {method} in Python"
    if getattr(hf_tokenizer, "split_special_tokens", False):
        return "split_special_tokens=True (specials are matched, then kept as text)"
    added = list(backend.get_added_tokens_decoder().values())
    if any(t.single_word for t in added):
        return "an added token has single_word=True (whether it matches depends on its neighbours)"
    normalized = [t for t in added if t.normalized]
    if normalized and backend.normalizer is not None and not _is_identity(
            json.loads(backend.normalizer.__getstate__())):
        return "normalized added tokens with a normalizer (matched in normalized, not raw, text)"
    # Only Metaspace has a prepend_scheme; Sequence members are serialized inline (compact JSON).
    pre_tokenizer = b"" if backend.pre_tokenizer is None else backend.pre_tokenizer.__getstate__()
    if b'"prepend_scheme":"first"' in pre_tokenizer:
        return "Metaspace prepend_scheme='first' (only the piece at offset 0 gets the prefix)"
    if getattr(backend.model, "dropout", None):
        return "BPE dropout makes encoding random"
    try:  # a private copy: HF's encode leaves its padding/truncation settings on the backend
        copy = Tokenizer.from_str(backend.to_str())
    except Exception as error:  # a custom Python component cannot be serialized
        return f"the backend cannot be copied: {error}"
    copy.no_padding()
    copy.no_truncation()
    copy.encode_special_tokens = False
    passes = (_Matcher.build([t for t in added if not t.normalized], copy),
              _Matcher.build(normalized, copy))
    try:
        core = copy.encode("Hello world", add_special_tokens=False)
        full = copy.post_process(core, None, True)  # what HF does for add_special_tokens=True
    except Exception as error:  # e.g. a WordLevel model without an unknown token
        return f"the post-processor probe failed: {error}"
    content = [i for i, seq in enumerate(full.sequence_ids) if seq is not None]
    if not content or full.ids[content[0]:content[-1] + 1] != core.ids:
        return "the post-processor changes the text's own ids"
    return _Plan(copy, tuple(m for m in passes if m is not None),
                 full.ids[:content[0]], full.ids[content[-1] + 1:])


class SegmentTokenizer:
    """Exactly hf_tokenizer.encode, with the pieces between added tokens cached (LRU, bytes)."""

    name = "segment"

    def __init__(self, hf_tokenizer: Any, cache_bytes: int = 512 << 20) -> None:
        plan = _plan(hf_tokenizer)
        if isinstance(plan, str):
            raise UnsupportedTokenizer(plan)
        self._plan = plan
        self._capacity = cache_bytes
        self._cache: OrderedDict[str, array[int]] = OrderedDict()
        self._cached_bytes = self._hits = self._misses = 0
        self._lock = threading.Lock()
        if (reason := self._self_check(hf_tokenizer)) is not None:
            raise UnsupportedTokenizer(reason)
        self.clear()

    @staticmethod
    def check_exact(hf_tokenizer: Any) -> str | None:
        """None when segment encodes hf_tokenizer exactly, else the reason it cannot."""
        try:
            SegmentTokenizer(hf_tokenizer, cache_bytes=0)
        except UnsupportedTokenizer as error:
            return str(error)
        return None

    @staticmethod
    def entry_bytes(piece: str, ids: array[int]) -> int:
        """What one cache entry counts against cache_bytes: the key's and the ids' memory."""
        return sys.getsizeof(piece) + sys.getsizeof(ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        parts = self.split(text)
        found = self._lookup([p for p in parts if isinstance(p, str)])
        ids: list[int] = []
        for part in parts:
            if isinstance(part, str):
                ids.extend(found[part])
            else:
                ids.append(part)
        return [*self._plan.prefix, *ids, *self._plan.suffix] if add_special_tokens else ids

    def split(self, text: str) -> list[str | int]:
        """text as HF's added-token extraction cuts it: text pieces and added-token ids."""
        parts: list[str | int] = [text] if text else []
        for matcher in self._plan.passes:  # non-normalized tokens first, then normalized ones
            parts = [q for p in parts for q in (matcher.split(p) if isinstance(p, str) else (p,))]
        return parts

    def stats(self) -> dict[str, int]:
        """hits/misses count text pieces (a miss is one encoded); bytes as entry_bytes counts."""
        with self._lock:
            return {"hits": self._hits, "misses": self._misses, "cached_bytes": self._cached_bytes,
                    "entries": len(self._cache), "capacity_bytes": self._capacity}

    def clear(self) -> None:
        """Drop every cached piece and zero the counters."""
        with self._lock:
            self._cache.clear()
            self._cached_bytes = self._hits = self._misses = 0

    def _lookup(self, pieces: list[str]) -> dict[str, array[int]]:
        """The ids of every piece: cached ones, then the missing ones encoded in one batch."""
        unique = list(dict.fromkeys(pieces))
        found: dict[str, array[int]] = {}
        with self._lock:
            for piece in unique:
                if (ids := self._cache.get(piece)) is not None:
                    self._cache.move_to_end(piece)
                    found[piece] = ids
            missing = [p for p in unique if p not in found]
            self._misses += len(missing)  # pieces encoded; every other occurrence is a hit
            self._hits += len(pieces) - len(missing)
        encodings = self._plan.backend.encode_batch_fast(missing, add_special_tokens=False)
        with self._lock:
            for piece, encoding in zip(missing, encodings):
                found[piece] = ids = array("I", encoding.ids)
                self._insert(piece, ids)
        return found

    def _insert(self, piece: str, ids: array[int]) -> None:
        size = self.entry_bytes(piece, ids)
        if size > self._capacity or piece in self._cache:
            return
        self._cache[piece] = ids
        self._cached_bytes += size
        while self._cached_bytes > self._capacity:
            old_piece, old_ids = self._cache.popitem(last=False)
            self._cached_bytes -= self.entry_bytes(old_piece, old_ids)

    def _self_check(self, hf_tokenizer: Any) -> str | None:
        """Compare with HF on texts holding every added token between words and whitespace."""
        tokens = [content for matcher in self._plan.passes for content in matcher.ids]
        for text in ("", "a", "Hi\n", " x".join(tokens) + " \n", "\n a".join(tokens) + "b\t"):
            for special in (False, True):
                try:
                    expected = hf_tokenizer.encode(text, add_special_tokens=special)
                    if self.encode(text, special) != expected:
                        return f"self-check: ids differ from HF encode on {text[:60]!r}"
                except Exception as error:
                    return f"self-check failed on {text[:60]!r}: {error}"
        return None
