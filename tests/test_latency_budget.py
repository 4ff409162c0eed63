"""The latency budget (`max_iteration_ms`): the cost model caps how much prefill rides along
with the decodes, decodes always run, and a prompt always makes progress: at least one block
(the tests' blocks are of 4 tokens), or MIN_PREFILL_ROWS rows where blocks are larger.

Costs are plain ints: `RowCost` prices an iteration at `row_ms` per Q row plus `kv_ms` per
KV row, so the expected chunk sizes can be worked out by hand. The roofline's closed form
(`RooflineCost`) is held to the bisection search (tests/test_cost_model.py) on a
made-up model and machine.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_svc.core import RequestStatus, Scheduler
from scheduler_svc.simulator import SimClock
from shared.config import SchedulerConfig
from shared.online_cost import OnlineIterationCost
from shared.cost_model import ModelShape, RooflineCost, estimate_iteration, latency_cost_for
from shared.engine_args import EngineArgs
from shared.errors import PacerError
from shared.hardware import HardwareProfile
from shared.plan import IterationPlan, StepResult
from test_scheduler_core import FakeWorker, add, check_plan, prompt, step
from tests.test_cost_model import max_prefill_tokens_within
from shared.sampling import SamplingParams
from test_scheduler_properties import Driver, check_orca
from test_scheduler_properties import aborts as abort_st
from test_scheduler_properties import arrivals as arrival_st


@dataclass(frozen=True)
class RowCost:
    """time = row_ms · Q rows + kv_ms · KV rows, summed over chunks, + fixed_ms an iteration."""
    row_ms: int = 1
    kv_ms: int = 0
    fixed_ms: int = 0
    # what OnlineIterationCost says of the worker's GEMMs: from how many rows they widen
    # their weights (None: one path for every size); only the target's floor reads it
    wide_from_rows: int | None = None

    def iteration_ms(self, chunks: Sequence[tuple[int, int]]) -> int:
        return self.fixed_ms + sum(self.row_ms * q + self.kv_ms * kv for q, kv in chunks)

    def max_prefill_rows(self, budget_ms: float, chunks: Sequence[tuple[int, int]],
                         prefix_len: int) -> int:
        left = budget_ms - self.iteration_ms(chunks) - self.kv_ms * prefix_len
        return max(0, int(left // (self.row_ms + self.kv_ms)))


def make(budget_ms: float, cost=RowCost(), token_budget: int = 1000, chunked: bool = True,
         block_size: int = 4, num_blocks: int = 256, max_seqs: int = 16) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=token_budget, max_num_seqs=max_seqs,
                             num_kv_blocks=num_blocks, block_size=block_size, max_model_len=1024,
                             enable_chunked_prefill=chunked, max_iteration_ms=budget_ms,
                             iteration_cost=cost,
                             # prompt(n) prompts share prefixes; rows are counted uncached
                             enable_prefix_caching=False)
    return Scheduler(config, eos_token_ids=2, max_model_len=1024)


def chunks_of(sched: Scheduler, plan: IterationPlan) -> list[tuple[int, int]]:
    """(q_rows, kv_len) of every scheduled request; call before update()."""
    return [(rows, sched.get_request(rid).num_computed_tokens + rows)
            for rid, rows in plan.num_scheduled_tokens.items()]


def start_decoding(sched: Scheduler, worker: FakeWorker, n: int, prompt_len: int = 3) -> None:
    """n requests past their prefill, each decoding one row per iteration from now on."""
    for i in range(n):
        add(sched, f"d{i}", prompt_len, max_tokens=200)
    while any(sched.get_request(f"d{i}").num_output_tokens == 0 for i in range(n)):
        step(sched, worker)


# ---- chunk sizes as the cost model says ------------------------------------------------

def test_prefill_is_cut_to_what_fits_beside_the_decodes():
    sched = make(budget_ms=20)                    # 1 ms per row: 20 rows per iteration
    worker = FakeWorker(sched)
    start_decoding(sched, worker, 3)
    add(sched, "long", 100, max_tokens=2)
    sizes = []
    while sched.get_request("long").num_output_tokens == 0:
        plan, _ = step(sched, worker)
        sizes.append(plan.num_scheduled_tokens["long"])
        assert all(plan.num_scheduled_tokens[f"d{i}"] == 1 for i in range(3))
    # 3 decodes leave 17 rows: 100 = 5 · 17 + 15
    assert sizes == [17, 17, 17, 17, 17, 15]


def test_long_prompts_that_cannot_get_blocks_beside_a_short_one_still_move():
    """A pool of 16 four-row blocks, 30 ms an iteration at 1 ms a row and 1 ms per row of
    context: a short prompt admitted past a long one leaves it no time, a second long one is
    admitted, and the pool fills with the two half-prefilled prompts while another short one
    waits. Placed after the short ones, the long prompts never preempt; with nothing else
    able to move they take their blocks as before, preempting, and every request ends."""
    config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8, num_kv_blocks=16,
                             block_size=4, max_model_len=1024, max_iteration_ms=30,
                             iteration_cost=RowCost(row_ms=1, kv_ms=1),
                             enable_prefix_caching=False)
    sched = Scheduler(config, eos_token_ids=2, max_model_len=1024)
    worker = FakeWorker(sched)
    arrive = {0: [("L1", 60)], 3: [("L2", 60), ("S", 8)], 8: [("S2", 16)]}
    for n in range(60):
        for request_id, length in arrive.get(n, []):
            add(sched, request_id, length, max_tokens=2)
        step(sched, worker)
        if not sched.has_unfinished():
            break
    assert not sched.has_unfinished()


def test_a_short_prompt_cut_by_the_latency_budget_goes_on_before_the_long_one():
    """20 rows an iteration (1 ms a row); a 100-row prompt (longer than the 64-row token
    budget) prefilling, then a 30-row one arrives: it takes the iteration's 20 rows, and the
    next iteration its last 10 before the long prompt's chunk, although it was admitted
    after it (docs/design.md#short-prompts-beside-long-ones)."""
    sched = make(budget_ms=20, token_budget=64, num_blocks=256)
    worker = FakeWorker(sched)
    add(sched, "long", 100, max_tokens=2)
    assert list(step(sched, worker)[0].num_scheduled_tokens.items()) == [("long", 20)]
    add(sched, "short", 30, max_tokens=2)
    assert list(step(sched, worker)[0].num_scheduled_tokens.items()) == [("short", 20)]
    assert list(step(sched, worker)[0].num_scheduled_tokens.items()) == [("short", 10),
                                                                          ("long", 10)]


def test_a_long_prompt_at_the_floor_is_walled_in_until_it_is_through():
    """40 ms an iteration, 1 ms a row and 0.5 ms a row of context; three decodes, a
    600-row prompt, and a short prompt (30 tokens out) arriving every iteration. The short
    ones go first at the start; as the long one's prefix grows, the decodes and its prefix
    read fill the budget and its chunks get the floor's four rows, at more than nine times
    its pace alone. From then on nothing is admitted until it is through: 163 iterations.
    Let in regardless, the short ones kept it at the floor: 1,188 iterations
    (docs/design.md#short-prompts-beside-long-ones)."""
    sched = make(budget_ms=40, cost=RowCost(row_ms=1, kv_ms=0.5), token_budget=64, max_seqs=64,
                 num_blocks=2048)
    worker = FakeWorker(sched)
    start_decoding(sched, worker, 3)
    add(sched, "long", 600, max_tokens=2)
    admitted = []
    while sched.get_request("long").num_output_tokens == 0 and len(admitted) < 2000:
        add(sched, f"s{len(admitted)}", 8, max_tokens=30)
        plan, _ = step(sched, worker)
        admitted.append(bool(plan.new_requests))
    assert admitted[:4] == [True] * 4                # short ones first while it moves
    last = max(n for n, admits in enumerate(admitted) if admits)
    assert len(admitted) < 300 and len(admitted) - last > 100
    plan, _ = step(sched, worker)
    assert plan.new_requests                         # through: the queue moves again


def test_a_walled_in_prompt_takes_no_handover_beside_it():
    """A P/D decode instance: handed-over streams join through `reserve()`, refused while
    requests wait there. Once a long prompt is walled in (as in the test above), the queue
    empties (its requests aborted) and still no reservation is taken until the long prompt
    is through."""
    sched = make(budget_ms=40, cost=RowCost(row_ms=1, kv_ms=0.5), token_budget=64, max_seqs=64,
                 num_blocks=2048)
    worker = FakeWorker(sched)
    start_decoding(sched, worker, 12)
    add(sched, "long", 600, max_tokens=2)
    n = 0
    while sched._walled is None:
        n += 1
        add(sched, f"s{n}", 8, max_tokens=30)
        step(sched, worker)
        assert n < 300
    for request_id in [f"s{k}" for k in range(1, n + 1)]:
        if sched.get_request(request_id).status is RequestStatus.WAITING:
            sched.abort(request_id)
    while sched.get_request("long").num_output_tokens == 0:
        assert sched.num_waiting == 0
        assert sched.reserve("late", prompt(8), SamplingParams(max_tokens=30)) is None
        step(sched, worker)
    assert sched.reserve("late", prompt(8), SamplingParams(max_tokens=30)) is not None


def test_decodes_keep_their_tokens_but_a_prompt_moves_a_widened_block():
    """GEMMs that widen their weights from 8 rows on: the rows a prompt may always take are a
    whole block (16). With a 24-row token budget and 22 decodes after the long prompt, it
    still moves 16 rows an iteration (a widened iteration is the dearest there is), not 4."""
    sched = make(budget_ms=10_000, cost=RowCost(row_ms=1, wide_from_rows=8), token_budget=24,
                 block_size=16, num_blocks=256, max_seqs=32)
    worker = FakeWorker(sched)
    add(sched, "long", 400, max_tokens=2)
    step(sched, worker)
    for i in range(22):
        add(sched, f"d{i}", 1, max_tokens=100)
    step(sched, worker)
    for _ in range(3):
        plan, _ = step(sched, worker)
        assert plan.num_scheduled_tokens["long"] == 16


def test_a_plan_made_ahead_gives_the_rows_of_requests_it_ends_to_the_prompt():
    """A P/D prefill instance (a TTFT goal, max_tokens 1, plans made ahead): six short
    prompts end with the token in flight, so the plan made ahead has the long prompt's
    chunk alone, at the whole 16-row token budget (it kept a row back for each of them)."""
    config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=16, num_kv_blocks=256,
                             block_size=4, max_model_len=1024, target_ttft_ms=10_000,
                             iteration_cost=RowCost(), enable_prefix_caching=False)
    sched = Scheduler(config, eos_token_ids=2, max_model_len=1024, clock=lambda: 100.0)
    worker = FakeWorker(sched)
    sched.add_request("long", prompt(200), SamplingParams(max_tokens=1))
    step(sched, worker)
    for i in range(6):      # more urgent (arrived earlier): placed first
        sched.add_request(f"a{i}", prompt(2), SamplingParams(max_tokens=1), arrival_s=0.0)
    worker.execute(sched.schedule())
    assert sched.schedule_ahead().num_scheduled_tokens == {"long": 16}


