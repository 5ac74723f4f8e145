"""Pick the fastest prompt tokenizer backend that reproduces `hf_tokenizer.encode` exactly.

"auto" tries fastokens, then segment, then falls back to hf. A backend is chosen only if it builds
(no UnsupportedTokenizer) and gives hf's ids on every probe with both add_special_tokens values.
Probes are built from the tokenizer's own added tokens and chat template, where backends
usually go wrong: added tokens at the start/end, adjacent, inside words, next to whitespace and
newlines (lstrip/rstrip/single_word/normalized), partial tokens, unicode and code.
"""
from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from deepinfer.serve.tokenizer.base import PromptTokenizer, UnsupportedTokenizer
from deepinfer.serve.tokenizer.hf import HFTokenizer

BACKENDS = ("auto", "fastokens", "segment", "hf")
_AUTO_ORDER = ("fastokens", "segment")
DEFAULT_CACHE_BYTES = 512 << 20
_MAX_PROBE_TOKENS = 40


@dataclass(frozen=True)
class ProbeResult:
    """Why a backend was (not) chosen; build_s and probe_s time its construction and probes."""

    backend: str
    ok: bool
    reason: str
    build_s: float = 0.0
    probe_s: float = 0.0


def select_prompt_tokenizer(
    hf_tokenizer: Any,
    backend: str = "auto",
    cache_bytes: int = DEFAULT_CACHE_BYTES,
    probes: Sequence[str] | None = None,
) -> tuple[PromptTokenizer, list[ProbeResult]]:
    """Return (tokenizer, probe results in the order tried).

    `backend` "hf", "fastokens" or "segment" forces one; a forced backend that cannot be built or
    fails a probe raises ValueError. `cache_bytes` sizes the segment backend's cache. `probes`
    replaces the generated probe texts.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown prompt tokenizer backend {backend!r}; choose one of {BACKENDS}")
    if backend == "hf":
        return HFTokenizer(hf_tokenizer), [ProbeResult("hf", True, "forced; the reference itself")]
    texts = list(probes) if probes is not None else build_probes(hf_tokenizer)
    reference = _Reference(hf_tokenizer)
    results: list[ProbeResult] = []
    for name in (_AUTO_ORDER if backend == "auto" else (backend,)):
        tokenizer, result = _try_backend(name, hf_tokenizer, cache_bytes, texts, reference)
        results.append(result)
        if tokenizer is not None:
            return tokenizer, results
        if backend != "auto":
            raise ValueError(f"prompt tokenizer backend {name!r} is unusable: {result.reason}")
    results.append(ProbeResult("hf", True, "fallback; the reference itself"))
    return HFTokenizer(hf_tokenizer), results


def build_backend(name: str, hf_tokenizer: Any,
                  cache_bytes: int = DEFAULT_CACHE_BYTES) -> PromptTokenizer:
    """Construct one backend without probing; raises UnsupportedTokenizer if it refuses.

    `cache_bytes` sizes the segment backend's cache; fastokens is built without its own cache.
    """
    if name == "hf":
        return HFTokenizer(hf_tokenizer)
    if name == "fastokens":
        from deepinfer.serve.tokenizer.fastokens_backend import FastokensTokenizer

        return FastokensTokenizer(hf_tokenizer)
    if name == "segment":
        try:
            from deepinfer.serve.tokenizer.segment import SegmentTokenizer
        except ImportError as exc:
            raise UnsupportedTokenizer(f"segment backend unavailable ({exc})") from exc
        return SegmentTokenizer(hf_tokenizer, cache_bytes=cache_bytes)
    raise ValueError(f"unknown prompt tokenizer backend {name!r}")


class _Reference:
    """hf ids per (probe, add_special_tokens), computed once and shared by all backends."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self._hf = hf_tokenizer
        self._ids: dict[tuple[str, bool], list[int]] = {}

    def ids(self, text: str, add_special_tokens: bool) -> list[int]:
        key = (text, add_special_tokens)
        if key not in self._ids:
            self._ids[key] = self._hf.encode(text, add_special_tokens=add_special_tokens)
        return self._ids[key]


