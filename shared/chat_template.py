"""Rendering a model's chat template the way transformers does, in a jinja2 sandbox.

Templates come with the model, messages come from clients: both are untrusted. The sandbox
is immutable (no `list.append` on our data), refuses attributes such as `__class__` with an
error instead of an empty string, and every failure becomes an InvalidRequestError.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from shared.errors import InvalidRequestError, ModelLoadError
from shared.json_file import json_type


class _TemplateEnvironment(ImmutableSandboxedEnvironment):
    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # The stock sandbox returns an Undefined that prints as "", so a probe like
        # {{ ''.__class__.__mro__ }} would render silently; fail loudly instead.
        raise SecurityError(f"access to attribute {attribute!r} of a "
                            f"{type(obj).__name__} is not allowed in a chat template")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # transformers overrides jinja's tojson: no HTML escaping, non-ASCII kept as is
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = _TemplateEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def check_chat_template(template: Any, where: str) -> None:
    """Compile the model's template as it loads (kept compiled for the first request): one
    that is not a string or does not parse is refused then, not on every chat request."""
    if not isinstance(template, str):
        raise ModelLoadError(f"{where}: the chat template is a {type(template).__name__}, not "
                             f"a string")
    try:
        _compile(template)
    except jinja2.TemplateSyntaxError as e:
        raise ModelLoadError(f"{where}: the chat template does not parse (line {e.lineno}: "
                             f"{e.message})") from None


# between a message's text parts, as vLLM joins them for templates that expect a string
PART_SEPARATOR = "\n"


def validate_messages(messages: Any) -> list[dict]:
    """Checked copies of OpenAI-style messages. Content given as a list of text parts is
    joined with newlines, as vLLM does for templates that expect a string."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content} objects")
    return [_validate_message(i, m) for i, m in enumerate(messages)]


def _validate_message(i: int, message: Any) -> dict:
    if not isinstance(message, dict):
        raise InvalidRequestError(f"messages[{i}] must be an object with role and content")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise InvalidRequestError(f"messages[{i}].role must be a non-empty string")
    checked = {**message, "content": _content_text(i, message.get("content"))}
    if message.get("tool_calls") is not None:
        checked["tool_calls"] = _past_tool_calls(i, message["tool_calls"])
    return checked


def _past_tool_calls(i: int, calls: Any) -> list[dict]:
    """An assistant message's earlier tool calls, checked, their arguments parsed from their
    JSON as vLLM hands them to the chat template (templates write `arguments | tojson`)."""
    at = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise InvalidRequestError(f"{at} must be a list of calls")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequestError(f"{at}[{j}] must be " + '{"type": "function", "id": ..., '
                                      '"function": {"name": ..., "arguments": "{...}"}}')
        arguments = call_arguments(fn.get("arguments", "{}"), f"{at}[{j}].function.arguments")
        out.append({**call, "function": {**fn, "arguments": arguments}})
    return out


def call_arguments(arguments: Any, at: str) -> Any:
    """A past call's arguments as the template takes them: parsed from their JSON text (a
    blank one: none); `at` names them in the error."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except (ValueError, RecursionError):
        raise InvalidRequestError(f"{at} is not valid JSON") from None


def _content_text(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"messages[{i}].content must be a string or a list of text parts")
    return text_of_parts(content, f"messages[{i}].content")


# where a part of each kind keeps its words, where not under "text" (OpenAI's refusal part)
PART_TEXT_FIELD = {"refusal": "refusal"}


def text_of_parts(parts: list, at: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """Text parts (`at`: their list, for errors; `kinds`: the part types taken, the one an
    error shows first) as one string, joined as vLLM joins them for templates that expect a
    string: a newline between."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            got = f"{kind!r:.60}" if isinstance(kind, str) else \
                "a part without a type" if isinstance(part, dict) else f"a JSON {json_type(part)}"
            raise InvalidRequestError(f'{at}[{j}] must be a text part, {{"type": "{kinds[0]}", '
                                      f'"text": "..."}} (the types served: {", ".join(kinds)}), '
                                      f"not {got}")
        field = PART_TEXT_FIELD.get(kind, "text")
        if not isinstance(part.get(field), str):
            raise InvalidRequestError(f"{at}[{j}].{field} must be a string")
        texts.append(part[field])
    return PART_SEPARATOR.join(texts)


def render_chat_template(template: str, messages: Any, *, bos_token: str = "",
                         eos_token: str = "", add_generation_prompt: bool = True,
                         tools: list | None = None, continue_final_message: bool = False) -> str:
    """`continue_final_message`: the text ends where the final message's content does (no
    end-of-turn after it), so that the model goes on with that message (a prefilled answer)."""
    if add_generation_prompt and continue_final_message:
        raise InvalidRequestError("add_generation_prompt and continue_final_message cannot both "
                                  "be true: the first opens a new message, the second goes on "
                                  "with the last one")
    checked = validate_messages(messages)

    def render(chat: list[dict]) -> str:
        try:
            return _compile(template).render(
                messages=chat, bos_token=bos_token, eos_token=eos_token,
                add_generation_prompt=add_generation_prompt, tools=tools)
        except InvalidRequestError:
            raise
        except Exception as e:  # the template is foreign code: any failure is the request's
            raise InvalidRequestError(f"chat template failed: {type(e).__name__}: {e}") from e

    rendered = render(checked)
    if not continue_final_message:
        return rendered
    # where the final message's content begins: found by rendering a marker in its place (its
    # text alone may also occur in what the template writes around it: "\n", ">", "end")
    marked = render([*checked[:-1], {**checked[-1], "content": _FINAL_MARK}])
    return _open_final_message(rendered, marked.rfind(_FINAL_MARK), checked[-1]["content"])


# stands in for the final message's content to find where the template writes it (private-use
# characters no template writes)
_FINAL_MARK = "\ue000pacer-final-message\ue001"


def _open_final_message(rendered: str, at: int, final: str) -> str:
    """The rendered chat cut after the final message's content, which begins at `at`: as
    given, or stripped (templates often trim a message)."""
    for content in (final, final.strip(), final.lstrip()):
        if at >= 0 and content and rendered.startswith(content, at):
            return rendered[:at + len(content)]
    raise InvalidRequestError("continue_final_message needs a final message with content that "
                              "the chat template writes out as given")
