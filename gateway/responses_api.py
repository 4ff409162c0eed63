"""OpenAI's Responses API (`POST /v1/responses`), served by the chat path: what is taken
and what is answered, docs/api.md#the-responses-api.

A request is read into the chat completions body it means (`input` and `instructions` become
messages, function-call items the assistant's tool calls and tool messages,
`max_output_tokens` the token limit, `text.format` the response format) and goes through
`parse_chat` and the same generation as /v1/chat/completions; only the answer's shape is this
module's: a `response` object (a message, then a `function_call` item per call), or a stream
of typed events

    event: response.created             {"response": {... "status": "in_progress"}}
    event: response.in_progress
    event: response.output_item.added   the assistant message, empty (at its first text)
    event: response.content_part.added  its output_text part, empty
    event: response.output_text.delta   {"delta": "Hel"} ... one per piece of text
    event: response.output_text.done    {"text": the whole text}
    event: response.content_part.done
    event: response.output_item.done
    ...                                 each call: item added, arguments delta and done, done
    event: response.completed           {"response": {... "output": [...], "usage": {...}}}
"""
from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from contextlib import aclosing
from collections.abc import Sequence
from typing import Any

import structlog
from aiohttp import web

from gateway.generation import Generation, merged_deltas
from gateway import openai_schema as oai
from gateway.openai_schema import APIError, GenerationRequest, TokenLogprob, read_field
from gateway.responses import (JSON_PIECE_CHARS, SSEResponse, collect, json_text, openai_calls,
                               send_whole, split_calls, tool_names)
from gateway.tool_parsers import ToolParser, ToolStream
from shared import chat_template
from shared.errors import InvalidRequestError

log = structlog.get_logger("gateway.responses_api")

# vLLM's sampling extensions, taken on /v1/responses as on the chat endpoint
SAMPLING_EXTRAS = ("top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                   "ignore_eos", "bad_words", "allowed_token_ids", "include_stop_str_in_output",
                   "timeout", "skip_special_tokens")
# vLLM's fields that chat takes and that mean the same here: structured outputs, the prompt's
# truncation, the chat template's turn
CHAT_EXTRAS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar", "guided_whitespace_pattern", "truncate_prompt_tokens",
               "add_generation_prompt", "continue_final_message")
# Fields of the other endpoints whose answer a response object has no place for
NOT_ON_RESPONSES = ("best_of", "echo", "prompt_logprobs", "suffix", "functions")
# a failed response's error.code must be one of the Responses API's codes (the client's types
# hold them to those); the error's own type goes beside it, in `type`
FAILED_CODES = {"invalid_request_error": "invalid_prompt"}
# Chat fields that have another spelling here: sent, they would be silently ignored
CHAT_SPELLINGS = {"messages": "input", "max_tokens": "max_output_tokens",
                  "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
                  "n": None, "logprobs": None}
# stream_options here: OpenAI's one option, not to pad events (nothing here is padded)
STREAM_OPTIONS = ("include_obfuscation",)


def in_responses_terms(error: APIError) -> APIError:
    """An error the chat path raised, naming the field as /v1/responses spells it (a prompt
    too long for the context is 'input''s fault here, not 'messages'')."""
    name = CHAT_SPELLINGS.get(error.param or "")
    if name is not None:
        error.message = re.sub(rf"\b{re.escape(error.param)}\b", name, error.message)
        error.args, error.param = (error.message,), name
    return error


# Fields that need a stored response or a server-side tool; none is kept or run here
NOT_SERVED = ("previous_response_id", "conversation", "prompt")
LOGPROBS_INCLUDE = "message.output_text.logprobs"    # the one `include` served
INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


