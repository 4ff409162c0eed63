"""Dropped connections and Redis restarts, step by step: the real gateway (HTTP, in-process),
the real scheduler service and worker rank 0's plan loop on a tiny random model, all in this
process, over a real redis-server that a test kills (-9) and starts again on the same port,
empty, as `pacer up` does.

A gate between the plan loop and the model holds one plan, so that a connection can be
dropped, or Redis restarted, at a known point: while a plan runs. Each test first streams
one undisturbed completion as its reference.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
import pytest
import redis

from gateway.app import serve as serve_gateway
from gateway.config import GatewayConfig
from gateway.streams import TokenRouter
from gpu_worker.service import PlanLoop, worker_heartbeat
from redis.asyncio.client import Pipeline

from scheduler_svc import takeover
from scheduler_svc.recovery import Recovery
from scheduler_svc.service import SchedulerServiceConfig
from scheduler_svc.service import serve as serve_scheduler
from scheduler_svc.workers import WorkerWatch
from services.engine import LLMEngine
from shared.lifecycle import (cancel_tasks, connect_redis, keep_heartbeat, redis_run_id,
                                stream_id_text, stream_tail_id)
from scheduler_svc.core import Scheduler
from shared.config import SchedulerConfig
from shared.engine_args import EngineArgs
from shared.keys import WORKER_HEARTBEAT_TTL_S, Keys
from shared.plan import IterationPlan, StepResult
from shared.protocol import Heartbeat, encode, from_fields
from tests.helpers_tiny_model import write_tiny_llama
from tests.redis_fixture import start_redis, stop_redis
from tests.served_fixture import API_KEY
from tests.sse_client import StreamResult, stream_completion

KEYS = Keys()
MODEL_NAME = "tiny"
MAX_TOKENS = 24
DEADLINE_S = 60.0        # a stream open this long hangs: the failure these tests look for
FAR_FUTURE_ID = "9999999999999-0"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


class Redis:
    """A redis-server on a fixed port that can be restarted: empty, or with what it had, given
    `persist_dir` (an append-only file)."""

    def __init__(self, persist_dir: str | None = None) -> None:
        self.persist_dir = persist_dir
        self.proc, self.url = start_redis(None, persist_dir)
        self.port = urlsplit(self.url).port

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)

    def restart(self) -> None:
        stop_redis(self.proc)
        self.proc, _ = start_redis(self.port, self.persist_dir)

    def stop(self) -> None:
        stop_redis(self.proc)


@pytest.fixture
def server():
    r = Redis()
    try:
        yield r
    finally:
        r.stop()


class Gate:
    """The executor of the plan loop: the tiny model's runner, except that once armed it
    holds the next plan that computes tokens until released (it runs in the loop's thread)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.requests = runner.requests
        self._armed = False
        self.delay_s = 0.0          # each plan takes this much longer (a slow model)
        self._held = threading.Event()
        self._release = threading.Event()

    def execute(self, plan: IterationPlan) -> StepResult:
        if self._armed and plan.num_scheduled_tokens:
            self._armed = False
            self._held.set()
            self._release.wait(DEADLINE_S)
        time.sleep(self.delay_s)
        return self.runner.execute(plan)

    async def hold_next_plan(self) -> None:
        """Arm, and return once the plan loop is inside the next plan."""
        self._held.clear()
        self._release.clear()
        self._armed = True
        assert await asyncio.to_thread(self._held.wait, DEADLINE_S), "no plan came"

    def release(self) -> None:
        self._release.set()


class Worker:
    """Rank 0's plan loop over the gate; `stop()` lets it answer what it read and return,
    `start(after)` runs a new one from that plans-stream cursor (a worker that paused)."""

    def __init__(self, redis_client, gate: Gate) -> None:
        self.redis, self.gate = redis_client, gate
        self.loop: PlanLoop | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self, after: bytes | str | None = None) -> None:
        run_id = await redis_run_id(self.redis)
        if after is None:
            after = await stream_tail_id(self.redis, KEYS.plans)
        self.loop = PlanLoop(self.redis, KEYS, self.gate, self.gate.requests, after, run_id)
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self.loop.run(self._stop))

    async def stop(self) -> str:
        """Returns the entry id of the last plan answered."""
        self._stop.set()
        await self._task
        return self.loop.answered()["answered_plan"]

    def stats(self) -> dict:
        return {} if self.loop is None else {**self.loop.stats(), **self.loop.answered()}