def test_kv_rows_shrink_later_chunks():
    sched = make(budget_ms=100, cost=RowCost(row_ms=2, kv_ms=1))
    worker = FakeWorker(sched)
    add(sched, "long", 60, max_tokens=1)
    plan, _ = step(sched, worker)
    # prefix 0: 2N + N <= 100 -> 33 rows; prefix 33: 3N + 33 <= 100 -> 22; then the last 5
    assert plan.num_scheduled_tokens["long"] == 33
    plan, _ = step(sched, worker)
    assert plan.num_scheduled_tokens["long"] == 22
    plan, _ = step(sched, worker)
    assert plan.num_scheduled_tokens["long"] == 5


def test_second_prompt_gets_only_the_time_left():
    sched = make(budget_ms=30)
    worker = FakeWorker(sched)
    add(sched, "a", 20, max_tokens=1)
    add(sched, "b", 40, max_tokens=1)
    plan, _ = step(sched, worker)
    assert plan.num_scheduled_tokens == {"a": 20, "b": 10}


def test_token_budget_still_applies():
    sched = make(budget_ms=1000, token_budget=8)
    worker = FakeWorker(sched)
    add(sched, "a", 20, max_tokens=1)
    plan, _ = step(sched, worker)
    assert plan.num_scheduled_tokens == {"a": 8}


