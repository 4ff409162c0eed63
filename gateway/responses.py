"""Turning a Generation's deltas into OpenAI's answer: one JSON body, or SSE chunks.

A stream (chat shown; completions carry `text` instead of `delta`):

    data: {"object":"chat.completion.chunk","choices":[{"delta":{"role":"assistant","content":""}}]}
    data: {... "choices":[{"delta":{"content":"Hello"},"finish_reason":null}]}
    data: {... "choices":[{"delta":{},"finish_reason":"stop"}]}
    data: {... "choices":[],"usage":{...}}          # only with stream_options.include_usage
    data: [DONE]
"""
from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections.abc import Iterator
from contextlib import aclosing, suppress

import structlog
from aiohttp import web

from gateway import openai_schema as oai
from gateway.generation import Delta, Generation, merged_deltas
from gateway.openai_schema import APIError, GenerationRequest, TokenLogprob
from gateway.state import STATE
from gateway.tool_parsers import ToolParser, ToolStream, parse_calls

log = structlog.get_logger("gateway.responses")

# an error event's type -> the status of a non-streaming answer (others: 500)
ERROR_STATUS = {"invalid_request_error": 400, "timeout_error": 408, "unavailable_error": 503}
# a request whose deadline passed ran it out: the official OpenAI clients retry a 408 (twice by
# default), each retry running the whole deadline again; this header, which they obey, says not to
ERROR_HEADERS = {"timeout_error": {"x-should-retry": "false"},
                 # a draining gateway cut it off: sent again, it is served once one is back
                 "unavailable_error": {"Retry-After": "1"}}

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


