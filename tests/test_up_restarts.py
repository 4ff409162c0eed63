"""`pacer up`'s restarts of a worker group, with real processes standing in for the ranks: a
group whose ranks die together is restarted once and counted once, its heartbeat keys are
gone at once and stay gone until the new ranks beat, and nothing new starts once `pacer up`
is stopping."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import redis

from services import restarts
from services.restarts import MAX_RESTARTS, Restarter, Watchdog
from services.supervisor import Supervisor, stop_children
from services.up import _watch
from tests.redis_fixture import redis_server  # noqa: F401  (a fixture)

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
GROUPS = {"worker rank 0": "worker group", "worker rank 1": "worker group"}
UNUSED_REDIS = "redis://127.0.0.1:1/0"   # no heartbeat keys: the restarter never connects
# a rank that beats until it is stopped: it writes its heartbeat key as SIGTERM arrives
BEATS_UNTIL_STOPPED = [sys.executable, "-c", """if True:
    import signal, sys, time, redis
    r = redis.Redis.from_url(sys.argv[1])
    signal.signal(signal.SIGTERM, lambda *_: (r.set(sys.argv[2], "beat"), sys.exit(0)))
    print("ready", flush=True)
    time.sleep(600)"""]


@pytest.fixture
def sup():
    sup = Supervisor()
    for name in ("scheduler", "worker rank 0", "worker rank 1"):
        sup.start(name, SLEEPER)
    yield sup
    stop_children(sup.children, 5.0)


def kill_group(sup: Supervisor) -> list:
    ranks = [c for c in sup.children if c.name in GROUPS]
    for child in ranks:
        child.proc.send_signal(signal.SIGKILL)
    for child in ranks:
        child.proc.wait()
    return ranks


def watch_for(sup: Supervisor, restarter: Restarter, seconds: float) -> int:
    """`pacer up`'s watch loop over what exits, for `seconds`."""
    end = time.monotonic() + seconds
    return _watch(sup, lambda: time.monotonic() > end, restarter,
                  Watchdog(UNUSED_REDIS, {}, after_s=0))


def test_ranks_that_die_together_restart_the_group_once(sup):
    restarter = Restarter(sup, UNUSED_REDIS, {}, GROUPS)
    # three: counted twice each, they went past MAX_RESTARTS at the third
    assert 2 * 3 > MAX_RESTARTS
    for death in range(1, 4):
        old = kill_group(sup)
        backoff = 0.5 * (death - 1)       # the restarter's wait before its restart
        assert watch_for(sup, restarter, backoff + 1.5) == 0, \
            f"gave up after {death} group deaths"
        fresh = [c for c in sup.children if c.name in GROUPS]
        assert not any(f is o for f in fresh for o in old)
        # the fresh ranks were not stopped again for the rank that died beside the first
        assert all(c.returncode is None for c in sup.children), death
        assert len(restarter._recent["worker group"]) == death


def test_no_group_starts_once_up_is_stopping(sup):
    restarter = Restarter(sup, UNUSED_REDIS, {}, GROUPS)
    old = kill_group(sup)
    assert restarter.handle(old[0], stopping=lambda: True)
    assert [c for c in sup.children if c.name in GROUPS] == old     # none started


def test_a_dead_groups_heartbeats_go_at_once_and_again_once_its_survivors_stopped(
        redis_server):
    r = redis.Redis.from_url(redis_server)
    keys = {name: f"test:hb:{name}" for name in GROUPS}
    r.delete("test:restarts")
    sup = Supervisor()
    try:
        for name, key in keys.items():
            sup.start(name, [*BEATS_UNTIL_STOPPED, redis_server, key], stdout=subprocess.PIPE)
            assert sup.children[-1].proc.stdout.readline().strip() == b"ready"
            r.set(key, "beat")
        rank1 = sup.children[1]
        rank1.proc.kill()
        rank1.proc.wait()
        seen = []       # the keys left when the restarter first waits (its backoff)

        def stopping() -> bool:
            seen.append(seen or r.exists(*keys.values()))
            return False
        assert Restarter(sup, redis_server, keys, GROUPS, "test:restarts").handle(rank1,
                                                                                stopping)
        assert seen[0] == 0                         # the dead rank's key did not wait
        assert r.exists(*keys.values()) == 0        # nor what rank 0 wrote as it stopped
        assert r.hgetall("test:restarts") == {b"worker group": b"1"}    # counted, once
    finally:
        stop_children(sup.children, 5.0)
        r.close()


def test_restarts_are_counted_again_in_a_redis_that_lost_them(redis_server, monkeypatch):
    """`pacer up` restarts its own Redis (empty) when it dies: the restarts counted before
    were gone from /metrics, and the Redis restart itself was never counted (the new server
    refused the write, a moment after it started). The counts are written whole, and a write
    that failed is tried again."""
    monkeypatch.setattr(restarts, "COUNT_RETRY_S", 0.0)
    r = redis.Redis.from_url(redis_server)
    r.delete("test:counts")
    sup = Supervisor()
    try:
        for name in ("scheduler", "redis"):
            sup.start(name, SLEEPER)
        restarter = Restarter(sup, redis_server, {}, {}, "test:counts")

        def die(name: str) -> None:
            child = next(c for c in sup.children if c.name == name)
            child.proc.kill()
            child.proc.wait()
            assert restarter.handle(child, lambda: False)
        die("scheduler")
        assert r.hgetall("test:counts") == {b"scheduler": b"1"}
        r.delete("test:counts")                 # the Redis restarted, empty...
        restarter.redis_url = UNUSED_REDIS      # ... and refuses connections for a moment
        die("redis")
        restarter.count_again()
        assert r.hgetall("test:counts") == {}
        restarter.redis_url = redis_server      # it answers
        restarter.count_again()
        assert r.hgetall("test:counts") == {b"scheduler": b"1", b"redis": b"1"}
    finally:
        stop_children(sup.children, 5.0)
        r.close()