def test_without_a_budget_the_token_budget_alone_decides():
    config = SchedulerConfig(max_num_batched_tokens=64, num_kv_blocks=64, block_size=4,
                             max_model_len=256)
    sched = Scheduler(config, 2, 256)
    add(sched, "a", 100, max_tokens=1)
    assert sched.schedule().num_scheduled_tokens == {"a": 64}


# ---- nothing starves ---------------------------------------------------------------------

def test_decodes_over_budget_still_run_and_a_prompt_moves_one_block_at_a_time():
    sched = make(budget_ms=2, block_size=4)      # 5 decodes alone take 5 ms
    worker = FakeWorker(sched)
    start_decoding(sched, worker, 5)
    add(sched, "long", 10, max_tokens=1)
    sizes = []
    while sched.get_request("long") is not None:
        plan, _ = step(sched, worker)
        assert all(plan.num_scheduled_tokens[f"d{i}"] == 1 for i in range(5))
        if "long" in plan.num_scheduled_tokens:
            sizes.append(plan.num_scheduled_tokens["long"])
    assert sizes == [4, 4, 2]                    # one block per iteration


@pytest.mark.parametrize("wide_from_rows,moves", [(None, 4), (24, 16)])
def test_the_floor_is_a_few_rows_unless_the_gemms_widen(wide_from_rows, moves):
    """With 16-token blocks: a prompt beside decodes that fill the budget moves
    MIN_PREFILL_ROWS (4) rows an iteration, or a whole block where the GEMMs widen their
    weights from some row count (a widening paid for 4 rows is the dearest iteration)."""
    sched = make(budget_ms=2, block_size=16, cost=RowCost(wide_from_rows=wide_from_rows))
    worker = FakeWorker(sched)
    start_decoding(sched, worker, 5)
    add(sched, "long", 40, max_tokens=1)
    plan, _ = step(sched, worker)
    assert plan.num_scheduled_tokens["long"] == moves


def test_only_the_first_prefill_gets_the_floor():
    sched = make(budget_ms=2, block_size=4)
    worker = FakeWorker(sched)
    start_decoding(sched, worker, 5)
    add(sched, "a", 10, max_tokens=1)
    add(sched, "b", 10, max_tokens=1)
    plan, _ = step(sched, worker)
    assert plan.num_scheduled_tokens["a"] == 4 and "b" not in plan.num_scheduled_tokens


