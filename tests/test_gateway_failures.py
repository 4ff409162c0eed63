"""The gateway's upstream, token router and replica router against a real redis-server whose
keys are broken or whose data is odd: each request still ends, or is routed, instead of
hanging or failing every other one."""
from __future__ import annotations

import asyncio

import msgpack
import pytest
import pytest_asyncio
import redis as redis_sync
import redis.asyncio as aioredis

from gateway.router import ReplicaRouter
from gateway.streams import TokenRouter
from gateway.upstream import ENTRY_CHECK_S, REQUEST_LOST, Upstream
from shared.keys import Keys
from shared.protocol import SCHEMA_VERSION, FinishEvent, encode
from shared.sampling import SamplingParams
from tests.redis_fixture import lose_a_reply, redis_server  # noqa: F401  (the fixture)

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


async def test_a_submit_retried_after_its_reply_was_lost_has_its_entry_checked(
        redis, monkeypatch) -> None:
    """The connection breaks after Redis ran a submit's script: the retry is refused as a
    repeat, and now learns where the first try's entry is, so the request is checked for a
    lost entry like any other. Before, the repeat returned no entry id, the quiet streams'
    lookup skipped the request, and once its entry was gone its client waited forever."""
    lost = lose_a_reply(monkeypatch, "EVALSHA")
    upstream = Upstream(redis, KEYS, "gw")
    router = TokenRouter(redis, upstream.reply_to)
    stream = router.open("retried")
    stream.redis_run_id, stream.entry = await upstream.submit(
        "retried", [1, 2, 3], SamplingParams(max_tokens=2), 0.0)
    assert lost
    (entry_id, _), = await redis.xrange(KEYS.requests)
    assert stream.entry == (KEYS.requests, entry_id)
    stream.last_event_at -= 2 * ENTRY_CHECK_S
    assert await upstream.check_entries(router) == 0        # still there: left queued
    await redis.xdel(KEYS.requests, entry_id)               # then lost (trimmed, evicted)
    assert await upstream.check_entries(router) == 1
    _, finish = await stream.next()
    assert finish.finish_reason == "error" and finish.error == REQUEST_LOST


async def test_a_request_a_scheduler_acked_without_an_answer_ends_with_an_error(redis) -> None:
    """A scheduler of a release that drops a request it cannot read (another protocol
    version) in silence reads its entry and acks it, and publishes nothing: the entry stays in
    the stream, so the lookup for lost entries found it, and its client waited until its
    timeout (forever without one). Found acked at two checks in a row with no finish event,
    it ends with an error naming the scheduler of the other version; one still queued, or
    read and being served (pending), or whose finish event came after the ack, waits on."""
    import msgpack

    upstream = Upstream(redis, KEYS, "gw")
    router = TokenRouter(redis, upstream.reply_to)
    await redis.xgroup_create(KEYS.requests, KEYS.requests_group, id="0", mkstream=True)
    streams = {}
    for rid in ("dropped", "answered", "served", "queued"):
        streams[rid] = stream = router.open(rid)
        stream.redis_run_id, stream.entry = await upstream.submit(
            rid, [1, 2, 3], SamplingParams(max_tokens=2), 0.0)
        stream.last_event_at -= 2 * ENTRY_CHECK_S
    # the old scheduler reads three, acks two of them and answers one of those
    read = await redis.xreadgroup(KEYS.requests_group, "old", {KEYS.requests: ">"}, count=3)
    ids = [entry_id for entry_id, _ in read[0][1]]
    await redis.xack(KEYS.requests, KEYS.requests_group, ids[0], ids[1])
    old = msgpack.packb({"v": SCHEMA_VERSION - 1, "kind": "heartbeat", "service": "scheduler",
                         "id": "old", "time": 0.0, "extra": {}})
    await redis.set(KEYS.hb_scheduler("old"), old)
    reader = asyncio.create_task(upstream.keep_schedulers_read())
    try:
        while not upstream.other_versions:
            await asyncio.sleep(0.01)
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)

    assert await upstream.check_entries(router) == 0     # a finish may be on its way
    streams["answered"].push(FinishEvent("answered", "length", 3, 0))
    await streams["answered"].next()
    assert await upstream.check_entries(router) == 1
    _, finish = await streams["dropped"].next()
    assert finish.finish_reason == "error" and finish.error.startswith(
        "a scheduler took the request from Redis's request stream and dropped it without an "
        "answer"), finish.error
    assert (f"speaks protocol version {SCHEMA_VERSION - 1}, this gateway version "
            f"{SCHEMA_VERSION}") in finish.error
    assert streams["answered"].finish.finish_reason == "length"
    assert streams["served"].finish is None and streams["queued"].finish is None
    assert await upstream.check_entries(router) == 0


