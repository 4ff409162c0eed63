"""Property test: random arrivals, prompt lengths, max_tokens, budgets, sequence caps, block
sizes, pool sizes, aborts (some while a plan runs), prompts sharing prefixes of random
lengths, prefix caching on or off, and workers that lose their KV cache while a plan runs;
driven strictly (schedule, run, update) or with overlap, as the served loop does
(`schedule_ahead()` while a plan runs, docs/design.md#overlap), which must end every request
exactly where the strict loop does.
Every step keeps the invariants (`check_plan`, the FakeWorker's protocol checks — every row
reads exactly its own prefix's K/V, writes only into blocks no other request holds —, and
`check_integrity`: ref counts equal table counts, free + used = total, a cached block's hash
is the chain of its holders' tokens); every run finishes within a proven number of steps;
every request that was not aborted ends exactly where the stop rule says.

The step bound: each iteration with live requests advances the oldest running request (it is
scheduled first with the whole budget and is never the preemption victim while another runs),
or admits the queue head into an empty batch, which makes it the oldest running request. Once
oldest, a request stays running until it finishes, so it is charged at most prompt + max_tokens
iterations. A lost KV cache sends everything back to the queue, so each one restarts the bound.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from scheduler_svc.core import Scheduler
from shared.errors import InvalidRequestError
from shared.outputs import RequestOutput
from shared.plan import IterationPlan, StepResult
from shared.sampling import SamplingParams
from test_scheduler_core import EOS, TOKEN, FakeWorker, check_plan, make_scheduler


@dataclass(frozen=True)
class Arrival:
    step: int
    num_prompt: int
    max_tokens: int
    eos_at: int | None          # the output index where the fake model samples EOS
    ignore_eos: bool
    family: int = 0             # arrivals of one family share their first `shared` tokens
    shared: int = 0


def arrival_prompt(a: Arrival, index: int) -> list[int]:
    """Never EOS or TOKEN; the part after the family's shared prefix is the arrival's own."""
    return [300 + a.family * 50 + i % 50 if i < a.shared else 1000 + index * 50 + i % 50
            for i in range(a.num_prompt)]


@dataclass(frozen=True)
class Abort:
    step: int
    index: int                  # which arrival
    while_running: bool         # between schedule() and update() rather than before schedule()


arrivals = st.builds(Arrival, st.integers(0, 8), st.integers(1, 32), st.integers(1, 16),
                     st.none() | st.integers(0, 15), st.booleans(), st.integers(0, 2),
                     st.integers(0, 32))
aborts = st.builds(Abort, st.integers(0, 30), st.integers(0, 11), st.booleans())


@st.composite
def configs(draw) -> dict:
    # Size the pool in slots so that most requests fit alone but several at once often do
    # not: that is where preemption happens.
    block_size = draw(st.integers(1, 8))
    slots = draw(st.integers(8, 64))
    return {"budget": draw(st.integers(1, 40)), "max_seqs": draw(st.integers(1, 6)),
            "num_blocks": max(1, slots // block_size), "block_size": block_size,
            "max_model_len": draw(st.integers(2, 128)), "chunked": draw(st.booleans()),
            "prefix_caching": draw(st.sampled_from([True, True, True, False]))}


def fits(sched: Scheduler, a: Arrival) -> bool:
    longest = min(a.num_prompt + a.max_tokens, sched.max_model_len)
    bm = sched.block_manager
    return a.num_prompt < sched.max_model_len and bm.blocks_needed(longest) <= bm.num_total_blocks


def expected_tokens(sched: Scheduler, a: Arrival) -> tuple[list[int], str]:
    limit = min(a.max_tokens, sched.max_model_len - a.num_prompt)
    out = [EOS if n == a.eos_at else TOKEN for n in range(limit)]
    if not a.ignore_eos and a.eos_at is not None and a.eos_at < limit:
        return out[:a.eos_at + 1], "stop"
    return out, "length"


def check_orca(sched: Scheduler, plan: IterationPlan) -> None:
    """ORCA-only mode: prompts go whole (from the end of their cached prefix); only a lone
    oversized prompt exceeds the budget."""
    for new in plan.new_requests:
        assert plan.num_scheduled_tokens[new.request_id] == \
            len(new.token_ids) - new.num_computed_tokens
    budget = sched.config.max_num_batched_tokens
    if plan.total_tokens > budget:
        (new,) = plan.new_requests
        assert plan.num_scheduled_tokens[new.request_id] > budget


class Driver:
    def __init__(self, sched: Scheduler, arrivals: list[Arrival], aborts: list[Abort],
                 kv_losses: frozenset[int] = frozenset(), overlap: bool = False) -> None:
        self.sched, self.arrivals, self.aborts = sched, arrivals, aborts
        self.overlap = overlap
        # overlap: plans sent, with the result the workers gave (they run plans in order)
        self.in_flight: deque[tuple[IterationPlan, StepResult]] = deque()
        self.num_ahead = 0
        self.kv_losses = kv_losses  # steps whose plan is lost with the workers' KV cache
        eos_at = {f"r{i}": a.eos_at for i, a in enumerate(arrivals)}
        self.worker = FakeWorker(sched, lambda rid, n: EOS if n == eos_at[rid] else TOKEN)
        self.outputs: dict[str, list[RequestOutput]] = {}
        self.accepted: set[int] = set()

    def arrive(self, step: int) -> None:
        for i, a in enumerate(self.arrivals):
            if a.step != step:
                continue
            try:
                self.sched.add_request(f"r{i}", arrival_prompt(a, i),
                                       SamplingParams(max_tokens=a.max_tokens,
                                                      ignore_eos=a.ignore_eos))
                self.accepted.add(i)
            except InvalidRequestError:
                assert not fits(self.sched, a)
            assert (i in self.accepted) == fits(self.sched, a)

    def abort(self, step: int, while_running: bool) -> None:
        for ab in self.aborts:
            if ab.step == step and ab.while_running == while_running:
                self.sched.abort(f"r{ab.index}")

    def step(self, step: int) -> None:
        if self.overlap:
            self.step_overlapped(step)
            return
        self.arrive(step)
        self.abort(step, while_running=False)
        plan = self.sched.schedule()
        check_plan(self.sched, plan)
        if not self.sched.config.enable_chunked_prefill:
            check_orca(self.sched, plan)
        if step in self.kv_losses:
            # the workers restarted before answering: no block's content survives
            self.worker.lose_kv_cache(plan)
            self.sched.recompute_running()
            assert self.sched.block_manager.num_cached_blocks == 0
            self.sched.block_manager.check_integrity()
            return
        result = self.worker.execute(plan)
        self.abort(step, while_running=True)
        for out in self.sched.update(plan, result):
            self.outputs.setdefault(out.request_id, []).append(out)
        self.sched.block_manager.check_integrity()

    def step_overlapped(self, step: int) -> None:
        """As the served loop: a plan out if none is in flight, the next one made ahead while
        one is, then the oldest result applied."""
        sched = self.sched
        self.arrive(step)
        self.abort(step, while_running=False)
        if not self.in_flight:
            if not sched.has_schedulable():
                return
            self.send(sched.schedule())
        if sched.has_schedulable() and sched.can_schedule_ahead():
            plan = sched.schedule_ahead()
            self.num_ahead += 1
            if not plan.is_empty or plan.dropped_request_ids:
                self.send(plan)
        if step in self.kv_losses:
            # the workers restarted with both plans unanswered: no block's content survives
            self.worker.lose_kv_cache()
            self.in_flight.clear()
            sched.recompute_running()
            assert sched.block_manager.num_cached_blocks == 0
            sched.block_manager.check_integrity()
            return
        self.abort(step, while_running=True)
        plan, result = self.in_flight.popleft()
        for out in sched.update(plan, result):
            self.outputs.setdefault(out.request_id, []).append(out)
        sched.block_manager.check_integrity()

    def run_to_end(self, tick=lambda: None) -> None:
        """Step until every arrival came and every request ended (`tick()` after each step),
        within a bound that only a scheduler that stopped making progress exceeds; then every
        block must be free."""
        sched, arrivals = self.sched, self.arrivals
        last_arrival = max(a.step for a in arrivals)
        # with overlap a plan that stalled for blocks costs one more step before the next
        bound = (last_arrival + 3 + sum(a.num_prompt + a.max_tokens for a in arrivals)) \
            * (1 + len(self.kv_losses)) * (2 if self.overlap else 1)
        step = 0
        while step <= last_arrival or sched.has_unfinished() or self.in_flight:
            assert step <= bound, "the scheduler stopped making progress"
            self.step(step)
            tick()
            step += 1
        assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks

    def check_outputs(self) -> int:
        """Every accepted request ended once, with the tokens it should have (a prefix of them
        if aborted); returns how many got at least one token."""
        aborted = {ab.index for ab in self.aborts}
        with_tokens = 0
        for i in self.accepted:
            outs = self.outputs[f"r{i}"]
            got = [t.token_id for o in outs for t in o.new_tokens]
            with_tokens += bool(got)
            want, reason = expected_tokens(self.sched, self.arrivals[i])
            assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
            assert outs[-1].num_output_tokens == len(got)
            if outs[-1].finish_reason == "abort":
                assert i in aborted and got == want[:len(got)]
            else:
                assert (got, outs[-1].finish_reason) == (want, reason)
        return with_tokens

    def send(self, plan: IterationPlan) -> None:
        check_plan(self.sched, plan)
        if not self.sched.config.enable_chunked_prefill:
            check_orca(self.sched, plan)
        self.in_flight.append((plan, self.worker.execute(plan)))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs(), st.lists(arrivals, min_size=2, max_size=12), st.lists(aborts, max_size=4),
       st.frozensets(st.integers(0, 40), max_size=2), st.booleans())
def test_random_traffic_keeps_invariants_and_finishes(config, arrivals, aborts, kv_losses,
                                                      overlap):
    sched = make_scheduler(**config)
    driver = Driver(sched, arrivals, aborts, kv_losses, overlap)
    driver.run_to_end()
    # `pytest --hypothesis-show-statistics` shows how often the hard paths were exercised
    event(f"preemptions: {min(sched.num_preemptions_total, 3)}")
    event(f"accepted requests: {min(len(driver.accepted), 4)}")
    if overlap:
        event(f"plans made ahead: {'0' if not driver.num_ahead else '>0'}")
        event(f"rows skipped after a stop token: {'>0' if driver.worker.num_skipped else '0'}")
    bm = sched.block_manager
    event(f"prefix cache hit tokens: {'0' if not bm.prefix_cache_hits else '>0'}")
    assert bm.prefix_cache_hits <= bm.prefix_cache_queries
    driver.check_outputs()


# ---- a P/D decode instance ---------------------------------------------------------------

@dataclass(frozen=True)
class DecodeCall:
    """One call a decode instance's scheduler makes on its core: `reserve` blocks for a
    prompt being prefilled elsewhere, a hand-off of a reservation `with_kv` or `without_kv`
    (recomputed here), a `whole` hand-off (a prompt prefilled here), a `cancel` of a
    reservation, an `abort`, or a `step` (plan, run, update). `index` picks the request
    among the reserved or live ones, `num_prompt` and `max_tokens` size a new one."""
    kind: str
    index: int
    num_prompt: int
    max_tokens: int


decode_calls = st.builds(DecodeCall, st.sampled_from(
    ["reserve", "reserve", "with_kv", "with_kv", "without_kv", "whole", "cancel", "abort",
     "step", "step"]), st.integers(0, 7), st.integers(1, 12), st.integers(2, 6))


@st.composite
def decode_configs(draw) -> dict:
    # a pool with room for a few requests at once, so that the sequence cap is what binds
    block_size = draw(st.integers(1, 8))
    return {"budget": draw(st.integers(1, 40)), "max_seqs": draw(st.integers(1, 4)),
            "num_blocks": draw(st.integers(32, 96)) // block_size, "block_size": block_size,
            "max_model_len": draw(st.integers(16, 64)), "chunked": draw(st.booleans()),
            "prefix_caching": draw(st.booleans())}


class DecodeDriver:
    """Plays a decode instance's scheduler on a core with a FakeWorker; a reservation
    handed over with its K/V gets the prompt's K/V in its reserved blocks, as a prefill
    instance's writes would put it there."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.worker = FakeWorker(sched)
        self.prompts: dict[str, list[int]] = {}
        self.ended: set[str] = set()

    def call(self, c: DecodeCall) -> None:
        sched, rid = self.sched, f"r{len(self.prompts)}"
        reserved = sorted(r for r in self.prompts if sched.is_reserved(r))
        live = sorted(r for r in self.prompts if sched.get_request(r) is not None)
        sampling = SamplingParams(max_tokens=c.max_tokens, ignore_eos=True)
        if c.kind in ("reserve", "whole"):
            prompt = self.prompts[rid] = arrival_prompt(Arrival(0, c.num_prompt, 1, None, True),
                                                        len(self.prompts))
            try:
                if c.kind == "reserve":
                    sched.reserve(rid, prompt, sampling)
                else:
                    sched.add_request(rid, prompt, sampling)
            except InvalidRequestError:
                pass
        elif c.kind in ("with_kv", "without_kv") and reserved:
            self.hand_over(reserved[c.index % len(reserved)], c.kind == "with_kv")
        elif c.kind == "cancel" and reserved:
            sched.cancel_reservation(reserved[c.index % len(reserved)])
        elif c.kind == "abort" and live:
            sched.abort(live[c.index % len(live)])
        elif c.kind == "step":
            self.step()
        assert sched.num_running <= sched.config.max_num_seqs

    def hand_over(self, rid: str, with_kv: bool) -> None:
        sched = self.sched
        if with_kv:
            table, size = sched.get_request(rid).block_table, sched.block_manager.block_size
            prompt = self.prompts[rid]
            for p in range(len(prompt)):
                self.worker.kv[table[p // size] * size + p % size] = tuple(prompt[:p + 1])
        sched.activate(rid, TOKEN, ["d0:1"] if with_kv else None)

    def step(self) -> None:
        plan = self.sched.schedule()
        check_plan(self.sched, plan)
        # a request handed over with its K/V and aborted or preempted before a plan took it
        # to the workers is dropped by an id they never had (they ignore it; the FakeWorker
        # would not)
        known = self.worker.requests
        sent = replace(plan,
                       finished_request_ids=[r for r in plan.finished_request_ids if r in known],
                       preempted_request_ids=[r for r in plan.preempted_request_ids if r in known])
        for out in self.sched.update(plan, self.worker.execute(sent)):
            if out.finished:
                self.ended.add(out.request_id)
        self.sched.block_manager.check_integrity()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(decode_configs(), st.lists(decode_calls, min_size=10, max_size=60))
def test_a_decode_instance_never_runs_more_than_max_num_seqs(config, calls):
    """Reservations, hand-offs with and without their K/V, whole hand-offs, cancels and
    aborts in any order: the requests running never exceed max_num_seqs (a reservation holds
    its seat until its hand-off comes), and once every reservation is handed over, everything
    ends: neither kind of request starves the other."""
    sched = make_scheduler(**config)
    driver = DecodeDriver(sched)
    for c in calls:
        driver.call(c)
    for rid in list(driver.prompts):
        if sched.is_reserved(rid):
            driver.hand_over(rid, with_kv=True)
    bound = sum(len(p) + 8 for p in driver.prompts.values()) + 2
    for _ in range(bound):
        if not sched.has_unfinished():
            break
        driver.step()
    assert not sched.has_unfinished(), "a request starved"
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks
    assert sched.reserve("late", [5], SamplingParams(max_tokens=1)) is not None
