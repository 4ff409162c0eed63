"""Redis at a terminal: plans and results carry readable fields beside the msgpack blob, and
`pacer inspect` decodes the streams and the stats hash (against a real redis-server)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import redis

from services.cli import main
from shared.keys import Keys
from shared.plan import (CachedRequestData, IterationPlan, NewRequestData, SampledToken,
                         StepResult)
from shared.protocol import (CancelMsg, Heartbeat, PlanMsg, RequestMsg, ReserveMsg,
                             StepResultMsg, encode, to_fields)
from shared.sampling import SamplingParams
from tests.redis_fixture import redis_server  # noqa: F401  (the fixture)

KEYS = Keys("inspect-test:")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAN = IterationPlan(
    step=7,
    new_requests=[NewRequestData("r-new", list(range(40)), 40, SamplingParams(), [3, 4, 5], 0)],
    cached_requests=[CachedRequestData("r-a", [], 12), CachedRequestData("r-b", [9], 30)],
    num_scheduled_tokens={"r-a": 1, "r-b": 1, "r-new": 40},
    finished_request_ids=["r-done"], preempted_request_ids=["r-evicted"])


@pytest.fixture(scope="module")
def filled(redis_server: str) -> str:
    r = redis.Redis.from_url(redis_server)
    r.xadd(KEYS.plans, to_fields(PlanMsg(PLAN), scheduler="sched-1"))
    r.xadd(KEYS.results, to_fields(StepResultMsg(StepResult(7, {"r-a": SampledToken(11, -0.5)})),
                                   worker="host:42"))
    r.xadd(KEYS.requests, to_fields(RequestMsg("r-q", list(range(100)), SamplingParams(), "ch",
                                               "gw-1", 1.0)))
    r.xgroup_create(KEYS.requests, KEYS.requests_group, id="0")
    r.xreadgroup(KEYS.requests_group, "sched-1", {KEYS.requests: ">"})
    r.hset(KEYS.stats, mapping={"num_requests_running": 2, "worker_iterations_total": 7})
    beat(r, "")
    r.close()
    return redis_server


def beat(r: redis.Redis, instance: str, keys: Keys = KEYS) -> None:
    """A live scheduler of `instance` ("": the colocated engine's)."""
    r.set(keys.hb_scheduler(f"sched-{instance}"),
          encode(Heartbeat("scheduler", f"sched-{instance}", time.time(),
                           {"instance": instance})), ex=600)


def inspect(capsys, url: str, *args: str) -> str:
    assert main(["inspect", *args, "--redis-url", url, "--key-prefix", KEYS.prefix]) == 0
    return capsys.readouterr().out


def test_plan_and_result_entries_carry_readable_fields(filled):
    r = redis.Redis.from_url(filled, decode_responses=False)
    (_, plan), = r.xrevrange(KEYS.plans, count=1)
    assert {k: plan[k] for k in (b"step", b"requests", b"prefill_rows", b"decode_rows",
                                 b"scheduler")} == {
        b"step": b"7", b"requests": b"3", b"prefill_rows": b"40", b"decode_rows": b"2",
        b"scheduler": b"sched-1"}
    (_, result), = r.xrevrange(KEYS.results, count=1)
    assert result[b"step"] == b"7" and result[b"sampled"] == b"1" and result[b"worker"] == b"host:42"
    r.close()


def test_inspect_plans_decodes_the_plan(filled, capsys):
    out = inspect(capsys, filled, "plans", "--count", "3")
    assert "step=7" in out and "decode_rows=2" in out and "scheduler=sched-1" in out
    assert 'preempted_request_ids: ["r-evicted"]' in out
    assert "  - request_id: \"r-new\"" in out and "block_table: [3, 4, 5]" in out
    assert '"... 40 in all"' in out                   # a long token list is cut


def test_inspect_json_is_one_object_per_entry(filled, capsys):
    (line,) = inspect(capsys, filled, "results", "--json").splitlines()
    view = json.loads(line)
    assert view["kind"] == "step_result" and view["worker"] == "host:42"
    assert view["message"]["result"]["sampled"]["r-a"]["token_id"] == 11


def test_inspect_requests_shows_pending_per_consumer(filled, capsys):
    out = inspect(capsys, filled, "requests")
    assert "request_id=r-q" in out and "prompt_tokens=100" in out
    assert "pending in group schedulers: 1 (sched-1: 1)" in out


def test_inspect_stats(filled, capsys):
    rows = [line.split() for line in inspect(capsys, filled, "stats").splitlines()]
    assert rows == [["num_requests_running", "2"], ["worker_iterations_total", "7"]]
    assert json.loads(inspect(capsys, filled, "stats", "--json")) == {   # numbers, not text
        "num_requests_running": 2, "worker_iterations_total": 7}


def test_inspect_stats_of_a_scheduler_that_stopped_says_so(filled, capsys):
    """A scheduler that died (kill -9) left its last snapshot: num_requests_running 3 while
    nothing runs. A line above the numbers says so (/metrics reports such gauges as NaN)."""
    r = redis.Redis.from_url(filled)
    r.hset(KEYS.for_instance("r7").stats,
           mapping={"num_requests_running": 3, "updated_at": time.time() - 60})
    first, *rows = inspect(capsys, filled, "stats", "--instance", "r7").splitlines()
    assert first.startswith("no scheduler of this engine beats now") and " s ago" in first
    assert rows[0].split() == ["num_requests_running", "3"]
    # with --json the line goes to stderr: the output stays one object of numbers
    assert main(["inspect", "stats", "--instance", "r7", "--json", "--redis-url", filled,
                 "--key-prefix", KEYS.prefix]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["num_requests_running"] == 3 and "beats now" in err
    beat(r, "r7")                   # its scheduler is back: its numbers are the current ones
    r.close()
    assert "beats now" not in inspect(capsys, filled, "stats", "--instance", "r7")


def test_inspect_says_when_a_stream_is_empty(filled, capsys):
    """A wrong --key-prefix finds nothing: said, as for stats, not a silent exit."""
    assert main(["inspect", "plans", "--redis-url", filled, "--key-prefix", "nope:"]) == 0
    assert "no entries in nope:plans" in capsys.readouterr().out


def test_inspect_an_engine_instances_own_keys(filled, capsys):
    """P/D and replicas keep an instance's streams and stats under pacer:inst:ID:; --instance
    reads them, and without it an empty answer says where they are."""
    d0 = KEYS.for_instance("d0")
    request = encode(RequestMsg("r-pd", list(range(30)), SamplingParams(), "ch", "gw-1", 1.0))
    r = redis.Redis.from_url(filled)
    r.xadd(d0.handoff, to_fields(ReserveMsg(request, "p0")))
    r.xadd(d0.handoff, to_fields(CancelMsg("r-pd", "no decode instance took it")))
    r.hset(d0.stats, mapping={"num_requests_running": 5})
    beat(r, "d0")
    r.close()
    out = inspect(capsys, filled, "handoff", "--instance", "d0")
    assert out.index("kind=cancel") < out.index("kind=reserve"), out        # newest first
    assert 'reason: "no decode instance took it"' in out and 'prefill_instance: "p0"' in out
    assert 'kind: "request"' in out and 'request_id: "r-pd"' in out, out    # the inner one
    rows = [line.split() for line in inspect(capsys, filled, "stats", "--instance",
                                             "d0").splitlines()]
    assert rows == [["num_requests_running", "5"]]
    assert main(["inspect", "stats", "--redis-url", filled, "--key-prefix", "pd:"]) == 0
    assert "give --instance ID" in capsys.readouterr().out
    assert main(["inspect", "handoff", "--redis-url", filled, "--key-prefix", KEYS.prefix]) != 0
    assert "handoff is an engine instance's stream: give --instance ID" in \
        capsys.readouterr().err


def test_inspect_under_replicas_names_the_instances(redis_server, capsys):
    """--replicas: each replica reads its own request stream and writes its own plans and
    stats, so the plain keys hold nothing. The answer names the instances whose schedulers
    beat, not "no scheduler has run" (which `stats` said while two ran)."""
    keys = Keys("inspect-replicas:")
    r = redis.Redis.from_url(redis_server)
    for name in ("r0", "r1"):
        beat(r, name, keys)
    r.close()
    for what in ("requests", "stats", "plans"):     # stats said "no scheduler has run" too
        assert main(["inspect", what, "--redis-url", redis_server,
                     "--key-prefix", keys.prefix]) == 0
        out = capsys.readouterr().out
        assert "no scheduler has run" not in out, (what, out)
        assert "engine instances' (r0, r1): give --instance ID" in out, (what, out)


def test_inspect_an_instance_nobody_ran_as_says_so(redis_server, capsys):
    """`--instance zz` that no engine instance ran as, with no keys of its own: one line
    saying so and naming the instances beating now (or that none does), not the shared
    request stream's entries printed as if they were zz's."""
    keys = Keys("inspect-unknown:")
    r = redis.Redis.from_url(redis_server)
    r.xadd(keys.requests, to_fields(RequestMsg("r-shared", [1, 2], SamplingParams(), "ch",
                                               "gw-1", 1.0)))
    r.close()

    def refused(*argv: str) -> str:
        assert main(["inspect", *argv, "--redis-url", redis_server,
                     "--key-prefix", keys.prefix]) == 1, argv
        captured = capsys.readouterr()
        assert "r-shared" not in captured.out and len(captured.err.splitlines()) == 1, captured
        return captured.err

    for what in ("requests", "stats", "plans"):
        err = refused(what, "--instance", "zz")
        assert "no engine instance 'zz' is known" in err, err
        assert "no engine instance's scheduler beats now" in err, err
    r = redis.Redis.from_url(redis_server)
    for name in ("r1", "r0"):
        beat(r, name, keys)
    r.close()
    assert "the engine instances beating now: r0, r1" in refused("requests", "--instance", "zz")
    # a live instance with no keys of its own yet, and one whose keys outlived it: read
    assert main(["inspect", "requests", "--instance", "r0", "--redis-url", redis_server,
                 "--key-prefix", keys.prefix]) == 0
    capsys.readouterr()
    r = redis.Redis.from_url(redis_server)
    r.hset(keys.for_instance("old").stats, mapping={"num_requests_running": 0})
    r.close()
    assert main(["inspect", "stats", "--instance", "old", "--redis-url", redis_server,
                 "--key-prefix", keys.prefix]) == 0
    assert "num_requests_running" in capsys.readouterr().out


def test_a_reader_that_goes_away_ends_it_quietly(filled):
    """`pacer inspect stats | head`: a closed pipe is no traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "inspect", "stats",
                             "--redis-url", filled, "--key-prefix", KEYS.prefix],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()             # before it writes a line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and err == "", err


def _not_redis() -> socket.socket:
    """A listener that answers every connection as an HTTP server would."""
    server = socket.create_server(("127.0.0.1", 0))

    def answer():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return                  # closed: the test is over
            with conn:
                conn.recv(1024)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    threading.Thread(target=answer, daemon=True).start()
    return server


def test_a_redis_that_cannot_answer_gets_one_line_naming_why(redis_server, capsys):
    """Another application's keys under the prefix, a database the server lacks, something
    that is not Redis: one line each, not a traceback."""
    r = redis.Redis.from_url(redis_server)
    r.set("foreign:plans", "not a stream")
    r.set("foreign:stats", "not a hash")
    r.close()
    with _not_redis() as other:
        not_redis = f"redis://127.0.0.1:{other.getsockname()[1]}/0"
        cases = [
            (["plans", "--key-prefix", "foreign:"], redis_server,
             "holds a key under foreign: that pacer did not write (WRONGTYPE"),
            (["stats", "--key-prefix", "foreign:"], redis_server,
             "holds a key under foreign: that pacer did not write (WRONGTYPE"),
            (["plans"], redis_server.replace("/0", "/99"), "DB index is out of range"),
            (["plans"], not_redis, f"what answers at {not_redis} is not Redis"),
        ]
        for argv, url, needle in cases:
            assert main(["inspect", *argv, "--redis-url", url]) == 1, argv
            err = capsys.readouterr().err
            assert needle in err and len(err.splitlines()) == 1, (argv, err)
