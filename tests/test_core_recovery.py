"""The two core entry points recovery uses, from plain ints: `recompute_running()` after a
worker died, and `add_request(..., output_token_ids=...)` for a request taken over from a
scheduler that died. Both must continue a request exactly where it was: same output so far,
the next sample at the next output position, prompt and generated tokens recomputed."""
from __future__ import annotations

import pytest

from scheduler_svc.core import RequestStatus, Scheduler
from shared.config import SchedulerConfig
from shared.plan import SampledToken, StepResult
from shared.sampling import SamplingParams
from tests.redis_fixture import redis_server  # noqa: F401  (a fixture)


def make_scheduler() -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, num_kv_blocks=32,
                             block_size=4, max_model_len=128)
    return Scheduler(config, eos_token_ids=2, max_model_len=128)


def run_step(sched: Scheduler, token: int = 7):
    plan = sched.schedule()
    sampled = {rid: SampledToken(token) for rid, n in plan.num_scheduled_tokens.items()
               if sched.get_request(rid).num_uncomputed_tokens == n}
    return plan, sched.update(plan, StepResult(plan.step, sampled))


def test_recompute_running_keeps_generated_tokens_and_order() -> None:
    sched = make_scheduler()
    for rid in ("a", "b"):
        sched.add_request(rid, [10, 11, 12, 13, 14], SamplingParams(max_tokens=8))
    run_step(sched)
    run_step(sched)                             # both have 2 output tokens
    sched.schedule()                            # a plan in flight whose worker dies
    assert sched.recompute_running() == ["a", "b"]
    assert sched.num_running == 0 and sched.num_waiting == 2
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks
    plan, _ = run_step(sched)                   # no update() of the lost plan is needed
    assert plan.preempted_request_ids == ["a", "b"]     # a surviving worker forgets them
    assert [r.request_id for r in plan.new_requests] == ["a", "b"]
    assert plan.new_requests[0].token_ids == [10, 11, 12, 13, 14, 7, 7]
    assert plan.new_requests[0].num_prompt_tokens == 5
    assert plan.num_scheduled_tokens == {"a": 7, "b": 7}
    assert sched.get_request("a").output_token_ids == [7, 7, 7]


def test_a_request_resumed_with_output_tokens_is_recomputed_and_continues() -> None:
    sched = make_scheduler()
    sched.add_request("r", [10, 11, 12], SamplingParams(max_tokens=5), reply_to="ch",
                      output_token_ids=[20, 21])
    plan, outputs = run_step(sched)
    assert plan.new_requests[0].token_ids == [10, 11, 12, 20, 21]
    assert plan.new_requests[0].num_prompt_tokens == 3
    assert outputs[0].num_output_tokens == 3
    run_step(sched)
    _, outputs = run_step(sched)
    assert outputs[0].finished and outputs[0].finish_reason == "length"
    assert outputs[0].num_output_tokens == 5
    assert sched.get_request("r") is None
    assert RequestStatus.FINISHED_LENGTH.finish_reason == "length"


# ---- prefix caching across failures ------------------------------------------------------

PREFIX = list(range(200, 220))                  # 5 full blocks of 4


def test_a_lost_kv_cache_empties_the_prefix_cache() -> None:
    sched = make_scheduler()
    sched.add_request("a", PREFIX + [1], SamplingParams(max_tokens=8))
    run_step(sched)
    assert sched.block_manager.num_cached_blocks == 5
    sched.add_request("b", PREFIX + [3], SamplingParams(max_tokens=4))
    sched.schedule()                            # b hits a's blocks; the workers die
    assert sched.recompute_running() == ["a", "b"]
    assert sched.block_manager.num_cached_blocks == 0
    plan, _ = run_step(sched)
    assert [(n.request_id, n.num_computed_tokens) for n in plan.new_requests] == \
        [("a", 0), ("b", 0)]                    # both recomputed from their first token
    sched.block_manager.check_integrity()


