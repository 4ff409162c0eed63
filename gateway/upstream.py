"""What the gateway writes to Redis: requests, aborts, its heartbeat; and what /health reads.

The heartbeat loop also watches Redis itself: a server with another run_id restarted and kept
nothing (no request entry, no scheduler state for it), and one unreachable for
REDIS_UNREACHABLE_S cannot deliver token events. Either way the open requests can no longer
complete, so `on_lost` ends them with an error event instead of letting them hang. A request
whose submission is still on its way when that happens is judged by the run_id its XADD
reports (`replaced`): only the old server's requests are lost.

After a restart the connection pool still holds connections to the old server; the first
command on each fails. Submitting and aborting drop those idle connections and try once more,
so the first requests after Redis is back are not refused. A connection can also break after
Redis ran the command and before its reply came: a submit is one script that adds the entry
only if the request id's `submitted` key is new, so a retried submit never enqueues a request
twice (two schedulers reading one stream would each serve a copy).
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import replace
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from gateway.router import ReplicaRouter, live_instances
from shared.lifecycle import cancel_requested
from shared.keys import (ABORTS_MAXLEN, HEARTBEAT_INTERVAL_S, HEARTBEAT_TTL_S, REQUESTS_MAXLEN,
                         SCAN_COUNT, Keys)
from shared.protocol import AbortMsg, Heartbeat, RequestMsg, encode, to_fields
from shared.redis_retry import retry_redis
from shared.sampling import SamplingParams

log = structlog.get_logger("gateway.upstream")

REDIS_UNREACHABLE_S = 3.0
REDIS_RESTARTED = "Redis restarted and lost the request; send it again"
REPLACED_KEPT = 64          # run ids of servers that restarted away, remembered
# tries of a request's submit or abort when its connection is dead (~0.3 s of waiting when
# Redis is really away: the client gets its 503 soon)
LIVE_CONNECTION_TRIES = 3
SUBMITTED_TTL_S = 60        # how long a request id is remembered against a repeated submit
# KEYS: the requests stream, the id's `submitted` key; ARGV: its TTL, MAXLEN, the entry's
# fields and values
_SUBMIT_ONCE = """
if redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[1]) then
  return redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', unpack(ARGV, 3))
