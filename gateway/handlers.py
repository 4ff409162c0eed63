"""The HTTP endpoints. Errors are raised as APIError and answered by the error middleware."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError

from gateway import openai_schema as oai
from gateway.generation import Generation
from gateway.openapi import openapi_spec
from gateway.openai_schema import APIError, GenerationRequest
from gateway.prompts import (chat_prompt, check_vocabulary, choice_sampling, echo_texts,
                             prompt_token_ids, sampling_params)
from gateway.responses import Shape, full_json, json_text, send_whole, stream_sse
from gateway.responses_api import (ResponseShape, chat_body, in_responses_terms, response_json,
                                   response_sse)
from gateway.state import STATE, GatewayState, WaitingSlot
from shared.errors import InvalidRequestError
from shared.json_file import parse_user_json
from shared.redis_retry import redis_trouble

log = structlog.get_logger("gateway.handlers")

RETRY_AFTER_S = 1
try:
    PACKAGE_VERSION = importlib.metadata.version("pacer")
except importlib.metadata.PackageNotFoundError:      # run from a checkout, not installed
    PACKAGE_VERSION = "unknown"
SUBSCRIBE_WAIT_S = 2.0
# how long /health and /metrics wait for Redis: a stalled server (SIGSTOP, a full disk) would
# hold them for the socket timeout (10 s), and a probe that times out says nothing of why
REDIS_ANSWER_S = 1.5
NO_ANSWER = f"no answer within {REDIS_ANSWER_S:g} s"
THREADED_PARSE_BYTES = 256 * 1024
# a request body still arriving after this long is refused (408): a client that opens
# requests and never finishes them holds nothing for long
BODY_TIMEOUT_S = 30.0
# the request bodies being read at once hold at most this many times --max-body-bytes between
# them (a body's bytes as they arrive): past it a request is refused (429). Unbounded, every
# connection could hold a body of almost the limit: 200 held 1.5 GB of the gateway's memory
BODIES_READ_AT_ONCE = 64


@dataclass(frozen=True)
class Reply:
    """What every answer's envelope carries."""
    response_id: str
    model: str
    num_prompt_tokens: int          # each prompt once, whatever n is
    headers: dict[str, str]


# How a request's generations are answered: (HTTP request, generations, parsed request,
# envelope) -> the response
Answer = Callable[[web.Request, list[Generation], GenerationRequest, Reply],
                  Awaitable[web.StreamResponse]]


async def _openai_answer(request: web.Request, gens: list[Generation], req: GenerationRequest,
                         reply: Reply) -> web.StreamResponse:
    """Completions' and chat completions' shape: a JSON body, or SSE chunks."""
    shape = Shape(req, reply.response_id, reply.model, num_prompt_tokens=reply.num_prompt_tokens,
                  headers=reply.headers, tool_parser=request.app[STATE].tool_parser)
    if req.stream:
        return await stream_sse(request, gens, shape)
    return await full_json(request, gens, shape)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, functools.partial(
        oai.parse_completion, max_model_len=request.app[STATE].max_model_len), "cmpl-")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    auto_tools = request.app[STATE].tool_parser is not None
    return await _generate(request, functools.partial(oai.parse_chat, auto_tools=auto_tools),
                           "chatcmpl-")


async def responses(request: web.Request) -> web.StreamResponse:
    """OpenAI's Responses API, through the chat path (gateway/responses_api.py)."""
    echo: dict = {}                 # the request's fields its response object repeats
    parser = request.app[STATE].tool_parser
    translated = False              # its fields are the chat path's from here on

    def parse(body: Any) -> GenerationRequest:
        nonlocal translated
        chat, fields = chat_body(body)
        echo.update(fields)
        translated = True
        return oai.parse_chat(chat, auto_tools=parser is not None)

    async def answer(request: web.Request, gens: list[Generation], req: GenerationRequest,
                     reply: Reply) -> web.StreamResponse:
        shape = ResponseShape(reply.response_id, reply.model, echo, reply.num_prompt_tokens,
                              reply.headers)
        if req.stream:
            return await response_sse(request, gens, req, parser, shape)
        return await response_json(request, gens, req, parser, shape)
    try:
        return await _generate(request, parse, "resp_", answer)
    except APIError as error:
        raise in_responses_terms(error) if translated else error from None


async def stored_response(request: web.Request) -> web.Response:
    """OpenAI's retrieve, delete and cancel of a stored response: nothing is stored here."""
    raise APIError(f"no response {request.match_info['response_id']!r:.80} is stored: this "
                   "server keeps none (every response says \"store\": false)", status=404,
                   param="response_id", code="response_not_found")


