"""pacer up's watchdog (services/restarts.py): a child whose heartbeat was seen and that
writes none for --watchdog-s while its process lives is named to be killed; one never seen
(still loading), one that beats, and every child while Redis is away or has lost every key
are not. Real processes and a real Redis."""
from __future__ import annotations

import subprocess
import time

import pytest
import redis

from services.restarts import Watchdog
from services.supervisor import Child
from shared.protocol import Heartbeat, encode
from tests.redis_fixture import redis_server  # noqa: F401  (a fixture)

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


def test_every_key_gone_at_once_is_a_redis_restart_not_a_hang(redis_server, children,
                                                              monkeypatch):
    monkeypatch.setattr(Watchdog, "CHECK_EVERY_S", 0.0)
    r = redis.Redis.from_url(redis_server)
    watchdog = Watchdog(redis_server, KEYS, AFTER_S)
    try:
        for child in children:
            beat(r, child)
        assert checks(watchdog, children, 0.1) == []
        r.flushdb()                         # what a restarted Redis holds: nothing
        assert checks(watchdog, children, 3 * AFTER_S) == []
        for child in children:              # they beat again, then one stops
            beat(r, child)
        assert checks(watchdog, children, 0.1) == []
        r.delete(KEYS["scheduler"])
        assert checks(watchdog, children, 3 * AFTER_S) == ["scheduler"]
    finally:
        watchdog.close()
        r.close()
