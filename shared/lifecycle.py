"""The life of one service process: uvloop, signals, a Redis connection, a heartbeat key.

    async def main(stop: asyncio.Event) -> int:
        redis = await connect_redis(url)
        hb = essential_task(keep_heartbeat(redis, key, make_heartbeat), "heartbeat")
        while not stop.is_set(): ...       # the service's loop drains, then returns
    sys.exit(run_service(main))

The first SIGINT/SIGTERM sets `stop` and the service drains (finishes what it holds, takes
nothing new); a second one cancels the main coroutine, for an operator who will not wait.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import socket
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from shared import clock
from shared.errors import PacerError
from shared.exit_reason import note_exception, report_error
from shared.keys import HEARTBEAT_INTERVAL_S, HEARTBEAT_TTL_S, SCAN_COUNT, Keys
from shared.protocol import Heartbeat, encode, heartbeat_of
from shared.redis_retry import retry_redis
from shared.scripts import Script, execute
from shared.service_args import redis_password, refused_for_good, shown_url

log = structlog.get_logger("lifecycle")

# Blocking stream reads wait at most ~1 s; the socket timeout must be longer, or a read that is
# still legitimately blocking would fail, yet finite, so that a vanished server cannot hang it.
SOCKET_TIMEOUT_S = 10.0

ServiceMain = Callable[[asyncio.Event], Awaitable[int]]
RedisServiceMain = Callable[[aioredis.Redis, asyncio.Event], Awaitable[int]]


def run_service(main: ServiceMain) -> int:
    """Run `main(stop)` on uvloop until it returns; its return value is the exit code."""
    try:
        import uvloop
    except ImportError:   # not on Windows
        return asyncio.run(_with_signals(main))
    return uvloop.run(_with_signals(main))


def freeze_heap() -> None:
    """Once a service has loaded what it keeps (model, tokenizer, modules: ~7 x 10^5 Python
    objects in a worker), collect once and move everything alive out of the cyclic
    collector's reach (`gc.freeze`). A full collection then walks only what was made since:
    over the whole heap it took 0.1-0.9 s here (more under load) in workers, schedulers and
    the gateway alike, stalling whatever iteration or token it landed on."""
    gc.collect()
    gc.freeze()


def run_redis_service(redis_url: str, main: RedisServiceMain) -> int:
    """`run_service` for a service that talks to one Redis: `main(redis, stop)` gets a client
    once the server answers, closed when `main` returns."""
    async def with_redis(stop: asyncio.Event) -> int:
        try:
            redis = await connect_redis(redis_url, stop)
        except (RedisError, OSError):
            if stop.is_set():       # told to stop while Redis was away: nothing to drain
                log.info("stopped before redis answered")
                return 0
            raise
        try:
            return await main(redis, stop)
        finally:
            await redis.aclose()
    return run_service(with_redis)


async def _with_signals(main: ServiceMain) -> int:
    stop = asyncio.Event()
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            log.warning("second signal; stopping now", signal=sig.name)
            task.cancel()
            return
        log.info("signal received; draining", signal=sig.name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        return await main(stop)
    except asyncio.CancelledError:
        return 1
    except PacerError:
        raise                       # the command line prints it as `pacer: error: ...`
    except Exception as e:
        log.exception("service failed")
        note_exception(e)
        return 1


async def connect_redis(url: str, stop: asyncio.Event | None = None) -> aioredis.Redis:
    """A client for `url`, once the server answers PING (waits with backoff, logging). A
    server that refuses the URL for good (`refused_for_good`) raises its one-line error."""
    redis = aioredis.Redis.from_url(url, password=redis_password(),
                                    socket_timeout=SOCKET_TIMEOUT_S, health_check_interval=30)
    _count_connections(redis)

    async def ping() -> None:
        try:
            await redis.ping()
        except (RedisError, OSError) as e:
            if (refused := refused_for_good(url, e)) is not None:
                raise refused from None
            raise
    try:
        await retry_redis(ping, f"connect to {shown_url(url)}", log,
                          errors=(RedisError, OSError),
                          give_up=lambda: stop is not None and stop.is_set())
    except BaseException:
        await redis.aclose()
        raise
    return redis


async def check_key_types(redis: aioredis.Redis, expected: dict[str, str], prefix: str) -> None:
    """Keys of ours that exist with another type (`expected`: key -> "stream", "hash", ...):
    another application shares the key prefix, or a key was written by hand. One line naming
    them, before the first command on them fails with WRONGTYPE (a traceback at start-up)."""
    pipe = redis.pipeline(transaction=False)
    for key in expected:
        pipe.type(key)
    found = [t.decode() if isinstance(t, bytes) else t for t in await pipe.execute()]
    wrong = [f"{key} holds a {kind}, not a {want}"
             for (key, want), kind in zip(expected.items(), found) if kind not in ("none", want)]
    if wrong:
        raise PacerError(f"{'; '.join(wrong)}: another application uses the key prefix "
                         f"{prefix!r} in this Redis; give pacer its own with --key-prefix (or "
                         "its own database), or delete the keys")


# connection pool -> connections it made (see connections_made)
_CONNECTIONS_MADE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _count_connections(redis: aioredis.Redis) -> None:
    """Count the connections the client's pool makes, from its first (before any exists)."""
    pool = redis.connection_pool
    _CONNECTIONS_MADE[pool] = 0

    async def connected(connection) -> None:
        await connection.on_connect()
        _CONNECTIONS_MADE[pool] += 1
    pool.connection_kwargs["redis_connect_func"] = connected