def test_a_failed_iteration_registers_nothing() -> None:
    sched = make_scheduler()
    sched.add_request("a", PREFIX + [1], SamplingParams(max_tokens=8))
    sched.schedule()                            # a's whole prompt is in flight...
    sched.recompute_running()                   # ...and never computed
    sched.add_request("b", PREFIX + [3], SamplingParams(max_tokens=4))
    plan, _ = run_step(sched)
    assert [n.num_computed_tokens for n in plan.new_requests] == [0, 0]


def test_a_restarted_scheduler_trusts_no_cache() -> None:
    """A new scheduler (a restart, or one taking requests over) knows nothing of what the
    workers' blocks hold: the same prompt again, resumed or new, is a miss."""
    first = make_scheduler()
    first.add_request("a", PREFIX + [1], SamplingParams(max_tokens=8))
    run_step(first)
    assert first.block_manager.num_cached_blocks == 5
    second = make_scheduler()                   # the restarted process: a fresh core
    second.add_request("a", PREFIX + [1], SamplingParams(max_tokens=8), output_token_ids=[7])
    second.add_request("b", PREFIX + [3], SamplingParams(max_tokens=4))
    plan, _ = run_step(second)
    assert [n.num_computed_tokens for n in plan.new_requests] == [0, 0]
    bm = second.block_manager
    assert bm.prefix_cache_hits == 0 and bm.prefix_cache_queries == 22 + 21
    # once its own iteration has computed them, the new scheduler's blocks are hits
    second.add_request("c", PREFIX + [5], SamplingParams(max_tokens=4))
    plan, _ = run_step(second)
    assert [(n.request_id, n.num_computed_tokens) for n in plan.new_requests] == [("c", 20)]
    assert bm.prefix_cache_hits == 20


def test_a_request_taken_over_again_and_again_is_dropped_with_an_error(redis_server) -> None:
    """A request live each time its scheduler stopped, MAX_TAKEOVERS times, ends with an error
    when the next scheduler takes it back, rather than being served (and perhaps stopping that
    one too); one taken over once is resumed. Real Redis: its group counts the deliveries."""
    import asyncio

    import redis.asyncio as aioredis

    from scheduler_svc.book import RequestBook
    from scheduler_svc.takeover import MAX_TAKEOVERS, Takeover
    from shared.keys import Keys
    from shared.protocol import FinishEvent, RequestMsg, decode, to_fields

    keys = Keys("poison-test:")

    async def deliver(r, rid: str) -> None:
        await r.xadd(keys.requests, to_fields(RequestMsg(
            rid, [1, 2, 3], SamplingParams(max_tokens=4), f"tokens:{rid}", "gw", 0.0)))
        await r.xreadgroup(keys.requests_group, "s", {keys.requests: ">"})

    async def go():
        r = aioredis.Redis.from_url(redis_server)
        await r.xgroup_create(keys.requests, keys.requests_group, id="0", mkstream=True)
        await deliver(r, "poison")
        for _ in range(MAX_TAKEOVERS - 1):   # restarts that took it back, and stopped again
            await r.xreadgroup(keys.requests_group, "s", {keys.requests: "0"})
        await deliver(r, "once")             # live at the last stop only
        core = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4,
                                         num_kv_blocks=8, block_size=4, max_model_len=64))
        book = RequestBook(core)
        await Takeover(r, keys, "s", book).take_back_pending()
        await r.aclose()
        return core, book.take_outbox()

    core, outbox = asyncio.run(go())
    assert core.get_request("once") is not None and core.get_request("poison") is None
    [(channel, data)] = outbox.finishes
    event = decode(data)
    assert channel == "tokens:poison" and isinstance(event, FinishEvent)
    assert event.finish_reason == "error" and f"stopped {MAX_TAKEOVERS} times" in event.error
    assert len(outbox.acks) == 1 and outbox.ended_ids == ["poison"]


