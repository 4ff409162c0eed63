"""`pacer up`'s restarts of a worker group, with real processes standing in for the ranks: a
group whose ranks die together is restarted once and counted once, its heartbeat keys are
gone at once and stay gone until the new ranks beat, and nothing new starts once `pacer up`
is stopping."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import redis

from scheduler_svc.workers import incarnation
from services import restarts
from services.restarts import MAX_FAILED_STARTS, MAX_RESTARTS, Restarter, Watchdog
from services.supervisor import Supervisor, stop_children
from services.up import _watch
from shared.errors import PacerError
from tests.redis_fixture import free_port, redis_server  # noqa: F401  (a fixture)
from tests.served_fixture import ROOT, Served, process_state, wait_for

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


# a service that drains and exits 0 on SIGTERM, as the gateway and the scheduler do
EXITS_CLEANLY = [sys.executable, "-c", """if True:
    import signal, sys, time
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("ready", flush=True)
    time.sleep(600)"""]


def test_clean_stops_are_restarted_and_not_counted_as_a_crash_loop():
    """An operator's SIGTERMs (each drained, exit 0) are restarts asked for, not deaths:
    `pacer up` said "gateway died 6 times within 60 s ... exit code 0; giving up" and
    stopped everything."""
    sup = Supervisor()
    restarter = Restarter(sup, UNUSED_REDIS, {}, {})
    child = sup.start("gateway", EXITS_CLEANLY, stdout=subprocess.PIPE)
    try:
        for _ in range(MAX_RESTARTS + 2):
            assert child.proc.stdout.readline().strip() == b"ready"
            child.proc.terminate()
            assert child.proc.wait(30) == 0
            restarter.handle(child, stopping=lambda: False)
            fresh, = sup.children
            assert fresh is not child and fresh.returncode is None
            child = fresh
        assert not restarter._recent.get("gateway")
    finally:
        stop_children(sup.children, 5.0)


def test_a_stopped_child_is_let_run_to_take_its_sigterm():
    """A child stopped (SIGSTOP: by an operator, or hung so and not yet found by the
    watchdog) as `pacer up` stops it: a stopped process takes its SIGTERM only once it runs
    again, so it was killed (-9) at the deadline, its drain never run. SIGCONT follows."""
    sup = Supervisor()
    child = sup.start("gateway", EXITS_CLEANLY, stdout=subprocess.PIPE)
    try:
        assert child.proc.stdout.readline().strip() == b"ready"
        child.proc.send_signal(signal.SIGSTOP)
        wait_for(lambda: process_state(child.pid) == "T", 30.0, "the child stopped")
        assert stop_children(sup.children, 10.0) == [0]
    finally:
        stop_children(sup.children, 5.0)


def test_no_group_starts_once_up_is_stopping(sup):
    restarter = Restarter(sup, UNUSED_REDIS, {}, GROUPS)
    old = kill_group(sup)
    restarter.handle(old[0], stopping=lambda: True)
    assert [c for c in sup.children if c.name in GROUPS] == old     # none started


def test_a_restarted_child_runs_in_the_folder_it_was_first_started_in(tmp_path):
    """A restart is the same process again: the folder given at its start too (its relative
    paths mean what they meant), not the supervisor's."""
    where, said = tmp_path / "svc", tmp_path / "cwd.txt"
    where.mkdir()
    writes_cwd = [sys.executable, "-c",
                  "import os, sys; open(sys.argv[1], 'a').write(os.getcwd() + '\\n')", str(said)]
    sup = Supervisor()
    child = sup.start("service", writes_cwd, cwd=str(where))
    assert child.proc.wait(30) == 0
    assert sup.restart(child).proc.wait(30) == 0
    assert said.read_text().splitlines() == [str(where), str(where)]


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
        Restarter(sup, redis_server, keys, GROUPS, "test:restarts").handle(rank1, stopping)
        assert seen[0] == 0                         # the dead rank's key did not wait
        assert r.exists(*keys.values()) == 0        # nor what rank 0 wrote as it stopped
        assert r.hgetall("test:restarts") == {b"worker group": b"1"}    # counted, once
    finally:
        stop_children(sup.children, 5.0)
        r.close()



