"""The worker service: one process per tensor-parallel rank.

Rank 0 is the only rank that talks to Redis about work:

    XREAD plans (after the last id seen) -> executor.execute(plan) -> APPEND each token to its
    request's progress record, PUBLISH one TokenBatch per gateway channel -> XADD the
    StepResultMsg (one script: tokens go out before the scheduler can even see the result,
    so a client never waits on the next plan; the progress record lets a scheduler that takes
    a request over resume where the client is, see `shared/progress.py`)

Both ends are fenced at no extra round trip. Each read of plans checks rank 0's claim
(`claimed`) in its pipeline, after the XREAD: a rank paused past the claim's TTL, whose rank a
new process took meanwhile, runs no plan it reads then and exits 1. The result script writes
nothing, and the process exits 1, when the claim is another's (a plan read before the pause
still ran); nor, the process going on, for a plan at or before the plans fence, which the
scheduler sets to the newest plan it gave up (its worker group lost: a rank stopped past its
heartbeat's TTL, its claim still its own): it may have ended that plan's requests since, and
their tokens and progress records would outlive them.

That pipeline goes out while the loop reads and runs the next plan, which the scheduler sent
before this result (docs/design.md#overlap); results still leave in plan order: the next one
waits for this one to be sent.

Every XREAD of plans also asks the server for its run_id, in the same pipeline (so from the
same server). Another run_id is a Redis that restarted: the cursor into the old plans stream
means nothing there if it kept nothing (an XREAD after an id the new stream has not reached
waits forever), so rank 0 reads the new stream from its start. A Redis that persists
(AOF, RDB) comes back with the old plans, up to PLANS_MAXLEN of them: the scheduler names the
run_id it sent each plan to, and rank 0 runs only the plans sent to the server it read them
from (the scheduler forgets its plans in flight when Redis restarts, and plans afresh).

A result whose first send failed is sent again in full, unless the Redis it would go to is not
the one the plan came from: the scheduler abandons a plan that went with the old Redis and
never reads its result. A send can also reach a restarted Redis without failing first (on a
connection made since, with overlap the next plan's result): after a send that may have gone
over a connection made since its plan was read, the run_id is read, and what went to another
server is taken back (`_send_once`); no connection made, no extra round trip.

A plan the scheduler sent that rank 0 cannot decode (a scheduler of another version) stops
it with an error: skipped, its result would never come, and the scheduler would wait for it
forever.

A plan whose step is not after the last one came from a scheduler that started afresh (the
old one died): rank 0 then adds every request it still holds to that plan's finished ids, so
every rank forgets the dead scheduler's requests before applying the new plan.

Ranks > 0 follow rank 0 over torch.distributed (`gpu_worker.tp.follower`); they meet it at
the address rank 0 writes to the rendezvous key (`gpu_worker.tp.rendezvous`). Rank 0 forwards
each plan's bytes to them as they came from Redis, without decoding and encoding them again.
Every rank keeps its heartbeat key alive; the heartbeat carries the KV pool's size so the
scheduler can refuse a mismatch, the model it loaded (its name and weights fingerprint: the
scheduler refuses other weights), and with a KV connector (P/D) the pool's descriptor under
"kv" (shared/kv_layout.py): where a prefill rank writes this rank's K/V.

Rank 0 measures how long it waits for plans (from sending a result to receiving the next
plan) against how long it computes (and, of that, what the runner timed as the forward), and
writes them to the `stats` hash.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, Protocol

import redis.asyncio as aioredis
import structlog

from gpu_worker.model_runner import build_runner
from gpu_worker.tp.executor import TPExecutor
from gpu_worker.tp.group import GroupNotFormed, bind_device, on_device
from gpu_worker.tp.service import serve_follower, start_rank0
from shared.cpu import pin_forward_thread
from shared.engine_layout import EngineLayout
from shared.errors import PacerError
from shared.keys import PROGRESS_TTL_S, RESULTS_MAXLEN, WORKER_HEARTBEAT_TTL_S, Keys
from shared.model_source import model_identity
from shared.lifecycle import (OTHERS_CLAIM, Claim, Stopwatch, cancel_tasks, claimed,
                              connections_made, essential_task, freeze_heap, keep_heartbeat,
                              queue_hset, redis_run_id, stopped_for, stream_id_text,
                              stream_tail_id)
from shared.plan import IterationPlan, StepResult
from shared.progress import encode_progress
from shared.protocol import (Heartbeat, PlanMsg, PromptLogprobsEvent, ProtocolError,
                             StepResultMsg, TokenBatch, TokenEvent, encode, from_fields,
                             message_bytes, to_fields)
from shared.redis_retry import TRANSIENT, redis_failure, retry_redis
from shared.scripts import Script, execute

log = structlog.get_logger("worker")

PLAN_BLOCK_MS = 500
# how long the event loop waits, at most, for the forward thread to build an iteration's inputs
# before it goes on with its own Python work (PlanLoop.handed_over)
HAND_OVER_WAIT_S = 0.01
WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"     # beside each result, for a reader
STATS_INTERVAL_S = 0.1
# a worker told to stop sends its last result this long at most while Redis does not take it
# (`pacer up` killed: Redis stops with every other child, and nobody is left to wait for it)
STOP_RETRY_S = 5.0
# a progress record's TTL is refreshed at the first token and every this many tokens after
PROGRESS_REFRESH_EVERY = 64
# One iteration's result, written only while rank 0's claim is this incarnation's (KEYS[1],
# ARGV[1]; '' for no claim) and its plan (entry id ARGV[2]) is after the plans fence (KEYS[2]):
# APPEND each token's entry to its progress record (KEYS[4..]: (entry, refresh 0/1) each, from
# ARGV[6]), PUBLISH each token batch (ARGV[5] of (channel, batch)), XADD the result to KEYS[3]
# (MAXLEN ~ ARGV[4]; its fields last). A record this call creates gets its TTL (ARGV[3])
# whatever the token's index: a result sent again after its request finished (a retried
# pipeline), or one taken over mid-stream, must not leave a record forever. Returns {1, the
# result's id}; {0, the other's claim} or {2, the fence} with nothing written.
_SEND_RESULT = Script(OTHERS_CLAIM + """
if ARGV[1] ~= '' then
  local held = others_claim()
  if held then
    return {0, held}
  end