@dataclass
class System:
    base_url: str
    gate: Gate
    worker: Worker
    engine: LLMEngine               # the tiny model's, whose core the scheduler serves
    scheduler: asyncio.Task         # the scheduler service; returns once `stop` is set
    stop: asyncio.Event


@asynccontextmanager
async def running(server: Redis, model: str,
                  scheduler: SchedulerServiceConfig | None = None) -> AsyncIterator[System]:
    """Gateway, scheduler and worker rank 0 (with its heartbeat) against `server`."""
    engine = LLMEngine(EngineArgs(model=model, dtype="float32", num_kv_blocks=64), progress=False)
    gate = Gate(engine.runner)
    scheduler_redis, worker_redis = await connect_redis(server.url), await connect_redis(server.url)
    worker = Worker(worker_redis, gate)
    await worker.start()
    rank_0 = worker_heartbeat(0, 1, engine.layout.num_kv_blocks, engine.args.block_size)

    def beat() -> Heartbeat:          # what serve_worker's heartbeat says, of whichever loop
        msg = rank_0()
        return Heartbeat(msg.service, msg.id, msg.time, {**msg.extra, **worker.stats()})

    stop = asyncio.Event()
    tasks = [asyncio.create_task(keep_heartbeat(worker_redis, KEYS.hb_worker(0), beat,
                                                   ttl_s=WORKER_HEARTBEAT_TTL_S)),
             asyncio.create_task(serve_scheduler(
                 scheduler_redis, KEYS, engine.scheduler,
                 scheduler or SchedulerServiceConfig(scheduler_id="scheduler-0"), stop))]
    config = GatewayConfig(port=0, redis_url=server.url, model=model,
                           served_model_name=MODEL_NAME, api_key=API_KEY)
    try:
        async with serve_gateway(config) as base_url:
            yield System(base_url, gate, worker, engine, tasks[1], stop)
    finally:
        gate.release()
        stop.set()
        await worker.stop()
        await cancel_tasks(*tasks)
        await scheduler_redis.aclose()
        await worker_redis.aclose()


def body(i: int) -> dict:
    return {"model": MODEL_NAME, "prompt": f"the story of number {i} is", "temperature": 0,
            "max_tokens": MAX_TOKENS, "ignore_eos": True}


async def complete(s: System, n: int, on_first_chunks=None) -> list[StreamResult]:
    """`n` concurrent streams (prompt i for stream i); `on_first_chunks()` is awaited once
    every stream has two chunks."""
    progress = [0] * n
    started = asyncio.Event()

    def seen(i: int, result: StreamResult) -> None:
        progress[i] = len(result.chunk_times)
        if min(progress) >= 2:
            started.set()

    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(stream_completion(
            session, s.base_url, body(i), DEADLINE_S, on_chunk=lambda r, i=i: seen(i, r)))
            for i in range(n)]
        if on_first_chunks is not None:
            await asyncio.wait_for(started.wait(), DEADLINE_S)
            await on_first_chunks()
        return await asyncio.gather(*tasks)


def assert_complete(results: list[StreamResult], reference: list[str]) -> None:
    for i, (r, expected) in enumerate(zip(results, reference)):
        assert r.status == 200 and r.error is None, (i, r)
        assert r.done and r.finish_reason == "length", (i, r)
        assert r.text == expected, (i, r.text, expected)


