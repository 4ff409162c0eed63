"""The P/D roles of the scheduler service from plain objects (docs/design.md#pd-disaggregation):
the decode side's reservations and hand-offs on a real scheduling core, the prefill side's
sends and its refusal of a decode pool whose layout differs. The served paths, with real
processes and the real transfer engine, are tests/test_served_disagg.py's."""
from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace

import pytest

from scheduler_svc import disagg
from scheduler_svc.book import Outbox, RequestBook
from scheduler_svc.core import RequestStatus, Scheduler
from scheduler_svc.disagg import NO_ROOM, DecodeSide, PrefillSide, _Decoder
from scheduler_svc.workers import role_disagreement
from shared.config import SchedulerConfig
from shared.keys import Keys
from shared.lifecycle import stream_id_text
from shared.plan import IterationPlan, SampledToken, StepResult
from shared.protocol import (AbortMsg, CancelMsg, HandoffMsg, Heartbeat, RequestMsg, ReservedMsg,
                             ReserveMsg, decode, encode, from_fields, to_fields)
from shared.sampling import SamplingParams
from tests.redis_fixture import lose_a_reply, redis_server  # noqa: F401  (a fixture)

BLOCK = 4


def core(num_blocks: int = 16) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=8,
                                     num_kv_blocks=num_blocks, block_size=BLOCK,
                                     max_model_len=128))


def request(rid: str, n: int, max_tokens: int = 8, first: int = 10) -> RequestMsg:
    """A request of `n` prompt tokens counting up from `first` (requests of one `first`
    share a prefix)."""
    return RequestMsg(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens,
                                                                    temperature=0.0,
                                                                    ignore_eos=True),
                      f"tokens:{rid}", "gw", 0.0)


def descriptor(session: str, tp: int = 1, rank: int = 0, dtype: str = "float32") -> dict:
    return {"engine": "mooncake", "session": session, "base": 0, "num_layers": 2,
            "num_blocks": 16, "block_bytes": 64, "dtype": dtype, "tp": tp, "rank": rank}


def reply(*msgs) -> list:
    """An XREAD reply carrying these messages."""
    return [[b"stream", [(f"{i + 1}-0".encode(), to_fields(m)) for i, m in enumerate(msgs)]]]


def handoff(msg: RequestMsg, entry: str, token: int, sessions: list[str]) -> HandoffMsg:
    """A hand-off with the K/V written into the reserved blocks and their digests."""
    blocks = -(-len(msg.prompt_token_ids) // BLOCK)
    return HandoffMsg(encode(msg), entry, [token], sessions, 0,
                      [list(range(blocks)), [[1000 + i for i in range(blocks)]]])


def checked(c: Scheduler, side: DecodeSide, intact: bool = True) -> IterationPlan:
    """One plan carrying the due K/V checks, answered as the workers would."""
    plan = side.add_checks(c.schedule())
    assert plan.kv_checks and plan.is_empty
    result = StepResult(plan.step, {},
                        kv_verified=[k.request_id for k in plan.kv_checks] if intact else [])
    c.update(plan, result)
    side.observe(plan, result)
    return plan


def handed_over(kv_check=None) -> tuple[Scheduler, DecodeSide]:
    """A decode side that reserved blocks for "r" (9 tokens) and got its hand-off: with the
    digests of handoff(), or with `kv_check` as given."""
    c = core()
    side = decode_side(c)
    msg = request("r", 9)
    side.receive(reply(ReserveMsg(encode(msg), "p0")))
    side.receive(reply(handoff(msg, "5-0", 77, ["d0:1"]) if kv_check is None else
                       HandoffMsg(encode(msg), "5-0", [77], ["d0:1"], 0, kv_check)))
    return c, side


def decode_side(c: Scheduler) -> DecodeSide:
    side = DecodeSide(Keys(), "d0", "host-d0", c, RequestBook(c), started_at=1.0)
    side.peers = [descriptor("d0:1")]
    return side


def test_a_reservation_becomes_a_running_decode_past_its_prompt():
    c = core()
    side = decode_side(c)
    msg = request("r", 9)
    side.receive(reply(ReserveMsg(encode(msg), "p0")))
    (instance, reserved), = side._replies
    assert instance == "p0" and reserved.block_ids == [0, 1, 2]     # 9 + 1 tokens, 4 a block
    assert reserved.peers == [descriptor("d0:1")] and c.num_reserved == 1
    assert not c.has_schedulable()              # the K/V is on its way: nothing to run yet
    side.receive(reply(handoff(msg, "5-0", 77, ["d0:1"])))
    assert not c.has_schedulable() and side.checks_due     # its K/V is checked first
    check, = checked(c, side).kv_checks
    assert check.block_ids == [0, 1, 2] and check.digests == [[1000, 1001, 1002]]
    plan = c.schedule()
    new, = plan.new_requests                    # new to the workers, its prefix in the pool
    assert new.num_computed_tokens == 9 and new.token_ids[-1] == 77
    assert new.kv_received == ["d0:1"] and plan.num_scheduled_tokens == {"r": 1}
    assert side.recomputed_total == 0


@pytest.mark.parametrize("why", ["the check failed", "no digests came"])
def test_received_kv_that_fails_its_check_or_has_none_is_recomputed(why):
    if why == "the check failed":
        c, side = handed_over()
        checked(c, side, intact=False)
        assert side.kv_check_failures_total == 1
    else:
        c, side = handed_over(kv_check=[])
        assert not side.checks_due
    plan = c.schedule()
    new, = plan.new_requests
    assert new.num_computed_tokens == 0 and new.kv_received == []
    assert side.recomputed_total == 1


def test_a_request_aborted_while_its_kv_is_checked_is_not_activated():
    c, side = handed_over()
    plan = side.add_checks(c.schedule())
    c.abort("r")
    result = StepResult(plan.step, {}, kv_verified=["r"])
    out, = c.update(plan, result)
    side.observe(plan, result)
    assert out.finish_reason == "abort" and not c.has_unfinished()
    assert c.block_manager.num_free_blocks == 16


def test_a_hand_off_into_another_worker_is_recomputed_here():
    c = core()
    side = decode_side(c)
    msg = request("r", 9)
    side.receive(reply(ReserveMsg(encode(msg), "p0")))
    side.peers = [descriptor("d0:2")]           # the decode worker restarted since
    side.receive(reply(handoff(msg, "5-0", 77, ["d0:1"])))
    plan = c.schedule()
    new, = plan.new_requests
    assert new.num_computed_tokens == 0 and new.kv_received == []
    assert plan.num_scheduled_tokens == {"r": 8}          # prompt + first token, chunked
    assert side.recomputed_total == 1


def test_no_reservation_while_requests_wait_and_a_cancel_frees_blocks():
    """An ask finding no room waits, unanswered, until a cancel frees blocks; none is granted
    while requests wait here (they go first)."""
    c = core(num_blocks=4)
    side = decode_side(c)
    side.receive(reply(ReserveMsg(encode(request("a", 9, max_tokens=2)), "p0")))
    assert c.block_manager.num_free_blocks == 1
    side.receive(reply(ReserveMsg(encode(request("b", 9, max_tokens=2)), "p0")))
    assert [m.request_id for _, m in side.take_replies()] == ["a"]     # b waits
    side.receive(reply(CancelMsg("a", "asked again")))     # nothing was written: free now
    (_, granted), = side.take_replies()
    assert granted.request_id == "b" and len(granted.block_ids) == 3
    side.receive(reply(CancelMsg("b", "not wanted")))
    assert c.block_manager.num_free_blocks == 4 and c.num_reserved == 0
    c.add_request("w", list(range(10)), SamplingParams(max_tokens=2))   # one waits here
    side.receive(reply(ReserveMsg(encode(request("c", 3, max_tokens=2)), "p0")))
    assert side.take_replies() == [] and side.stats()["num_reservations_waiting"] == 1


@pytest.mark.parametrize("end", ["abort", "deadline"])
def test_a_reservation_whose_request_ended_is_let_go_without_its_prefill_sides_cancel(end):
    """A prefill scheduler killed after asking for blocks, then the request ends (its client
    gone, its deadline passed): the restarted prefill scheduler does not know what was asked,
    so no cancel comes. The decode side lets the reservation go itself, its blocks held while
    the prefill workers may still write, then free; a hand-off that comes late ends there."""
    c = core(num_blocks=6)
    side = decode_side(c)
    msg = request("a", 9)
    if end == "deadline":
        msg = replace(msg, deadline=time.time() + 0.2)
    side.receive(reply(ReserveMsg(encode(msg), "p0")))
    assert c.num_reserved == 1 and c.block_manager.num_free_blocks == 3
    assert not side.expire()                        # nothing ended yet
    if end == "abort":
        side.book.abort(to_fields(AbortMsg("a", "client disconnected")))
    else:
        time.sleep(0.25)
    assert side.expire() and c.num_reserved == 0
    assert side.stats()["kv_blocks_held"] == 3      # until p0's workers let go
    asked = side.held_heartbeats()
    assert not side.release_settled(asked, [beat(10.0)])     # the first look
    assert side.release_settled(asked, [beat(11.0)])         # a later beat names no write
    assert c.block_manager.num_free_blocks == 6
    side.receive(reply(HandoffMsg(encode(msg), "5-0", [77], ["d0:1"], 0, [])))
    side.book.expire(time.time())                   # as each scheduler step does
    assert c.num_running == 0 and c.get_request("a") is None


def test_a_decode_instance_takes_no_more_requests_than_max_num_seqs():
    """Each reservation becomes a running request: past --max-num-seqs running and reserved
    together, a decode instance keeps an ask waiting (answered once a seat frees), as a
    colocated scheduler admits no more than that."""
    c = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2, num_kv_blocks=64,
                                  block_size=BLOCK, max_model_len=128))
    side = decode_side(c)
    msgs = [request(f"r{i}", 5) for i in range(3)]
    side.receive(reply(ReserveMsg(encode(msgs[0]), "p0")))
    side.receive(reply(handoff(msgs[0], "5-0", 77, ["d0:1"])))
    checked(c, side)
    assert c.num_running == 1
    side.receive(reply(ReserveMsg(encode(msgs[1]), "p0")))     # one runs, one on its way
    assert side._replies[-1][1].block_ids
    side.take_replies()
    side.receive(reply(ReserveMsg(encode(msgs[2]), "p0")))     # waits for a seat
    assert side.take_replies() == []
    c.abort("r0")
    (_, granted), = side.take_replies()                         # answered as it frees
    assert granted.request_id == "r2" and granted.block_ids


def beat(at: float, tp: int = 1, unsettled: tuple[str, ...] = (),
         started_at: float = 1.0) -> bytes:
    """A prefill worker's heartbeat written at `at`, naming the requests whose writes it gave
    up on and that may still land."""
    extra = {"tp": tp, "started_at": started_at,
             **({"kv_unsettled": list(unsettled)} if unsettled else {})}
    return encode(Heartbeat("worker", "0", at, extra))


def held_for_p0(c: Scheduler) -> DecodeSide:
    """A decode side whose reservation for "a" (3 blocks of 4) was handed over without K/V:
    the request is recomputed in other blocks, the reserved ones held."""
    side = decode_side(c)
    msg = request("a", 9, max_tokens=2)
    side.receive(reply(ReserveMsg(encode(msg), "p0")))
    side.receive(reply(HandoffMsg(encode(msg), "5-0", [77], [], 0, [])))
    assert side.recomputed_total == 1 and side.stats()["kv_blocks_held"] == 3
    return side