end
local fence = redis.call('GET', KEYS[2])
if fence then
  local ms, seq = string.match(ARGV[2], '^(%d+)-(%d+)$')
  local fence_ms, fence_seq = string.match(fence, '^(%d+)-(%d+)$')
  ms, seq = tonumber(ms), tonumber(seq)
  fence_ms, fence_seq = tonumber(fence_ms), tonumber(fence_seq)
  if ms < fence_ms or (ms == fence_ms and seq <= fence_seq) then
    return {2, fence}
  end
end
local at = 6
for i = 4, #KEYS do
  local n = redis.call('APPEND', KEYS[i], ARGV[at])
  if ARGV[at + 1] == '1' or n == #ARGV[at] then
    redis.call('EXPIRE', KEYS[i], ARGV[3])
  end
  at = at + 2
end
for _ = 1, tonumber(ARGV[5]) do
  redis.call('PUBLISH', ARGV[at], ARGV[at + 1])
  at = at + 2
end
return {1, redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', unpack(ARGV, at))}
""")


class _RedisReplaced(Exception):
    """Redis restarted while a plan ran: its result has nobody to go to."""


class _Origin(NamedTuple):
    """Where a plan came from: the run_id of the Redis it was read from, and how many
    connections the client had made before the read (`connections_made`; None where it cannot
    tell), so that a send over a connection made since is checked (`_send_once`)."""
    run_id: str
    connections: int | None


class Executor(Protocol):
    def execute(self, plan: IterationPlan) -> StepResult: ...


class RequestView(Protocol):
    """What rank 0 needs of a request's state on the runner (ModelRunner's _RequestState)."""
    token_ids: list[int]
    num_prompt_tokens: int
    reply_to: str
    num_cached_tokens: int | None


def token_batches(result: StepResult, requests: Mapping[str, RequestView],
                  instance: str = "") -> dict[str, TokenBatch]:
    """One TokenBatch per gateway channel for the tokens of one iteration, sent by the workers
    of engine `instance` ("" for a colocated engine).

    Call after `execute`: the sampled token is already appended, so its output position is
    `len(token_ids) - num_prompt_tokens - 1` (prompt of 5, first sampled token: index 0).
    """
    batches: dict[str, TokenBatch] = {}
    for rid, token in result.sampled.items():
        state = requests[rid]
        if not state.reply_to or token.token_id < 0:   # no token: the scheduler ends it
            continue
        index = len(state.token_ids) - state.num_prompt_tokens - 1
        batch = batches.get(state.reply_to)
        if batch is None:
            batch = batches[state.reply_to] = TokenBatch(instance=instance)
        batch.events.append(TokenEvent(rid, index, token.token_id, token.logprob,
                                       token.top_logprobs))
        if index == 0 and state.num_cached_tokens is not None:    # its first token
            batch.cached[rid] = state.num_cached_tokens
    for rid, p in result.prompt_logprobs.items():      # rare: only requests that ask
        if requests[rid].reply_to:
            batch = batches.setdefault(requests[rid].reply_to, TokenBatch(instance=instance))
            batch.prompt.append(PromptLogprobsEvent(rid, p))
    return batches


def _forward_thread(device: str) -> None:
    """The start of the thread that runs every forward: its device current, its cores its own
    where `--cpus` gave them."""
    bind_device(device)
    pin_forward_thread()


class PlanLoop:
    """Rank 0's loop: plans in, tokens and results out."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, executor: Executor,
                 requests: Mapping[str, RequestView], plans_after: bytes | str,
                 run_id: str, device: str = "cpu", claim: Claim | None = None) -> None:
        """`plans_after`: the cursor into the plans stream of the Redis with `run_id`;
        `device`: the executor's (rank 0's), made current on the forward thread; `claim`:
        rank 0's (`claimed`), checked with each read of plans and each result sent."""
        self.redis, self.keys, self.executor, self.requests = redis, keys, executor, requests
        self.claim = claim
        self._plans_after = plans_after
        self._run_id = run_id
        # one thread runs every forward: the event loop keeps heartbeats and signals alive
        # while torch computes, and thread-local torch state (the current CUDA device) stays
        # on one thread
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward",
                                          initializer=_forward_thread, initargs=(device,))
        self.plan_wait = Stopwatch()
        self.busy = Stopwatch()
        # of `busy`, what the runner timed as its compute (each result's forward_ms, the cost
        # model's input); the rest is the hand-over to the forward thread and back (the GIL,
        # whenever the event loop holds it: docs/benchmarks.md#one-stream-served-where-the-gap-
        # to-in-process-goes), P/D's exposed sends and the token batches
        self.forward_s = 0.0
        self.publish = Stopwatch()
        # set by the forward thread as the model starts on a plan's inputs (or as it returns)
        self._handed_over = threading.Event()
        self.num_iterations = 0
        self._stats_at = 0.0
        self._stats_stale = False       # a result went without them since they were written
        self._last_step: int | None = None
        self._answered: dict[str, str] = {}
        self._replaced: set[str] = set()    # run ids of servers seen restarted away
        self._skipped = 0                   # plans of a server before it restarted

    async def run(self, stop: asyncio.Event) -> None:
        """Until `stop`: a plan that was read is always run and answered before returning.
        The read for the next plans goes out as the last one read starts to run, so a plan
        the scheduler sends meanwhile is here when the forward ends."""
        self.plan_wait.start()
        answering: asyncio.Task | None = None
        reading: asyncio.Task | None = None
        entries: deque = deque()
        try:
            while True:
                if not entries:
                    if reading is None:
                        if stop.is_set():
                            break
                        reading = asyncio.create_task(self._read_plans())
                    entries.extend(await reading)
                    reading = None
                    continue
                entry_id, fields, origin = entries.popleft()
                self._plans_after = entry_id
                plan, wire = self._plan_of(fields, origin.run_id)
                if plan is None:
                    continue
                if not entries and not stop.is_set():
                    reading = asyncio.create_task(self._read_plans())
                answering = await self._run_plan(plan, wire, entry_id, origin, answering,
                                                 stop)
        finally:
            if reading is not None:
                reading.cancel()
            if answering is not None:
                await answering
            self._thread.shutdown(wait=True)
            self.plan_wait.discard()

    async def _read_plans(self) -> list:
        """The next plans, each as (entry id, fields, _Origin)."""
        try:
            connections = connections_made(self.redis)
            pipe = self.redis.pipeline(transaction=False)
            pipe.info("server")
            pipe.xread({self.keys.plans: self._plans_after}, count=8, block=PLAN_BLOCK_MS)
            if self.claim is not None:      # as the read returns: no new plan once not ours
                self.claim.queue_check(pipe)
            info, reply, *held = await execute(pipe)
        except TRANSIENT as e:      # the loop reads again after a pause
            log.warning(redis_failure(e), op="read plans", error=str(e))
            await asyncio.sleep(0.5)
            return []
        if held:
            self.claim.checked(held[0])
        if info["run_id"] != self._run_id:
            # what was read came after an id of the old stream: read the new one from its start
            log.warning("redis restarted; reading its plans stream from the start",
                        old_run_id=self._run_id, run_id=info["run_id"])
            self._replaced.add(self._run_id)
            self._run_id, self._plans_after = info["run_id"], "0-0"
            # the stats hash went with the old server: write the counters again (idle, none
            # would until the next result, and /metrics would leave them out until then)
            self._stats_stale = True
            return []
        entries = [(entry_id, fields, _Origin(self._run_id, connections))
                   for _, entries in reply or [] for entry_id, fields in entries]
        if not entries and self._stats_stale:   # idle: the counters the last results left out
            try:
                pipe = self.redis.pipeline(transaction=False)
                queue_hset(pipe, self.claim, self.keys.stats, self.stats())
                written = await execute(pipe)
                self._stats_stale = False
            except TRANSIENT:
                pass
            else:
                if self.claim is not None:
                    self.claim.checked(written[0])
        return entries

    def _plan_of(self, fields: dict, run_id: str) -> tuple[IterationPlan | None, bytes]:
        """The plan of an entry read from the server with `run_id`, unless the scheduler sent
        it to another one: a persisted plan from before Redis restarted, run once already or
        given up on (the scheduler plans afresh after a restart)."""
        sent_to = fields.get(b"run_id", fields.get("run_id"))
        if sent_to is not None and stream_id_text(sent_to) != run_id:
            self._skipped += 1
            return None, b""
        if self._skipped:
            log.warning("plans sent before redis restarted skipped", skipped=self._skipped)
            self._skipped = 0
        try:
            return _decode_plan(fields)
        except ProtocolError as e:
            if sent_to is None:     # no scheduler's: the result of no plan waits on it
                log.error("undecodable entry in the plans stream skipped", error=str(e))
                return None, b""
            # skipped, its result would never come: the scheduler would wait for it forever
            raise PacerError(f"cannot read a plan the scheduler sent: {e}; the scheduler and "
                             "the workers must run the same version of pacer") from None

    async def _run_plan(self, plan: IterationPlan, wire: bytes, entry_id: bytes | str,
                        origin: _Origin, answering: asyncio.Task | None,
                        stop: asyncio.Event) -> asyncio.Task:
        """Run the plan; returns the task sending its result, once the previous plan's
        (`answering`) is sent. `wire`: the plan's bytes as they came from the plans stream;
        `origin`: where it came from (`_read_plans`)."""
        self.plan_wait.stop()
        self.busy.start()
        fresh = self._forget_stale(plan)
        loop = asyncio.get_running_loop()
        self._handed_over.clear()
        running = loop.run_in_executor(self._thread, self._execute, fresh,
                                       wire if fresh is plan else None)
        # the thread needs the GIL to build the inputs; were the loop to go on now, sending
        # the last result, that thread would wait for it (~1.8 ms of a 10 ms step, served one
        # stream): so the loop waits here, without the GIL, until the kernels run
        self._handed_over.wait(HAND_OVER_WAIT_S)
        result = await running
        # before the next plan runs
        batches = token_batches(result, self.requests, self.keys.instance)
        self.busy.stop()
        self.forward_s += (result.forward_ms or 0.0) / 1e3
        if answering is not None:
            await answering
        self.num_iterations += 1
        self.plan_wait.start()
        return asyncio.create_task(self._answer(plan.step, batches, result, entry_id,
                                                origin, stop))

    async def _answer(self, step: int, batches: dict[str, TokenBatch], result: StepResult,
                      entry_id: bytes | str, origin: _Origin,
                      stop: asyncio.Event) -> None:
        """Send the result of the plan `entry_id` of the Redis with run_id `origin.run_id`;
        noted as answered unless that Redis is gone."""
        run_id = origin.run_id
        self.publish.start()
        try:
            if run_id in self._replaced:
                raise _RedisReplaced()
            sent = await self._send(step, batches, result, entry_id, origin, stop)
        except _RedisReplaced:
            log.warning("redis restarted after a plan was read; its result is dropped",
                        step=step)
            sent = False
        except TRANSIENT as e:
            log.error("result not sent: the worker is stopping and redis does not answer",
                      step=step, error=str(e))
            sent = False
        self.publish.stop()
        if sent:
            self._answered = {"answered_run_id": run_id,
                              "answered_plan": stream_id_text(entry_id)}

    def _execute(self, plan: IterationPlan, wire: bytes | None) -> StepResult:
        """A TP group's rank 0 forwards the plan's bytes as they came (`wire`; None when
        the plan was changed here)."""
        try:
            if wire is not None and isinstance(self.executor, TPExecutor):
                return self.executor.execute(plan, wire)
            return self.executor.execute(plan)
        finally:
            self._handed_over.set()         # a plan that ran no forward ends the wait too

    def handed_over(self) -> None:
        """The runner's `on_forward`: the forward thread has built the iteration's inputs and
        starts its layers; the event loop may take the GIL for its own work from here on."""
        self._handed_over.set()

    def _forget_stale(self, plan: IterationPlan) -> IterationPlan:
        """A step that is not after the last one: a new scheduler, which knows nothing of
        the requests this runner still holds."""
        stale = self._last_step is not None and plan.step <= self._last_step
        self._last_step = plan.step
        if not stale or not self.requests:
            return plan
        log.warning("plan from a restarted scheduler; dropping the old requests",
                    step=plan.step, dropped=len(self.requests))
        return dataclasses.replace(
            plan, finished_request_ids=[*self.requests, *plan.finished_request_ids])

    async def _send(self, step: int, batches: dict[str, TokenBatch], result: StepResult,
                    entry_id: bytes | str, origin: _Origin, stop: asyncio.Event) -> bool:
        """Whether the result went out (not: its plan is behind the plans fence). Raises
        _RedisReplaced, or the Redis failure once the worker was told to stop STOP_RETRY_S
        ago (a worker orphaned with its Redis gone must exit)."""
        with_stats = time.monotonic() - self._stats_at >= STATS_INTERVAL_S
        if with_stats:
            self._stats_at = time.monotonic()
        self._stats_stale = not with_stats
        # a fresh pipeline each try: a failed execute() has emptied the last one; the
        # scheduler waits for this result, and skips a duplicate by its step
        return await retry_redis(
            lambda: self._send_once(batches, result, with_stats, entry_id, origin),
            f"send result of step {step}", log,
            before_retry=lambda: self._check_same_redis(step, origin.run_id),
            give_up=stopped_for(stop, STOP_RETRY_S))

    async def _send_once(self, batches: dict[str, TokenBatch], result: StepResult,
                         with_stats: bool, entry_id: bytes | str, origin: _Origin) -> bool:
        """One pipeline: the result script (`_queue_result`), and the stats when due.
        Another incarnation's claim of rank 0 stops the process (a rank paused past its TTL,
        a new one in its place); a plan at or before the plans fence (the scheduler gave it
        up: its group lost, a request of it maybe ended since) writes nothing: False.

        A connection made since the plan was read (`origin`) may have
        reached a Redis that restarted meanwhile, without a failure to warn of it: then the
        server's run_id is read after it, and what the send wrote to another server is
        taken back (its result entry, the progress records it made; its token events
        reached no client: the gateway ended those streams). No connection made since, no
        round trip: the send went to the plan's server, or failed."""
        pipe = self.redis.pipeline(transaction=False)
        progress = self._queue_result(pipe, batches, result, entry_id)
        if with_stats:      # fenced too: a stale rank's counters are not the holder's
            queue_hset(pipe, self.claim, self.keys.stats, self.stats())
        (written, value), *stats_written = await execute(pipe)
        if written == 0:
            self.claim.stop(value)
        if stats_written and self.claim is not None:
            self.claim.checked(stats_written[0])
        if written == 2:
            log.warning("result not sent: the scheduler gave its plan up (its worker group "
                        "was lost)", plan=stream_id_text(entry_id))
            return False
        if origin.connections is not None and \
                connections_made(self.redis) == origin.connections or \
                await redis_run_id(self.redis) == origin.run_id:
            return True
        self._replaced.add(origin.run_id)
        taken_back = self.redis.pipeline(transaction=False)
        taken_back.xdel(self.keys.results, value)
        if progress:
            taken_back.delete(*progress)
        await taken_back.execute()
        raise _RedisReplaced()

    async def _check_same_redis(self, step: int, run_id: str) -> None:
        """After a failed send: is Redis still the server the plan came from (`run_id`)? If
        not, the plan went with the old one and nobody waits for its result."""
        if (await self.redis.info("server"))["run_id"] != run_id:
            self._replaced.add(run_id)
            raise _RedisReplaced()

    def _queue_result(self, pipe, batches: dict[str, TokenBatch], result: StepResult,
                      entry_id: bytes | str) -> list[str]:
        """Queue the script that sends the result of the plan `entry_id` (`_SEND_RESULT`),
        fenced in the same command: one command, where one per token took 1.1-1.5 ms of the
        worker's Python per iteration at 64 streams against 0.3-0.4 ms. Each token's
        progress record is appended before the PUBLISHes (whatever a client saw is in the
        record); its TTL is refreshed at a multiple of PROGRESS_REFRESH_EVERY. Returns the
        records' keys."""
        keys: list[str] = []
        appends: list = []
        for batch in batches.values():
            for event in batch.events:
                keys.append(self.keys.progress(event.request_id))
                appends += [encode_progress(event.index, event.token_id),
                            int(event.index % PROGRESS_REFRESH_EVERY == 0)]
        claim = self.claim
        publishes = [item for channel, batch in batches.items()
                     for item in (channel, encode(batch))]
        fields = to_fields(StepResultMsg(result), worker=WORKER_ID)
        _SEND_RESULT.queue(
            pipe, (claim.key if claim else self.keys.claim_worker(0), self.keys.plans_fence,
                   self.keys.results, *keys),
            claim.incarnation if claim else "", stream_id_text(entry_id), PROGRESS_TTL_S,
            RESULTS_MAXLEN, len(batches), *appends, *publishes,
            *(item for pair in fields.items() for item in pair))
        return keys

    def answered(self) -> dict[str, str]:
        """The last plan whose result was sent: the Redis run_id and the plan's entry id (for
        the heartbeat: a scheduler that sees its plan answered without a result stops
        waiting)."""
        return self._answered

    def stats(self) -> dict[str, float]:
        return {"worker_plan_wait_seconds_total": round(self.plan_wait.total_s, 6),
                "worker_busy_seconds_total": round(self.busy.total_s, 6),
                "worker_forward_seconds_total": round(self.forward_s, 6),
                "worker_publish_seconds_total": round(self.publish.total_s, 6),
                "worker_iterations_total": self.num_iterations}


