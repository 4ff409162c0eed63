"""OpenAI's request fields, checked once into a typed value, and OpenAI's response shapes.

Only what we serve is accepted: `model` must be the served name, and a field that would change
the answer in a way we do not serve (tools, a JSON response format, `best_of` above `n`) is
refused rather than ignored. Field types are checked strictly (`true` is not an integer, `"0.5"`
is not a number) because a silently coerced parameter is a wrong answer the client cannot see.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gateway.tool_parsers import PARSERS
from shared.errors import InvalidRequestError
from shared.json_file import json_type
from shared.sampling import (MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, MAX_PENALTY,
                             MAX_REPETITION_PENALTY, MAX_TOKEN_IDS, INT64_TEXT, token_id_key)
from shared import chat_template
from shared.structured import JSON_OPTIONS, KINDS, closed_schema, rebased_schema, structured_pair

MAX_LOGPROBS = 20
# stop strings (and bad words): each is looked for after every token of its request
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_BAD_WORD_CHARS = 128      # bad words are tokenized as the request is read
NAMED_TOOL_CHOICE = '{"type": "function", "function": {"name": ...}}'
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")      # OpenAI's rule for a function's name
MAX_TIMEOUT_S = 86_400.0
# Every integer must fit the wire format (msgpack int64).
INT_BOUND = 2**63
# Below this a temperature only overflows the logits (inf, then NaN): it means greedy.
MIN_TEMPERATURE = 1e-5
# The sampler compares in float32, where a smaller top_p rounds to 0 and drops every token
# (NaN probabilities, a crashed worker); this one keeps exactly the most likely token.
MIN_TOP_P = 1e-6
# Most choices one request may ask for (prompts x n): each is a request of its own upstream.
MAX_CHOICES = 128
# The client's own id for a request (vLLM reads it too): logged beside ours, sent back.
REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID_CHARS = 128
# The roles OpenAI accepts (any other is a 400 there too); the chat template renders each one.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass(frozen=True)
class GenerationRequest:
    """A completions or chat request after validation; prompt text is not yet tokenized."""
    endpoint: Literal["completions", "chat"]
    model: str
    prompts: tuple[str | list[int], ...]    # completions: one or more; chat: none
    messages: list[dict] | None             # chat, content flattened to strings
    max_tokens: int | None                  # None: the endpoint's default
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    logprobs: int | None                    # None: none; 0: sampled token only; N: top-N too
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float               # vLLM's extension; 1 is off
    logit_bias: tuple[tuple[int, float], ...]
    min_tokens: int                         # vLLM's: no end before this many tokens
    min_p: float                            # vLLM's: 0 is off
    stream: bool
    include_usage: bool
    continuous_usage: bool = False          # vLLM's: usage so far on every chunk
    n: int = 1                              # choices per prompt
    echo: bool = False                      # completions: the prompt before the output
    # completions, echo with max_tokens 0 (vLLM's echo without generation: scoring a text):
    # one token is generated upstream and left out of the answer
    echo_only: bool = False
    prompt_logprobs: int | None = None      # vLLM's: the prompt's, in the answer (top-N)
    structured_outputs: tuple[str, str] | None = None   # what the output must match (kind, text)
    include_stop_str_in_output: bool = False  # vLLM's: the stop string ends the text
    allowed_token_ids: tuple[int, ...] = ()   # vLLM's: only these may be drawn
    bad_words: tuple[str, ...] = ()           # vLLM's: words never completed
    truncate_prompt_tokens: int | None = None  # vLLM's: only the prompt's last N tokens
    tools: tuple[dict, ...] = ()            # chat: shown to the template
    # "required" or a function's name: tool calls out; "auto": words or calls, parsed
    tool_choice: str | None = None
    parallel_tool_calls: bool = True        # "auto": False keeps only the first call
    timeout: float | None = None            # seconds; pacer's extension: a deadline
    skip_special_tokens: bool = True        # vLLM's: special tokens left out of the text
    # vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:N", not its text
    tokens_as_ids: bool = False
    # vLLM's: what the tokenizer adds to a text (a BOS): completions' prompts take it, a chat
    # template writes its own (true adds it on top)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True      # chat, vLLM's: the template opens the answer's turn
    continue_final_message: bool = False    # chat, vLLM's: the answer goes on with the last one


# ---- field readers ---------------------------------------------------------------------------

_MISSING = object()


def read_field(body: dict, name: str, kinds: tuple[type, ...], default: Any = _MISSING) -> Any:
    value = body.get(name, _MISSING)
    if value is _MISSING or (value is None and default is not _MISSING):
        if default is _MISSING:
            raise APIError(f"'{name}' is a required property", param=name)
        return default
    if isinstance(value, float) and int in kinds and float not in kinds and value.is_integer():
        value = int(value)      # 4.0 where an integer is asked: read as vLLM's pydantic reads it
    # bool is an int in Python, never in JSON
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(_JSON_NAMES[k] for k in kinds)
        raise APIError(f"'{name}' must be {names}, got {json_type(value)}", param=name)
    if isinstance(value, int) and not isinstance(value, bool) and not -INT_BOUND <= value < INT_BOUND:
        shown = f", got {value}" if abs(value) < 10**30 else ""
        raise APIError(f"'{name}' must be {INT64_TEXT}{shown}", param=name)
    if isinstance(value, float) and not math.isfinite(value):
        raise APIError(f"'{name}' must be a finite number", param=name)
    return value


_JSON_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
               list: "an array", dict: "an object"}


def _number(body: dict, name: str, default: float) -> float:
    return float(read_field(body, name, (int, float), default))


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                              and -INT_BOUND <= t < INT_BOUND for t in value):
        raise APIError(f"'{name}' must be a list of integers", param=name)
    return value


def _token_id_list(body: dict, name: str) -> tuple[int, ...]:
    """A sampling field's token ids (allowed_token_ids, stop_token_ids): at most
    MAX_TOKEN_IDS, each paid for on every step of its batch."""
    ids = _int_list(read_field(body, name, (list,), []), name)
    if len(ids) > MAX_TOKEN_IDS:
        raise APIError(f"'{name}' takes at most {MAX_TOKEN_IDS} token ids, got {len(ids)}",
                       param=name)
    return tuple(ids)


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} (the ids as strings, JSON's keys), bias in [-100, 100]."""
    bias = read_field(body, "logit_bias", (dict,), {})
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise APIError(f"'logit_bias' takes at most {MAX_LOGIT_BIAS_ENTRIES} tokens",
                       param="logit_bias")
    pairs = []
    keys: dict[int, str] = {}
    for key, value in bias.items():
        token = token_id_key(key)
        if token is None or token >= INT_BOUND:
            raise APIError(f"'logit_bias' keys must be token ids (decimal digits), got "
                           f"{key!r:.40}", param="logit_bias")
        if token in keys:       # "7" and "07": their biases would add up, past the bounds
            raise APIError(f"'logit_bias' names token {token} twice ({keys[token]!r} and "
                           f"{key!r})", param="logit_bias")
        keys[token] = key
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise APIError(f"'logit_bias' values must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                           f"{MAX_LOGIT_BIAS:g}], got {value!r} "
                           f"for token {key}", param="logit_bias")
        pairs.append((token, float(value)))
    return tuple(pairs)


