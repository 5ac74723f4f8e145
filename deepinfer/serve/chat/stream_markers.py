"""Streaming text that may open a marker (a tool call's, a DSML block's): how much of its end
to hold back until the next piece says whether the marker follows."""
from __future__ import annotations

from collections.abc import Sequence

WHITESPACE = " \t\r\n"
MAX_SPACE = 64  # whitespace held back before a possible marker; a bound keeps holding cheap


def holdback(text: str, markers: Sequence[str], with_space: bool = True) -> int:
    """Chars at the end of `text` that could still begin one of `markers`, with the whitespace
    before them when `with_space` (left out of the content if the marker follows)."""
    keep = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), keep, -1):
            if text.endswith(marker[:n]):
                keep = n
                break
    if with_space:
        keep += trailing_space(text[:len(text) - keep])
    return keep


def trailing_space(text: str) -> int:
    """Whitespace chars at the end of `text`, at most MAX_SPACE."""
    n = 0
    while n < min(len(text), MAX_SPACE) and text[-1 - n] in WHITESPACE:
        n += 1
    return n
