"""The scheduling core from plain ints: plans are asserted on directly, and a `FakeWorker`
plays the worker's side of the plan protocol (keeps its own copy of each request, applies the
diffs, samples a fixed token) so that new-vs-cached data, block tables and finished ids are
checked the way a real worker would consume them."""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from scheduler_svc.core import RequestStatus, Scheduler
from scheduler_svc.core.scheduler import MAX_DEFERRALS
from shared.config import SchedulerConfig
from shared.errors import InvalidRequestError
from shared.outputs import RequestOutput
from shared.plan import IterationPlan, SampledToken, StepResult
from shared.sampling import SamplingParams

EOS = 2
TOKEN = 7          # what the fake model samples unless told otherwise
ROOT = Path(__file__).resolve().parents[1]


# ---- factory helpers ---------------------------------------------------------------------

def make_scheduler(budget: int = 64, max_seqs: int = 8, num_blocks: int = 64,
                   block_size: int = 4, max_model_len: int = 256, chunked: bool = True,
                   eos: int | tuple[int, ...] | None = EOS,
                   prefix_caching: bool = True) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                             num_kv_blocks=num_blocks, block_size=block_size,
                             max_model_len=max_model_len, enable_chunked_prefill=chunked,
                             enable_prefix_caching=prefix_caching)
    return Scheduler(config, eos, max_model_len)


def prompt(n: int) -> list[int]:
    return [100 + i % 50 for i in range(n)]      # never EOS, never a stop id used here


def add(sched: Scheduler, request_id: str, num_prompt: int, max_tokens: int = 4,
        **sampling) -> None:
    sched.add_request(request_id, prompt(num_prompt), SamplingParams(max_tokens=max_tokens,
                                                                      **sampling))


@dataclass
class WorkerRequest:
    token_ids: list[int]
    num_prompt_tokens: int
    block_table: list[int]
    num_computed_tokens: int
    sampling: SamplingParams
    stopped: bool = False       # its last token stops it: rows of plans made ahead skip it