@pytest.mark.parametrize("end", ["it settles", "a rank restarts"])
def test_the_blocks_of_a_given_up_transfer_wait_for_every_writer_to_let_go(end, monkeypatch):
    # a write the prefill worker gave up at its deadline may still land: the blocks it
    # targets go to no request until each rank of the prefill instance has beaten, after the
    # hold, without naming the request (or has been another process for a while)
    # (docs/failure-modes.md)
    clock = [100.0]
    monkeypatch.setattr(disagg.time, "monotonic", lambda: clock[0])
    c = core(num_blocks=4)
    side = held_for_p0(c)
    assert not c.schedule().new_requests        # recomputed in other blocks: one is free
    asked = side.held_heartbeats()
    assert [key for _, key in asked] == [Keys().for_instance("p0").hb_worker(0)]
    assert not side.release_settled(asked, [beat(10.0, tp=2, unsettled=("a",))])
    asked = side.held_heartbeats()              # rank 0 says there are two ranks
    assert [key for _, key in asked] == [Keys().for_instance("p0").hb_worker(r) for r in (0, 1)]
    assert not side.release_settled(asked, [beat(10.0, 2, ("a",)), beat(10.0, 2)])  # first
    assert not side.release_settled(asked, [beat(10.0, 2), beat(11.0, 2)])   # rank 0 no newer
    assert not side.release_settled(asked, [beat(11.0, 2, ("a",)), beat(11.0, 2)])  # names it
    assert not side.release_settled(asked, [beat(12.0, 2), None])     # rank 1 stopped: wait
    if end == "a rank restarts":     # what the new process names is its own writes, and the
        last = beat(1.0, 2, ("a",), started_at=2.0)     # old one may have been stopped only
        assert not side.release_settled(asked, [beat(12.0, 2), last])
        clock[0] += disagg.HELD_REPLACED_S
    else:
        last = beat(12.0, 2)
    assert side.release_settled(asked, [beat(12.0, 2), last])
    assert c.block_manager.num_aside_blocks == 0 and side.held_heartbeats() == []
    c.block_manager.check_integrity()
    new, = c.schedule().new_requests
    assert new.request_id == "a" and new.num_computed_tokens == 0


def test_a_prefill_rank_without_a_heartbeat_is_waited_for_until_taken_for_dead(monkeypatch):
    # a stopped worker loses its heartbeat (a 2 s TTL) and may write when it runs again
    clock = [100.0]
    monkeypatch.setattr(disagg.time, "monotonic", lambda: clock[0])
    c = core(num_blocks=4)
    side = held_for_p0(c)
    asked = side.held_heartbeats()
    assert not side.release_settled(asked, [beat(10.0, unsettled=("a",))])
    assert not side.release_settled(asked, [None])
    clock[0] += disagg.HELD_GONE_S - 1
    assert not side.release_settled(asked, [None])
    clock[0] += 1
    assert side.release_settled(asked, [None])
    assert c.block_manager.num_aside_blocks == 0


@pytest.mark.parametrize("seen_first", [True, False])
def test_a_prefill_rank_taken_over_by_another_process_is_waited_for(monkeypatch, seen_first):
    # a prefill worker stopped (SIGSTOP) mid-iteration loses its claim, and a new process
    # takes its rank; resumed, the old one went on with that iteration's layer writes, into
    # blocks that had gone back to the pool as soon as the new process beat. Its connector
    # refuses them now (tests/test_kv_transfer.py); the blocks wait HELD_REPLACED_S for what
    # it had on the way. Seen first or not (its beat lapsed before the first look), the same.
    clock = [100.0]
    monkeypatch.setattr(disagg.time, "monotonic", lambda: clock[0])
    c = core(num_blocks=4)
    side = held_for_p0(c)
    asked = side.held_heartbeats()
    assert not side.release_settled(asked, [beat(50.0, unsettled=("a",)) if seen_first else None])
    clock[0] += 8.0                             # the claim lapsed; the new process loaded
    new = beat(58.0, started_at=57.0)
    assert not side.release_settled(asked, [new])
    clock[0] += disagg.HELD_REPLACED_S - 0.5
    assert not side.release_settled(asked, [beat(63.0, started_at=57.0)])
    clock[0] += 0.5
    assert side.release_settled(asked, [beat(63.5, started_at=57.0)])
    assert c.block_manager.num_aside_blocks == 0


def test_a_prefill_rank_unseen_at_the_first_look_that_beats_again_lets_go():
    # a rank whose beat was missing at the first look (stalled a moment) that beats again,
    # the same process as before the hold, without naming the write: let go as any other
    c = core(num_blocks=4)
    side = held_for_p0(c)
    asked = side.held_heartbeats()
    assert not side.release_settled(asked, [None])
    assert side.release_settled(asked, [beat(50.0, started_at=1.0)])


def test_a_reservation_cancelled_while_a_write_may_land_is_held():
    c = core(num_blocks=4)
    side = decode_side(c)
    side.receive(reply(ReserveMsg(encode(request("a", 9, max_tokens=2)), "p0")))
    side.receive(reply(CancelMsg("a", "finished", kv_pending=True)))
    assert c.num_reserved == 0 and c.block_manager.num_aside_blocks == 3
    asked = side.held_heartbeats()
    assert not side.release_settled(asked, [beat(5.0)])           # the first read
    assert side.release_settled(asked, [beat(6.0)])
    assert c.block_manager.num_free_blocks == 4


def test_reservations_forgotten_with_a_lost_redis_are_held_while_a_write_may_land():
    # Redis restarted while p0's worker wrote into "a"'s blocks (a send given up at its
    # deadline lands later, whatever Redis does): freed at once, they went to the next
    # request, the late write into its K/V
    c = core(num_blocks=4)
    side = decode_side(c)
    side.receive(reply(ReserveMsg(encode(request("a", 9, max_tokens=2)), "p0")))
    side.forget_all()
    assert c.num_reserved == 0 and c.block_manager.num_aside_blocks == 3
    asked = side.held_heartbeats()
    assert not side.release_settled(asked, [beat(5.0, unsettled=("a",))])
    assert not side.release_settled(asked, [beat(6.0, unsettled=("a",))])
    assert side.release_settled(asked, [beat(7.0)])
    assert c.block_manager.num_free_blocks == 4


def test_a_decode_scheduler_starts_once_no_prefill_write_may_land_in_its_pool(monkeypatch):
    # a restarted decode scheduler does not know which blocks its predecessor reserved or
    # held: it waits until every prefill worker has beaten since its first look without
    # naming its workers' sessions among the peers its writes may still land in
    clock = [100.0]
    monkeypatch.setattr(disagg.time, "monotonic", lambda: clock[0])
    side = decode_side(core())                  # its worker: session "d0:1"

    def worker(at: float, *writing: str) -> Heartbeat:
        return Heartbeat("worker", "0", at, {"kv_writing_to": list(writing)} if writing else {})
    writers = disagg.Writers()
    assert not writers.done({"p0": worker(10.0), "p1": worker(10.0)}, side.writes_here)  # first
    assert not writers.done({"p0": worker(10.0), "p1": worker(11.0)}, side.writes_here)  # older
    assert not writers.done({"p0": worker(11.0, "d0:1"), "p1": worker(11.0)}, side.writes_here)
    # a rank without a heartbeat may be stopped, and write when it runs: waited for until dead
    beats = {"p0": worker(12.0, "d9:1"), "p1": worker(11.0), "p2": None}
    assert not writers.done(beats, side.writes_here)
    clock[0] += disagg.HELD_GONE_S
    assert writers.done(beats, side.writes_here)


def test_planned_ahead_a_handoff_joins_the_next_plan_and_an_abort_holds_its_blocks_back():
    # the decode instance plans ahead (docs/design.md#overlap): a request handed over while
    # a plan runs has its K/V checked by the plan made ahead, and joins the next; an abort's
    # blocks go back to the pool only once the plans in flight, which still run its rows,
    # have run: meanwhile no reservation (a prefill instance writes those at any time) can
    # get them; other free blocks go as usual
    c = core(num_blocks=8)
    side = decode_side(c)
    a = request("a", 9)
    b = replace(request("b", 9), prompt_token_ids=list(range(50, 59)))  # none of a's cached
    side.receive(reply(ReserveMsg(encode(a), "p0"), handoff(a, "5-0", 77, ["d0:1"])))
    checked(c, side)
    first = c.schedule()
    side.receive(reply(ReserveMsg(encode(b), "p0")))
    b_blocks = c.get_request("b").block_table
    side.receive(reply(HandoffMsg(encode(b), "6-0", [78], ["d0:1"], 0,
                                  [b_blocks, [[0] * len(b_blocks)]])))
    ahead = side.add_checks(c.schedule_ahead())
    assert first.num_scheduled_tokens == {"a": 1}
    assert ahead.num_scheduled_tokens == {"a": 1} and ahead.kv_checks[0].request_id == "b"
    held_by_a = set(c.get_request("a").block_table)
    c.abort("a")                                # both plans still carry it
    assert c.block_manager.num_free_blocks == 2     # the 2 never used; a's 3 held
    side.receive(reply(ReserveMsg(encode(request("small", 3)), "p0")))
    assert side._replies[-1][1].block_ids       # a never-used block: given at once
    assert not set(side._replies[-1][1].block_ids) & held_by_a
    side.take_replies()
    big = replace(request("big", 9), prompt_token_ids=list(range(80, 89)))
    #                                             3 blocks: only a's would do
    side.receive(reply(ReserveMsg(encode(big), "p0")))
    assert side.take_replies() == []            # it waits
    assert c.block_manager.num_free_blocks == 1
    assert c.num_reserved == 2                  # "small", and "b" while its K/V is checked
    c.update(first, StepResult(first.step, {"a": SampledToken(1)}))
    assert side.take_replies() == []            # the plan made ahead still carries "a"
    result = StepResult(ahead.step, {"a": SampledToken(2)}, kv_verified=["b"])
    c.update(ahead, result)
    side.observe(ahead, result)
    assert c.block_manager.num_free_blocks == 4     # a's back
    after = c.schedule()
    assert after.num_scheduled_tokens == {"b": 1}
    assert after.new_requests[0].kv_received == ["d0:1"]
    c.update(after, StepResult(after.step, {"b": SampledToken(3)}))
    (_, granted), = side.take_replies()         # a's blocks back: the waiting ask gets in
    assert granted.request_id == "big" and len(granted.block_ids) == 3
    assert c.num_reserved == 2
    c.block_manager.check_integrity()


def prefill_side(c: Scheduler, own: list[dict]) -> PrefillSide:
    side = PrefillSide(Keys(), "p0", c, RequestBook(c), min_prompt_tokens=8)
    side.own = own
    side.decoders = {"d0": _Decoder("d0", "host-d0", 100, 0, 1.0)}
    return side