def test_a_decode_schedulers_death_counts_once_when_a_prefill_one_handed_its_request_back(
        redis_server, monkeypatch) -> None:
    """P/D: decode scheduler "d0" dies holding a request and restarts slowly; the prefill
    scheduler "p0" claims the request (a takeover: the dead one's death counted) and hands
    it back to "d0", and the restarted "d0" finds it among its own pending entries. That one
    death was counted twice (the claim, then the take-back), so after two deaths the request
    ended with "stopped 3 times". Now the take-back counts only the entries its predecessor
    held at its last lease refresh: two deaths leave it running, a third drops it. Real
    Redis: its group counts the deliveries."""
    import asyncio

    import redis.asyncio as aioredis

    from scheduler_svc import takeover as takeover_mod
    from scheduler_svc.book import RequestBook
    from scheduler_svc.takeover import MAX_TAKEOVERS, Takeover
    from shared.keys import Keys
    from shared.protocol import RequestMsg, decode, to_fields

    keys = Keys("pd-takeover-test:")
    monkeypatch.setattr(takeover_mod, "CLAIM_IDLE_MS", 0)        # "d0" has been gone long
    monkeypatch.setattr(takeover_mod, "HANDED_LATER_MS", 50)
    msg = RequestMsg("r", [1, 2, 3], SamplingParams(max_tokens=8), "tokens:r", "gw", 0.0)

    def book() -> RequestBook:
        return RequestBook(Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4,
                                                     num_kv_blocks=8, block_size=4,
                                                     max_model_len=64)))

    async def hand_to_d0(r, entry_id) -> None:                 # as PrefillSide._move does
        await r.xclaim(keys.requests, keys.requests_group, "d0", 0, [entry_id], justid=True)

    async def restart_d0(r) -> tuple[RequestBook, Takeover]:
        """A new "d0" takes back its pending entries, serves them and keeps their leases."""
        d0_book = book()
        d0 = Takeover(r, keys, "d0", d0_book)
        await d0.take_back_pending()
        await d0.refresh_leases()
        return d0_book, d0

    async def go():
        r = aioredis.Redis.from_url(redis_server)
        await r.xgroup_create(keys.requests, keys.requests_group, id="0", mkstream=True)
        entry_id = await r.xadd(keys.requests, to_fields(msg))
        await r.xreadgroup(keys.requests_group, "p0", {keys.requests: ">"})
        await hand_to_d0(r, entry_id)
        d0_book = book()                  # "d0" runs it (the hand-off's notice) and leases it
        d0_book.admit(entry_id, msg)
        await Takeover(r, keys, "d0", d0_book).refresh_leases()
        # death 1: "d0" is killed; its restart takes longer than the idle claim
        await asyncio.sleep(0.2)
        p0_book = book()
        p0 = Takeover(r, keys, "p0", p0_book)
        pipe = r.pipeline(transaction=False)
        p0.queue_claim(pipe, 10)
        claimed = p0.claimed((await pipe.execute())[0])
        assert [e for e, _ in claimed] == [entry_id]
        await p0.resume(claimed)
        assert p0_book.core.get_request("r") is not None      # taken over once: resumed
        await hand_to_d0(r, entry_id)      # no tokens to prefill: handed to "d0" again
        seen = []
        d0_book, _ = await restart_d0(r)                       # "d0" is back
        seen.append(d0_book)
        # deaths 2 and 3, each restart quick (no claim between)
        for _ in range(2):
            d0_book, _ = await restart_d0(r)
            seen.append(d0_book)
        await r.aclose()
        return seen

    after_death_1, after_death_2, after_death_3 = asyncio.run(go())
    for served in (after_death_1, after_death_2):
        assert served.core.get_request("r") is not None
        assert served.take_outbox().finishes == []
    assert after_death_3.core.get_request("r") is None
    [(channel, data)] = after_death_3.take_outbox().finishes
    assert channel == "tokens:r"
    assert f"stopped {MAX_TAKEOVERS} times" in decode(data).error


