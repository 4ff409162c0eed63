"""Cache-aware routing between data-parallel replicas (docs/design.md#cache-aware-routing):
the router's choice on crafted sets of candidates, the same choice read from a real Redis
(published block hash sets, stats hashes), and the core's index changes turned into the
set a replica publishes."""
from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from gateway.router import (DECODE_TOKENS, Candidate, ReplicaRouter, leading,
                            pick)
from scheduler_svc.cached_blocks import queue_block_events
from scheduler_svc.core import BlockManager, Request
from shared.keys import Keys
from shared.lifecycle import scheduler_heartbeats
from shared.prefix_hash import block_hashes, cacheable_hashes
from shared.protocol import Heartbeat, encode, from_fields
from shared.sampling import SamplingParams
from tests.redis_fixture import lose_a_reply, redis_server  # noqa: F401


# ---- the choice, on crafted candidates -----------------------------------------------------

def test_the_longest_cached_prefix_wins_at_equal_load():
    cands = [Candidate("r0", 0, 2), Candidate("r1", 512, 2), Candidate("r2", 256, 2)]
    assert pick("prefix", cands, 1000, turn=0) == 1
    assert pick("prefix", cands, 1000, turn=2) == 1        # whoever's turn it is


def test_a_prefix_sticks_to_its_replica_through_a_passing_queue():
    # r1 holds 512 of 1000 tokens and has 700 more tokens of work queued: weighed alone,
    # 1000 + 100 < 488 + 800 would move the prefix; it stays, r1 not being overloaded
    cands = [Candidate("r0", 0, 1, queued_tokens=100), Candidate("r1", 512, 4, queued_tokens=800)]
    assert pick("prefix", cands, 1000, turn=0) == 1
    # clearly overloaded (13 requests in flight > 2 x 4 + 4): the cost decides, and r0 is cheaper
    cands = [Candidate("r0", 0, 4, queued_tokens=100),
             Candidate("r1", 512, 13, queued_tokens=3000)]
    assert pick("prefix", cands, 1000, turn=0) == 0
    # at 12 (= 2 x 4 + 4) it is not yet
    cands = [Candidate("r0", 0, 4, queued_tokens=100),
             Candidate("r1", 512, 12, queued_tokens=3000)]
    assert pick("prefix", cands, 1000, turn=0) == 1


def test_a_short_lead_is_weighed_against_the_work_queued():
    # r1's cached prefix covers less than half the prompt: the cost decides (1100 < 1600)
    cands = [Candidate("r0", 0, 1, queued_tokens=100), Candidate("r1", 400, 2, queued_tokens=1000)]
    assert pick("prefix", cands, 1000, turn=0) == 0
    # ...and with little queued there it still wins (600 + 100 < 1000 + 100)
    cands = [Candidate("r0", 0, 1, queued_tokens=100), Candidate("r1", 400, 2, queued_tokens=100)]
    assert pick("prefix", cands, 1000, turn=0) == 1


def test_a_prefix_cached_on_two_replicas_goes_to_the_less_busy_one():
    # the same 960 tokens on r0 and r2: neither leads, the cost picks the one with less queued
    cands = [Candidate("r0", 960, 5, queued_tokens=900), Candidate("r1", 0, 2),
             Candidate("r2", 960, 3, queued_tokens=300)]
    assert pick("prefix", cands, 1000, turn=0) == 2
    # a longer match on r0 (a later turn of the same chat) leads by 512 of 1000: r0
    cands = [Candidate("r0", 960, 5, queued_tokens=900), Candidate("r1", 0, 2),
             Candidate("r2", 448, 3, queued_tokens=300)]
    assert pick("prefix", cands, 1000, turn=0) == 0
    # ...unless r0 is clearly overloaded (5 > 2 x 0 + 4 with an idle r1)
    cands[1] = Candidate("r1", 0, 0)
    assert pick("prefix", cands, 1000, turn=0) == 2