def _killed_and_handled(sup: Supervisor, restarter: Restarter, name: str) -> None:
    """The child `name` dies, and `pacer up`'s restarter handles it (counts, restarts)."""
    child = next(c for c in sup.children if c.name == name)
    child.proc.kill()
    child.proc.wait()
    restarter.handle(child, lambda: False)


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
        _killed_and_handled(sup, restarter, "scheduler")
        assert r.hgetall("test:counts") == {b"scheduler": b"1"}
        r.delete("test:counts")                 # the Redis restarted, empty...
        restarter.redis_url = UNUSED_REDIS      # ... and refuses connections for a moment
        _killed_and_handled(sup, restarter, "redis")
        restarter.count_again()
        assert r.hgetall("test:counts") == {}
        restarter.redis_url = redis_server      # it answers
        restarter.count_again()
        assert r.hgetall("test:counts") == {b"scheduler": b"1", b"redis": b"1"}
    finally:
        stop_children(sup.children, 5.0)
        r.close()


def test_a_new_pacer_up_does_not_report_an_earlier_runs_restarts(redis_server):
    """The hash outlived the `pacer up` that counted them: a new one on the same Redis, which
    had restarted nothing, reported them in /metrics as its own (and once it restarted a
    service, that count went down to 1 beside the others' stale ones)."""
    r = redis.Redis.from_url(redis_server)
    r.hset("test:earlier", mapping={"worker group": 3, "gateway": 2})
    sup = Supervisor()
    try:
        sup.start("scheduler", SLEEPER)
        restarter = Restarter(sup, redis_server, {}, {}, "test:earlier")
        restarter.count_again()                 # as `pacer up` starts, before its services
        assert r.hgetall("test:earlier") == {}
        _killed_and_handled(sup, restarter, "scheduler")
        assert r.hgetall("test:earlier") == {b"scheduler": b"1"}
    finally:
        stop_children(sup.children, 5.0)
        r.close()


# a service that comes up (writes its heartbeat, with its pid, as a worker does once its model
# is loaded) unless the file argv[3] exists: then it dies before that, as a worker whose model
# cannot be read any more does at every restart
COMES_UP_UNLESS_BROKEN = [sys.executable, "-c", """if True:
    import os, sys, time, redis
    from shared.protocol import Heartbeat, encode
    if os.path.exists(sys.argv[3]):
        print("pacer: error: cannot read the model", file=sys.stderr, flush=True)
        sys.exit(1)
    beat = Heartbeat("worker", "0", time.time(), {"pid": os.getpid(), "started_at": time.time()})
    redis.Redis.from_url(sys.argv[1]).set(sys.argv[2], encode(beat))
    time.sleep(float(sys.argv[4]))"""]


def _one_service(redis_url: str, key: str, broken: str, lives_s: float) -> Supervisor:
    """A supervisor of one worker rank that has come up (its heartbeat is in Redis)."""
    r = redis.Redis.from_url(redis_url)
    r.delete(key)
    sup = Supervisor()
    child = sup.start("worker rank 0", [*COMES_UP_UNLESS_BROKEN, redis_url, key, broken,
                                        str(lives_s)], cwd=ROOT)
    wait_for(lambda: (incarnation(r.get(key)) or (None,))[0] == child.pid, 30.0,
             "the worker's heartbeat")
    r.close()
    return sup


def test_a_service_that_dies_before_it_comes_up_again_is_given_up_on_whatever_its_pace(
        redis_server, tmp_path, monkeypatch):
    """A worker that cannot load its model any more (deleted, corrupt, its memory taken) dies
    at each restart. `pacer up` gave up only after MAX_RESTARTS deaths within
    RESTART_WINDOW_S: a model that loads in more than ~12 s never made that many, and the
    group was restarted forever, a traceback a minute. Here the window holds no two deaths,
    as for such a model."""
    monkeypatch.setattr(restarts, "RESTART_WINDOW_S", 0.0)
    key, broken = "test:hb:failing", str(tmp_path / "broken")
    sup = _one_service(redis_server, key, broken, lives_s=600)
    try:
        restarter = Restarter(sup, redis_server, {"worker rank 0": key},
                              {"worker rank 0": "worker group"})
        open(broken, "w").close()
        sup.children[0].proc.kill()
        with pytest.raises(PacerError) as e:
            watch_for(sup, restarter, 60.0)
        said = str(e.value)
        assert "worker group" in said and "worker rank 0" in said and "exit code 1" in said, said
        assert restarter._failed_starts["worker group"] == MAX_FAILED_STARTS
    finally:
        stop_children(sup.children, 5.0)


