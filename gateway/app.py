"""The aiohttp application: middlewares, background tasks, and how it is served.

    app = create_app(GatewayConfig(...))            # loads the tokenizer; no I/O to Redis yet
    async with serve(config) as base_url: ...       # in-process (tests, `pacer up`)
    run_gateway(config)                             # until SIGINT/SIGTERM, with uvloop

What a client can send is bounded: the body by `max_body_bytes` (413), the request line and
each header by HEADER_LIMITS (aiohttp answers 400/431 before a handler runs).

SIGTERM drains (`drain`): new requests get 503, running ones get `shutdown_timeout_s` to
finish, then whatever is left ends with an error event, and the server stops. A second
signal ends them with that event at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
import structlog
from aiohttp import web
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.config import GatewayConfig
from gateway.handlers import BODY_TIMEOUT_S, add_routes
from gateway.metrics import GatewayMetrics
from gateway.openai_schema import REQUEST_ID_HEADER, APIError, error_body, valid_request_id
from gateway.router import ReplicaRouter
from gateway.state import STATE, GatewayState
from gateway.streams import TokenRouter
from gateway.upstream import Upstream
from shared import clock
from shared.errors import InvalidRequestError
from shared.keys import Keys
from shared.lifecycle import clear_key, essential_task, freeze_heap, run_service
from shared.model_config import load_model_config
from shared.model_source import resolve_model
from shared.service_args import redis_password, refused_for_good, shown_url
from shared.tokenizer import load_tokenizer

log = structlog.get_logger("gateway")

SUBSCRIBE_TIMEOUT_S = 10.0
REDIS_CONNECTIONS = 64               # the gateway's pool; a command beyond them waits
REDIS_CONNECTION_WAIT_S = 10.0       # ... this long at most, then it is a Redis error
HEADER_LIMITS = {"max_line_size": 8190, "max_field_size": 8190, "max_headers": 64}
KEEPALIVE_TIMEOUT_S = 75.0
# connections the kernel completes and holds until the gateway accepts them (capped by
# net.core.somaxconn). aiohttp's 128 overflowed in a burst: the kernel dropped the rest's
# handshakes, and of 1,000 clients each sending a 2-4 MB body and then reading, up to a tenth
# saw their connection reset instead of the answer (a 429 or a 400 alike)
LISTEN_BACKLOG = 4096
DRAIN_POLL_S = 0.05
SHUTDOWN_ERROR = "the server shut down before the request finished; send it again"


def create_app(config: GatewayConfig) -> web.Application:
    source = resolve_model(config.model, weights=False)     # the tokenizer and config only
    context = load_model_config(source).max_position_embeddings
    state = GatewayState(
        config=config, keys=Keys(config.key_prefix), tokenizer=load_tokenizer(source),
        served_model_name=config.served_model_name or source.name,
        max_model_len=min(context, config.max_model_len or context), metrics=GatewayMetrics())
    app = web.Application(client_max_size=config.max_body_bytes,
                          middlewares=[_errors, _auth(config.api_key)])
    app[STATE] = state
    app.cleanup_ctx.append(_redis_tasks)
    add_routes(app)
    return app


async def _redis_tasks(app: web.Application) -> AsyncIterator[None]:
    """The Redis connection, the one token listener and the heartbeat, for the app's life."""
    state = app[STATE]
    # blocking pub/sub reads need a socket timeout longer than their 1 s wait. A burst of
    # requests (each an XADD, a client gone an abort) waits for a connection of the pool
    # rather than failing with "Too many connections" past redis-py's 100
    state.redis = aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(
        state.config.redis_url, password=redis_password(), max_connections=REDIS_CONNECTIONS,
        timeout=REDIS_CONNECTION_WAIT_S, socket_timeout=10, health_check_interval=30))
    # the token listener gets a connection that never reconnects behind its back: events
    # published while it was away are lost, so it must know, and end the open streams
    listener = aioredis.Redis.from_url(state.config.redis_url, password=redis_password(),
                                       socket_timeout=10, health_check_interval=30,
                                       retry=Retry(NoBackoff(), 0))
    replicas = None
    if state.config.router:
        degrees = dict(state.config.instances)
        replicas = ReplicaRouter(state.redis, state.keys,
                                 [(i, degrees[i]) for i in state.config.route_prefill or degrees],
                                 state.config.router)
    state.upstream = Upstream(state.redis, state.keys, state.config.gateway_id, replicas,
                              prefill=bool(state.config.route_prefill))
    state.router = TokenRouter(listener, state.upstream.reply_to, state.config.finish_grace_s)
    heartbeat = state.upstream.keep_heartbeat_watching_redis(state.router)
    tasks = [essential_task(state.router.run(), "token-router"),
             essential_task(heartbeat, "gateway-heartbeat"),
             essential_task(state.upstream.keep_schedulers_read(), "scheduler-heartbeats")]
    try:
        # a request sent before the subscription is confirmed could lose its first tokens,
        # one stamped before the clock is read may end at once (shared/clock.py; a Redis
        # that does not answer yet is read by the heartbeat, once it does)
        await asyncio.wait_for(state.router.subscribed.wait(), SUBSCRIBE_TIMEOUT_S)
        await asyncio.wait_for(clock.sync(state.redis), SUBSCRIBE_TIMEOUT_S)
    except (TimeoutError, RedisError, OSError):
        log.warning("token channel not subscribed yet; Redis may be down",
                    redis_url=shown_url(state.config.redis_url))
    freeze_heap()
    log.info("gateway ready", gateway_id=state.config.gateway_id, model=state.served_model_name)
    yield
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await state.upstream.drain()
    # gone at once for /health and the schedulers (each ends a gone gateway's requests), not
    # after the key's TTL, as a scheduler and a worker do at a clean exit
    await clear_key(state.redis, state.keys.hb_gateway(state.config.gateway_id))
    await state.redis.aclose()
    await listener.aclose()


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""
    try:
        return await handler(request)
    except APIError as e:
        return _refused(request, e.body(), e.status, e.headers)
    except InvalidRequestError as e:
        return _refused(request, error_body(str(e), "invalid_request_error"), 400)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        return _refused(request, error_body(e.reason, kind), e.status)
    except Exception:
        log.exception("unhandled error", path=request.path)
        return _refused(request, error_body("internal server error", "server_error"), 500)