def _try_backend(name: str, hf_tokenizer: Any, cache_bytes: int, texts: Sequence[str],
                 reference: _Reference) -> tuple[PromptTokenizer | None, ProbeResult]:
    start = time.perf_counter()
    try:
        tokenizer = build_backend(name, hf_tokenizer, cache_bytes)
    except UnsupportedTokenizer as exc:
        return None, ProbeResult(name, False, f"unsupported: {exc}", time.perf_counter() - start)
    built = time.perf_counter()
    failure = _first_failure(tokenizer, texts, reference)
    reason = failure or f"equal to hf on {len(texts)} probes, with and without special tokens"
    result = ProbeResult(name, failure is None, reason, built - start, time.perf_counter() - built)
    if failure is not None:
        return None, result
    clear = getattr(tokenizer, "clear", None)  # a cache starts empty, not full of probes
    if callable(clear):
        clear()
    return tokenizer, result


def _first_failure(tokenizer: PromptTokenizer, texts: Sequence[str],
                   reference: _Reference) -> str | None:
    for add_special_tokens in (False, True):
        for text in texts:
            expected = reference.ids(text, add_special_tokens)
            try:
                got = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # a Rust panic is a BaseException; it is a failed probe
                return f"raised {type(exc).__name__}: {exc} on probe {_show(text)}"
            if got != expected:
                at = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b),
                          min(len(got), len(expected)))
                return (f"ids differ from hf on probe {_show(text)} (add_special_tokens="
                        f"{add_special_tokens}) at token {at}: hf {expected[at:at + 4]}, "
                        f"{tokenizer.name} {got[at:at + 4]}")
    return None


def _show(text: str, limit: int = 80) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} chars)"


# ----------------------------------------------------------------------------------------- probes

_GENERIC = (
    "", " ", "  ", "\n", "\n\n\n", "\t", " \t \n", "\r\n", "\r\n\r\n  x",
    "Hello, world!", "  leading and trailing spaces  ", "HELLO hello Hello hElLo",
    "line one\nline two\r\nline three\n\n    indented\n\t\ttabbed\n",
    "héllo wörld — naïve café, straße, ﬁne, Ωmega ≈ ∑ √2",
    "日本語のテキスト、中文文本。한국어 텍스트 العربية עברית ไทย हिन्दी",
    "emoji 🤖👍🏽 👨\u200d👩\u200d👧 🇫🇷 ✨",
    "combining e\u0301 a\u0308 o\u0303; zero width a\u200bb\u200dc\ufeffd; nbsp a\u00a0b\u3000c",
    "control \x00 \x01 \x1b[31m \x7f end",
    "".join(map(chr, range(0x80))),  # every ASCII byte, controls included
    "".join(map(chr, range(0x80, 0x800, 7))),  # every UTF-8 continuation byte and 2-byte lead
    # every 3- and 4-byte UTF-8 lead byte
    "".join(chr(c) for c in range(0x800, 0x110000, 0x1000) if not 0xD800 <= c < 0xE000),
    "numbers 0 12 345 6789 1234567890 3.14159 -2.5e-10 0x1F 1,000,000",
    "def f(x):\n    return {'a': [x, x ** 2]}  # comment\n\nclass A:\n\tpass\n",
    'for (int i = 0; i < n; ++i) { s += a[i]; }\n#include <stdio.h>\nprintf("%d\\n", s);',
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}',
    "<html><body><div class=\"x\">&amp; &lt;tag&gt;</div></body></html>",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa !!!???... ---- ____ ====",
    "don't won't I'm you're it's we'll they've",
    " " * 33 + "x" + "\n" * 7 + "y",
    "https://example.com/path?q=1&r=two#frag user@example.com",
)

