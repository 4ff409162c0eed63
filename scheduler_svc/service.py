"""The scheduler service: the pure core in a short asyncio loop over Redis streams.

One iteration, strictly in order (the core refuses a second plan before the first's update):

    intake    one pipeline: HSET stats when due, PUBLISH finish events, XACK finished
              entries, XREADGROUP new requests (only while the waiting queue is below its
              bound), XREAD aborts
    schedule  plan = core.schedule()
    send      XADD PlanMsg to the plans stream (MAXLEN ~)
    wait      XREAD the results stream after the last id seen, for this plan's step
    update    outputs = core.update(plan, result); finished ones go to the next intake

Request state lives in Redis until it is finished: an entry is XACKed only after its finish
event was published, so a scheduler restarted under the same id re-reads its pending entries
(XREADGROUP from 0) and serves them again. With no work the intake blocks on XREADGROUP for
`idle_block_ms` instead of spinning.
"""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from scheduler_svc.book import Outbox, RequestBook
from scheduler_svc.core import Scheduler
from scheduler_svc.stats import SchedulerStats
from services.lifecycle import stream_tail_id
from shared.keys import PLANS_MAXLEN, Keys
from shared.plan import IterationPlan, StepResult
from shared.protocol import (Heartbeat, PlanMsg, ProtocolError, StepResultMsg, decode,
                             from_fields, to_fields)

log = structlog.get_logger("scheduler")
T = TypeVar("T")


@dataclass(frozen=True)
class SchedulerServiceConfig:
    scheduler_id: str                 # the consumer name: stable across restarts to recover
    tp: int = 1                       # worker ranks that must be alive before the first plan
    max_waiting: int = 128            # pull from the request stream only below this
    idle_block_ms: int = 100
    result_block_ms: int = 500
    drain_timeout_s: float = 30.0
    worker_silence_warn_s: float = 10.0


