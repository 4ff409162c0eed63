"""Request-stream entries that no gateway wrote: anyone with access to Redis can XADD to the
request stream (redis-cli, a script), and the scheduler must survive what they write. The
real gateway, scheduler service and worker rank 0's plan loop on a tiny model, in this
process, over a real redis-server (the harness of `tests/test_redis_restart.py`)."""
from __future__ import annotations

import asyncio
import time

import msgpack
import redis.asyncio as aioredis

from shared.protocol import (STREAM_FIELD, AbortMsg, FinishEvent, RequestMsg, decode,
                             encode)
from shared.sampling import SamplingParams
from tests.test_redis_restart import (DEADLINE_S, KEYS, assert_complete, complete, running,
                                      server, tiny_model)  # noqa: F401  (fixtures)

CHANNEL = "test:hand-written"


def entry(request_id: str, **fields) -> dict:
    """A request's stream fields as a person would write them, `fields` overriding."""
    body = msgpack.unpackb(encode(RequestMsg(request_id, [5, 6, 7], SamplingParams(max_tokens=4),
                                             CHANNEL, "by-hand", time.time())))
    body.update(fields)
    return {STREAM_FIELD: msgpack.packb(body)}


async def test_hand_written_entries_are_refused_and_serving_goes_on(server, tiny_model):
    """A deadline that is not a number crashed the scheduler (restarted, it took the entry
    back and crashed again until `pacer up` gave up), as did a reply channel Redis refuses;
    a token id outside the vocabulary took the worker group down each time it ran. Now the
    first two are dropped with an error logged and acked, the others answered with an error
    naming the id, and the streams around them complete as before."""
    async with running(server, tiny_model) as s:
        reference = [r.text for r in await complete(s, 2)]
        admin = aioredis.Redis.from_url(server.url)
        pubsub = admin.pubsub()
        await pubsub.subscribe(CHANNEL)
        try:
            await admin.xadd(KEYS.requests, entry("deadline", deadline="soon"))
            await admin.xadd(KEYS.requests, entry("no-channel", reply_to=None))
            await admin.xadd(KEYS.requests, entry("big-id", prompt_token_ids=[5, 10**6]))
            bias = SamplingParams(max_tokens=4, logit_bias={10**6: 1.0}).to_dict()
            await admin.xadd(KEYS.requests, entry("big-bias", sampling=bias))
            finishes: dict[str, FinishEvent] = {}

            async def answers() -> None:
                while len(finishes) < 2:
                    message = await pubsub.get_message(ignore_subscribe_messages=True,
                                                       timeout=1.0)
                    if message is not None:
                        event = decode(message["data"])
                        finishes[event.request_id] = event
            await asyncio.wait_for(answers(), DEADLINE_S)
            for rid, param in (("big-id", "prompt_token_ids"), ("big-bias", "logit_bias")):
                assert finishes[rid].finish_reason == "error", finishes[rid]
                assert finishes[rid].error_type == "invalid_request_error", finishes[rid]
                assert f"{param}: token id 1000000 is outside the vocabulary" in \
                    finishes[rid].error, finishes[rid]
            assert_complete(await complete(s, 2), reference)
            # every hand-written entry was acked: none waits to be taken back by a restart
            assert (await admin.xpending(KEYS.requests, KEYS.requests_group))["pending"] == 0
        finally:
            await pubsub.aclose()
            await admin.aclose()


async def test_an_abort_written_by_hand_with_a_bad_id_leaves_the_streams_running(server,
                                                                                tiny_model):
    """An abort whose request id is not a string (a list) crashed the scheduler reading it,
    and each restart read it again (a scheduler reads the aborts from before its oldest
    request), until its requests were dropped as if they stopped it. Now it is dropped with an
    error logged, and the streams it came among complete as before."""
    async with running(server, tiny_model) as s:
        reference = [r.text for r in await complete(s, 2)]
        admin = aioredis.Redis.from_url(server.url)

        async def bad_abort() -> None:
            body = msgpack.unpackb(encode(AbortMsg("x", "by hand")))
            await admin.xadd(KEYS.aborts, {STREAM_FIELD: msgpack.packb({**body,
                                                                      "request_id": [1, 2]})})
        try:
            assert_complete(await complete(s, 2, bad_abort), reference)
        finally:
            await admin.aclose()
