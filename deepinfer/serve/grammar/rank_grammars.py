"""A rank's grammars for server requests, prepared off its step loop.

A constrained request waits here while a background thread loads the grammar its API process
compiled (or compiles it, where none came: xgrammar writes some grammars out at a size that
grows with rules x states, and the grammar workers then send none). The step loop goes on with
the other requests and adds the request once its grammar is ready. xgrammar's load and compile
run without the GIL, so neither the step loop nor the heartbeat thread waits on them.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from deepinfer.core.engine import Engine
from deepinfer.core.sampling import StructuredOutput
from deepinfer.serve.ranks.ipc import AddRequest

log = logging.getLogger("deepinfer.rank")


@dataclass
class _Pending:
    message: AddRequest
    future: Future


class PendingGrammars:
    """Constrained AddRequests held until their grammar is ready, in arrival order."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._executor: ThreadPoolExecutor | None = None
        self._pending: dict[str, _Pending] = {}

    def hold(self, message: AddRequest) -> bool:
        """Take a constrained request (True), or leave an unconstrained one to the caller."""
        spec = message.params.structured
        if spec is None:
            return False
        compiled = self._cached(spec)
        if compiled is None:
            future = self._submit(spec, message.grammar)
        else:
            future = Future()
            future.set_result(compiled)
        self._pending[message.request_id] = _Pending(message, future)
        return True

    def ready(self) -> list[tuple[AddRequest, Any]]:
        """Requests whose preparation ended: (message, compiled grammar or the exception)."""
        out = []
        for request_id, pending in list(self._pending.items()):
            if not pending.future.done():
                continue
            del self._pending[request_id]
            exc = pending.future.exception()
            if exc is None:
                compiled = pending.future.result()
                self._engine.grammar_compiler().remember(pending.message.params.structured,
                                                         compiled)
            out.append((pending.message, exc if exc is not None else compiled))
        return out

    def drop(self, request_id: str) -> bool:
        """Forget an aborted request (its preparation still ends, and is cached)."""
        return self._pending.pop(request_id, None) is not None

    def drop_all(self) -> list[str]:
        """Forget every held request (a regroup failed them all); their ids."""
        held, self._pending = list(self._pending), {}
        return held

    @property
    def waiting(self) -> int:
        return len(self._pending)

    def _cached(self, spec: StructuredOutput) -> Any | None:
        compiler = self._engine.grammars
        return None if compiler is None else compiler.cached(spec)

    def _submit(self, spec: StructuredOutput, serialized: str | None) -> Future:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-grammar")
        return self._executor.submit(self._prepare, spec, serialized)

    def _prepare(self, spec: StructuredOutput, serialized: str | None) -> Any:
        compiler = self._engine.grammar_compiler()  # only this thread builds it
        if serialized is not None:
            try:
                return compiler.load(serialized)
            except ValueError as exc:  # compiled against other tokenizer facts: a bug
                log.warning("%s; compiling it here", exc)
        return compiler.compile(spec)