class Shape:
    """The response shape of one endpoint for one request (its choices indexed 0..k-1)."""

    def __init__(self, req: GenerationRequest, response_id: str, model: str, *,
                 num_prompt_tokens: int, headers: dict[str, str] | None = None,
                 tool_parser: ToolParser | None = None) -> None:
        self.req = req
        self.tool_parser = tool_parser                # the model's format, for "auto"
        self.headers = headers or {}                  # sent with the answer or the stream
        self.chat = req.endpoint == "chat"
        self.num_prompt_tokens = num_prompt_tokens    # each prompt once, whatever n is
        self._envelope = (response_id, model, int(time.time()))
        # completions logprobs: where each choice's next token's text starts
        self._text_offset: dict[int, int] = {}
        # tool calls in a stream: the choices whose named call has begun; 'required''s text
        # and logprobs held until the list is whole
        self._called: set[int] = set()
        self._held: dict[int, tuple[str, list[TokenLogprob]]] = {}
        # "auto": each choice's parse so far, and the logprobs of the text it holds
        self._auto: dict[int, tuple[ToolStream, list[TokenLogprob]]] = {}

    def body(self, *, chunk: bool) -> dict:
        body = oai.envelope(self.req.endpoint, *self._envelope, chunk=chunk)
        if chunk and self.req.include_usage:
            body["usage"] = None     # OpenAI: null on every chunk but the usage chunk
        return body

    def usage(self, gens: list[Generation]) -> dict:
        # each prompt's cached tokens once, as its tokens are counted (its first choice's)
        cached = [g.num_cached_tokens for g in gens[::self.req.n]]
        return oai.usage(self.num_prompt_tokens, sum(g.num_output_tokens for g in gens),
                         None if None in cached else sum(cached))

    def logprobs(self, index: int, entries: list[TokenLogprob], *,
                 on_read: bool = False) -> dict | None:
        """A choice's logprobs; `on_read`: made as json_pieces writes them (a whole answer's)."""
        if self.req.logprobs is None:
            return None
        if self.chat:
            return oai.chat_logprobs(entries, on_read=on_read)
        offset = self._text_offset.get(index, 0)
        self._text_offset[index] = offset + sum(len(e.token) for e in entries)
        return oai.completion_logprobs(entries, offset)

    def choice(self, index: int, text: str, entries: list[TokenLogprob],
               finish: str | None, stop_reason: oai.StopReason = None) -> dict:
        """A whole answer's choice, for json_pieces to write."""
        logprobs = self.logprobs(index, entries, on_read=True)
        if not self.chat:
            return oai.completion_choice(index, text, logprobs, finish, stop_reason)
        content, calls = split_calls(self.req, self.tool_parser, text)
        return oai.chat_choice(index, content, logprobs,
                               finish_of_calls(self.req, finish, calls), calls, stop_reason)

    def chunk(self, index: int, text: str | None, entries: list[TokenLogprob],
              finish: str | None, usage: dict | None = None,
              stop_reason: oai.StopReason = None) -> dict | None:
        """A stream's chunk; None when there is nothing to send yet."""
        if self.chat:
            if self.req.tool_choice:
                delta, entries, finish = self._tool_delta(index, text, entries, finish)
                if delta is None:
                    return None
            else:
                delta = {} if text is None else {"content": text}
            choice = oai.chat_delta_choice(index, delta, self.logprobs(index, entries), finish,
                                           stop_reason)
        else:
            choice = oai.completion_choice(index, text or "", self.logprobs(index, entries),
                                           finish, stop_reason)
        return self._chunk_body(choice, usage)

    def held_back(self, index: int, usage: dict | None = None) -> dict | None:
        """A failing choice's text that its tool choice still holds (a call begun under
        "auto", a list of calls not whole yet under 'required'), as a chunk of words, so that
        the client has every token before the error; None when nothing is held."""
        stream, entries = self._auto.pop(index, (None, []))
        text = stream.unsent() if stream is not None else ""
        if not text:
            text, entries = self._held.pop(index, ("", entries))
        if not text and not entries:
            return None
        return self._chunk_body(oai.chat_delta_choice(
            index, {"content": text}, self.logprobs(index, entries), None), usage)

    def _chunk_body(self, choice: dict, usage: dict | None) -> dict:
        body = {**self.body(chunk=True), "choices": [choice]}
        if usage is not None:
            body["usage"] = usage
        return body

    def _tool_delta(self, index: int, text: str | None, entries: list[TokenLogprob],
                    finish: str | None) -> tuple[dict | None, list[TokenLogprob], str | None]:
        """A named function's arguments stream as they come, its first delta naming it;
        'required''s list goes whole at the finish (or, cut short, as text)."""
        choice = self.req.tool_choice
        if choice == "auto":
            return self._auto_delta(index, text, entries, finish)
        if choice != "required":
            if text is None:
                return {}, entries, finish
            if index in self._called:
                return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}, \
                    entries, None
            self._called.add(index)
            return {"tool_calls": [oai.tool_call(choice, text, 0)]}, entries, None
        held, held_entries = self._held.get(index, ("", []))
        if text is not None:
            self._held[index] = (held + text, held_entries + entries)
            return None, [], None
        self._held.pop(index, None)
        calls = oai.tool_calls(choice, held)
        if calls is None:
            return {"content": held}, held_entries, finish
        return {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}, held_entries, \
            finish_of_calls(self.req, finish, calls)

    def _auto_delta(self, index: int, text: str | None, entries: list[TokenLogprob],
                    finish: str | None) -> tuple[dict | None, list[TokenLogprob], str | None]:
        """Words go out as they come, up to where a call may begin; the rest is held and at
        the finish sent as the calls (or, not parsing, as words)."""
        stream, held = self._auto.pop(index, None) or (ToolStream(self.tool_parser), [])
        held = held + entries
        if text is not None:
            out = stream.feed(text)
            self._auto[index] = (stream, [] if out else held)
            return ({"content": out}, held, None) if out else (None, [], None)
        content, found = stream.finish(tool_names(self.req))
        calls = openai_calls(found, self.req.parallel_tool_calls)
        delta: dict = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
        return delta, held, finish_of_calls(self.req, finish, calls)