def test_with_nothing_cached_prefix_routing_takes_the_least_work():
    cands = [Candidate("r0", 0, 1, queued_tokens=500), Candidate("r1", 0, 3, queued_tokens=100),
             Candidate("r2", 0, 2, queued_tokens=300)]
    assert pick("prefix", cands, 100, turn=0) == 1
    assert pick("least-loaded", cands, 100, turn=0) == 0       # it counts requests


def test_a_full_kv_cache_counts_as_load():
    cands = [Candidate("r0", 512, 1, kv_usage=1.0), Candidate("r1", 0, 1, kv_usage=0.2)]
    assert pick("prefix", cands, 600, turn=0) == 1
    cands = [Candidate("r0", 512, 1, kv_usage=0.5), Candidate("r1", 0, 1, kv_usage=0.2)]
    assert pick("prefix", cands, 600, turn=0) == 0
    # over 90 % the holder is no longer sticky, but the prefix may still be worth the wait
    cands = [Candidate("r0", 1024, 1, kv_usage=0.92), Candidate("r1", 0, 1, kv_usage=0.2)]
    assert pick("prefix", cands, 1100, turn=0) == 0


def test_new_prefixes_spread_and_then_stick():
    """A burst as the shared-prefix bench sends it (16 requests, 7 system prompts of 1,024
    tokens + 64): played through the router's bookkeeping with nothing finishing, each
    prefix ends up on one replica only, and the replicas get prefixes alike."""
    seq = [0, 1, 2, 3, 2, 4, 3, 5, 1, 0, 5, 5, 6, 6, 1, 1]
    where: dict[int, int] = {}
    queued, load = [0, 0], [0, 0]
    for turn, p in enumerate(seq):
        cands = [Candidate(f"r{i}", 1024 if where.get(p) == i else 0, load[i],
                           queued_tokens=queued[i]) for i in range(2)]
        i = pick("prefix", cands, 1088, turn)
        assert where.setdefault(p, i) == i, f"prefix {p} moved at request {turn}"
        queued[i] += 1088 - cands[i].cached_tokens
        load[i] += 1
    prefixes_on = [sum(1 for r in where.values() if r == i) for i in range(2)]
    assert sorted(prefixes_on) == [3, 4]


def test_ties_and_round_robin_take_turns():
    cands = [Candidate("r0"), Candidate("r1"), Candidate("r2")]
    assert [pick("round-robin", cands, 10, t) for t in range(4)] == [0, 1, 2, 0]
    assert [pick("least-loaded", cands, 10, t) for t in range(3)] == [0, 1, 2]
    assert [pick("prefix", cands, 10, t) for t in range(3)] == [0, 1, 2]
    # least-loaded ignores the cache; prefix does not
    cands = [Candidate("r0", 0, 1), Candidate("r1", 64, 1)]
    assert pick("least-loaded", cands, 100, 0) == 0 and pick("prefix", cands, 100, 0) == 1
    with pytest.raises(ValueError):
        pick("random", cands, 10, 0)


def test_leading_counts_only_the_unbroken_run():
    assert leading([1, 1, 0, 1]) == 2 and leading([]) == 0 and leading([0, 1]) == 0


# ---- the same, read from Redis -------------------------------------------------------------

BLOCK = 4
SYSTEM = list(range(100, 132))                         # 8 full blocks of a shared prefix