class FakeWorker:
    """Applies plans as `gpu_worker` does, minus the model: `next_token(request_id,
    num_generated)` decides each sampled token (TOKEN by default).

    Its KV cache holds, in each slot, the whole prefix ending at the token written there (what
    real K/V depend on). Every row checks that the slots it attends over hold exactly its own
    prefix (a prefix cache hit included), and that it writes only into blocks no other live
    request holds. Like the model runner, it skips the rows of a request whose last token
    was a stop token (a plan made ahead, docs/design.md#overlap, gives it one more)."""

    def __init__(self, sched: Scheduler,
                 next_token: Callable[[str, int], int] = lambda request_id, n: TOKEN) -> None:
        self.sched = sched
        self.next_token = next_token
        self.requests: dict[str, WorkerRequest] = {}
        self.kv: dict[int, tuple[int, ...]] = {}        # slot -> the prefix its K/V encode
        self.num_skipped = 0

    def lose_kv_cache(self, plan: IterationPlan | None = None) -> None:
        """The workers restarted (after receiving `plan`, never answered): every slot's
        content is gone. Requests are kept only so that the next plan's finished ids, which
        drop them, find them."""
        if plan is not None:
            self._apply_diffs(plan)
        self.kv.clear()

    def execute(self, plan: IterationPlan) -> StepResult:
        self._apply_diffs(plan)
        sampled = {}
        for request_id, rows in plan.num_scheduled_tokens.items():
            wr = self.requests[request_id]
            if wr.stopped:
                self.num_skipped += 1
                continue
            kv_len = wr.num_computed_tokens + rows
            assert rows >= 1 and kv_len <= len(wr.token_ids) <= self.sched.max_model_len
            assert len(wr.block_table) * self.sched.block_manager.block_size >= kv_len
            self._write_and_read(request_id, wr, kv_len)
            wr.num_computed_tokens = kv_len
            if kv_len == len(wr.token_ids):
                num_generated = len(wr.token_ids) - wr.num_prompt_tokens
                assert num_generated < wr.sampling.max_tokens, f"{request_id} past max_tokens"
                token = self.next_token(request_id, num_generated)
                wr.token_ids.append(token)
                wr.stopped = wr.sampling.stops_on(token, self.sched.eos_token_ids)
                sampled[request_id] = SampledToken(token)
        return StepResult(plan.step, sampled)

    def _apply_diffs(self, plan: IterationPlan) -> None:
        for request_id in plan.dropped_request_ids:
            assert request_id in self.requests, f"plan {plan.step} drops unknown {request_id}"
            del self.requests[request_id]
        for new in plan.new_requests:
            assert new.request_id not in self.requests, f"{new.request_id} sent twice"
            self.requests[new.request_id] = WorkerRequest(
                list(new.token_ids), new.num_prompt_tokens, list(new.block_table),
                new.num_computed_tokens, new.sampling)
        for cached in plan.cached_requests:
            wr = self.requests[cached.request_id]
            assert wr.num_computed_tokens == cached.num_computed_tokens
            wr.block_table.extend(cached.new_block_ids)
        listed = [n.request_id for n in plan.new_requests]
        listed += [c.request_id for c in plan.cached_requests]
        assert sorted(listed) == sorted(plan.num_scheduled_tokens)

    def _write_and_read(self, request_id: str, wr: WorkerRequest, kv_len: int) -> None:
        block_size = self.sched.block_manager.block_size
        written = {wr.block_table[p // block_size]
                   for p in range(wr.num_computed_tokens, kv_len)}
        for other_id, other in self.requests.items():
            shared = written.intersection(other.block_table) if other_id != request_id else ()
            assert not shared, f"{request_id} writes into blocks {shared} {other_id} holds"
        for p in range(kv_len):
            slot = wr.block_table[p // block_size] * block_size + p % block_size
            if p >= wr.num_computed_tokens:
                self.kv[slot] = tuple(wr.token_ids[:p + 1])
            assert self.kv.get(slot) == tuple(wr.token_ids[:p + 1]), \
                f"{request_id} reads another prefix's K/V at position {p}"


def check_plan(sched: Scheduler, plan: IterationPlan) -> None:
    """Invariants every plan keeps, checked right after schedule()."""
    config = sched.config
    if config.enable_chunked_prefill:
        assert plan.total_tokens <= config.max_num_batched_tokens
    assert len(plan.num_scheduled_tokens) <= config.max_num_seqs
    assert sched.num_running <= config.max_num_seqs
    for request_id in plan.num_scheduled_tokens:
        request = sched.get_request(request_id)
        assert request.status is RequestStatus.RUNNING
    sched.block_manager.check_integrity()


def step(sched: Scheduler, worker: FakeWorker) -> tuple[IterationPlan, list[RequestOutput]]:
    plan = sched.schedule()
    check_plan(sched, plan)
    result = worker.execute(plan)
    for request_id in plan.num_scheduled_tokens:
        assert worker.requests[request_id].block_table == \
            sched.get_request(request_id).block_table
    outputs = sched.update(plan, result)
    sched.block_manager.check_integrity()
    bm = sched.block_manager
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_total_blocks
    return plan, outputs


def run(sched: Scheduler, worker: FakeWorker, max_steps: int = 1000
        ) -> tuple[list[IterationPlan], dict[str, list[RequestOutput]]]:
    """Drive to completion; returns every plan and each request's outputs in order."""
    plans, outputs = [], {}
    while sched.has_unfinished():
        assert len(plans) < max_steps, "did not finish"
        plan, outs = step(sched, worker)
        plans.append(plan)
        for out in outs:
            outputs.setdefault(out.request_id, []).append(out)
    assert sched.num_running == sched.num_waiting == 0
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks
    return plans, outputs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t.token_id for out in outs for t in out.new_tokens]


def final(outs: list[RequestOutput]) -> RequestOutput:
    assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
    return outs[-1]


# ---- purity ------------------------------------------------------------------------------

def test_core_imports_neither_torch_nor_redis_nor_asyncio():
    code = ("import sys, scheduler_svc.core; "
            "bad = {'torch', 'redis', 'asyncio', 'numpy'} & set(sys.modules); "
            "print(sorted(bad)); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---- chunking and piggybacking -----------------------------------------------------------

def test_long_prompt_is_cut_into_budget_sized_chunks():
    sched = make_scheduler(budget=16, block_size=4)
    worker = FakeWorker(sched)
    add(sched, "a", 100, max_tokens=3)
    plans, outputs = run(sched, worker)
    rows = [p.num_scheduled_tokens["a"] for p in plans if "a" in p.num_scheduled_tokens]
    assert rows == [16] * 6 + [4] + [1, 1]          # 100 = 6*16 + 4, then two decodes
    assert len(plans[0].new_requests) == 1 and plans[0].new_requests[0].num_computed_tokens == 0
    computed = [p.cached_requests[0].num_computed_tokens for p in plans[1:9]]
    assert computed == [16, 32, 48, 64, 80, 96, 100, 101]
    # no token until the last chunk reaches the end of the prompt
    assert [len(o.new_tokens) for o in outputs["a"]] == [1, 1, 1]
    assert tokens(outputs["a"]) == [TOKEN] * 3 and final(outputs["a"]).finish_reason == "length"


def test_decodes_come_first_and_a_chunk_piggybacks_on_them():
    # prompt(n) prompts share prefixes; rows are counted here without caching
    sched = make_scheduler(budget=16, prefix_caching=False)
    worker = FakeWorker(sched)
    add(sched, "a", 4, max_tokens=10, ignore_eos=True)
    add(sched, "b", 3, max_tokens=10, ignore_eos=True)
    step(sched, worker)                              # both prefill whole
    add(sched, "long", 40, max_tokens=2)
    plan, _ = step(sched, worker)
    assert list(plan.num_scheduled_tokens.items()) == [("a", 1), ("b", 1), ("long", 14)]
    assert [c.request_id for c in plan.cached_requests] == ["a", "b"]
    assert [n.request_id for n in plan.new_requests] == ["long"]
    plan, _ = step(sched, worker)
    assert list(plan.num_scheduled_tokens.items()) == [("a", 1), ("b", 1), ("long", 14)]
    plan, _ = step(sched, worker)
    assert list(plan.num_scheduled_tokens.items()) == [("a", 1), ("b", 1), ("long", 12)]
    assert plan.total_tokens == 14


def test_budget_and_seq_cap_hold_and_every_request_finishes():
    sched = make_scheduler(budget=24, max_seqs=3, num_blocks=40, block_size=4)
    worker = FakeWorker(sched)
    lengths = [5, 30, 1, 17, 60, 8, 2, 45]
    for i, n in enumerate(lengths):
        add(sched, f"r{i}", n, max_tokens=1 + i % 5)
    plans, outputs = run(sched, worker)           # check_plan asserts budget and cap each step
    assert max(len(p.num_scheduled_tokens) for p in plans) == 3
    assert max(p.total_tokens for p in plans) == 24
    for i in range(len(lengths)):
        out = final(outputs[f"r{i}"])
        assert out.num_output_tokens == 1 + i % 5 and out.num_prompt_tokens == lengths[i]


def test_waiting_requests_are_admitted_first_come_first_served():
    sched = make_scheduler(budget=8, max_seqs=8)
    worker = FakeWorker(sched)
    for name, n in [("a", 6), ("b", 6), ("c", 2)]:
        add(sched, name, n, max_tokens=1)
    plan, _ = step(sched, worker)
    # b gets the 2 rows left rather than c overtaking it
    assert list(plan.num_scheduled_tokens.items()) == [("a", 6), ("b", 2)]


def test_a_short_prompt_does_not_wait_behind_long_ones():
    """Two 100-row prompts (longer than the 16-row budget), the first prefilling, the second
    queued, then a 6-row one: it is admitted at once, past the queued long prompt, and the
    prefilling one's chunk takes what it leaves; first come, first served it waited until
    both long prompts were prefilled (docs/design.md#short-prompts-beside-long-ones)."""
    sched = make_scheduler(budget=16, max_seqs=8, num_blocks=128, prefix_caching=False)
    worker = FakeWorker(sched)
    add(sched, "long", 100, max_tokens=2)
    add(sched, "later", 100, max_tokens=2)
    plan, _ = step(sched, worker)
    assert list(plan.num_scheduled_tokens.items()) == [("long", 16)]
    add(sched, "short", 6, max_tokens=2)
    plan, outputs = step(sched, worker)
    assert list(plan.num_scheduled_tokens.items()) == [("short", 6), ("long", 10)]
    assert [o.request_id for o in outputs if o.new_tokens] == ["short"]
    _, outs = run(sched, worker)
    for request_id in ("short", "long", "later"):
        assert final(outs[request_id]).num_output_tokens == 2


@pytest.mark.parametrize("running", [True, False])
def test_a_long_prompt_is_not_held_back_for_good_by_short_ones(running):
    """A short prompt arrives every iteration, filling the 16-row budget: the 100-row prompt
    (prefilling already, or still queued) waits for them at most MAX_DEFERRALS iterations in
    a row, then takes its turn first, so its prefill ends while they keep coming (seven
    turns of 16 rows, one in nine iterations at worst)."""
    sched = make_scheduler(budget=16, max_seqs=8, num_blocks=256, prefix_caching=False)
    worker = FakeWorker(sched)
    add(sched, "long", 100, max_tokens=2)
    if running:
        step(sched, worker)
    first = None
    for n in range(1, 200):
        add(sched, f"s{n}", 16, max_tokens=1)
        plan, outputs = step(sched, worker)
        if any(o.request_id == "long" and o.new_tokens for o in outputs):
            first = n
            break
    assert first is not None and first <= 7 * (MAX_DEFERRALS + 1)


def test_a_short_prompt_passes_a_long_one_only_where_the_pool_has_room_for_both():
    """A 148-row prompt (37 of the pool's 40 blocks) prefilling 16 rows an iteration, then a
    16-row one: after the long one's first chunk 36 blocks are free and it needs 33 more, so
    the short one (4 blocks) waits its turn, first come, first served, and the long one
    has its whole budget to the end (let in first, the short one took blocks and rows the
    long one needed)."""
    sched = make_scheduler(budget=16, max_seqs=8, num_blocks=40, max_model_len=256,
                           prefix_caching=False)
    worker = FakeWorker(sched)
    add(sched, "long", 148, max_tokens=2)
    step(sched, worker)
    add(sched, "short", 16, max_tokens=20)
    plans = 1
    while sched.get_request("long").num_output_tokens == 0:
        plan, _ = step(sched, worker)
        plans += 1
        # (beside the long one's last chunk, short itself, first come, first served)
        assert "short" not in plan.num_scheduled_tokens or \
            sched.get_request("long").num_output_tokens == 1
    assert plans == 10                              # 148 rows, 16 an iteration
    _, outs = run(sched, worker)
    assert final(outs["short"]).num_output_tokens == 20


def test_the_room_a_queued_long_prompt_needs_leaves_out_its_cached_prefix():
    """A queued 168-token prompt whose first 160 tokens are cached needs 2 blocks, not 42:
    the short prompt behind it still passes it and the running long one, with its first
    token after one iteration (counted whole, it waited out the running prompt's prefill)."""
    sched = make_scheduler(budget=16, max_seqs=8, num_blocks=120, max_model_len=512,
                           prefix_caching=True)
    worker = FakeWorker(sched)
    system = [300 + i % 50 for i in range(160)]
    sched.add_request("d", system + [900], SamplingParams(max_tokens=200))
    while sched.get_request("d").num_output_tokens == 0:
        step(sched, worker)
    sched.add_request("R", [1000 + i % 50 for i in range(200)], SamplingParams(max_tokens=2))
    step(sched, worker)
    sched.add_request("L", system + [901] * 8, SamplingParams(max_tokens=2))
    sched.add_request("S", [2000 + i for i in range(8)], SamplingParams(max_tokens=2))
    step(sched, worker)
    assert sched.get_request("S").num_output_tokens == 1


def test_decodes_after_a_long_prompt_keep_their_tokens():
    """A short prompt admitted past a prefilling long one decodes after it in the running
    list: the long one's chunks leave it its row of the 16-row token budget every
    iteration (they took all 16, and it waited for the whole prefill)."""
    sched = make_scheduler(budget=16, max_seqs=8, num_blocks=128, prefix_caching=False)
    worker = FakeWorker(sched)
    add(sched, "long", 100, max_tokens=2)
    step(sched, worker)
    add(sched, "short", 4, max_tokens=30)
    step(sched, worker)
    assert sched.get_request("short").num_output_tokens == 1
    while sched.get_request("long").num_output_tokens == 0:
        plan, _ = step(sched, worker)
        assert plan.num_scheduled_tokens.get("short") == 1
        assert sum(plan.num_scheduled_tokens.values()) <= 16


# ---- block tables ------------------------------------------------------------------------

def test_new_requests_carry_the_full_table_and_cached_ones_only_new_blocks():
    sched = make_scheduler(budget=4, block_size=4)
    worker = FakeWorker(sched)
    add(sched, "a", 6, max_tokens=6, ignore_eos=True)
    plans = [step(sched, worker)[0] for _ in range(6)]
    assert plans[0].new_requests[0].block_table == [0]           # rows 0..3
    assert plans[0].cached_requests == []
    diffs = [p.cached_requests[0].new_block_ids for p in plans[1:]]
    # rows 4..5 open block 1; decodes write slots 6, 7 (block 1), 8 (block 2), 9
    assert diffs == [[1], [], [], [2], []]
    assert sched.get_request("a").block_table == [0, 1, 2]


# ---- preemption --------------------------------------------------------------------------

def test_preemption_evicts_the_latest_admitted_and_it_recomputes_everything():
    # prompt(n) prompts share prefixes; rows are counted here without caching
    sched = make_scheduler(budget=64, num_blocks=6, block_size=2, prefix_caching=False)
    worker = FakeWorker(sched, next_token=lambda request_id, n: 10 + n)
    add(sched, "a", 4, max_tokens=6)
    add(sched, "b", 4, max_tokens=6)
    plans, outputs = run(sched, worker)
    assert sched.num_preemptions_total >= 1
    hit = next(i for i, p in enumerate(plans) if "b" in p.preempted_request_ids)
    assert plans[hit].num_scheduled_tokens == {"a": 1}           # a kept going, b evicted
    assert plans[hit].new_requests == []                         # no admissions that step
    generated = tokens(outputs["b"][:hit])                       # what b had before eviction
    assert generated
    resume = next(p for p in plans[hit + 1:] if "b" in p.num_scheduled_tokens)
    (new,) = resume.new_requests
    assert new.token_ids == prompt(4) + generated and new.num_prompt_tokens == 4
    assert new.num_computed_tokens == 0 and resume.num_scheduled_tokens["b"] == len(new.token_ids)
    for name in ("a", "b"):                     # generation continued where it left off
        assert tokens(outputs[name]) == [10, 11, 12, 13, 14, 15]
        assert final(outputs[name]).finish_reason == "length"


def test_no_admissions_in_an_iteration_that_preempted():
    # budget 3 lets the victim come back as a 2-row chunk at once; the rule says wait a step
    sched = make_scheduler(budget=3, num_blocks=4, block_size=2)
    worker = FakeWorker(sched)
    add(sched, "a", 2, max_tokens=5, ignore_eos=True)
    add(sched, "b", 2, max_tokens=5, ignore_eos=True)
    while sched.num_preemptions_total == 0:
        plan, _ = step(sched, worker)
    assert plan.preempted_request_ids == ["b"] and plan.new_requests == []
    assert plan.finished_request_ids == []
    assert list(plan.num_scheduled_tokens) == ["a"]
    plan, _ = step(sched, worker)
    assert [n.request_id for n in plan.new_requests] == ["b"]


def test_preempted_request_resumes_before_later_arrivals():
    sched = make_scheduler(budget=64, num_blocks=6, block_size=2)
    worker = FakeWorker(sched)
    add(sched, "a", 4, max_tokens=6, ignore_eos=True)
    add(sched, "b", 4, max_tokens=6, ignore_eos=True)
    while sched.num_preemptions_total == 0:
        step(sched, worker)
    add(sched, "c", 2, max_tokens=1)
    plans, _ = run(sched, worker)
    admitted = [n.request_id for p in plans for n in p.new_requests]
    assert admitted == ["b", "c"]



def test_a_preempted_request_keeps_its_place_by_arrival_and_is_not_starved():
    # Eight equal requests over a pool that holds about two. The victim is the last running
    # request: a preempted request re-admitted used to go last (admission order), and a
    # younger one preempted after it went back ahead of it, so the second-oldest was evicted
    # again and again (7 times) and finished after all six younger ones.
    sched = make_scheduler(budget=64, max_seqs=16, num_blocks=40, block_size=4)
    worker = FakeWorker(sched)
    names = [f"r{i}" for i in range(8)]
    for i, name in enumerate(names):
        sched.add_request(name, [100 + (i * 7 + j) % 900 for j in range(50)],
                          SamplingParams(max_tokens=75, ignore_eos=True))
    finished, preempted = [], []
    while sched.has_unfinished():
        plan, outputs = step(sched, worker)
        preempted += plan.preempted_request_ids
        finished += [out.request_id for out in outputs if out.finished]
        waiting = [r.arrival_index for r in sched._waiting]
        running = [r.arrival_index for r in sched._running]
        assert waiting == sorted(waiting) and running == sorted(running)
    assert preempted and finished == names     # equal requests end first come, first served
    assert preempted.count("r1") <= 2

# ---- abort -------------------------------------------------------------------------------

def test_abort_waiting_request_is_reported_and_never_sent():
    sched = make_scheduler(max_seqs=1)
    worker = FakeWorker(sched)
    add(sched, "a", 4, max_tokens=8, ignore_eos=True)
    add(sched, "b", 4)
    step(sched, worker)
    sched.abort("b")
    assert sched.num_waiting == 0
    plan, outputs = step(sched, worker)
    assert "b" not in plan.dropped_request_ids
    assert [(o.request_id, o.finished, o.finish_reason) for o in outputs][0] == ("b", True, "abort")


def test_abort_mid_prefill_frees_blocks_at_once():
    sched = make_scheduler(budget=8, num_blocks=16, block_size=4)
    worker = FakeWorker(sched)
    add(sched, "a", 30)
    step(sched, worker)
    assert sched.block_manager.num_free_blocks == 14
    sched.abort("a")
    assert sched.block_manager.num_free_blocks == 16 and not sched.get_request("a")
    sched.block_manager.check_integrity()
    plan, outputs = step(sched, worker)
    assert plan.is_empty and plan.finished_request_ids == ["a"]
    assert outputs[0].finish_reason == "abort" and outputs[0].num_prompt_tokens == 30
    assert not sched.has_unfinished()


def test_abort_while_the_plan_runs_drops_its_token():
    sched = make_scheduler()
    worker = FakeWorker(sched)
    add(sched, "a", 4, max_tokens=8, ignore_eos=True)
    add(sched, "b", 4, max_tokens=2, ignore_eos=True)
    plan = sched.schedule()
    result = worker.execute(plan)
    sched.abort("a")                                 # arrives while the workers run
    outputs = sched.update(plan, result)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", "abort"), ("b", None)]
    plan, _ = step(sched, worker)
    assert plan.finished_request_ids == ["a"] and list(plan.num_scheduled_tokens) == ["b"]


def test_an_aborted_id_is_refused_until_plans_in_flight_let_go_of_its_blocks():
    # The served loop's order: two plans in flight, the abort comes, the first result reports
    # it (its client is told), and a request of the same id arrives before the second result
    # is in. It shared the pool's books with the aborted one's blocks and crashed the core.
    sched = make_scheduler(num_blocks=16)
    worker = FakeWorker(sched)
    add(sched, "x", 10, max_tokens=20, ignore_eos=True)
    first = sched.schedule()
    ahead = sched.schedule_ahead()
    sched.abort("x")
    outputs = sched.update(first, worker.execute(first))
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("x", "abort")]
    with pytest.raises(InvalidRequestError, match="'x' is already in use"):
        add(sched, "x", 10, max_tokens=4)
    sched.update(ahead, worker.execute(ahead))      # now its blocks are back
    assert sched.block_manager.num_free_blocks == 16
    add(sched, "x", 10, max_tokens=4)
    _, outputs = run(sched, worker)
    assert final(outputs["x"]).num_output_tokens == 4


def test_abort_preempted_request_is_not_dropped_twice():
    sched = make_scheduler(budget=64, num_blocks=6, block_size=2)
    worker = FakeWorker(sched)
    add(sched, "a", 4, max_tokens=6, ignore_eos=True)
    add(sched, "b", 4, max_tokens=6, ignore_eos=True)
    while sched.num_preemptions_total == 0:
        step(sched, worker)
    assert sched.get_request("b").status is RequestStatus.PREEMPTED
    sched.abort("b")
    sched.abort("nobody")                            # unknown ids are ignored
    plans, outputs = run(sched, worker)              # FakeWorker rejects unknown drops
    assert all("b" not in p.dropped_request_ids for p in plans)
    assert final(outputs["b"]).finish_reason == "abort"


# ---- stop conditions ---------------------------------------------------------------------

def eos_at(k: int, eos: int = EOS) -> Callable[[str, int], int]:
    return lambda request_id, n: eos if n == k else TOKEN


def test_eos_stops_unless_ignored():
    sched = make_scheduler()
    worker = FakeWorker(sched, next_token=eos_at(2))
    add(sched, "stops", 3, max_tokens=8)
    add(sched, "ignores", 3, max_tokens=5, ignore_eos=True)
    _, outputs = run(sched, worker)
    assert tokens(outputs["stops"]) == [TOKEN, TOKEN, EOS]
    assert final(outputs["stops"]).finish_reason == "stop"
    assert tokens(outputs["ignores"]) == [TOKEN, TOKEN, EOS, TOKEN, TOKEN]
    assert final(outputs["ignores"]).finish_reason == "length"


def test_stop_token_ids_stop_even_with_ignore_eos():
    sched = make_scheduler()
    worker = FakeWorker(sched, next_token=eos_at(1, eos=42))
    add(sched, "a", 3, max_tokens=8, ignore_eos=True, stop_token_ids=(42,))
    _, outputs = run(sched, worker)
    assert tokens(outputs["a"]) == [TOKEN, 42] and final(outputs["a"]).finish_reason == "stop"


def test_several_eos_ids_and_none():
    sched = make_scheduler(eos=(2, 3))
    add(sched, "a", 3, max_tokens=4)
    _, outputs = run(sched, FakeWorker(sched, next_token=eos_at(0, eos=3)))
    assert tokens(outputs["a"]) == [3] and final(outputs["a"]).finish_reason == "stop"
    sched = make_scheduler(eos=None)
    add(sched, "a", 3, max_tokens=2)
    _, outputs = run(sched, FakeWorker(sched, next_token=eos_at(0)))
    assert final(outputs["a"]).finish_reason == "length"


def test_eos_on_the_last_allowed_token_reports_stop():
    sched = make_scheduler()
    add(sched, "a", 3, max_tokens=3)
    _, outputs = run(sched, FakeWorker(sched, next_token=eos_at(2)))
    out = final(outputs["a"])
    assert out.finish_reason == "stop" and out.num_output_tokens == 3


def test_model_context_ends_generation():
    sched = make_scheduler(max_model_len=10, budget=4)
    add(sched, "a", 7, max_tokens=50)
    plans, outputs = run(sched, FakeWorker(sched))
    out = final(outputs["a"])
    assert out.finish_reason == "length" and out.num_output_tokens == 3      # 7 + 3 == 10
    assert max(p.cached_requests[0].num_computed_tokens + p.total_tokens
               for p in plans if p.cached_requests) <= 10


# ---- ORCA-only mode ----------------------------------------------------------------------

def test_orca_mode_never_splits_a_prompt():
    # prompt(n) prompts share prefixes; rows are counted here without caching
    sched = make_scheduler(budget=16, chunked=False, prefix_caching=False)
    worker = FakeWorker(sched)
    add(sched, "a", 10, max_tokens=6, ignore_eos=True)
    add(sched, "b", 10, max_tokens=6, ignore_eos=True)
    plan, _ = step(sched, worker)
    assert plan.num_scheduled_tokens == {"a": 10}              # b would not fit whole
    plan, _ = step(sched, worker)
    assert plan.num_scheduled_tokens == {"a": 1, "b": 10}      # the decode comes first
    plans, _ = run(sched, worker)
    assert all(rows == 1 for p in plans for rows in p.num_scheduled_tokens.values())


def test_orca_mode_admits_an_oversized_prompt_whole_and_alone():
    # prompt(n) prompts share prefixes; rows are counted here without caching
    sched = make_scheduler(budget=16, chunked=False, prefix_caching=False)
    worker = FakeWorker(sched)
    add(sched, "a", 4, max_tokens=6, ignore_eos=True)
    step(sched, worker)
    add(sched, "huge", 40, max_tokens=2)
    add(sched, "small", 2, max_tokens=2)
    plan, _ = step(sched, worker)
    assert list(plan.num_scheduled_tokens.items()) == [("a", 1), ("huge", 40)]
    plan, _ = step(sched, worker)
    assert list(plan.num_scheduled_tokens.items()) == [("a", 1), ("huge", 1), ("small", 2)]


# ---- validation and protocol -------------------------------------------------------------

@pytest.mark.parametrize("num_prompt, max_tokens, match", [
    (0, 4, "empty prompt"),
    (64, 4, "no room"),                   # prompt == max_model_len
    (40, 30, "whole pool"),               # 64 tokens -> 16 blocks of 4 > 12
])
def test_invalid_requests_raise(num_prompt, max_tokens, match):
    sched = make_scheduler(num_blocks=12, block_size=4, max_model_len=64)
    with pytest.raises(InvalidRequestError, match=match):
        add(sched, "x", num_prompt, max_tokens=max_tokens)
    assert not sched.has_unfinished()


@pytest.mark.parametrize("prompt_ids, sampling, match", [
    ([5, 1000], SamplingParams(), "prompt_token_ids: token id 1000 is outside the vocabulary"),
    ([5, 6], SamplingParams(allowed_token_ids=(3, 1000)), "allowed_token_ids: token id 1000"),
    ([5, 6], SamplingParams(logit_bias={2000: 1.0}), "logit_bias: token id 2000"),
    ([5, 6], SamplingParams(bad_words_token_ids=((4, 1000),)), "bad_words_token_ids: token id"),
])
def test_token_ids_outside_the_vocabulary_are_refused(prompt_ids, sampling, match):
    """The workers look every one of these up in a table of vocab_size rows (an IndexError
    that took the worker group down); stop ids are only compared, and may be anything."""
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, num_kv_blocks=64,
                             block_size=4, max_model_len=256)
    sched = Scheduler(config, EOS, 256, vocab_size=1000)
    with pytest.raises(InvalidRequestError, match=match):
        sched.add_request("x", prompt_ids, sampling)
    assert not sched.has_unfinished()
    sched.add_request("y", [0, 999], SamplingParams(stop_token_ids=(5000,)))


