"""pacer up's watchdog (services/restarts.py): a child whose heartbeat was seen and that
writes none for --watchdog-s while its process lives is named to be killed, every child
silent at once too; one never seen (still loading), one that beats, and every child while
Redis is away or after it restarted (another run_id) are not. Real processes and a real Redis."""
from __future__ import annotations

import contextlib
import subprocess
import time

import pytest
import redis

from services.restarts import Watchdog
from services.supervisor import Child
from shared.protocol import Heartbeat, encode
from tests.redis_fixture import redis_server  # noqa: F401  (a fixture)
from tests.redis_fixture import start_redis, stop_redis

AFTER_S = 0.4
KEYS = {"worker rank 0": "wd:hb:worker", "scheduler": "wd:hb:scheduler"}


@pytest.fixture
def children():
    procs = [subprocess.Popen(["sleep", "60"]) for _ in KEYS]
    yield [Child(name, ["sleep"], proc) for name, proc in zip(KEYS, procs)]
    for proc in procs:
        proc.kill()
        proc.wait()


def beat(r: redis.Redis, child: Child, pid: int | None = None) -> None:
    r.set(KEYS[child.name], encode(Heartbeat(child.name, "x", time.time(),
                                             {"pid": pid or child.pid})))


def checks(watchdog: Watchdog, children: list[Child], seconds: float) -> list[str]:
    """The names it finds hung over `seconds` of checks."""
    found, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        found += [c.name for c in watchdog.hung(children)]
        time.sleep(0.02)
    return found


@contextlib.contextmanager
def all_beating(url: str, children: list[Child]):
    """A client and a watchdog of the Redis at `url`, once it has seen every child beat."""
    r = redis.Redis.from_url(url)
    watchdog = Watchdog(url, KEYS, AFTER_S)
    try:
        for child in children:
            beat(r, child)
        assert checks(watchdog, children, 0.1) == []
        yield r, watchdog
    finally:
        watchdog.close()
        r.close()


def test_a_silent_child_is_found_hung_and_a_beating_or_unseen_one_is_not(
        redis_server, children, monkeypatch):
    monkeypatch.setattr(Watchdog, "CHECK_EVERY_S", 0.0)
    r = redis.Redis.from_url(redis_server)
    worker, scheduler = children
    watchdog = Watchdog(redis_server, KEYS, AFTER_S)
    try:
        beat(r, worker)
        beat(r, scheduler, pid=1)           # a key an earlier process left: not this one's
        assert checks(watchdog, children, 2 * AFTER_S) == []
        r.delete(KEYS[worker.name])         # the worker stops beating; the scheduler's
        beat(r, scheduler)                  # ...beats on
        assert checks(watchdog, children, 3 * AFTER_S) == [worker.name]   # named once
        assert Watchdog(redis_server, KEYS, 0).hung(children) == []        # 0: never
    finally:
        watchdog.close()
        r.close()


def test_every_child_silent_at_once_is_found_hung(redis_server, children, monkeypatch):
    """Every key gone while Redis kept running (every service stalled together: their keys
    expired) is no Redis restart: each child is named."""
    monkeypatch.setattr(Watchdog, "CHECK_EVERY_S", 0.0)
    with all_beating(redis_server, children) as (r, watchdog):
        r.delete(*KEYS.values())            # both stop beating: their keys expire
        assert sorted(checks(watchdog, children, 3 * AFTER_S)) == sorted(KEYS)


def test_a_redis_restart_is_not_a_hang(children, monkeypatch):
    """Redis restarted (another run_id; it kept nothing), even unseen by any check while it
    was away: the silence counts from then, and the services beat again."""
    monkeypatch.setattr(Watchdog, "CHECK_EVERY_S", 0.0)
    proc, url = start_redis()
    try:
        with all_beating(url, children) as (r, watchdog):
            stop_redis(proc)
            time.sleep(2 * AFTER_S)         # away for longer than AFTER_S, no check meanwhile
            proc, _ = start_redis(int(url.rsplit(":", 1)[1].split("/")[0]))
            assert checks(watchdog, children, 0.1) == []
            for child in children:          # they beat again, then one stops
                beat(r, child)
            assert checks(watchdog, children, 0.1) == []
            r.delete(KEYS["scheduler"])
            assert checks(watchdog, children, 3 * AFTER_S) == ["scheduler"]
    finally:
        stop_redis(proc)