def _bad_words(body: dict) -> tuple[str, ...]:
    words = read_field(body, "bad_words", (list,), [])
    if not all(isinstance(w, str) and w.strip() for w in words):
        raise APIError("'bad_words' must be a list of non-blank strings", param="bad_words")
    if len(words) > MAX_BAD_WORDS or any(len(w) > MAX_BAD_WORD_CHARS for w in words):
        raise APIError(f"'bad_words' takes at most {MAX_BAD_WORDS} words of at most "
                       f"{MAX_BAD_WORD_CHARS} characters", param="bad_words")
    return tuple(words)


def _stop(body: dict) -> tuple[str, ...]:
    stop = read_field(body, "stop", (str, list), [])
    stops = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stops):
        raise APIError("'stop' must be a string or a list of strings", param="stop")
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise APIError(f"'stop' takes at most {MAX_STOP_STRINGS} strings of at most "
                       f"{MAX_STOP_CHARS} characters (each is looked for after every token)",
                       param="stop")
    return tuple(s for s in stops if s)


# ---- requests ---------------------------------------------------------------------------------

def valid_request_id(given: str) -> bool:
    return 0 < len(given) <= MAX_REQUEST_ID_CHARS and given.isascii() and given.isprintable()


def client_request_id(headers) -> str | None:
    """The REQUEST_ID_HEADER's value, if given: 1-MAX_REQUEST_ID_CHARS printable ASCII."""
    given = headers.get(REQUEST_ID_HEADER)
    if given is not None and not valid_request_id(given):
        raise APIError(f"the {REQUEST_ID_HEADER} header must be 1-{MAX_REQUEST_ID_CHARS} "
                       "printable ASCII characters")
    return given


def parse_completion(body: Any, max_model_len: int | None = None) -> GenerationRequest:
    """`max_model_len` (the gateway's; None: the whole of each prompt is checked): a
    token-id prompt is checked only as far as the context holds it (a body carries ~1.4
    million ids: checking them all held the event loop for 0.15-0.3 s)."""
    body = _object(body)
    logprobs = read_field(body, "logprobs", (int,), None)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise APIError(f"'logprobs' must be in [0, {MAX_LOGPROBS}], got {logprobs}", param="logprobs")
    truncated = _truncate_prompt_tokens(body) is not None
    prompts = _completion_prompts(read_field(body, "prompt", (str, list)), max_model_len,
                                  truncated)
    echo = read_field(body, "echo", (bool,), False)
    max_tokens = read_field(body, "max_tokens", (int,), None)
    echo_only = echo and max_tokens == 0
    request = _common(body, "completions", prompts=prompts, messages=None,
                      max_tokens=1 if echo_only else max_tokens, logprobs=logprobs, echo=echo)
    return dataclasses.replace(request, echo_only=True) if echo_only else request