def test_orca_mode_sends_the_first_prompt_whole_and_holds_the_next():
    sched = make(budget_ms=30, chunked=False)
    worker = FakeWorker(sched)
    add(sched, "a", 50, max_tokens=1)             # over budget alone: goes anyway, whole
    add(sched, "b", 5, max_tokens=1)
    plan, _ = step(sched, worker)
    assert plan.num_scheduled_tokens == {"a": 50}
    plan, _ = step(sched, worker)
    assert plan.num_scheduled_tokens == {"b": 5}


def test_orca_mode_batches_whole_prompts_while_they_fit():
    sched = make(budget_ms=30, chunked=False)
    worker = FakeWorker(sched)
    for name, n in (("a", 10), ("b", 15), ("c", 10)):
        add(sched, name, n, max_tokens=1)
    plan, _ = step(sched, worker)
    assert plan.num_scheduled_tokens == {"a": 10, "b": 15}


# ---- the roofline on a made-up model and machine -----------------------------------------

TOY_MODEL = ModelShape("toy", num_layers=4, hidden_size=256, intermediate_size=512,
                       num_heads=8, num_kv_heads=2, head_dim=32, vocab_size=1000)
TOY_HW = HardwareProfile("toy", {"bfloat16": 0.002, "float32": 0.001}, bandwidth_tbps=0.0005)


def test_roofline_chunks_are_the_largest_that_fit():
    cost = RooflineCost(TOY_MODEL, TOY_HW, dtype_bytes=2)
    budget = 5.0 * cost.iteration_ms([(1, 64)] * 4)     # room for ~18 prefill rows
    sched = make(budget_ms=budget, cost=cost, block_size=4, num_blocks=512)
    worker = FakeWorker(sched)
    start_decoding(sched, worker, 4, prompt_len=64)
    add(sched, "long", 900, max_tokens=1)
    cut = 0
    while sched.get_request("long") is not None:
        plan = sched.schedule()
        check_plan(sched, plan)
        chunks = chunks_of(sched, plan)
        rows = plan.num_scheduled_tokens.get("long", 0)
        if estimate_iteration(chunks, TOY_MODEL, TOY_HW, 2).time_ms > budget:
            assert rows <= 4                                   # only the one-block floor
        request = sched.get_request("long")
        if 1 < rows < request.num_uncomputed_tokens:          # cut by the latency budget
            cut += 1
            bigger = [c for c in chunks if c[0] == 1] + [(rows + 1, request.num_computed_tokens + rows + 1)]
            assert estimate_iteration(bigger, TOY_MODEL, TOY_HW, 2).time_ms > budget
        sched.update(plan, worker.execute(plan))
    assert cut >= 10


@pytest.mark.parametrize("gemm_half_rows", [0.0, 16.0, 256.0])   # with the efficiency curve
def test_closed_form_matches_the_cost_models_search(gemm_half_rows):
    rng = random.Random(5)
    hw = HardwareProfile("toy", {"bfloat16": 3.0, "float32": 1.0}, bandwidth_tbps=0.2,
                         gemm_half_rows=gemm_half_rows)
    for dtype_bytes in (2, 4):
        cost = RooflineCost(TOY_MODEL, hw, dtype_bytes)
        for _ in range(200):
            chunks = [(1, rng.randint(1, 4000)) for _ in range(rng.randint(0, 40))]
            if rng.random() < 0.4:
                q = rng.randint(1, 2000)
                chunks.append((q, q + rng.randint(0, 3000)))
            prefix, budget = rng.choice([0, 7, 500, 20000]), rng.uniform(0.01, 50.0)
            assert cost.max_prefill_rows(budget, chunks, prefix) == max_prefill_tokens_within(
                budget, chunks, prefix, TOY_MODEL, hw, dtype_bytes)
            if chunks:
                want = estimate_iteration(chunks, TOY_MODEL, hw, dtype_bytes).time_ms
                assert cost.iteration_ms(chunks) == pytest.approx(want, rel=1e-12)


# ---- random traffic under a latency budget -------------------------------------------------

def check_latency(sched: Scheduler, plan: IterationPlan, cost: RowCost) -> None:
    """Over budget only through the floor: then one prefill of at most one block (chunked),
    or one whole prompt (ORCA); decodes are never dropped for time."""
    config = sched.config
    if cost.iteration_ms(chunks_of(sched, plan)) <= config.max_iteration_ms:
        return
    if config.enable_chunked_prefill:
        prefills = [rows for rows in plan.num_scheduled_tokens.values() if rows > 1]
        assert len(prefills) <= 1 and all(rows <= config.block_size for rows in prefills)
    else:
        assert len(plan.new_requests) <= 1


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 40), st.integers(1, 6), st.integers(1, 8), st.integers(8, 64),
       st.booleans(), st.integers(1, 30), st.integers(0, 2),
       st.lists(arrival_st, min_size=2, max_size=12), st.lists(abort_st, max_size=4))