async def test_a_result_whose_connection_was_dropped_is_sent_again(server, tiny_model):
    """Redis closes every client connection (CLIENT KILL) while a plan runs: the worker's
    pooled connection is dead when it sends the result, and the send must be repeated in
    full, or the scheduler waits for that result forever."""
    async with running(server, tiny_model) as s:
        reference = [r.text for r in await complete(s, 2)]

        async def drop_connections() -> None:
            await s.gate.hold_next_plan()
            with server.client() as admin:
                assert admin.client_kill_filter(_type="normal", skipme=True) > 0
            s.gate.release()

        assert_complete(await complete(s, 2, drop_connections), reference)


async def test_requests_delivered_in_a_reply_that_was_lost_are_read_back(server, tiny_model,
                                                                         monkeypatch):
    """The connection breaks after Redis ran the scheduler's intake and before its reply
    came: the new requests that reply delivered are the scheduler's now (pending), and Redis
    never delivers them as new again. The retried intake reads them back from the
    scheduler's own history; nothing else would before the takeover's idle claim (made
    never here, so that a miss hangs the streams)."""
    monkeypatch.setattr(takeover, "CLAIM_IDLE_MS", 3_600_000)
    async with running(server, tiny_model) as s:
        reference = [r.text for r in await complete(s, 2)]
        lost: list = []
        execute = Pipeline.execute

        async def lose_a_reply(pipe, raise_on_error: bool = True):
            names = [args[0] for args, _ in pipe.command_stack]
            replies = await execute(pipe, raise_on_error)
            if not lost and "XREADGROUP" in names and replies[names.index("XREADGROUP")]:
                lost.append(replies[names.index("XREADGROUP")])
                raise redis.exceptions.ConnectionError("the reply was lost")
            return replies
        monkeypatch.setattr(Pipeline, "execute", lose_a_reply)
        assert_complete(await complete(s, 2), reference)
        assert lost


async def test_after_a_redis_restart_the_streams_end_with_an_error_and_new_ones_complete(
        server, tiny_model):
    """Redis restarts while a plan runs: the streams in flight end with an error event,
    and streams started afterwards (as many as before, so the gateway's pool holds a
    connection to the old server for each) complete exactly."""
    async with running(server, tiny_model) as s:
        await restart_while_a_plan_runs(s, server, [r.text for r in await complete(s, 4)])


async def test_plans_of_a_restarted_redis_are_read_though_their_ids_are_lower(
        server, tiny_model):
    """The old server's plans stream had ids from a clock ahead of the new one's (an XREAD
    after such an id waits forever on the new stream): the worker reads the new server's
    plans from the start all the same."""
    with server.client() as admin:
        admin.xadd(KEYS.plans, {"m": b"not a plan"}, id=FAR_FUTURE_ID)
    async with running(server, tiny_model) as s:
        await restart_while_a_plan_runs(s, server, [r.text for r in await complete(s, 1)])


async def test_after_a_restart_of_a_redis_that_persists_no_old_plan_runs_again(
        tmp_path, tiny_model):
    """Redis keeps its keys across a restart (AOF): the plans stream still holds every plan
    sent before it. Worker rank 0 must not run them again (it did, from the stream's start:
    tokens of long-finished requests republished, their progress records made again, new
    requests queued behind them); new streams complete exactly."""
    server = Redis(persist_dir=str(tmp_path))
    try:
        async with running(server, tiny_model) as s:
            reference = [r.text for r in await complete(s, 2)]
            server.restart()
            with server.client() as admin:
                assert admin.xlen(KEYS.plans) > 0               # the old plans are back
            await serving_again(s)
            assert_complete(await complete(s, 2), reference)
            with server.client() as admin:
                assert admin.keys(KEYS.progress("*")) == []     # no old request ran again
    finally:
        server.stop()