def test_a_send_given_up_then_restarted_from_zero_is_not_trusted_again():
    """A write given up at its deadline may still land in the reserved blocks (its worker's
    heartbeat names it unsettled): after the request restarts from zero (preempted, workers
    lost) its K/V is not sent into them again and handed over as intact; the decode side
    recomputes it in blocks of its own."""
    c = core()
    side = prefill_side(c, [descriptor("p0:1")])
    side.admit(b"9-0", request("r", 10))
    side.take()
    side.receive_reservations(reply(ReservedMsg("r", "d0", "host-d0", [7, 8, 9],
                                                [descriptor("d0:1")], 1.0)))
    plan = side.add_sends(c.schedule())
    assert plan.kv_sends
    result = StepResult(plan.step, {}, kv_failed=["r"])
    c.update(plan, result)
    side.observe(plan, result)
    c.recompute_running()                   # as a preemption: num_computed_tokens = 0
    plan = side.add_sends(c.schedule())
    assert not plan.kv_sends
    result = StepResult(plan.step, {})
    c.update(plan, result)
    side.observe(plan, result)
    plan = side.add_sends(c.schedule())
    result = StepResult(plan.step, {"r": SampledToken(5)})
    out, = c.update(plan, result)
    side.observe(plan, result)
    assert side.finished(out)
    (_, _, _, handoff), = side.take().handoffs
    assert handoff.kv_received == [] and handoff.kv_check == []


def test_a_request_aborted_while_the_worker_group_is_lost_leaves_its_blocks_held():
    """The worker group is lost while a plan sends a prompt's K/V, and the request is aborted
    while the scheduler waits for the next group (it ends then, with no plan): a rank that
    only stopped may still write into the reserved blocks, so the cancel says its K/V is
    pending and the decode side holds them. Once a result of the new group is in, a cancel
    frees them at once again."""
    c = core()
    side = prefill_side(c, [descriptor("p0:1")])
    for rid, entry in (("r", b"9-0"), ("r2", b"10-0")):
        side.admit(entry, request(rid, 10))
        side.receive_reservations(reply(ReservedMsg(rid, "d0", "host-d0", [7, 8, 9],
                                                    [descriptor("d0:1")], 1.0)))
    side.take()
    plan = side.add_sends(c.schedule())
    assert {s.request_id for s in plan.kv_sends} == {"r"}
    c.recompute_running()
    side.plans_lost()
    c.abort("r")
    out, = c.take_aborted()
    assert not side.finished(out)
    (_, cancel), = side.take().cancels
    assert cancel.request_id == "r" and cancel.kv_pending
    plan = side.add_sends(c.schedule())             # the new group answers a plan
    result = StepResult(plan.step, {})
    c.update(plan, result)
    side.observe(plan, result)
    c.abort("r2")
    plan = c.schedule()
    out, = c.update(plan, StepResult(plan.step, {}))
    assert not side.finished(out)
    (_, cancel), = side.take().cancels
    assert cancel.request_id == "r2" and not cancel.kv_pending


def test_the_prefill_side_sends_each_chunk_and_hands_over_with_the_first_token():
    c = core()
    side = prefill_side(c, [descriptor("p0:1")])
    msg = request("r", 10)
    side.admit(b"9-0", msg)
    (instance, ask), = side.take().reserves
    assert instance == "d0"
    side.receive_reservations(reply(ReservedMsg("r", "d0", "host-d0", [7, 8, 9],
                                                [descriptor("d0:1")], 1.0)))
    plan = side.add_sends(c.schedule())                     # 8 rows: blocks 0 and 1
    send, = plan.kv_sends
    assert (send.src_block_ids, send.dst_block_ids) == ([0, 1], [7, 8])
    result = StepResult(plan.step, {}, kv_digests={"r": [[10, 11]]})
    c.update(plan, result)
    side.observe(plan, result)
    plan = side.add_sends(c.schedule())                     # the last 2 rows: block 2
    assert plan.kv_sends[0].dst_block_ids == [9]
    result = StepResult(plan.step, {"r": SampledToken(5)}, kv_digests={"r": [[12]]})
    out, = c.update(plan, result)
    side.observe(plan, result)
    assert out.finished and side.finished(out)
    (instance, consumer, entry, handoff), = side.take().handoffs
    assert (instance, consumer, entry) == ("d0", "host-d0", b"9-0")
    assert handoff.output_token_ids == [5] and handoff.kv_received == ["d0:1"]
    assert handoff.kv_check == [[7, 8, 9], [[10, 11, 12]]]
    assert c.block_manager.num_free_blocks == 16            # freed: the sends were done


def test_a_request_waiting_for_its_reservation_is_not_admitted_twice():
    """Its own entry handed back to it (a claim) or a duplicate entry of the same request,
    while it waits for a decode instance's blocks: nothing new in the core (the book does
    not know it yet, and would have added the whole request beside the reservation's), the
    duplicate acked; the reservation then admits it once, for its first token."""
    c = core()
    side = prefill_side(c, [descriptor("p0:1")])
    msg = request("r", 10)
    side.admit(b"9-0", msg)
    side.admit(b"9-0", msg)                     # our own entry, claimed back
    side.admit("9-0", msg)                      # ... as a forwarded hand-off names it
    side.admit(b"9-7", msg)                     # a second entry of the same request
    assert c.get_request("r") is None and side.pending_entry_ids() == [b"9-0"]
    assert side.book.take_outbox().acks == [b"9-7"]
    assert len(side.take().reserves) == 1
    side.receive_reservations(reply(ReservedMsg("r", "d0", "host-d0", [7, 8, 9],
                                                [descriptor("d0:1")], 1.0)))
    assert c.get_request("r").sampling.max_tokens == 1 and not side.pending_entry_ids()
    plan = side.add_sends(c.schedule())
    send, = plan.kv_sends
    assert len(send.src_block_ids) == len(send.dst_block_ids) == 2


def test_with_no_decode_instance_to_ask_the_prefill_side_waits_for_one():
    """A long prompt and no decode instance up: no ask goes out; once the heartbeats show
    one, housekeeping asks it."""
    c = core()
    side = prefill_side(c, [descriptor("p0:1")])
    side.decoders = {}
    side.admit(b"9-0", request("r", 10))
    assert side.pending_entry_ids() == [b"9-0"] and not side.take().reserves
    side.housekeeping({"d0": _Decoder("d0", "host-d0", 100, 0, 1.0)}, {})
    assert len(side.take().reserves) == 1


def test_asking_the_same_decode_instance_again_never_frees_the_blocks_it_names():
    """A decode instance holds one reservation per request id and answers a repeated ask with
    the same blocks: re-asking it (after a refusal, or no answer in RESERVE_RETRY_S) sends no
    cancel, a late answer to the earlier ask is not cancelled once the request uses those
    blocks, and cancels (for other instances) leave before asks in the pipeline. Before, an
    "asked again" cancel queued after the new ask freed the blocks the prefill then wrote
    into, under other requests."""
    c = core()
    side = prefill_side(c, [descriptor("p0:1")])
    side.admit(b"9-0", request("r", 10))
    assert len(side.take().reserves) == 1
    side._pending["r"].asked_at -= 60                   # no answer in time: asked again
    side.retry()
    out = side.take()
    assert [i for i, _ in out.reserves] == ["d0"] and out.cancels == []
    granted = ReservedMsg("r", "d0", "host-d0", [7, 8, 9], [descriptor("d0:1")], 1.0)
    side.receive_reservations(reply(granted, granted))  # the answers to both asks
    assert side.take().cancels == [] and c.get_request("r") is not None
    # another instance now has more room: a request asked there cancels what it left at d0
    side.admit(b"9-1", request("s", 10, first=50))       # no prefix of r's (r's stays at d0)
    side.take()
    side.decoders["d1"] = _Decoder("d1", "host-d1", 500, 0, 1.0)
    side._pending["s"].asked_at -= 60
    side.retry()
    out = side.take()
    assert [(i, m.reason) for i, m in out.cancels] == [("d0", "asked elsewhere")]
    assert [i for i, _ in out.reserves] == ["d1"]

    class Pipe:
        def __init__(self):
            self.sent = []

        def xadd(self, stream, fields, **_):
            self.sent.append(type(from_fields(fields)).__name__)

        def xclaim(self, *args, **kwargs):
            pass

    pipe = Pipe()
    side.queue(pipe, out)
    assert pipe.sent == ["CancelMsg", "ReserveMsg"]


def test_a_prompt_goes_to_the_decode_instance_its_prefix_went_to_while_it_has_room():
    """The decode instance a prompt's leading blocks were last handed to holds them in its
    prefix cache: a prompt sharing them asks it, though another has more free blocks, and so
    does a short prompt handed over whole (it computes less there). Not when that instance
    has no room for the rest, is clearly overloaded beside the least loaded one (counting
    the requests sent to it since its heartbeat), or has restarted; a prompt of another
    prefix goes by free blocks as before. Before, every prompt went by free blocks, and one
    sharing a prefix cached on d0 was sent whole to d1."""
    c = core(num_blocks=64)
    side = prefill_side(c, [descriptor("p0:1")])
    side.decoders["d1"] = _Decoder("d1", "host-d1", 90, 0, 1.0)

    def ask(rid: str, first: int = 10, n: int = 24) -> str:
        side.admit(f"9-{rid}".encode(), request(rid, n, first=first))
        (instance, _), = side.take().reserves
        return instance

    assert ask("a") == "d0"                              # the most free blocks
    side.receive_reservations(reply(ReservedMsg("a", "d0", "host-d0", list(range(7)),
                                                [descriptor("d0:1")], 1.0)))
    side.housekeeping({"d0": _Decoder("d0", "host-d0", 80, 1, 1.0),
                       "d1": _Decoder("d1", "host-d1", 90, 0, 1.0)}, {})
    assert ask("b") == "d0"                              # a's 5 cacheable blocks are there
    assert ask("c", first=50) == "d1"                    # another prefix: free blocks decide
    # a short prompt of a's prefix, handed over whole, goes there too
    side.admit(b"9-s", request("s", 6))
    (instance, _, _, _), = side.take().handoffs
    assert instance == "d0"
    # overloaded: 2 x 0 + 4 requests (running, and sent since its heartbeat) at most
    side.housekeeping({"d0": _Decoder("d0", "host-d0", 80, 4, 1.0),
                       "d1": _Decoder("d1", "host-d1", 90, 0, 1.0)}, {})
    assert ask("e") == "d0"
    assert ask("f") == "d1"                              # d0 at 5 now
    # no room there for the blocks it does not hold (7 less 5 cached)
    side.housekeeping({"d0": _Decoder("d0", "host-d0", 1, 0, 1.0),
                       "d1": _Decoder("d1", "host-d1", 90, 0, 1.0)}, {})
    assert ask("g") == "d1"
    # f and g went to d1 last, and the blocks with them
    side.housekeeping({"d0": _Decoder("d0", "host-d0", 90, 0, 1.0),
                       "d1": _Decoder("d1", "host-d1", 80, 0, 1.0)}, {})
    for rid in ("f", "g"):
        side.receive_reservations(reply(ReservedMsg(rid, "d1", "host-d1", list(range(7)),
                                                    [descriptor("d1:1")], 1.0)))
    assert ask("h") == "d1"
    # d1 restarted: its cache is empty, whatever was handed to it before
    side.housekeeping({"d0": _Decoder("d0", "host-d0", 95, 0, 1.0),
                       "d1": _Decoder("d1", "host-d1", 90, 0, 2.0)}, {})
    assert ask("i") == "d0"                              # by free blocks again