def test_the_router_reads_published_sets_and_remembers_what_it_sent(redis_server):
    keys = Keys("rt:")
    r0, r1 = keys.for_instance("r0"), keys.for_instance("r1")
    sync = redis.Redis.from_url(redis_server)
    for k in (r0, r1):
        sync.hset(k.stats, mapping={"num_requests_running": 0, "num_requests_waiting": 0,
                                    "kv_cache_usage_perc": 0.1, "block_size": BLOCK})
    # r1 published the system prompt's blocks; r0 holds an unrelated prefix
    sync.sadd(r1.cached_blocks, *block_hashes(SYSTEM, BLOCK))
    sync.sadd(r0.cached_blocks, *block_hashes(list(range(500, 532)), BLOCK))

    async def scenario() -> list[str]:
        client = aioredis.Redis.from_url(redis_server)
        router = ReplicaRouter(client, keys, [("r0", 1), ("r1", 1)], "prefix")
        try:
            chosen = [await router.choose("learn", [1, 2, 3])]       # learns the block size
            assert router.block_size == BLOCK
            router.ended("learn")
            chosen.append(await router.choose("a", SYSTEM + [7, 8, 9, 10, 11]))
            # "a" counts for its 5 uncached tokens on r1 until its first token
            assert router._queued == [0, 5]
            # a new prefix nobody holds: the least work queued (r0)
            fresh = list(range(900, 940))
            chosen.append(await router.choose("b", fresh + [1]))
            # the same new prefix again, before anyone published it: follows "b"
            chosen.append(await router.choose("c", fresh + [2, 3]))
            assert router._queued == [41 + 2, 5]
            router.prefilled("b")
            router.prefilled("b")                                   # once is enough
            assert router._queued == [DECODE_TOKENS + 2, 5]
            for rid in ("a", "b", "c"):
                router.ended(rid)
            assert router._outstanding == [0, 0] and router._queued == [0, 0]
            return chosen
        finally:
            await client.aclose()

    chosen = asyncio.run(scenario())
    assert chosen[1:] == ["r1", "r0", "r0"]
    sync.close()


def test_the_first_prompt_a_router_sees_is_hashed_and_remembered(redis_server):
    """The block size is read before the first prompt is hashed: the first request of a new
    prefix is remembered, so the second follows it while nothing is published yet (learnt
    from the same round trip's replies, it went unhashed, and the second, its replica busy
    with the first, went to the other)."""
    keys = Keys("rt1:")
    sync = redis.Redis.from_url(redis_server)
    for k in (keys.for_instance("r0"), keys.for_instance("r1")):
        sync.hset(k.stats, mapping={"num_requests_running": 0, "num_requests_waiting": 0,
                                    "kv_cache_usage_perc": 0.1, "block_size": BLOCK})
    sync.close()
    fresh = list(range(900, 940))

    async def scenario() -> list[str]:
        client = aioredis.Redis.from_url(redis_server)
        router = ReplicaRouter(client, keys, [("r0", 1), ("r1", 1)], "prefix")
        try:
            return [await router.choose("first", fresh + [1]),
                    await router.choose("second", fresh + [2])]
        finally:
            await client.aclose()

    first, second = asyncio.run(scenario())
    assert second == first


@pytest.mark.parametrize("policy", ["round-robin", "least-loaded", "prefix"])
def test_a_prompt_a_decode_instance_prefills_loads_no_prefill_instance(redis_server, policy):
    """P/D with several prefill instances: a prompt under their --disagg-min-prompt-tokens
    (their stats hashes say it) is prefilled by the decode instance it is handed to. The
    router names no prefill instance for it (whichever prefill scheduler reads it hands it
    over) and counts it nowhere. Before, it counted at the one chosen until its first token,
    which may wait for a decode instance's seat (so that one looked loaded by work it never
    does), and the scheduler reading it first forwarded it there. Replicas publish no such
    threshold: every prompt is routed."""
    keys = Keys(f"rtd{policy}:")
    sync = redis.Redis.from_url(redis_server)
    for inst in ("p0", "p1"):
        sync.hset(keys.for_instance(inst).stats, mapping={
            "num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0.0,
            "block_size": BLOCK, "disagg_min_prompt_tokens": 16})
    idle_stats(sync, keys)                                  # replicas r0, r1
    sync.close()

    async def scenario() -> tuple[list[str], list[str]]:
        client = aioredis.Redis.from_url(redis_server)
        pd = ReplicaRouter(client, keys, [("p0", 1), ("p1", 1)], policy)
        replicas = ReplicaRouter(client, keys, [("r0", 1), ("r1", 1)], policy)
        try:
            got = [await pd.choose(f"short{i}", list(range(15))) for i in range(3)]
            assert pd._outstanding == [0, 0] and pd._queued == [0, 0] and pd.chosen == [0, 0]
            pd.prefilled("short0", "d0")
            pd.ended("short0")
            assert pd._outstanding == [0, 0] and pd._queued == [0, 0]
            got.append(await pd.choose("long", list(range(16))))
            assert sum(pd._outstanding) == 1
            return got, [await replicas.choose(f"r{i}", list(range(15))) for i in range(2)]
        finally:
            await client.aclose()

    pd_chosen, replica_chosen = asyncio.run(scenario())
    assert pd_chosen[:3] == ["", "", ""] and pd_chosen[3] in ("p0", "p1")
    assert all(c in ("r0", "r1") for c in replica_chosen)