async def test_worker_counters_are_written_again_to_a_redis_that_restarted(server, tiny_model):
    """Redis restarts (empty) while nothing runs: rank 0's counters in the stats hash (in
    /metrics as pacer:worker_*) come back without waiting for a request, as the scheduler's
    do; they were gone until the next one."""
    def iterations() -> float:
        with server.client() as admin:
            return float(admin.hget(KEYS.stats, "worker_iterations_total") or 0)

    async def until_written(what: str) -> None:
        end = time.monotonic() + DEADLINE_S
        while iterations() != s.worker.loop.num_iterations:
            assert time.monotonic() < end, f"{what}: {iterations()} written, " \
                                           f"{s.worker.loop.num_iterations} run"
            await asyncio.sleep(0.1)

    async with running(server, tiny_model) as s:
        await complete(s, 1)
        await until_written("rank 0's counters after the request")   # all of them, idle
        server.restart()
        await until_written("rank 0's counters on the new server")


async def test_the_next_plans_result_is_not_sent_to_a_redis_that_restarted(server, tiny_model):
    """With overlap, rank 0 has read the next plan when Redis restarts (empty) while a plan
    runs. The running plan's result is dropped (its send fails and finds another server);
    the next one's must be too, though its send finds a fresh connection: sent, it left
    progress records of the old server's requests on the new one (for an hour) and a result
    nobody reads."""
    async with running(server, tiny_model) as s:
        reference = [r.text for r in await complete(s, 2)]

        async def restart() -> None:
            await s.gate.hold_next_plan()
            with server.client() as admin:
                await _plan_after(admin, stream_id_text(admin.xrevrange(KEYS.plans, count=1)[0][0]))
            await asyncio.sleep(0.2)            # the next plan is read meanwhile
            server.restart()
            s.gate.release()

        for i, r in enumerate(await complete(s, 2, restart)):
            assert r.done and r.error is not None, (i, r)
        await serving_again(s)
        with server.client() as admin:
            assert admin.keys(KEYS.progress("*")) == []
            planned = {from_fields(f).plan.step for _, f in admin.xrange(KEYS.plans)}
            answered = {from_fields(f).result.step for _, f in admin.xrange(KEYS.results)}
            assert answered <= planned, answered - planned   # no result of the old server's


async def test_streams_complete_across_a_redis_out_of_memory_for_a_moment(server, tiny_model):
    """Redis refuses every write (maxmemory, noeviction) while a plan runs, for a second:
    worker rank 0 and the scheduler retry as they would an unreachable server (rank 0's
    plan loop died of the unhandled error, the scheduler exited), and the streams complete
    exactly once memory is back."""
    async with running(server, tiny_model) as s:
        reference = [r.text for r in await complete(s, 2)]

        async def out_of_memory() -> None:
            await s.gate.hold_next_plan()
            with server.client() as admin:
                admin.config_set("maxmemory", "1")
                s.gate.release()
                await asyncio.sleep(1.0)
                admin.config_set("maxmemory", "0")

        assert_complete(await complete(s, 2, out_of_memory), reference)


async def test_a_password_set_while_serving_is_named_and_serving_resumes_once_lifted(
        server, tiny_model):
    """An operator sets requirepass while pacer serves, and its connections are cut: every new
    connection is refused. /health and a refused request must name the credentials (they said
    "Redis is unreachable" and "Redis is away", the services' logs "redis unavailable"), and
    streams complete exactly once the password is lifted."""
    async with running(server, tiny_model) as s:
        reference = [r.text for r in await complete(s, 1)]
        with server.client() as admin:
            admin.config_set("requirepass", "set-by-an-operator")     # admin stays let in
            admin.client_kill_filter(_type="pubsub")
            admin.client_kill_filter(_type="normal", skipme=True)
            async with aiohttp.ClientSession() as session:
                end = time.monotonic() + DEADLINE_S
                while True:
                    async with session.get(f"{s.base_url}/health") as r:
                        health = await r.text()
                    if "credentials" in health:
                        break
                    assert time.monotonic() < end, health
                    await asyncio.sleep(0.1)
                assert r.status == 503
                async with session.post(f"{s.base_url}/v1/completions", json=body(0),
                                        headers={"Authorization": f"Bearer {API_KEY}"}) as r:
                    assert r.status == 503
                    refused = (await r.json())["error"]["message"]
                assert "Redis refuses this client's credentials" in refused, refused
            admin.config_set("requirepass", "")
        await serving_again(s)
        assert_complete(await complete(s, 1), reference)


