"""Turning a stream of token ids into a stream of text, one token at a time.

Decoding each token alone is wrong twice over: a multi-byte character split across tokens
decodes to U+FFFD, and tokenizers that drop a leading space at the start of a sequence would
glue words together. So we decode a short window, the way vLLM and TGI do:

    ids:  [ ...emitted... | p p p | r r n ]   p: context, already emitted; r: held back; n: new
                            ^ prefix_offset
                                    ^ read_offset
    prefix = decode(ids[prefix_offset:read_offset])   # context only, already emitted
    full   = decode(ids[prefix_offset:])              # the same context plus what is new
    emit full[len(prefix):] unless it ends in U+FFFD (a character still incomplete)

After emitting, the window slides: prefix_offset <- read_offset, read_offset <- len(ids).
While a character is incomplete nothing is emitted and the offsets stay, so the next token
decodes the whole character at once.
"""
from __future__ import annotations

from shared.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5   # prompt tokens decoded as context for the first generated token (vLLM)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_token_ids or [])
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - _PROMPT_CONTEXT, 0)
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """Everything add() and flush() have returned so far."""
        return "".join(self._pieces)

    def add(self, token_id: int) -> str:
        """The text that token_id completes ("" while a character is still incomplete)."""
        self._ids.append(token_id)
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset, len(self._ids))
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""
        return self._emit(full[len(prefix):])

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back (a truly broken byte
        sequence comes out as U+FFFD, as decode() of all ids would give)."""
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset, len(self._ids))
        return self._emit(full[len(prefix):]) if len(full) > len(prefix) else ""

    def _emit(self, piece: str) -> str:
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._pieces.append(piece)
        return piece

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)