def test_a_service_that_comes_up_each_time_is_restarted_each_time(redis_server, tmp_path,
                                                                   monkeypatch):
    """Deaths of a process that had come up are not failed starts: with no window to fill,
    such a service is restarted for as long as it comes up again."""
    monkeypatch.setattr(restarts, "RESTART_WINDOW_S", 0.0)
    monkeypatch.setattr(restarts, "CHECK_STARTED_S", 0.0)
    key = "test:hb:coming-up"
    sup = _one_service(redis_server, key, str(tmp_path / "never"), lives_s=0.5)
    pids = set()
    end = time.monotonic() + 60.0       # a safety net

    def stopping() -> bool:
        pids.add(sup.children[0].pid)
        return len(pids) > MAX_FAILED_STARTS + 1 or time.monotonic() > end
    try:
        restarter = Restarter(sup, redis_server, {"worker rank 0": key},
                              {"worker rank 0": "worker group"})
        assert _watch(sup, stopping, restarter, Watchdog(UNUSED_REDIS, {}, after_s=0)) == 0
        assert len(pids) > MAX_FAILED_STARTS + 1
    finally:
        stop_children(sup.children, 5.0)


def test_pacer_up_gives_up_on_a_worker_that_cannot_load_its_model_any_more(tmp_path):
    """The model's weights are corrupted while `pacer up` serves, then the worker dies: each
    restart dies loading them. `pacer up` stops everything and exits 1, and its last line
    (after every service's stop, not buried above it) names the service and how it died."""
    from tests.helpers_tiny_model import write_tiny_llama
    model = write_tiny_llama(tmp_path / "tiny")
    log_path = tmp_path / "up.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "--port", str(free_port()),
             "--redis-url", f"redis://127.0.0.1:{free_port()}/0", "--model", model,
             "--dtype", "float32", "--kv-cache-memory", "64MiB"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        def worker_pid() -> int | None:
            lines = log_path.read_text(errors="replace").splitlines()
            if not any(line.startswith("pacer up: serving") for line in lines):
                assert proc.poll() is None, "\n".join(lines[-20:])
                return None
            return next(json.loads(line)["pid"] for line in lines if line.startswith("{")
                        and json.loads(line).get("child") == "worker rank 0")
        pid = wait_for(worker_pid, 240.0, "pacer up serving")
        with open(os.path.join(model, "model.safetensors"), "r+b") as f:
            f.truncate(1000)
        os.kill(pid, signal.SIGKILL)
        proc.wait(240.0)
        lines = log_path.read_text(errors="replace").strip().splitlines()
        assert proc.returncode == 1, lines[-20:]
        assert lines[-1].startswith("pacer: error: worker group did not come up again: "
                                    "worker rank 0 exited (exit code 1)"), lines[-20:]
        # and why, in the worker's own words: not only somewhere above, among every
        # service's lines
        assert "its last error: " in lines[-1] and "safetensors" in lines[-1].lower(), lines[-1]
    finally:
        proc.kill()
        proc.wait()


# a service that reads its model (argv[3]) as it starts, then comes up: a read that never
# returns (the file a FIFO nobody writes, as a dead network mount) hangs it before its first
# heartbeat
LOADS_THEN_COMES_UP = [sys.executable, "-c", """if True:
    import os, sys, time, redis
    from shared.protocol import Heartbeat, encode
    open(sys.argv[3], "rb").read()
    beat = Heartbeat("worker", "0", time.time(), {"pid": os.getpid(), "started_at": time.time()})
    redis.Redis.from_url(sys.argv[1]).set(sys.argv[2], encode(beat))
    time.sleep(600)"""]


def test_a_restart_that_hangs_before_it_comes_up_is_killed_and_given_up_on(
        redis_server, tmp_path, monkeypatch):
    """A worker restarted while its model's mount stops answering hangs in the read: it never
    beats, so the watchdog (which kills only a process it saw beating) left it alone, and
    `pacer up` waited forever with /health saying the worker is missing. A restart gets the
    start-up timeout the first start has: killed past it, counted as a death before it came
    up, given up on at the third in a row."""
    monkeypatch.setattr(restarts, "RESTART_WINDOW_S", 0.0)
    key, model = "test:hb:hanging", tmp_path / "model"
    model.write_bytes(b"weights")
    r = redis.Redis.from_url(redis_server)
    r.delete(key)
    sup = Supervisor()
    try:
        child = sup.start("worker rank 0", [*LOADS_THEN_COMES_UP, redis_server, key,
                                            str(model)], cwd=ROOT)
        wait_for(lambda: (incarnation(r.get(key)) or (None,))[0] == child.pid, 30.0,
                 "the worker's heartbeat")
        restarter = Restarter(sup, redis_server, {"worker rank 0": key},
                              {"worker rank 0": "worker group"}, startup_timeout_s=1.0)
        model.unlink()
        os.mkfifo(model)                    # the mount stops answering
        child.proc.kill()
        with pytest.raises(PacerError) as e:
            watch_for(sup, restarter, 120.0)
        said = str(e.value)
        assert said.startswith("worker group did not come up again: worker rank 0 was killed "
                               "(no heartbeat within 1 s of its restart)"), said
        assert restarter._failed_starts["worker group"] == MAX_FAILED_STARTS
    finally:
        stop_children(sup.children, 5.0)
        r.close()


