"""The scheduler service: the pure core in a short asyncio loop over Redis streams.

One iteration:

    intake    one pipeline: HSET stats when due, PUBLISH finish events, XACK finished
              entries, DEL their progress records, XREADGROUP new requests (only while the
              waiting queue is below its bound), XREAD aborts; once a second also MGET the
              heartbeats of the gateways holding live requests and XAUTOCLAIM abandoned ones
              (and, after a claim or once a minute, delete the group's dead consumers)
    schedule  plan = core.schedule_ahead() while one plan is in flight (overlap), else
              core.schedule()
    send      XADD PlanMsg to the plans stream (MAXLEN ~)
    wait      XREAD the results stream after the last id seen, for the oldest plan's step
    update    outputs = core.update(plan, result); finished ones go to the next intake

With overlap (the default; `--no-overlap` turns it off) the plan for iteration t+1 is in the
plans stream before the workers finish t, so they never wait for the scheduler's host work:
at most two plans are in flight, their results applied in order (docs/design.md#overlap).
A P/D decode instance plans ahead too (its steps are short, so the turn between them is a
large share); a prefill instance keeps the strict order: plan, wait, update.

Failures, and what the loop does about them (the worker, plan and Redis cases are
`recovery.py`'s):

    a worker dies       recompute every running request, wait for the group (meanwhile
                        ending the requests aborted or past their deadline), carry on
    a plan is lost      recompute every running request, carry on
    it restarts itself  request state lives in Redis until finished: an entry is XACKed only
                        after its finish event was published. At start it runs one empty
                        plan (so the workers finish whatever the dead scheduler sent), then
                        takes back its pending entries with their progress records
                        (`takeover.py`); entries of a dead scheduler with another id are
                        XAUTOCLAIMed after CLAIM_IDLE_MS
    Redis restarts      every live request ends with an error event; serving goes on
    a gateway dies      its heartbeat missing twice in a row: its requests are aborted
    a deadline passes   the request ends with a timeout error event; its blocks are freed

With no work the intake blocks on XREADGROUP for `idle_block_ms` instead of spinning (a P/D
prefill instance on XREAD of its inbox and the requests stream: `_wake`), and
every Redis operation retries with backoff (0.1 s doubling to 2 s) while Redis is away.
"""
from __future__ import annotations

import asyncio
import os
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from scheduler_svc.book import Outbox, RequestBook
from scheduler_svc.cached_blocks import queue_block_events
from scheduler_svc.core import Scheduler
from scheduler_svc.disagg import (DECODE_QUARANTINE_S, DecodeSide, PrefillSide, Writers,
                                  decoders_from, descriptors_pending, prefills_from,
                                  scheduler_beats, trim_read)
from scheduler_svc.recovery import (WORKER_PROBE_S, Cursors, Interrupted, Recovery, RedisLost,
                                    WorkersLost)
from scheduler_svc.stats import SchedulerStats
from scheduler_svc.takeover import Takeover
from scheduler_svc.workers import WorkerWatch, model_disagreement, role_disagreement
from shared import clock
from shared.keys import HEARTBEAT_INTERVAL_S, HEARTBEAT_TTL_S, PLANS_MAXLEN, SCAN_COUNT, Keys
from shared.lifecycle import (Claim, cancel_tasks, claimed, essential_task, freeze_heap,
                              keep_heartbeat, queue_hset, scheduler_heartbeats, stopped_for,
                              stream_id_text, stream_tail_id)
from shared.outputs import RequestOutput
from shared.plan import IterationPlan, StepResult
from shared.scripts import execute
from shared.service_args import check_role
from shared.protocol import (Heartbeat, PlanMsg, ProtocolError, StepResultMsg, decode,
                             from_fields, heartbeat_of, protocol_disagreement, to_fields)

log = structlog.get_logger("scheduler")

HOUSEKEEPING_S = 1.0          # gateway heartbeats and XAUTOCLAIM, at most this often
GATEWAY_MISSES = 2            # consecutive missing heartbeats before a gateway counts as dead
@dataclass(frozen=True)
class SchedulerServiceConfig:
    scheduler_id: str                 # the consumer name: stable across restarts to recover
    tp: int = 1                       # worker ranks that must be alive before the first plan
    max_waiting: int = 128            # pull from the request stream only below this
    idle_block_ms: int = 100
    result_block_ms: int = 500
    drain_timeout_s: float = 30.0
    worker_silence_warn_s: float = 10.0
    # P/D (docs/design.md#pd-disaggregation): "colocated", "prefill" or "decode"; the engine
    # instance whose keys this scheduler plans on; prompts shorter than this are prefilled on
    # the decode instance itself
    role: str = "colocated"
    instance: str = ""
    disagg_min_prompt_tokens: int = 32
    # plan iteration t+1 while t runs (docs/design.md#overlap); not on a prefill instance
    overlap: bool = True
    # the model served (shared/model_source.py:model_identity): P/D pairs only instances of
    # the same weights
    model: str = ""
    weights: str = ""

    def __post_init__(self) -> None:
        check_role(self.role, self.instance)


