"""What the gateway writes to Redis: requests, aborts, its heartbeat; and what /health reads.

The heartbeat loop also watches Redis itself: a server with another run_id restarted and kept
nothing (no request entry, no scheduler state for it), and one unreachable for
REDIS_UNREACHABLE_S cannot deliver token events. Either way the open requests can no longer
complete, so `on_lost` ends them with an error event instead of letting them hang.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from shared.keys import (ABORTS_MAXLEN, HEARTBEAT_INTERVAL_S, HEARTBEAT_TTL_S, REQUESTS_MAXLEN,
                         Keys)
from shared.protocol import AbortMsg, Heartbeat, RequestMsg, encode, to_fields
from shared.sampling import SamplingParams

log = structlog.get_logger("gateway.upstream")

REDIS_UNREACHABLE_S = 3.0


class Upstream:
    def __init__(self, redis: aioredis.Redis, keys: Keys, gateway_id: str) -> None:
        self.redis = redis
        self.keys = keys
        self.gateway_id = gateway_id
        self.reply_to = keys.tokens(gateway_id)
        self._pending_aborts: set[asyncio.Task] = set()

    async def submit(self, request_id: str, prompt_token_ids: list[int],
                     sampling: SamplingParams, arrival_time: float,
                     deadline: float | None = None) -> str:
        """`deadline`: time.time() after which the scheduler ends the request. Returns the
        run id of the Redis that took the request: when Redis restarts, only the requests
        the old one took are lost."""
        msg = RequestMsg(request_id=request_id, prompt_token_ids=prompt_token_ids,
                         sampling=sampling, reply_to=self.reply_to, gateway_id=self.gateway_id,
                         arrival_time=arrival_time, deadline=deadline)
        pipe = self.redis.pipeline(transaction=False)
        pipe.xadd(self.keys.requests, to_fields(msg), maxlen=REQUESTS_MAXLEN, approximate=True)
        pipe.info("server")
        _, info = await pipe.execute()
        return info["run_id"]

    async def abort(self, request_id: str, reason: str) -> None:
        await self.redis.xadd(self.keys.aborts, to_fields(AbortMsg(request_id, reason)),
                              maxlen=ABORTS_MAXLEN, approximate=True)
        log.info("request aborted upstream", request_id=request_id, reason=reason)

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

    async def heartbeat_forever(self, on_lost: Callable[[str], object]) -> None:
        """Keep the heartbeat key alive; call `on_lost(reason)` when Redis restarted or has
        been unreachable for REDIS_UNREACHABLE_S."""
        key = self.keys.hb_gateway(self.gateway_id)
        run_id: str | None = None
        unreachable_since: float | None = None
        while True:
            try:
                pipe = self.redis.pipeline(transaction=False)
                pipe.set(key, encode(Heartbeat("gateway", self.gateway_id, time.time(), {})),
                         ex=HEARTBEAT_TTL_S)
                pipe.info("server")
                _, info = await pipe.execute()
                if run_id is not None and info["run_id"] != run_id:
                    on_lost("Redis restarted and lost the request; send it again",
                            keep_run_id=info["run_id"])
                run_id, unreachable_since = info["run_id"], None
            except (RedisError, OSError) as e:
                log.warning("heartbeat not written", error=str(e))
                now = time.monotonic()
                unreachable_since = unreachable_since or now
                if now - unreachable_since >= REDIS_UNREACHABLE_S:
                    on_lost("Redis is unreachable; the request cannot complete")
                    unreachable_since = now
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def missing_services(self, tp: int) -> list[str]:
        """Which services /health needs but whose heartbeat key has expired."""
        schedulers = [k async for k in self.redis.scan_iter(match=self.keys.hb_scheduler_pattern)]
        missing = [] if schedulers else ["scheduler"]
        ranks = [self.keys.hb_worker(r) for r in range(tp)]
        alive = await asyncio.gather(*(self.redis.exists(k) for k in ranks))
        missing += [f"worker rank {r}" for r in range(tp) if not alive[r]]
        return missing
