"""Chaos with real processes: 32 concurrent greedy streams (every fourth under a grammar)
against `pacer up` while a worker is killed (-9), then the scheduler, then a worker is
stopped (SIGSTOP: alive, silent; pacer up's watchdog kills it), then Redis is restarted.

After a worker's or the scheduler's death every stream must end with exactly the text of an
undisturbed run (no token missing, none repeated); after Redis restarts (it keeps nothing)
every stream must either do that or end with an explicit error event, its text so far a prefix
of the undisturbed one, and 32 streams started once it is back must complete exactly. No stream
may stay open past STREAM_DEADLINE_S. `pytest -s` prints how long clients saw no tokens (the
recovery time).

Every prompt starts with the same preamble of several KV blocks, so streams admitted after
the first take it from the prefix cache, before and after each failure: a recovery must never
reuse a block whose content it cannot vouch for.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest
import redis

from scheduler_svc.cli import default_scheduler_id
from shared.keys import Keys
from shared.protocol import decode
from tests.served_fixture import Served, start_served, wait_healthy
from tests.sse_client import StreamResult, stream_completion

pytestmark = pytest.mark.slow

KEYS = Keys()
NUM_STREAMS = 32
MAX_TOKENS = 32
KILL_AFTER_CHUNKS = 4          # every stream has streamed this much before the kill
STREAM_DEADLINE_S = 150.0
WATCHDOG_S = 4.0               # --watchdog-s: a stopped worker is killed this long after
                               # its last heartbeat
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot",
           "The three primary colours are", "In 1969, the first person on the Moon"]


PREAMBLE = ("Answer in plain English, one short paragraph, no lists, no headings, and no "
            "apologies; if a question is unclear, guess the likeliest meaning and say so. ")


# every fourth stream under a grammar whose matcher a recovery must rebuild from the tokens
# (longer than MAX_TOKENS can reach, so those streams too end by length)
GRAMMAR = {"regex": "[a-z ,.]{600}"}


def body(i: int) -> dict:
    limits = {"structured_outputs": GRAMMAR} if i % 4 == 3 else {"ignore_eos": True}
    return {"model": "smollm2-135m", "prompt": f"{PREAMBLE}{PROMPTS[i % len(PROMPTS)]} ({i})",
            "max_tokens": MAX_TOKENS, "temperature": 0, **limits}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    # float32: recovery recomputes a stream's tokens in other batches, and only the float32
    # path is batch-invariant on every CPU (on AMX, oneDNN's bf16 GEMMs and the int4 GEMMs of
    # 40 rows or more are not; elsewhere the defaults are too: tests/test_batch_invariance.py)
    system = start_served(str(tmp_path_factory.mktemp("chaos") / "pacer-up.log"), "--dtype", "float32",
                          "--quantization", "none", "--watchdog-s", str(WATCHDOG_S))
    try:
        yield system
    finally:
        system.stop()


@pytest.fixture(scope="module")
def reference(served: Served) -> list[str]:
    results, _ = asyncio.run(run_streams(served, None))
    assert all(r.error is None and r.finish_reason == "length" for r in results)
    assert all(set(r.text) <= set("abcdefghijklmnopqrstuvwxyz ,.") for r in results[3::4])
    end = time.monotonic() + 5.0         # the stats hash is written on going idle
    while served.metrics().get("pacer:prefix_cache_hits_total", 0) == 0:
        assert time.monotonic() < end, "no stream took the preamble from the prefix cache"
        time.sleep(0.1)
    return [r.text for r in results]


def heartbeat_pid(s: Served, key: str) -> int:
    r = redis.Redis.from_url(s.redis_url)
    try:
        return decode(r.get(key)).extra["pid"]
    finally:
        r.close()


def redis_pid(s: Served) -> int:
    r = redis.Redis.from_url(s.redis_url)
    try:
        return r.info("server")["process_id"]
    finally:
        r.close()


async def run_streams(s: Served, kill) -> tuple[list[StreamResult], float | None]:
    """All streams at once; `kill()` runs once every stream has KILL_AFTER_CHUNKS chunks.
    Returns the results and when the kill happened (monotonic)."""
    killed_at: list[float] = []
    started = asyncio.Event()
    progress = [0] * NUM_STREAMS

    def seen(i: int, result: StreamResult) -> None:
        progress[i] = len(result.chunk_times)
        if min(progress) >= KILL_AFTER_CHUNKS:
            started.set()

    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(stream_completion(
            session, s.base_url, body(i), STREAM_DEADLINE_S,
            on_chunk=lambda r, i=i: seen(i, r))) for i in range(NUM_STREAMS)]
        if kill is not None:
            await asyncio.wait_for(started.wait(), STREAM_DEADLINE_S)
            killed_at.append(time.monotonic())
            kill()
        results = await asyncio.gather(*tasks)
    return results, (killed_at[0] if killed_at else None)


def stall_after(results: list[StreamResult], killed_at: float) -> float:
    """The longest time any stream went without a token, from the kill on."""
    gaps = [b - max(a, killed_at) for r in results
            for a, b in zip(r.chunk_times, r.chunk_times[1:]) if b > killed_at]
    return max(gaps, default=0.0)


def assert_exact(results: list[StreamResult], reference: list[str], s: Served) -> None:
    for i, (r, expected) in enumerate(zip(results, reference)):
        assert r.error is None, (i, r.error, s.log_tail())
        assert r.done and r.finish_reason == "length", (i, r)
        assert r.text == expected, (i, r.text, expected)


def restarts(s: Served, service: str) -> float:
    """`pacer:service_restarts_total` of `service`, as /metrics shows it."""
    status, body = s.get("/metrics")
    assert status == 200, body
    sample = f'pacer:service_restarts_total{{service="{service}"}} '
    return next((float(line[len(sample):]) for line in body.decode().splitlines()
                 if line.startswith(sample)), 0.0)


def test_a_killed_worker_is_restarted_and_every_stream_completes_exactly(served, reference):
    pid = heartbeat_pid(served, KEYS.hb_worker(0))
    before = restarts(served, "worker group")
    results, killed_at = asyncio.run(run_streams(served, lambda: os.kill(pid, signal.SIGKILL)))
    assert_exact(results, reference, served)
    assert heartbeat_pid(served, KEYS.hb_worker(0)) != pid
    assert restarts(served, "worker group") == before + 1      # counted in /metrics
    # the scheduler's line names the requests it recomputed (an operator follows them by id)
    with open(served.log_path, encoding="utf-8", errors="replace") as f:
        lost = [json.loads(line[line.index("{"):]) for line in f
                if '"worker group lost; recomputing running requests"' in line]
    assert lost and lost[-1]["recomputed"] == len(lost[-1]["request_ids"]) > 0, lost
    assert set(lost[-1]["request_ids"]) <= {r.response_id for r in results}, lost[-1]
    print(f"\nworker kill -9: streams stalled {stall_after(results, killed_at):.2f} s "
          "(restart + model load + recompute), then all 32 completed exactly")
    wait_healthy(served)


def test_a_killed_scheduler_is_restarted_and_every_stream_completes_exactly(served, reference):
    wait_healthy(served)
    pid = heartbeat_pid(served, KEYS.hb_scheduler(default_scheduler_id(None)))
    results, killed_at = asyncio.run(run_streams(served, lambda: os.kill(pid, signal.SIGKILL)))
    assert_exact(results, reference, served)
    print(f"\nscheduler kill -9: streams stalled {stall_after(results, killed_at):.2f} s "
          "(restart + take-over from the progress records), then all 32 completed exactly")
    wait_healthy(served)


def test_a_stopped_worker_is_killed_and_restarted_and_every_stream_completes_exactly(
        served, reference):
    """SIGSTOP: the worker's process lives but runs no more (as a hung one): without the
    watchdog every stream would wait for it forever."""
    wait_healthy(served)
    pid = heartbeat_pid(served, KEYS.hb_worker(0))
    results, stopped_at = asyncio.run(run_streams(served, lambda: os.kill(pid, signal.SIGSTOP)))
    assert_exact(results, reference, served)
    assert heartbeat_pid(served, KEYS.hb_worker(0)) != pid
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)                     # killed, not merely left stopped
    print(f"\nworker stopped: streams stalled {stall_after(results, stopped_at):.2f} s "
          f"(--watchdog-s {WATCHDOG_S:g} + restart + model load + recompute), then all 32 "
          "completed exactly")
    wait_healthy(served)


def test_a_redis_restart_ends_every_stream_completed_or_with_an_error(served, reference):
    wait_healthy(served)
    pid = redis_pid(served)
    results, killed_at = asyncio.run(run_streams(served, lambda: os.kill(pid, signal.SIGKILL)))
    ended = [time.monotonic() - killed_at for r in results if r.error is not None]
    for i, (r, expected) in enumerate(zip(results, reference)):
        assert r.done, (i, r)
        if r.error is None:
            assert r.text == expected, (i, r.text, expected)
        else:
            assert expected.startswith(r.text), (i, r.text, expected)
    wait_healthy(served)
    back = time.monotonic() - killed_at
    assert redis_pid(served) != pid
    # as many streams as before at once: every connection the services pooled before the
    # restart leads to the dead server, and none of them may cost a request
    after, _ = asyncio.run(run_streams(served, None))
    assert_exact(after, reference, served)
    print(f"\nredis restart: {len(ended)} streams ended with an error event "
          f"(the last {max(ended, default=0.0):.2f} s after the kill), "
          f"{NUM_STREAMS - len(ended)} completed; healthy again {back:.2f} s after the kill; "
          f"then {NUM_STREAMS} new streams completed exactly")