# --startup-timeout of the `pacer up` whose restart hangs: the test waits it out once; the first
# start (every service at once) and the restart that serves must come up within it (a few
# seconds with the tiny model, on a busy machine)
HUNG_STARTUP_TIMEOUT_S = 12


def test_pacer_up_kills_a_restarted_worker_that_hangs_loading_its_model(tmp_path):
    """`pacer up` with the tiny model; the model's config becomes a FIFO nobody writes (a
    mount that stopped answering), then the worker dies: its restart hangs reading it. It is
    killed once --startup-timeout has passed, with a line naming it, and the next restart,
    the model readable again, serves."""
    from tests.helpers_tiny_model import write_tiny_llama
    model = write_tiny_llama(tmp_path / "tiny")
    config = os.path.join(model, "config.json")
    log_path = tmp_path / "up.log"
    port = free_port()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "--port", str(port),
             "--redis-url", f"redis://127.0.0.1:{free_port()}/0", "--model", model,
             "--dtype", "float32", "--kv-cache-memory", "64MiB",
             "--startup-timeout", str(HUNG_STARTUP_TIMEOUT_S)],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    def lines() -> list[str]:
        found = log_path.read_text(errors="replace").splitlines()
        assert proc.poll() is None, "\n".join(found[-20:])
        return found
    try:
        wait_for(lambda: any(line.startswith("pacer up: serving") for line in lines()), 240.0,
                 "pacer up serving")
        pid = next(json.loads(line)["pid"] for line in lines() if line.startswith("{")
                   and json.loads(line).get("child") == "worker rank 0")
        os.rename(config, config + ".real")
        os.mkfifo(config)
        os.kill(pid, signal.SIGKILL)
        said = f"wrote no heartbeat within {HUNG_STARTUP_TIMEOUT_S} s of its restart"
        hung = wait_for(lambda: next((line for line in lines() if said in line), None), 240.0,
                        "the hung restart killed")
        assert hung.startswith("pacer up: worker rank 0 (pid "), hung
        os.remove(config)
        os.rename(config + ".real", config)
        served = Served(f"http://127.0.0.1:{port}", "", proc, str(log_path))
        wait_for(lambda: lines() and served.get("/health")[0] == 200, 240.0, "healthy again")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_pacer_ups_gateway_is_watched_by_its_heartbeat_as_the_other_services_are(
        redis_server, tmp_path, monkeypatch):
    """The gateway `pacer up` starts, as it starts it: its heartbeat (a random id's, with no
    pid) was unknown to pacer up, so a gateway restart that hung before it came up was never
    killed (--startup-timeout), nor a gateway stopped while serving (--watchdog-s). Now each
    gateway process beats under a key pacer up knows, naming its pid: one that stops beating
    is found hung."""
    from services.cli import build_parser
    from services.up import _service_argvs
    from shared.engine_args import EngineArgs
    from shared.protocol import Heartbeat, encode
    from tests.helpers_tiny_model import write_tiny_llama
    monkeypatch.setattr(Watchdog, "CHECK_EVERY_S", 0.0)
    model = write_tiny_llama(tmp_path / "tiny")
    args = build_parser().parse_args(["up", "--model", model, "--port", str(free_port()),
                                      "--redis-url", redis_server, "--key-prefix", "gwtest"])
    services = _service_argvs(args, EngineArgs.from_cli(args))
    r = redis.Redis.from_url(redis_server)
    sup = Supervisor()
    try:
        gateway = sup.start("gateway", dict(services.argvs)["gateway"], cwd=ROOT)
        key = restarts.heartbeat_key(services.heartbeat_keys, gateway)
        assert key is not None
        wait_for(lambda: (incarnation(r.get(key)) or (None,))[0] == gateway.pid, 60.0,
                 "the gateway's heartbeat, naming its pid")
        # a scheduler that beats on: every key gone at once would be a Redis restart
        scheduler = sup.start("scheduler", SLEEPER)
        r.set(services.heartbeat_keys["scheduler"], encode(Heartbeat(
            "scheduler", "s", time.time(), {"pid": scheduler.pid})))
        watchdog = Watchdog(redis_server, services.heartbeat_keys, after_s=0.5)
        try:
            assert watchdog.hung(sup.children) == []
            gateway.proc.send_signal(signal.SIGSTOP)
            assert wait_for(lambda: watchdog.hung(sup.children), 30.0,
                            "the stopped gateway found hung") == [gateway]
        finally:
            watchdog.close()
    finally:
        stop_children(sup.children, 5.0)
        r.close()
