"""Incremental detokenization with stop strings, for streaming one request's output.

Token ids arrive one at a time; ``add_token`` returns the text that is safe to send to the
client now. Two things make this harder than ``decode(ids)[len(previous):]``:

* A token can end in the middle of a multi-byte UTF-8 character (byte-level BPE splits emoji
  and CJK into several tokens). Decoding such a tail yields a trailing "\\ufffd", so we wait
  for more tokens instead of emitting a replacement character that would later change.
* A stop string can span tokens, and nothing after (or, by default, of) the stop string may
  ever reach the client. So text that could still turn out to be the start of a stop string
  is held back until it provably is not, or until ``flush()`` at the end of the request.

The decoding follows vLLM's ``detokenize_incrementally``: keep the token strings, and decode
only a small window ``tokens[prefix_offset:]``; the new text is what that window decodes to
beyond ``tokens[prefix_offset:read_offset]``. Decoding a few tokens of context (rather than
the new token alone) keeps tokenizer-specific joining right, e.g. SentencePiece's leading
space, and makes the cost per token independent of the output length.

Equality with ``decode``: for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM2...)
the deltas of ``add_token`` plus ``flush()`` concatenate to exactly
``tokenizer.decode(output_ids, skip_special_tokens=params.skip_special_tokens)`` (when no
stop string matched and the tokenizer does no ``clean_up_tokenization_spaces``). With a
SentencePiece/Metaspace tokenizer the first delta keeps the leading space of the first token
(decoded in the context of the prompt), which a standalone ``decode(output_ids)`` strips.
"""
from __future__ import annotations

from typing import Any

from deepinfer.core.sampling import SamplingParams

# Prompt tokens decoded as context before the first output token, as in vLLM: enough for a
# tokenizer to join the first output token to the prompt as it would inside one text.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output token ids into streamed text, cut at the first stop string.

    ``add_token`` returns the newly safe text (None when there is none yet), ``flush`` returns
    the rest when the request finishes. ``stopped_by`` is the stop string that matched, after
    which the caller should stop generating; further tokens are ignored.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        # tokenizer: a transformers PreTrainedTokenizer(Fast); only convert_ids_to_tokens and
        # convert_tokens_to_string are used.
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops = list(params.stop)
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._include_stop = params.include_stop_str_in_output

        context = tokenizer.convert_ids_to_tokens(
            list(prompt_token_ids[-(_PROMPT_CONTEXT_TOKENS + 2):]),
            skip_special_tokens=self._skip_special)
        prefix_offset = max(len(context) - _PROMPT_CONTEXT_TOKENS, 0)
        prefix_text = tokenizer.convert_tokens_to_string(context[prefix_offset:])
        if prefix_text.endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character: the output would complete it and the text
            # lengths would no longer line up. Decode the output on its own instead.
            context, prefix_offset, prefix_text = [], 0, ""
        self._tokens: list[str] = context
        self._prefix_offset = prefix_offset  # start of the decoding window
        self._read_offset = len(context)  # tokens before this are already in self._text
        self._prefix_text = prefix_text  # decode(tokens[prefix_offset:read_offset])

        self._text = ""  # decoded output so far, cut at the stop string once one matched
        self._emitted = 0  # chars of self._text already returned to the caller
        self._stopped_by: str | None = None
        self._flushed = False

    @property
    def stopped_by(self) -> str | None:
        """The stop string that ended the output, or None."""
        return self._stopped_by

    @property
    def text(self) -> str:
        """The output text so far (including any held-back tail), cut at a stop string."""
        return self._text

    def add_token(self, token_id: int) -> str | None:
        """Appends one generated token; returns the new text safe to emit, or None if none."""
        if self._stopped_by is not None:
            return None  # e.g. the rest of a multi-token step: nothing after a stop is output
        if self._flushed:
            raise RuntimeError("add_token() after flush()")
        self._tokens.extend(self._tokenizer.convert_ids_to_tokens(
            [token_id], skip_special_tokens=self._skip_special))
        window = self._tokenizer.convert_tokens_to_string(self._tokens[self._prefix_offset:])
        if len(window) > len(self._prefix_text) and not window.endswith(_REPLACEMENT_CHAR):
            # The new tokens decode to complete characters: move the window forward.
            self._append(window[len(self._prefix_text):])
            self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
            self._prefix_text = self._tokenizer.convert_tokens_to_string(
                self._tokens[self._prefix_offset:self._read_offset])
        return self._release(final=False) or None

    def flush(self) -> str:
        """Ends the output: returns all text not yet emitted ("" after a stop string).

        Tokens still waiting for the rest of a character are decoded as they are (with a
        "\\ufffd", as ``decode`` would), and still checked against the stop strings.
        """
        if self._flushed or self._stopped_by is not None:
            self._flushed = True
            return ""
        self._flushed = True
        window = self._tokenizer.convert_tokens_to_string(self._tokens[self._prefix_offset:])
        if len(window) > len(self._prefix_text):
            self._append(window[len(self._prefix_text):])
        return self._release(final=True)

    def _append(self, delta: str) -> None:
        """Adds decoded text and cuts it at the earliest stop string it completes."""
        # Matches lying wholly in the older text were ruled out by earlier calls, so a new one
        # must end in `delta` and so start at most max_stop_len - 1 chars before it.
        start = max(len(self._text) - self._max_stop_len + 1, 0)
        self._text += delta
        best: tuple[int, int, str] | None = None  # (position, length, stop string)
        for stop in self._stops:
            pos = self._text.find(stop, start)
            # Earliest start wins; at one position the shorter stop string completed first.
            if pos != -1 and (best is None or (pos, len(stop)) < best[:2]):
                best = (pos, len(stop), stop)
        if best is not None:
            pos, length, stop = best
            self._text = self._text[:pos + length if self._include_stop else pos]
            self._stopped_by = stop

    def _release(self, final: bool) -> str:
        """Returns the text newly safe to emit and marks it emitted."""
        end = len(self._text)
        if not final and self._stopped_by is None and not self._include_stop:
            # Hold back a tail that may be the start of a stop string, which would be cut out.
            # (When the stop string is kept in the output, text before it is emitted anyway.)
            end -= self._partial_stop_len()
        if end <= self._emitted:
            return ""
        delta = self._text[self._emitted:end]
        self._emitted = end
        return delta

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        for length in range(min(self._max_stop_len - 1, len(self._text)), 0, -1):
            tail = self._text[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0