@pytest.mark.parametrize("lose", ["destroy the group", "delete the stream"])
async def test_a_consumer_group_lost_on_a_live_redis_runs_no_old_request_again(
        server, tiny_model, lose):
    """An operator destroys the requests' consumer group (or deletes the stream; an
    `allkeys-*` policy evicts it) while streams run, Redis staying up. Those streams end
    with an error that says so (it said "Redis restarted"); the group made again must not
    deliver the requests the stream still holds, long finished, as new (made from 0, it did:
    each ran again to its end for nobody); new streams complete exactly."""
    from structlog.testing import capture_logs
    async with running(server, tiny_model) as s:
        reference = [r.text for r in await complete(s, 2)]
        with server.client() as admin:
            old = {from_fields(f).request_id for _, f in admin.xrange(KEYS.requests)}

        async def lose_the_group() -> None:
            with server.client() as admin:
                if lose == "destroy the group":
                    admin.xgroup_destroy(KEYS.requests, KEYS.requests_group)
                else:
                    admin.delete(KEYS.requests)

        with capture_logs() as logs:
            for i, r in enumerate(await complete(s, 2, lose_the_group)):
                assert r.done and r.error is not None, (i, r)
                said = r.error["message"]
                assert "was deleted or evicted" in said and "restarted" not in said, said
            await serving_again(s)
            assert_complete(await complete(s, 2), reference)
        admitted = [e["request_id"] for e in logs if e["event"] == "request admitted to queue"]
        assert len(admitted) == len(set(admitted)), admitted     # none admitted twice
        assert len(old) == 2 and not old & set(admitted), (old, admitted)


async def test_a_worker_told_to_stop_gives_up_a_redis_that_is_gone(server, tiny_model):
    """`pacer up` is killed: every child gets SIGTERM at once, and Redis exits with them.
    Rank 0, told to stop with a result still to send, must give up and return (it retried
    forever, an orphan logging "redis unavailable")."""
    async with running(server, tiny_model) as s:
        async def stop_with_redis() -> None:
            await s.gate.hold_next_plan()
            server.stop()
            stopping = asyncio.create_task(s.worker.stop())
            s.gate.release()
            await asyncio.wait_for(stopping, DEADLINE_S)

        await complete(s, 1, stop_with_redis)


async def test_a_scheduler_told_to_stop_gives_up_a_redis_that_is_gone(server):
    """The scheduler of a killed `pacer up`: stopped while it waits on a Redis that is gone
    (here for its workers, before any drain began), it must exit, not retry forever."""
    core = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4,
                                     num_kv_blocks=8, block_size=4, max_model_len=64))
    redis_client, stop = await connect_redis(server.url), asyncio.Event()
    serving = asyncio.create_task(serve_scheduler(
        redis_client, KEYS, core, SchedulerServiceConfig("s", drain_timeout_s=0.5), stop))
    try:
        with server.client() as admin:      # waiting for workers
            while not admin.keys(KEYS.hb_scheduler("*")):
                await asyncio.sleep(0.05)
        server.stop()
        await asyncio.sleep(1.0)            # it retries now
        stop.set()
        await asyncio.wait_for(serving, DEADLINE_S)         # returns, whatever its code
    finally:
        serving.cancel()
        await redis_client.aclose()


async def serving_again(s: System) -> None:
    """Once a stream completes again after a restart (those sent before the gateway
    noticed it end with an error)."""
    end = time.monotonic() + DEADLINE_S
    while (await complete(s, 1))[0].error is not None:
        assert time.monotonic() < end, "not serving again after the restart"
        await asyncio.sleep(0.1)


