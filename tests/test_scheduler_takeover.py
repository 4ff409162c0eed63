"""Take-over by another scheduler replica, with real processes: a redis-server, worker rank 0,
scheduler A (consumer name A) and the gateway, each its own `pacer` process, on a tiny random
model. A few greedy streams run; scheduler A is killed (-9) mid-stream and never restarted;
scheduler B, with another consumer name, is started and must XAUTOCLAIM A's pending requests
(after `CLAIM_IDLE_MS`) and finish them from their progress records.

Every stream must end with exactly the tokens of an undisturbed run. The test also listens to
the gateway's token channel itself, so it sees the raw token events (their output `index`, the
gateway's per-request sequence numbers) before the gateway drops duplicates: each index must
come exactly once. `pytest -s` prints how long the take-over took.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import aiohttp
import pytest
import redis
import redis.asyncio as aioredis

from scheduler_svc.takeover import CLAIM_IDLE_MS
from scheduler_svc.workers import incarnation
from shared.keys import HEARTBEAT_TTL_S, Keys
from shared.protocol import FinishEvent, Heartbeat, TokenBatch, decode, encode, heartbeat_of
from tests.helpers_tiny_model import write_tiny_llama
from tests.redis_fixture import free_port, start_redis, stop_redis
from tests.served_fixture import API_KEY, ROOT, Served, wait_for, wait_healthy
from tests.sse_client import StreamResult, stream_completion

KEYS = Keys()
MODEL_NAME = "tiny"
GATEWAY_ID = "gateway-takeover"
SCHEDULER_A, SCHEDULER_B = "scheduler-a", "scheduler-b"
NUM_STREAMS = 4
MAX_TOKENS = 200
KILL_AFTER_CHUNKS = 4          # every stream has streamed this much before the kill
STREAM_DEADLINE_S = 90.0       # a stream open this long hangs: the failure looked for
ENGINE_FLAGS = ["--num-kv-blocks", "128", "--max-model-len", "512",
                "--dtype", "float32", "--quantization", "none"]   # batch-invariant (see test_chaos.py)


@dataclass
class Process:
    name: str
    proc: subprocess.Popen
    log_path: str

    def log_tail(self, chars: int = 3000) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f"--- {self.name} ---\n{f.read()[-chars:]}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class System:
    redis_url: str
    model: str
    logs_dir: str
    gateway: Served | None = None
    processes: dict[str, Process] = field(default_factory=dict)

    def start(self, name: str, *argv: str) -> Process:
        log_path = os.path.join(self.logs_dir, f"{name}.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "services.cli", *argv],
                                    cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        self.processes[name] = Process(name, proc, log_path)
        return self.processes[name]

    def start_scheduler(self, scheduler_id: str) -> Process:
        return self.start(scheduler_id, "scheduler", "--model", self.model, *ENGINE_FLAGS,
                          "--redis-url", self.redis_url, "--scheduler-id", scheduler_id)

    def logs(self) -> str:
        return "\n".join(p.log_tail() for p in self.processes.values())


@pytest.fixture(scope="module")
def system(tmp_path_factory) -> Iterator[System]:
    """Redis, worker rank 0, scheduler A and the gateway, each a process; /health is 200."""
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    logs_dir = str(tmp_path_factory.mktemp("takeover-logs"))
    redis_proc, redis_url = start_redis()
    port = free_port()
    system = System(redis_url, model, logs_dir)
    try:
        system.start("worker", "worker", "--rank", "0", "--model", model, *ENGINE_FLAGS,
                     "--redis-url", redis_url)
        system.start_scheduler(SCHEDULER_A)
        gateway = system.start("gateway", "gateway", "--port", str(port), "--redis-url",
                               redis_url, "--model", model, "--served-model-name", MODEL_NAME,
                               "--max-model-len", "512", "--gateway-id", GATEWAY_ID,
                               "--api-key", API_KEY)
        system.gateway = Served(f"http://127.0.0.1:{port}", redis_url, gateway.proc,
                                gateway.log_path)
        try:
            wait_healthy(system.gateway, 120.0)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\n{system.logs()}") from None
        yield system
    finally:
        # the gateway first, so that the scheduler is not left with live clients to drain
        for name in ("gateway", SCHEDULER_B, SCHEDULER_A, "worker"):
            if name in system.processes:
                system.processes[name].stop()
        stop_redis(redis_proc)


def body(i: int) -> dict:
    return {"model": MODEL_NAME, "prompt": f"the story of number {i} is", "temperature": 0,
            "max_tokens": MAX_TOKENS, "ignore_eos": True}


class TokenTap:
    """The gateway's token channel as the gateway receives it: every token event's
    (index, token id) per request, duplicates included."""

    def __init__(self, redis_url: str) -> None:
        self.redis = aioredis.Redis.from_url(redis_url)
        self.pubsub = self.redis.pubsub()
        self.events: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self.finished: dict[str, FinishEvent] = {}
        self.finishes: dict[str, int] = defaultdict(int)      # finish events per request
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> "TokenTap":
        await self.pubsub.subscribe(KEYS.tokens(GATEWAY_ID))
        self._task = asyncio.create_task(self._listen())
        return self

    async def _listen(self) -> None:
        async for message in self.pubsub.listen():
            if message["type"] != "message":
                continue
            msg = decode(message["data"])
            if isinstance(msg, TokenBatch):
                for e in msg.events:
                    self.events[e.request_id].append((e.index, e.token_id))
            elif isinstance(msg, FinishEvent):
                self.finished.setdefault(msg.request_id, msg)
                self.finishes[msg.request_id] += 1

    async def __aexit__(self, *exc) -> None:
        await asyncio.sleep(0.2)          # the last events published with the finish event
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self.pubsub.aclose()
        await self.redis.aclose()

    def tokens(self, request_id: str) -> list[int]:
        return [token for _, token in sorted(self.events[request_id])]


async def run_streams(s: System, kill=None) -> tuple[list[StreamResult], TokenTap, float]:
    """NUM_STREAMS streams at once; `kill(tap)` (returning when it happened, monotonic) runs
    once every stream has KILL_AFTER_CHUNKS chunks."""
    progress = [0] * NUM_STREAMS
    started = asyncio.Event()
    killed_at = 0.0

    def seen(i: int, result: StreamResult) -> None:
        progress[i] = len(result.chunk_times)
        if min(progress) >= KILL_AFTER_CHUNKS:
            started.set()

    async with TokenTap(s.redis_url) as tap, aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(stream_completion(
            session, s.gateway.base_url, body(i), STREAM_DEADLINE_S,
            on_chunk=lambda r, i=i: seen(i, r))) for i in range(NUM_STREAMS)]
        if kill is not None:
            await asyncio.wait_for(started.wait(), STREAM_DEADLINE_S)
            killed_at = await kill(tap)
        results = await asyncio.gather(*tasks)
    return results, tap, killed_at


@contextlib.asynccontextmanager
async def open_stream(s: System, session: aiohttp.ClientSession, i: int):
    """A stream of `body(i)`, once its first token came: (the response, the request id).
    Leaving closes the connection: the gateway sends the abort."""
    async with session.post(f"{s.gateway.base_url}/v1/completions",
                            json={**body(i), "stream": True},
                            headers={"Authorization": f"Bearer {API_KEY}"}) as resp:
        assert resp.status == 200
        first = await resp.content.readline()      # data: {...} of the first token
        yield resp, json.loads(first.decode()[len("data: "):])["id"]


def assert_complete(results: list[StreamResult], tap: TokenTap, s: System) -> None:
    """Every stream ended normally with MAX_TOKENS tokens, each index published once."""
    for i, r in enumerate(results):
        assert r.error is None and r.done and r.finish_reason == "length", (i, r, s.logs())
        indices = sorted(index for index, _ in tap.events[r.response_id])
        assert indices == list(range(MAX_TOKENS)), (i, indices)
        finish = tap.finished[r.response_id]
        assert finish.num_output_tokens == MAX_TOKENS, (i, finish)


def pending(s: System) -> dict[str, int]:
    """Unacked request entries per consumer of the group."""
    r = redis.Redis.from_url(s.redis_url)
    try:
        return {c["name"].decode(): c["pending"]
                for c in r.xinfo_consumers(KEYS.requests, KEYS.requests_group)}
    finally:
        r.close()


def test_a_second_scheduler_under_a_running_ones_name_refuses_to_start(system: System):
    """Two schedulers under one consumer name would each take the other's requests for a
    dead scheduler's (and share one heartbeat): the second one on the host stops at once."""
    namesake = system.start("namesake", "scheduler", "--model", system.model, *ENGINE_FLAGS,
                            "--redis-url", system.redis_url, "--scheduler-id", SCHEDULER_A)
    try:
        assert namesake.proc.wait(60) == 1, namesake.log_tail()
    finally:
        namesake.stop()
    holder = system.processes[SCHEDULER_A].proc
    assert last_line(namesake) == (
        f"pacer: error: scheduler id {SCHEDULER_A!r} is taken: pid {holder.pid} on host "
        f"{socket.gethostname()} holds it; give each scheduler its own --scheduler-id")
    assert holder.poll() is None     # the first one serves on