def test_a_request_goes_only_to_a_decode_instance_whose_context_holds_it(capsys):
    """A decode instance started with a shorter --max-model-len than a request's prompt +
    max_tokens (which the gateway accepted) stopped it with "length", its answer cut short
    without a word: such a request goes to a decode instance that holds it (its K/V, or a
    short prompt whole), though the shorter one has more free blocks; one that fits goes by
    free blocks as before; where no decode instance holds it, it ends at once with an error
    naming the lengths. The shorter instance is named once, in an error line."""
    from scheduler_svc.disagg import decoders_from
    from scheduler_svc.service import SchedulerService, SchedulerServiceConfig

    def decoder(instance: str, num_blocks: int, max_model_len: int) -> _Decoder:
        """A decode instance as its scheduler's heartbeat shows it to the prefill side."""
        service = SchedulerService(None, Keys(), Scheduler(SchedulerConfig(
            max_num_batched_tokens=8, num_kv_blocks=num_blocks, block_size=BLOCK,
            max_model_len=max_model_len)), SchedulerServiceConfig(
                f"host-{instance}", role="decode", instance=instance))
        return decoders_from([encode(service.heartbeat())])[instance]

    c = core()                                           # --max-model-len 128
    side = prefill_side(c, [descriptor("p0:1")])
    short = decoder("d0", 100, 64)
    side.housekeeping({"d0": short, "d1": decoder("d1", 50, 128)}, {})
    side.admit(b"1-0", request("long", 10, max_tokens=80))         # 90 tokens
    side.admit(b"2-0", request("whole", 5, max_tokens=80))
    side.admit(b"3-0", request("fits", 10, max_tokens=20, first=50))      # 30 tokens
    out = side.take()
    assert sorted((i, m.request_msg.request_id) for i, m in out.reserves) == [
        ("d0", "fits"), ("d1", "long")]
    assert [(i, m.request_msg.request_id) for i, _, _, m in out.handoffs] == [("d1", "whole")]
    side.housekeeping({"d0": short}, {})                 # d1 gone: none holds 90 tokens
    side.admit(b"4-0", request("cut", 10, max_tokens=80))
    side.admit(b"5-0", request("cut-whole", 5, max_tokens=80))
    # a chat without max_tokens (the gateway's default, 80) answers in d0's context instead
    chat = request("chat", 10, max_tokens=80, first=90)
    side.admit(b"6-0", replace(chat, sampling=replace(chat.sampling, max_tokens_default=True)))
    out = side.take()
    assert [(i, m.request_msg.request_id) for i, m in out.reserves] == [("d0", "chat")]
    assert not out.handoffs
    assert sorted(side.pending_entry_ids()) == [b"1-0", b"3-0", b"6-0"]  # asked, no answer yet
    events = {e.request_id: e for e in (decode(d) for _, d in side.book.take_outbox().finishes)}
    assert {rid: (e.finish_reason, e.error_type) for rid, e in events.items()} == {
        "cut": ("error", "invalid_request_error"),
        "cut-whole": ("error", "invalid_request_error")}
    assert "90 tokens" in events["cut"].error and "(d0 64)" in events["cut"].error
    said = capsys.readouterr().out
    assert said.count("decode instance d0 has --max-model-len 64, this prefill instance 128") \
        == 1, said


def test_a_request_waiting_for_its_reservation_ends_at_its_abort_or_deadline():
    """Aborted (its client gone) or past its deadline while the decode side has no room: it
    ends at the next retry, with the same finish event as a request the core holds, and its
    ask at the decode instance is cancelled; it asks for nothing more."""
    c = core()
    side = prefill_side(c, [descriptor("p0:1")])
    side.admit(b"9-0", request("gone", 10))
    side.admit(b"9-1", replace(request("late", 10), deadline=time.time() - 0.5))
    side.admit(b"9-2", request("waits", 10))
    side.take()
    side.book.abort(to_fields(AbortMsg("gone", "client disconnected")))
    side.retry()
    out = side.take()
    assert sorted((i, m.request_id, m.reason) for i, m in out.cancels) == [
        ("d0", "gone", "abort"), ("d0", "late", "error")]
    assert out.reserves == [] and side.pending_entry_ids() == [b"9-2"]
    events = {e.request_id: e for e in (decode(d) for _, d in side.book.take_outbox().finishes)}
    assert events["gone"].finish_reason == "abort"
    assert events["late"].error_type == "timeout_error" and "deadline" in events["late"].error
    assert side.num_awaiting_reservation == 1


def test_a_prefill_instance_keeps_the_leases_of_requests_waiting_for_a_reservation(
        redis_server, monkeypatch):
    """A long prompt that waits for a decode instance's room (longer than CLAIM_IDLE_MS
    under load) is still this scheduler's: its lease is kept as the book's live entries'
    are, so no scheduler (this one included) claims it as a dead one's. Real Redis."""
    import asyncio
    import contextlib

    import redis.asyncio as aioredis

    from scheduler_svc import takeover

    monkeypatch.setattr(takeover, "LEASE_REFRESH_S", 0.05)
    keys = Keys("lease-test:")

    async def go():
        r = aioredis.Redis.from_url(redis_server)
        await r.xgroup_create(keys.requests, keys.requests_group, id="0", mkstream=True)
        entry = await r.xadd(keys.requests, to_fields(request("r", 10)))
        await r.xreadgroup(keys.requests_group, "p0", {keys.requests: ">"})
        c = core()
        side = PrefillSide(keys, "p0", c, RequestBook(c), min_prompt_tokens=8)
        side.admit(entry, request("r", 10))     # no decode instance yet: it waits
        leases = asyncio.create_task(takeover.Takeover(
            r, keys, "p0", side.book, admit=side.admit,
            held=side.pending_entry_ids).keep_leases())
        await asyncio.sleep(0.8)
        _, claimed, *_ = await r.xautoclaim(keys.requests, keys.requests_group, "p1", 400,
                                            start_id="0-0")
        leases.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await leases
        await r.aclose()
        return claimed

    assert asyncio.run(go()) == []


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_pd_scheduler_waits_for_every_ranks_kv_descriptor(redis_server, role):
    """TP 2: a follower beats from its start, while it loads, and its beat takes its KV
    connector's descriptor only at the next write; rank 0 beats once the group has loaded.
    A scheduler that took the follower's first beat for the group's kept a pool "without a
    connector" for good: the decode instance refused every reservation, the prefill instance
    took the decode pool for another layout, and every prompt went over whole. It waits for
    the descriptor instead. Real Redis."""
    import asyncio

    import redis.asyncio as aioredis

    from gpu_worker.service import worker_heartbeat
    from scheduler_svc.service import SchedulerService, SchedulerServiceConfig

    keys = Keys(f"kv-descriptor-{role}:").for_instance(role[0] + "0")
    ranks = [descriptor(f"{role}:{rank}", tp=2, rank=rank) for rank in range(2)]

    def beat(rank: int, loaded: bool) -> bytes:
        kv = ranks[rank] if loaded else None
        return encode(worker_heartbeat(rank, 2, 16, BLOCK, kv=lambda: kv, role=role)())

    async def go() -> list[dict]:
        r = aioredis.Redis.from_url(redis_server)
        try:
            service = SchedulerService(r, keys, core(), SchedulerServiceConfig(
                "s", tp=2, role=role, instance=role[0] + "0"))
            await service.prepare()
            await r.set(keys.hb_worker(1), beat(1, loaded=False))     # loading
            await r.set(keys.hb_worker(0), beat(0, loaded=True))      # the group is up

            async def next_beat() -> None:                            # the follower's next
                await r.set(keys.hb_worker(1), beat(1, loaded=True))
            assert await service.wait_for_workers(asyncio.Event(), next_beat)
            return service.prefill.own if role == "prefill" else service.decode.peers
        finally:
            await r.aclose()

    assert [d.get("session") for d in asyncio.run(go())] == [f"{role}:0", f"{role}:1"]


def test_a_decode_instance_of_another_protocol_version_is_named_and_left_out(redis_server,
                                                                              capsys):
    """A rolling upgrade: a decode instance of another pacer release beats beside a prefill
    instance. Its messages mean something else (an older one knows nothing of the cached
    blocks a reservation shares), so it gets no request: its heartbeat read as none, and the
    prefill scheduler said nothing of why. It says so, once, naming it and both versions.
    Real Redis."""
    import asyncio

    import msgpack
    import redis.asyncio as aioredis

    from scheduler_svc.service import SchedulerService, SchedulerServiceConfig
    from shared.protocol import SCHEMA_VERSION

    keys = Keys("other-protocol:").for_instance("p0")

    def beat(instance: str, version: int) -> bytes:
        return msgpack.packb({"v": version, "kind": "heartbeat", "service": "scheduler",
                              "id": f"host-{instance}", "time": time.time(),
                              "extra": {"role": "decode", "instance": instance,
                                        "free_blocks": 100, "started_at": 1.0}})

    async def go() -> list[str]:
        r = aioredis.Redis.from_url(redis_server)
        try:
            service = SchedulerService(r, keys, core(), SchedulerServiceConfig(
                "s", role="prefill", instance="p0"))
            await r.set(keys.hb_scheduler("host-d0"), beat("d0", SCHEMA_VERSION - 1))
            await r.set(keys.hb_scheduler("host-d1"), beat("d1", SCHEMA_VERSION))
            await service._find_decoders()
            await service._find_decoders()          # the next heartbeats: said once
            return sorted(service.prefill.decoders)
        finally:
            await r.aclose()

    assert asyncio.run(go()) == ["d1"]
    line = (f"scheduler {keys.hb_scheduler('host-d0')} speaks protocol version "
            f"{SCHEMA_VERSION - 1}, this prefill scheduler version {SCHEMA_VERSION}")
    assert capsys.readouterr().out.count(line) == 1


def test_a_decode_pool_of_another_layout_prefills_the_request_itself():
    c = core()
    side = prefill_side(c, [descriptor("p0:1")])
    msg = request("r", 10)
    side.admit(b"9-0", msg)
    side.take()
    side.receive_reservations(reply(ReservedMsg(
        "r", "d0", "host-d0", [7, 8, 9], [descriptor("d0:1", tp=2), descriptor("d0:2", 2, 1)],
        1.0)))
    out = side.take()
    assert [m.reason for _, m in out.cancels] and "TP 1" in out.cancels[0][1].reason
    (_, _, _, handoff), = out.handoffs
    assert handoff.output_token_ids == [] and handoff.kv_received == []
    assert c.get_request("r") is None                       # never prefilled here


def test_a_decode_pool_whose_descriptor_is_malformed_prefills_the_request_itself():
    """KV descriptors that do not say where to write (no pool address here) are refused as
    another layout is, before any send: they made every write raise in the prefill worker's
    forward, failing the whole iteration."""
    c = core()
    side = prefill_side(c, [descriptor("p0:1")])
    side.admit(b"9-0", request("r", 10))
    side.take()
    side.receive_reservations(reply(ReservedMsg(
        "r", "d0", "host-d0", [7, 8, 9], [{**descriptor("d0:1"), "base": None}], 1.0)))
    out = side.take()
    assert "malformed: base None" in out.cancels[0][1].reason
    (_, _, _, handoff), = out.handoffs
    assert handoff.kv_received == [] and c.get_request("r") is None


