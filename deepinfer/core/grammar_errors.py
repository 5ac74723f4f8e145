"""xgrammar's error text as a user reads it: one line, without its C++ source locations."""
from __future__ import annotations

import re

# "[08:09:52] /project/cpp/regex_converter.cc:94: " and "Check failed: (cond) is false: "
_LOCATION = re.compile(r"\[\d{1,2}:\d{2}:\d{2}\]\s*\S+\.(?:cc|cpp|h|hpp):\d+:\s*")
_CHECK = re.compile(r"Check failed:\s*\(.*?\)\s*is false:\s*")
_SPACES = re.compile(r"\s+")
MAX_CHARS = 300  # a message that quotes the user's schema back is cut here


def clean_message(exc: BaseException) -> str:
    text = _CHECK.sub("", _LOCATION.sub("", str(exc)))
    text = _SPACES.sub(" ", text).strip() or type(exc).__name__
    return text if len(text) <= MAX_CHARS else text[:MAX_CHARS - 3] + "..."