def _completion_prompts(prompt: str | list, max_model_len: int | None,
                        truncated: bool) -> tuple[str | list[int], ...]:
    """OpenAI's four shapes: a string, a list of token ids, or a batch (a list) of either."""
    if isinstance(prompt, str):
        return (prompt,)
    if prompt and all(isinstance(p, (str, list)) for p in prompt):
        return tuple(p if isinstance(p, str) else _prompt_ids(p, max_model_len, truncated)
                     for p in prompt)
    return (_prompt_ids(prompt, max_model_len, truncated),)


def _prompt_ids(value: list, max_model_len: int | None, truncated: bool) -> list[int]:
    """A token-id prompt. One the context cannot hold is refused before its ids are looked
    at, or with truncate_prompt_tokens only its end is (no more is ever kept), so the ids
    checked are never more than the context holds."""
    if max_model_len is not None and truncated:
        value = value[-max_model_len:]
    elif max_model_len is not None:
        check_prompt_length(len(value), max_model_len, "prompt")
    ids = _int_list(value, "prompt")
    if not ids:
        raise APIError("'prompt' must not be empty", param="prompt")
    return ids


def parse_chat(body: Any, auto_tools: bool = False) -> GenerationRequest:
    """`auto_tools`: tool_choice "auto" is served (a tool-call parser is configured)."""
    body = _object(body)
    messages = [_message(m, i) for i, m in enumerate(read_field(body, "messages", (list,)))]
    if not messages:
        raise APIError("'messages' must hold at least one message", param="messages")
    want = read_field(body, "logprobs", (bool,), False)
    top = read_field(body, "top_logprobs", (int,), None)
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise APIError(f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got {top}", param="top_logprobs")
    if top is not None and not want:
        raise APIError("'top_logprobs' needs 'logprobs' to be true", param="top_logprobs")
    # OpenAI's newer name first; an error names the field the client sent
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = read_field(body, limit, (int,), None)
    if read_field(body, "echo", (bool,), False):
        raise APIError("'echo' is served on /v1/completions only", param="echo")
    request = _common(body, "chat", prompts=(), messages=messages, max_tokens=max_tokens,
                      logprobs=(top or 0) if want else None, auto_tools=auto_tools,
                      max_tokens_field=limit)
    add_generation_prompt, continue_final_message = _chat_format(body)
    return dataclasses.replace(request, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message)


def _chat_format(body: dict) -> tuple[bool, bool]:
    """vLLM's add_generation_prompt and continue_final_message: a new turn for the answer (the
    default), or the final message left open for the model to go on with (a prefilled
    answer); not both."""
    add = read_field(body, "add_generation_prompt", (bool,), True)
    cont = read_field(body, "continue_final_message", (bool,), False)
    if add and cont:
        raise APIError("'continue_final_message' needs 'add_generation_prompt' to be false: the "
                       "first goes on with the last message, the second opens a new one",
                       param="continue_final_message")
    return add, cont


@dataclass(frozen=True)
class TokenizeRequest:
    """vLLM's /tokenize: a prompt (with the special tokens the model adds, unless told not
    to) or chat messages (rendered by the chat template, with any tools, as generation
    renders them)."""
    model: str | None
    prompt: str | None
    messages: list[dict] | None
    add_special_tokens: bool
    tools: tuple[dict, ...] = ()
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False         # vLLM's: each token's vocabulary entry too


def parse_tokenize(body: Any) -> TokenizeRequest:
    body = _object(body)
    model = read_field(body, "model", (str,), None)
    strs = read_field(body, "return_token_strs", (bool,), False)
    if ("prompt" in body) == ("messages" in body):
        raise APIError("give one of 'prompt' or 'messages'")
    if "messages" in body:
        messages = [_message(m, i) for i, m in enumerate(read_field(body, "messages", (list,)))]
        if not messages:
            raise APIError("'messages' must hold at least one message", param="messages")
        tools = read_field(body, "tools", (list,), None) or []
        for i, tool in enumerate(tools):
            _tool_name(tool, i)
        # as a chat request's: the template writes its own special tokens
        return TokenizeRequest(model, None, messages,
                               read_field(body, "add_special_tokens", (bool,), False),
                               tuple(tools), *_chat_format(body), return_token_strs=strs)
    return TokenizeRequest(model, read_field(body, "prompt", (str,)), None,
                           read_field(body, "add_special_tokens", (bool,), True),
                           return_token_strs=strs)


def parse_detokenize(body: Any, max_model_len: int) -> tuple[str | None, list[int]]:
    """vLLM's /detokenize: (model, token ids). No more ids than the model's context holds
    (no prompt and answer of this server is longer): the 1.4 million a body can carry took
    ~2 s to check and decode, all of it on the event loop (the tokenizer's decode holds the
    GIL, even on a thread), and every stream stalled meanwhile."""
    body = _object(body)
    tokens = read_field(body, "tokens", (list,))
    if len(tokens) > max_model_len:
        raise APIError(f"'tokens' holds {len(tokens)} token ids, more than the model's context "
                       f"({max_model_len} tokens)", param="tokens",
                       code="context_length_exceeded")
    return read_field(body, "model", (str,), None), _int_list(tokens, "tokens")


def check_prompt_length(num_prompt_tokens: int, max_model_len: int, param: str) -> None:
    """A prompt that leaves the context no room for a token of answer is refused."""
    if num_prompt_tokens >= max_model_len:
        raise APIError(f"This model's maximum context length is {max_model_len} tokens, "
                       f"but the prompt has {num_prompt_tokens} tokens", param=param,
                       code="context_length_exceeded")


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {json_type(body)}")
    return body


def text_of_parts(parts: list, param: str, kinds: tuple[str, ...]) -> str:
    """shared.chat_template's, its error a 400 naming the list (`param`)."""
    try:
        return chat_template.text_of_parts(parts, param, kinds)
    except InvalidRequestError as e:
        raise APIError(str(e), param=param) from None


def _message(m: Any, i: int) -> dict:
    param = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise APIError(f"{param} must be an object with a string 'role'", param=param)
    if m["role"] not in CHAT_ROLES:
        raise APIError(f"{param}.role must be one of {', '.join(CHAT_ROLES)}, got {m['role']!r}",
                       param=f"{param}.role")
    content = m.get("content")
    if content is None and m["role"] != "assistant":    # only an answer may be calls alone
        raise APIError(f"{param}.content is required for a {m['role']} message",
                       param=f"{param}.content")
    if content is None:
        content = ""
    elif isinstance(content, list):   # content parts: only text is served
        # an answer OpenAI refused, replayed: its words
        content = text_of_parts(content, f"{param}.content",
                                ("text", "refusal") if m["role"] == "assistant" else ("text",))
    elif not isinstance(content, str):
        raise APIError(f"{param}.content must be a string or a list of text parts", param=param)
    # OpenAI's newer name for the system message (for its reasoning models): chat templates
    # know "system" only, and some drop a role they do not know without a word
    role = "system" if m["role"] == "developer" else m["role"]
    return {**m, "role": role, "content": content}


# vLLM's and OpenAI's fields that would change the answer and that this server does not do
NOT_SERVED_FIELDS = {
    "use_beam_search": "no beam search here (vLLM serves it apart, as its beam_search API)",
    "prompt_embeds": "prompts are text or token ids here",
    "logits_processors": "no custom logits processors run here",
    "chat_template": "the model's own chat template renders the messages",
    "audio": "text output only",
}


def _refuse_what_would_be_ignored(body: dict) -> None:
    """Fields that change what the answer must be, which this server does not do: a clear
    error rather than an answer that silently ignores them. (Fields with no effect on the
    answer, such as `user`, are accepted.)"""
    if read_field(body, "functions", (list,), None):
        raise APIError("'functions' are not supported: send 'tools'", param="functions")
    if read_field(body, "suffix", (str,), None):
        raise APIError("'suffix' is not supported", param="suffix")
    for name, why in NOT_SERVED_FIELDS.items():
        if body.get(name) not in (None, False, [], {}, ""):
            raise APIError(f"'{name}' is not served: {why}", param=name)
    modalities = read_field(body, "modalities", (list,), None)
    if modalities is not None and modalities != ["text"]:
        raise APIError(f"'modalities' serves ['text'] only, got {modalities!r:.80}",
                       param="modalities")


def _allowed_token_ids(body: dict) -> tuple[int, ...]:
    """vLLM's allowed_token_ids: the only ids the output may hold; an empty list would allow
    nothing (vLLM refuses it too)."""
    if body.get("allowed_token_ids") == []:
        raise APIError("'allowed_token_ids' is empty: it would allow no token",
                       param="allowed_token_ids")
    return _token_id_list(body, "allowed_token_ids")


def _truncate_prompt_tokens(body: dict) -> int | None:
    """vLLM's truncate_prompt_tokens: keep the prompt's last N tokens (N >= 1; -1: as many as
    the model's context takes with the answer, which prompts.py resolves)."""
    n = read_field(body, "truncate_prompt_tokens", (int,), None)
    if n is not None and n < 1 and n != -1:
        raise APIError(f"'truncate_prompt_tokens' must be at least 1, or -1 (the model's "
                       f"context), got {n}", param="truncate_prompt_tokens")
    return n


def _tool_choice(body: dict, endpoint: str,
                 auto_tools: bool = False) -> tuple[tuple[dict, ...], str | None]:
    """The tools the chat template is shown, and what the output must be: "required" (a
    list of calls to any of them), a function's name (one call of it), "auto" (words or
    calls, as the model decides), or None (text). OpenAI's default with tools, "auto", needs
    a parser of the model's own tool-call format (`auto_tools`: the gateway was started with
    --tool-call-parser); without one it is refused, as vLLM does."""
    tools = read_field(body, "tools", (list,), None) or []
    choice = read_field(body, "tool_choice", (str, dict), "auto" if tools else "none")
    if not tools and choice in ("none", "auto"):
        return (), None                  # nothing to call
    if endpoint != "chat":
        raise APIError("'tools' are served on /v1/chat/completions only", param="tools")
    names = [_tool_name(t, i) for i, t in enumerate(tools)]
    seen: set[str] = set()          # (each name looked for among all before it: 30,000 tools,
    for name in names:              # a 3 MB body, held the event loop for 8 s)
        if name in seen:
            raise APIError(f"tools name the function {name!r} twice: a call names the "
                           "function it calls, so each tool needs a name of its own",
                           param="tools")
        seen.add(name)
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict) or \
                function.get("name") not in names:
            raise APIError(f"'tool_choice' must name one of the tools ({', '.join(names)}) as "
                           + NAMED_TOOL_CHOICE, param="tool_choice")
        return tuple(tools), function["name"]
    if choice == "none":
        return tuple(tools), None        # shown, none called (OpenAI's and vLLM's default)
    if choice == "auto" and auto_tools:
        return tuple(tools), "auto"
    if choice == "auto":
        raise APIError("tool_choice 'auto' needs a parser of this model's tool-call format "
                       f"(start the server with --tool-call-parser {' or '.join(PARSERS)}): "
                       "send tool_choice 'required' or a named function (calls made by "
                       "constrained decoding), or 'none'", param="tool_choice")
    if choice != "required":
        raise APIError(f"'tool_choice' must be 'none', 'auto', 'required' or a named function, "
                       f"got {choice!r:.100}", param="tool_choice")
    if not tools:
        raise APIError("tool_choice 'required' needs 'tools'", param="tool_choice")
    return tuple(tools), "required"


