"""The P/D prefill scheduler's TTFT goal (docs/design.md#the-ttft-goal), from plain numbers: a
fake clock and the online iteration-cost model at a prior it never leaves (no forward times
are fed back), pricing an iteration of N prefill rows at 10 + N ms, so every expected
chunk and deadline can be worked out by hand. Requests are prefill-only (max_tokens 1), as on
a prefill instance."""
from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_svc.core import Scheduler
from scheduler_svc.core.request import Request
from scheduler_svc.core.ttft_goal import CAN_MAKE_IT, STARVING, WILL_MISS, TtftGoal
from shared.config import AUTO_TTFT_FACTOR, SchedulerConfig
from shared.errors import PacerError
from shared.online_cost import OnlineIterationCost
from shared.plan import SampledToken, StepResult
from shared.sampling import SamplingParams
from test_scheduler_core import make_scheduler
from test_scheduler_properties import Driver, configs
from test_scheduler_properties import aborts as abort_st
from test_scheduler_properties import arrivals as arrival_st

FIXED_MS = 10.0
_PROMPTS = itertools.count(1)


def cost() -> OnlineIterationCost:
    return OnlineIterationCost(prior_ms=(FIXED_MS, 1.0, 1.0, 0.0))   # 10 ms + 1 ms a row


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(budget: int = 100, target_ms: float | None = None,
         factor: float | None = None) -> tuple[Scheduler, Clock]:
    clock = Clock()
    config = SchedulerConfig(max_num_batched_tokens=budget, num_kv_blocks=512, block_size=4,
                             max_model_len=4096, iteration_cost=cost(),
                             target_ttft_ms=target_ms, target_ttft_factor=factor)
    return Scheduler(config, eos_token_ids=2, clock=clock), clock


def add(sched: Scheduler, rid: str, n: int, at: float | None = None) -> None:
    """A prompt of its own (no prefix shared with another: no prefix cache hit)."""
    base = 100 * next(_PROMPTS)
    sched.add_request(rid, [base + i % 50 for i in range(n)], SamplingParams(max_tokens=1),
                      arrival_s=at)


def step(sched: Scheduler, clock: Clock) -> dict[str, int]:
    """One iteration: the plan's rows per request; the clock moves by its predicted time."""
    plan = sched.schedule()
    rows = dict(plan.num_scheduled_tokens)
    clock.now += (FIXED_MS + sum(rows.values())) / 1e3 if rows else 0.01
    sampled = {rid: SampledToken(7) for rid in sched.samples_in_flight()}
    sched.update(plan, StepResult(plan.step, sampled))
    return rows


def goal(budget: int = 100, **kw) -> TtftGoal:
    return TtftGoal(cost(), budget, **kw)


def request(n: int, arrival_s: float = 0.0, computed: int = 0) -> Request:
    r = Request("r", list(range(n)), SamplingParams(max_tokens=1), 0, arrival_s=arrival_s)
    r.num_computed_tokens = computed
    return r


# ---- the goal from plain numbers -----------------------------------------------------------

def test_auto_goal_is_factor_times_own_prefill_plus_one_full_iteration():
    g = goal(factor=AUTO_TTFT_FACTOR)
    # 250 tokens at a budget of 100: chunks 100, 100, 50 -> 110 + 110 + 60 ms alone
    assert g.prefill_ms(0, 250) == pytest.approx(280.0)
    assert g.goal_ms(250) == pytest.approx(AUTO_TTFT_FACTOR * 280.0 + 110.0)
    assert goal(target_ms=75.0).goal_ms(250) == 75.0


def test_classes_starving_can_make_it_will_miss():
    g = goal(target_ms=200.0)
    short, long = request(50), request(500)          # 60 ms and 550 ms alone
    assert g.priority(short, now=0.0) == (CAN_MAKE_IT, 0.2)
    assert g.priority(long, now=0.0) == (WILL_MISS, 0.2)
    assert g.priority(short, now=0.15)[0] == WILL_MISS       # 150 + 60 > 200
    assert g.priority(short, now=0.41)[0] == STARVING        # past its deadline by > 200 ms
    assert g.priority(request(500, computed=450), now=0.1)[0] == CAN_MAKE_IT   # 60 ms left


def test_a_placed_prompt_bounds_the_iteration_by_its_deadline():
    g = goal(target_ms=300.0)
    r = request(250)
    # 100 rows now, then 100 + 50 alone (170 ms): this iteration may take 300 - 170 ms
    assert g.iteration_limit_ms(r, 100, now=0.0) == pytest.approx(130.0)
    assert g.iteration_limit_ms(request(500), 100, now=0.0) is None     # will miss anyway


def test_attainment_counts_first_tokens_against_the_goal():
    sched, clock = make(target_ms=200.0)
    add(sched, "fast", 50, at=0.0)
    add(sched, "slow", 300, at=0.0)
    while sched.has_unfinished():
        step(sched, clock)
    # fast: 60 ms; slow: 3 more iterations after it, 420 ms in all
    assert sched.ttft_goal.met_total == 1 and sched.ttft_goal.missed_total == 1


def test_config_takes_one_goal_and_needs_a_cost_model():
    with pytest.raises(PacerError):
        SchedulerConfig(target_ttft_ms=100.0, target_ttft_factor=3.0, iteration_cost=cost())
    with pytest.raises(PacerError):
        SchedulerConfig(target_ttft_ms=100.0)


# ---- the scheduler with the goal -----------------------------------------------------------