class SchedulerService:
    def __init__(self, redis: aioredis.Redis, keys: Keys, core: Scheduler,
                 config: SchedulerServiceConfig) -> None:
        self.redis, self.keys, self.core, self.config = redis, keys, core, config
        self.book = RequestBook(core)
        self.stats = SchedulerStats()
        self._read_id: str | bytes = "0"          # own pending entries first, then ">"
        self._aborts_after: str | bytes = "0-0"
        self._results_after: str | bytes = "0-0"
        self._drain_deadline: float | None = None

    # ---- start-up ------------------------------------------------------------------------

    async def prepare(self) -> None:
        """Create the consumer group and note where the aborts and results streams end."""
        try:
            await self.redis.xgroup_create(self.keys.requests, self.keys.requests_group,
                                           id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._aborts_after = await stream_tail_id(self.redis, self.keys.aborts)
        self._results_after = await stream_tail_id(self.redis, self.keys.results)

    async def wait_for_workers(self, stop: asyncio.Event) -> bool:
        """Until every rank's heartbeat is up; False if stopped first or a rank's KV pool
        disagrees with ours (then nothing could be scheduled safely)."""
        keys = [self.keys.hb_worker(r) for r in range(self.config.tp)]
        logged = 0.0
        while not stop.is_set():
            values = await self.redis.mget(keys)
            if all(values):
                return self._layouts_agree(values)
            if time.monotonic() - logged > 5.0:
                missing = [r for r, v in enumerate(values) if not v]
                log.info("waiting for workers", missing_ranks=missing)
                logged = time.monotonic()
            await asyncio.sleep(0.2)
        return False

    def _layouts_agree(self, values: list[bytes]) -> bool:
        mine = {"num_kv_blocks": self.core.block_manager.num_total_blocks,
                "block_size": self.core.block_manager.block_size}
        for rank, value in enumerate(values):
            try:
                extra = decode(value).extra
            except (ProtocolError, AttributeError) as e:
                log.error("worker heartbeat unreadable", rank=rank, error=str(e))
                return False
            theirs = {k: extra.get(k) for k in mine}
            if theirs != mine:
                log.error("worker KV pool disagrees with the scheduler's; start both with the "
                          "same engine flags", rank=rank, worker=theirs, scheduler=mine)
                return False
        return True

    # ---- the loop ------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, then drain: no new requests, finish the running ones
        (bounded by drain_timeout_s); what is left stays pending in the group."""
        while True:
            if stop.is_set() and self._drain_deadline is None:
                self._drain_deadline = time.monotonic() + self.config.drain_timeout_s
                log.info("draining", live_requests=self.book.num_live)
            busy = self.core.has_unfinished()
            await self._intake(pull=self._drain_deadline is None, block=not busy)
            if not self.core.has_unfinished():
                if self._drain_deadline is not None:
                    return
                continue
            if self._drain_expired():
                log.warning("drain timed out; unfinished requests stay pending",
                            live_requests=self.book.num_live)
                return
            if not await self._iterate():
                return

    async def _iterate(self) -> bool:
        """One plan out, its result in, the core updated. False: no result will come."""
        plan = self.core.schedule()
        if plan.is_empty and not plan.finished_request_ids:
            # only aborts of queued requests to report; no worker needs to hear of it
            if not self._apply(plan, StepResult(plan.step, {})):
                # nothing could be admitted and nothing changed: do not spin
                await asyncio.sleep(self.config.idle_block_ms / 1000)
            self.stats.went_idle()
            return True
        await self._send(plan)
        result = await self._wait_result(plan.step)
        if result is None:
            return False
        self.stats.result_received()
        self._apply(plan, result)
        if not self.core.has_unfinished():
            self.stats.went_idle()
        return True

    def _apply(self, plan: IterationPlan, result: StepResult) -> int:
        """Update the core; returns how many requests got a token or finished."""
        outputs = self.core.update(plan, result)
        for output in outputs:
            if output.finished:
                self.book.finished(output)
        self.stats.mark_dirty()
        return len(outputs)

    async def _intake(self, pull: bool, block: bool) -> None:
        """Write stats, flush the outbox, read requests and aborts: one round trip."""
        outbox = self.book.take_outbox()
        room = max(0, self.config.max_waiting - self.core.num_waiting) if pull else 0
        idle = not self.core.has_unfinished()
        # stats go first: a client that saw its request end and then scrapes /metrics must
        # not find the request still holding blocks
        stats = self.stats.snapshot(self.core) if self.stats.due(idle) else None

        async def exchange() -> list:
            pipe = self.redis.pipeline(transaction=False)
            if stats is not None:
                pipe.hset(self.keys.stats, mapping=stats)
            self._queue_outbox(pipe, outbox)
            if room:
                # a pending-list read (id "0...") never blocks; only ">" does
                pipe.xreadgroup(self.keys.requests_group, self.config.scheduler_id,
                                {self.keys.requests: self._read_id}, count=room,
                                block=self.config.idle_block_ms if block else None)
            pipe.xread({self.keys.aborts: self._aborts_after}, count=1000)
            return await pipe.execute()

        # a retried exchange may publish a finish event twice; gateways keep the first
        replies = await self._retrying("intake", exchange)
        if room:
            self._receive_requests(replies[-2])
        self._receive_aborts(replies[-1])

    def _queue_outbox(self, pipe, outbox: Outbox) -> None:
        for channel, data in outbox.finishes:
            pipe.publish(channel, data)
        if outbox.acks:
            pipe.xack(self.keys.requests, self.keys.requests_group, *outbox.acks)

    def _receive_requests(self, reply) -> None:
        entries = [e for _, stream_entries in (reply or []) for e in stream_entries]
        if self._read_id != ">":
            if not entries:
                self._read_id = ">"          # the pending list is exhausted
                return
            self._read_id = entries[-1][0]
            log.info("recovering pending requests", count=len(entries))
        for entry_id, fields in entries:
            if fields:       # a pending entry trimmed from the stream comes back empty
                self.book.receive(entry_id, fields)
            else:
                self.book.release(entry_id)

    def _receive_aborts(self, reply) -> None:
        for _, entries in reply or []:
            for entry_id, fields in entries:
                self._aborts_after = entry_id
                self.book.abort(fields)

    async def _send(self, plan: IterationPlan) -> None:
        fields = to_fields(PlanMsg(plan))
        attempts = 0

        async def xadd() -> None:
            nonlocal attempts
            attempts += 1
            # a retry after a dropped connection must not run the plan twice
            if attempts > 1 and await self._plan_in_stream(plan.step):
                return
            await self.redis.xadd(self.keys.plans, fields, maxlen=PLANS_MAXLEN,
                                  approximate=True)

        await self._retrying("send plan", xadd)
        self.stats.plan_sent()

    async def _plan_in_stream(self, step: int) -> bool:
        newest = await self.redis.xrevrange(self.keys.plans, count=1)
        if not newest:
            return False
        try:
            msg = from_fields(newest[0][1])
        except ProtocolError:
            return False
        return isinstance(msg, PlanMsg) and msg.plan.step == step

    async def _wait_result(self, step: int) -> StepResult | None:
        """This step's result from the results stream; None if the drain deadline passed
        while the workers stayed silent."""
        waited_since = time.monotonic()
        while True:
            reply = await self._retrying("read results", lambda: self.redis.xread(
                {self.keys.results: self._results_after}, count=16,
                block=self.config.result_block_ms))
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    self._results_after = entry_id
                    result = _decode_result(fields)
                    if result is not None and result.step == step:
                        return result
                    log.warning("unexpected step result skipped", expected_step=step,
                                got_step=None if result is None else result.step)
            if self._drain_expired():
                log.error("no step result before the drain deadline", step=step)
                return None
            if time.monotonic() - waited_since > self.config.worker_silence_warn_s:
                await self._warn_silent_workers(step)
                waited_since = time.monotonic()

    async def _retrying(self, what: str, op: Callable[[], Awaitable[T]]) -> T:
        """Run a Redis operation until the connection lets it through (or the drain ends)."""
        delay = 0.1
        while True:
            try:
                return await op()
            except (RedisConnectionError, RedisTimeoutError) as e:
                if self._drain_expired():
                    raise
                log.warning("redis unavailable; retrying", op=what, error=str(e),
                            retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _warn_silent_workers(self, step: int) -> None:
        ranks = range(self.config.tp)
        try:
            alive = await self.redis.mget([self.keys.hb_worker(r) for r in ranks])
        except RedisError:
            alive = [None] * len(ranks)
        log.warning("still waiting for a step result", step=step,
                    dead_ranks=[r for r in ranks if not alive[r]])

    def _drain_expired(self) -> bool:
        return self._drain_deadline is not None and time.monotonic() > self._drain_deadline

    async def flush(self) -> None:
        """Publish and ack what the last iteration finished (at exit)."""
        outbox = self.book.take_outbox()
        if outbox:
            pipe = self.redis.pipeline(transaction=False)
            self._queue_outbox(pipe, outbox)
            await pipe.execute()
        await self.redis.hset(self.keys.stats, mapping=self.stats.snapshot(self.core))

    def heartbeat(self) -> Heartbeat:
        return Heartbeat("scheduler", self.config.scheduler_id, time.time(), {
            "pid": os.getpid(), "num_kv_blocks": self.core.block_manager.num_total_blocks,
            "running": self.core.num_running, "waiting": self.core.num_waiting,
            "iterations": self.stats.num_plans_sent})


def _decode_result(fields: dict) -> StepResult | None:
    try:
        msg = from_fields(fields)
    except ProtocolError as e:
        log.error("undecodable step result", error=str(e))
        return None
    return msg.result if isinstance(msg, StepResultMsg) else None


async def serve(redis: aioredis.Redis, keys: Keys, core: Scheduler,
                config: SchedulerServiceConfig, stop: asyncio.Event) -> int:
    """Prepare, wait for the workers, run until stopped and drained. Returns an exit code."""
    from services.lifecycle import cancel_tasks, clear_key, heartbeat_forever

    service = SchedulerService(redis, keys, core, config)
    await service.prepare()
    hb_key = keys.hb_scheduler(config.scheduler_id)
    heartbeat = asyncio.create_task(heartbeat_forever(redis, hb_key, service.heartbeat),
                                    name="scheduler-heartbeat")
    try:
        if not await service.wait_for_workers(stop):
            return 0 if stop.is_set() else 2
        log.info("scheduler ready", scheduler_id=config.scheduler_id, tp=config.tp,
                 num_kv_blocks=core.block_manager.num_total_blocks)
        await service.run(stop)
        await service.flush()
        return 0
    except RedisError as e:
        log.error("redis failed", error=str(e))
        return 1
    finally:
        await cancel_tasks(heartbeat)
        await clear_key(redis, hb_key)