def _tool_name(tool: Any, i: int) -> str:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or tool.get("type") != "function" or \
            not isinstance(function.get("name"), str) or \
            not TOOL_NAME.fullmatch(function["name"]) or \
            not isinstance(function.get("parameters"), (dict, type(None))):   # null: as absent
        raise APIError(f"tools[{i}] must be " + '{"type": "function", "function": {"name": '
                       '1-64 of a-z A-Z 0-9 _ -, "parameters": a JSON schema}}', param="tools")
    check_strict(function, f"tools[{i}].function", "tools")
    return function["name"]


def check_strict(spec: dict, where: str, param: str) -> None:
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise APIError(f"{where}.strict must be a boolean, got {json_type(spec['strict'])}",
                       param=param)


def tool_call_constraint(tools: tuple[dict, ...], choice: str, parallel: bool) -> dict:
    """vLLM's structured_outputs for a tool choice: the named function's parameters, or a
    list of {"name", "parameters"} objects, one of the tools' each (at most one unless
    parallel calls are allowed). In the list each tool's parameters sit in the list schema's
    $defs, their own `$ref`s rebased, so that "#" and "#/$defs/X" inside them still point
    into those parameters (as pydantic's schemas use them)."""
    def parameters(tool: dict) -> dict:
        schema = tool["function"].get("parameters") or {"type": "object"}
        # a strict function takes no argument its parameters do not name
        return closed_schema(schema) if tool["function"].get("strict") is True else schema
    if choice != "required":
        return {"json": parameters(next(t for t in tools if t["function"]["name"] == choice))}
    names = [t["function"]["name"] for t in tools]
    defs = {f"tool-{name}": rebased_schema(parameters(t), f"/$defs/tool-{name}")
            for name, t in zip(names, tools)}
    calls = {"type": "array", "minItems": 1, "$defs": defs, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                          "parameters": {"$ref": f"#/$defs/tool-{name}"}},
         "required": ["name", "parameters"], "additionalProperties": False} for name in names]}}
    return {"json": calls if parallel else {**calls, "maxItems": 1}}