def last_line(process: Process) -> str:
    return process.log_tail().strip().splitlines()[-1]


def test_of_two_schedulers_started_together_under_one_name_one_refuses(system: System):
    """The check was a read of the heartbeat key, written only once the scheduler had
    prepared: two started at once could both find it empty and both run under one name.
    The name is claimed (SET NX) before anything else: exactly one of them gets it. (Under a
    key prefix of their own: the one that runs waits for workers, and sends this module's
    worker nothing.)"""
    twins = [system.start(f"twin-{i}", "scheduler", "--model", system.model, *ENGINE_FLAGS,
                          "--redis-url", system.redis_url, "--key-prefix", "twins:",
                          "--scheduler-id", "twin")
             for i in range(2)]
    try:
        wait_for(lambda: any(t.proc.poll() is not None for t in twins), 60.0,
                 "one of the twins refused")
        refused = next(t for t in twins if t.proc.poll() is not None)
        running = next(t for t in twins if t is not refused)
        assert refused.proc.returncode == 1, refused.log_tail()
        assert last_line(refused).startswith(
            f"pacer: error: scheduler id 'twin' is taken: pid {running.proc.pid} on host "), \
            refused.log_tail()
        assert running.proc.poll() is None, running.log_tail()
    finally:
        for twin in twins:
            twin.stop()