def chat_body(body: Any) -> tuple[dict, dict]:
    """The chat completions body a Responses request means, and the request's own fields
    that its response object repeats."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    for name, instead in CHAT_SPELLINGS.items():
        if name in body:
            raise APIError(f"'{name}' is not a field of /v1/responses" +
                           (f": send '{instead}'" if instead else ""), param=name)
    for name in NOT_ON_RESPONSES:
        if body.get(name) not in (None, False):
            raise APIError(f"'{name}' is not served on /v1/responses (a response object has no "
                           f"place for it)", param=name)
    for name in NOT_SERVED:
        if body.get(name) is not None:
            raise APIError(f"'{name}' is not served: responses are not stored here, and "
                           f"each request stands alone", param=name)
    read_field(body, "store", (bool,), None)     # answered false whatever it asks: a boolean
    if read_field(body, "background", (bool,), False):
        raise APIError("'background' responses are not served (nothing is stored)",
                       param="background")
    stream = read_field(body, "stream", (bool,), False)
    options = oai.stream_options(body, stream) or {}
    for name, value in options.items():
        if name not in STREAM_OPTIONS or not isinstance(value, bool):
            raise APIError(f"'stream_options' on /v1/responses takes {', '.join(STREAM_OPTIONS)} "
                           f"(a boolean) only, got {name!r:.60}: usage comes in "
                           "response.completed", param="stream_options")
    include = read_field(body, "include", (list,), None) or []
    if any(item != LOGPROBS_INCLUDE for item in include):
        raise APIError(f"'include' serves {LOGPROBS_INCLUDE!r} only (no reasoning or tool "
                       "results here)", param="include")
    instructions = read_field(body, "instructions", (str,), None)
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + \
        _messages(read_field(body, "input", (str, list)))
    chat: dict[str, Any] = {"model": read_field(body, "model", (str,)), "messages": messages,
                            "stream": stream}
    tools = [_tool(t, i) for i, t in enumerate(read_field(body, "tools", (list,), None) or [])]
    choice = read_field(body, "tool_choice", (str, dict), "auto" if tools else "none")
    if tools:
        chat["tools"] = tools
        chat["parallel_tool_calls"] = read_field(body, "parallel_tool_calls", (bool,), True)
    if tools or body.get("tool_choice") is not None:    # chat's checks: 'required' needs tools
        chat["tool_choice"] = _tool_choice(choice, tools)
    max_output = read_field(body, "max_output_tokens", (int,), None)
    if max_output is not None:
        if max_output < 1:
            raise APIError(f"'max_output_tokens' must be at least 1, got {max_output}",
                           param="max_output_tokens")
        chat["max_tokens"] = max_output
    for name in ("temperature", "top_p", *SAMPLING_EXTRAS, *CHAT_EXTRAS):
        if body.get(name) is not None:
            chat[name] = body[name]
    top_logprobs = read_field(body, "top_logprobs", (int,), None)
    if include or top_logprobs is not None:        # the output text's, as chat gives them
        if tools:
            raise APIError("logprobs beside tools are not served on /v1/responses",
                           param="top_logprobs" if top_logprobs is not None else "include")
        chat["logprobs"] = True
        if top_logprobs is not None:
            chat["top_logprobs"] = top_logprobs
    text = read_field(body, "text", (dict,), None) or {}
    fmt = text.get("format") or {"type": "text"}
    if not isinstance(fmt, dict):
        raise APIError("'text.format' must be an object", param="text.format")
    if fmt.get("type") == "json_schema":
        # checked here: chat's errors would name its own json_schema, no field of this API
        if not isinstance(fmt.get("schema"), dict):
            raise APIError("'text.format.schema' must be a JSON schema (an object) where "
                           "text.format.type is 'json_schema'", param="text.format.schema")
        oai.check_strict(fmt, "text.format", "text.format")
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "response"), "schema": fmt.get("schema"),
            "strict": fmt.get("strict")}}
    elif fmt.get("type") != "text":
        chat["response_format"] = {"type": fmt.get("type")}
    truncation = read_field(body, "truncation", (str,), "disabled")
    if truncation not in ("disabled", "auto"):
        raise APIError(f"'truncation' must be 'disabled' or 'auto', got {truncation!r:.60}",
                       param="truncation")
    if truncation == "auto":          # the input's end, as much as the context holds
        if body.get("truncate_prompt_tokens") is not None:
            raise APIError("give 'truncation' or vLLM's 'truncate_prompt_tokens', not both",
                           param="truncate_prompt_tokens")
        chat["truncate_prompt_tokens"] = -1
    metadata = read_field(body, "metadata", (dict,), None)
    echo = {"instructions": instructions, "max_output_tokens": max_output,
            "top_logprobs": top_logprobs,
            "temperature": read_field(body, "temperature", (int, float), 1.0),
            "top_p": read_field(body, "top_p", (int, float), 1.0),
            "text": {"format": fmt}, "truncation": truncation, "metadata": metadata or {},
            "tools": body.get("tools") or [], "tool_choice": choice,
            "parallel_tool_calls": chat.get("parallel_tool_calls", True)}
    return chat, echo


def _tool(tool: Any, i: int) -> dict:
    """A Responses function tool ({"type", "name", "parameters", ...}) as chat's; checked here,
    so that an error shows this API's shape, not chat's."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else oai.json_type(tool)
        raise APIError(f"tools[{i}]: only function tools are served (nothing runs tools "
                       f"here), got {kind!r:.60}", param="tools")
    if not isinstance(tool.get("name"), str) or not oai.TOOL_NAME.fullmatch(tool["name"]) or \
            not isinstance(tool.get("parameters"), (dict, type(None))):   # null: as absent
        raise APIError(f"tools[{i}] must be " + '{"type": "function", "name": 1-64 of a-z A-Z '
                       '0-9 _ -, "parameters": a JSON schema} (chat\'s nested "function" is '
                       'not this API\'s shape)', param="tools")
    oai.check_strict(tool, f"tools[{i}]", "tools")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict, tools: list[dict]) -> str | dict:
    if isinstance(choice, dict):
        names = [t["function"]["name"] for t in tools]
        if choice.get("type") != "function" or choice.get("name") not in names:
            raise APIError("'tool_choice' must be 'none', 'auto', 'required' or "
                           '{"type": "function", "name": ...} naming one of the tools ('
                           + ", ".join(names) + ")", param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _messages(given: str | list) -> list[dict]:
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not given:
        raise APIError("'input' must hold at least one message", param="input")
    messages: list[dict] = []
    call_ids: set[str] = set()
    for i, item in enumerate(given):
        param = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else oai.json_type(item)
        if kind == "function_call":
            call = {"id": _text(item, "call_id", param), "type": "function", "function": {
                "name": _text(item, "name", param), "arguments": _text(item, "arguments", param)}}
            try:         # checked here, where its error can name the item as sent
                chat_template.call_arguments(call["function"]["arguments"], f"{param}.arguments")
            except InvalidRequestError as e:
                raise APIError(str(e), param=param) from None
            call_ids.add(call["id"])
            # the calls made together, and the words said before them (a response's message
            # item, then its function_call items), are one assistant turn, as chat has them
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            continue
        if kind == "function_call_output":
            call_id = _text(item, "call_id", param)
            if call_id not in call_ids:      # as OpenAI: an output answers a call given before
                raise APIError(f"{param}: no function_call with call_id {call_id!r:.60} comes "
                               "before this output in 'input'", param=param)
            output = item.get("output")      # a string, or (as OpenAI takes) text parts
            messages.append({"role": "tool", "tool_call_id": call_id, "content": (
                oai.text_of_parts(output, f"{param}.output", TEXT_PARTS)
                if isinstance(output, list) else _text(item, "output", param))})
            continue
        if kind != "message":
            raise APIError(f"{param}: only messages, function calls and their outputs are "
                           f"served, got {kind!r:.60}", param=param)
        role, content = item.get("role"), item.get("content")
        if role not in INPUT_ROLES:
            raise APIError(f"{param}.role must be one of {', '.join(INPUT_ROLES)}, got "
                           f"{role!r:.60}", param=f"{param}.role")
        if isinstance(content, list):
            content = oai.text_of_parts(content, f"{param}.content", TEXT_PARTS)
        elif not isinstance(content, str):
            raise APIError(f"{param}.content must be a string or a list of text parts",
                           param=f"{param}.content")
        messages.append({"role": role, "content": content})
    return messages


def _logprobs(entries: list[TokenLogprob] | None, on_read: bool = False) -> Sequence[dict]:
    """An output text's logprobs in OpenAI's shape (chat's: token, logprob, bytes, top);
    `on_read`: made as json_pieces writes them (a whole answer's: oai.MadeOnRead)."""
    if not entries:
        return []
    return oai.chat_logprobs(entries, on_read=on_read)["content"]


class RawJSON:
    """JSON made already, in pieces, which `ResponseShape.send` writes where this stands: a
    stream's logprobs, made as their deltas went out, in each of its closing events."""
    __slots__ = ("pieces",)

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces


# what stands for a RawJSON in json.dumps's output until its text replaces it (no text the
# model writes holds it: a NUL, then this process's random id)
_RAW = f"\0raw-{uuid.uuid4().hex}"
_RAW_DUMPED = json.dumps(_RAW)


def _text(item: dict, name: str, param: str) -> str:
    if not isinstance(item.get(name), str):
        raise APIError(f"{param}.{name} must be a string", param=f"{param}.{name}")
    return item[name]


class ResponseShape:
    """One response's object and events; `echo`: the request's fields it repeats."""

    def __init__(self, response_id: str, model: str, echo: dict, num_prompt_tokens: int,
                 headers: dict[str, str]) -> None:
        self.response_id, self.model, self.echo = response_id, model, echo
        self.num_prompt_tokens, self.headers = num_prompt_tokens, headers
        self.message_id = "msg_" + response_id.removeprefix("resp_")
        self.created_at = int(time.time())
        self._sequence = 0

    def response(self, status: str, output: list[dict], *, usage: dict | None = None,
                 incomplete: str | None = None, error: dict | None = None) -> dict:
        return {"id": self.response_id, "object": "response", "created_at": self.created_at,
                "status": status, "error": error,
                "incomplete_details": None if incomplete is None else {"reason": incomplete},
                "model": self.model, "output": output, "previous_response_id": None,
                "store": False, "usage": usage, **self.echo}

    def message(self, text: str | None, status: str,
                logprobs: list[TokenLogprob] | RawJSON | None = None,
                on_read: bool = False) -> dict:
        content = [] if text is None else [self.part(text, logprobs, on_read)]
        return {"type": "message", "id": self.message_id, "status": status,
                "role": "assistant", "content": content}

    @staticmethod
    def part(text: str, logprobs: list[TokenLogprob] | RawJSON | None = None,
             on_read: bool = False) -> dict:
        return {"type": "output_text", "text": text, "annotations": [],
                "logprobs": logprobs if isinstance(logprobs, RawJSON) else
                _logprobs(logprobs, on_read)}

    @staticmethod
    def function_call(call: dict, status: str = "completed", arguments: str | None = None) -> dict:
        """An OpenAI chat tool call (`oai.tool_call`) as a Responses output item; `status`
        incomplete where max_output_tokens cut the output (its arguments may not parse)."""
        return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"),
                "call_id": call["id"], "name": call["function"]["name"],
                "arguments": call["function"]["arguments"] if arguments is None else arguments,
                "status": status}

    def usage(self, num_output_tokens: int, num_cached_tokens: int | None) -> dict:
        return {"input_tokens": self.num_prompt_tokens,
                # cache_write_tokens: the client's types require it; none is written to a
                # cache that is paid for
                "input_tokens_details": {"cached_tokens": num_cached_tokens or 0,
                                         "cache_write_tokens": 0},
                "output_tokens": num_output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.num_prompt_tokens + num_output_tokens}

    @staticmethod
    def status(gen: Generation) -> str:
        """completed, or incomplete where max_output_tokens cut the output."""
        return "incomplete" if gen.finish_reason == "length" else "completed"

    def final(self, content: str | None, calls: list[dict] | None, gen: Generation,
              logprobs: list[TokenLogprob] | None = None) -> dict:
        """The finished response: its message (unless it only calls), then its calls; for
        json_pieces to write (its logprobs made as they are written)."""
        status = self.status(gen)
        output = ([self.message(content or "", status, logprobs, on_read=True)]
                  if content or not calls else [])
        return self.finished(output + [self.function_call(c, status) for c in calls or []], gen)

    def finished(self, output: list[dict], gen: Generation) -> dict:
        status = self.status(gen)
        return self.response(status, output,
                             usage=self.usage(gen.num_output_tokens, gen.num_cached_tokens),
                             incomplete="max_output_tokens" if status == "incomplete" else None)

    async def send(self, out: web.StreamResponse, kind: str, /, **fields: Any) -> None:
        """Writes one event. A RawJSON in `fields` is written as its pieces are, the event
        loop free between them (a long output's logprobs are MBs of JSON)."""
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        raws: list[RawJSON] = []

        def raw(value: object) -> str:
            if not isinstance(value, RawJSON):
                raise TypeError(f"{type(value).__name__} is not JSON serializable")
            raws.append(value)
            return _RAW
        around = json.dumps(payload, separators=(",", ":"), default=raw).split(_RAW_DUMPED)
        parts = [f"event: {kind}\ndata: {around[0]}".encode()]
        for value, after in zip(raws, around[1:]):
            for i, piece in enumerate(value.pieces):
                if i:       # what is made goes out, then the other streams have their turn
                    await out.write(b"".join(parts))
                    parts = []
                    await asyncio.sleep(0)
                parts.append(piece)
            parts.append(after.encode())
        await out.write(b"".join(parts) + b"\n\n")

    def item_fields(self, **more: Any) -> dict:
        return {"item_id": self.message_id, "output_index": 0, "content_index": 0, **more}