def connections_made(redis: aioredis.Redis) -> int | None:
    """How many connections a client of `connect_redis` has made (None: another client). A
    command on a connection made since some moment may have reached another server than the
    one that answered then (Redis restarted): redis-py reconnects a connection it found
    closed without a failure the caller sees. One not made since went to that server, or
    failed."""
    return _CONNECTIONS_MADE.get(redis.connection_pool)


async def keep_heartbeat(redis: aioredis.Redis, key: str,
                            make: Callable[[], Heartbeat],
                            interval_s: float = HEARTBEAT_INTERVAL_S,
                            ttl_s: int = HEARTBEAT_TTL_S, claim: "Claim | None" = None) -> None:
    """Keep `key` alive with a fresh Heartbeat until cancelled; survives Redis outages. Each
    beat measures the offset to Redis's clock too (shared/clock.py). With the process's
    `claim` (`claimed`; `key` may be the claim's own), each beat is written only while the
    claim is this incarnation's (or lapsed, taken by no one): one another incarnation holds
    now leaves `key` as it is, and `claim.lost(its value)` is raised."""
    while not cancel_requested():
        try:
            beat = make()
            pipe = redis.pipeline(transaction=False)
            pipe.time()
            if claim is None:
                pipe.set(key, encode(beat), ex=ttl_s)
            else:
                _SET_WHILE_CLAIMED.queue(pipe, (claim.key, key), claim.incarnation,
                                         encode(beat), ttl_s)
            before, sent = time.time(), time.monotonic()
            redis_time, held_by = await execute(pipe)
            clock.measured(before, redis_time, time.time())
        except (RedisError, OSError) as e:
            log.warning("heartbeat not written", key=key, error=str(e))
        else:
            if claim is not None:
                if held_by:
                    raise claim.lost(held_by)
                claim.confirmed_at = sent
        await asyncio.sleep(interval_s)
    raise asyncio.CancelledError


async def scheduler_heartbeats(redis: aioredis.Redis, keys: Keys) -> dict[str, bytes | None]:
    """Each scheduler heartbeat key alive, and its value: SCAN of the heartbeat keys, one
    MGET (a key that expired in between reads as None)."""
    beats = [k.decode() if isinstance(k, bytes) else k
             async for k in redis.scan_iter(match=keys.hb_scheduler_pattern, count=SCAN_COUNT)]
    return dict(zip(beats, await redis.mget(beats) if beats else []))


# SET the claim key to ARGV[2] (with a TTL of ARGV[3] s) only while it still holds ARGV[1]: the
# dead predecessor's claim that was read, not one another process wrote since
_TAKE_OVER = Script("""
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
  return 1
end
return 0
""")

