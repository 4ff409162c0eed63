"""One request's output text: incremental detokenizing, stop strings, and what may be sent.

Text that could still grow into a stop string is held back, so a streaming client never
receives the start of a stop string that the next token completes:

    stop = ["STOP"];  text so far "Hello ST"  -> send "Hello ", hold "ST"
    next token "OP" -> "Hello STOP" -> cut at the stop string, finish with reason "stop"
"""
from __future__ import annotations

from typing import Callable

from shared.detokenizer import IncrementalDetokenizer


class TextOutput:
    def __init__(self, detokenizer: IncrementalDetokenizer, stop: tuple[str, ...] = (),
                 min_tokens: int = 0, include_stop: bool = False,
                 ends: Callable[[int], bool] | None = None) -> None:
        """`ends`: whether a token ends the request by itself (EOS, a stop token): its text is
        left out, as vLLM does, unless `include_stop`."""
        self._detok = detokenizer
        self._stop = stop
        self._include_stop = include_stop      # vLLM's include_stop_str_in_output
        self._ends = None if include_stop else ends
        # vLLM's min_tokens: a stop string counts only where it ends in a token past the
        # first min_tokens (as EOS may be token min_tokens + 1 at the earliest), so that
        # their text is all kept: min_tokens 1 with a stop "\n" is never an empty answer
        # (a stop string ends in the newest token's text, as every search)
        self._min_tokens = min_tokens
        self._tokens = 0
        self.text = ""
        self.stopped = False      # a stop string was found; text ends right before it (or
        #                           with it, include_stop)
        self.stop_string: str | None = None     # the one found (vLLM's stop_reason)
        self._sent = 0
        # each (non-empty) stop string's prefix function, and the length of its longest
        # proper prefix the text ends with, followed a character at a time (KMP)
        self._borders = [(s, _prefix_function(s)) for s in stop if s]
        self._matched = [0] * len(self._borders)

    def add(self, token_id: int) -> None:
        if self.stopped or (self._ends is not None and self._ends(token_id)):
            return
        before = len(self.text)
        self._extend(self._detok.add(token_id))
        self._tokens += 1
        self._find_stop(before)

    def finish(self) -> None:
        """No more tokens: release what the detokenizer still holds (an incomplete character)."""
        if not self.stopped:
            before = len(self.text)
            self._extend(self._detok.flush())
            self._find_stop(before)

    @property
    def sent(self) -> int:
        """How much of `text` `take` has handed out."""
        return self._sent

    def take(self, final: bool = False) -> str:
        """The text not yet sent that can be sent now (all of it once `final`)."""
        end = len(self.text) if final or self.stopped else len(self.text) - self._held_back()
        end = max(end, self._sent)
        piece, self._sent = self.text[self._sent:end], end
        return piece

    def _find_stop(self, before: int) -> None:
        if not self._stop or len(self.text) == before or self._tokens <= self._min_tokens:
            return
        # only a stop string that ends in the new text: it starts at most len(stop)-1 chars
        # before it (one wholly in older text was either found then or came before
        # min_tokens, where stop strings do not count)
        hits = [(i, len(s), s) for s in self._stop
                if (i := self.text.find(s, max(0, before - len(s) + 1))) >= 0]
        if hits:
            at, length, self.stop_string = min(hits)
            self.text = self.text[:at + length if self._include_stop else at]
            self.stopped = True

    def _extend(self, piece: str) -> None:
        self.text += piece
        for i, (stop, border) in enumerate(self._borders):
            k = self._matched[i]
            for c in piece:
                while k and stop[k] != c:
                    k = border[k - 1]
                if stop[k] == c:
                    k += 1
                if k == len(stop):      # the whole of it: its longest proper border
                    k = border[k - 1]
            self._matched[i] = k

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string.
        Kept up as the text grows: looked for afresh after every token, each prefix of each
        stop string tried, 64 stop strings of 1024 characters took ~8 ms a token, on the
        gateway's event loop."""
        return max(self._matched, default=0)


def _prefix_function(s: str) -> list[int]:
    """For each i, the length of the longest proper prefix of s[:i + 1] that also ends it."""
    border = [0] * len(s)
    for i in range(1, len(s)):
        k = border[i - 1]
        while k and s[k] != s[i]:
            k = border[k - 1]
        border[i] = k + (s[k] == s[i])
    return border