async def _generate(request: web.Request, parse: Callable[[Any], GenerationRequest],
                    id_prefix: str, answer: Answer = _openai_answer) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE]
    _refuse_new_requests(state)     # before the body is read
    _check_room(state, 1)           # a full queue too: its 429 need not wait for the body
    client_id = oai.client_request_id(request.headers)
    # the body first: a client that sends it slowly (or never) holds no place in the queue
    body = await _read_json(request, state)
    slot = _admit(state)
    # a drain waits for it from here, on its way in (its prompt tokenized, its chat template
    # rendered) as much as streaming: counted only once its stream was open, one admitted
    # just before the signal was not waited for, and the server cut it off mid-stream
    state.num_admitted += 1
    try:
        return await _generate_in_slot(request, body, parse, id_prefix, answer, state, slot,
                                       arrival, client_id)
    finally:
        slot.release()
        state.num_admitted -= 1


async def _generate_in_slot(request: web.Request, body: Any,
                            parse: Callable[[Any], GenerationRequest],
                            id_prefix: str, answer: Answer, state: GatewayState,
                            slot: WaitingSlot, arrival: float,
                            client_id: str | None) -> web.StreamResponse:
    req, prompts = await asyncio.to_thread(_parsed, body, parse, state)
    samplings = [sampling_params(req, len(ids), state.max_model_len, state.tokenizer,
                                 state.served_max_model_len) for ids in prompts]
    # choice i * n + j: prompt i's j-th sample (OpenAI's order), each a request upstream
    echoes = await asyncio.to_thread(echo_texts, req, prompts, state.tokenizer) \
        if req.echo else [None] * len(prompts)
    choices = [(ids, choice_sampling(sampling, j), echo)
               for ids, sampling, echo in zip(prompts, samplings, echoes) for j in range(req.n)]
    request_id = f"{id_prefix}{uuid.uuid4().hex}"
    with structlog.contextvars.bound_contextvars(
            request_id=request_id, **({"client_request_id": client_id} if client_id else {})):
        async with contextlib.AsyncExitStack() as stack:
            # the other choices' places are taken here, each given back on any way out: one
            # taken before a raise and never given back would shrink the queue for good
            slots = [slot] + _admit_choices(state, len(choices) - 1)
            for place in slots:     # each generation gives its own back; these are for a raise
                stack.callback(place.release)
            gens = [await stack.enter_async_context(Generation(
                request_id=request_id if len(choices) == 1 else f"{request_id}-{index}",
                prompt_token_ids=ids, sampling=sampling, stop=req.stop,
                tokenizer=state.tokenizer, upstream=state.upstream, router=state.router,
                metrics=state.metrics, arrival=arrival, slot=place,
                timeout_s=req.timeout or state.config.request_timeout_s, echo=echo,
                include_stop=req.include_stop_str_in_output, echo_only=req.echo_only,
                skip_special_tokens=_skip_special_tokens(req, state),
                tokens_as_ids=req.tokens_as_ids))
                for index, ((ids, sampling, echo), place) in enumerate(zip(choices, slots))]
            for gen in gens:        # one by one: a failed start leaves none in flight
                await _start(gen, state)
            return await answer(request, gens, req, Reply(
                request_id, state.served_model_name, sum(map(len, prompts)),
                {oai.REQUEST_ID_HEADER: client_id or request_id}))


def _skip_special_tokens(req: GenerationRequest, state: GatewayState) -> bool:
    """The request's skip_special_tokens, but false where "auto" has a parser whose tags
    may be special tokens (hermes): left out of the text, its calls would come back as
    words."""
    parser = state.tool_parser
    return req.skip_special_tokens and not (req.tool_choice == "auto" and parser is not None
                                            and parser.keeps_special_tokens)


def _parsed(body: Any, parse: Callable[[Any], GenerationRequest],
            state: GatewayState) -> tuple[GenerationRequest, list[list[int]]]:
    """The request, checked, and its prompts' ids. CPU-bound: the tokenizer's, and a body's
    worth of messages or tools to check (30,000 tools, 3 MB, a tool choice made a grammar of
    for over a second): run it off the event loop."""
    req = parse(body)
    _check_model(req.model, state)
    # the served context: `truncate_prompt_tokens: -1` fits the prompt into the schedulers'
    # where theirs is shorter (it kept the gateway's, and was refused as too long)
    return req, prompt_token_ids(req, state.tokenizer, state.served_max_model_len)


def _admit(state: GatewayState) -> WaitingSlot:
    """Refuse at once what would only wait: a draining server, a scheduler of another
    protocol version beating, a full queue."""
    _refuse_new_requests(state)
    return _take_places(state, 1)[0]