async def response_json(request: web.Request, gens: list[Generation], req: GenerationRequest,
                        parser: ToolParser | None, shape: ResponseShape) -> web.StreamResponse:
    [text], [entries] = await collect(gens)
    # off the event loop, its JSON a piece at a time (json_text): a long output's logprobs
    # (8k tokens with 20 top ones) took ~1 s to make and serialize, every stream stalled
    body = await asyncio.to_thread(
        lambda: json_text(shape.final(*split_calls(req, parser, text), gens[0], entries)))
    return await send_whole(request, body, shape.headers)


class _MessageEvents:
    """The assistant message's events in a stream, opened at its first text. Its logprobs'
    JSON is made once, a delta's at a time as they go out: the closing events (the text's,
    the part's, the item's, the response's) each carry them all, which a long output's made
    and serialized afresh in each, on the event loop (8k tokens with 20 top ones: seconds,
    every stream stalled)."""

    def __init__(self, response: web.StreamResponse, shape: ResponseShape) -> None:
        self.response, self.shape = response, shape
        self.pieces: list[str] = []
        # the logprobs' JSON so far, brackets off: pieces of about JSON_PIECE_CHARS, then
        # the entries of the deltas since
        self.logprobs_made: list[bytes] = []
        self.logprobs_since: list[str] = []
        self.since_chars = 0
        self.opened = False

    async def text(self, piece: str, logprobs: list[TokenLogprob] | None = None) -> None:
        shape = self.shape
        if not self.opened:
            self.opened = True
            await shape.send(self.response, "response.output_item.added", output_index=0,
                             item=shape.message(None, "in_progress"))
            await shape.send(self.response, "response.content_part.added",
                             **shape.item_fields(part=shape.part("")))
        if piece or logprobs:       # a token with no text of its own (EOS) has logprobs
            self.pieces.append(piece)
            made = json.dumps(_logprobs(logprobs), separators=(",", ":"))
            if made != "[]":
                self.logprobs_since.append(made[1:-1])
                self.since_chars += len(made)
                if self.since_chars >= JSON_PIECE_CHARS:
                    self._logprobs_piece()
            await shape.send(self.response, "response.output_text.delta",
                             **shape.item_fields(delta=piece, logprobs=RawJSON([made.encode()])))

    def _logprobs_piece(self) -> None:
        comma = "," if self.logprobs_made else ""
        self.logprobs_made.append((comma + ",".join(self.logprobs_since)).encode())
        self.logprobs_since, self.since_chars = [], 0

    def item(self, status: str) -> dict:
        """The message so far, as an output item."""
        if self.logprobs_since:
            self._logprobs_piece()
        logprobs = RawJSON([b"[", *self.logprobs_made, b"]"])
        return self.shape.message("".join(self.pieces), status, logprobs)

    async def close(self, status: str) -> dict:
        """The closing events; the message's item, as the response's output has it."""
        shape, item = self.shape, self.item(status)
        part = item["content"][0]
        await shape.send(self.response, "response.output_text.done",
                         **shape.item_fields(text=part["text"], logprobs=part["logprobs"]))
        await shape.send(self.response, "response.content_part.done",
                         **shape.item_fields(part=part))
        await shape.send(self.response, "response.output_item.done", output_index=0, item=item)
        return item