def test_a_stalled_scheduler_leaves_a_claimed_request_to_its_new_owner(redis_server) -> None:
    """Scheduler "a" holds two requests and stalls; "b" claims one of them (idle past
    CLAIM_IDLE_MS). When "a" refreshes its leases it keeps its own entry and leaves the claimed
    one to "b" (an XCLAIM of every entry took it back, and both served it, taking it from each
    other every second); "a" then drops that request: no finish event, no ack, its blocks
    free. So too one that "b" claimed and already finished (acked) while "a" was stopped: it
    is no one's, and "a" must not serve it on. Real Redis: the owners are the group's."""
    import asyncio

    import redis.asyncio as aioredis

    from scheduler_svc.book import RequestBook
    from scheduler_svc.takeover import Takeover
    from shared.keys import Keys
    from shared.lifecycle import redis_run_id
    from shared.protocol import RequestMsg, decode, to_fields

    keys = Keys("lease-test:")

    async def go():
        r = aioredis.Redis.from_url(redis_server)
        await r.xgroup_create(keys.requests, keys.requests_group, id="0", mkstream=True)
        for rid in ("kept", "claimed", "finished"):
            await r.xadd(keys.requests, to_fields(RequestMsg(
                rid, [1, 2, 3], SamplingParams(max_tokens=8), f"tokens:{rid}", "gw", 0.0)))
        core = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4,
                                         num_kv_blocks=8, block_size=4, max_model_len=64))
        book = RequestBook(core)
        (_, entries), = await r.xreadgroup(keys.requests_group, "a", {keys.requests: ">"})
        for entry_id, fields in entries:
            book.receive(entry_id, fields)
        run_step(core)                                  # both running, holding blocks
        claimed_id, finished_id = entries[1][0], entries[2][0]
        await r.xclaim(keys.requests, keys.requests_group, "b", 0, [claimed_id, finished_id])
        await r.xack(keys.requests, keys.requests_group, finished_id)
        takeover = Takeover(r, keys, "a", book)
        # leases kept on a server other than the one served (Redis restarted, not noticed
        # yet): what it lacks says nothing of another scheduler
        takeover.run_id = "the run_id of a server that restarted"
        await takeover.refresh_leases()
        assert takeover.take_lost() == []
        takeover.run_id = await redis_run_id(r)
        await takeover.refresh_leases()
        lost = takeover.take_lost()
        owners = {e["message_id"]: e["consumer"] for e in await r.xpending_range(
            keys.requests, keys.requests_group, min="-", max="+", count=10)}
        await r.aclose()
        for entry_id in lost:
            book.lose(entry_id)
        return core, book, lost, owners, entries, claimed_id, finished_id

    core, book, lost, owners, entries, claimed_id, finished_id = asyncio.run(go())
    assert lost == [claimed_id, finished_id]
    assert owners == {entries[0][0]: b"a", claimed_id: b"b"}
    assert core.get_request("kept") is not None
    assert core.get_request("claimed") is None and core.get_request("finished") is None
    for output in run_step(core)[1]:                    # the abort is reported, silently
        if output.finished:
            book.finished(output)
    outbox = book.take_outbox()
    assert outbox.finishes == [] and outbox.acks == []
    assert book.live_entry_ids() == [entries[0][0]]
    # a request ending with an error is leased until it ends (the next iteration may be
    # seconds away: the worker group lost), and told its entry is lost (gone with a Redis that
    # restarted, or claimed) it stays, so that its client still reads the error
    book.stop("kept", "Redis restarted")
    assert book.live_entry_ids() == book.leased_entry_ids() == [entries[0][0]]
    assert book.lose(entries[0][0]) is False
    for output in run_step(core)[1]:
        if output.finished:
            book.finished(output)
    [(channel, data)] = book.take_outbox().finishes
    assert channel == "tokens:kept" and decode(data).error == "Redis restarted"