def test_a_decode_pool_announcing_loopback_on_another_machine_prefills_the_request_itself():
    """A decode worker on another machine started without --kv-host announces a session on
    127.0.0.1, where the prefill workers would dial themselves: that pool is refused, with a
    line naming the flag, and the prompt goes to it whole (on the same machine it is fine)."""
    c = core()
    side = prefill_side(c, [{**descriptor("127.0.0.1:1"), "host": "prefill-machine"}])
    for rid, host in (("here", "prefill-machine"), ("there", "decode-machine")):
        side.admit(f"9-{len(rid)}".encode(), request(rid, 10))
        side.take()
        side.receive_reservations(reply(ReservedMsg(
            rid, "d0", "host-d0", [7, 8, 9], [{**descriptor("127.0.0.1:2"), "host": host}],
            1.0)))
        out = side.take()
        if rid == "here":
            assert out.cancels == [] and c.get_request("here") is not None
            continue
        (_, cancel), = out.cancels
        assert "decode-machine" in cancel.reason and "--kv-host" in cancel.reason
        assert "\n" not in cancel.reason
        (_, _, _, whole), = out.handoffs
        assert whole.kv_received == [] and c.get_request("there") is None


@pytest.mark.parametrize("peers", [["junk"], [None], [["a"]]])
def test_a_reservation_whose_descriptors_are_no_mappings_is_skipped(peers):
    """Read with .get, such an entry raised AttributeError out of the prefill scheduler's
    loop; now it is undecodable, skipped with an error line, and the request asks again."""
    c = core()
    side = prefill_side(c, [descriptor("p0:1")])
    side.admit(b"9-0", request("r", 10))
    side.take()
    import msgpack
    fields = to_fields(ReservedMsg("r", "d0", "host-d0", [7, 8, 9], [descriptor("d0:1")], 1.0))
    obj = msgpack.unpackb(fields["m"])
    obj["peers"] = peers            # as a decode scheduler of another version could write it
    fields["m"] = msgpack.packb(obj, use_bin_type=True)
    side.receive_reservations([[b"stream", [(b"1-0", fields)]]])
    out = side.take()
    assert out.handoffs == [] and c.get_request("r") is None
    assert side.num_awaiting_reservation == 1


def test_a_worker_heartbeat_whose_kv_is_no_mapping_reads_as_no_connector():
    side = decode_side(core())
    side.set_workers([encode(Heartbeat("worker", "0", 1.0, {"kv": "junk"}))])
    assert side.peers == [{}]
    side.receive(reply(ReserveMsg(encode(request("r", 10)), "p0")))
    (_, answer), = side.take_replies()
    assert answer.block_ids == [] and "no KV connector" in answer.error


def test_a_decode_pool_of_another_layout_is_not_asked_again_until_it_restarts():
    """The mismatch is remembered for the decode instance's incarnation: the next long prompt
    goes to it whole at once, with no reservation asked and cancelled per prompt; once it
    restarted (another started_at in its heartbeat) it is asked again."""
    c = core()
    side = prefill_side(c, [descriptor("p0:1")])
    side.admit(b"9-0", request("r", 10))
    side.take()
    side.receive_reservations(reply(ReservedMsg(
        "r", "d0", "host-d0", [7, 8, 9], [descriptor("d0:1", dtype="bfloat16")], 1.0)))
    side.take()
    side.admit(b"10-0", request("r2", 10))
    out = side.take()
    assert out.reserves == [] and out.cancels == []
    (instance, _, _, whole), = out.handoffs
    assert instance == "d0" and whole.kv_received == []
    side.housekeeping({"d0": _Decoder("d0", "host-d0", 100, 0, 2.0)}, {})
    side.admit(b"11-0", request("r3", 10))
    (instance, ask), = side.take().reserves
    assert instance == "d0" and decode(ask.request).request_id == "r3"


@pytest.mark.parametrize("found_by", ["its heartbeat", "its reply"])
def test_a_decode_instance_of_another_model_is_no_partner_at_all(found_by, capsys):
    """A decode instance that serves another model (other weights, the same KV shape) gets
    neither our K/V nor a prompt whole (it would answer with its own model's tokens): the
    requests go to a decode instance of this model, or, while none is up, are served here.
    Found from its heartbeat, or from the KV descriptors of its answer (it restarted with
    another model since the heartbeat), once per incarnation; it is a partner again once it
    restarts with this model."""
    c = core()
    ours = {"model": "tiny", "weights": "aaaa"}
    side = PrefillSide(Keys(), "p0", c, RequestBook(c), min_prompt_tokens=8, model=ours)
    side.own = [{**descriptor("p0:1"), **ours}]
    other = _Decoder("d0", "host-d0", 100, 0, 1.0, "tiny-tuned", "bbbb")
    if found_by == "its heartbeat":
        side.housekeeping({"d0": other}, {})
    else:
        side.housekeeping({"d0": replace(other, model="tiny", weights="aaaa")}, {})
        side.admit(b"8-0", request("first", 10))
        (instance, _), = side.take().reserves
        side.receive_reservations(reply(ReservedMsg(
            "first", "d0", "host-d0", [7, 8, 9],
            [{**descriptor("d0:1"), "model": "tiny-tuned", "weights": "bbbb"}], 1.0)))
        out = side.take()
        (_, cancel), = out.cancels
        assert "another model" in cancel.reason and not out.handoffs and not out.reserves
        assert c.get_request("first").sampling.max_tokens == 8     # served here, whole
    side.admit(b"9-0", request("long", 10))
    side.admit(b"10-0", request("short", 5))
    side.housekeeping({"d0": other}, {})        # the next heartbeats: nothing said again
    out = side.take()
    assert not out.reserves and not out.handoffs and not out.cancels
    assert c.get_request("long").sampling.max_tokens == 8
    assert c.get_request("short") is not None and not side.pending_entry_ids()
    assert capsys.readouterr().out.count("decode instance serves another model") == 1
    # a decode instance of this model comes up: the next prompts go there
    side.housekeeping({"d0": other, "d1": _Decoder("d1", "host-d1", 50, 0, 1.0, "tiny",
                                                   "aaaa")}, {})
    side.admit(b"11-0", request("next", 10))
    side.admit(b"12-0", request("next-short", 5))
    out = side.take()
    (instance, _), = out.reserves
    (whole_to, _, _, _), = out.handoffs
    assert instance == whole_to == "d1"
    # d0 restarted with this model: a partner again
    side.housekeeping({"d0": replace(other, started_at=2.0, weights="aaaa", free_blocks=500)},
                      {})
    side.admit(b"13-0", request("later", 10))
    (instance, _), = side.take().reserves
    assert instance == "d0"


def test_a_prefill_instance_serving_a_request_itself_refuses_one_longer_than_its_context():
    """While every decode instance up serves another model, the prefill instance serves a
    request itself, whole: one whose prompt + max_tokens is longer than its own
    --max-model-len (which the gateway accepted by its own, longer one) was cut short there
    with "length" without a word. It is refused with an error naming both lengths; a chat's
    default max_tokens answers in the rest of this instance's context."""
    c = core(num_blocks=40)                              # --max-model-len 128
    ours = {"model": "tiny", "weights": "aaaa"}
    side = PrefillSide(Keys(), "p0", c, RequestBook(c), min_prompt_tokens=8, model=ours)
    side.own = [{**descriptor("p0:1"), **ours}]
    side.housekeeping({"d0": _Decoder("d0", "host-d0", 100, 0, 1.0, "tiny-tuned", "bbbb")}, {})
    side.admit(b"1-0", request("long", 10, max_tokens=200))
    default = request("chat", 10, max_tokens=200)
    side.admit(b"2-0", replace(default, sampling=replace(default.sampling,
                                                         max_tokens_default=True)))
    side.take()
    assert c.get_request("long") is None
    (event,) = (decode(d) for _, d in side.book.take_outbox().finishes)
    assert (event.request_id, event.finish_reason, event.error_type) == (
        "long", "error", "invalid_request_error")
    assert "210 tokens" in event.error and "--max-model-len 128" in event.error \
        and "\n" not in event.error, event.error
    assert c.get_request("chat").sampling.max_tokens == 118


def test_a_short_prompt_goes_whole_and_a_failed_send_hands_over_without_kv():
    c = core()
    side = prefill_side(c, [descriptor("p0:1")])
    side.admit(b"1-0", request("short", 5))
    (_, _, _, whole), = side.take().handoffs
    assert whole.output_token_ids == [] and whole.kv_received == []
    side.admit(b"2-0", request("r", 8))
    side.receive_reservations(reply(ReservedMsg("r", "d0", "host-d0", [3, 4, 5],
                                                [descriptor("d0:1")], 1.0)))
    plan = side.add_sends(c.schedule())
    out, = c.update(plan, StepResult(plan.step, {"r": SampledToken(6)}, kv_failed=["r"]))
    side.observe(plan, StepResult(plan.step, {}, kv_failed=["r"]))
    assert side.finished(out)
    (_, _, _, handoff), = side.take().handoffs
    assert handoff.output_token_ids == [6] and handoff.kv_received == []
    assert RequestStatus.RUNNING not in {r.status for r in c._requests.values()}