def split_calls(req: GenerationRequest, parser: ToolParser | None,
                text: str) -> tuple[str | None, list[dict] | None]:
    """A whole chat output's content and tool calls (OpenAI's shape; None: no calls): the
    calls constrained decoding made ("required", a named function: the text is the calls),
    the calls the model wrote in its own format ("auto"), or the text alone."""
    if req.tool_choice == "auto":
        content, found = parse_calls(parser, text, tool_names(req))
        return content, openai_calls(found, req.parallel_tool_calls)
    calls = oai.tool_calls(req.tool_choice, text) if req.tool_choice else None
    return (text if calls is None else None), calls


def tool_names(req: GenerationRequest) -> set[str]:
    """The functions the request offers: a call of any other is words, not a call."""
    return {t["function"]["name"] for t in req.tools}


def openai_calls(found: list[tuple[str, str]], parallel: bool) -> list[dict] | None:
    """Parsed calls in OpenAI's shape (the first alone without parallel calls); None for none."""
    if not found:
        return None
    return [oai.tool_call(name, arguments) for name, arguments in (found if parallel
                                                                    else found[:1])]


def finish_of_calls(req: GenerationRequest, finish: str | None, calls) -> str | None:
    """An output that made tool calls and ended where its grammar did: "tool_calls", for
    tool_choice "auto" and "required"; a named function's call ends as text does, "stop" (as
    OpenAI and vLLM answer a forced function)."""
    named = req.tool_choice not in ("auto", "required")
    return "tool_calls" if calls is not None and finish == "stop" and not named else finish


async def collect(gens: list[Generation]) -> tuple[list[str], list[list[TokenLogprob]]]:
    """Each generation's whole text and logprobs, once all have finished; a failed one is
    an APIError (nothing has been sent yet)."""
    texts: list[list[str]] = [[] for _ in gens]
    entries: list[list[TokenLogprob]] = [[] for _ in gens]
    async with aclosing(merged_deltas(gens)) as deltas:
        async for index, delta in deltas:
            if delta.error is not None:
                raise APIError(f"generation failed: {delta.error}",
                               status=ERROR_STATUS.get(delta.error_type, 500),
                               type=delta.error_type,
                               headers=ERROR_HEADERS.get(delta.error_type))
            texts[index].append(delta.text)
            entries[index] += delta.logprobs
    return ["".join(t) for t in texts], entries


async def full_json(request: web.Request, gens: list[Generation],
                    shape: Shape) -> web.StreamResponse:
    texts, entries = await collect(gens)
    # a batch of prompts as long as the context, with their logprobs (echo's, vLLM's
    # prompt_logprobs: a decode a token and a top one), took seconds on the event loop
    text = await asyncio.to_thread(_full_body, gens, shape, texts, entries)
    return await send_whole(request, text, shape.headers)


def _full_body(gens: list[Generation], shape: Shape, texts: list[str],
               entries: list[list[TokenLogprob]]) -> str:
    """A whole answer's JSON, once every generation has finished. CPU-bound: run it off the
    event loop."""
    body = {**shape.body(chunk=False),
            "choices": [shape.choice(i, texts[i], entries[i], gen.finish_reason,
                                     gen.stop_reason)
                        for i, gen in enumerate(gens)],
            "usage": shape.usage(gens)}
    top = shape.req.prompt_logprobs
    if top is not None and shape.chat:      # vLLM's places: a chat's one prompt, the answer's
        body["prompt_logprobs"] = gens[0].prompt_logprobs(top)
    elif top is not None:                   # each completion choice's own
        for choice, gen in zip(body["choices"], gens):
            choice["prompt_logprobs"] = gen.prompt_logprobs(top)
    return json_text(body)


# a whole answer's JSON is made this many characters at a time (~1 ms of json.dumps)
JSON_PIECE_CHARS = 32768
# how deep json_pieces looks for a long list: an answer's choices, a choice's logprobs, their
# content
_JSON_PIECE_DEPTH = 6


def json_text(body: object, separators: tuple[str, str] = (", ", ": ")) -> str:
    """`json.dumps(body)`, made a piece at a time (json_pieces); run it off the event loop."""
    return "".join(json_pieces(body, separators))