def test_request_that_fills_the_whole_pool_is_accepted_and_finishes():
    sched = make_scheduler(num_blocks=12, block_size=4, max_model_len=64, budget=8)
    add(sched, "x", 40, max_tokens=8, ignore_eos=True)      # 48 tokens == 12 blocks
    add(sched, "y", 10, max_tokens=8, ignore_eos=True)
    _, outputs = run(sched, FakeWorker(sched))
    assert final(outputs["x"]).num_output_tokens == 8 == final(outputs["y"]).num_output_tokens


def test_duplicate_live_id_raises_but_a_finished_id_can_be_reused():
    sched = make_scheduler()
    add(sched, "a", 3, max_tokens=1)
    with pytest.raises(InvalidRequestError, match="already in use"):
        add(sched, "a", 3)
    worker = FakeWorker(sched)
    run(sched, worker)
    add(sched, "a", 3, max_tokens=1)
    plan, _ = step(sched, worker)
    assert plan.finished_request_ids == ["a"] and plan.new_requests[0].request_id == "a"


def test_empty_plan_still_carries_finished_ids():
    sched = make_scheduler()
    worker = FakeWorker(sched)
    add(sched, "a", 3, max_tokens=1)
    step(sched, worker)
    assert not sched.has_unfinished()
    plan, outputs = step(sched, worker)
    assert plan.is_empty and plan.finished_request_ids == ["a"] and outputs == []
    plan, _ = step(sched, worker)
    assert plan.finished_request_ids == []