async def restart_while_a_plan_runs(s: System, server: Redis, reference: list[str]) -> None:
    """As many streams as `reference` has texts; Redis restarts while a plan of theirs runs:
    each must end with an error event after a prefix of its text; then as many new streams
    must complete exactly."""
    async def restart() -> None:
        await s.gate.hold_next_plan()
        server.restart()
        s.gate.release()

    for i, r in enumerate(await complete(s, len(reference), restart)):
        assert r.done and r.error is not None, (i, r)
        assert reference[i].startswith(r.text), (i, r.text)
    assert_complete(await complete(s, len(reference)), reference)


async def test_a_redis_restart_while_the_scheduler_waits_for_the_workers_is_survived(
        server, tiny_model, monkeypatch):
    """The worker group looks lost (its heartbeat hidden) while a plan runs, and Redis goes
    away and comes back empty while the scheduler waits for the group: that second
    interruption is recovered from too (it was raised out of the loop and ended the
    scheduler). The streams end with an error; new ones complete exactly."""
    waiting = asyncio.Event()
    after_workers_lost = Recovery._after_workers_lost

    async def noted(self, *args):
        waiting.set()
        return await after_workers_lost(self, *args)
    monkeypatch.setattr(Recovery, "_after_workers_lost", noted)
    async with running(server, tiny_model) as s:
        reference = [r.text for r in await complete(s, 2)]

        async def hide_the_worker() -> None:
            with server.client() as admin:
                while True:
                    admin.delete(KEYS.hb_worker(0))
                    await asyncio.sleep(0.02)

        async def restart() -> None:
            await s.gate.hold_next_plan()
            hiding = asyncio.create_task(hide_the_worker())
            await asyncio.wait_for(waiting.wait(), DEADLINE_S)
            hiding.cancel()
            stop_redis(server.proc)
            await asyncio.sleep(1.0)    # down a while: the scheduler's reads fail meanwhile
            server.proc, _ = start_redis(server.port)
            s.gate.release()

        for i, r in enumerate(await complete(s, 2, restart)):
            assert r.done and r.error is not None, (i, r)
        await serving_again(s)
        assert_complete(await complete(s, 2), reference)


async def test_a_plan_no_worker_read_and_gone_from_the_stream_is_computed_again(
        server, tiny_model):
    """The worker pauses after a plan; the next plan is deleted from the stream before it
    reads it. The scheduler must notice that the plan it waits for is gone (a result can
    never come), recompute the running request, and the stream complete exactly."""
    async with running(server, tiny_model) as s:
        reference = [r.text for r in await complete(s, 1)]

        async def pause_and_lose_the_next_plan() -> None:
            await s.gate.hold_next_plan()
            paused = asyncio.create_task(s.worker.stop())
            s.gate.release()
            last_read = await paused
            with server.client() as admin:
                admin.xdel(KEYS.plans, await _plan_after(admin, last_read))
            await s.worker.start(after=last_read)

        assert_complete(await complete(s, 1, pause_and_lose_the_next_plan), reference)


async def _plan_after(admin: redis.Redis, entry_id: str) -> bytes:
    """The id of the first plan after `entry_id`, once the scheduler sent it."""
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        newer = admin.xrange(KEYS.plans, min=f"({entry_id}", count=1)
        if newer:
            return newer[0][0]
        await asyncio.sleep(0.02)
    raise AssertionError(f"no plan after {entry_id}")


def test_a_stream_being_submitted_outlives_the_end_of_the_old_servers_streams():
    """When the gateway learns that Redis restarted, it ends the streams the old server
    took; one whose submission has not yet said which server took it is left alone (its
    submission's answer decides)."""
    router = TokenRouter(None, "channel")
    old, new, submitting = (router.open(rid) for rid in ("old", "new", "submitting"))
    old.redis_run_id, new.redis_run_id = "run-a", "run-b"
    assert router.fail_all("restarted", keep_run_id="run-b") == 1        # old
    submitting.redis_run_id = "run-b"
    assert router.fail_all("restarted", keep_run_id="run-b") == 1        # old
    submitting.redis_run_id = None
    assert router.fail_all("unreachable") == 3          # no token can arrive: every one