class SchedulerService:
    def __init__(self, redis: aioredis.Redis, keys: Keys, core: Scheduler,
                 config: SchedulerServiceConfig, stop: asyncio.Event | None = None,
                 claim: Claim | None = None) -> None:
        """`stop`: the service's; told to stop drain_timeout_s ago, it gives up on a Redis
        that does not answer, wherever it waits for one (not only while draining). `claim`:
        the scheduler id's (`claimed`), which fences each plan sent; None: plans go out
        unfenced (a test's service, which claims nothing)."""
        self.redis, self.keys, self.core, self.config = redis, keys, core, config
        self.claim = claim
        self._stopped_long = stopped_for(stop or asyncio.Event(), config.drain_timeout_s)
        self.book = RequestBook(core)
        self.stats = SchedulerStats()
        self.workers = WorkerWatch(keys, config.tp)
        self.started_at = time.time()
        self.prefill = PrefillSide(keys, config.instance, core, self.book,
                                   config.disagg_min_prompt_tokens,
                                   {"model": config.model, "weights": config.weights},
                                   config.scheduler_id) \
            if config.role == "prefill" else None
        self.decode = DecodeSide(keys, config.instance, config.scheduler_id, core, self.book,
                                 self.started_at) if config.role == "decode" else None
        self.takeover = Takeover(redis, keys, config.scheduler_id, self.book,
                                 admit=self.prefill.admit if self.prefill else None,
                                 held=self.prefill.pending_entry_ids if self.prefill else None)
        self.cursors = Cursors()
        self.recovery = Recovery(redis, keys, core, self.book, self.workers, self.takeover,
                                 self.cursors, self._give_up_redis)
        self._drain_deadline: float | None = None
        # plans sent whose results are not applied yet, oldest first: (plan, entry id)
        self._flight: deque[tuple[IterationPlan, bytes | str]] = deque()
        self._overlap = config.overlap and config.role != "prefill"
        self._housekeeping_at = 0.0
        self._gateway_misses: dict[str, int] = {}
        # P/D decode: this is the instance's first scheduler in a Redis `pacer up` started
        # (`Keys.pool_untold`): no predecessor's reservation, so no late K/V write, exists
        self._pool_untold = False
        if self.publishes_cache:     # the gateway's router reads it
            core.block_manager.keep_events()

    @property
    def publishes_cache(self) -> bool:
        """Whether this scheduler publishes its cached block hashes for the gateway's router:
        a replica's, and a P/D prefill instance's (docs/design.md#cache-aware-routing)."""
        return self.keys.own_requests or self.config.role == "prefill"

    # ---- start-up ------------------------------------------------------------------------

    async def prepare(self) -> None:
        """Read Redis's clock (requests' deadlines are on it), create the consumer group and
        note where the aborts and results streams end."""
        await self.recovery.retrying("read redis's clock", lambda: clock.sync(self.redis))
        ours = {self.keys.requests: "stream", self.keys.aborts: "stream",
                self.keys.plans: "stream", self.keys.results: "stream",
                self.keys.stats: "hash", self.keys.cached_blocks: "set"}
        if self.prefill is not None:
            ours[self.keys.reservations] = "stream"
        if self.decode is not None:
            ours[self.keys.handoff] = "stream"
        await self.recovery.prepare(ours)
        if self.decode is not None:     # before any reservation is answered
            self._pool_untold = bool(await self.recovery.retrying(
                "take the new pool's mark", lambda: self.redis.delete(self.keys.pool_untold)))
        if self.publishes_cache:     # the index starts empty (docs/design.md#prefix-caching)
            await self.recovery.retrying("clear cached blocks",
                                         lambda: self.redis.delete(self.keys.cached_blocks))
        self.cursors.aborts = await self.recovery.retrying("find where to read aborts",
                                                          self.recovery.aborts_from)
        self.cursors.results = await stream_tail_id(self.redis, self.keys.results)
        if self.prefill is not None:
            self.prefill.cursor = await stream_tail_id(self.redis, self.keys.reservations)
        if self.decode is not None:
            self.decode.cursor = await stream_tail_id(self.redis, self.keys.handoff)
        # before the heartbeat (which /health waits for): a gateway's router reads the block
        # size it hashes prompts with from here, and a request may come at once
        stats = self.stats_snapshot()
        await self.recovery.retrying("write stats", lambda: self.redis.hset(self.keys.stats,
                                                                           mapping=stats))

    async def start(self, stop: asyncio.Event) -> bool:
        """Wait for the workers, let them finish what a previous scheduler sent, take back
        this consumer's unfinished requests. False if stopped first or the workers' KV pool
        disagrees with ours."""
        while True:
            if not await self.wait_for_workers(stop):
                return False
            try:
                await self._barrier()
                taken = await self.recovery.retrying("take back pending",
                                                     self.takeover.take_back_pending)
            except Interrupted as e:
                if not await self._recover(e, stop):
                    return False
                continue
            if taken:
                log.info("took back unfinished requests", count=taken)
            if self.decode is not None:
                await self._await_late_writes(stop)
            return True

    async def _await_late_writes(self, stop: asyncio.Event) -> None:
        """A decode scheduler starts knowing nothing of the blocks a predecessor had reserved
        or set aside, and prefill workers may still be writing into them (a write given up
        at its deadline can land much later). After DECODE_QUARANTINE_S (the prefill
        schedulers see the restart within it and send nothing more here), wait until every
        prefill worker has beaten since without naming this instance's workers among the
        peers its writes may still land in; a rank with no heartbeat (stopped, it writes
        again when it runs) for HELD_GONE_S, one another process took over for
        HELD_REPLACED_S (docs/failure-modes.md). The first scheduler of an instance in a
        Redis `pacer up` started has no predecessor, and waits for nothing."""
        if self._pool_untold:
            log.info("first scheduler of this decode instance: no prefill worker was told "
                     "where its pool is; not waiting for late K/V writes")
            return
        log.info("waiting for prefill workers' late K/V writes into this instance",
                 quarantine_s=DECODE_QUARANTINE_S)
        await asyncio.sleep(DECODE_QUARANTINE_S)

        async def read() -> dict[str, Heartbeat | None]:
            # every worker beating now, and every rank the prefill schedulers say they have
            keys = {k async for k in self.redis.scan_iter(
                match=self.keys.hb_instance_workers_pattern, count=SCAN_COUNT)}
            schedulers = [k async for k in self.redis.scan_iter(
                match=self.keys.hb_scheduler_pattern, count=SCAN_COUNT)]
            for beat in scheduler_beats(await self.redis.mget(schedulers) if schedulers
                                        else [], "prefill"):
                keys.update(self.keys.for_instance(beat.extra["instance"]).hb_worker(r)
                            for r in range(int(beat.extra.get("tp", 1))))
            keys = sorted(k.decode() if isinstance(k, bytes) else k for k in keys)
            return dict(zip(keys, map(heartbeat_of, await self.redis.mget(keys) if keys else [])))
        writers, logged = Writers(), False
        while not stop.is_set():
            beats = await self.recovery.retrying("read prefill workers' heartbeats", read)
            if writers.done(beats, self.decode.writes_here):
                return
            if not logged and time.monotonic() - writers.since > 5.0:
                log.info("waiting for prefill workers' K/V writes into this instance to end",
                         without_heartbeat=sorted(writers.gone_since))
                logged = True
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def _barrier(self) -> None:
        """One empty plan: workers run plans in order, so once it is answered every plan of
        a dead predecessor has run and its tokens are in the progress records."""
        plan = self.core.schedule()
        plan_id = await self._send(plan)
        self.core.update(plan, await self._wait_result(plan.step, plan_id))

    async def wait_for_workers(self, stop: asyncio.Event,
                               meanwhile: Callable[[], Awaitable[None]] | None = None) -> bool:
        """Until every rank's heartbeat is up (with P/D, every rank's with its KV connector
        descriptor: `descriptors_pending`), running `meanwhile` between looks; False if
        stopped first or a rank's KV pool disagrees with ours (then nothing could be
        scheduled safely)."""
        logged = 0.0
        while not stop.is_set() or self._drain_deadline is not None and not self._drain_expired():
            values = await self.recovery.retrying(
                "read worker heartbeats", lambda: self.redis.mget(self.workers.heartbeat_keys))
            pending = descriptors_pending(values) \
                if self.prefill is not None or self.decode is not None else []
            if all(values) and not pending:
                self.workers.record(values)
                if self.decode is not None:
                    self.decode.set_workers(values)
                if self.prefill is not None:
                    self.prefill.set_workers(values)
                return self._layouts_agree(values)
            if time.monotonic() - logged > 5.0:
                missing = [r for r, v in enumerate(values) if not v]
                log.info("waiting for workers", missing_ranks=missing,
                         **({"ranks_without_kv_descriptor": pending} if pending else {}))
                logged = time.monotonic()
            if meanwhile is not None:
                await meanwhile()
            await asyncio.sleep(0.2)
        return False

    async def _wait_for_lost_workers(self, stop: asyncio.Event) -> bool:
        """Wait for a worker group that was lost. Every request waits in the queue meanwhile
        (none runs), so one that is aborted, reaches its deadline, loses its gateway or is
        dropped for losing the workers again and again ends at once, with no plan: its
        client (or its gateway's bookkeeping) must not wait for the workers to come back."""
        async def end_stopped() -> None:
            await self._intake(pull=False, block=False, watch=False)
            self.book.expire(clock.now())
            if ended := self.core.take_aborted():
                self._finish(ended)
        return await self.wait_for_workers(stop, end_stopped)

    def _layouts_agree(self, values: list[bytes]) -> bool:
        mine = {"num_kv_blocks": self.core.block_manager.num_total_blocks,
                "block_size": self.core.block_manager.block_size}
        for rank, value in enumerate(values):
            why = protocol_disagreement(value, f"worker rank {rank} of this instance",
                                        "scheduler")
            if why:
                log.error(why, rank=rank)
                return False
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
            why = (role_disagreement(extra, rank, self.config.role)
                   or model_disagreement(extra, rank, self.config.model, self.config.weights))
            if why:
                log.error(why, rank=rank)
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
            try:
                if not await self._step():
                    return
            except Interrupted as e:
                if not await self._recover(e, stop):
                    return

    async def _recover(self, interrupted: Interrupted, stop: asyncio.Event) -> bool:
        """Forget what the interruption lost and bring the core back to what can be served.
        An interruption while recovering (Redis restarting while the scheduler waits for a
        worker group to come back) is recovered from in turn: raised, it ended the scheduler
        with a traceback. False: stop serving."""
        while True:
            given_up = self._flight[-1][1] if self._flight and \
                not isinstance(interrupted, RedisLost) else None
            self._flight.clear()        # the core forgets them too (recompute_running)
            if self.decode is not None:
                self.decode.plans_lost()
            if self.prefill is not None:
                self.prefill.plans_lost()
            if isinstance(interrupted, RedisLost):
                self._forget_disagg_state()
                self.stats.mark_dirty()         # its stats hash went with the old server
            try:
                if given_up is not None:
                    await self.recovery.retrying("fence the plans given up",
                                                 lambda: self._fence_plans(given_up))
                return await self.recovery.recover(interrupted, stop,
                                                   self._wait_for_lost_workers)
            except Interrupted as again:
                log.warning("interrupted again while recovering", first=type(interrupted).__name__,
                            then=type(again).__name__)
                interrupted = again

    async def _fence_plans(self, newest: bytes | str) -> None:
        """Rank 0 writes nothing for the plans up to `newest` (the plans fence), whose
        results this scheduler no longer waits for; before any request ends (aborted while
        the group is waited for): a rank that was only stopped runs them when it resumes,
        and their tokens and progress records would outlive the requests they belong to."""
        if self.claim is None:
            await self.redis.set(self.keys.plans_fence, newest)
        else:       # a stale scheduler must not move the new holder's fence back
            await self.claim.call("SET", self.keys.plans_fence, newest)

    def _forget_disagg_state(self) -> None:
        """Redis restarted empty: reservations and hand-offs in flight went with it."""
        if self.prefill is not None:
            self.prefill.forget_all()
            self.prefill.cursor = "0-0"
        if self.decode is not None:
            self.decode.forget_all()

    async def _step(self) -> bool:
        """Intake, then one iteration if there is work. False: stop serving."""
        busy = self._has_work() or bool(self._flight)
        await self._intake(pull=self._drain_deadline is None, block=not busy)
        self.book.expire(clock.now())
        if self.decode is not None and self.decode.expire():
            self.stats.mark_dirty()             # the pool changed with no plan
        if self._flight:
            return await self._iterate()        # a result is due: apply it in order
        if not self._has_work():                # nothing, or reservations awaiting their K/V
            if self._drain_deadline is None:
                return True
            return self.core.has_unfinished() and not self._drain_expired()
        if not self.core.has_unfinished():
            return self._drain_deadline is None
        if self._drain_expired():
            log.warning("drain timed out; unfinished requests stay pending",
                        live_requests=self.book.num_live)
            return False
        return await self._iterate()

    def _has_work(self) -> bool:
        """A plan would carry something: rows, aborts, or (P/D decode) K/V checks."""
        return self.core.has_schedulable() or (self.decode is not None
                                               and self.decode.checks_due)

    async def _iterate(self) -> bool:
        """A plan out (with overlap, the next one while the last runs), the oldest result
        in, the core updated. False: no result will come."""
        if self.takeover.overdue:               # back from a stall: are they still ours?
            await self._drop_claimed()
        if not self._flight:
            plan = self.core.schedule()
            if self.prefill is not None:
                plan = self.prefill.add_sends(plan)
            if self.decode is not None:
                plan = self.decode.add_checks(plan)
            if plan.is_empty and not plan.dropped_request_ids and not plan.kv_checks:
                # only aborts of queued requests to report; no worker needs to hear of it
                if not self._apply(plan, StepResult(plan.step, {})):
                    # nothing could be admitted and nothing changed: do not spin
                    await asyncio.sleep(self.config.idle_block_ms / 1000)
                self.stats.went_idle()
                return True
            self._flight.append((plan, await self._send(plan)))
        # past the drain deadline nothing more goes out: the results of the plans in flight
        # come in, and then `_step` stops (with a plan always ahead, it never got the chance)
        if self._overlap and not self._drain_expired() and self.core.has_schedulable() \
                and self.core.can_schedule_ahead():
            plan = self.core.schedule_ahead()
            if self.decode is not None:
                plan = self.decode.add_checks(plan)
            if not plan.is_empty or plan.dropped_request_ids or plan.kv_checks:
                self._flight.append((plan, await self._send(plan)))
        plan, plan_id = self._flight[0]
        result = await self._wait_result(plan.step, plan_id)
        if result is None:
            return False
        if self.takeover.overdue:
            await self._drop_claimed()
        self._flight.popleft()
        self.stats.result_received()
        self._apply(plan, result)
        if not self.core.has_unfinished():
            self.stats.went_idle()
        return True

    def _apply(self, plan: IterationPlan, result: StepResult) -> int:
        """Update the core; returns how many requests got a token or finished."""
        outputs = self.core.update(plan, result)
        if self.prefill is not None:
            self.prefill.observe(plan, result)
        if self.decode is not None:
            self.decode.observe(plan, result)
        self._finish(outputs)
        return len(outputs)

    def _finish(self, outputs: list[RequestOutput]) -> None:
        """The finished among the core's outputs go to the book (a prefill instance's, once
        prefilled, to their decode instance instead)."""
        for output in outputs:
            if output.finished and not (self.prefill is not None
                                        and self.prefill.finished(output)):
                self.book.finished(output)
        self.stats.mark_dirty()

    # ---- intake --------------------------------------------------------------------------

    async def _intake(self, pull: bool, block: bool, watch: bool = True) -> None:
        """Write stats, flush the outbox, read requests and aborts: one round trip. `watch`:
        whether an idle scheduler looks for restarted workers (not while it waits for a lost
        group: it takes that group as it comes back)."""
        if self.claim is not None and self.claim.unconfirmed:
            # back from a stall, maybe past the claim's TTL, and resumed mid-iteration: the
            # exchange would go out before any refresh of ours (its finish events, acks and
            # reads of new requests, into a consumer a new process of this id serves now)
            await self.recovery.retrying("check the claim", self.claim.confirm)
        outbox = self.book.take_outbox()
        # a prefill instance's requests waiting for a decode instance's blocks are queued too
        # (each holds its entry and an ask there): counted, it pulls no more than it can serve
        # while the decode side is full, and leaves the rest to the other prefill instances
        held = self.prefill.num_awaiting_reservation if self.prefill is not None else 0
        room = max(0, self.config.max_waiting - self.core.num_waiting - held) if pull else 0
        if self.decode is not None:
            room = 0                 # new requests are the prefill instances'
        disagg_out = self.prefill.take() if self.prefill is not None else None
        reserved = self.decode.take_replies() if self.decode is not None else None
        block_ms = self.config.idle_block_ms if block else None
        # an idle prefill instance blocks until an answer to its asks (or a forward) comes
        # into its inbox or, with room, a new request into the requests stream (`_wake`)
        wake = block and self.prefill is not None
        idle = not self.core.has_unfinished()
        counts = self.prefill.counts() if self.prefill is not None else None
        # stats go first: a client that saw its request end and then scrapes /metrics must
        # not find the request still holding blocks
        stats = self.stats_snapshot() if self.stats.due(idle) else None
        gateways = self._housekeeping_due()
        claim = room if gateways is not None else 0
        # idle, the workers may have been restarted (their KV cache and every cached prefix
        # gone) with no plan in flight to notice it: look before the next plan goes out
        watch_workers = watch and idle and not self._flight
        # blocks set aside from a given-up reservation: may their writers' heartbeats free them
        held = self.decode.held_heartbeats() if self.decode is not None and gateways is not None \
            else []
        block_events = self.core.block_manager.take_events()

        tries = 0
        moves_at = 0                 # where the prefill side's commands start in the pipeline

        async def exchange() -> list:
            nonlocal tries, moves_at
            tries += 1
            pipe = self.redis.pipeline(transaction=False)
            if stats is not None:    # fenced: a stale scheduler's stats are not the holder's
                queue_hset(pipe, self.claim, self.keys.stats, stats)
            self._queue_outbox(pipe, outbox)
            queue_block_events(pipe, self.keys.cached_blocks, block_events)
            if disagg_out is not None:
                moves_at = len(pipe)
                self.prefill.queue(pipe, disagg_out)
            if reserved:
                self.decode.queue(pipe, reserved)
            if gateways is not None:
                if disagg_out is not None:
                    trim_read(pipe, self.keys.reservations, self.prefill.cursor)
                if self.decode is not None:
                    trim_read(pipe, self.keys.handoff, self.decode.cursor)
            if held:
                pipe.mget([key for _, key in held])
            if gateways:
                pipe.mget([self.keys.hb_gateway(g) for g in gateways])
            if claim:
                self.takeover.queue_claim(pipe, claim)
            # replies read back from the end: every command below returns one
            if wake:
                self._wake(pipe, room, block_ms)
            if disagg_out is not None:
                pipe.xread({self.keys.reservations: self.prefill.cursor}, count=1000)
            if self.decode is not None:
                pipe.xread({self.keys.handoff: self.decode.cursor}, count=1000, block=block_ms)
            if room:
                # tried again, Redis may have run the last try and delivered new entries in
                # the reply that was lost: ours now (pending), never delivered as new again;
                # they are read back from our own history past the last one seen
                start = ">" if tries == 1 or self.cursors.requests_seen is None \
                    else self.cursors.requests_seen
                pipe.xreadgroup(self.keys.requests_group, self.config.scheduler_id,
                                {self.keys.requests: start}, count=room,
                                block=None if wake else block_ms)
                if wake:
                    pipe.xinfo_groups(self.keys.requests)
            if watch_workers:
                # after the blocking reads, so as they returned: a request that came while
                # this one blocked is planned only once a worker restarted meanwhile is seen
                pipe.mget(self.workers.heartbeat_keys)
            pipe.xread({self.keys.aborts: self.cursors.aborts}, count=1000)
            return await execute(pipe)

        # a retried exchange may publish a finish event twice; gateways keep the first
        try:
            replies = await self.recovery.retrying("intake", exchange)
        except Interrupted:          # RedisLost
            self.book.put_back(outbox)
            if disagg_out is not None:
                self.prefill.put_back(disagg_out)
            raise
        if stats is not None and self.claim is not None:
            self.claim.checked(replies[0])
        if disagg_out is not None:
            self.prefill.moves_skipped(disagg_out, replies[moves_at:])
        self._receive_aborts(replies.pop())
        worker_beats = replies.pop() if watch_workers else None
        self._drop_lost()
        if room and wake:
            self.prefill.requests_tail = next(
                (g["last-delivered-id"] for g in replies.pop()
                 if stream_id_text(g["name"]) == self.keys.requests_group), "0-0")
        if room:
            self._receive_requests(replies.pop())
        if self.decode is not None and self.decode.receive(replies.pop()):
            self.stats.mark_dirty()         # reservations change the pool between plans
        if disagg_out is not None:
            self.prefill.receive_reservations(replies.pop())
        if wake:
            replies.pop()            # only woke the intake: the reads after it took what came
        if claim:
            await self._resume_claimed(self.takeover.claimed(replies.pop()))
        lost = self.workers.restarted_in(worker_beats) if worker_beats is not None else []
        if gateways:
            self._check_gateways(gateways, replies.pop())
        if held and self.decode.release_settled(held, replies.pop()):
            self.stats.mark_dirty()
        if self.prefill is not None:
            if gateways is not None:
                await self._find_decoders()
            else:
                self.prefill.retry()
            if self.prefill.counts() != counts:
                # aborts, reservations and hand-offs of whole requests (a short prompt, at
                # arrival) change them between plans; an idle instance writes no more stats
                self.stats.mark_dirty()
        if gateways is not None and self.takeover.sweep_due:
            await self.recovery.retrying("forget stopped schedulers", self.takeover.forget_dead)
        if lost:
            raise WorkersLost(lost)

    def _wake(self, pipe, room: int, block_ms: int) -> None:
        """Queue the blocking read an idle prefill scheduler waits on: it returns once an
        entry comes into its inbox (an ask answered, a request forwarded) or, while it pulls,
        a request into the requests stream past the last one its group delivered (at the
        last intake); the reads queued after it take them (one whose bound is reached by
        requests waiting for blocks pulls none, and has only this read to block on). Before,
        the requests' read was the only blocking one, for 5 ms while an ask was out: a
        scheduler whose asks waited for a full decode instance's room (seconds) polled Redis
        the whole time."""
        streams = {self.keys.reservations: self.prefill.cursor}
        if room:
            streams[self.keys.requests] = self.prefill.requests_tail
        pipe.xread(streams, count=1, block=block_ms)

    async def _find_decoders(self) -> None:
        """The decode instances alive now, from the scheduler heartbeats."""
        found = await self.recovery.retrying(
            "find decoders", lambda: scheduler_heartbeats(self.redis, self.keys))
        beats = list(found.values())
        self.prefill.other_protocols({why for key, value in found.items() if (
            why := protocol_disagreement(value, f"scheduler {key}", "prefill scheduler"))})
        self.prefill.housekeeping(decoders_from(beats), prefills_from(beats))

    def _housekeeping_due(self) -> list[str] | None:
        """The gateways to check when housekeeping is due this intake, else None."""
        if time.monotonic() - self._housekeeping_at < HOUSEKEEPING_S:
            return None
        self._housekeeping_at = time.monotonic()
        return list(self.book.gateways())

    def _queue_outbox(self, pipe, outbox: Outbox) -> None:
        for channel, data in outbox.finishes:
            pipe.publish(channel, data)
        if outbox.acks:
            pipe.xack(self.keys.requests, self.keys.requests_group, *outbox.acks)
        if outbox.ended_ids:
            pipe.delete(*(self.keys.progress(rid) for rid in outbox.ended_ids))

    def _receive_requests(self, reply) -> None:
        for _, stream_entries in reply or []:
            for entry_id, fields in stream_entries:
                self.cursors.requests_seen = entry_id
                if self.prefill is None:
                    self.book.receive(entry_id, fields)
                elif (msg := self.book.decode(entry_id, fields)) is not None:
                    self.prefill.route(entry_id, msg)

    async def _resume_claimed(self, entries: list) -> None:
        if entries:
            log.warning("claiming requests of a scheduler that stopped", count=len(entries))
            await self.recovery.retrying("resume claimed",
                                         lambda: self.takeover.resume(entries))

    async def _drop_claimed(self) -> None:
        """After a stall (docs/failure-modes.md), before another token is planned or a result
        applied: drop the requests another scheduler claimed (or finished) meanwhile, rather
        than publish a second run of their tokens and a second finish."""
        await self.recovery.retrying("refresh leases", self.takeover.refresh_leases)
        self._drop_lost()

    def _drop_lost(self) -> None:
        """Requests another scheduler claimed while this one stalled: theirs now."""
        for entry_id in self.takeover.take_lost():
            if self.prefill is not None:
                self.prefill.lose(entry_id)
            self.book.lose(entry_id)

    def _receive_aborts(self, reply) -> None:
        for _, entries in reply or []:
            for entry_id, fields in entries:
                self.cursors.aborts = entry_id
                self.book.abort(fields)

    def _check_gateways(self, gateways: list[str], heartbeats: list) -> None:
        """Stop the requests of a gateway whose heartbeat is gone: nobody reads their tokens,
        and their KV blocks are better spent on live clients. Each ends with an error, not a
        bare abort: a gateway that was only paused (stopped, swapping) reads it when it comes
        back, and tells its clients that the request was dropped."""
        misses = {}
        for gateway_id, beat in zip(gateways, heartbeats):
            if beat is None:
                misses[gateway_id] = self._gateway_misses.get(gateway_id, 0) + 1
        self._gateway_misses = misses
        by_gateway = self.book.gateways()
        for gateway_id, count in misses.items():
            if count >= GATEWAY_MISSES:
                rids = by_gateway.get(gateway_id, [])
                log.warning("gateway gone; aborting its requests", gateway_id=gateway_id,
                            requests=len(rids))
                for rid in rids:
                    self.book.stop(rid, f"gateway {gateway_id} sent no heartbeat for over "
                                        f"{HEARTBEAT_TTL_S} s, so its requests were dropped; "
                                        f"send the request again")

    # ---- plans and results ---------------------------------------------------------------

    async def _send(self, plan: IterationPlan) -> bytes | str:
        """XADD the plan; returns its entry id in the plans stream."""
        # the server it goes to: after a restart of a Redis that persists, worker rank 0 skips
        # the plans sent to the server before (this scheduler plans their requests afresh)
        fields = to_fields(PlanMsg(plan), scheduler=self.config.scheduler_id,
                           run_id=self.recovery.run_id)
        attempts = 0

        async def xadd() -> bytes | str:
            nonlocal attempts
            attempts += 1
            # a retry after a dropped connection must not run the plan twice
            if attempts > 1:
                sent = await self._plan_in_stream(plan.step)
                if sent is not None:
                    return sent
            if self.claim is not None:      # no plan once another process has the id
                return await self.claim.xadd(self.keys.plans, fields, PLANS_MAXLEN)
            return await self.redis.xadd(self.keys.plans, fields, maxlen=PLANS_MAXLEN,
                                         approximate=True)

        plan_id = await self.recovery.retrying("send plan", xadd)
        self.stats.plan_sent()
        return plan_id

    async def _plan_in_stream(self, step: int) -> bytes | str | None:
        """The entry id of this step's plan if it is the newest in the stream."""
        newest = await self.redis.xrevrange(self.keys.plans, count=1)
        if not newest:
            return None
        entry_id, fields = newest[0]
        try:
            msg = from_fields(fields)
        except ProtocolError:
            return None
        return entry_id if isinstance(msg, PlanMsg) and msg.plan.step == step else None

    async def _wait_result(self, step: int, plan_id: bytes | str) -> StepResult | None:
        """This step's result from the results stream; None if the drain deadline passed
        while the workers stayed silent. Raises WorkersLost, PlanLost or RedisLost."""
        waited_since = probed_at = time.monotonic()
        while True:
            result = await self._read_result(step, self.config.result_block_ms)
            if result is not None:
                return result
            if self._drain_expired():
                log.error("no step result before the drain deadline", step=step)
                return None
            if time.monotonic() - probed_at >= WORKER_PROBE_S:
                probed_at = time.monotonic()
                result = await self.recovery.probe(step, plan_id, self._read_result)
                if result is not None:
                    return result
            if time.monotonic() - waited_since > self.config.worker_silence_warn_s:
                log.warning("still waiting for a step result", step=step)
                waited_since = time.monotonic()

    async def _read_result(self, step: int, block_ms: int | None) -> StepResult | None:
        """This step's result if it is in the results stream (waiting up to `block_ms` for
        the first entry); older results on the way are skipped."""
        while True:
            reply = await self.recovery.retrying("read results", lambda: self.redis.xread(
                {self.keys.results: self.cursors.results}, count=16, block=block_ms))
            entries = [entry for _, stream_entries in reply or [] for entry in stream_entries]
            if not entries:
                return None
            for entry_id, fields in entries:
                self.cursors.results = entry_id
                result = _decode_result(fields)
                if result is not None and result.step == step:
                    return result
                log.warning("unexpected step result skipped", expected_step=step,
                            got_step=None if result is None else result.step)
            block_ms = None         # read on at once: this step's result may be next

    def _drain_expired(self) -> bool:
        return self._drain_deadline is not None and time.monotonic() > self._drain_deadline

    def _give_up_redis(self) -> bool:
        """Whether a Redis operation that keeps failing is given up: the drain deadline
        passed, or the stop came that long ago while it retried (before the drain began)."""
        return self._drain_expired() or self._stopped_long()

    async def flush(self) -> None:
        """Publish and ack what the last iteration finished (at exit)."""
        outbox = self.book.take_outbox()
        pipe = self.redis.pipeline(transaction=False)
        queue_hset(pipe, self.claim, self.keys.stats, self.stats_snapshot())
        self._queue_outbox(pipe, outbox)
        if self.publishes_cache:     # a successor starts with an empty index
            pipe.delete(self.keys.cached_blocks)
        stats_written, *_ = await execute(pipe)
        if self.claim is not None:
            self.claim.checked(stats_written)

    def stats_snapshot(self) -> dict[str, float]:
        role = self.prefill or self.decode
        return {**self.stats.snapshot(self.core), **(role.stats() if role else {})}

    def heartbeat(self) -> Heartbeat:
        return Heartbeat("scheduler", self.config.scheduler_id, time.time(), {
            "pid": os.getpid(), "host": socket.gethostname(), "num_kv_blocks": self.core.block_manager.num_total_blocks,
            "running": self.core.num_running, "waiting": self.core.num_waiting,
            "iterations": self.stats.num_plans_sent, "role": self.config.role,
            "instance": self.config.instance, "started_at": self.started_at,
            "tp": self.config.tp, "model": self.config.model, "weights": self.config.weights,
            "free_blocks": self.core.block_manager.num_free_blocks,
            "max_model_len": self.core.max_model_len})


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
    # two schedulers under one name would take each other's requests as a dead one's
    async with claimed(redis, keys.claim_scheduler(config.scheduler_id), "scheduler",
                       config.scheduler_id, f"scheduler id {config.scheduler_id!r}",
                       "give each scheduler its own --scheduler-id") as claim:
        return await _serve(redis, keys, core, config, stop, claim)


async def _serve(redis: aioredis.Redis, keys: Keys, core: Scheduler,
                 config: SchedulerServiceConfig, stop: asyncio.Event, claim: Claim) -> int:
    hb_key = keys.hb_scheduler(config.scheduler_id)
    service = SchedulerService(redis, keys, core, config, stop, claim)
    await service.prepare()
    tasks = [essential_task(keep_heartbeat(redis, hb_key, service.heartbeat, claim=claim),
                            "scheduler-heartbeat"),
             essential_task(service.takeover.keep_leases(), "scheduler-leases")]
    try:
        if not await service.start(stop):
            return 0 if stop.is_set() else 2
        freeze_heap()
        log.info("scheduler ready", scheduler_id=config.scheduler_id, tp=config.tp,
                 num_kv_blocks=core.block_manager.num_total_blocks)
        await service.run(stop)
        await service.flush()
        await service.takeover.leave()
        return 0
    except RedisError as e:
        log.error("redis failed", error=str(e))
        return 1
    finally:
        await cancel_tasks(*tasks)
        await claim.clear(hb_key)