def test_a_request_running_at_every_worker_loss_is_dropped_with_an_error() -> None:
    """Running each time the worker group was lost, MAX_WORKER_LOSSES times over: it ends with
    an error instead of being recomputed again; a request that joined later, running at the
    last loss only, is recomputed as ever."""
    from scheduler_svc.book import RequestBook
    from scheduler_svc.recovery import MAX_WORKER_LOSSES, Recovery
    from shared.keys import Keys
    from shared.protocol import RequestMsg

    core = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4,
                                     num_kv_blocks=32, block_size=4, max_model_len=64))
    book = RequestBook(core)
    recovery = Recovery(None, Keys(), core, book, None, None, None, lambda: False)

    def admit(rid: str) -> None:
        book.admit(f"{rid}-entry", RequestMsg(rid, [1, 2, 3], SamplingParams(max_tokens=8),
                                              f"tokens:{rid}", "gw", 0.0))

    admit("poison")
    for loss in range(1, MAX_WORKER_LOSSES + 1):
        if loss == MAX_WORKER_LOSSES:
            admit("late")
        plan = core.schedule()
        assert "poison" in plan.num_scheduled_tokens          # it runs at every loss
        recovery._drop_requests_that_keep_losing_workers(core.recompute_running())
    assert core.get_request("poison") is None
    assert core.get_request("late") is not None
    assert f"lost {MAX_WORKER_LOSSES} times" in book._errors["poison"][0]


@pytest.mark.parametrize("stopped_by", ["abort", "deadline"])
def test_a_request_stopped_while_the_worker_group_is_lost_ends_at_once(redis_server,
                                                                       stopped_by) -> None:
    """The worker group is lost while a request runs, and no worker comes back: an abort of
    that request, or its deadline, must end it now (its finish event published, its blocks
    free), not with the first result of a group that comes back (it waited for one, and so
    did its client and its gateway's bookkeeping). Real Redis: the abort comes in its
    stream, the event on pub/sub."""
    import asyncio
    import time

    import redis.asyncio as aioredis

    from gpu_worker.service import worker_heartbeat
    from scheduler_svc.recovery import WorkersLost
    from scheduler_svc.service import SchedulerService, SchedulerServiceConfig
    from shared.keys import Keys
    from shared.protocol import AbortMsg, FinishEvent, RequestMsg, decode, encode, to_fields

    keys = Keys(f"lost-workers-{stopped_by}:")

    async def go():
        r = aioredis.Redis.from_url(redis_server)
        core = make_scheduler()
        service = SchedulerService(r, keys, core, SchedulerServiceConfig("s"))
        await service.prepare()
        await r.set(keys.hb_worker(0), encode(worker_heartbeat(0, 1, 32, 4)()))
        await r.set(keys.hb_gateway("gw"), b"alive")    # its gateway stays: not what ends it
        stop = asyncio.Event()
        assert await service.wait_for_workers(stop)
        await r.xadd(keys.requests, to_fields(RequestMsg(
            "r", [10, 11, 12], SamplingParams(max_tokens=8), "tokens:r", "gw", 0.0,
            deadline=time.time() + 2.0 if stopped_by == "deadline" else None)))
        await service._intake(pull=True, block=False)
        run_step(core)                                  # running, holding blocks
        await r.delete(keys.hb_worker(0))               # the group is gone, for good
        pubsub = r.pubsub()
        await pubsub.subscribe("tokens:r")
        recovering = asyncio.create_task(service._recover(WorkersLost([0]), stop))
        if stopped_by == "abort":
            await r.xadd(keys.aborts, to_fields(AbortMsg("r", "client disconnected")))
        event = None
        try:
            async with asyncio.timeout(10):
                while event is None:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    event = msg and decode(msg["data"])
            waiting = not recovering.done()
        finally:
            stop.set()
            await asyncio.wait_for(recovering, 10)
            await pubsub.aclose()
            await r.aclose()
        return core, event, waiting

    core, event, waiting = asyncio.run(go())
    assert isinstance(event, FinishEvent)
    assert (event.finish_reason, event.error_type) == (
        ("abort", "server_error") if stopped_by == "abort" else ("error", "timeout_error"))
    assert waiting                                      # still no worker: it ended anyway
    assert core.get_request("r") is None
    assert core.block_manager.num_free_blocks == core.block_manager.num_total_blocks