def test_round_robin_goes_in_turn():
    async def scenario() -> list[str]:
        router = ReplicaRouter(None, Keys(), [("r0", 1)], "round-robin")  # type: ignore[arg-type]
        return [await router.choose(str(i), [1, 2, 3]) for i in range(2)]
    assert asyncio.run(scenario()) == ["r0", "r0"]          # one instance: no Redis read


def idle_stats(sync: redis.Redis, keys: Keys) -> None:
    """Replicas r0 and r1's stats hashes, as two idle schedulers write them."""
    for inst in ("r0", "r1"):
        sync.hset(keys.for_instance(inst).stats, mapping={
            "num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0.0,
            "block_size": BLOCK})


@pytest.mark.parametrize("policy", ["round-robin", "least-loaded", "prefix"])
def test_an_instance_whose_scheduler_stopped_is_left_out(redis_server, policy):
    """Every policy skips an instance with no live scheduler heartbeat while another has one
    (its stream would hold the request until the scheduler is back); with none alive at all
    (no verdict) every instance is a candidate, as before. The live set is read by a task of
    its own, never on a request's way (a SCAN of the whole keyspace: the request that found
    the set stale paid for it before it was sent)."""
    reads = []
    keys = Keys(f"live-{policy}:")
    sync = redis.Redis.from_url(redis_server)
    idle_stats(sync, keys)

    def beat(inst: str) -> None:
        sync.set(keys.hb_scheduler(f"sched-{inst}"),
                 encode(Heartbeat("scheduler", f"sched-{inst}", 0.0, {"instance": inst})))

    async def choices(n: int) -> list[str]:
        client = aioredis.Redis.from_url(redis_server)
        router = ReplicaRouter(client, keys, [("r0", 1), ("r1", 1)], policy)
        scan_iter = client.scan_iter

        def counted(*args, **kw):
            reads.append(args)
            return scan_iter(*args, **kw)
        client.scan_iter = counted
        try:
            await router.read_live(await scheduler_heartbeats(client, keys))
            read = len(reads)
            chosen = [await router.choose(str(i), [i] * 8) for i in range(n)]
            assert len(reads) == read          # no read of its own on the requests' way
            return chosen
        finally:
            await client.aclose()

    assert set(asyncio.run(choices(6))) == {"r0", "r1"}     # no heartbeat at all
    beat("r1")
    assert set(asyncio.run(choices(6))) == {"r1"}           # r0's scheduler is gone
    beat("r0")
    assert set(asyncio.run(choices(6))) == {"r0", "r1"}
    sync.close()