@pytest.mark.parametrize("policy", ["prefix", "least-loaded"])
async def test_a_replicas_odd_stats_or_a_key_of_another_type_does_not_refuse_requests(
        redis, policy: str) -> None:
    """The router's reads are hints: a stats hash holding nan or inf, or a stats or cached
    blocks key holding another type, routes without that hint. Before, the first failed
    every request with a 500 (int() of nan) and the second with a 503 naming WRONGTYPE."""
    r0, r1 = KEYS.for_instance("r0"), KEYS.for_instance("r1")
    await redis.hset(r0.stats, mapping={"num_requests_running": "nan", "block_size": "inf",
                                        "kv_cache_usage_perc": "-inf"})
    await redis.hset(r1.stats, mapping={"num_requests_waiting": "inf", "block_size": "4"})
    router = ReplicaRouter(redis, KEYS, [("r0", 1), ("r1", 1)], policy)
    assert await router.choose("odd-stats", list(range(40))) in ("r0", "r1")

    await redis.delete(r0.stats)
    await redis.set(r0.stats, "not a hash")
    await redis.set(r1.cached_blocks, "not a set")
    router = ReplicaRouter(redis, KEYS, [("r0", 1), ("r1", 1)], policy)
    assert [await router.choose(f"wrong-type-{i}", list(range(40))) for i in range(2)]
    assert router.block_size == 4      # learnt whatever the policy (P/D's short prompts need it)


async def test_a_malformed_token_message_is_dropped_and_the_listener_goes_on(redis) -> None:
    """A token batch that decodes but names a request by a list, not a string: routing it
    raised TypeError, which ended the listener task silently, and every stream open then or
    later waited forever for its events."""
    router = TokenRouter(redis, "gwfail:tokens:gw")
    stream = router.open("r1")
    task = asyncio.create_task(router.run())
    try:
        await asyncio.wait_for(router.subscribed.wait(), 10)
        await redis.publish(router.channel, msgpack.packb({
            "v": SCHEMA_VERSION, "kind": "token_batch", "events": [[["r1"], 0, 7, None, None]]}))
        await redis.publish(router.channel, encode(FinishEvent("r1", "length", 3, 0)))
        _, finish = await asyncio.wait_for(stream.next(), 10)
        assert finish.finish_reason == "length"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class PausingRouter(TokenRouter):
    """Pauses Redis as the heartbeat loop starts looking up the quiet streams' entries: it
    stalls between the heartbeat's reply and the lookup's."""

    def __init__(self, redis, channel: str, admin: redis_sync.Redis) -> None:
        super().__init__(redis, channel)
        self.admin, self.paused = admin, False

    def quiet(self, for_s: float):
        if not self.paused:
            self.paused = True
            self.admin.execute_command("CLIENT", "PAUSE", str(int(PAUSE_S * 1000)), "ALL")
        return super().quiet(for_s)


PAUSE_S = 8.0


async def test_a_redis_that_stalls_during_the_entry_lookup_ends_the_streams_as_soon(
        redis, redis_server: str) -> None:
    """The entry lookup waited for the pool's socket timeout (10 s), holding the heartbeat
    loop: a Redis that stalled just then ended no stream until the stall was over. Bounded as
    the heartbeat's reply is, the streams end ~REDIS_UNREACHABLE_S after it stalled."""
    client = aioredis.Redis.from_url(redis_server, socket_timeout=10)
    admin = redis_sync.Redis.from_url(redis_server)
    upstream = Upstream(client, KEYS, "gw")
    router = PausingRouter(client, upstream.reply_to, admin)
    entry_id = await redis.xadd("gwfail:requests", {"f": "v"})
    stream = quiet_stream(router, "queued", "gwfail:requests", entry_id)
    task = asyncio.create_task(upstream.keep_heartbeat_watching_redis(router))
    try:
        _, finish = await asyncio.wait_for(stream.next(), PAUSE_S - 1.5)
        assert finish.error == "Redis does not answer (stalled); the request cannot complete"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()
        admin.close()