def test_a_scheduler_paused_past_its_claim_finds_it_taken_and_stops(system: System):
    """Stopped (SIGSTOP) longer than its claim's TTL, a scheduler's claim lapses and a new one
    under its id takes it. Resumed, the first one's refresh was a plain SET: it overwrote the
    newer claim and both ran under one name. Now the refresh leaves another incarnation's
    claim alone, and the stale one exits 1 naming the holder; the new one serves on. (Under a
    key prefix of their own, as the twins above.)"""
    keys = Keys(prefix="paused:")
    r = redis.Redis.from_url(system.redis_url)

    def start() -> Process:
        return system.start(f"paused-{len(system.processes)}", "scheduler", "--model",
                            system.model, *ENGINE_FLAGS, "--redis-url", system.redis_url,
                            "--key-prefix", "paused:", "--scheduler-id", "paused")

    def holds_claim(process: Process) -> bool:
        beat = heartbeat_of(r.get(keys.claim_scheduler("paused")))
        return beat is not None and beat.extra.get("pid") == process.proc.pid
    stale = start()
    fresh = None
    try:
        wait_for(lambda: holds_claim(stale), 60.0, "the first scheduler's claim")
        stale.proc.send_signal(signal.SIGSTOP)
        wait_for(lambda: not r.exists(keys.claim_scheduler("paused")), 30.0,
                 "the paused scheduler's claim to lapse")
        fresh = start()
        wait_for(lambda: holds_claim(fresh), 60.0, "the second scheduler's claim")
        stale.proc.send_signal(signal.SIGCONT)
        assert stale.proc.wait(30) == 1, stale.log_tail()
        assert last_line(stale) == (
            f"pacer: error: scheduler id 'paused' was taken over: this process (pid "
            f"{stale.proc.pid}) did not refresh its claim within {HEARTBEAT_TTL_S} s (paused, "
            f"or cut off from Redis) and pid {fresh.proc.pid} on host {socket.gethostname()} "
            "holds it now; this one stops"), stale.log_tail()
        assert fresh.proc.poll() is None, fresh.log_tail()
        assert holds_claim(fresh)
    finally:
        stale.proc.send_signal(signal.SIGCONT)
        stale.stop()
        if fresh is not None:
            fresh.stop()
        r.close()


def claim_of_a_dead_process(kind: str, ident: str) -> tuple[int, bytes]:
    """(pid, claim) of a process of this host that is gone: what a new process of `ident`
    wrote, for a claim taken over (any process after it takes it over at once)."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    host = socket.gethostname()
    return gone.pid, encode(Heartbeat(kind, ident, time.time(), {
        "pid": gone.pid, "host": host, "started_at": 0.0, "incarnation": f"{gone.pid}@{host}@0.0"}))


def serving_scheduler(system: System) -> str:
    """The name of the one scheduler driving the worker (B is started if none runs; of two,
    the other is stopped)."""
    alive = [n for n in (SCHEDULER_A, SCHEDULER_B)
             if n in system.processes and system.processes[n].proc.poll() is None]
    if not alive:
        system.start_scheduler(SCHEDULER_B)
        alive = [SCHEDULER_B]
    for other in alive[1:]:
        system.processes[other].stop()
    return alive[0]


def replace_claim_mid_stream(system: System, name: str, claim_key: str, taker: bytes,
                             stream: str, restart) -> tuple[list[StreamResult], "TokenTap",
                                                             list, str]:
    """Run the streams; once they stream, the claim of process `name` is replaced by
    `taker`'s (as a new process of its identity takes a lapsed claim) as the newest entry of
    `stream` is read, the process must exit 1, and `restart()` starts its successor. Returns
    the streams' results and tap, what `stream` got after the claim changed, before the
    restart, and the stale process's last line."""
    stale_process = system.processes[name]
    r = redis.Redis.from_url(system.redis_url)
    after_takeover: list = []
    stale_said: list[str] = []

    async def take_the_claim(_tap: TokenTap) -> float:
        pipe = r.pipeline(transaction=True)        # the newest entry as the claim changes
        pipe.set(claim_key, taker, ex=HEARTBEAT_TTL_S)
        pipe.xrevrange(stream, count=1)
        _, [(newest, _)] = pipe.execute()
        assert await asyncio.to_thread(stale_process.proc.wait, 30) == 1, system.logs()
        after_takeover.extend(r.xrange(stream, min=b"(" + newest))
        stale_said.append(last_line(stale_process))     # before its restart's log replaces it
        await asyncio.to_thread(restart)
        return time.monotonic()

    try:
        results, tap, _ = asyncio.run(run_streams(system, take_the_claim))
    finally:
        r.close()
    return results, tap, after_takeover, stale_said[0]


