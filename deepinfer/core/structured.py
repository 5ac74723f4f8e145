"""Structured outputs through xgrammar: compiled grammars per distinct constraint (cached),
and a matcher per request that yields each step's allowed-token bitmask.

A compiled grammar is made here by compiling a constraint (the offline `LLM`, and a rank
whose API process sent none) or by loading one compiled elsewhere (`serialize_json` text;
the server's grammar workers compile with the same tokenizer facts as the rank)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from deepinfer.core.grammar_errors import clean_message
from deepinfer.core.sampling import StructuredOutput

_CACHE_SIZE = 64
# Whitespace between a JSON schema's tokens, in characters at a stretch: enough for a newline
# and the indent of pretty-printed JSON several levels deep, while a model that keeps choosing
# whitespace (which the schema otherwise allows forever) is made to write the next token.
MAX_JSON_WHITESPACE = 20


def import_xgrammar() -> Any:
    try:
        import xgrammar as xgr
    except ImportError as exc:  # an optional extra
        raise ValueError("structured outputs need xgrammar: pip install "
                         "'deepinfer[structured]'") from exc
    return xgr


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> Any:
    """What xgrammar knows of the tokenizer; a grammar compiled against it loads only where
    it is equal (vocab size and stop ids size and end the bitmask)."""
    return import_xgrammar().TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None)


def compile_constraint(compiler: Any, spec: StructuredOutput) -> Any:
    """One xgrammar compile; a constraint xgrammar rejects is a ValueError with a clean
    one-line message."""
    try:
        if spec.kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if spec.kind == "json_schema":
            if spec.compact:  # forced tool calls: json.dumps spacing, nothing to spend
                return compiler.compile_json_schema(spec.spec, any_whitespace=False)
            return compiler.compile_json_schema(spec.spec,
                                                max_whitespace_cnt=MAX_JSON_WHITESPACE)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.spec)
        if spec.kind == "structural_tag":
            return compiler.compile_structural_tag(spec.spec)
        return compiler.compile_grammar(spec.spec)
    except Exception as exc:  # xgrammar raises several types for a bad user constraint
        raise ValueError(f"invalid {spec.kind} constraint: {clean_message(exc)}") from exc


class GrammarCompiler:
    """Compiles or loads grammars for one tokenizer; the compiled grammars are shared by
    requests."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self._xgr = import_xgrammar()
        self._info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self._compiler = self._xgr.GrammarCompiler(self._info)
        self.vocab_size = vocab_size
        self._compiled: OrderedDict[StructuredOutput, Any] = OrderedDict()

    def matcher(self, spec: StructuredOutput) -> "RequestGrammar":
        """A matcher of the constraint's grammar, compiled here on a cache miss."""
        compiled = self.cached(spec)
        if compiled is None:
            compiled = self.compile(spec)
            self.remember(spec, compiled)
        return self.matcher_of(compiled)

    def matcher_of(self, compiled: Any) -> "RequestGrammar":
        return RequestGrammar(self._xgr, compiled, self.vocab_size)

    def compile(self, spec: StructuredOutput) -> Any:
        return compile_constraint(self._compiler, spec)

    def load(self, serialized: str) -> Any:
        """A grammar compiled elsewhere; ValueError if it was compiled for another tokenizer
        (or another xgrammar version)."""
        try:
            return self._xgr.CompiledGrammar.deserialize_json(serialized, self._info)
        except Exception as exc:  # xgrammar's several deserialize errors
            raise ValueError(f"could not load a compiled grammar: {clean_message(exc)}"
                             ) from exc

    def cached(self, spec: StructuredOutput) -> Any | None:
        compiled = self._compiled.get(spec)
        if compiled is not None:
            self._compiled.move_to_end(spec)
        return compiled

    def remember(self, spec: StructuredOutput, compiled: Any) -> None:
        self._compiled[spec] = compiled
        self._compiled.move_to_end(spec)
        if len(self._compiled) > _CACHE_SIZE:
            self._compiled.popitem(last=False)


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