# The claim KEYS[1] holds when it is another incarnation's than ARGV[1] (it took the claim
# this one let lapse), else false: it holds this incarnation's, or nothing (lapsed, taken by
# no one; or Redis restarted). The head of each script fenced by a claim (those below, rank
# 0's result: gpu_worker/service.py).
OTHERS_CLAIM = """
local function others_claim()
  local held = redis.call('GET', KEYS[1])
  if not held then
    return false
  end
  local ok, claim = pcall(cmsgpack.unpack, held)
  if ok and type(claim) == 'table' and type(claim.extra) == 'table'
     and claim.extra.incarnation == ARGV[1] then
    return false
  end
  return held
end
"""

# SET KEYS[2] (the claim itself, or a heartbeat of its process) to ARGV[2] (TTL ARGV[3] s)
# unless another incarnation holds the claim, which is returned, nothing touched
_SET_WHILE_CLAIMED = Script(OTHERS_CLAIM + """
local held = others_claim()
if held then
  return held
end
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
return false
""")

# A clean exit's delete of KEYS[2] (the claim KEYS[1] itself, or its process's heartbeat):
# only while the claim is not another incarnation's
_CLEAR_WHILE_CLAIMED = Script(OTHERS_CLAIM + """
if not others_claim() then
  redis.call('DEL', KEYS[2])
end
return 0
""")

# The claim when another incarnation holds it (else nil): a check queued in a pipeline
_CHECK = Script(OTHERS_CLAIM + "return others_claim()")

# XADD to KEYS[2] (MAXLEN ~ ARGV[2]; the fields: ARGV[3..]) unless another incarnation holds
# the claim: {1, the entry id}, or {0, the other's claim} with nothing added
_FENCED_XADD = Script(OTHERS_CLAIM + """
local held = others_claim()
if held then
  return {0, held}
end
return {1, redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', unpack(ARGV, 3))}
""")


# Run the command ARGV[2] on KEYS[2] (its further arguments: ARGV[3..]) unless another
# incarnation holds the claim, which is returned, nothing run
_CALL_WHILE_CLAIMED = Script(OTHERS_CLAIM + """
local held = others_claim()
if held then
  return held
end
redis.call(ARGV[2], KEYS[2], unpack(ARGV, 3))
return false
""")