end
return false
"""
T = TypeVar("T")


class Upstream:
    def __init__(self, redis: aioredis.Redis, keys: Keys, gateway_id: str,
                 replicas: ReplicaRouter | None = None, prefill: bool = False) -> None:
        self.redis = redis
        self.keys = keys
        # data-parallel replicas: each request goes to the stream of the one this picks; with
        # `prefill` (P/D), to the shared stream, naming the prefill instance this picks
        self.replicas = replicas
        self.prefill = prefill
        self.gateway_id = gateway_id
        self.reply_to = keys.tokens(gateway_id)
        self._pending_aborts: set[asyncio.Task] = set()
        self._replaced: deque[str] = deque(maxlen=REPLACED_KEPT)

    def replaced(self, run_id: str) -> bool:
        """Whether the Redis with this run_id is known to have restarted (lost everything)."""
        return run_id in self._replaced

    async def submit(self, request_id: str, prompt_token_ids: list[int],
                     sampling: SamplingParams, arrival_time: float,
                     deadline: float | None = None) -> str:
        """`deadline`: time.time() after which the scheduler ends the request. Returns the
        run id of the Redis that took the request: when Redis restarts, only the requests
        the old one took are lost."""
        msg = RequestMsg(
            request_id=request_id, prompt_token_ids=prompt_token_ids, sampling=sampling,
            reply_to=self.reply_to, gateway_id=self.gateway_id, arrival_time=arrival_time,
            deadline=deadline)

        async def send() -> str:
            stream, fields = self.keys.requests, to_fields(msg)
            if self.replicas is not None:
                instance = await self.replicas.choose(request_id, prompt_token_ids)
                if self.prefill:
                    fields = to_fields(replace(msg, instance=instance))
                else:
                    stream = self.keys.for_instance(instance).instance_requests
            pipe = self.redis.pipeline(transaction=False)
            pipe.eval(_SUBMIT_ONCE, 2, stream, self.keys.submitted(request_id),
                      SUBMITTED_TTL_S, REQUESTS_MAXLEN, *(x for kv in fields.items() for x in kv))
            pipe.info("server")
            _, info = await pipe.execute()
            return info["run_id"]

        return await self._live_connection(send, "submit request")

    def prefilled(self, request_id: str) -> None:
        """The request's first token came back (P/D: it has left its prefill instance)."""
        if self.replicas is not None:
            if self.prefill:
                self.replicas.ended(request_id)
            else:
                self.replicas.prefilled(request_id)

    def ended(self, request_id: str) -> None:
        """The request ended, however: it no longer loads its replica."""
        if self.replicas is not None:
            self.replicas.ended(request_id)

    async def abort(self, request_id: str, reason: str) -> None:
        fields = to_fields(AbortMsg(request_id, reason))
        await self._live_connection(lambda: self.redis.xadd(
            self.keys.aborts, fields, maxlen=ABORTS_MAXLEN, approximate=True), "abort request")
        log.info("request aborted upstream", request_id=request_id, reason=reason)

    async def _live_connection(self, op: Callable[[], Awaitable[T]], what: str) -> T:
        """Run `op`; if its connection was dead, drop the pool's idle connections (after a
        restart they all lead to the old server) and run it again, LIVE_CONNECTION_TRIES in
        all: requests sent together after a restart each meet a dead connection, and one
        in use elsewhere while the idle ones were dropped can come back to the pool after
        that (seen in CI: a request's second try failed too)."""
        return await retry_redis(op, what, log, errors=(RedisConnectionError,),
                                 attempts=LIVE_CONNECTION_TRIES,
                                 before_retry=self._drop_idle_connections)

    async def _drop_idle_connections(self) -> None:
        await self.redis.connection_pool.disconnect(inuse_connections=False)

    def abort_soon(self, request_id: str, reason: str) -> None:
        """Abort from code that may itself be cancelled (a client that went away)."""
        task = asyncio.get_running_loop().create_task(self._abort_logged(request_id, reason))
        self._pending_aborts.add(task)
        task.add_done_callback(self._pending_aborts.discard)

    async def _abort_logged(self, request_id: str, reason: str) -> None:
        try:
            await self.abort(request_id, reason)
        except RedisError as e:
            log.error("abort not sent", request_id=request_id, reason=reason, error=str(e))

    async def drain(self) -> None:
        """Wait for aborts still being sent (at shutdown)."""
        if self._pending_aborts:
            await asyncio.gather(*self._pending_aborts, return_exceptions=True)

    async def keep_heartbeat_watching_redis(self, on_lost: Callable[[str], object]) -> None:
        """Keep the heartbeat key alive; call `on_lost(reason)` when Redis restarted or has
        been unreachable for REDIS_UNREACHABLE_S."""
        key = self.keys.hb_gateway(self.gateway_id)
        run_id: str | None = None
        unreachable_since: float | None = None
        while not cancel_requested():
            try:
                pipe = self.redis.pipeline(transaction=False)
                pipe.set(key, encode(Heartbeat("gateway", self.gateway_id, time.time(), {})),
                         ex=HEARTBEAT_TTL_S)
                pipe.info("server")
                _, info = await pipe.execute()
                replaced, run_id, unreachable_since = run_id, info["run_id"], None
                if replaced is not None and run_id != replaced:
                    self._replaced.append(replaced)
                    on_lost(REDIS_RESTARTED, keep_run_id=run_id)
                    # the idle connections in the pool all lead to the old server
                    await self._drop_idle_connections()
            except (RedisError, OSError) as e:
                log.warning("heartbeat not written", error=str(e))
                now = time.monotonic()
                unreachable_since = unreachable_since or now
                if now - unreachable_since >= REDIS_UNREACHABLE_S:
                    on_lost("Redis is unreachable; the request cannot complete")
                    unreachable_since = now
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
        raise asyncio.CancelledError

    async def live_schedulers(self, instances: tuple[tuple[str, int], ...] = ()) -> set[str]:
        """The engine instances with a scheduler beating ("" for the colocated engine's)."""
        if instances:
            return set(await live_instances(self.redis, self.keys))
        async for _ in self.redis.scan_iter(match=self.keys.hb_scheduler_pattern,
                                            count=SCAN_COUNT):
            return {""}
        return set()

    async def missing_services(self, tp: int,
                               instances: tuple[tuple[str, int], ...] = ()) -> list[str]:
        """Which services /health needs but whose heartbeat key has expired: the scheduler and
        every worker rank of the colocated engine, or of each engine instance (replica or P/D
        instance; a scheduler's heartbeat names its instance)."""
        up = await self.live_schedulers(instances)
        missing = [] if instances or "" in up else ["scheduler"]
        missing += [f"instance {inst} scheduler" for inst, _ in instances if inst not in up]
        ranks = [(f"worker rank {r}" if not inst else f"instance {inst} worker rank {r}",
                  self.keys.for_instance(inst).hb_worker(r))
                 for inst, degree in (instances or (("", tp),)) for r in range(degree)]
        alive = await asyncio.gather(*(self.redis.exists(k) for _, k in ranks))
        missing += [name for (name, _), up in zip(ranks, alive) if not up]
        return missing