def test_a_worker_of_another_role_is_refused_and_a_pd_worker_needs_a_connector():
    assert role_disagreement({}, 0, "decode") is None                   # role not stated
    assert role_disagreement({"role": "decode"}, 0, "decode") is None
    why = role_disagreement({"role": "prefill"}, 1, "decode")
    assert "rank 1" in why and "--role prefill" in why and "--role decode" in why
    done = subprocess.run([sys.executable, "-m", "services.cli", "worker", "--role", "decode",
                           "--instance", "d0"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--kv-connector mooncake" in done.stderr


def test_a_request_the_router_chose_for_another_prefill_instance_is_handed_there():
    """The gateway's router names the prefill instance holding the prompt's prefix; the one
    that read the entry hands it over (XCLAIM + notice) unless it is the one named, or the
    one named has no live scheduler; the named one admits it from the notice."""
    c = core()
    side = prefill_side(c, [descriptor("p0:1")])
    side.prefills = {"p0": "host-p0", "p1": "host-p1"}
    side.route(b"9-0", replace(request("a", 10), instance="p1"))
    side.route(b"9-1", replace(request("b", 10), instance="p0"))
    side.route(b"9-2", replace(request("c", 10), instance="p2"))   # no live p2: kept here
    side.route(b"9-3", request("d", 10))                          # nobody chosen
    out = side.take()
    (instance, consumer, entry, notice), = out.forwards
    assert (instance, consumer, entry) == ("p1", "host-p1", b"9-0")
    assert notice.entry_id == "9-0" and notice.output_token_ids == [] and not notice.kv_received
    assert [i for i, _ in out.reserves] == ["d0", "d0", "d0"]     # b, c, d asked d0 for blocks
    assert side.forwarded_total == 1
    # p1 receives the notice on its reservations stream and admits the request
    c1 = core()
    p1 = PrefillSide(Keys(), "p1", c1, RequestBook(c1), min_prompt_tokens=8)
    p1.decoders = {"d0": _Decoder("d0", "host-d0", 100, 0, 1.0)}
    p1.receive_reservations(reply(notice))
    (instance, ask), = p1.take().reserves
    assert instance == "d0" and ask.prefill_instance == "p1"


@pytest.mark.parametrize("kv_check", [
    [[0, 1, 2]],                                  # no digests
    [[0, 1, 2], [[1, 2, 3], [1, 2, 3]]],          # two ranks' digests, one rank here
    [[0, 1, 2], [[1, 2]]],                        # a digest short
    [[0, 1, 7], [[1, 2, 3]]],                     # blocks other than the reservation's
    [[0, 1, 2], [["a", 2, 3]]],                   # not a digest
    "garbage",
])
def test_a_hand_off_whose_check_does_not_fit_is_recomputed(kv_check):
    c, side = handed_over(kv_check)
    assert not side.checks_due
    new, = c.schedule().new_requests
    assert new.num_computed_tokens == 0 and side.recomputed_total == 1


def test_a_check_whose_plan_was_lost_rides_on_the_next_plan():
    c, side = handed_over()
    lost = side.add_checks(c.schedule())
    assert [k.request_id for k in lost.kv_checks] == ["r"] and not side.checks_due
    c.recompute_running()                       # the worker died with that plan
    side.plans_lost()
    assert side.checks_due and c.is_reserved("r")
    check, = checked(c, side).kv_checks         # checked again, on the new worker's pool
    assert check == lost.kv_checks[0]
    new, = c.schedule().new_requests
    assert new.num_computed_tokens == 9 and side.recomputed_total == 0


def test_a_check_whose_worker_restarted_meanwhile_is_not_sent_but_recomputed():
    """The decode worker stopped (a rolling restart) with a check in flight and came back with
    another KV session: its pool never held the K/V, so the request is recomputed without a
    check. The check went to the new worker before, failed, and counted as K/V that differed
    from what was sent (`kv_check_failures_total`), a false integrity alarm."""
    c, side = handed_over()
    side.add_checks(c.schedule())
    c.recompute_running()                       # the worker stopped with that plan
    side.plans_lost()
    side.peers = [descriptor("d0:2")]           # the group back, a new session
    assert not side.add_checks(c.schedule()).kv_checks and not side.checks_due
    new, = c.schedule().new_requests
    assert new.num_computed_tokens == 0 and new.kv_received == []
    assert side.recomputed_total == 1 and side.kv_check_failures_total == 0


def _reserved_on_the_prefill_side(msg: RequestMsg) -> tuple[Scheduler, PrefillSide]:
    c = core()
    side = prefill_side(c, [descriptor("p0:1")])
    side.admit(b"9-0", msg)
    side.take()
    side.receive_reservations(reply(ReservedMsg(msg.request_id, "d0", "host-d0", [7, 8, 9],
                                                [descriptor("d0:1")], 1.0)))
    return c, side


def test_a_request_ended_before_its_first_token_is_cancelled_not_handed_over():
    """A deadline passed (or a client gone) mid-prefill: the request ends with no token, its
    reservation is cancelled, and nothing asks for a last token it does not have (that took
    the prefill scheduler down, in a crash loop as each restart took the request back)."""
    c, side = _reserved_on_the_prefill_side(request("r", 10))
    plan = side.add_sends(c.schedule())                     # the first chunk is running
    side.book.stop("r", "the request's deadline passed", "timeout_error")
    # its write given up at the deadline: the decode side holds the blocks while it may land
    result = StepResult(plan.step, {}, kv_failed=["r"])
    outs = c.update(plan, result)
    side.observe(plan, result)
    [out] = [o for o in outs if o.request_id == "r"]
    assert out.finished and not out.new_tokens
    assert side.finished(out) is False
    assert side.take().cancels == [("d0", CancelMsg("r", "finished", kv_pending=True))]


def test_min_tokens_reach_the_prefill_leg_as_one_at_most():
    """The prefill instance samples the first token only: min_tokens 30 of 40 becomes 1 of 1
    there (EOS still kept from that token), where it used to fail SamplingParams' check and
    take the prefill scheduler down."""
    sampling = SamplingParams(max_tokens=40, min_tokens=30, temperature=0.0)
    c, _side = _reserved_on_the_prefill_side(replace(request("r", 10), sampling=sampling))
    admitted = c.get_request("r").sampling
    assert (admitted.max_tokens, admitted.min_tokens) == (1, 1)
    assert admitted.suppressed(0, frozenset({2})) == sampling.suppressed(0, frozenset({2}))


def test_a_prefill_side_leaves_a_request_another_scheduler_claimed_without_cancels():
    """Another prefill scheduler claimed two of this one's entries while it stalled: one still
    waiting for its reservation, one being prefilled into reserved blocks. Both are dropped
    with no cancel to the decode instance: it holds one reservation per request id, the one
    the new owner's ask gets too."""
    c = core()
    side = prefill_side(c, [descriptor("p0:1")])
    side.admit(b"9-0", request("waiting", 10))
    side.admit(b"9-1", request("prefilling", 10))
    side.take()
    side.receive_reservations(reply(ReservedMsg("prefilling", "d0", "host-d0", [7, 8, 9],
                                                [descriptor("d0:1")], 1.0)))
    plan = c.schedule()
    for entry_id in (b"9-0", "9-1"):
        side.lose(entry_id)
        side.book.lose(entry_id)
    assert not side.pending_entry_ids() and c.get_request("prefilling") is None
    for output in c.update(plan, StepResult(plan.step, {})):   # its abort, as served
        if output.finished and not side.finished(output):
            side.book.finished(output)
    assert side.take().cancels == [] and side.book.take_outbox() == Outbox()


def test_a_hand_off_goes_only_while_its_entry_is_the_prefill_schedulers(redis_server):
    """A prefill scheduler that stalled between a request's first token and its hand-off: one
    entry another prefill scheduler claimed meanwhile stays that one's (an XCLAIM took it
    from it: two schedulers served the request), one that ended there (acked) is not handed
    over, or the decode instance started it again for nobody; its reservation is cancelled
    instead. One still its own goes as before. Real Redis."""
    import asyncio

    import redis as sync_redis
    import redis.asyncio as aioredis

    from shared.scripts import execute

    r = sync_redis.Redis.from_url(redis_server)
    keys = Keys("move-test:")
    r.xgroup_create(keys.requests, keys.requests_group, id="0", mkstream=True)
    msgs = {rid: request(rid, 9) for rid in ("mine", "claimed", "ended")}
    entries = {rid: r.xadd(keys.requests, to_fields(m)) for rid, m in msgs.items()}
    r.xreadgroup(keys.requests_group, "p0", {keys.requests: ">"})
    r.xclaim(keys.requests, keys.requests_group, "p1", 0, [entries["claimed"]], justid=True)
    r.xack(keys.requests, keys.requests_group, entries["ended"])
    c = core(num_blocks=12)
    d0 = decode_side(c)
    d0.keys = keys.for_instance("d0")
    for m in msgs.values():
        d0.receive(reply(ReserveMsg(encode(m), "p0")))
    assert c.num_reserved == 3
    p0 = prefill_side(core(), [descriptor("p0:1")])
    p0.keys, p0.consumer = keys, "p0"
    for rid, m in msgs.items():
        p0.out.handoffs.append(("d0", "host-d0", entries[rid],
                                handoff(m, stream_id_text(entries[rid]), 77, ["d0:1"])))
    async def move():       # as the scheduler runs its pipelines (the scripts by digest)
        client = aioredis.Redis.from_url(redis_server)
        try:
            pipe = client.pipeline(transaction=False)
            p0.queue(pipe, p0.take())
            await execute(pipe)
        finally:
            await client.aclose()
    asyncio.run(move())
    owners = {p["message_id"]: p["consumer"].decode()
              for p in r.xpending_range(keys.requests, keys.requests_group, "-", "+", 10)}
    assert owners == {entries["mine"]: "host-d0", entries["claimed"]: "p1"}
    notices = [from_fields(f) for _, f in r.xrange(d0.keys.handoff)]
    assert [(type(n).__name__, n.request_id if isinstance(n, CancelMsg)
             else n.request_msg.request_id) for n in notices] == \
        [("HandoffMsg", "mine"), ("CancelMsg", "ended")]
    d0.receive(r.xread({d0.keys.handoff: "0-0"}))
    assert c.get_request("ended") is None and c.is_reserved("claimed")
    assert d0.checks_due and c.block_manager.num_free_blocks == 12 - 2 * 3
    r.close()


@pytest.mark.parametrize("reply_lost", [False, True])
def test_a_hand_off_or_forward_the_move_skips_is_logged_once_naming_why(redis_server,
                                                                        monkeypatch, reply_lost):
    """The move script skips an entry that is no longer the prefill scheduler's: one acked
    meanwhile (its request ended), one another scheduler claimed. Each skip, a hand-off's or
    a forward's, is logged once with the request id and why, by the scheduler's intake
    (among a cancel and a reserve that went out beside them); a move that went is not, nor
    one that an intake's try whose reply was lost made (its retry finds the entry the new
    owner's). Real Redis."""
    import asyncio

    import redis.asyncio as aioredis
    from structlog.testing import capture_logs

    from scheduler_svc.service import SchedulerService, SchedulerServiceConfig

    keys = Keys(f"move-log-{reply_lost}:").for_instance("p0")
    rids = ("mine", "claimed", "ended", "fwd-claimed", "fwd-ended")

    async def go() -> list[dict]:
        r = aioredis.Redis.from_url(redis_server)
        try:
            service = SchedulerService(r, keys, core(), SchedulerServiceConfig(
                "sched-p0", role="prefill", instance="p0"))
            await service.prepare()
            entries = {rid: await r.xadd(keys.requests, to_fields(request(rid, 9)))
                       for rid in rids}
            await r.xreadgroup(keys.requests_group, "sched-p0", {keys.requests: ">"})
            for rid in ("claimed", "fwd-claimed"):
                await r.xclaim(keys.requests, keys.requests_group, "sched-p9", 0,
                               [entries[rid]], justid=True)
            await r.xack(keys.requests, keys.requests_group, entries["ended"],
                         entries["fwd-ended"])
            out = service.prefill.out
            out.cancels.append(("d0", CancelMsg("other", "asked elsewhere")))
            out.reserves.append(("d0", ReserveMsg(encode(request("other", 9)), "p0")))
            for rid in ("mine", "claimed", "ended"):
                out.handoffs.append(("d0", "host-d0", entries[rid],
                                     handoff(request(rid, 9), stream_id_text(entries[rid]),
                                             77, ["d0:1"])))
            for rid in ("fwd-claimed", "fwd-ended"):
                out.forwards.append(("p1", "sched-p1", entries[rid], HandoffMsg(
                    encode(request(rid, 9)), stream_id_text(entries[rid]), [], [])))
            lost = lose_a_reply(monkeypatch, "EVALSHA") if reply_lost else None
            with capture_logs() as logs:
                await service._intake(pull=False, block=False)
            assert not reply_lost or lost
            owners = {stream_id_text(p["message_id"]): p["consumer"].decode() for p in
                      await r.xpending_range(keys.requests, keys.requests_group, "-", "+", 10)}
            assert owners == {stream_id_text(entries["mine"]): "host-d0",
                              stream_id_text(entries["claimed"]): "sched-p9",
                              stream_id_text(entries["fwd-claimed"]): "sched-p9"}
            return [e for e in logs if e["event"].startswith("request entry not moved")]
        finally:
            await r.aclose()

    skipped = asyncio.run(go())
    assert sorted((e["request_id"], e["to_instance"], e["why"]) for e in skipped) == [
        ("claimed", "d0", "scheduler sched-p9 claimed its entry meanwhile"),
        ("ended", "d0", "its request ended first (its entry was acked)"),
        ("fwd-claimed", "p1", "scheduler sched-p9 claimed its entry meanwhile"),
        ("fwd-ended", "p1", "its request ended first (its entry was acked)")]
    assert all(e["log_level"] == "warning" for e in skipped)


def test_a_prompt_whose_prefix_the_decode_pool_caches_gets_and_is_sent_only_the_rest():
    """With prefix caching, a reservation takes the prompt's leading blocks the decode pool's
    cache holds (shared, as an admission takes them) and new blocks for the rest only; the
    prefill side sends, and the hand-off's check covers, only those, and the request runs on
    past its prompt in the shared blocks. Before, every prompt got new blocks for all of it
    and its whole K/V was sent again."""
    c = core()
    d0 = decode_side(c)
    first = request("a", 9)
    d0.receive(reply(ReserveMsg(encode(first), "p0")))
    d0.receive(reply(handoff(first, "5-0", 77, ["d0:1"])))
    checked(c, d0)
    plan = c.schedule()                     # its first decode: its 2 full blocks are cached
    c.update(plan, StepResult(plan.step, {"a": SampledToken(78)}))
    second = request("b", 10)               # the same 8 leading tokens as "a"'s
    d0.receive(reply(ReserveMsg(encode(second), "p0")))
    (_, granted), = d0._replies[-1:]
    assert granted.block_ids[:2] == c.get_request("a").block_table[:2]
    assert granted.num_cached_blocks == 2 and len(granted.block_ids) == 3
    assert c.block_manager.prefix_cache_hits == 8
    p = core()
    p0 = prefill_side(p, [descriptor("p0:1")])
    p0.admit(b"9-0", second)
    p0.take()
    p0.receive_reservations(reply(decode(encode(granted))))
    sends = []
    while True:
        plan = p0.add_sends(p.schedule())
        sends += [(s.src_block_ids, s.dst_block_ids) for s in plan.kv_sends]
        done = p.get_request("b").num_computed_tokens + plan.num_scheduled_tokens["b"] == 10
        result = StepResult(plan.step, {"b": SampledToken(5)} if done else {},
                            kv_digests={s.request_id: [[900 + b for b in s.dst_block_ids]]
                                        for s in plan.kv_sends})
        outs = p.update(plan, result)
        p0.observe(plan, result)
        if done:
            break
    assert sends == [([2], granted.block_ids[2:])]      # the chunk of rows 8-9 only
    assert p0.finished(outs[0])
    (_, _, _, handed), = p0.take().handoffs
    assert handed.kv_check == [granted.block_ids[2:], [[900 + granted.block_ids[2]]]]
    d0.receive(reply(handed))
    plan = d0.add_checks(c.schedule())      # beside "a"'s next decode
    check, = plan.kv_checks
    assert check.block_ids == granted.block_ids[2:]
    result = StepResult(plan.step, {"a": SampledToken(79)}, kv_verified=["b"])
    c.update(plan, result)
    d0.observe(plan, result)
    assert d0.recomputed_total == 0
    plan = c.schedule()
    new, = plan.new_requests
    assert new.num_computed_tokens == 10 and new.block_table == granted.block_ids
    c.update(plan, StepResult(plan.step, {"a": SampledToken(80), "b": SampledToken(6)}))
    c.block_manager.check_integrity()


def pd_pair(r, prefix: str, num_blocks: int) -> tuple[PrefillSide, DecodeSide]:
    """p0's prefill side and d0's decode side (a pool of `num_blocks` blocks of 4) on real
    Redis under `prefix`, their inboxes read from the start."""
    keys = Keys(prefix)
    p0 = prefill_side(core(), [descriptor("p0:1")])
    d0 = decode_side(core(num_blocks))
    p0.keys, d0.keys = keys, keys.for_instance("d0")
    p0.cursor = d0.cursor = "0-0"
    return p0, d0


def exchange(r, p0: PrefillSide, d0: DecodeSide) -> None:
    """One round of what p0's and d0's schedulers each write and read at an intake."""
    # the move script by its digest: a scheduler's async pipeline (shared.scripts.execute)
    # sends one the server lacks again; this synchronous one finds it loaded
    r.script_load(disagg._MOVE.text)
    pipe = r.pipeline(transaction=False)
    p0.queue(pipe, p0.take())
    pipe.execute()
    d0.receive(r.xread({d0.keys.handoff: d0.cursor}, count=1000))
    pipe = r.pipeline(transaction=False)
    d0.queue(pipe, d0.take_replies())
    pipe.execute()
    p0.receive_reservations(r.xread({p0.keys.for_instance("p0").reservations: p0.cursor},
                                    count=1000))
    p0.retry()


def inbox(r, d0: DecodeSide, kind: type) -> list:
    """The messages of `kind` written into d0's handoff stream so far."""
    return [m for m in (from_fields(f) for _, f in r.xrange(d0.keys.handoff))
            if isinstance(m, kind)]


def test_a_full_decode_instance_keeps_each_ask_and_answers_them_in_arrival_order(
        redis_server, monkeypatch):
    """Six long prompts ask a decode instance with room for two: the other asks wait there,
    each written once, and are answered as room frees (here, reservations cancelled as their
    requests end on the prefill side), in the order they came; one whose request ended while
    it waited (its client gone) is dropped. Before, "no room" came back at once and the
    prefill side asked again 0.2 s later, the whole request each time: 30 waiting 850-token
    prompts wrote 2,015 asks for 30 requests, each decoded and answered by the decode
    scheduler between its plans. (RESERVE_RETRY_S, the prefill side's fallback should no
    answer come, is set past the test's length.) Real Redis."""
    import redis as sync_redis

    monkeypatch.setattr(disagg, "RESERVE_RETRY_S", 600.0)
    r = sync_redis.Redis.from_url(redis_server)
    p0, d0 = pd_pair(r, "ask-queue:", num_blocks=6)     # 9-token prompts: 3 blocks each
    order = ["r3", "r1", "r5", "r0", "r4", "r2"]
    for i, rid in enumerate(order):
        p0.admit(f"9-{i}".encode(), request(rid, 9))
    end = time.monotonic() + 1.0                    # 5 re-asks a second each, before
    while time.monotonic() < end:
        exchange(r, p0, d0)
        time.sleep(0.02)
    granted = [m.request_id for m in (from_fields(f) for _, f in
                                      r.xrange(p0.keys.for_instance("p0").reservations))
               if m.block_ids]
    assert granted == order[:2]
    assert [m.request_msg.request_id for m in inbox(r, d0, ReserveMsg)] == order
    assert d0.stats()["num_reservations_waiting"] == 4
    p0.book.abort(to_fields(AbortMsg("r5", "client disconnected")))    # waiting: dropped
    exchange(r, p0, d0)                     # p0 ends it, and cancels its ask ...
    exchange(r, p0, d0)                     # ... which d0 drops
    assert d0.stats()["num_reservations_waiting"] == 3
    for rid in order[:2] + order[3:5]:      # each reservation let go lets the next ask in
        p0.core.abort(rid)
        out, = p0.core.take_aborted()
        assert not p0.finished(out)
        exchange(r, p0, d0)
    granted = [m.request_id for m in (from_fields(f) for _, f in
                                      r.xrange(p0.keys.for_instance("p0").reservations))
               if m.block_ids]
    assert granted == ["r3", "r1", "r0", "r4", "r2"]
    assert len(inbox(r, d0, ReserveMsg)) == len(order)      # each asked once
    assert d0.stats()["num_reservations_waiting"] == 0
    r.close()


def test_waiting_asks_keep_their_place_end_with_their_request_and_are_bounded(monkeypatch):
    """An ask asked again while it waits (the prefill side's fallback past RESERVE_RETRY_S,
    or its entry's new owner asking) keeps its place, and is answered to whoever asked last;
    one whose client aborted, whose deadline passed or that was not asked again for
    WAITING_ASK_GONE_S is dropped; past WAITING_ASKS_MAX of one prefill instance waiting,
    the next is answered NO_ROOM, and that prefill side asks again only after
    RESERVE_RETRY_S."""
    monkeypatch.setattr(disagg, "WAITING_ASKS_MAX", 3)
    c = core(num_blocks=3)
    side = decode_side(c)
    side.receive(reply(ReserveMsg(encode(request("in", 9, 2)), "p0")))     # the whole pool
    side.take_replies()
    late = replace(request("late", 9, 2), deadline=time.time() + 0.2)
    side.receive(reply(*(ReserveMsg(encode(m), "p0") for m in
                         (request("a", 9, 2), late, request("b", 9, 2), request("c", 9, 2)))))
    side.receive(reply(ReserveMsg(encode(request("x", 9, 2)), "p1")))     # p1's asks apart
    (to, refused), = side.take_replies()
    assert (to, refused.request_id, refused.error) == ("p0", "c", NO_ROOM)
    side.receive(reply(ReserveMsg(encode(request("a", 9, 2)), "p2")))     # a's new owner
    side.book.abort(to_fields(AbortMsg("b", "client disconnected")))
    time.sleep(0.25)
    assert side.expire() and side.stats()["num_reservations_waiting"] == 2     # a, x
    side.receive(reply(CancelMsg("in", "finished")))
    (to, granted), = side.take_replies()
    assert (to, granted.request_id, len(granted.block_ids)) == ("p2", "a", 3)
    # one its prefill side stopped asking for (it asks again every RESERVE_RETRY_S while it
    # waits): gone, or restarted without it
    side.receive(reply(ReserveMsg(encode(request("y", 9, 2)), "p1")))
    for rid in ("x", "y"):
        msg, at = side._asks[rid]
        side._asks[rid] = (msg, at - disagg.WAITING_ASK_GONE_S - 1)
    side.receive(reply(ReserveMsg(encode(request("y", 9, 2)), "p1")))     # asked again
    side.expire()
    assert list(side._asks) == ["y"]                        # x was not
    p0 = prefill_side(core(), [descriptor("p0:1")])
    p0.admit(b"9-0", request("c", 9, 2))
    p0.take()
    p0.receive_reservations(reply(refused))
    p0.retry()
    assert p0.take().reserves == []
    p0._pending["c"].asked_at -= disagg.RESERVE_RETRY_S
    p0.retry()
    assert [i for i, _ in p0.take().reserves] == ["d0"]


def prefill_and_hand_over(p0: PrefillSide) -> None:
    """p0's core runs its requests to their first token, as its workers would (each send's
    digests returned), and p0 hands each over."""
    c = p0.core
    while c.has_unfinished():
        plan = p0.add_sends(c.schedule())
        result = StepResult(plan.step, {rid: SampledToken(5) for rid in c.samples_in_flight()},
                            kv_digests={s.request_id: [[900 + b for b in s.dst_block_ids]]
                                        for s in plan.kv_sends})
        outs = c.update(plan, result)
        p0.observe(plan, result)
        for out in outs:
            if out.finished:
                assert p0.finished(out)


def admit_entry(r, p0: PrefillSide, msg: RequestMsg) -> None:
    """A request into the request stream, read by p0's scheduler (the group made if need
    be), and admitted by p0."""
    keys = p0.keys
    if not r.exists(keys.requests):
        r.xgroup_create(keys.requests, keys.requests_group, id="0", mkstream=True)
    r.xadd(keys.requests, to_fields(msg))
    (_, [(entry, _)]), = r.xreadgroup(keys.requests_group, p0.consumer, {keys.requests: ">"})
    p0.admit(entry, msg)


def run_to_the_end(c: Scheduler) -> dict[str, tuple[int, list[str]]]:
    """c's requests run to their end, the pool's books checked at each step; each new to the
    workers -> (its computed tokens, kv_received) as they first got it."""
    outs = {}
    while c.has_unfinished():
        plan = c.schedule()
        outs.update({n.request_id: (n.num_computed_tokens, n.kv_received)
                     for n in plan.new_requests})
        c.update(plan, StepResult(plan.step, {rid: SampledToken(60)
                                              for rid in c.samples_in_flight()}))
        c.block_manager.check_integrity()
    return outs


def test_a_lost_worker_group_leaves_no_reservation_sharing_a_prefix_it_no_longer_knows(
        redis_server):
    """Two reservations took the same cached prefix of the decode pool (shared blocks); then
    the decode worker group is lost, and the core empties its prefix cache (the blocks' K/V is
    unknown from then on). Before, both reservations kept sharing those blocks, no longer
    cached (`check_integrity` refused the pool's books), and ran on them as received K/V
    (the hand-off's check covers only the blocks sent): a new worker's blocks hold nothing
    there; and those blocks never went back into the prefix cache. Now each reservation on
    a cached prefix is let go at the loss (its blocks written by the prefill side held
    while a write may land), and the request is recomputed here when its hand-off comes, its
    full blocks cached again as it computes them. The books balance at each step. Real
    Redis."""
    import redis as sync_redis

    r = sync_redis.Redis.from_url(redis_server)
    p0, d0 = pd_pair(r, "reset:", num_blocks=16)
    c, blocks = d0.core, d0.core.block_manager
    p0.consumer = "p0"
    admit_entry(r, p0, request("a", 9))
    exchange(r, p0, d0)
    prefill_and_hand_over(p0)
    exchange(r, p0, d0)
    checked(c, d0)
    plan = c.schedule()                 # "a"'s first decode here: its 2 full blocks cached
    c.update(plan, StepResult(plan.step, {"a": SampledToken(78)}))
    assert blocks.num_cached_blocks == 2
    admit_entry(r, p0, request("b", 10, max_tokens=3))   # the same 8 leading tokens
    exchange(r, p0, d0)
    prefill_and_hand_over(p0)
    exchange(r, p0, d0)                 # "b" handed over: its K/V's check is due
    assert d0.checks_due and c.is_reserved("b")
    admit_entry(r, p0, request("c", 10, max_tokens=3))   # ... and again
    exchange(r, p0, d0)
    shared = c.get_request("a").block_table[:2]
    assert [c.get_request(rid).block_table[:2] for rid in "bc"] == [shared, shared]
    blocks.check_integrity()
    d0.plans_lost()                     # the worker group is lost (as service._recover)
    c.recompute_running()
    blocks.check_integrity()
    assert not c.is_reserved("b") and not c.is_reserved("c") and not d0.checks_due
    assert d0.recomputed_total == 1             # "b", handed over already
    assert blocks.num_aside_blocks == 2         # each one's block p0 wrote into
    prefill_and_hand_over(p0)
    exchange(r, p0, d0)
    outs = run_to_the_end(c)
    # each recomputed, "b" and "c" on the prefix "a" computed again
    assert outs == {"a": (0, []), "b": (8, []), "c": (8, [])}
    d0.receive(reply(ReserveMsg(encode(request("e", 10)), "p0")))
    (_, granted), = d0.take_replies()
    assert granted.num_cached_blocks == 2
    blocks.check_integrity()
    r.close()


async def served_prefill(r, prefix: str, **config):
    """A prefill scheduler service "s" of instance p0 under `prefix` on real Redis, prepared,
    its worker up, decode instance d0 beating beside it (nothing answers its asks)."""
    from gpu_worker.service import worker_heartbeat
    from scheduler_svc.service import SchedulerService, SchedulerServiceConfig

    keys = Keys(prefix).for_instance("p0")
    service = SchedulerService(r, keys, core(), SchedulerServiceConfig(
        "s", role="prefill", instance="p0", **config))
    await service.prepare()
    kv = descriptor("p0:1")
    await r.set(keys.hb_worker(0), encode(worker_heartbeat(0, 1, 16, BLOCK, kv=lambda: kv,
                                                           role="prefill")()))
    await r.set(keys.hb_scheduler("host-d0"), encode(Heartbeat(
        "scheduler", "host-d0", time.time(), {"role": "decode", "instance": "d0",
                                              "free_blocks": 100, "running": 0,
                                              "started_at": 1.0, "model": "", "weights": ""})))
    import asyncio
    assert await service.wait_for_workers(asyncio.Event())
    return keys, service


def test_requests_waiting_for_a_reservation_count_against_the_intake_bound(redis_server):
    """Every decode instance full: a prefill scheduler's requests wait for their blocks
    there. They count against max_waiting as its queued ones do, so it claims no more of the
    shared requests stream than that (the rest stay for another prefill instance, and a
    scheduler that dies leaves that many to take over), and claims the next as one ends.
    Before, its bound counted only its core's queue: it claimed every request in the stream,
    each with an ask waiting at the decode instance. Real Redis."""
    import asyncio

    import redis.asyncio as aioredis

    async def go():
        r = aioredis.Redis.from_url(redis_server)
        try:
            keys, service = await served_prefill(r, "backpressure:", max_waiting=3)
            for i in range(6):
                await r.xadd(keys.requests, to_fields(request(f"r{i}", 40)))
            for _ in range(3):
                await service._intake(pull=True, block=False)
            claimed = (await r.xpending(keys.requests, keys.requests_group))["pending"]
            asks = len(await r.xrange(keys.for_instance("d0").handoff))
            await r.xadd(keys.aborts, to_fields(AbortMsg("r0", "client disconnected")))
            for _ in range(3):
                await service._intake(pull=True, block=False)
            return claimed, asks, sorted(service.prefill._pending)
        finally:
            await r.aclose()

    assert asyncio.run(go()) == (3, 3, ["r1", "r2", "r3"])


def test_an_idle_prefill_scheduler_waits_for_answers_without_polling(redis_server):
    """Its asks out and nothing else to do, a prefill scheduler issues no Redis command while
    no answer comes (here for idle_block_ms, a minute): its intake blocks on one read of its
    inbox and the requests stream; an answer, or a new request, wakes it at once. Before, it
    read the requests stream blocking 5 ms while an ask was out (~100 ms where Redis keeps
    its default hz) and its inbox without blocking, in a loop: over 10 s of waiting asks
    460 Redis commands a second with Redis at hz 500 (0.85 s of the scheduler's CPU), 42
    now. Real Redis."""
    import asyncio
    import contextlib

    import redis.asyncio as aioredis

    async def calls(r) -> int:
        stats = await r.info("commandstats")
        return sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0)
                   for c in ("xread", "xreadgroup", "xinfo|groups", "xadd"))

    async def until(what, deadline_s: float = 10.0) -> None:
        end = time.monotonic() + deadline_s
        while not await what():
            assert time.monotonic() < end
            await asyncio.sleep(0.02)

    async def go():
        r = aioredis.Redis.from_url(redis_server)
        watch = aioredis.Redis.from_url(redis_server)
        loop = None
        try:
            keys, service = await served_prefill(r, "no-polling:", idle_block_ms=60_000)
            for i in range(2):
                await r.xadd(keys.requests, to_fields(request(f"r{i}", 40)))
            loop = asyncio.create_task(service.run(asyncio.Event()))
            handoff = keys.for_instance("d0").handoff

            async def asked(n: int) -> bool:
                return await watch.xlen(handoff) == n
            await until(lambda: asked(2))

            async def blocking() -> bool:           # the intake after the asks is blocking
                # (a loaded machine takes a while to get there: a quiet spell alone is not
                # proof; Redis lists the client blocked in its read)
                clients = await watch.client_list()
                return any("b" in c["flags"] and c["cmd"].startswith("xread")
                           for c in clients)
            await until(blocking)
            before = await calls(watch)
            await asyncio.sleep(0.5)
            idle = await calls(watch) - before
            await watch.xadd(keys.requests, to_fields(request("r2", 40)))
            await until(lambda: asked(3))           # woken by a new request
            await watch.xadd(keys.reservations, to_fields(ReservedMsg(
                "r0", "d0", "host-d0", list(range(11)), [descriptor("d0:1")], 1.0)))

            async def admitted() -> bool:
                return service.core.get_request("r0") is not None
            await until(admitted)                   # woken by the answer
            return idle
        finally:
            if loop is not None:
                loop.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loop
            await watch.aclose()
            await r.aclose()

    assert asyncio.run(go()) == 0