@dataclass
class Claim:
    """This process's claim of its identity (`claimed`). What only the holder may write goes
    through it, fenced by the claim in the same command: its heartbeats (`keep_heartbeat`,
    `clear`), a scheduler's plans (`xadd`) and plans fence, the stats hash (`call`,
    `queue_call`), worker rank 0's results (its own script, with OTHERS_CLAIM at its head,
    then `stop`); a P/D rank's K/V writes, which no script can fence, check
    `may_have_lapsed` first. A process paused past the claim's TTL ran
    once or twice before its next refresh found the claim another's: a plan the workers
    ran as a new scheduler's, a heartbeat that named the stale process again (the
    scheduler took a worker's for a restart and recomputed every request), its clean exit's
    delete of the new holder's keys (`clear`)."""

    redis: aioredis.Redis
    key: str
    incarnation: str
    lost: Callable[[bytes], PacerError]
    # when the last beat (or `confirm`) that found the claim this incarnation's was sent
    confirmed_at: float = field(default_factory=time.monotonic)
    ttl_s: float = HEARTBEAT_TTL_S          # the claim key's TTL (`claimed`)

    @property
    def unconfirmed(self) -> bool:
        """No beat has found the claim this incarnation's for longer than they come round:
        the process was stopped (SIGSTOP, swapping), its loop held or Redis away, and another
        process of its identity may hold the claim now. What cannot go into a fenced script
        (a scheduler's intake: blocking reads, its finish events) waits for `confirm` then."""
        return time.monotonic() - self.confirmed_at > 2 * HEARTBEAT_INTERVAL_S

    @property
    def may_have_lapsed(self) -> bool:
        """No beat has found the claim this incarnation's for its TTL (less a beat's interval,
        for the two clocks and what follows the check): it may have lapsed, and another process
        of its identity may hold it now. (The beat that confirmed it reached Redis after
        `confirmed_at`, and found the claim this incarnation's, which then lives the TTL from
        there, or no one's, which the claim's own next beat sets back.) On the local clock, no
        round trip: what a stale process must not do and no fenced script can cover stops here
        (a P/D rank's K/V writes into a peer's pool, gpu_worker/kv_transfer/connector.py)."""
        return time.monotonic() - self.confirmed_at >= self.ttl_s - HEARTBEAT_INTERVAL_S

    async def confirm(self) -> None:
        """Check the claim in a round trip of its own: another incarnation's stops the
        process (`checked`); this one's is noted as confirmed."""
        sent = time.monotonic()
        self.checked(await _CHECK.run(self.redis, (self.key,), self.incarnation))
        self.confirmed_at = sent

    async def xadd(self, stream: str, fields: dict, maxlen: int) -> bytes | str:
        """XADD `fields` to `stream` (MAXLEN ~ `maxlen`) while the claim is this
        incarnation's (or lapsed, taken by no one). Another incarnation's: nothing is added,
        and the process exits 1 at once with the line of `lost`, as when its refresh finds
        it."""
        sent, value = await _FENCED_XADD.run(
            self.redis, (self.key, stream), self.incarnation, maxlen,
            *(item for pair in fields.items() for item in pair))
        if not sent:
            self.stop(value)
        return value

    def queue_call(self, pipe, command: str, key: str, *args) -> None:
        """Queue `command key *args` (HSET of a stats hash, SET of the plans fence) on `pipe`,
        run only while the claim is this incarnation's (or lapsed, taken by no one); its
        reply goes to `checked` (run `pipe` with shared.scripts.execute)."""
        _CALL_WHILE_CLAIMED.queue(pipe, (self.key, key), self.incarnation, command, *args)

    async def call(self, command: str, key: str, *args) -> None:
        """`queue_call` in a round trip of its own, then `checked`."""
        self.checked(await _CALL_WHILE_CLAIMED.run(self.redis, (self.key, key),
                                                   self.incarnation, command, *args))

    def queue_check(self, pipe) -> None:
        """Queue a check of the claim on `pipe`, in the round trip of what it reads; its
        reply goes to `checked` (run `pipe` with shared.scripts.execute)."""
        _CHECK.queue(pipe, (self.key,), self.incarnation)

    def checked(self, held: bytes | None) -> None:
        """The reply of `queue_check`: another incarnation's claim stops the process
        (`stop`)."""
        if held:
            self.stop(held)

    def stop(self, held: bytes) -> None:
        """A fenced write found the claim another incarnation's (`held`, its value): exit 1
        at once with the line of `lost`, as when the refresh finds it."""
        report_error(self.lost(held))
        os._exit(1)

    async def clear(self, key: str) -> None:
        """`clear_key` of the claim itself or a heartbeat of its process, at a clean exit:
        only while the claim is this incarnation's (or none's), never a new holder's."""
        try:
            await _CLEAR_WHILE_CLAIMED.run(self.redis, (self.key, key), self.incarnation)
        except (RedisError, OSError) as e:
            log.warning("heartbeat key not cleared", key=key, error=str(e))


def queue_hset(pipe, claim: Claim | None, key: str, mapping: dict) -> None:
    """Queue HSET of `mapping` into `key` (a stats hash) on `pipe`: fenced by `claim`
    (`Claim.queue_call`: pass its reply to `claim.checked`) where there is one. Run `pipe`
    with shared.scripts.execute."""
    if claim is None:
        pipe.hset(key, mapping=mapping)
    else:
        claim.queue_call(pipe, "HSET", key, *(item for pair in mapping.items() for item in pair))