def test_random_traffic_under_a_latency_budget(budget, max_seqs, block_size, slots, chunked,
                                               budget_ms, kv_ms, arrivals, aborts):
    cost = RowCost(row_ms=1, kv_ms=kv_ms)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                             num_kv_blocks=max(1, slots // block_size), block_size=block_size,
                             max_model_len=128, enable_chunked_prefill=chunked,
                             max_iteration_ms=budget_ms, iteration_cost=cost)
    sched = Scheduler(config, 2, 128)

    def check(plan: IterationPlan) -> None:
        check_latency(sched, plan, cost)
        if not chunked:
            check_orca(sched, plan)

    drive_random_traffic(sched, arrivals, aborts, check)


def drive_random_traffic(sched: Scheduler, arrivals, aborts, each_plan) -> None:
    """Run the arrivals and aborts to the end, every plan checked (`each_plan` after the
    common checks). The oldest running request still moves every iteration (the floor), so
    the bound of test_scheduler_properties holds unchanged; everything ends and every block
    comes back."""
    driver = Driver(sched, arrivals, aborts)
    last_arrival = max(a.step for a in arrivals)
    bound = last_arrival + 3 + sum(a.num_prompt + a.max_tokens for a in arrivals)
    step_no = 0
    while step_no <= last_arrival or sched.has_unfinished():
        assert step_no <= bound, "the scheduler stopped making progress"
        driver.arrive(step_no)
        driver.abort(step_no, while_running=False)
        plan = sched.schedule()
        check_plan(sched, plan)
        each_plan(plan)
        result = driver.worker.execute(plan)
        driver.abort(step_no, while_running=True)
        for out in sched.update(plan, result):
            driver.outputs.setdefault(out.request_id, []).append(out)
        step_no += 1
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks
    for i in driver.accepted:
        assert driver.outputs[f"r{i}"][-1].finished


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 40), st.integers(1, 6), st.integers(1, 8), st.integers(8, 64),
       st.integers(0, 10), st.integers(0, 2), st.lists(arrival_st, min_size=2, max_size=12),
       st.lists(abort_st, max_size=4))
def test_random_traffic_under_the_auto_target_and_its_pace(budget, max_seqs, block_size, slots,
                                                           fixed_ms, kv_ms, arrivals, aborts):
    """The token-gap target at its auto factor with the prompts' pace, the clock moved by each
    iteration's cost: plans stay valid, the oldest running request still moves every
    iteration (so the progress bound of test_scheduler_properties holds), everything ends."""
    cost = RowCost(row_ms=1, kv_ms=kv_ms, fixed_ms=fixed_ms)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                             num_kv_blocks=max(1, slots // block_size), block_size=block_size,
                             max_model_len=128, target_tbt_factor=1.5, iteration_cost=cost)
    clock = SimClock()
    sched = Scheduler(config, 2, 128, clock=clock)

    def advance(plan: IterationPlan) -> None:
        clock.now += cost.iteration_ms(chunks_of(sched, plan)) / 1e3

    drive_random_traffic(sched, arrivals, aborts, advance)


# ---- configuration ------------------------------------------------------------------------

def test_config_refuses_a_budget_without_a_cost_model_or_a_bad_value():
    for budget in ({"max_iteration_ms": 20}, {"target_tbt_ms": 50}, {"target_tbt_factor": 3}):
        with pytest.raises(PacerError, match="needs a cost model"):
            SchedulerConfig(**budget)
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(PacerError, match="max-iteration-ms"):
            SchedulerConfig(max_iteration_ms=bad, iteration_cost=RowCost())


def test_engine_flags_parse_and_build_the_cost_model():
    import argparse
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    args = EngineArgs.from_cli(p.parse_args(
        ["--max-iteration-ms", "25", "--hw", "h100", "--no-chunked-prefill"]))
    assert (args.max_iteration_ms, args.hw, args.enable_chunked_prefill) == (25.0, "h100", False)
    defaults = EngineArgs.from_cli(p.parse_args([]))
    assert defaults.enable_chunked_prefill and defaults.max_iteration_ms is None
    # what `pacer up` serves with, for the benches that start one: the token-gap target on,
    # where the in-process engine's own default leaves it off
    assert defaults.target_tbt_ms == "auto" and EngineArgs().target_tbt_ms == "off"
    assert EngineArgs.serving(kv_cache_memory="512MiB") == replace(defaults,
                                                                   kv_cache_memory="512MiB")
    assert latency_cost_for(None, "h100", TOY_MODEL, 2) is None
    cost = latency_cost_for(25.0, "h100", TOY_MODEL, 2)
    assert cost.hw.name == "h100" and cost.model.num_layers == TOY_MODEL.num_layers
    # without --hw: the model fitted online from measured forward times
    assert isinstance(latency_cost_for(25.0, None, TOY_MODEL, 2), OnlineIterationCost)
    assert isinstance(latency_cost_for(None, None, TOY_MODEL, 2, "auto"), OnlineIterationCost)
    assert latency_cost_for(None, None, TOY_MODEL, 2, "off") is None