def _structured_outputs(body: dict, tools: tuple[dict, ...], tool_choice: str | None,
                        parallel_tool_calls: bool) -> tuple[str, str] | None:
    """What the output must match (shared/structured.py), from OpenAI's `response_format`
    (json_object, json_schema), vLLM's `structured_outputs` ({kind: spec}) or its older
    `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, or a tool choice
    that makes the output tool calls: one of them."""
    given: list[tuple[str, Any]] = []
    fmt = read_field(body, "response_format", (dict,), None)
    kind = "text" if fmt is None else fmt.get("type")
    if kind == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise APIError("response_format.json_schema must be an object with a 'schema' (a "
                           "JSON schema)", param="response_format")
        check_strict(spec, "response_format.json_schema", "response_format")
        # strict (OpenAI's structured outputs): no key the schema does not name
        given.append(("response_format", {"json": spec["schema"],
                                          "disable_additional_properties": spec.get("strict") is True}))
    elif kind != "text":                # OpenAI's 400 for a format without a type, too
        raise APIError(f"response_format.type must be 'text', 'json_object' or 'json_schema', "
                       f"got {'nothing' if kind is None else repr(kind)[:100]}",
                       param="response_format")
    options: dict[str, Any] = {}
    options_param = "structured_outputs"
    if (spec := read_field(body, "structured_outputs", (dict,), None)) is not None:
        named = {k for k, v in spec.items() if v is not None and v is not False}
        if named and named <= set(JSON_OPTIONS):     # vLLM's options for another field's schema
            options = {k: spec[k] for k in named}
        else:
            given.append(("structured_outputs", spec))
    if body.get("guided_whitespace_pattern") is not None:     # vLLM's older spelling of one
        options["whitespace_pattern"] = read_field(body, "guided_whitespace_pattern", (str,))
        options_param = "guided_whitespace_pattern"
    # each guided_* field a constraint of its own: two are refused naming both
    given += [(f"guided_{k}", {k: body[f"guided_{k}"]}) for k in KINDS
              if body.get(f"guided_{k}") is not None]
    if tool_choice is not None and tool_choice != "auto":    # auto: the model's own format
        given.append(("tool_choice", tool_call_constraint(tools, tool_choice,
                                                          parallel_tool_calls)))
    if len(given) > 1:
        raise APIError(f"give one constraint on the output, not {' and '.join(n for n, _ in given)}",
                       param=given[1][0])
    if options and not given:
        given.append(("structured_outputs", options))     # structured_pair says what is missing
    elif options:
        if not (isinstance(given[0][1], dict) and {"json", "json_object"} & set(given[0][1])):
            raise APIError(f"{options_param}: {', '.join(sorted(options))} apply to a JSON "
                           f"schema, not to {given[0][0]}", param=options_param)
        given[0] = (given[0][0], {**given[0][1], **options})
    if not given:
        return None
    param, spec = given[0]
    try:
        # named as sent: structured_outputs.KIND is a field the client may not have sent
        return structured_pair(spec, {"response_format": "response_format's schema",
                                      "structured_outputs": None}.get(param, param))
    except InvalidRequestError as e:
        if param == "tool_choice":      # the schema is the tools' parameters, not a field sent
            raise APIError(f"the tools' parameters are not a schema the calls can follow: "
                           f"{str(e).partition(': ')[2] or e}", param="tools") from None
        raise APIError(str(e), param=param) from None