def _refused(request: web.Request, body: dict, status: int,
             headers: dict | None = None) -> web.Response:
    """An error answer, logged (a refusal is a client's mistake: info), with the client's
    X-Request-Id sent back as on every other answer."""
    given = request.headers.get(REQUEST_ID_HEADER)
    headers = dict(headers or {})
    if given is not None and valid_request_id(given):
        headers.setdefault(REQUEST_ID_HEADER, given)
    log.info("request refused", path=request.path, status=status,
             error=body["error"]["message"][:200], client_request_id=given and given[:80])
    return web.json_response(body, status=status, headers=headers)


KEYED_PATHS = ("/tokenize", "/detokenize")


def _auth(api_key: str | None):
    # as bytes both: a header's bytes that are not UTF-8 come as surrogates (aiohttp decodes
    # with surrogateescape), which a plain encode() refused with a 500 and a traceback
    expected = f"Bearer {api_key}".encode(errors="surrogateescape") if api_key else None

    @web.middleware
    async def auth(request: web.Request, handler) -> web.StreamResponse:
        # the OpenAI routes and the tokenizer's need the key, /health and /metrics do not
        if expected is not None and (request.path.startswith("/v1/")
                                     or request.path in KEYED_PATHS):
            given = request.headers.get("Authorization", "").encode(errors="surrogateescape")
            if not hmac.compare_digest(given, expected):
                # raised, for _errors to answer: logged and the X-Request-Id sent back, as
                # every other refusal (a client with a stale key was invisible in the log)
                raise APIError("invalid or missing API key (send 'Authorization: Bearer <key>')",
                               status=401, code="invalid_api_key")
        return await handler(request)
    return auth


@contextlib.asynccontextmanager
async def serve(config: GatewayConfig, app: web.Application | None = None) -> AsyncIterator[str]:
    """Run the gateway on config.host:config.port (0: a free port); yields its base URL."""
    # lingering_time: a request answered before its body is read (a 429, a 400 for a header)
    # has the rest of its body read and dropped as long as an accepted one's may take to
    # arrive; at aiohttp's 10 s a client on a slow link still sending it saw the connection
    # closed (EPIPE) where it would have read the answer next
    runner = web.AppRunner(app or create_app(config), handler_cancellation=True,
                           access_log=None, shutdown_timeout=5.0,
                           keepalive_timeout=KEEPALIVE_TIMEOUT_S, lingering_time=BODY_TIMEOUT_S,
                           **HEADER_LIMITS)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port, backlog=LISTEN_BACKLOG)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def drain(app: web.Application) -> None:
    """Stop taking requests, give the running ones `shutdown_timeout_s`, end the rest.
    Cancelled meanwhile (a second signal: the operator will not wait), it ends them at once,
    each with its error event: cancelled, the server cut them off mid-stream without one,
    and only after waiting for them for its own shutdown timeout."""
    state = app[STATE]
    state.draining = True
    log.info("draining", open_requests=state.num_admitted,
             shutdown_timeout_s=state.config.shutdown_timeout_s)
    try:
        if await _until_answered(state, state.config.shutdown_timeout_s):
            return
    except asyncio.CancelledError:
        asyncio.current_task().uncancel()
        log.warning("stopping now; ending the open requests", open_requests=state.num_admitted)
    # one not sent upstream yet is refused once it would be (503), the rest end now
    state.cut_off = True
    state.router.fail_all(SHUTDOWN_ERROR, "unavailable_error")
    # their handlers write the error event and return; the server then stops
    await _until_answered(state, 2.0)


async def _until_answered(state: GatewayState, timeout_s: float) -> bool:
    """Until every admitted request is answered (its stream open or not yet); whether it
    came to that within `timeout_s`."""
    end = time.monotonic() + timeout_s
    while state.num_admitted and time.monotonic() < end:
        await asyncio.sleep(DRAIN_POLL_S)
    return not state.num_admitted


async def _check_credentials(redis_url: str) -> None:
    """A Redis that refuses the URL for good (its credentials, a database it lacks) stops the
    gateway at once; one that does not answer yet does not (it serves, and /health says
    Redis is away, until it is back)."""
    client = aioredis.Redis.from_url(redis_url, password=redis_password(), socket_timeout=2,
                                     socket_connect_timeout=2)
    try:
        await client.ping()
    except (RedisError, OSError) as e:
        if (refused := refused_for_good(redis_url, e)) is not None:
            raise refused from None
    finally:
        await client.aclose()


async def _serve_until(config: GatewayConfig, stop: asyncio.Event) -> int:
    await _check_credentials(config.redis_url)
    app = create_app(config)
    async with serve(config, app) as url:
        log.info("listening", url=url)
        await stop.wait()
        await drain(app)
    log.info("gateway stopped")
    return 0


def run_gateway(config: GatewayConfig) -> int:
    """Serve until SIGINT/SIGTERM, then drain; a second signal stops at once. Returns the
    exit code."""
    return run_service(lambda stop: _serve_until(config, stop))
