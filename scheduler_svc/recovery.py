"""What the scheduler service does when the plan in flight cannot be answered, or Redis is
not the server it was.

    try:
        one iteration
    except Interrupted as e:                 # WorkersLost, PlanLost or RedisLost
        carry_on = await recovery.recover(e, stop)

While it waits for a result the service probes every WORKER_PROBE_S (`probe`): one pipeline
reads the server's run_id, the worker heartbeats and the plan's entry, and says which of
these happened:

    a worker dies       a rank gone or restarted: recompute every running request
                        (`core.recompute_running`), wait for the group, carry on
    a plan is lost      the plan left the plans stream, or rank 0 answered it (its heartbeat
                        says so) and the result is not in the results stream: recompute every
                        running request, carry on
    Redis restarts      another run_id, or the consumer group is gone: every live request ends
                        with an error event, the plan in flight is forgotten, the group is
                        created again (if it kept nothing), the stream cursors start at the
                        new server's tails; serving goes on. A Redis that persists comes back
                        with the old plans, results and aborts: each plan names the run_id it
                        was sent to, so worker rank 0 runs none of the old server's

Every Redis operation of the service goes through `retrying`: the shared retry policy, plus
the check that a server that answers again is still the one with our run_id.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ResponseError

from scheduler_svc.book import RequestBook
from scheduler_svc.core import Scheduler
from scheduler_svc.takeover import Takeover
from scheduler_svc.workers import WorkerWatch
from shared.keys import Keys
from shared.lifecycle import (check_key_types, redis_run_id, stream_id_order, stream_id_text,
                              stream_tail_id)
from shared.plan import StepResult
from shared.redis_retry import retry_redis

log = structlog.get_logger("scheduler")
T = TypeVar("T")

WORKER_PROBE_S = 0.5          # how often a scheduler waiting for a result checks the workers
# why the request queue was lost, for the clients whose requests end with it and the log
REDIS_RESTARTED = "Redis restarted"
GROUP_GONE = "the requests stream or its consumer group was deleted or evicted"


class Interrupted(Exception):
    """The plan in flight will never be answered, or Redis is not the server it was."""


class WorkersLost(Interrupted):
    """A worker rank died or was restarted: the plan in flight will never be answered."""


class RedisLost(Interrupted):
    """Redis came back empty (another run_id), or the consumer group is gone: an operator
    deleted the stream or destroyed the group, or an `allkeys-*` policy evicted it. The
    argument says which (REDIS_RESTARTED, GROUP_GONE)."""


class PlanLost(Interrupted):
    """The plan in flight left the plans stream, or rank 0 answered it and the result is not
    in the results stream: no result will come, though Redis and the workers are there."""


@dataclass
class Cursors:
    """Where the service reads on in the streams it does not consume as a group, and the
    newest request entry the group delivered to it (None: none yet on this server)."""
    aborts: bytes | str = "0-0"
    results: bytes | str = "0-0"
    requests_seen: bytes | str | None = None


WaitForWorkers = Callable[[asyncio.Event], Awaitable[bool]]
ReadResult = Callable[[int, int | None], Awaitable[StepResult | None]]


MAX_WORKER_LOSSES = 3


class Recovery:
    def __init__(self, redis: aioredis.Redis, keys: Keys, core: Scheduler, book: RequestBook,
                 workers: WorkerWatch, takeover: Takeover, cursors: Cursors,
                 drain_expired: Callable[[], bool]) -> None:
        self.redis, self.keys, self.core, self.book = redis, keys, core, book
        self.workers, self.takeover, self.cursors = workers, takeover, cursors
        self._drain_expired = drain_expired
        self.run_id: str | None = None
        # request id -> how many worker groups were lost while it ran (see MAX_WORKER_LOSSES)
        self._worker_losses: dict[str, int] = {}

    async def prepare(self, ours: dict[str, str]) -> None:
        """Check that the keys of this scheduler (`ours`: key -> type) hold what it writes,
        create the consumer group and note which server this is."""
        async def prepare() -> None:
            await check_key_types(self.redis, ours, self.keys.prefix)
            await self.ensure_group()
            self._note_server(await redis_run_id(self.redis))
        await retry_redis(prepare, "create the consumer group", log, give_up=self._drain_expired)

    def _note_server(self, run_id: str) -> None:
        """The server served from now on; the leases are kept on it alone (`Takeover`)."""
        self.run_id = self.takeover.run_id = run_id

    async def aborts_from(self) -> bytes | str:
        """Where this scheduler reads the aborts stream from: just before the oldest request
        it may still take (one pending in the group, a stopped scheduler's or its own before a
        restart, or one no scheduler has read yet), so that an abort sent while no scheduler
        ran still reaches it (an abort comes after its request, and both streams' ids are the
        one server's clock); the stream's end if no request waits. Aborts of requests since
        finished are kept as early ones, a bounded few (book.abort)."""
        tail = await stream_tail_id(self.redis, self.keys.aborts)
        requests, group = self.keys.requests, self.keys.requests_group
        oldest = [entry["min"] for entry in [await self.redis.xpending(requests, group)]
                  if entry["pending"]]
        info = next((g for g in await self.redis.xinfo_groups(requests)
                     if stream_id_text(g["name"]) == group), None)
        if info is None:
            raise RedisLost(GROUP_GONE)     # or with a Redis that restarted just now
        if stream_id_order(await stream_tail_id(self.redis, requests)) > \
                stream_id_order(info["last-delivered-id"]):
            oldest.append(info["last-delivered-id"])        # not read by any scheduler yet
        if not oldest:
            return tail
        ms, _ = min(map(stream_id_order, oldest))
        start = f"{max(ms - 1, 0)}-0"       # every abort of that millisecond on
        return start if stream_id_order(start) < stream_id_order(tail) else tail

    async def ensure_group(self, start: bytes | str = "0") -> None:
        """Create the consumer group, to deliver the entries after `start`, unless it exists."""
        try:
            await self.redis.xgroup_create(self.keys.requests, self.keys.requests_group,
                                           id=start, mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    # ---- noticing ------------------------------------------------------------------------

    async def retrying(self, what: str, op: Callable[[], Awaitable[T]]) -> T:
        """Run a Redis operation until the connection lets it through (or the drain ends).
        After a dropped connection, Redis must be the same server (run_id) to carry on."""
        try:
            return await retry_redis(op, what, log, give_up=self._drain_expired,
                                     before_retry=self._check_same_redis)
        except ResponseError as e:
            if "NOGROUP" in str(e):
                # the group went with the server (another run_id), or alone
                await retry_redis(self._check_same_redis, "read run_id", log,
                                  give_up=self._drain_expired)
                raise RedisLost(GROUP_GONE) from e
            raise

    async def _check_same_redis(self) -> None:
        if await redis_run_id(self.redis) != self.run_id:
            raise RedisLost(REDIS_RESTARTED)

    async def probe(self, step: int, plan_id: bytes | str,
                    read_result: ReadResult) -> StepResult | None:
        """Raise RedisLost, WorkersLost or PlanLost if the plan in flight can no longer be
        answered; returns its result if that turned up meanwhile. One pipeline, so every
        answer comes from the same server."""
        async def look() -> list:
            pipe = self.redis.pipeline(transaction=False)
            pipe.info("server")
            pipe.mget(self.workers.heartbeat_keys)
            pipe.xrange(self.keys.plans, min=plan_id, max=plan_id)
            return await pipe.execute()

        info, heartbeats, sent = await self.retrying("probe workers", look)
        if info.get("run_id") != self.run_id:
            raise RedisLost(REDIS_RESTARTED)
        lost = self.workers.lost_in(heartbeats)
        answered = self.workers.answered(heartbeats, self.run_id, plan_id)
        if sent and not answered and not lost:
            return None
        # the result may have landed just before the rank died or its heartbeat was written
        result = await read_result(step, None)
        if lost:
            if result is not None:
                log.warning("worker died right after answering", ranks=lost)
            raise WorkersLost(lost)
        if result is not None:
            return result
        raise PlanLost("rank 0 answered the plan but its result is not in the results stream"
                       if sent else "the plan is not in the plans stream")

    # ---- recovering ----------------------------------------------------------------------

    async def recover(self, interrupted: Interrupted, stop: asyncio.Event,
                      wait_for_workers: WaitForWorkers) -> bool:
        """Bring the core and the cursors back to what can still be served. False: stop
        serving (stopped while waiting for the workers, or their KV pool disagrees)."""
        if isinstance(interrupted, WorkersLost):
            return await self._after_workers_lost(interrupted, stop, wait_for_workers)
        if isinstance(interrupted, PlanLost):
            recomputed = self.core.recompute_running()
            log.error("plan in flight lost; recomputing running requests",
                      reason=str(interrupted), recomputed=len(recomputed),
                      request_ids=_named(recomputed))
            return True
        await self._after_redis_lost(str(interrupted))
        return True

    async def _after_workers_lost(self, lost: WorkersLost, stop: asyncio.Event,
                                  wait_for_workers: WaitForWorkers) -> bool:
        since = time.monotonic()
        recomputed = self.core.recompute_running()
        log.warning("worker group lost; recomputing running requests", ranks=lost.args[0],
                    recomputed=len(recomputed), request_ids=_named(recomputed))
        self._drop_requests_that_keep_losing_workers(recomputed)
        if not await wait_for_workers(stop):
            return False
        log.info("worker group back", waited_s=round(time.monotonic() - since, 2))
        return True

    def _drop_requests_that_keep_losing_workers(self, running: list[str]) -> None:
        """A request running each time the worker group was lost, MAX_WORKER_LOSSES times over,
        ends with an error rather than being recomputed again: one request that takes the
        workers down (a bug) must not take them down restart after restart, with every other
        request, until `pacer up` gives up."""
        counts = {rid: self._worker_losses.get(rid, 0) + 1 for rid in running}
        self._worker_losses = counts           # requests not running at a loss start over
        for rid, n in counts.items():
            if n >= MAX_WORKER_LOSSES:
                log.error("request dropped: the workers were lost each time it ran",
                          request_id=rid, losses=n)
                self.book.stop(rid, f"the worker group was lost {n} times while this request "
                                    f"ran, so it was dropped (it may be what stops it); see "
                                    f"the server's log")

    async def _after_redis_lost(self, why: str) -> None:
        """Redis restarted (`why` says so, or that the group alone is gone): the token events
        published meanwhile are lost (and, unless it persists, every request's entry), so
        each live request ends with an error event; then serve anew."""
        self.core.recompute_running()            # a plan in flight went with the old Redis
        failed = self.book.stop_all(f"the request queue was lost ({why}); send the request "
                                    f"again")
        log.error("request queue lost; failing live requests", reason=why, failed=failed)
        # the group alone went (deleted, evicted): the entries up to the newest it delivered
        # here were delivered to a scheduler already, each of which ends its own now; made
        # from "0", it delivered every request the stream still held as new, and requests
        # finished long ago ran again for nobody. A new server's ids start again.
        start = self.cursors.requests_seen if why == GROUP_GONE else None
        await self.retrying("recreate group", lambda: self.ensure_group(start or "0"))
        self._note_server(await self.retrying("read run_id", lambda: redis_run_id(self.redis)))
        # at the new server's tails ("0-0" if it kept nothing): a Redis that persists kept the
        # old results (of steps this scheduler may plan again) and the aborts already read
        self.cursors.results = await self.retrying(
            "find the results' end", lambda: stream_tail_id(self.redis, self.keys.results))
        self.cursors.aborts = await self.retrying("find where to read aborts", self.aborts_from)
        self.takeover.claim_cursor = "0-0"
        self.cursors.requests_seen = None


# request ids a recovery line names (an operator follows them by id); the count says the rest
NAMED_IN_A_LINE = 32


def _named(request_ids: list[str]) -> list[str]:
    return request_ids[:NAMED_IN_A_LINE]