# Each renders a probe around an added token `t`, with a second one `u`.
_AROUND: tuple[Callable[[str, str], str], ...] = (
    lambda t, u: t,
    lambda t, u: f"{t}Hello world",
    lambda t, u: f"Hello world{t}",
    lambda t, u: f"{t}{u}{t}",
    lambda t, u: f"word{t}word",
    lambda t, u: f"a {t} b  {u}  c",
    lambda t, u: f"\n{t}\n\n{u}\t\n",
    lambda t, u: f"  {t}text\n",
    lambda t, u: f"{t} {t}\n{t}",
    lambda t, u: f"x{t[:-1]} {t[1:]}y",
    lambda t, u: f"{t.upper()} {t.lower()}",
    lambda t, u: f"ünï{t}çødé 日本{u}語 🤖",
    lambda t, u: f"def f():\n    return '{t}'\n{u}",
)


def build_probes(hf_tokenizer: Any, max_tokens: int = _MAX_PROBE_TOKENS,
                 seed: int = 0) -> list[str]:
    """Probe texts for this tokenizer: generic edge cases, text around its own added tokens, its
    chat template's rendering of a tool-calling conversation, and all of them joined."""
    tokens = _probe_tokens(hf_tokenizer, max_tokens, seed)
    texts = list(_GENERIC)
    for i, token in enumerate(tokens):
        other = tokens[(i + 1) % len(tokens)]
        texts.extend(render(token, other) for render in _AROUND)
    texts.extend(_chat_renderings(hf_tokenizer))
    texts.append("".join(texts))
    return list(dict.fromkeys(texts))


def _added_tokens(hf_tokenizer: Any) -> list[Any]:
    try:
        decoder = hf_tokenizer.added_tokens_decoder
    except AttributeError:
        return []
    return [decoder[i] for i in sorted(decoder)]


def _probe_tokens(hf_tokenizer: Any, max_tokens: int, seed: int) -> list[str]:
    """Added tokens worth probing: the named specials, those the chat template writes, one of
    every flag combination, then a seeded sample of the rest."""
    added = _added_tokens(hf_tokenizer)
    template = _chat_template_text(hf_tokenizer)
    named = [t for t in getattr(hf_tokenizer, "all_special_tokens", []) if isinstance(t, str)]
    chosen: dict[str, None] = dict.fromkeys(named[:8])
    chosen.update((a.content, None) for a in added if template and a.content in template)
    flags_seen: set[tuple[bool, ...]] = set()
    for token in added:
        flags = tuple(bool(getattr(token, f, False))
                      for f in ("special", "single_word", "lstrip", "rstrip", "normalized"))
        if flags not in flags_seen:
            flags_seen.add(flags)
            chosen[token.content] = None
    rest = [a.content for a in added if a.content not in chosen]
    random.Random(seed).shuffle(rest)
    chosen.update((content, None) for content in rest)
    return [t for t in chosen if t][:max_tokens]


def _chat_template_text(hf_tokenizer: Any) -> str:
    template = getattr(hf_tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(v) for v in template.values())
    return template if isinstance(template, str) else ""


def _chat_renderings(hf_tokenizer: Any) -> list[str]:
    """The chat template applied to a tool-calling conversation (and to a plain one, for
    templates that reject tools); nothing when the tokenizer has no template."""
    if not _chat_template_text(hf_tokenizer):
        return []
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]
    call = {"type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    plain = [
        {"role": "system", "content": "You are terse.\nAnswer in English."},
        {"role": "user", "content": "Weather in Paris?  Use °C.\n\n```py\nprint(1)\n```"},
        {"role": "assistant", "content": "Let me check. 🌦"},
        {"role": "user", "content": "  And tomorrow?\t"},
    ]
    with_tools = plain[:3] + [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "get_weather", "content": '{"temp_c": 21, "sky": "clear"}'},
        plain[3],
    ]
    rendered = []
    for messages, tool_list in ((with_tools, tools), (plain, None)):
        try:
            text = hf_tokenizer.apply_chat_template(
                messages, tools=tool_list, tokenize=False, add_generation_prompt=True)
        except Exception:  # templates differ in what they accept; a probe is optional
            continue
        if isinstance(text, str):
            rendered.append(text)
    return rendered