def _refuse_new_requests(state: GatewayState) -> None:
    if state.draining:
        raise _shutting_down()
    if state.upstream.other_versions:
        # it reads requests from the shared stream and cannot serve them: each would end with
        # an error (as the scheduler heartbeats were last read)
        raise APIError("new requests are refused while a scheduler of another protocol "
                       f"version beats: {state.upstream.other_versions[0]}",
                       status=503, type="server_error")


def _admit_choices(state: GatewayState, count: int) -> list[WaitingSlot]:
    """Places for a request's choices past its first, all or none; more choices than the
    queue holds could never be admitted together: a 400, not a 429."""
    bound = state.config.max_waiting_requests
    if count + 1 > bound:
        raise APIError(f"this request asks for {count + 1} choices; the gateway queues at "
                       f"most {bound} requests (--max-waiting-requests)", param="n")
    return _take_places(state, count)


def _take_places(state: GatewayState, count: int) -> list[WaitingSlot]:
    _check_room(state, count)
    return [WaitingSlot(state) for _ in range(count)]


def _check_room(state: GatewayState, count: int) -> None:
    """429 unless the queue has room for `count` more requests."""
    if count and state.num_waiting + count > state.config.max_waiting_requests:
        raise _overloaded(state, f"{state.num_waiting} requests are waiting")