def _choices(body: dict, num_prompts: int) -> int:
    """`n`, checked with `best_of` (OpenAI: at least n; above it would rank candidates, which
    this server does not do) and against MAX_CHOICES over every prompt."""
    n = read_field(body, "n", (int,), 1)
    if n < 1:
        raise APIError(f"'n' must be at least 1, got {n}", param="n")
    best_of = read_field(body, "best_of", (int,), None)
    if best_of is not None and best_of < n:
        raise APIError(f"'best_of' must be at least 'n' ({n}), got {best_of}", param="best_of")
    if best_of is not None and best_of > n:
        raise APIError(f"'best_of' above 'n' is not supported (no ranking of candidates "
                       f"here), got {best_of} with n={n}", param="best_of")
    if n * num_prompts > MAX_CHOICES:
        raise APIError(f"at most {MAX_CHOICES} choices per request, got n={n} for "
                       f"{num_prompts} prompt(s)", param="n")
    return n


def stream_options(body: dict, stream: bool) -> dict | None:
    """The request's `stream_options`, which only a stream may have (a 400 otherwise, as
    vLLM's)."""
    options = read_field(body, "stream_options", (dict,), None)
    if options is not None and not stream:
        raise APIError("'stream_options' needs 'stream' to be true", param="stream_options")
    return options