@pytest.mark.parametrize("policy", ["round-robin", "least-loaded", "prefix"])
def test_a_request_goes_only_to_replicas_whose_context_holds_it(redis_server, policy):
    """Replicas started with unequal --max-model-len: the gateway refuses what fits none,
    but a request that fit only the longer was sent to the shorter too, which cut its answer
    with "length". Each replica's length is read from its scheduler's heartbeat with the
    live set; one that does not state it (an older release) stays a candidate."""
    keys = Keys(f"lengths-{policy}:")
    sync = redis.Redis.from_url(redis_server)
    idle_stats(sync, keys)
    for inst, length in (("r0", 64), ("r1", 512)):
        sync.set(keys.hb_scheduler(f"sched-{inst}"), encode(Heartbeat(
            "scheduler", f"sched-{inst}", 0.0,
            {"instance": inst, "role": "colocated", "max_model_len": length})))

    async def choices(length: int) -> set[str]:
        client = aioredis.Redis.from_url(redis_server)
        router = ReplicaRouter(client, keys, [("r0", 1), ("r1", 1)], policy)
        try:
            await router.read_live(await scheduler_heartbeats(client, keys))
            return {await router.choose(str(i), [i] * 8, length) for i in range(6)}
        finally:
            await client.aclose()

    assert asyncio.run(choices(40)) == {"r0", "r1"}
    assert asyncio.run(choices(100)) == {"r1"}
    sync.set(keys.hb_scheduler("sched-r0"), encode(Heartbeat(      # states no length
        "scheduler", "sched-r0", 0.0, {"instance": "r0"})))
    assert asyncio.run(choices(100)) == {"r0", "r1"}
    sync.close()


@pytest.mark.parametrize("policy", ["round-robin", "least-loaded", "prefix"])
def test_an_instance_whose_workers_are_missing_is_left_out(redis_server, policy):
    """A replica whose scheduler beats but one of whose worker ranks does not (dead, hung,
    restarting, loading its model) cannot serve: its scheduler would hold the request until
    the ranks are back (seen: 4 of 8 requests waited 31 s on a replica whose worker was
    stopped, while the other replica idled). Every policy leaves it out while another
    instance has its scheduler and all its ranks (as many as the gateway's `--instances ID:TP`
    says, whatever a scheduler's heartbeat claims, as /health counts them); with none whole,
    the instances whose scheduler beats are the candidates."""
    keys = Keys(f"workers-{policy}:")
    sync = redis.Redis.from_url(redis_server)
    idle_stats(sync, keys)
    for inst in ("r0", "r1"):
        sync.set(keys.hb_scheduler(f"sched-{inst}"), encode(Heartbeat(
            "scheduler", f"sched-{inst}", 0.0, {"instance": inst, "tp": 1})))

    def beat(inst: str, rank: int) -> None:
        sync.set(keys.for_instance(inst).hb_worker(rank),
                 encode(Heartbeat("worker", f"rank{rank}", 0.0, {})))

    async def choices(n: int) -> list[str]:
        client = aioredis.Redis.from_url(redis_server)
        router = ReplicaRouter(client, keys, [("r0", 2), ("r1", 2)], policy)
        try:
            await router.read_live(await scheduler_heartbeats(client, keys))
            return [await router.choose(str(i), [i] * 8) for i in range(n)]
        finally:
            await client.aclose()

    assert set(asyncio.run(choices(6))) == {"r0", "r1"}     # none whole: both schedulers
    beat("r0", 0)
    beat("r0", 1)
    beat("r1", 0)                                           # r1's rank 1 is missing
    assert set(asyncio.run(choices(6))) == {"r0"}
    beat("r1", 1)
    assert set(asyncio.run(choices(6))) == {"r0", "r1"}
    sync.delete(keys.hb_scheduler("sched-r0"))              # r0's workers, but no scheduler
    assert set(asyncio.run(choices(6))) == {"r1"}
    sync.close()