@contextlib.asynccontextmanager
async def claimed(redis: aioredis.Redis, key: str, kind: str, ident: str, what: str,
                  hint: str, ttl_s: int = HEARTBEAT_TTL_S):
    """Hold the identity `key` names (a scheduler id, a worker rank of an instance) for this
    process while the block runs: claimed at once with SET NX (two processes started together
    cannot both get it), kept by `keep_heartbeat` (its value is a Heartbeat of this
    incarnation: pid, host, start time), deleted at the end while it is still this
    incarnation's. A claim left by a dead process
    (a restart, the key not expired yet) is taken over: on this host, when its pid is gone
    (or is another program's now); from another host, once it stops being refreshed (it
    lapses within `ttl_s`). A live holder: PacerError naming `what`, the holder and `hint`
    (what to do). `kind`: the service (`scheduler`, `worker`), as its command line says it.
    Yields the `Claim`, to fence what the process publishes.

    A process paused past `ttl_s` (SIGSTOP, a long stall) may find its lapsed claim taken by
    a new process of its identity: its refresh (or a fenced publish, `Claim.xadd`) leaves
    that one's claim as it is and the process exits 1 at once, with one line naming the
    holder (it is the stale one)."""
    started_at = time.time()
    pid, host = os.getpid(), socket.gethostname()
    incarnation = f"{pid}@{host}@{started_at!r}"

    def make() -> Heartbeat:
        return Heartbeat(kind, ident, time.time(), {
            "pid": pid, "host": host, "started_at": started_at, "incarnation": incarnation})

    def lost(raw: bytes) -> PacerError:
        beat = heartbeat_of(raw)
        return PacerError(f"{what} was taken over: this process (pid {pid}) did not refresh "
                          f"its claim within {ttl_s} s (paused, or cut off from Redis) and "
                          f"{holder(beat.extra if beat else {})} holds it now; this one stops")
    await retry_redis(lambda: _claim(redis, key, encode(make()), kind, what, hint, ttl_s),
                      f"claim {key}", log)
    claim = Claim(redis, key, incarnation, lost, ttl_s=ttl_s)
    task = essential_task(keep_heartbeat(redis, key, make, ttl_s=ttl_s, claim=claim),
                          f"claim of {what}")
    try:
        yield claim
    finally:
        await cancel_tasks(task)
        await claim.clear(key)


async def _claim(redis: aioredis.Redis, key: str, value: bytes, kind: str, what: str,
                 hint: str, ttl_s: int) -> None:
    def taken(extra: dict) -> PacerError:
        return PacerError(f"{what} is taken: {holder(extra)} holds it; {hint}")
    seen, lapse_by = None, time.monotonic() + ttl_s + 1.0
    while not await redis.set(key, value, nx=True, ex=ttl_s):
        raw = await redis.get(key)
        if raw is None:
            continue                        # it lapsed in between: claim it again
        extra = beat.extra if (beat := heartbeat_of(raw)) is not None else {}
        if extra.get("host") == socket.gethostname():
            if live_here(extra, kind) is not None:
                raise taken(extra)
            if await _TAKE_OVER.run(redis, (key,), raw, value, ttl_s):
                return                      # a dead predecessor's: ours now
            continue                        # someone else wrote it meanwhile: read again
        # another host's (or one that names none): alive if it refreshes the key
        if (seen is not None and raw != seen) or time.monotonic() > lapse_by:
            raise taken(extra)
        seen = raw
        await asyncio.sleep(HEARTBEAT_INTERVAL_S)


def holder(extra: dict) -> str:
    """Who wrote a heartbeat (its `extra`), for a person: "pid 123 on host h"."""
    pid, host = extra.get("pid"), extra.get("host")
    return (f"{f'pid {pid}' if isinstance(pid, int) else 'a process'} on "
            f"{f'host {host}' if host else 'another host'}")


def live_here(extra: dict, service: str) -> int | None:
    """The pid of the live `service` process of this host that wrote a heartbeat (its
    `extra`), or None: it names no pid, it is this process (its pid reused by us), it is
    gone, or its pid is another program's now."""
    pid = extra.get("pid")
    if not isinstance(pid, int) or pid == os.getpid():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass                        # alive, another user's
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if service.encode() not in f.read():
                return None         # the pid is another program's now
    except OSError:
        pass                        # no /proc to ask: alive is all there is to go by
    return pid


