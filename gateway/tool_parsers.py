"""Parsers of a model's own tool-call format, for `tool_choice: "auto"` (docs/api.md#requests).

With "auto" the model decides whether to answer in words or call a tool, and writes a call in
the format it was trained on; nothing constrains it. `pacer up --tool-call-parser NAME` names
the format (vLLM's `--tool-call-parser`), and the gateway turns the text into OpenAI's
`tool_calls`:

    hermes        <tool_call>{"name": "f", "arguments": {...}}</tool_call>, one block a call,
                  words before the first block are the message's content (Hermes, Qwen);
                  the text keeps special tokens, which some models' tags are
    llama3_json   the whole output a JSON object {"name": "f", "parameters": {...}} (or
                  several separated by ';'), as Llama 3.1+ write them
    pythonic      the whole output a Python list of calls with keyword arguments,
                  [f(city="Paris"), g()], as Llama 3.2 and 4 write them (Llama 4 inside
                  <|python_start|> ... <|python_end|>); read with `ast`, never run

A text whose calls do not parse (cut short by max_tokens, say) is returned as content. While
streaming, the content is sent as it comes up to where a call may begin; from there the text
is held and, at the end, sent as the calls (or, if they do not parse, as content).
"""
from __future__ import annotations

import ast
import json
from collections.abc import Collection
from typing import Protocol

Call = tuple[str, str]            # (function name, arguments as JSON text)


class ToolParser(Protocol):
    name: str
    # the text it reads keeps the special tokens: its tags are special tokens in some models'
    # vocabularies, which the text would otherwise leave out (vLLM keeps them too)
    keeps_special_tokens: bool

    def split(self, text: str) -> tuple[str, list[Call]] | None:
        """The content before the calls and the calls; None: calls begun but not parseable."""

    def held_from(self, text: str, sent: int) -> int:
        """Where the text that may be a call begins (len(text): none of it may be); nothing
        before `sent` (already out as words) is looked at again."""


def _call(obj: object, arguments_key: str) -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):             # some models write the arguments as a string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):     # not JSON, or nested past the parser's depth
            return None
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


class HermesParser:
    name = "hermes"
    keeps_special_tokens = True          # <tool_call> is a special token in some (Hermes 2 Pro)
    START, END = "<tool_call>", "</tool_call>"

    def split(self, text: str) -> tuple[str, list[Call]] | None:
        first = text.find(self.START)
        if first < 0:
            return text, []
        calls, at = [], first
        while (at := text.find(self.START, at)) >= 0:
            end = text.find(self.END, at)
            body = text[at + len(self.START):end if end >= 0 else len(text)]
            try:
                call = _call(json.loads(body), "arguments")
            except (ValueError, RecursionError):
                return None
            if call is None:
                return None
            calls.append(call)
            if end < 0:
                break
            at = end + len(self.END)
        return text[:first], calls

    def held_from(self, text: str, sent: int) -> int:
        found = text.find(self.START, sent)
        if found >= 0:
            return found
        for k in range(min(len(self.START) - 1, len(text)), 0, -1):   # a start cut in two
            if self.START.startswith(text[-k:]):
                return len(text) - k
        return len(text)


class Llama3JsonParser:
    name = "llama3_json"
    keeps_special_tokens = False         # the calls parse with or without the tag
    TAG = "<|python_tag|>"

    def split(self, text: str) -> tuple[str, list[Call]] | None:
        body = text.strip().removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                obj, at = decoder.raw_decode(body, at)
            except (ValueError, RecursionError):
                return None
            call = _call(obj, "parameters")
            if call is None:
                return None
            calls.append(call)
            while at < len(body) and body[at] in "; \n\t":
                at += 1
        return "", calls

    def held_from(self, text: str, sent: int) -> int:
        return _held_if_whole_output(text, sent, "{", self.TAG)


def _held_if_whole_output(text: str, sent: int, opening: str, tag: str) -> int:
    """`held_from` for formats whose calls are the whole output: all of it is held while it
    may still be calls (blanks, `opening` or `tag` first), none once it cannot."""
    if sent:
        return len(text)             # words went out: the output is no call
    body = text.lstrip()
    if not body or body.startswith((opening, tag)) or tag.startswith(body):
        return 0                     # nothing but blanks yet, or the output is a call
    return len(text)


class PythonicParser:
    name = "pythonic"
    keeps_special_tokens = False
    START, END = "<|python_start|>", "<|python_end|>"

    def split(self, text: str) -> tuple[str, list[Call]] | None:
        body = text.strip().removeprefix(self.START).removesuffix(self.END).strip()
        if not body.startswith("["):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return None
            calls = []
            for node in tree.elts:
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) \
                        or node.args or any(kw.arg is None for kw in node.keywords):
                    return None          # positional or ** arguments: no JSON object for them
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
                calls.append((node.func.id,
                              json.dumps(arguments, ensure_ascii=False, allow_nan=False)))
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return None                  # not Python, not literals, or not JSON (a set, NaN)
        return "", calls

    def held_from(self, text: str, sent: int) -> int:
        return _held_if_whole_output(text, sent, "[", self.START)


PARSERS: dict[str, ToolParser] = {p.name: p for p in (HermesParser(), Llama3JsonParser(),
                                                      PythonicParser())}


def _split(parser: ToolParser, text: str, names: Collection[str]) -> tuple[str, list[Call]]:
    """The words before the calls and the calls; the whole text as words, no calls, where
    the calls do not parse or one names a function the request did not offer."""
    split = parser.split(text)
    if split is None or not all(name in names for name, _ in split[1]):
        return text, []
    return split


def parse_calls(parser: ToolParser, text: str,
                names: Collection[str]) -> tuple[str | None, list[Call]]:
    """A whole output: its content (None when it only calls) and its calls. The blanks
    before the calls are no content (a stream holds them back too: ToolStream)."""
    content, calls = _split(parser, text, names)
    return (content.rstrip() or None, calls) if calls else (text, [])


class ToolStream:
    """One streamed output under "auto": what may be sent as content now, and at the end the
    calls (or the held text as content)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser, self.text, self.sent = parser, "", 0

    def feed(self, piece: str) -> str:
        self.text += piece
        # blanks wait for the next word: before a call they are no content (parse_calls)
        held = self.parser.held_from(self.text, self.sent)
        upto = max(self.sent, len(self.text[:held].rstrip()))
        out, self.sent = self.text[self.sent:upto], upto
        return out

    def finish(self, names: Collection[str]) -> tuple[str, list[Call]]:
        """The content not sent yet, and the calls (of the functions in `names`)."""
        content, calls = _split(self.parser, self.text, names)
        return (content[self.sent:].rstrip(), calls) if calls else (self.unsent(), [])

    def unsent(self) -> str:
        """All the text not sent yet, as words (a stream that ends without its finish, a
        failed one, has no calls: its client still gets every token)."""
        out, self.sent = self.text[self.sent:], len(self.text)
        return out