def _decode_plan(fields: dict) -> tuple[IterationPlan, bytes]:
    """The plan of a plans-stream entry and its encoded bytes; ProtocolError if it is not
    one."""
    msg = from_fields(fields)
    if not isinstance(msg, PlanMsg):
        raise ProtocolError(f"a {msg.KIND} message, not a plan")
    return msg.plan, message_bytes(fields)


def worker_heartbeat(rank: int, tp: int, num_kv_blocks: int, block_size: int,
                     loop: PlanLoop | None = None,
                     kv: Callable[[], dict | None] = lambda: None, role: str | None = None,
                     kv_progress: Callable[[], dict] = dict, identity: dict | None = None):
    """A heartbeat factory for one rank; rank 0's carries its wait/busy counters. `kv`: this
    rank's KV connector descriptor, once its runner has one; `role`: its instance's role, when
    stated (`pacer worker --role`; the scheduler refuses another); `kv_progress`: the K/V
    writes that may still land, and where (ModelRunner.kv_progress); `identity`: the model it
    serves (shared/model_source.py:model_identity; the scheduler refuses other weights)."""
    started_at = time.time()     # with the pid, tells a restarted rank from the one before

    def make() -> Heartbeat:
        extra = {"pid": os.getpid(), "started_at": started_at, "rank": rank, "tp": tp,
                 "num_kv_blocks": num_kv_blocks, "block_size": block_size}
        if role is not None:
            extra["role"] = role
        if identity is not None:
            extra.update(identity)
        if loop is not None:
            extra.update(loop.stats())
            extra.update(loop.answered())
        descriptor = kv()
        if descriptor is not None:
            extra["kv"] = descriptor
        extra.update(kv_progress())
        return Heartbeat("worker", str(rank), time.time(), extra)
    return make