def test_engine_layout_carries_the_budget_to_the_scheduler():
    from scheduler_svc.build import build_scheduler
    from shared.engine_layout import engine_layout
    layout = engine_layout(EngineArgs(max_iteration_ms=30.0, hw="a100", dtype="bfloat16"))
    config = layout.scheduler_config
    assert config.max_iteration_ms == 30.0 and config.iteration_cost.hw.name == "a100"
    assert config.iteration_cost.dtype_bytes == 2
    assert build_scheduler(layout).config.iteration_cost is config.iteration_cost
    assert engine_layout(EngineArgs()).scheduler_config.enable_chunked_prefill


# ---- the token-gap target ---------------------------------------------------------------

def make_target(factor: float | None = None, ms: float | None = None, token_budget: int = 512,
                cost=RowCost()) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=token_budget, max_num_seqs=16,
                             num_kv_blocks=256, block_size=4, max_model_len=1024,
                             target_tbt_factor=factor, target_tbt_ms=ms, iteration_cost=cost)
    return Scheduler(config, eos_token_ids=2, max_model_len=1024)


def test_a_lone_prefill_runs_at_the_full_token_budget():
    sched = make_target(factor=3.0, token_budget=64)
    add(sched, "long", 200, max_tokens=2)
    assert sched.schedule().num_scheduled_tokens == {"long": 64}   # no one waits between tokens


@pytest.mark.parametrize("wide_from_rows", [None, 8])
@pytest.mark.parametrize("factor", [1.5, 3.0, 8.0])
def test_beside_decodes_prefill_is_capped_to_the_factor_of_a_decode_iteration(factor,
                                                                             wide_from_rows):
    """The target: `factor` times the decodes alone, and at least the decodes plus one block
    (a prompt always moves); where the GEMMs widen their weights, at least factor - 1 times
    that."""
    sched = make_target(factor=factor, cost=RowCost(wide_from_rows=wide_from_rows))
    worker = FakeWorker(sched)
    start_decoding(sched, worker, 4)
    add(sched, "long", 600, max_tokens=2)     # longer than the token budget: no stretch
    while sched.get_request("long").num_output_tokens == 0:
        plan = sched.schedule()
        chunks = chunks_of(sched, plan)
        decodes = [c for c in chunks if c[0] == 1]
        decode_ms = RowCost().iteration_ms(decodes)
        floor_ms = RowCost().iteration_ms(decodes + [(4, 4)])     # the decodes and one block
        assert plan.total_tokens <= 512                            # the token budget still caps
        if decodes:     # once the streams finished, a lone prefill takes the token budget
            floor = 1 if wide_from_rows is None else factor - 1
            assert RowCost().iteration_ms(chunks) <= max(factor * decode_ms, floor * floor_ms,
                                                         floor_ms)
        sched.update(plan, worker.execute(plan))


@pytest.mark.parametrize("streams,prompts,prompt_len,ratio", [
    (2, 2, 300, 1), (2, 4, 300, 1.5), (2, 8, 300, 2.5), (6, 5, 300, 11 / 6), (6, 12, 300, 3),
    (8, 0, 300, 1), (2, 2, 600, 1)])
def test_waiting_prompts_stretch_the_gap_by_what_they_add_to_the_streams(streams, prompts,
                                                                         prompt_len, ratio):
    """`streams` decode while `prompts` prompts wait: the target stretches by ((streams +
    prompts) / streams) squared, streams counted as at least STRETCH_MIN_STREAMS (4): 2
    streams and 2 prompts hold it. Prompts longer than the token budget (512: the last case)
    are long prompts, what the target chunks: they do not stretch it."""
    stretch = ratio ** 2
    sched = make_target(factor=3.0)
    worker = FakeWorker(sched)
    start_decoding(sched, worker, streams)
    for i in range(prompts):
        add(sched, f"p{i}", prompt_len, max_tokens=2)
    add(sched, "long", 1000, max_tokens=2)      # something to chunk in every case
    chunks = chunks_of(sched, sched.schedule())
    target_ms = max(3.0 * RowCost().iteration_ms([(1, 0)] * streams),
                    RowCost().iteration_ms([(1, 0)] * streams + [(4, 4)]))
    assert RowCost().iteration_ms(chunks) == pytest.approx(target_ms * stretch, abs=1)


def make_paced(clock: SimClock, max_seqs: int = 16, cost: RowCost = RowCost()) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=max_seqs, num_kv_blocks=1024,
                             block_size=4, max_model_len=1024, target_tbt_factor=1.5,
                             iteration_cost=cost, enable_prefix_caching=False)
    return Scheduler(config, eos_token_ids=2, max_model_len=1024, clock=clock)


def paced_beside(streams: int, prompts: int) -> tuple[SimClock, Scheduler, FakeWorker]:
    """A paced scheduler with `streams` decoding and `prompts` 600-row prompts queued."""
    clock = SimClock()
    sched = make_paced(clock)
    worker = FakeWorker(sched)
    start_decoding(sched, worker, streams)
    for i in range(prompts):
        add(sched, f"p{i}", 600, max_tokens=2)
    return clock, sched, worker