def _overloaded(state: GatewayState, why: str) -> APIError:
    """A refusal that a retry a moment later may not meet (429, Retry-After), counted."""
    state.metrics.requests_rejected.inc()
    return APIError(f"the server is overloaded: {why}; retry in {RETRY_AFTER_S} s",
                    status=429, type="rate_limit_error",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def _shutting_down() -> APIError:
    """The 503 of a draining server, with Retry-After as those for a Redis trouble have: a
    client retries it elsewhere, or here once restarted."""
    return APIError("the server is shutting down; send the request to another replica",
                    status=503, type="server_error",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def _unavailable(why: str) -> APIError:
    """A refusal for a passing trouble with Redis (away, stalled, out of memory): a 503 with
    Retry-After, as the 429s have, after which a retry may find it gone (the OpenAI clients
    wait that long before theirs)."""
    return APIError(f"{why}; try again later", status=503, type="server_error",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


async def _start(gen: Generation, state: GatewayState) -> None:
    if not state.router.subscribed.is_set():
        # tokens published before the subscription is back would be lost
        try:
            await asyncio.wait_for(state.router.subscribed.wait(), SUBSCRIBE_WAIT_S)
        except TimeoutError as e:
            failure = state.router.failure
            why = "Redis is away" if failure is None else redis_trouble(failure)
            raise _unavailable(f"the token channel is not connected ({why})") from e
    if state.cut_off:
        raise _shutting_down()      # the drain has ended the open streams: nothing would end it
    try:
        await gen.start()
    except (RedisError, TimeoutError) as e:     # TimeoutError: no answer (Upstream.submit)
        log.error("request not enqueued", error=str(e) or type(e).__name__)
        raise _unavailable(f"the request could not be queued: {redis_trouble(e)}") from e


async def _read_json(request: web.Request, state: GatewayState) -> Any:
    max_body_bytes = state.config.max_body_bytes
    if (request.content_length or 0) > max_body_bytes:     # declared: no need to wait for it
        raise APIError(f"the request body is larger than {max_body_bytes} bytes", status=413)
    received = 0            # of this body, counted in state.body_bytes until it is parsed
    try:
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                chunks = []
                while chunk := await request.content.readany():
                    received += len(chunk)
                    state.body_bytes += len(chunk)
                    if received > max_body_bytes:
                        raise APIError(f"the request body is larger than {max_body_bytes} "
                                       "bytes", status=413)
                    if state.body_bytes > BODIES_READ_AT_ONCE * max_body_bytes:
                        raise _overloaded(state, f"{state.body_bytes} bytes of request bodies "
                                                 "are being read")
                    chunks.append(chunk)
                raw = b"".join(chunks)
                del chunks
        except TimeoutError:
            raise APIError(f"the request body did not arrive within {BODY_TIMEOUT_S:g} s",
                           status=408, type="timeout_error") from None
        except web.RequestPayloadError as e:
            # the client's bytes, not this server: a Content-Encoding they are not in (gzip
            # that is not gzip), a broken chunked encoding
            why = getattr(e.__cause__, "message", None) or " ".join(str(e).split())
            raise APIError(f"the request body could not be read: {why}") from None
        try:
            if len(raw) < THREADED_PARSE_BYTES:
                return parse_user_json(raw)
            # a big body (~10 ms a MB of token ids here) parsed on the event loop would hold
            # every stream's next token; on a thread the loop gets the GIL back every few ms
            return await asyncio.to_thread(parse_user_json, raw)
        except InvalidRequestError as e:
            raise APIError(f"the request body {e}") from None
    finally:
        state.body_bytes -= received


async def tokenize(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await _read_json(request, state)
    # all of it on the encoding's thread: a body's worth of messages took ~0.2 s to check,
    # and of text is a million ids, whose token strings and JSON took ~1 s, on the event
    # loop, every stream stalled meanwhile
    answer = await asyncio.to_thread(_tokenized, body, state)
    return await send_whole(request, answer, {})        # MBs: a client who stops reading


def _tokenized(body: Any, state: GatewayState) -> str:
    """/tokenize's answer, as JSON."""
    req = oai.parse_tokenize(body)
    _check_model(req.model, state)
    tokenizer = state.tokenizer
    text = req.prompt if req.messages is None else chat_prompt(req, tokenizer)
    ids = tokenizer.encode(text, req.add_special_tokens)
    answer = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
    if req.return_token_strs:
        answer["token_strs"] = [tokenizer.id_to_token(t) for t in ids]
    return json_text(answer)        # in pieces: one json.dumps of a million ids holds the GIL


async def detokenize(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    model, ids = oai.parse_detokenize(await _read_json(request, state),
                                     state.max_model_len)
    _check_model(model, state)
    check_vocabulary(ids, state.tokenizer, "tokens")
    text = state.tokenizer.decode(ids, skip_special_tokens=False)   # a context's: MBs may be
    return await send_whole(request, json_text({"prompt": text}), {})


def _check_model(model: str | None, state: GatewayState) -> None:
    if model is not None and model != state.served_model_name:
        raise APIError(f"The model `{model}` does not exist (this server serves "
                       f"`{state.served_model_name}`)", status=404, param="model",
                       code="model_not_found")


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(oai.models_list(state.served_model_name,
                                             state.served_max_model_len, state.started_at))


async def model(request: web.Request) -> web.Response:
    """OpenAI's retrieve-model: the served model's entry, or a 404."""
    state = request.app[STATE]
    _check_model(request.match_info["model"], state)
    [entry] = oai.models_list(state.served_model_name, state.served_max_model_len,
                              state.started_at)["data"]
    return web.json_response(entry)


async def version(request: web.Request) -> web.Response:
    """vLLM's /version: this package's."""
    return web.json_response({"version": PACKAGE_VERSION})


async def health(request: web.Request) -> web.Response:
    """200 only while a scheduler and every worker rank keep their heartbeat keys alive, the
    gateway's own last heartbeat was written (one Redis refuses, out of memory say, refuses
    every request too, before the services' keys expire) and the token channel is subscribed
    (tokens published before it is would be lost); Redis is given REDIS_ANSWER_S to answer."""
    state = request.app[STATE]
    if state.draining:
        return web.json_response({"status": "draining"}, status=503)
    try:
        missing = await asyncio.wait_for(state.upstream.missing_services(
            state.config.tp, state.config.instances), REDIS_ANSWER_S)
    except TimeoutError:
        missing = [f"redis ({NO_ANSWER})"]
    except RedisError as e:
        missing = [f"redis ({redis_trouble(e)}: {e})"]
    else:
        failure = state.upstream.heartbeat_failure
        if failure is not None:     # first: the services' keys that expired did for it
            missing.insert(0, f"redis (heartbeats cannot be written: {redis_trouble(failure)})")
    if not state.router.subscribed.is_set():
        missing.append("token channel (not subscribed on Redis)")
    if missing:
        return web.json_response({"status": "unhealthy", "missing": missing}, status=503)
    return web.json_response({"status": "ok"})


async def openapi(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(openapi_spec(state.served_model_name, state.served_max_model_len,
                                          state.tokenizer.vocab_size))


async def metrics(request: web.Request) -> web.Response:
    state: GatewayState = request.app[STATE]
    instances = [i for i, _ in state.config.instances] or [""]
    deadline = time.monotonic() + REDIS_ANSWER_S       # for every Redis read of the scrape
    try:
        live = await asyncio.wait_for(state.upstream.live_schedulers(state.config.instances),
                                      REDIS_ANSWER_S)
    except (RedisError, TimeoutError):
        live = set()
    streams = [state.keys.requests] + [state.keys.for_instance(i).instance_requests
                                       for i in instances if i]
    body = await state.metrics.render(state.redis, {
        i: state.keys.for_instance(i).stats for i in instances}, live, streams,
        max(deadline - time.monotonic(), 0.01), state.keys.restarts)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/responses/{response_id}", stored_response)
    app.router.add_delete("/v1/responses/{response_id}", stored_response)
    app.router.add_post("/v1/responses/{response_id}/cancel", stored_response)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_get("/version", version)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
