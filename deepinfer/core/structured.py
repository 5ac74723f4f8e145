"""Structured outputs through xgrammar: a compiled grammar per distinct constraint (cached),
and a matcher per request that yields each step's allowed-token bitmask."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from deepinfer.core.sampling import StructuredOutput

_CACHE_SIZE = 64


class GrammarCompiler:
    """Compiles constraints for one tokenizer; the compiled grammars are shared by requests."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        try:
            import xgrammar as xgr
        except ImportError as exc:  # an optional extra
            raise ValueError("structured outputs need xgrammar: pip install "
                             "'deepinfer[structured]'") from exc
        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
        self._compiler = xgr.GrammarCompiler(info)
        self.vocab_size = vocab_size
        self._compiled: OrderedDict[StructuredOutput, Any] = OrderedDict()

    def matcher(self, spec: StructuredOutput) -> "RequestGrammar":
        compiled = self._compiled.get(spec)
        if compiled is None:
            compiled = self._compile(spec)
            self._compiled[spec] = compiled
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(spec)
        return RequestGrammar(self._xgr, compiled, self.vocab_size)

    def _compile(self, spec: StructuredOutput) -> Any:
        try:
            if spec.kind == "json_object":
                return self._compiler.compile_builtin_json_grammar()
            if spec.kind == "json_schema":
                return self._compiler.compile_json_schema(spec.spec)
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.spec)
            if spec.kind == "structural_tag":
                return self._compiler.compile_structural_tag(spec.spec)
            return self._compiler.compile_grammar(spec.spec)
        except Exception as exc:  # xgrammar raises several types for a bad user constraint
            raise ValueError(f"invalid {spec.kind} constraint: {exc}") from exc


class RequestGrammar:
    """One request's position in its grammar."""

    def __init__(self, xgr: Any, compiled: Any, vocab_size: int) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def next_bitmask(self) -> torch.Tensor:
        self._matcher.fill_next_token_bitmask(self._bitmask)
        return self._bitmask[0].clone()

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())
