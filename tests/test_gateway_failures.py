"""The gateway's upstream, token router and replica router against a real redis-server whose
keys are broken or whose data is odd: each request still ends, or is routed, instead of
hanging or failing every other one."""
from __future__ import annotations

import redis.asyncio as aioredis
import pytest_asyncio

from gateway.streams import TokenRouter
from gateway.upstream import ENTRY_CHECK_S, REQUEST_LOST, Upstream
from shared.keys import Keys
from tests.redis_fixture import redis_server  # noqa: F401  (the fixture)

KEYS = Keys("gwfail:")


@pytest_asyncio.fixture
async def redis(redis_server: str):
    client = aioredis.Redis.from_url(redis_server)
    await client.flushdb()
    yield client
    await client.aclose()


def quiet_stream(router: TokenRouter, request_id: str, key: str, entry_id: bytes):
    stream = router.open(request_id)
    stream.entry = (key, entry_id)
    stream.last_event_at -= 2 * ENTRY_CHECK_S
    return stream


async def test_an_entry_whose_stream_key_now_holds_another_type_is_lost(redis) -> None:
    """The request stream was deleted and its name reused for a string: the request's entry
    is gone as surely as if it were deleted. The lookup failed with WRONGTYPE before, every
    time, so that request waited forever, and so did those in other streams looked up with it."""
    upstream = Upstream(redis, KEYS, "gw")
    router = TokenRouter(redis, upstream.reply_to)
    kept_id = await redis.xadd("gwfail:kept", {"f": "v"})
    gone_id = await redis.xadd("gwfail:reused", {"f": "v"})
    await redis.delete("gwfail:reused")
    await redis.set("gwfail:reused", "a string now")
    kept = quiet_stream(router, "kept", "gwfail:kept", kept_id)
    gone = quiet_stream(router, "gone", "gwfail:reused", gone_id)

    assert await upstream.check_entries(router) == 1
    _, finish = await gone.next()
    assert finish.finish_reason == "error" and finish.error == REQUEST_LOST
    assert kept.finish is None