def _common(body: dict, endpoint: str, *, prompts, messages, max_tokens: int | None,
            logprobs: int | None, echo: bool = False, auto_tools: bool = False,
            max_tokens_field: str = "max_tokens") -> GenerationRequest:
    _refuse_what_would_be_ignored(body)
    tools, tool_choice = _tool_choice(body, endpoint, auto_tools)
    parallel_tool_calls = read_field(body, "parallel_tool_calls", (bool,), True)
    n = _choices(body, max(1, len(prompts)))
    stream = read_field(body, "stream", (bool,), False)
    options = stream_options(body, stream)
    include_usage = (options or {}).get("include_usage", False)
    continuous_usage = (options or {}).get("continuous_usage_stats", False)
    if not isinstance(include_usage, bool) or not isinstance(continuous_usage, bool):
        raise APIError("'stream_options.include_usage' and 'continuous_usage_stats' must be "
                       "booleans", param="stream_options")
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise APIError(f"'temperature' must be >= 0, got {temperature}", param="temperature")
    if temperature < MIN_TEMPERATURE:
        temperature = 0.0
    seed = read_field(body, "seed", (int,), None)      # any int64, as vLLM takes
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise APIError(f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    top_p = max(top_p, MIN_TOP_P)
    top_k = read_field(body, "top_k", (int,), 0)
    if top_k < -1:
        raise APIError(f"'top_k' must be -1 (off), 0 (off) or positive, got {top_k}", param="top_k")
    penalties = {name: _number(body, name, 0.0) for name in ("presence_penalty",
                                                              "frequency_penalty")}
    for name, value in penalties.items():
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise APIError(f"'{name}' must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got "
                           f"{value:g}", param=name)
    repetition = _number(body, "repetition_penalty", 1.0)
    if not 0 < repetition <= MAX_REPETITION_PENALTY:
        raise APIError(f"'repetition_penalty' must be in (0, {MAX_REPETITION_PENALTY:g}], got "
                       f"{repetition:g}", param="repetition_penalty")
    if max_tokens is not None and max_tokens < 1:
        raise APIError(f"'{max_tokens_field}' must be at least 1, got {max_tokens}",
                       param=max_tokens_field)
    min_tokens = read_field(body, "min_tokens", (int,), 0)       # at most max_tokens: prompts.py
    if min_tokens < 0:
        raise APIError(f"'min_tokens' must be at least 0, got {min_tokens}", param="min_tokens")
    prompt_logprobs = read_field(body, "prompt_logprobs", (int,), None)
    if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_LOGPROBS:
        raise APIError(f"'prompt_logprobs' must be in [0, {MAX_LOGPROBS}], got {prompt_logprobs}",
                       param="prompt_logprobs")
    if prompt_logprobs is not None and stream:
        raise APIError("'prompt_logprobs' are returned in a non-streamed answer only (with a "
                       "stream, use echo and logprobs on /v1/completions)",
                       param="prompt_logprobs")
    min_p = _number(body, "min_p", 0.0)
    if not 0 <= min_p <= 1:
        raise APIError(f"'min_p' must be in [0, 1], got {min_p:g}", param="min_p")
    timeout = read_field(body, "timeout", (int, float), None)
    if timeout is not None and not 0 < timeout <= MAX_TIMEOUT_S:
        raise APIError(f"'timeout' must be in (0, {MAX_TIMEOUT_S}] seconds, got {timeout}",
                       param="timeout")
    return GenerationRequest(
        endpoint=endpoint, model=read_field(body, "model", (str,)), prompts=prompts, messages=messages,
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=max(top_k, 0),
        seed=seed, stop=_stop(body),
        stop_token_ids=_token_id_list(body, "stop_token_ids"),
        ignore_eos=read_field(body, "ignore_eos", (bool,), False), logprobs=logprobs,
        repetition_penalty=repetition, **penalties, logit_bias=_logit_bias(body),
        min_tokens=min_tokens, min_p=min_p,
        stream=stream, include_usage=include_usage,
        continuous_usage=include_usage and continuous_usage, n=n,     # vLLM's: only with it
        echo=echo,
        prompt_logprobs=prompt_logprobs, tools=tools, tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
        include_stop_str_in_output=read_field(body, "include_stop_str_in_output", (bool,), False),
        allowed_token_ids=_allowed_token_ids(body),
        bad_words=_bad_words(body),
        truncate_prompt_tokens=_truncate_prompt_tokens(body),
        structured_outputs=_structured_outputs(body, tools, tool_choice, parallel_tool_calls),
        timeout=None if timeout is None else float(timeout),
        skip_special_tokens=read_field(body, "skip_special_tokens", (bool,), True),
        tokens_as_ids=read_field(body, "return_tokens_as_token_ids", (bool,), False),
        add_special_tokens=read_field(body, "add_special_tokens", (bool,),
                                      endpoint == "completions"))


# ---- responses --------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One output token's log-probability, with token ids already turned into text."""
    token: str
    logprob: float | None                   # None: an echoed prompt's first token
    top: list[tuple[str, float]] | None
    # chat's `bytes`: each token's own bytes (part of a character, for some), token then top;
    # None: its text's UTF-8
    raw: tuple[bytes, ...] | None = None
    # where the token's text starts in its choice's text (echoed prompt included): a special
    # token left out of the text, or one that only begins a character, adds nothing there
    offset: int | None = None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage; `prompt_tokens_details.cached_tokens` (the prompt tokens the prefix
    cache held) once the scheduler has said it."""
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def completion_logprobs(entries: list[TokenLogprob], text_offset: int) -> dict:
    """The legacy completions shape; offsets count from the start of the generated text. Each
    `top_logprobs` holds the chosen token's too (up to `logprobs` + 1 entries, as OpenAI and
    vLLM answer); chat's `top_logprobs` are the top ones alone."""
    offsets, at = [], text_offset
    for e in entries:
        offsets.append(at if e.offset is None else e.offset)
        at += len(e.token)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.top is None else {**dict(e.top), e.token: e.logprob}
                             for e in entries],
            "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprob], *, on_read: bool = False) -> dict:
    """Chat's logprobs; `on_read`: their `content` made as its JSON is written (MadeOnRead),
    for a whole answer, whose JSON json_pieces writes."""
    return {"content": MadeOnRead(entries, _chat_entry) if on_read else
            [_chat_entry(e) for e in entries]}


def _chat_entry(e: TokenLogprob) -> dict:
    raw = e.raw or (None,) * (1 + len(e.top))
    return {**_chat_item(e.token, e.logprob, raw[0]),
            "top_logprobs": [_chat_item(t, lp, b) for (t, lp), b in zip(e.top, raw[1:])]}