def json_pieces(value: object, separators: tuple[str, str] = (", ", ": "),
                depth: int = _JSON_PIECE_DEPTH) -> Iterator[str]:
    """`json.dumps(value, separators=separators)` in pieces, each a json.dumps of about
    JSON_PIECE_CHARS at most (an item longer than that, deeper than `depth`, aside): a long
    list a slice at a time, a long item looked into. json.dumps holds the GIL for as long as
    it runs, on a thread too: a long output's logprobs, or a long prompt's, in one call (~0.4 s
    for 8k tokens with 20 top ones each) stalled the event loop, and every stream,
    meanwhile; between pieces a thread lets it run."""
    item, key = separators
    if depth and isinstance(value, dict) and all(isinstance(k, str) for k in value):
        yield "{"
        for i, (k, v) in enumerate(value.items()):
            yield (item if i else "") + json.dumps(k) + key
            yield from json_pieces(v, separators, depth - 1)
        yield "}"
    elif depth and isinstance(value, (list, oai.MadeOnRead)):
        yield "["
        first, made = 0, 0
        while first < len(value):
            # as many items as a piece holds at their mean length so far, at most twice as
            # many as so far: the first alone, as one that fills a piece, looked into
            size = min(first, JSON_PIECE_CHARS * first // max(made, 1))
            if size <= 1:
                yield item if first else ""
                for piece in json_pieces(value[first], separators, depth - 1):
                    made += len(piece)
                    yield piece
                first += 1
                continue
            piece = json.dumps(value[first:first + size], separators=separators,
                               default=oai.json_default)[1:-1]
            yield item + piece
            first, made = first + size, made + len(piece)
        yield "]"
    else:
        yield json.dumps(value, separators=separators, default=oai.json_default)


_FRAMING = 64          # a chunk's length line and CRLFs, besides its data
# a whole answer is written this many bytes at a time (send_whole)
WHOLE_PIECE_BYTES = 65536
# SO_LINGER on, for 0 s: closing the socket resets the connection and drops what it holds
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)


class StallBoundResponse(web.StreamResponse):
    """A response that gives up on a client who stops reading. A write waits only where
    the socket's buffers are full (the kernel's, then the transport's past its high-water
    mark); one that waits `stalled_client_timeout_s` closes the connection and raises
    ConnectionResetError, as a client that hung up does, so that the request is aborted
    upstream and the handler ends (its metrics and log line with it). A client still
    reading, however slowly, frees room before then. Writes that cannot wait go untimed:
    the per-token path pays no timer. A write can wait only where the transport has paused
    its writers, which it does past the high-water mark and undoes only once its buffer is
    back under the low one: a write is untimed while the writers are not paused and it
    leaves the buffer at most at the high mark. (Checking the buffer against the high mark
    alone, a small write while paused, the kernel having taken some of the buffer, waited
    untimed, forever; against the low mark, every write was timed under uvloop, whose low
    mark is 16 bytes: a timer and ~0.1 ms of the event loop a token.) The connection is reset, not closed: a closed socket keeps the output the kernel holds
    (MBs) and sends it, then its FIN, to a client that reads again; one that does not keeps
    that memory, and its connection, for as long as it answers the kernel's probes."""

    def __init__(self, headers: dict[str, str]) -> None:
        super().__init__(headers=headers)
        self._transport = None       # set by prepare(), with the three below
        self._protocol = None
        self._high_water = 0
        self._stall_s = 0.0

    async def prepare(self, request: web.BaseRequest):
        self._transport, self._protocol = request.transport, request.protocol
        if self._transport is not None:
            self._high_water = self._transport.get_write_buffer_limits()[1]
        self._stall_s = request.app[STATE].config.stalled_client_timeout_s
        return await super().prepare(request)

    def may_wait(self, size: int) -> bool:
        """Whether writing `size` bytes may wait for the client (then it is timed)."""
        transport = self._transport
        return transport is not None and (
            self._protocol.writing_paused
            or transport.get_write_buffer_size() + size + _FRAMING > self._high_water)

    async def write(self, data) -> None:
        await self._bounded(super().write(data), len(data))

    async def write_eof(self, data: bytes = b"") -> None:
        await self._bounded(super().write_eof(data), len(data))

    async def _bounded(self, writing, size: int) -> None:
        if not self.may_wait(size):
            await writing        # the transport stays under its mark: nothing waits
            return
        transport = self._transport
        try:
            async with asyncio.timeout(self._stall_s):
                await writing
        except TimeoutError:
            sock = transport.get_extra_info("socket")
            with suppress(OSError):          # a socket closed already has nothing to drop
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
            transport.abort()
            raise ConnectionResetError(f"the client read nothing for {self._stall_s:g} s "
                                       "with output waiting") from None


