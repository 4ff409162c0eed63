"""Turning a Generation's deltas into OpenAI's answer: one JSON body, or SSE chunks.

A stream (chat shown; completions carry `text` instead of `delta`):

    data: {"object":"chat.completion.chunk","choices":[{"delta":{"role":"assistant","content":""}}]}
    data: {... "choices":[{"delta":{"content":"Hello"},"finish_reason":null}]}
    data: {... "choices":[{"delta":{},"finish_reason":"stop"}]}
    data: {... "choices":[],"usage":{...}}          # only with stream_options.include_usage
    data: [DONE]
"""
from __future__ import annotations

import time

import structlog
from aiohttp import web

from gateway import openai_schema as oai
from gateway.generation import Delta, Generation
from gateway.openai_schema import APIError, GenerationRequest, TokenLogprob

log = structlog.get_logger("gateway.responses")

# an error event's type -> the status of a non-streaming answer (others: 500)
ERROR_STATUS = {"invalid_request_error": 400, "timeout_error": 408}

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


class Shape:
    """The response shape of one endpoint for one request."""

    def __init__(self, req: GenerationRequest, response_id: str, model: str) -> None:
        self.req = req
        self.chat = req.endpoint == "chat"
        self._envelope = (response_id, model, int(time.time()))
        self._text_offset = 0     # completions logprobs: where the next token's text starts

    def body(self, *, chunk: bool) -> dict:
        body = oai.envelope(self.req.endpoint, *self._envelope, chunk=chunk)
        if chunk and self.req.include_usage:
            body["usage"] = None     # OpenAI: null on every chunk but the usage chunk
        return body

    def logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        if self.req.logprobs is None:
            return None
        if self.chat:
            return oai.chat_logprobs(entries)
        result = oai.completion_logprobs(entries, self._text_offset)
        self._text_offset += sum(len(e.token) for e in entries)
        return result

    def chunk(self, text: str | None, entries: list[TokenLogprob], finish: str | None) -> dict:
        if self.chat:
            delta = {} if text is None else {"content": text}
            choice = oai.chat_delta_choice(delta, self.logprobs(entries), finish)
        else:
            choice = oai.completion_choice(text or "", self.logprobs(entries), finish)
        return {**self.body(chunk=True), "choices": [choice]}


async def full_json(gen: Generation, shape: Shape) -> web.Response:
    texts: list[str] = []
    entries: list[TokenLogprob] = []
    async for delta in gen.deltas():
        if delta.error is not None:
            raise APIError(f"generation failed: {delta.error}",
                           status=ERROR_STATUS.get(delta.error_type, 500), type=delta.error_type)
        texts.append(delta.text)
        entries += delta.logprobs
    make = oai.chat_choice if shape.chat else oai.completion_choice
    body = {**shape.body(chunk=False),
            "choices": [make("".join(texts), shape.logprobs(entries), gen.finish_reason)],
            "usage": oai.usage(gen.num_prompt_tokens, gen.num_output_tokens)}
    return web.json_response(body)


async def stream_sse(request: web.Request, gen: Generation, shape: Shape) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    try:
        if shape.chat:
            first = oai.chat_delta_choice({"role": "assistant", "content": ""}, None, None)
            await response.write(oai.sse({**shape.body(chunk=True), "choices": [first]}))
        async for delta in gen.deltas():
            await _write_delta(response, shape, delta)
        if shape.req.include_usage:
            await response.write(oai.sse({**shape.body(chunk=True), "choices": [],
                                          "usage": oai.usage(gen.num_prompt_tokens,
                                                             gen.num_output_tokens)}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:
        log.info("client disconnected during the stream", request_id=gen.request_id)
    return response


async def _write_delta(response: web.StreamResponse, shape: Shape, delta: Delta) -> None:
    if delta.error is not None:
        await response.write(oai.sse(oai.error_body(f"generation failed: {delta.error}",
                                                    delta.error_type)))
        return
    if delta.text or delta.logprobs:
        await response.write(oai.sse(shape.chunk(delta.text, delta.logprobs, None)))
    if delta.finish_reason is not None:
        await response.write(oai.sse(shape.chunk(None, [], delta.finish_reason)))