def test_a_scheduler_whose_claim_another_took_sends_no_plan_after(system: System):
    """A scheduler paused past its claim's TTL sent a plan (or two) when it ran again, before
    its next refresh found its claim another process's: the worker ran it as a restarted
    scheduler's and dropped the requests the new one served. Each plan now goes out in one
    script with a check of the claim: mid-stream, its claim is replaced (as a new process of
    its id takes a lapsed one), and from that moment no plan of it reaches the stream; it
    exits 1 naming the holder. Restarted (the holder's pid is gone), it finishes the
    streams."""
    name = serving_scheduler(system)
    stale = system.processes[name].proc
    gone, taker = claim_of_a_dead_process("scheduler", name)
    results, tap, after_takeover, stale_said = replace_claim_mid_stream(
        system, name, KEYS.claim_scheduler(name), taker, KEYS.plans,
        lambda: system.start_scheduler(name))
    assert after_takeover == [], system.logs()
    assert stale_said == (
        f"pacer: error: scheduler id {name!r} was taken over: this process (pid {stale.pid}) "
        f"did not refresh its claim within {HEARTBEAT_TTL_S} s (paused, or cut off from Redis) "
        f"and pid {gone} on host {socket.gethostname()} holds it now; this one stops")
    assert_complete(results, tap, system)


RELEASE_AFTER_TAKEOVER = """
import asyncio, sys
import redis
from shared.lifecycle import claimed, connect_redis

async def main(url, key, taker):
    client = await connect_redis(url)
    async with claimed(client, key, "scheduler", "released", "scheduler id 'released'", ""):
        # a new process of this id takes the claim (this one was paused past its TTL); no
        # await until the block ends, so that the refresh does not find it first
        redis.Redis.from_url(url).set(key, bytes.fromhex(taker), ex=30)
    await client.aclose()
asyncio.run(main(*sys.argv[1:]))
"""