@pytest.mark.parametrize("prefill", [False, True])
def test_a_submit_retried_after_its_reply_was_lost_counts_where_its_entry_is(
        redis_server, monkeypatch, prefill):
    """The connection breaks after Redis ran a submit's XADD: the retried submit is refused
    (its id was submitted) and the request lives where the first try put it (a replica's
    stream; with P/D, an entry naming that prefill instance). Its load counts there, not at
    another replica the retry chose (the turn had moved on: the round-robin's next)."""
    from gateway.upstream import Upstream

    keys = Keys(f"retried-{prefill}:")
    lost = lose_a_reply(monkeypatch, "EVALSHA")

    async def scenario() -> ReplicaRouter:
        client = aioredis.Redis.from_url(redis_server)
        router = ReplicaRouter(client, keys, [("r0", 1), ("r1", 1)], "round-robin")
        try:
            await Upstream(client, keys, "gw", router, prefill).submit(
                "a", [1, 2, 3], SamplingParams(max_tokens=2), 0.0)
            return router
        finally:
            await client.aclose()
    router = asyncio.run(scenario())
    assert lost
    sync = redis.Redis.from_url(redis_server)
    if prefill:
        (_, fields), = sync.xrange(keys.requests)
        where = from_fields(fields).instance
    else:
        where, = [inst for inst in ("r0", "r1")
                  if sync.xlen(keys.for_instance(inst).instance_requests)]
    sync.close()
    at = router.instances.index(where)
    assert router._outstanding[at] == 1 and sum(router._outstanding) == 1
    assert router._queued[at] == 3 and sum(router._queued) == 3
    assert router.chosen[at] == 1 and sum(router.chosen) == 1
    router.ended("a")
    assert router._outstanding == [0, 0] and router._queued == [0, 0]


def test_the_live_set_is_kept_by_its_own_task(redis_server, monkeypatch):
    """The upstream's `keep_schedulers_read` reads the live set again every LIVE_REFRESH_S; a
    read that fails keeps the last one and the task goes on."""
    import gateway.upstream as upstream_module

    monkeypatch.setattr(upstream_module, "LIVE_REFRESH_S", 0.01)
    keys = Keys("live-task:")
    sync = redis.Redis.from_url(redis_server)

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_server)
        router = ReplicaRouter(client, keys, [("r0", 1), ("r1", 1)], "round-robin")
        task = asyncio.create_task(
            upstream_module.Upstream(client, keys, "gw", router).keep_schedulers_read())
        try:
            sync.set(keys.hb_scheduler("s1"),
                     encode(Heartbeat("scheduler", "s1", 0.0, {"instance": "r1"})))
            while router._live != [1]:
                await asyncio.sleep(0.01)
            refusals = []

            async def refused(*_):
                refusals.append(1)
                raise redis.exceptions.ConnectionError("Redis is away")
            monkeypatch.setattr(upstream_module, "scheduler_heartbeats", refused)
            while len(refusals) < 3:
                await asyncio.sleep(0.01)
            assert not task.done() and router._live == [1]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.aclose()
    asyncio.run(asyncio.wait_for(scenario(), 10))
    sync.close()


# ---- what a replica publishes --------------------------------------------------------------

def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), arrival_index=0)


def test_the_index_changes_become_the_published_set(redis_server):
    bm = BlockManager(num_blocks=4, block_size=BLOCK)
    assert bm.take_events() == []                       # not kept unless asked
    bm.keep_events()
    a = _request("a", list(range(12)))
    bm.allocate(a, 12)
    a.num_computed_tokens = 12
    bm.cache_computed_blocks(a)
    stored = block_hashes(list(range(12)), BLOCK)
    assert bm.take_events() == [("stored", h) for h in stored]
    assert bm.take_events() == []
    bm.free(a)
    b = _request("b", list(range(50, 66)))             # 4 blocks: evicts a's 3 cached ones
    bm.allocate(b, 16)
    events = bm.take_events()
    assert sorted(h for kind, h in events if kind == "removed") == sorted(stored)
    key = Keys("ev:").for_instance("r0").cached_blocks
    client = redis.Redis.from_url(redis_server)
    pipe = client.pipeline(transaction=False)
    queue_block_events(pipe, key, [("stored", h) for h in stored] + events
                       + [("stored", b"x" * 32)])
    pipe.execute()
    assert client.smembers(key) == {b"x" * 32}
    bm.keep_events()
    b.num_computed_tokens = 16
    bm.cache_computed_blocks(b)
    bm.reset_prefix_cache()                             # the workers lost their KV
    assert bm.take_events() == [("cleared", b"")]
    pipe = client.pipeline(transaction=False)
    queue_block_events(pipe, key, [("cleared", b""), ("stored", b"y" * 32)])
    pipe.execute()
    assert client.smembers(key) == {b"y" * 32}
    client.close()