def test_rank_0s_heartbeat_tells_which_plans_it_answered():
    watch = WorkerWatch(KEYS, tp=1)

    def beat(extra: dict) -> list[bytes]:
        return [encode(Heartbeat("worker", "0", time.time(), {"pid": 1, **extra}))]

    answered = beat({"answered_run_id": "run-a", "answered_plan": "1700000000000-5"})
    assert watch.answered(answered, "run-a", b"1700000000000-5")
    assert watch.answered(answered, "run-a", "1699999999999-9")
    assert not watch.answered(answered, "run-a", "1700000000000-6")
    assert not watch.answered(answered, "run-b", "1700000000000-5")   # another Redis
    assert not watch.answered(beat({}), "run-a", "1-0")               # nothing answered yet
    assert not watch.answered([None], "run-a", "1-0")


async def test_one_script_call_records_every_tokens_progress_and_its_ttl():
    """Rank 0 appends each token to its request's progress record in one script call per
    iteration; the TTL is set at output index 0 and every PROGRESS_REFRESH_EVERY tokens. A
    plan at or before the plans fence writes nothing."""
    import redis.asyncio as aioredis
    from types import SimpleNamespace
    from gpu_worker.service import PROGRESS_REFRESH_EVERY
    from shared.keys import PROGRESS_TTL_S
    from shared.progress import decode_progress
    from shared.plan import StepResult
    from shared.protocol import TokenBatch, TokenEvent
    from shared.scripts import execute
    proc, url = start_redis()
    client = aioredis.Redis.from_url(url)

    def queue(pipe, batches: list[TokenBatch]) -> None:
        PlanLoop._queue_result(loop, pipe, {f"channel-{i}": b for i, b in enumerate(batches)},
                               StepResult(1, {}), "1-0")
    try:
        keys = Keys()
        loop = SimpleNamespace(keys=keys, claim=None)
        for index in range(PROGRESS_REFRESH_EVERY + 2):
            batches = [TokenBatch([TokenEvent("a", index, 100 + index, None, None)]),
                       TokenBatch([TokenEvent("b", index, 200 + index, None, None)])]
            pipe = client.pipeline(transaction=False)
            queue(pipe, batches)
            await execute(pipe)
            if index == 0:
                assert 0 < await client.ttl(keys.progress("a")) <= PROGRESS_TTL_S
                await client.persist(keys.progress("a"))          # so a refresh shows
            if index == 1:
                assert await client.ttl(keys.progress("a")) == -1     # no refresh at 1
        assert await client.ttl(keys.progress("a")) > 0           # refreshed at 64
        n = PROGRESS_REFRESH_EVERY + 2
        assert decode_progress(await client.get(keys.progress("a"))) == [100 + i for i in range(n)]
        assert decode_progress(await client.get(keys.progress("b"))) == [200 + i for i in range(n)]
        # a record created at any other index (a result sent again after its request finished
        # and its record went) gets its TTL too
        pipe = client.pipeline(transaction=False)
        queue(pipe, [TokenBatch([TokenEvent("c", 5, 7, None, None)])])
        await execute(pipe)
        assert 0 < await client.ttl(keys.progress("c")) <= PROGRESS_TTL_S
        # a plan at or before the plans fence (the scheduler gave it up) writes nothing
        await client.set(keys.plans_fence, "1-0")
        pipe = client.pipeline(transaction=False)
        queue(pipe, [TokenBatch([TokenEvent("d", 0, 7, None, None)])])
        assert await execute(pipe) == [[2, b"1-0"]]
        assert not await client.exists(keys.progress("d"))
    finally:
        await client.aclose()
        stop_redis(proc)