# ---- start-up ----------------------------------------------------------------------------

async def serve_worker(redis: aioredis.Redis, keys: Keys, layout: EngineLayout, rank: int,
                       stop: asyncio.Event, tp_host: str = "127.0.0.1",
                       role: str | None = None) -> int:
    """Load this rank's model, then serve until stopped. Returns an exit code."""
    # two processes as one rank would both read its plans and publish their results
    engine = f"instance {keys.instance!r}" if keys.instance else "the colocated engine"
    async with claimed(redis, keys.claim_worker(rank), "worker", str(rank),
                       f"worker rank {rank} of {engine}",
                       "give each worker its own --rank (and --instance)") as claim:
        return await _serve_worker(redis, keys, layout, rank, stop, tp_host, role, claim)


async def _serve_worker(redis: aioredis.Redis, keys: Keys, layout: EngineLayout, rank: int,
                        stop: asyncio.Event, tp_host: str, role: str | None,
                        claim: Claim) -> int:
    tp = layout.args.tp
    identity = model_identity(layout.source, layout.args.load_format == "dummy")
    if rank > 0:
        built: list = []        # the follower's runner, once loaded: its KV descriptor
        beat = worker_heartbeat(rank, tp, layout.num_kv_blocks, layout.args.block_size,
                                kv=lambda: built[0].kv_descriptor() if built else None,
                                role=role, identity=identity,
                                kv_progress=lambda: built[0].kv_progress() if built else {})
        def loaded(runner) -> None:
            runner.fence_kv(claim)
            built.append(runner)
            freeze_heap()
        try:
            return await _with_heartbeat(claim, keys.hb_worker(rank), beat,
                                         serve_follower(redis, keys, layout, rank, stop,
                                                        on_runner=loaded))
        finally:
            for runner in built:
                runner.close()
    if tp > 1:
        try:
            executor = await start_rank0(redis, keys, layout, tp_host, stop)
        except GroupNotFormed:
            log.info("stopped before the tensor-parallel group formed")
            return 0
    else:
        executor = await asyncio.to_thread(on_device, layout.args.device, build_runner, layout,
                                           None, True)
    runner = executor.runner if isinstance(executor, TPExecutor) else executor
    runner.fence_kv(claim)
    try:
        if stop.is_set():
            return 0
        # read from where the stream ends *before* announcing ourselves: the scheduler sends
        # its first plan only after it saw our heartbeat, so that plan cannot be missed (the
        # run_id first: should Redis restart in between, the first read starts over)
        run_id = await redis_run_id(redis)
        runner.grammars.warm()
        loop = PlanLoop(redis, keys, executor, executor.requests,
                        await stream_tail_id(redis, keys.plans), run_id, runner.rc.device,
                        claim)
        runner.on_forward = loop.handed_over
        beat = worker_heartbeat(rank, tp, layout.num_kv_blocks, layout.args.block_size, loop,
                                kv=runner.kv_descriptor, role=role, identity=identity,
                                kv_progress=runner.kv_progress)
        freeze_heap()
        return await _with_heartbeat(claim, keys.hb_worker(rank), beat, loop.run(stop))
    finally:
        if tp > 1:
            await asyncio.to_thread(executor.shutdown)
        runner.close()


async def _with_heartbeat(claim: Claim, key: str, beat, work) -> int:
    """Run `work` with the rank's heartbeat at `key`, written while `claim` is this process's
    (a stale rank's beat named it again: the scheduler took it for a restart)."""
    heartbeat = essential_task(
        keep_heartbeat(claim.redis, key, beat, ttl_s=WORKER_HEARTBEAT_TTL_S, claim=claim),
        "heartbeat")
    log.info("worker ready", heartbeat_key=key)
    try:
        await work
        return 0
    finally:
        await cancel_tasks(heartbeat)
        await claim.clear(key)
