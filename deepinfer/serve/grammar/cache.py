"""The API process's compiled grammars, by constraint: a bounded LRU (entries and bytes)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from deepinfer.core.sampling import StructuredOutput


@dataclass(frozen=True)
class CompiledConstraint:
    """A constraint that compiled: the grammar the rank loads (None: the rank compiles it)."""

    serialized: str | None
    compile_s: float = 0.0

    @property
    def nbytes(self) -> int:
        return len(self.serialized or "")


@dataclass(frozen=True)
class InvalidConstraint:
    """A constraint xgrammar refused (kept, so it is not compiled again)."""

    message: str

    nbytes = 0


Outcome = CompiledConstraint | InvalidConstraint


class GrammarCache:
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._items: OrderedDict[StructuredOutput, Outcome] = OrderedDict()
        self.nbytes = 0

    def get(self, spec: StructuredOutput) -> Outcome | None:
        outcome = self._items.get(spec)
        if outcome is not None:
            self._items.move_to_end(spec)
        return outcome

    def put(self, spec: StructuredOutput, outcome: Outcome) -> None:
        if outcome.nbytes > self.max_bytes:
            return
        old = self._items.pop(spec, None)
        self.nbytes += outcome.nbytes - (old.nbytes if old is not None else 0)
        self._items[spec] = outcome
        while len(self._items) > self.max_entries or self.nbytes > self.max_bytes:
            _, evicted = self._items.popitem(last=False)
            self.nbytes -= evicted.nbytes

    def __len__(self) -> int:
        return len(self._items)