def test_update_is_required_between_plans_and_must_match():
    sched = make_scheduler()
    worker = FakeWorker(sched)
    add(sched, "a", 3)
    plan = sched.schedule()
    with pytest.raises(RuntimeError, match="update"):
        sched.schedule()
    with pytest.raises(ValueError, match="sampled"):
        sched.update(plan, StepResult(plan.step, {}))
    result = worker.execute(plan)
    with pytest.raises(ValueError, match="result of step"):
        sched.update(plan, StepResult(plan.step + 1, result.sampled))
    outputs = sched.update(plan, result)         # the failed calls changed nothing
    assert [o.new_tokens[0].token_id for o in outputs] == [TOKEN]
    with pytest.raises(ValueError, match="awaiting"):
        sched.update(plan, result)               # the same plan twice


# ---- prefix caching ----------------------------------------------------------------------

def test_a_shared_prefix_is_computed_once_and_outlives_a_preemption():
    """b and c take a's cached prompt blocks; the pool then runs dry, the latest admitted (c)
    is preempted while its blocks are shared, and on return it takes them back. Each
    finished output says how many prompt tokens its first admission found cached."""
    sched = make_scheduler(budget=64, num_blocks=10, block_size=4)
    worker = FakeWorker(sched)
    shared = prompt(12)                                    # 3 full blocks
    sched.add_request("a", shared + [1], SamplingParams(max_tokens=20, ignore_eos=True))
    step(sched, worker)                                    # a's prompt computed, cached
    assert sched.block_manager.num_cached_blocks == 3
    sched.add_request("b", shared + [3], SamplingParams(max_tokens=2))
    sched.add_request("c", shared + [5], SamplingParams(max_tokens=20, ignore_eos=True))
    plan, _ = step(sched, worker)
    assert {n.request_id: (n.num_computed_tokens, plan.num_scheduled_tokens[n.request_id])
            for n in plan.new_requests} == {"b": (12, 1), "c": (12, 1)}
    a, b, c = (sched.get_request(r) for r in "abc")
    assert a.block_table[:3] == b.block_table[:3] == c.block_table[:3]
    preempted, cached = False, {}
    while sched.has_unfinished():
        plan, outputs = step(sched, worker)
        cached |= {o.request_id: o.num_cached_tokens for o in outputs if o.finished}
        preempted |= "c" in plan.preempted_request_ids
        for new in plan.new_requests:
            if new.request_id == "c":                       # back after its preemption
                assert new.num_computed_tokens >= 12
    assert preempted and sched.num_preemptions_total >= 1
    assert cached == {"a": 0, "b": 12, "c": 12}
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks
    assert bm.prefix_cache_hits >= 3 * 12 and bm.prefix_cache_queries > bm.prefix_cache_hits