def test_a_clean_exit_leaves_a_claim_another_process_took(system: System):
    """A process that stops cleanly deletes its claim, so that a restart need not wait: only
    while it is still its own. Before, a process whose claim another took while it was
    paused, stopping before its refresh found out, deleted the new holder's claim, and a
    third process could start under the identity beside the second."""
    key = Keys(prefix="released:").claim_scheduler("released")
    _, taker = claim_of_a_dead_process("scheduler", "released")
    done = subprocess.run([sys.executable, "-c", RELEASE_AFTER_TAKEOVER, system.redis_url,
                           key, taker.hex()], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    r = redis.Redis.from_url(system.redis_url)
    try:
        assert r.get(key) == taker
    finally:
        r.close()


STALE_WRITE = """
import asyncio, sys, time
import redis
from gpu_worker.service import PlanLoop, _Origin
from scheduler_svc.service import SchedulerService, SchedulerServiceConfig
from shared.config import SchedulerConfig
from shared.keys import Keys
from shared.lifecycle import claimed, connect_redis, connections_made, redis_run_id
from shared.plan import StepResult
from shared.protocol import RequestMsg, to_fields
from shared.sampling import SamplingParams
from scheduler_svc.core import Scheduler

async def main(url, write, taker):
    keys = Keys(prefix=f"stale-{write}:")
    client = await connect_redis(url)
    kind = "worker" if write == "worker-stats" else "scheduler"
    async with claimed(client, keys.claim_scheduler("stale"), kind, "stale", "stale", "") as claim:
        core = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8,
                                         num_kv_blocks=32, block_size=4, max_model_len=128),
                         eos_token_ids=2, max_model_len=128)
        service = SchedulerService(client, keys, core, SchedulerServiceConfig("stale"),
                                   claim=claim)
        await service.prepare()
        run_id = await redis_run_id(client)
        # a new process took the lapsed claim (this one was paused past its TTL) and wrote
        # its stats and plans fence; no await until the write, so that the refresh does
        # not find it first
        holder = redis.Redis.from_url(url)
        holder.set(claim.key, bytes.fromhex(taker), ex=30)
        holder.hset(keys.stats, mapping={"num_iterations_total": 4242, "worker_iterations_total": 4242})
        holder.set(keys.plans_fence, "9-0")
        if write == "scheduler-stats":
            service.stats.mark_dirty()
            await service._intake(pull=False, block=False, watch=False)
        elif write == "scheduler-intake":
            # it ended a request just before it was stopped (its finish, ack and progress
            # delete wait in the outbox); the new holder took the request back and serves it
            # (its progress record), and a new request came; resumed mid-iteration (the loop
            # held, no await), the intake runs before any refresh
            service.book.finish_now("1-1", RequestMsg(
                "ended", [1, 2, 3], SamplingParams(max_tokens=8), "tokens:gw", "gw", 0.0),
                "abort", 0)
            holder.set(keys.progress("ended"), b"held")
            holder.xadd(keys.requests, to_fields(RequestMsg(
                "new", [1, 2, 3], SamplingParams(max_tokens=8), "tokens:gw", "gw", 0.0)))
            time.sleep(1.5)
            await service._intake(pull=True, block=False, watch=False)
        elif write == "plans-fence":
            await service._fence_plans("1-0")
        else:
            loop = PlanLoop(client, keys, None, {}, "0-0", run_id, claim=claim)
            await loop._send_once({}, StepResult(7, {}), True, "10-0",
                                  _Origin(run_id, connections_made(client)))
asyncio.run(main(*sys.argv[1:]))
"""


def run_stale_write(system: System, write: str) -> None:
    """STALE_WRITE's `write` in a child process: it must exit 1 naming the holder."""
    _, taker = claim_of_a_dead_process("scheduler", "stale")
    done = subprocess.run([sys.executable, "-c", STALE_WRITE, system.redis_url, write,
                           taker.hex()], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "was taken over" in done.stderr.strip().splitlines()[-1], done.stderr


@pytest.mark.parametrize("write", ["scheduler-stats", "plans-fence", "worker-stats"])
def test_a_stale_process_writes_no_stats_and_no_plans_fence(system: System, write: str):
    """A scheduler or worker rank 0 paused past its claim's TTL, resumed after a new process
    of its identity took the claim, runs on until a fenced write or its refresh stops it.
    Its stats HSET (the scheduler's in its intake, rank 0's beside its result) and the
    scheduler's SET of the plans fence were plain commands: they overwrote the new holder's
    counters and could move its fence back to an older plan, so that the results of plans
    the holder gave up on went out again. Each is now run in a script that checks the claim
    first: the stale process writes nothing and exits 1 naming the holder."""
    keys = Keys(prefix=f"stale-{write}:")
    run_stale_write(system, write)
    r = redis.Redis.from_url(system.redis_url)
    try:
        stats = r.hgetall(keys.stats)
        assert stats[b"num_iterations_total"] == stats[b"worker_iterations_total"] == b"4242"
        assert r.get(keys.plans_fence) == b"9-0"
    finally:
        r.close()


def test_a_stale_scheduler_reads_no_request_and_ends_none(system: System):
    """A scheduler stopped past its claim's TTL and resumed mid-iteration runs its next
    intake before any timer of its own: one pipeline that published the finish events of
    what it ended before the stop, acked their entries, deleted their progress records and
    read new requests into its consumer name, which the new holder serves under too. A
    request so read waited, for nobody, until an idle claim took it (5 s and more), counted
    as a take-over. The claim, unconfirmed for longer than its refresh comes round, is now
    checked first: the stale one writes and reads nothing and exits 1. (Direct calls in a
    child process, its loop held past the refresh: a real SIGSTOP stops it wherever it
    happens to be, and its refresh usually runs first.)"""
    keys = Keys(prefix="stale-scheduler-intake:")
    tap = redis.Redis.from_url(system.redis_url)
    finishes = tap.pubsub(ignore_subscribe_messages=True)
    finishes.subscribe("tokens:gw")
    finishes.get_message(timeout=5.0)           # the subscription's own (ignored)
    try:
        run_stale_write(system, "scheduler-intake")
        assert finishes.get_message(timeout=0.5) is None      # no finish event
        assert tap.get(keys.progress("ended")) == b"held"
        group, = tap.xinfo_groups(keys.requests)
        assert group["pending"] == 0 and group["last-delivered-id"] == b"0-0", group
    finally:
        finishes.close()
        tap.close()


def start_worker(system: System) -> Process:
    """Worker rank 0 (again), once its heartbeat names it."""
    worker = system.start("worker", "worker", "--rank", "0", "--model", system.model,
                          *ENGINE_FLAGS, "--redis-url", system.redis_url)
    r = redis.Redis.from_url(system.redis_url)
    try:
        wait_for(lambda: (incarnation(r.get(KEYS.hb_worker(0))) or (None,))[0]
                 == worker.proc.pid, 120.0, "the restarted worker's heartbeat")
    finally:
        r.close()
    return worker


def test_a_worker_whose_claim_another_took_writes_its_heartbeat_no_more(system: System):
    """A rank paused past its claim's TTL beat once more (a plain SET) before its refresh
    found the claim another's: its heartbeat named the stale process again for up to a
    beat, and the scheduler took the rank for restarted (every running request recomputed),
    then for restarted again. Each beat is now written in one script with a check of the
    claim. Right after the worker's refresh, its claim is replaced and its heartbeat deleted
    (a new process of its rank took the lapsed claim, and beats only once loaded); its next
    beat, due before its next refresh, writes nothing, and it exits 1."""
    stale = system.processes["worker"]
    _, taker = claim_of_a_dead_process("worker", "0")
    r = redis.Redis.from_url(system.redis_url)
    r.config_set("notify-keyspace-events", "K$")
    refreshes = r.pubsub(ignore_subscribe_messages=True)
    refreshes.subscribe(f"__keyspace@0__:{KEYS.claim_worker(0)}")
    try:
        next(m for m in refreshes.listen() if m["data"] == b"set")     # its refresh ran
        pipe = r.pipeline(transaction=True)
        pipe.set(KEYS.claim_worker(0), taker, ex=HEARTBEAT_TTL_S)
        pipe.delete(KEYS.hb_worker(0))
        pipe.execute()
        assert stale.proc.wait(30) == 1, stale.log_tail()
        assert r.get(KEYS.hb_worker(0)) is None, stale.log_tail()
        assert "was taken over" in last_line(stale), stale.log_tail()
    finally:
        refreshes.close()
        r.config_set("notify-keyspace-events", "")
        r.close()
        start_worker(system)


def test_a_worker_whose_claim_another_took_publishes_no_result_after(system: System):
    """A rank 0 paused past its claim's TTL, resumed after a new rank 0 took the claim, ran
    the plans it had read and published their tokens, progress records and results before
    its next refresh stopped it. Its result now goes out in one script with a check of the
    claim (and a plan read comes with one): mid-stream, its claim is replaced (as a new
    process of its rank takes a lapsed one), and from that moment no result of it reaches
    the results stream; it exits 1 naming the holder. Restarted, it finishes the streams."""
    stale = system.processes["worker"].proc
    gone, taker = claim_of_a_dead_process("worker", "0")
    results, tap, after_takeover, stale_said = replace_claim_mid_stream(
        system, "worker", KEYS.claim_worker(0), taker, KEYS.results,
        lambda: start_worker(system))
    assert after_takeover == [], system.logs()
    assert stale_said == (
        f"pacer: error: worker rank 0 of the colocated engine was taken over: this process "
        f"(pid {stale.pid}) did not refresh its claim within {HEARTBEAT_TTL_S} s (paused, or "
        f"cut off from Redis) and pid {gone} on host {socket.gethostname()} holds it now; "
        "this one stops")
    assert_complete(results, tap, system)


def test_a_worker_resumed_after_its_group_was_declared_lost_writes_no_progress(
        system: System):
    """Rank 0 is stopped (SIGSTOP) with plans in flight until the scheduler declares the
    group lost (its heartbeat lapsed; its claim did not); the client leaves meanwhile, and
    the scheduler ends the request, deleting its progress record. Resumed, the worker ran
    the plans sent before the loss and wrote the record again, to stay for an hour. The
    scheduler now fences the plans it gave up on before it ends any request, and the
    worker's result script drops what such a plan would write."""
    name = serving_scheduler(system)
    worker = system.processes["worker"].proc
    scheduler_log = system.processes[name].log_path
    r = redis.Redis.from_url(system.redis_url)

    def losses() -> int:
        with open(scheduler_log, encoding="utf-8") as f:
            return f.read().count("worker group lost")

    async def leave_while_the_worker_is_stopped() -> str:
        before = losses()
        async with aiohttp.ClientSession() as session:
            async with open_stream(system, session, 11) as (resp, request_id):
                for _ in range(KILL_AFTER_CHUNKS):
                    await resp.content.readline()
                os.kill(worker.pid, signal.SIGSTOP)
                await asyncio.to_thread(wait_for, lambda: losses() > before, 30.0,
                                        "the scheduler declaring the worker group lost")
            # the connection is closed here: the gateway sends the abort
            await asyncio.to_thread(wait_for, lambda: not r.exists(KEYS.progress(request_id)),
                                    30.0, "the aborted request's progress record deleted")
            os.kill(worker.pid, signal.SIGCONT)
            # served after the plans sent before the loss: those were run (or dropped) first
            after = await stream_completion(session, system.gateway.base_url,
                                            {**body(12), "max_tokens": 8}, STREAM_DEADLINE_S)
            assert after.finish_reason == "length", (after, system.logs())
        return request_id

    try:
        request_id = asyncio.run(leave_while_the_worker_is_stopped())
        assert not r.exists(KEYS.progress(request_id)), system.logs()
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        r.close()


def test_a_second_worker_of_a_running_ones_rank_refuses_to_start(system: System):
    """Two `pacer worker --rank 0` of one instance both read its plans and both publish
    results (and beat into one key: the scheduler saw the rank lost and back, over and
    over). The second one exits 1 naming the rank and the one that holds it."""
    worker = system.processes["worker"].proc
    second = system.start("second-worker", "worker", "--rank", "0", "--model", system.model,
                          *ENGINE_FLAGS, "--redis-url", system.redis_url)
    try:
        assert second.proc.wait(60) == 1, second.log_tail()
    finally:
        second.stop()
    assert last_line(second) == (
        f"pacer: error: worker rank 0 of the colocated engine is taken: pid {worker.pid} on "
        f"host {socket.gethostname()} holds it; give each worker its own --rank (and "
        "--instance)"), second.log_tail()
    assert worker.poll() is None


def test_a_worker_restarted_under_its_dead_predecessors_claim_comes_up(system: System):
    """A restart comes before the dead process's claim has expired: on this host, a claim
    whose pid is gone is taken over at once, and the new worker serves. The streams' prompts
    are cached before (the new worker holds none of those blocks): the idle scheduler read
    the workers' heartbeats before it blocked for requests, so streams that came just after
    the new worker's first beat were planned on the old worker's cache, and the new worker
    stopped on the plan (UnknownKVCache). It now reads them as that read returns."""
    results, tap, _ = asyncio.run(run_streams(system))
    assert_complete(results, tap, system)
    old = system.processes["worker"].proc
    old.kill()
    old.wait()
    r = redis.Redis.from_url(system.redis_url)
    try:
        assert r.exists(KEYS.claim_worker(0))           # not expired yet
    finally:
        r.close()
    start_worker(system)
    results, tap, _ = asyncio.run(run_streams(system))
    assert_complete(results, tap, system)


def test_the_default_scheduler_id_is_the_hosts_and_the_instances():
    from scheduler_svc.cli import default_scheduler_id
    assert default_scheduler_id("p0") != default_scheduler_id("d0")
    assert default_scheduler_id("p0").startswith(default_scheduler_id(None))


def test_another_scheduler_takes_over_a_killed_schedulers_streams_exactly(system: System):
    reference, ref_tap, _ = asyncio.run(run_streams(system))
    assert_complete(reference, ref_tap, system)
    assert pending(system).get(SCHEDULER_A) == 0

    scheduler_a = system.processes[SCHEDULER_A].proc
    b_started: list[float] = []

    async def kill_a_then_start_b(_tap: TokenTap) -> float:
        os.kill(scheduler_a.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        # A's heartbeat key lives on until its TTL; the new scheduler must not need it gone
        assert await asyncio.to_thread(scheduler_a.wait, 10) == -signal.SIGKILL
        b_started.append(time.monotonic())
        system.start_scheduler(SCHEDULER_B)
        return killed_at

    results, tap, killed_at = asyncio.run(run_streams(system, kill_a_then_start_b))
    assert_complete(results, tap, system)
    for i, (r, ref) in enumerate(zip(results, reference)):
        assert r.text == ref.text, (i, r.text, ref.text)
        assert tap.tokens(r.response_id) == ref_tap.tokens(ref.response_id), i
    # every stream was mid-way at the kill: A's entries really were taken over, not finished
    assert all(r.chunk_times[-1] > killed_at for r in results)
    assert pending(system).get(SCHEDULER_B) == 0
    # A, dead and holding nothing now, leaves the group (else one consumer per id ever seen)
    wait_for(lambda: SCHEDULER_A not in pending(system), 30.0, "dead scheduler A removed "
             f"from the group: {pending(system)}\n{system.logs()}")
    with open(system.processes[SCHEDULER_B].log_path, encoding="utf-8") as f:
        assert "claiming requests of a scheduler that stopped" in f.read(), system.logs()

    before = [sum(t < killed_at for t in r.chunk_times) for r in results]
    pauses = [longest_pause(r, killed_at) for r in results]
    resumed = max(end for _, end in pauses)
    print(f"\nscheduler A kill -9 after {min(before)}-{max(before)} chunks per stream, "
          f"scheduler B (another consumer name) started: longest pause "
          f"{max(end - start for start, end in pauses):.2f} s, every stream streaming again "
          f"{resumed - killed_at:.2f} s after the kill ({resumed - b_started[0]:.2f} s after "
          f"B's process started; XAUTOCLAIM idle {CLAIM_IDLE_MS / 1000:g} s); each with "
          "exactly the undisturbed tokens, every index published once")


def longest_pause(r: StreamResult, killed_at: float) -> tuple[float, float]:
    """(start, end) of the longest time after the kill that the stream saw no token."""
    gaps = [(max(a, killed_at), b) for a, b in zip(r.chunk_times, r.chunk_times[1:])
            if b > killed_at]
    return max(gaps, key=lambda gap: gap[1] - gap[0])


def test_an_abort_sent_while_no_scheduler_runs_reaches_the_one_that_takes_the_request(
        system: System):
    """A client leaves while its scheduler is down: the abort waits in the aborts stream,
    and the scheduler that takes the request back (here the same one, restarted) reads it
    and ends the request, rather than running it to max_tokens for nobody."""
    name = SCHEDULER_B if SCHEDULER_B in system.processes else SCHEDULER_A
    scheduler = system.processes[name].proc
    aborts = redis.Redis.from_url(system.redis_url)

    async def leave_while_down() -> str:
        async with TokenTap(system.redis_url) as tap, aiohttp.ClientSession() as session:
            async with open_stream(system, session, 7) as (_, request_id):
                os.kill(scheduler.pid, signal.SIGKILL)
                assert await asyncio.to_thread(scheduler.wait, 10) == -signal.SIGKILL
                before = aborts.xlen(KEYS.aborts)
            # the connection is closed here: the gateway sends the abort
            deadline = time.monotonic() + 10
            while aborts.xlen(KEYS.aborts) == before and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert aborts.xlen(KEYS.aborts) > before, system.logs()
            system.start_scheduler(name)
            deadline = time.monotonic() + STREAM_DEADLINE_S
            while request_id not in tap.finished and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            finish = tap.finished.get(request_id)
        assert finish is not None and finish.finish_reason == "abort", (finish, system.logs())
        assert finish.num_output_tokens < MAX_TOKENS, finish
        return request_id

    try:
        asyncio.run(leave_while_down())
    finally:
        aborts.close()
    assert pending(system).get(name) == 0, pending(system)


def test_a_stalled_scheduler_that_comes_back_after_a_takeover_publishes_nothing_more(
        system: System):
    """The scheduler serving the streams is stopped (SIGSTOP) past the claim idle; another
    takes its requests over and finishes them; then the stalled one runs again. Before it
    applies the result it was waiting for or plans another token, it finds (its leases
    overdue) that its requests are another's or done, and drops them: each index is published
    once, each request finishes once, and no progress record is written again."""
    holder = serving_scheduler(system)
    taker = SCHEDULER_A if holder == SCHEDULER_B else SCHEDULER_B
    reference, ref_tap, _ = asyncio.run(run_streams(system))
    assert_complete(reference, ref_tap, system)
    stalled = system.processes[holder].proc

    async def stall_until_taken_over(tap: TokenTap) -> float:
        os.kill(stalled.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        system.start_scheduler(taker)
        end = time.monotonic() + STREAM_DEADLINE_S
        while len(tap.finished) < NUM_STREAMS:          # claimed and served to the end
            assert time.monotonic() < end, system.logs()
            await asyncio.sleep(0.05)
        os.kill(stalled.pid, signal.SIGCONT)
        await asyncio.sleep(2.0)            # what it would publish, the tap would see
        return stopped_at

    try:
        results, tap, stopped_at = asyncio.run(run_streams(system, stall_until_taken_over))
    finally:
        os.kill(stalled.pid, signal.SIGCONT)
    assert_complete(results, tap, system)
    for i, (r, ref) in enumerate(zip(results, reference)):
        assert r.text == ref.text, (i, r.text, ref.text)
        assert tap.finishes[r.response_id] == 1, (i, tap.finishes[r.response_id], system.logs())
    assert all(r.chunk_times[-1] > stopped_at for r in results)
    r = redis.Redis.from_url(system.redis_url)
    try:
        assert list(r.scan_iter(match=KEYS.progress("*"))) == [], system.logs()
    finally:
        r.close()
    with open(system.processes[holder].log_path, encoding="utf-8") as f:
        assert "request left: another scheduler claimed it" in f.read(), system.logs()
