"""JSON-schema constraints: what the compiled grammar accepts, checked against Python's json
module writing the same documents."""
from __future__ import annotations

import json

import pytest

from deepinfer.core.sampling import StructuredOutput
from deepinfer.core.structured import MAX_JSON_WHITESPACE, compile_constraint

xgr = pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {
    "origin": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
               "required": ["city"]},
    "by_train": {"type": "boolean"}}, "required": ["origin", "by_train"]}
DOC = {"origin": {"city": "Oslo"}, "by_train": True}


@pytest.fixture(scope="module")
def accepts():
    # A grammar's language does not depend on the vocabulary: a tiny one compiles fast.
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(["a", "b"], vocab_size=2))
    compiled = compile_constraint(compiler, StructuredOutput("json_schema", json.dumps(SCHEMA)))

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.is_completed()
    return accepts


def test_json_laid_out_as_json_dumps_writes_it_is_accepted(accepts):
    for layout in ({}, {"indent": 2}, {"indent": 4}, {"separators": (",", ":")}):
        assert accepts(json.dumps(DOC, **layout)), layout


def test_whitespace_between_tokens_is_bounded(accepts):
    """A model that keeps choosing whitespace is made to go on: at most MAX_JSON_WHITESPACE
    characters of it at a stretch, where the schema alone would allow it forever."""
    def spaced(n: int) -> str:
        return json.dumps(DOC).replace(": true", ":" + " " * n + "true")

    assert accepts(spaced(MAX_JSON_WHITESPACE))
    assert not accepts(spaced(MAX_JSON_WHITESPACE + 1))