def test_the_deadlines_of_ended_requests_do_not_pile_up() -> None:
    """Requests that end long before their deadline (an hour's --request-timeout) leave no
    entry behind in the book's deadline heap; a live one's deadline still ends it."""
    import time

    from scheduler_svc.book import RequestBook
    from shared.protocol import RequestMsg, decode

    core = make_scheduler()
    book = RequestBook(core)
    now = time.time()

    def admit(rid: str, deadline: float) -> None:
        book.admit(f"{rid}-entry", RequestMsg(rid, [1, 2, 3], SamplingParams(max_tokens=8),
                                              "tokens:gw", "gw", now, deadline=deadline))

    admit("live", now + 60)
    for i in range(1000):
        admit(f"r{i}", now + 3600)
        book.stop(f"r{i}")                      # its client left
        for output in core.take_aborted():
            book.finished(output)
        book.expire(now)
    assert book.num_live == 1
    assert len(book._deadlines) < 100          # not one per request served
    book.take_outbox()
    book.expire(now + 61)
    (output,) = core.take_aborted()
    book.finished(output)
    ((_, event),) = book.take_outbox().finishes
    assert decode(event).request_id == "live" and decode(event).error_type == "timeout_error"


def test_a_worker_that_loaded_other_weights_is_refused(redis_server) -> None:
    """A scheduler started on one model and a worker on another (services started alone, for
    several machines) may agree on the KV pool's size; the token ids and K/V of one mean
    nothing to the other, so the scheduler refuses to plan for it, naming both models. The
    same weights are served; a worker that states none (an older build) is not refused."""
    import asyncio

    import redis.asyncio as aioredis

    from gpu_worker.service import worker_heartbeat
    from scheduler_svc.service import SchedulerService, SchedulerServiceConfig
    from shared.keys import Keys
    from shared.protocol import encode

    mine = {"model": "smollm2-135m", "weights": "00aa"}

    async def agrees(theirs: dict | None) -> bool:
        keys = Keys(f"weights-{theirs and theirs['weights']}:")
        r = aioredis.Redis.from_url(redis_server)
        try:
            service = SchedulerService(r, keys, make_scheduler(),
                                       SchedulerServiceConfig("s", **mine))
            await service.prepare()
            await r.set(keys.hb_worker(0), encode(worker_heartbeat(0, 1, 32, 4,
                                                                   identity=theirs)()))
            return await service.wait_for_workers(asyncio.Event())
        finally:
            await r.aclose()

    assert asyncio.run(agrees(mine))
    assert asyncio.run(agrees(None))
    assert not asyncio.run(agrees({"model": "qwen2-0.5b", "weights": "11bb"}))
    from scheduler_svc.workers import model_disagreement
    why = model_disagreement({"model": "qwen2-0.5b", "weights": "11bb"}, 0, **mine)
    assert "'qwen2-0.5b'" in why and "'smollm2-135m'" in why and "--model" in why


def test_a_worker_of_another_protocol_version_is_refused_by_name(redis_server, capsys) -> None:
    """A worker of another pacer release (a rolling upgrade, one machine updated before
    another) writes its heartbeat in another protocol version: the scheduler refuses to plan
    for it with one line naming the rank and both versions (it logged the heartbeat as
    unreadable, with no word of which side was which)."""
    import asyncio

    import msgpack
    import redis.asyncio as aioredis

    from gpu_worker.service import worker_heartbeat
    from scheduler_svc.service import SchedulerService, SchedulerServiceConfig
    from shared.keys import Keys
    from shared.protocol import SCHEMA_VERSION, encode

    keys = Keys("protocol-worker:")

    async def agrees() -> bool:
        r = aioredis.Redis.from_url(redis_server)
        try:
            service = SchedulerService(r, keys, make_scheduler(), SchedulerServiceConfig("s"))
            await service.prepare()
            beat = msgpack.unpackb(encode(worker_heartbeat(0, 1, 32, 4)()))
            await r.set(keys.hb_worker(0), msgpack.packb({**beat, "v": SCHEMA_VERSION - 1}))
            return await service.wait_for_workers(asyncio.Event())
        finally:
            await r.aclose()

    assert not asyncio.run(agrees())
    assert (f"worker rank 0 of this instance speaks protocol version {SCHEMA_VERSION - 1}, "
            f"this scheduler version {SCHEMA_VERSION}") in capsys.readouterr().out