def test_a_prompt_behind_its_ttft_goal_lifts_the_gap_target():
    """The prompts' pace: one 1,000-row prompt beside 10 streams (RowCost: 1 ms a row). Its
    TTFT goal is 3x its prefill alone plus a full-budget iteration: 3 * 1000 + 512 ms. On
    arrival it needs 1000 / 3512 of the time left, less than the target leaves it (1.5 x the
    10 decodes: 5 rows); with 995 rows to go and 1.98 s left, a little over half (an iteration
    of 10 / (1 - 0.503) ms: 10 rows);
    with less time left than its prefill, PACE_MAX_GAP x the decodes (30 ms, 20 rows)."""
    clock = SimClock()
    sched = make_paced(clock)
    worker = FakeWorker(sched)
    start_decoding(sched, worker, 10)
    add(sched, "long", 1000, max_tokens=2)
    arrival = clock.now
    rows = []
    for left_s in (3.512, 1.98, 0.5):      # 995 rows left after the first
        clock.now = arrival + 3.512 - left_s
        plan, _ = step(sched, worker)
        rows.append(plan.num_scheduled_tokens["long"])
    assert rows == [5, 10, 20]


def test_the_pace_adds_up_the_prompts_in_the_order_they_get_rows():
    """600-row prompts queued beside 10 streams, then a 1,000-row one (all longer than the
    token budget: none stretches the target). Each prompt's deadline must hold its own prefill
    and those of the prompts before it: alone, the 1,000-row one needs 1,000 of its 3,512 ms
    (0.28, less than the target's max(1.5 x 10, 10 + 4) ms leaves: 5 rows); behind one
    600-row prompt, 1,600 (0.456: 10 / (1 - 0.456) ms, 8 rows); behind two, 2,200 (0.626, and
    the second 600-row one 1,200 of its 2,312 ms: 26 ms, 16 rows); behind three, the third
    600-row one needs 1,800 of 2,312 ms (0.78), held to PACE_MAX_GAP x the decodes: 30 ms."""
    for prompts, total in ((0, 15), (1, 18), (2, 26), (3, 30)):
        _, sched, _ = paced_beside(10, prompts)
        add(sched, "long", 1000, max_tokens=2)
        assert sched.schedule().total_tokens == total


def test_the_pace_stretches_where_long_prompts_outnumber_the_streams():
    """Two streams (2 ms of decodes) beside long prompts far behind their goals: four or
    fewer get PACE_MAX_GAP x the decodes (6 ms, 4 rows); six, 3 x (6 / 4) ** 2 = 6.75x
    (13.5 ms, 11 rows); eight, 3 x (8 / 4) ** 2, held to PACE_MAX_STRETCHED_GAP: 20 ms."""
    for prompts, total in ((4, 6), (6, 13), (8, 20)):
        clock, sched, worker = paced_beside(2, prompts)
        step(sched, worker)
        clock.now += 30                     # every goal long past
        assert sched.schedule().total_tokens == total


def test_a_prompt_late_behind_another_asks_for_nothing():
    """Two 1,000-row prompts queued together; 1.6 s later the second cannot make its goal (3 *
    1000 + 512 ms) behind the first (1,996 rows of work, 1,912 ms left) and asks for nothing:
    a longer iteration would go to the first, which needs 996 of its 1,912 ms, U = 0.52, less
    than the target already gives it: max(1.5 x 2, 2 + 4) ms."""
    clock = SimClock()
    sched = make_paced(clock)
    worker = FakeWorker(sched)
    start_decoding(sched, worker, 2)
    add(sched, "first", 1000, max_tokens=2)
    add(sched, "second", 1000, max_tokens=2)
    step(sched, worker)
    clock.now += 1.6
    assert sched.schedule().total_tokens == 6


def test_the_pace_counts_from_when_a_place_was_free():
    """A prompt that arrived 10 s ago and waited for one of three places, all held by streams:
    when a stream ends and it takes the place, its goal counts from then, so it gets what the
    target leaves (max(1.5 x 2, 2 + 4) - 2 rows), not the whole of the pace: its wait
    was the streams', which no iteration's length shortens."""
    clock = SimClock()
    sched = make_paced(clock, max_seqs=3)
    worker = FakeWorker(sched)
    add(sched, "s0", 3, max_tokens=3)
    add(sched, "s1", 3, max_tokens=200)
    add(sched, "s2", 3, max_tokens=200)
    sched.add_request("late", prompt(1000), SamplingParams(max_tokens=2),
                      arrival_s=clock.now - 10)
    while "late" not in (plan := step(sched, worker)[0]).num_scheduled_tokens:
        pass                                # s0 ends after its three tokens
    assert plan.num_scheduled_tokens["late"] == 4