# ---- planning ahead (docs/design.md#overlap) ---------------------------------------------

def test_a_plan_made_ahead_continues_every_decode_and_skips_a_known_last_token():
    sched = make_scheduler()
    worker = FakeWorker(sched)
    add(sched, "long", 3, max_tokens=8)
    add(sched, "short", 3, max_tokens=2)
    first = sched.schedule()                     # both prompts; each samples its first token
    ahead = sched.schedule_ahead()               # made before the first result is in
    assert ahead.num_scheduled_tokens == {"long": 1, "short": 1}
    assert [c.num_computed_tokens for c in ahead.cached_requests] == [3, 3]
    assert not sched.can_schedule_ahead()        # two plans in flight: the limit
    outputs = sched.update(first, worker.execute(first))
    assert tokens(outputs) == [TOKEN, TOKEN]
    third = sched.schedule_ahead()               # short's token in flight is its last
    assert third.num_scheduled_tokens == {"long": 1}
    outputs = sched.update(ahead, worker.execute(ahead))
    assert final([o for o in outputs if o.request_id == "short"]).finish_reason == "length"
    sched.update(third, worker.execute(third))
    assert sched.get_request("long").num_output_tokens == 3


def test_a_stop_token_in_flight_drops_the_row_planned_ahead_and_frees_blocks_once():
    sched = make_scheduler(block_size=4)
    worker = FakeWorker(sched, next_token=eos_at(0))
    add(sched, "a", 4, max_tokens=8)                 # its first token will be EOS
    add(sched, "b", 4, max_tokens=8, ignore_eos=True)
    first = sched.schedule()
    ahead = sched.schedule_ahead()                   # a's decode is planned: a new block
    assert ahead.num_scheduled_tokens == {"a": 1, "b": 1}
    outputs = sched.update(first, worker.execute(first))
    assert final([o for o in outputs if o.request_id == "a"]).finish_reason == "stop"
    bm = sched.block_manager
    assert bm.num_used_blocks == len(sched.get_request("b").block_table)   # a's all freed
    result = worker.execute(ahead)
    assert set(result.sampled) == {"b"} and worker.num_skipped == 1
    outputs = sched.update(ahead, result)
    assert [o.request_id for o in outputs] == ["b"]
    bm.check_integrity()
    assert sched.schedule().finished_request_ids == ["a"]   # the workers forget it now


def test_a_plan_made_ahead_never_preempts_it_stalls_and_the_next_plan_waits():
    sched = make_scheduler(block_size=4, num_blocks=4)
    worker = FakeWorker(sched)
    add(sched, "a", 8, max_tokens=8)
    add(sched, "b", 8, max_tokens=8)
    first = sched.schedule()                         # 2 full blocks each: the pool is full
    ahead = sched.schedule_ahead()                   # a needs a third block: none free
    assert ahead.is_empty and not ahead.preempted_request_ids
    assert sched.num_preemptions_total == 0 and not sched.can_schedule_ahead()
    sched.update(first, worker.execute(first))
    sched.update(ahead, worker.execute(ahead))       # empty: nothing to apply
    plan = sched.schedule()                          # made with the results in: preempts
    assert plan.preempted_request_ids == ["b"] and plan.num_scheduled_tokens == {"a": 1}