def cancel_requested() -> bool:
    """Whether the current task was cancelled though no CancelledError reached it: Python
    3.11's `asyncio.wait_for`, which redis-py puts around socket writes, returns the result
    instead when the write completes as the cancellation arrives. A loop that runs until
    cancelled must check this, or it may never end (and a service never stop)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def clear_key(redis: aioredis.Redis, key: str) -> None:
    """Delete a heartbeat key at a clean exit, so /health notices at once, not after the TTL."""
    try:
        await redis.delete(key)
    except (RedisError, OSError) as e:
        log.warning("heartbeat key not cleared", key=key, error=str(e))


# The exit code of a process whose essential task ended (BSD's EX_SOFTWARE: an internal error).
EXIT_TASK_ENDED = 70


def essential_task(work: Coroutine[Any, Any, None], name: str) -> asyncio.Task:
    """A background task the process cannot serve without: a heartbeat, lease renewal, the
    gateway's token listener. Each such loop outlives Redis's failures by design and ends only
    when cancelled; one that ends any other way met a bug, and a process that went on without
    it would fail silently (streams that never end, a heartbeat that lapses while the process
    still works, so that its requests are taken over twice). Its end is logged with the
    traceback and the process exits at once with EXIT_TASK_ENDED, as if killed: its
    supervisor starts it again and the recovery a `kill -9` gets begins
    (docs/failure-modes.md#a-background-task-ends). One that raises PacerError found that the
    process must not go on (its claim is another's now): its one line, and exit 1."""
    task = asyncio.create_task(work, name=name)
    task.add_done_callback(_exit_unless_cancelled)
    return task


def _exit_unless_cancelled(task: asyncio.Task) -> None:
    if task.cancelled():
        return
    error = task.exception()
    if isinstance(error, PacerError):
        # the task found that the process must not go on (a claim another process holds
        # now): its one line, exit 1 as a refused start does; not restarted into serving
        report_error(error)
        os._exit(1)
    log.critical("an essential task ended; exiting so that the process is started again",
                 task=task.get_name(), error=repr(error) if error else "returned",
                 exc_info=error)
    os._exit(EXIT_TASK_ENDED)


async def cancel_tasks(*tasks: asyncio.Task) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def stopped_for(stop: asyncio.Event, seconds: float) -> Callable[[], bool]:
    """A `retry_redis` give_up: True once `stop` has been seen set for `seconds`. A service
    told to stop gives up on a Redis that does not come back (its parent was killed, and Redis
    with it) instead of retrying forever as an orphan."""
    since: float | None = None

    def expired() -> bool:
        nonlocal since
        if not stop.is_set():
            return False
        since = since or time.monotonic()
        return time.monotonic() - since >= seconds
    return expired


class Stopwatch:
    """Accumulates seconds between `start()` and `stop()` calls (monotonic clock)."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._since: float | None = None

    def start(self) -> None:
        self._since = time.perf_counter()

    def discard(self) -> None:
        """Forget the running interval without counting it."""
        self._since = None

    def stop(self) -> float:
        """Stop and return the length of this interval (0 if it was not running)."""
        if self._since is None:
            return 0.0
        elapsed = time.perf_counter() - self._since
        self.total_s += elapsed
        self._since = None
        return elapsed


async def redis_run_id(redis: aioredis.Redis) -> str:
    """The server's run_id: another value means Redis restarted (and, without persistence,
    lost every key)."""
    return (await redis.info("server"))["run_id"]


async def stream_tail_id(redis: aioredis.Redis, stream: str) -> bytes | str:
    """The id of the newest entry of `stream` ("0-0" if none): read after it to see only what
    comes next. Unlike XREAD from `$`, nothing added between this call and the read is missed."""
    newest = await redis.xrevrange(stream, count=1)
    return newest[0][0] if newest else "0-0"


def describe_exit(code: int) -> str:
    """A child process's exit status in words; a signal the `signal` module has no name for
    (a real-time one, 34 to 64) is named by its number."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def stream_id_text(entry_id: bytes | str) -> str:
    """A stream entry id as redis-py may return it (bytes) as text: "1700000000000-3"."""
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


def stream_id_order(entry_id: bytes | str) -> tuple[int, int]:
    """A stream entry id as something that sorts like it (ids of one stream only)."""
    ms, _, seq = stream_id_text(entry_id).partition("-")
    return int(ms), int(seq or 0)