class SSEResponse(StallBoundResponse):
    """An event stream (StallBoundResponse: a client who stops reading is dropped)."""

    def __init__(self, headers: dict[str, str]) -> None:
        super().__init__({**SSE_HEADERS, **headers})


async def send_whole(request: web.Request, text: str,
                     headers: dict[str, str]) -> web.StreamResponse:
    """A whole answer's JSON, written a piece at a time under StallBoundResponse's bound:
    one of MBs (many choices with their logprobs) to a client that read nothing held the
    connection, and the MBs the kernel did not take, for as long as the client kept it open
    (as web.json_response wrote it); each piece waits only until the client has read
    enough of the last, so a slow reader is kept."""
    body = text.encode()
    response = StallBoundResponse({"Content-Type": "application/json; charset=utf-8",
                                   **headers})
    response.content_length = len(body)
    try:
        await response.prepare(request)     # a client gone already fails here
        for start in range(0, len(body), WHOLE_PIECE_BYTES):
            await response.write(body[start:start + WHOLE_PIECE_BYTES])
        await response.write_eof()
    except ConnectionResetError:
        log.info("client disconnected during the answer")
    return response


async def stream_sse(request: web.Request, gens: list[Generation],
                     shape: Shape) -> web.StreamResponse:
    response = SSEResponse(shape.headers)
    try:
        await response.prepare(request)     # a client gone already fails here
        if shape.chat:
            for i in range(len(gens)):
                first = oai.chat_delta_choice(i, {"role": "assistant", "content": ""}, None,
                                              None)
                await response.write(oai.sse({**shape.body(chunk=True), "choices": [first]}))
        async with aclosing(merged_deltas(gens)) as deltas:
            async for index, delta in deltas:
                # vLLM's continuous_usage_stats: the tokens so far on every chunk
                usage = shape.usage(gens) if shape.req.continuous_usage else None
                await _write_delta(response, shape, index, delta, usage)
                if delta.error is not None:
                    break            # the others end with it (aborted upstream)
        if shape.req.include_usage:
            await response.write(oai.sse({**shape.body(chunk=True), "choices": [],
                                          "usage": shape.usage(gens)}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:
        log.info("client disconnected during the stream", request_id=gens[0].request_id)
    return response


async def _write_delta(response: web.StreamResponse, shape: Shape, index: int,
                       delta: Delta, usage: dict | None) -> None:
    """A failed generation's last delta still carries text: the tokens that came with the
    failure, and what was held back as the possible start of a stop string (all of it, for a
    stop string as long as the output). It goes out before the error event, with what a tool
    choice held (a call begun, a list not whole), so the client has every token received."""
    chunks = [shape.chunk(index, delta.text, delta.logprobs, None, usage)] \
        if delta.text or delta.logprobs else []
    if delta.finish_reason is not None and delta.error is None:
        chunks.append(shape.chunk(index, None, [], delta.finish_reason, usage,
                                  delta.stop_reason))
    if delta.error is not None and shape.chat:     # what a tool choice held, as words
        chunks.append(shape.held_back(index, usage))
    for chunk in chunks:
        if chunk is not None:
            await response.write(oai.sse(chunk))
    if delta.error is not None:
        await response.write(oai.sse(oai.error_body(f"generation failed: {delta.error}",
                                                    delta.error_type)))
