"""The tool-call parsers of tool_choice "auto" (gateway/tool_parsers.py): whole outputs, and the
same outputs streamed in pieces of every size, which must give the same content and calls."""
from __future__ import annotations

import json

import pytest

from gateway.tool_parsers import PARSERS, ToolStream, parse_calls

HERMES, LLAMA, PYTHONIC = PARSERS["hermes"], PARSERS["llama3_json"], PARSERS["pythonic"]
NAMES = {"get_weather", "now", "a", "b", "x"}     # the functions the requests offer
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'

CASES = [   # (parser, text, content, calls)
    (HERMES, "The sky is blue.", "The sky is blue.", []),
    (HERMES, f"<tool_call>\n{WEATHER}\n</tool_call>", None,
     [("get_weather", '{"city": "Paris", "unit": "C"}')]),
    (HERMES, f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>", "Let me look.",
     [("get_weather", '{"city": "Paris", "unit": "C"}')]),
    (HERMES, f'<tool_call>{WEATHER}</tool_call>\n<tool_call>{{"name": "now", "arguments": '
             f'"{{}}"}}</tool_call>', None,
     [("get_weather", '{"city": "Paris", "unit": "C"}'), ("now", "{}")]),
    (HERMES, '<tool_call>\n{"name": "get_weather", "argum', '<tool_call>\n{"name": '
             '"get_weather", "argum', []),                           # cut short: words
    (HERMES, f"  Sure. <tool_call>{WEATHER}</tool_call>", "  Sure.",   # blanks before a call
     [("get_weather", '{"city": "Paris", "unit": "C"}')]),
    (HERMES, f"\n\n<tool_call>{WEATHER}</tool_call>", None,
     [("get_weather", '{"city": "Paris", "unit": "C"}')]),
    (HERMES, "a < b and <tool_c is not a tag", "a < b and <tool_c is not a tag", []),
    (HERMES, f"<tool_call>{WEATHER}", None,                          # the end tag cut off
     [("get_weather", '{"city": "Paris", "unit": "C"}')]),
    (LLAMA, '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     [("get_weather", '{"city": "Oslo"}')]),
    (LLAMA, '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": '
            '{"x": 1}}', None, [("a", "{}"), ("b", '{"x": 1}')]),
    (LLAMA, "  Paris is the capital.", "  Paris is the capital.", []),
    (LLAMA, '{"name": "a", "parameters": ', '{"name": "a", "parameters": ', []),
    (LLAMA, '{"not": "a call"}', '{"not": "a call"}', []),
    (PYTHONIC, '[get_weather(city="Paris", unit="C")]', None,
     [("get_weather", '{"city": "Paris", "unit": "C"}')]),
    (PYTHONIC, "<|python_start|>[a(), b(x=1)]<|python_end|>", None,
     [("a", "{}"), ("b", '{"x": 1}')]),
    (PYTHONIC, " [now(n=True, z=None, l=[1, 2.5], d={'k': 'v'}, s='é')]\n", None,
     [("now", '{"n": true, "z": null, "l": [1, 2.5], "d": {"k": "v"}, "s": "é"}')]),
    (PYTHONIC, "Paris is the capital.", "Paris is the capital.", []),
    (PYTHONIC, '[get_weather(city="Pa', '[get_weather(city="Pa', []),          # cut short
    (PYTHONIC, "[1, 2, 3]", "[1, 2, 3]", []),                                  # a list, no calls
    (PYTHONIC, '[get_weather("Paris")]', '[get_weather("Paris")]', []),        # positional
    (PYTHONIC, "[a(x={1, 2})]", "[a(x={1, 2})]", []),                          # no JSON for a set
    (PYTHONIC, "[a(x=open('f'))]", "[a(x=open('f'))]", []),                    # not a literal
    # nested past Python's JSON parser's depth (a RecursionError there): words, not a failure
    (HERMES, DEEP := '<tool_call>{"name": "a", "arguments": {"x": ' + "[" * 5000 + "]" * 5000
     + "}}</tool_call>", DEEP, []),
    (LLAMA, DEEP_LLAMA := '{"name": "a", "parameters": {"x": ' + "[" * 5000 + "]" * 5000 + "}}",
     DEEP_LLAMA, []),
]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_a_whole_output(parser, text, content, calls):
    assert parse_calls(parser, text, NAMES) == ((text, []) if not calls else (content, calls))
    for _, arguments in calls:
        json.loads(arguments)


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_streamed_in_pieces_of_any_size_gives_the_same_answer(parser, text, content, calls):
    for size in range(1, len(text) + 1):
        stream, sent = ToolStream(parser), ""
        for at in range(0, len(text), size):
            sent += stream.feed(text[at:at + size])
        tail, got = stream.finish(NAMES)
        assert got == calls
        if calls:        # the words before the calls as a whole output has them
            assert sent + tail == (content or "")
        else:            # no call: every character, once
            assert sent + tail == text


def test_words_go_out_until_a_call_may_begin():
    stream = ToolStream(HERMES)
    assert stream.feed("Sure") == "Sure"
    assert stream.feed(", <tool") == ","               # "<tool" may begin a call: held,
    assert stream.feed("box> is it") == " <toolbox> is it"    # a blank until a word follows
    assert stream.feed(" <tool_call>{") == ""
    assert stream.feed('"name": "x"}') == ""
    assert stream.finish(NAMES) == ("", [("x", "{}")])


def test_a_call_of_a_function_not_offered_is_words():
    text = f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>"
    assert parse_calls(HERMES, text, {"get_time"}) == (text, [])
    stream = ToolStream(HERMES)
    sent = stream.feed(text)
    assert sent + stream.finish({"get_time"})[0] == text
