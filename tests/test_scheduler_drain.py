"""A scheduler told to stop (SIGTERM: a rolling restart) while a stream runs: it drains for
`--drain-timeout` at most, leaves what is unfinished pending in its consumer group, and the
scheduler started in its place under the same name finishes it. The real gateway, scheduler
service and worker plan loop of tests/test_redis_restart.py, over a real redis-server, with
a model slowed down so that the stream outlasts the drain by far.
"""
from __future__ import annotations

import asyncio

import aiohttp

from scheduler_svc.build import build_scheduler
from scheduler_svc.service import SchedulerServiceConfig
from scheduler_svc.service import serve as serve_scheduler
from shared.lifecycle import cancel_tasks, connect_redis
from tests.sse_client import stream_completion
from tests.test_redis_restart import (DEADLINE_S, KEYS, MODEL_NAME, running,  # noqa: F401
                                      server, tiny_model)

SCHEDULER_ID = "scheduler-drained"
MAX_TOKENS = 900           # ~45 s at PLAN_DELAY_S a token: far past the drain timeout
PLAN_DELAY_S = 0.05


async def test_a_stopped_scheduler_leaves_within_its_drain_timeout(server, tiny_model):
    """With overlap (the default) a plan was always in flight while a request ran, and the
    drain deadline was only looked at with none: a scheduler drained until its requests
    finished, however long, whatever `--drain-timeout` said."""
    config = SchedulerServiceConfig(scheduler_id=SCHEDULER_ID, drain_timeout_s=0.5)
    async with running(server, tiny_model, config) as s, aiohttp.ClientSession() as session:
        body = {"model": MODEL_NAME, "prompt": "the story of a long drain is",
                "temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
        reference = await stream_completion(session, s.base_url, body, DEADLINE_S)
        started = asyncio.Event()
        s.gate.delay_s = PLAN_DELAY_S
        stream = asyncio.create_task(stream_completion(
            session, s.base_url, body, 3 * DEADLINE_S,
            on_chunk=lambda r: len(r.chunk_times) >= 2 and started.set()))
        await asyncio.wait_for(started.wait(), DEADLINE_S)
        s.stop.set()
        assert await asyncio.wait_for(s.scheduler, DEADLINE_S) == 0
        with server.client() as admin:
            pending = admin.xpending(KEYS.requests, "schedulers")["pending"]
        assert pending == 1 and not stream.done(), \
            "the scheduler drained until the request finished"

        # its successor, under the same name, takes the request back and finishes it
        s.gate.delay_s = 0.0
        successor_redis = await connect_redis(server.url)
        successor = asyncio.create_task(serve_scheduler(
            successor_redis, KEYS, build_scheduler(s.engine.layout), config, asyncio.Event()))
        try:
            result = await asyncio.wait_for(stream, 3 * DEADLINE_S)
        finally:
            await cancel_tasks(successor)
            await successor_redis.aclose()
        assert result.error is None and result.done and result.finish_reason == "length", result
        assert result.text == reference.text