def _chat_item(token: str, logprob: float | None, raw: bytes | None) -> dict:
    return {"token": token, "logprob": logprob,
            "bytes": list(token.encode("utf-8") if raw is None else raw)}


class MadeOnRead(Sequence):
    """A JSON list whose items are made from `source` as they are read, a slice at a time.
    Made whole, a chat answer's logprobs are 43 containers a token with 20 top ones (a dict
    and a `bytes` list for each), ~350k for 4 choices of 2000 tokens, all alive until the
    answer's JSON was written: the cyclic collector's full passes walked them, holding the
    GIL, and the event loop, for up to ~75 ms each (docs/benchmarks.md#big-answers-and-the-
    garbage-collector). json_pieces writes one slice at a time, which is freed before the
    next is made; json.dumps takes one whole (JSON_DEFAULT)."""
    __slots__ = ("source", "make")

    def __init__(self, source: list, make) -> None:
        self.source, self.make = source, make

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.make(x) for x in self.source[index]]
        return self.make(self.source[index])


def json_default(value: object) -> list:
    """json.dumps's `default=`: a MadeOnRead as the list it stands for."""
    if isinstance(value, MadeOnRead):
        return value[:]
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def vllm_prompt_logprobs(ids: list[int], entries: dict, top: int, text) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None for the first token, then for each token a dict from
    token id to {logprob, rank, decoded_token}: the token's own and the `top` most likely.
    `entries`: position -> PromptEntry; `text`: a token id's text."""
    def item(token_id: int, logprob: float, rank: int) -> tuple[str, dict]:
        return str(token_id), {"logprob": logprob, "rank": rank, "decoded_token": text(token_id)}

    out: list[dict | None] = [None]
    for pos in range(1, len(ids)):
        entry = entries.get(pos)
        if entry is None:
            out.append(None)
            continue
        found = dict([item(ids[pos], entry.logprob, entry.rank)])
        for rank, (token_id, logprob) in enumerate((entry.top or [])[:top], 1):
            found.setdefault(*item(token_id, logprob, rank))
        out.append(found)
    return out


StopReason = str | int | None
"""vLLM's `stop_reason` beside a choice's finish_reason: the stop string found, or the stop
token id sampled (one of `stop_token_ids`), else null (EOS, length, a grammar's end)."""


def completion_choice(index: int, text: str, logprobs: dict | None,
                      finish_reason: str | None, stop_reason: StopReason = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def chat_choice(index: int, text: str | None, logprobs: dict | None, finish_reason: str | None,
                tool_calls: list[dict] | None = None, stop_reason: StopReason = None) -> dict:
    """`text`: the content, also beside tool calls ("auto": words before them); calls made
    by constrained decoding have none (their text is the calls)."""
    message = {"role": "assistant", "content": text} if tool_calls is None else \
        {"role": "assistant", "content": text, "tool_calls": tool_calls}
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": finish_reason, "stop_reason": stop_reason}


def tool_calls(tool_choice: str, text: str) -> list[dict] | None:
    """The calls an output under `tool_choice` makes: the named function's, its arguments the
    text; or the list 'required' made (None if it does not parse: the output was cut short)."""
    if tool_choice != "required":
        return [tool_call(tool_choice, text)]
    try:
        calls = json.loads(text)
    except (ValueError, RecursionError):
        # cut short (max_tokens): the calls written whole before the cut are calls still
        calls = _whole_items(text)
    calls = [c for c in calls if isinstance(c, dict) and isinstance(c.get("name"), str)
             and "parameters" in c]
    return [tool_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
            for c in calls] or None


_SPACE = re.compile(r"[ \t\n\r]*")         # JSON's whitespace


def _whole_items(text: str) -> list:
    """The items of a JSON array cut short that were written whole before the cut."""
    decoder, items = json.JSONDecoder(), []
    at = text.find("[") + 1
    if at == 0:
        return items
    while True:
        try:
            item, at = decoder.raw_decode(text, _SPACE.match(text, at).end())
        except (ValueError, RecursionError):
            return items
        items.append(item)
        at = _SPACE.match(text, at).end()
        if not text.startswith(",", at):
            return items
        at += 1


def tool_call(name: str, arguments: str, index: int | None = None) -> dict:
    """One call in OpenAI's shape (a stream's delta carries its index)."""
    call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}
    return call if index is None else {"index": index, **call}


def chat_delta_choice(index: int, delta: dict, logprobs: dict | None,
                      finish_reason: str | None, stop_reason: StopReason = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def envelope(endpoint: str, response_id: str, model: str, created: int, *, chunk: bool) -> dict:
    if endpoint == "chat":
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        obj = "text_completion"
    return {"id": response_id, "object": obj, "created": created, "model": model}


def models_list(name: str, max_model_len: int, created: int) -> dict:
    return {"object": "list",
            "data": [{"id": name, "object": "model", "created": created,
                      "owned_by": "pacer", "root": name, "max_model_len": max_model_len}]}


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