def test_an_urgent_short_prompt_overtakes_a_running_long_one():
    """With the auto goal a short prompt arriving meanwhile has the earlier deadline and goes
    first; without one it goes first too, as a short prompt past a long one
    (docs/design.md#short-prompts-beside-long-ones; first come, first served alone kept the
    whole token budget for the long prompt until it was done)."""
    for factor, expect in ((None, {"short": 20, "long": 80}),
                           (AUTO_TTFT_FACTOR, {"short": 20, "long": 80})):
        sched, clock = make(factor=factor)
        add(sched, "long", 300, at=0.0)
        assert step(sched, clock) == {"long": 100}
        add(sched, "short", 20, at=clock.now)
        assert step(sched, clock) == expect


def test_batching_stops_where_a_placed_prompt_would_miss():
    """A (100 tokens, 110 ms alone) may finish by 150 ms: B, which will miss anyway, gets the
    40 rows that keep the iteration within A's deadline instead of the 412 the token budget
    leaves."""
    sched, clock = make(budget=512, target_ms=150.0)
    add(sched, "A", 100, at=0.0)
    add(sched, "B", 600, at=0.0)
    assert step(sched, clock) == {"A": 100, "B": 40}
    sched, clock = make(budget=512)                  # no goal: first come, first served
    add(sched, "A", 100)
    add(sched, "B", 600)
    assert step(sched, clock) == {"A": 100, "B": 412}


def test_a_prompt_that_will_miss_goes_after_one_that_can_make_it():
    sched, clock = make(target_ms=100.0)
    add(sched, "long", 500, at=0.0)      # 550 ms alone: misses whatever happens
    add(sched, "short", 20, at=0.0)      # 30 ms alone
    rows = step(sched, clock)
    assert list(rows) == ["short", "long"]
    assert rows == {"short": 20, "long": 70}     # the iteration ends by short's 100 ms


def test_a_long_prompt_is_not_starved_by_a_stream_of_short_ones():
    """Short prompts that can make their goal keep arriving, one filling each iteration; the
    long one, which will miss, waits behind them only until it is past its deadline by its
    own goal, then goes first."""
    target_ms = 300.0
    sched, clock = make(target_ms=target_ms)
    add(sched, "long", 1000, at=0.0)
    first_token = {}
    n = 0
    while "long" not in first_token:
        add(sched, f"s{n}", 100, at=clock.now)
        n += 1
        rows = step(sched, clock)
        if clock.now < 2 * target_ms / 1e3:
            assert "long" not in rows        # deferred while it could not make it anyway
        for rid in rows:
            if sched.get_request(rid) is None:
                first_token[rid] = clock.now
        assert n < 100, "the long prompt never got its first token"
    # it went first from about twice its goal: ~11 iterations of 110 ms after that
    assert first_token["long"] <= 2 * target_ms / 1e3 + 1.5
    assert sched.ttft_goal.met_total > 0


def test_pool_runs_dry_the_least_urgent_running_prompt_yields():
    """A short prompt admitted ahead of a running long one ranks before it: when the long
    one's next chunk finds no free block, it is the one preempted, not the short one already
    placed in this iteration."""
    clock = Clock()
    config = SchedulerConfig(max_num_batched_tokens=8, num_kv_blocks=4, block_size=4,
                             max_model_len=4096, iteration_cost=cost(),
                             target_ttft_factor=AUTO_TTFT_FACTOR)
    sched = Scheduler(config, eos_token_ids=2, clock=clock)
    add(sched, "long", 15, at=0.0)
    assert step(sched, clock) == {"long": 8}              # 2 of the 4 blocks
    add(sched, "short", 5, at=clock.now)                  # the earlier deadline: 2 blocks
    plan = sched.schedule()
    assert plan.num_scheduled_tokens == {"short": 5}
    assert plan.preempted_request_ids == ["long"]
    assert [r.request_id for r in plan.new_requests] == ["short"]


def test_without_a_goal_nothing_is_counted_and_order_is_fcfs_short_prompts_first():
    """First come, first served, but a short prompt does not wait behind long ones
    (docs/design.md#short-prompts-beside-long-ones): long, later (both over the 100-row
    budget) and short queued in that order give short, then long; later waits."""
    sched, clock = make()
    add(sched, "long", 500)
    add(sched, "later", 400)
    add(sched, "short", 20)
    assert step(sched, clock) == {"short": 20, "long": 80}
    assert sched.ttft_goal is None


# ---- random traffic, the same invariants as without a goal ---------------------------------

@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs(), st.sampled_from([None, 1.0, 60.0, 400.0]),
       st.lists(arrival_st, min_size=2, max_size=12), st.lists(abort_st, max_size=4),
       st.frozensets(st.integers(0, 40), max_size=2), st.booleans())
def test_random_traffic_with_a_ttft_goal_keeps_invariants_and_finishes(
        config, target_ms, arrivals, aborts, kv_losses, overlap):
    """Reordering by deadline changes who goes first, never what anyone gets: the fake
    worker checks every row's K/V, blocks all come back, every request ends with the tokens
    it would have had first come, first served, and each first token is counted once. The
    clock moves 50 ms a step, so goals are met, missed and starved past."""
    clock = Clock()
    base = make_scheduler(**config)
    sched = Scheduler(replace(base.config, iteration_cost=cost(), target_ttft_ms=target_ms,
                              target_ttft_factor=AUTO_TTFT_FACTOR if target_ms is None else None),
                      base.eos_token_ids, base.max_model_len, clock=clock)
    driver = Driver(sched, arrivals, aborts, kv_losses, overlap)

    def tick() -> None:
        clock.now += 0.05
    driver.run_to_end(tick)
    first_tokens = driver.check_outputs()
    goal = sched.ttft_goal
    assert goal.met_total + goal.missed_total == first_tokens