def test_a_handed_over_prompt_joins_the_decode_prefix_cache_once_its_kv_is_verified(
        redis_server):
    """A request handed over with its prompt's K/V, verified by the workers' check, has its
    prompt's full blocks in the decode pool's prefix cache from its activation: a prompt
    sharing them that asks right then (a shared system prompt under load) is sent only the
    rest. Before, they joined only after its first decode's result, and that ask got the
    whole prompt's K/V sent again. Blocks whose check is in flight are not cached, nor are
    those of a request whose check failed (recomputed here: they are cached as it computes
    them). The books balance at each step. Real Redis."""
    import redis as sync_redis

    r = sync_redis.Redis.from_url(redis_server)
    p0, d0 = pd_pair(r, "verified-prefix:", num_blocks=16)
    c, blocks = d0.core, d0.core.block_manager
    p0.consumer = "p0"

    def granted(rid: str) -> ReservedMsg:
        msg, = [m for m in (from_fields(f) for _, f in
                            r.xrange(p0.keys.for_instance("p0").reservations))
                if m.request_id == rid and m.block_ids]
        return msg

    admit_entry(r, p0, request("a", 9))
    exchange(r, p0, d0)
    prefill_and_hand_over(p0)
    exchange(r, p0, d0)                 # "a" handed over: its K/V's check is due
    plan = d0.add_checks(c.schedule())  # ... and in flight
    admit_entry(r, p0, request("b", 10, max_tokens=3))     # the same 8 leading tokens
    exchange(r, p0, d0)
    assert granted("b").num_cached_blocks == 0      # "a"'s blocks are not verified yet
    assert blocks.num_cached_blocks == 0
    blocks.check_integrity()
    result = StepResult(plan.step, {}, kv_verified=["a"])
    c.update(plan, result)
    d0.observe(plan, result)            # "a" runs on, its first decode not yet planned
    assert not c.is_reserved("a") and c.get_request("a").num_computed_tokens == 9
    assert blocks.num_cached_blocks == 2
    blocks.check_integrity()
    admit_entry(r, p0, request("c", 10, max_tokens=3))
    exchange(r, p0, d0)
    assert granted("c").num_cached_blocks == 2
    assert granted("c").block_ids[:2] == c.get_request("a").block_table[:2]
    blocks.check_integrity()
    prefill_and_hand_over(p0)
    exchange(r, p0, d0)                 # "b" and "c" handed over
    plan = d0.add_checks(c.schedule())
    assert sorted(k.request_id for k in plan.kv_checks) == ["b", "c"]
    result = StepResult(plan.step, {rid: SampledToken(60) for rid in c.samples_in_flight()},
                        kv_verified=["c"])              # "b"'s check fails
    c.update(plan, result)
    d0.observe(plan, result)
    assert d0.kv_check_failures_total == 1 and d0.recomputed_total == 1
    assert blocks.num_cached_blocks == 2        # "b"'s blocks: nothing cached of them
    blocks.check_integrity()
    outs = run_to_the_end(c)
    # "b" recomputed on the verified prefix "a" cached; "c" on its received K/V
    assert outs == {"b": (8, []), "c": (10, ["d0:1"])}
    r.close()