def test_long_prompts_in_a_closed_loop_keep_the_batch_decoding():
    """The collapse the pace prevents: eight slots, each request a 600-row prompt (longer than
    the token budget: the target's stretch for short prompts leaves it) and 40 tokens,
    a new one as each ends; an iteration costs 10 ms and 1 ms a row, and the clock moves by
    it. Held to 1.5x the decodes alone, prompts move a few rows an iteration; few requests get
    to decode, so the decodes' iteration is short, so the prompts move slower still: most of
    the slots sit prefilling (a median TTFT of three goals, 3 * (600 + 2 * 10) + 522 ms, one
    slot of eight decoding). With the pace the iterations grow, past PACE_MAX_GAP x the
    decodes while the long prompts outnumber the streams: the first tokens come in little
    more than half the time and two and a half times as many slots decode."""
    cost = RowCost(fixed_ms=10)
    goal_s = (3 * (600 + 2 * 10) + 522) / 1e3

    def run(paced: bool) -> tuple[float, float]:
        clock = SimClock()
        sched = make_paced(clock, max_seqs=8, cost=cost)
        if not paced:
            sched._pace_goal = None
        worker = FakeWorker(sched)
        arrived, ttft, decoding = {}, [], []
        for i in range(8):
            add(sched, f"r{i}", 600, max_tokens=40)
            arrived[f"r{i}"] = clock.now
        added = 8
        while sched.has_unfinished():
            plan = sched.schedule()
            chunks = chunks_of(sched, plan)
            decoding.append(sum(1 for q, _ in chunks if q == 1))
            clock.now += cost.iteration_ms(chunks) / 1e3
            for out in sched.update(plan, worker.execute(plan)):
                if out.num_output_tokens == 1:
                    ttft.append(clock.now - arrived[out.request_id])
                if out.finished and added < 40:
                    rid = f"r{added}"
                    add(sched, rid, 600, max_tokens=40)
                    arrived[rid], added = clock.now, added + 1
        return sorted(ttft)[len(ttft) // 2], sum(decoding) / len(decoding)

    paced_ttft, paced_decoding = run(paced=True)
    held_ttft, held_decoding = run(paced=False)
    assert held_ttft > 3 * goal_s and held_decoding < 1.5
    assert paced_ttft < 0.6 * held_ttft     # eight prompts at once wait for each other: the
    assert paced_decoding >= 2.5            # median is over the goal, paced or not


def test_a_fixed_target_in_ms():
    sched = make_target(ms=10.0)
    worker = FakeWorker(sched)
    start_decoding(sched, worker, 2)
    add(sched, "long", 100, max_tokens=2)
    plan = sched.schedule()
    assert plan.num_scheduled_tokens["long"] == 8                  # 10 ms - 2 decode rows


def test_measured_forward_times_reach_the_cost_model():
    seen = []

    class Recording(RowCost):
        def observe(self, chunks, ms, wide_from_rows=None):
            seen.append((sorted(chunks), ms, wide_from_rows))

    sched = make_target(factor=3.0, cost=Recording())
    add(sched, "a", 5, max_tokens=3)
    add(sched, "b", 2, max_tokens=3)
    plan = sched.schedule()
    result = FakeWorker(sched).execute(plan)
    sched.update(plan, StepResult(result.step, result.sampled, forward_ms=7.5, wide_from_rows=24))
    assert seen == [([(2, 2), (5, 5)], 7.5, 24)]


def test_decodes_alone_now_and_then_keep_their_price_true():
    """Eight places, sixteen 1,000-row prompts of 128 tokens each (a retrieval load), priced
    by the online cost model, on a machine where an iteration with prompt rows costs 15 ms
    more than its rows account for (a shape the fit's terms cannot tell from its fixed cost).
    While prompts are chunked beside the decodes every iteration is mixed, and fitted on those
    alone the decodes were priced at up to 4x their time, the token-gap target and the pace
    with them. Every DECODE_PROBE_EVERY iterations with prompt rows the decodes run alone once,
    and their price stays true (docs/design.md#the-prompts-pace)."""

    def true_ms(chunks) -> float:
        rows = sum(q for q, _ in chunks if q > 1)
        return 5.0 + sum(1.0 for q, _ in chunks if q == 1) + (15.0 + 0.7 * rows if rows else 0)

    clock = SimClock()
    cost = OnlineIterationCost()
    sched = make_paced(clock, max_seqs=8, cost=cost)
    worker = FakeWorker(sched)
    for i in range(16):
        add(sched, f"p{i}", 1000, max_tokens=128)
    priced = []                 # the decodes' price over their time, each iteration with some
    while sched.has_unfinished():
        plan = sched.schedule()
        chunks = chunks_of(sched, plan)
        decodes = [c for c in chunks if c[0] == 1]
        if decodes:
            priced.append(cost.iteration_ms(decodes) / true_ms(decodes))
        clock.now += true_ms(chunks) / 1e3
        sched.update(plan, replace(worker.execute(plan), forward_ms=true_ms(chunks)))
    assert len(priced) > 200 and max(priced[10:]) < 1.2