async def response_sse(request: web.Request, gens: list[Generation], req: GenerationRequest,
                       parser: ToolParser | None, shape: ResponseShape) -> web.StreamResponse:
    """The events of one response. Words stream as they come; under a tool choice, up to
    where a call may begin ("auto"; none for calls made by constrained decoding), and the
    calls follow whole at the end."""
    [gen] = gens
    response = SSEResponse(shape.headers)
    started = shape.response("in_progress", [])
    message = _MessageEvents(response, shape)
    calls_stream = ToolStream(parser) if req.tool_choice == "auto" else None
    constrained = bool(req.tool_choice) and calls_stream is None   # the text is the calls
    held: list[str] = []
    try:
        await response.prepare(request)     # a client gone already fails here
        await shape.send(response, "response.created", response=started)
        await shape.send(response, "response.in_progress", response=started)
        async with aclosing(merged_deltas(gens)) as deltas:
            async for _, delta in deltas:
                if constrained:
                    held.append(delta.text)
                else:
                    piece = calls_stream.feed(delta.text) if calls_stream else delta.text
                    if piece or delta.logprobs:
                        await message.text(piece, delta.logprobs)
                if delta.error is not None:
                    # a failure's last delta still has text (its tokens): sent above, with
                    # what the tool choice held (a call begun, a list not whole) as words;
                    # the message so far is the failed response's output
                    rest = "".join(held) if constrained else \
                        calls_stream.unsent() if calls_stream else ""
                    if rest:
                        await message.text(rest)
                    output = [message.item("incomplete")] if message.opened else []
                    failed = shape.response("failed", output, error={
                        "code": FAILED_CODES.get(delta.error_type, "server_error"),
                        "type": delta.error_type,
                        "message": f"generation failed: {delta.error}"})
                    await shape.send(response, "response.failed", response=failed)
                    await response.write_eof()
                    return response
        calls = None
        if calls_stream is not None:
            tail, found = calls_stream.finish(tool_names(req))
            calls = openai_calls(found, req.parallel_tool_calls)
            if tail:
                await message.text(tail)
        elif constrained:
            content, calls = split_calls(req, parser, "".join(held))
            if calls is None and content:
                await message.text(content)       # a list of calls cut short: its text
        status = shape.status(gen)
        output = []
        if message.opened or not calls:          # a message, unless the output only calls
            await message.text("")
            output.append(await message.close(status))
        for call in calls or []:
            index = len(output)
            await shape.send(response, "response.output_item.added", output_index=index,
                             item=shape.function_call(call, "in_progress", ""))
            ids = {"item_id": shape.function_call(call)["id"], "output_index": index}
            arguments = call["function"]["arguments"]
            await shape.send(response, "response.function_call_arguments.delta",
                             **ids, delta=arguments)
            await shape.send(response, "response.function_call_arguments.done",
                             **ids, arguments=arguments)
            item = shape.function_call(call, status)
            await shape.send(response, "response.output_item.done", output_index=index,
                             item=item)
            output.append(item)
        await shape.send(response, f"response.{status}",
                         response=shape.finished(output, gen))
        await response.write_eof()
    except ConnectionResetError:     # the generation's owner aborts it upstream
        log.info("client disconnected during the stream", request_id=gen.request_id)
    return response