def test_the_router_asks_for_exactly_the_blocks_a_prompt_can_hit():
    # the last token is always computed: a prompt ending on a block boundary cannot hit its
    # last block (BlockManager.find_cached_prefix)
    assert len(cacheable_hashes(list(range(16)), BLOCK)) == 3
    assert len(cacheable_hashes(list(range(17)), BLOCK)) == 4
    assert cacheable_hashes(list(range(17)), BLOCK) == block_hashes(list(range(16)), BLOCK)


# ---- how pacer up wires replicas -----------------------------------------------------------

def _up_args(*argv: str):
    import argparse

    from services import up
    from shared.engine_args import EngineArgs
    parser = argparse.ArgumentParser()
    up.register(parser.add_subparsers())
    args = parser.parse_args(["up", *argv])
    return up._service_argvs(args, EngineArgs.from_cli(args))


def test_pacer_up_replicas_start_own_stream_schedulers_and_a_routing_gateway():
    services = _up_args("--replicas", "2", "--router", "least-loaded")
    argvs = dict(services.argvs)
    assert set(argvs) == {"r0 worker rank 0", "r1 worker rank 0", "r0 scheduler",
                          "r1 scheduler", "gateway"}
    for r in ("r0", "r1"):
        sched = argvs[f"{r} scheduler"]
        assert "--own-request-stream" in sched and "--role" not in sched
        assert sched[sched.index("--instance") + 1] == r
        worker = argvs[f"{r} worker rank 0"]
        assert worker[worker.index("--instance") + 1] == r and "--threads" in worker
    gateway = argvs["gateway"]
    assert gateway[gateway.index("--instances") + 1] == "r0:1,r1:1"
    assert gateway[gateway.index("--router") + 1] == "least-loaded"
    # prefix routing is the default; without --replicas nothing changes
    gateway = dict(_up_args("--replicas", "2").argvs)["gateway"]
    assert gateway[gateway.index("--router") + 1] == "prefix"
    plain = dict(_up_args().argvs)
    assert "--router" not in plain["gateway"] and "--own-request-stream" not in plain["scheduler"]


def test_pacer_up_refuses_replicas_with_pd_and_a_router_alone():
    from shared.errors import PacerError
    with pytest.raises(PacerError, match="not supported"):
        _up_args("--replicas", "2", "--prefill-workers", "1", "--decode-workers", "1")
    with pytest.raises(PacerError, match="--router needs --replicas"):
        _up_args("--router", "prefix")
    with pytest.raises(PacerError, match="--router needs --replicas"):
        _up_args("--router", "prefix", "--prefill-workers", "1", "--decode-workers", "1")


def test_pacer_up_routes_between_several_prefill_instances():
    argvs = dict(_up_args("--prefill-workers", "2", "--decode-workers", "1").argvs)
    gateway = argvs["gateway"]
    assert gateway[gateway.index("--instances") + 1] == "p0:1,p1:1,d0:1"
    assert gateway[gateway.index("--router") + 1] == "prefix"
    assert gateway[gateway.index("--route-prefill") + 1] == "p0,p1"
    for name in ("p0 scheduler", "p1 scheduler"):
        sched = argvs[name]
        assert sched[sched.index("--role") + 1] == "prefill"
        assert "--own-request-stream" not in sched         # they share the request stream
    # one prefill instance: nothing to choose
    one = dict(_up_args("--prefill-workers", "1", "--decode-workers", "1").argvs)["gateway"]
    assert "--router" not in one and "--route-prefill" not in one