def test_a_scheduler_with_nothing_to_take_back_is_a_consumer_of_its_group(redis_server) -> None:
    """`redis-cli XINFO GROUPS` shows every scheduler of a stream as its consumer from its
    start, an idle replica's too: its reads (XREADGROUP '>') make it only once an entry
    comes, so its take-back makes it."""
    import asyncio

    import redis.asyncio as aioredis

    from scheduler_svc.book import RequestBook
    from scheduler_svc.takeover import Takeover
    from shared.keys import Keys

    keys = Keys("idle-consumer:")

    async def go():
        r = aioredis.Redis.from_url(redis_server)
        try:
            await r.xgroup_create(keys.requests, keys.requests_group, id="0", mkstream=True)
            book = RequestBook(make_scheduler())
            assert await Takeover(r, keys, "s", book).take_back_pending() == 0
            return [c["name"] for c in await r.xinfo_consumers(keys.requests,
                                                                keys.requests_group)]
        finally:
            await r.aclose()

    assert asyncio.run(go()) == [b"s"]


def test_a_stopped_schedulers_consumer_leaves_the_group_once_nothing_of_it_is_pending(
        redis_server) -> None:
    """Every scheduler id stays a consumer of the request group (`XINFO CONSUMERS`) until
    removed; where ids change (random host names) the group grew by one per id for good.
    Scheduler "b" removes the dead ones that hold nothing: "dead" only once its entry was
    claimed, never "alive" (its claim key is there: running, or starting) nor one with an
    entry pending; at a clean exit "b" leaves itself, but only with nothing pending."""
    import asyncio

    import redis.asyncio as aioredis

    from scheduler_svc.book import RequestBook
    from scheduler_svc.takeover import Takeover
    from shared.keys import Keys
    from shared.protocol import RequestMsg, to_fields

    keys = Keys("forget-test:")

    async def go():
        r = aioredis.Redis.from_url(redis_server)

        async def consumers() -> set[str]:
            return {c["name"].decode() for c in await r.xinfo_consumers(
                keys.requests, keys.requests_group)}
        try:
            await r.xgroup_create(keys.requests, keys.requests_group, id="0", mkstream=True)
            for rid in ("r1", "r2"):
                await r.xadd(keys.requests, to_fields(RequestMsg(
                    rid, [1, 2, 3], SamplingParams(max_tokens=8), f"tokens:{rid}", "gw", 0.0)))
            await r.xreadgroup(keys.requests_group, "dead", {keys.requests: ">"}, count=1)
            await r.xreadgroup(keys.requests_group, "dead-too", {keys.requests: ">"}, count=1)
            for name in ("idle-dead", "alive"):
                await r.xgroup_createconsumer(keys.requests, keys.requests_group, name)
            await r.set(keys.claim_scheduler("alive"), "pid 1", ex=60)
            takeover = Takeover(r, keys, "b", RequestBook(make_scheduler()))
            await takeover.take_back_pending()                      # "b" joins
            seen = [await consumers(), sorted(await takeover.forget_dead()), await consumers()]
            # "b" claims "dead"'s entry (idle past CLAIM_IDLE_MS in the service)
            pipe = r.pipeline(transaction=False)
            takeover.claim_cursor = "0-0"
            pipe.xautoclaim(keys.requests, keys.requests_group, "b", 0, count=1)
            claimed = takeover.claimed((await pipe.execute())[0])
            assert takeover.sweep_due
            seen += [await takeover.forget_dead(), await consumers()]
            seen += [await takeover.leave(), await consumers()]      # its entry pending
            await r.xack(keys.requests, keys.requests_group, claimed[0][0])
            seen += [await takeover.leave(), await consumers()]
            return seen
        finally:
            await r.aclose()

    (before, forgotten, after, forgotten2, after2, left_pending, after3, left,
     after4) = asyncio.run(go())
    assert before == {"dead", "dead-too", "idle-dead", "alive", "b"}
    assert forgotten == ["idle-dead"] and after == {"dead", "dead-too", "alive", "b"}
    assert forgotten2 == ["dead"] and after2 == {"dead-too", "alive", "b"}
    assert left_pending is False and after3 == after2
    assert left is True and after4 == {"dead-too", "alive"}
