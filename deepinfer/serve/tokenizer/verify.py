"""Shadow verification: re-encode a sample of prompts with hf in the background, off the request
path.

On the first disagreement the wrapper switches itself to hf for every later call, so a backend bug
costs at most the prompts encoded before its first sampled mismatch was checked.
"""
from __future__ import annotations

import bisect
import hashlib
import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deepinfer.serve.tokenizer.base import PromptTokenizer
from deepinfer.serve.tokenizer.hf import HFTokenizer

logger = logging.getLogger(__name__)

# Upper bounds (seconds) of the encode latency histogram; the last bucket is everything above.
LATENCY_BOUNDS_S = (1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0)


@dataclass(frozen=True)
class Mismatch:
    """A sampled prompt on which the primary backend disagreed with hf (the text is never kept)."""

    backend: str
    sha256: str
    add_special_tokens: bool
    first_difference: int
    primary_len: int
    hf_len: int


@dataclass(frozen=True)
class _Check:
    text: str
    add_special_tokens: bool
    ids: list[int]


class VerifiedTokenizer:
    """Serve `primary`'s ids; check a random `rate` of prompts against hf on one worker thread.

    The check queue holds at most `queue_size` prompts; a sampled prompt that finds it full is not
    checked and counted as dropped. On a mismatch the prompt's sha256 is logged, `on_mismatch` is
    called (from the worker thread) and every later encode uses hf; `name` becomes "hf". An
    exception from the primary falls back to hf for that call only (counted as primary_errors).
    """

    def __init__(
        self,
        primary: PromptTokenizer,
        hf_tokenizer: Any,
        rate: float = 0.005,
        on_mismatch: Callable[[Mismatch], None] | None = None,
        seed: int | None = None,
        queue_size: int = 16,
    ) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {rate}")
        self.primary = primary
        self.rate = rate
        self._hf = HFTokenizer(hf_tokenizer)
        self._verifying = primary.name != self._hf.name and rate > 0  # hf needs no checking
        self._on_mismatch = on_mismatch
        self._rng = random.Random(seed)
        self._queue: queue.Queue[_Check | None] = queue.Queue(maxsize=max(1, queue_size))
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._worker: threading.Thread | None = None
        self._closed = False
        self._pending = 0
        self._switched = False
        self._counts = dict.fromkeys(
            ("encodes", "checks", "mismatches", "dropped", "check_errors", "primary_errors"), 0)
        self._latency = [0] * (len(LATENCY_BOUNDS_S) + 1)
        self._latency_sum_s = 0.0

    @property
    def name(self) -> str:
        return self._hf.name if self._switched else self.primary.name

    @property
    def switched(self) -> bool:
        return self._switched

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        start = time.perf_counter()
        ids = self._encode(text, add_special_tokens)
        elapsed = time.perf_counter() - start
        with self._lock:
            self._counts["encodes"] += 1
            self._latency[bisect.bisect_left(LATENCY_BOUNDS_S, elapsed)] += 1
            self._latency_sum_s += elapsed
            sampled = (self._verifying and not self._switched and not self._closed
                       and self._rng.random() < self.rate)
        if sampled:
            self._schedule(_Check(text, add_special_tokens, list(ids)))
        return ids

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._switched:
            return self._hf.encode(text, add_special_tokens)
        try:
            return self.primary.encode(text, add_special_tokens=add_special_tokens)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # a Rust panic is a BaseException; the caller gets hf's ids
            with self._lock:
                self._counts["primary_errors"] += 1
            # The type only: an exception's message may quote the prompt.
            logger.warning("prompt tokenizer %s raised %s on prompt sha256=%s; used hf for it",
                           self.primary.name, type(exc).__name__, _sha256(text))
            return self._hf.encode(text, add_special_tokens)

    def _schedule(self, check: _Check) -> None:
        with self._lock:
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._run, name="prompt-tokenizer-verify", daemon=True)
                self._worker.start()
            self._pending += 1
        try:
            self._queue.put_nowait(check)
        except queue.Full:
            with self._lock:
                self._pending -= 1
                self._counts["dropped"] += 1
                self._idle.notify_all()

    def _run(self) -> None:
        while (check := self._queue.get()) is not None:
            try:
                self._check(check)
            except Exception:
                with self._lock:
                    self._counts["check_errors"] += 1
                logger.exception("prompt tokenizer verification failed to run")
            finally:
                with self._lock:
                    self._pending -= 1
                    self._idle.notify_all()

    def _check(self, check: _Check) -> None:
        expected = self._hf.encode(check.text, check.add_special_tokens)
        with self._lock:
            self._counts["checks"] += 1
        if expected == check.ids:
            return
        first = next((i for i, (a, b) in enumerate(zip(check.ids, expected)) if a != b),
                     min(len(check.ids), len(expected)))
        mismatch = Mismatch(self.primary.name, _sha256(check.text), check.add_special_tokens,
                            first, len(check.ids), len(expected))
        with self._lock:
            self._counts["mismatches"] += 1
            self._switched = True
        logger.warning(
            "prompt tokenizer %s disagrees with hf on prompt sha256=%s (add_special_tokens=%s, "
            "%d vs %d ids, first difference at %d); switching to hf",
            mismatch.backend, mismatch.sha256, mismatch.add_special_tokens, mismatch.primary_len,
            mismatch.hf_len, mismatch.first_difference)
        if self._on_mismatch is not None:
            try:
                self._on_mismatch(mismatch)
            except Exception:
                logger.exception("on_mismatch callback failed")

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every scheduled check has finished; False if `timeout` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Stop scheduling checks and let the worker finish the queued ones, then exit."""
        with self._lock:
            self._closed = True
            worker = self._worker
        if worker is not None:
            try:
                self._queue.put(None, timeout=timeout)
            except queue.Full:
                return
            worker.join(timeout)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "name": self.name,
                "primary": self.primary.name,
                "switched": self._switched,
                "rate": self.rate,
                **self._counts,
                "pending": self._pending,
                "encode_latency": {
                    "bounds_s": list(LATENCY_BOUNDS_S),
                    "counts": list(self._latency),
                    "count": self._counts["encodes"],
                    "sum_s": self._latency_sum_s,
                },
            }

    def __enter__(self) -> VerifiedTokenizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
