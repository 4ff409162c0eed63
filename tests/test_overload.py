"""Overload and deadlines against a real `pacer up` (2 running requests at most, 3 waiting):
beyond the bound the gateway answers 429 with Retry-After at once; a request past its
deadline ends with a timeout error and gives its KV blocks back; nothing is left in Redis.
"""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
import redis

from shared.keys import Keys
from tests.served_fixture import Served, start_served
from tests.sse_client import post_json, stream_completion

pytestmark = pytest.mark.slow

KEYS = Keys()
MAX_WAITING = 3
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    system = start_served(str(tmp_path_factory.mktemp("overload") / "pacer-up.log"),
                          "--max-num-seqs", "2", "--max-waiting-requests", str(MAX_WAITING))
    try:
        yield system
    finally:
        system.stop()


def long_body(**kw) -> dict:
    return {"model": "smollm2-135m", "prompt": "Tell me a long story about a lighthouse.",
            "max_tokens": 48, "temperature": 0, "ignore_eos": True, **kw}


def wait_idle(s: Served, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        m = s.metrics()
        if m.get("pacer:num_requests_running") == 0 and m.get("pacer:kv_cache_usage_perc") == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"scheduler not idle within {timeout_s} s: {s.metrics()}")


def progress_keys(s: Served) -> list[bytes]:
    r = redis.Redis.from_url(s.redis_url)
    try:
        return list(r.scan_iter(match=KEYS.progress_pattern))
    finally:
        r.close()


def test_a_full_queue_answers_429_with_retry_after_at_once(served: Served):
    answered: list[tuple[float, int]] = []

    async def one(session: aiohttp.ClientSession):
        result = await stream_completion(session, served.base_url, long_body(), DEADLINE_S)
        answered.append((time.monotonic(), result.status))
        return result

    async def burst():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session) for _ in range(12)))

    results = asyncio.run(burst())
    refused = [r for r in results if r.status == 429]
    served_ok = [r for r in results if r.status == 200]
    assert refused and served_ok and len(refused) + len(served_ok) == len(results)
    for r in refused:
        assert r.headers["Retry-After"] == "1"
        assert r.body["error"]["type"] == "rate_limit_error"
    for r in served_ok:
        assert r.error is None and r.finish_reason == "length", r
    # refusals come back at once, before any accepted stream could finish
    first_completed = min(t for t, status in answered if status == 200)
    assert all(t < first_completed for t, status in answered if status == 429)
    print(f"\n12 at once, --max-num-seqs 2 --max-waiting-requests {MAX_WAITING}: "
          f"{len(served_ok)} served, {len(refused)} answered 429")
    wait_idle(served)
    assert served.metrics()["pacer:requests_rejected_total"] == len(refused)


def test_each_choice_takes_a_place_in_the_queue(served: Served):
    """n choices are n requests upstream: more than the queue holds is a 400 (it could never
    be admitted), as many as it holds are served."""
    async def go(n: int):
        async with aiohttp.ClientSession() as session:
            return await post_json(session, served.base_url, "/v1/completions",
                                   long_body(max_tokens=4, n=n))

    wait_idle(served)
    status, body, _ = asyncio.run(go(MAX_WAITING + 1))
    assert status == 400 and body["error"]["param"] == "n", body
    status, body, _ = asyncio.run(go(MAX_WAITING))
    assert status == 200 and len(body["choices"]) == MAX_WAITING, body
    assert body["usage"]["completion_tokens"] == 4 * MAX_WAITING


def test_a_streaming_request_past_its_deadline_ends_with_a_timeout_error(served: Served):
    async def go():
        async with aiohttp.ClientSession() as session:
            return await stream_completion(
                session, served.base_url, long_body(max_tokens=1500, timeout=1.5), DEADLINE_S)

    started = time.monotonic()
    result = asyncio.run(go())
    assert result.status == 200 and result.done
    assert result.error is not None and result.error["type"] == "timeout_error", result
    assert result.text                         # it streamed until the deadline
    print(f"\ndeadline 1.5 s: the stream ended with a timeout error after "
          f"{time.monotonic() - started:.2f} s")
    wait_idle(served)


def test_a_non_streaming_request_past_its_deadline_is_a_408(served: Served):
    async def go():
        async with aiohttp.ClientSession() as session:
            return await post_json(session, served.base_url, "/v1/completions",
                                   long_body(max_tokens=1500, timeout=1.0))

    status, body, _ = asyncio.run(go())
    assert status == 408 and body["error"]["type"] == "timeout_error", body
    wait_idle(served)


def test_nothing_is_left_in_redis_once_requests_end(served: Served):
    wait_idle(served)
    assert progress_keys(served) == []
    r = redis.Redis.from_url(served.redis_url)
    try:
        groups = r.xinfo_groups(KEYS.requests)
        assert [g["pending"] for g in groups] == [0]
    finally:
        r.close()
