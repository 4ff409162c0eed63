"""The scheduling core on a fake clock: the roofline cost model stands in for the workers.

Each iteration the real `Scheduler` plans; the plan's chunks `(q_rows, kv_len)` are priced by
`RooflineCost.iteration_ms` and the clock moves on by that much; every request that reached
the end of its tokens "samples" a dummy token (never EOS, so it stops at its output length).
A token is stamped with the clock at the end of the iteration that produced it, which gives
TTFT (arrival → first token) and TBT (gap between a request's consecutive tokens) exactly as
docs/design.md#why-chunked-prefill counts them: a decode shares the wall time of everything
it rode with.
"""
from __future__ import annotations

import time
from array import array
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from scheduler_svc.arrivals import Arrival
from scheduler_svc.core import Scheduler
from shared.config import SchedulerConfig
from shared.cost_model import RooflineCost
from shared.errors import InvalidRequestError
from shared.plan import SampledToken, StepResult
from shared.sampling import SamplingParams

_DUMMY = SampledToken(0)
_TIMELINE_FIELDS = ("end_s", "ms", "decode_rows", "prefill_rows", "num_running",
                    "num_waiting", "max_tbt_ms")


@dataclass
class Timeline:
    """One entry per iteration, stored by column (a run can have millions of iterations)."""
    end_s: array = field(default_factory=lambda: array("d"))
    ms: array = field(default_factory=lambda: array("d"))
    decode_rows: array = field(default_factory=lambda: array("l"))
    prefill_rows: array = field(default_factory=lambda: array("l"))
    num_running: array = field(default_factory=lambda: array("l"))
    num_waiting: array = field(default_factory=lambda: array("l"))
    max_tbt_ms: array = field(default_factory=lambda: array("d"))   # 0 when no decode token

    def __len__(self) -> int:
        return len(self.ms)

    def to_dict(self) -> dict[str, list]:
        return {name: getattr(self, name).tolist() for name in _TIMELINE_FIELDS}


@dataclass
class SimResult:
    mode: str
    arrivals: list[Arrival]                  # admitted ones; index i is request id str(i)
    first_token_s: list[float]               # nan until the first token
    finish_s: list[float]
    tbt_ms: array                            # every gap, pooled over requests
    timeline: Timeline
    rejected: list[tuple[Arrival, str]]      # could never fit (too long for the KV pool)
    num_preemptions: int
    wall_s: float                            # how long the simulation itself took
    cpu_s: float                             # ...in this process's CPU time (a busy host)


def simulate(arrivals: Iterable[Arrival], config: SchedulerConfig, cost: RooflineCost,
             mode: str = "") -> SimResult:
    """Run every arrival to completion on the fake clock; deterministic for its inputs."""
    started, started_cpu = time.perf_counter(), time.process_time()
    # Every simulated prompt is the same id repeated (below): prefix caching would turn each
    # into a hit, so it is off — arrivals carry lengths, not contents.
    sched = Scheduler(replace(config, enable_prefix_caching=False), eos_token_ids=None,
                      max_model_len=config.max_model_len)
    pending = deque(sorted(arrivals, key=lambda a: a.arrival_s))
    state = _State()
    now = 0.0
    while pending or sched.has_unfinished():
        while pending and pending[0].arrival_s <= now:
            state.add(sched, pending.popleft())
        if not sched.has_unfinished():
            now = pending[0].arrival_s       # idle until the next arrival
            continue
        plan = sched.schedule()
        if plan.is_empty:
            if not pending:
                raise RuntimeError("the scheduler planned nothing with work waiting and no "
                                   "arrival to come")
            now = max(now, pending[0].arrival_s)
            sched.update(plan, StepResult(plan.step, {}))
            continue
        now = state.run(sched, plan, cost, now)
    return SimResult(mode, state.arrivals, state.first, state.finish, state.tbt, state.timeline,
                     state.rejected, sched.num_preemptions_total, time.perf_counter() - started,
                     time.process_time() - started_cpu)


class _State:
    """Per-request times and the timeline, in flat lists indexed by request id."""

    def __init__(self) -> None:
        self.arrivals: list[Arrival] = []
        self.first: list[float] = []
        self.last: list[float] = []
        self.finish: list[float] = []
        self.tbt = array("d")
        self.timeline = Timeline()
        self.rejected: list[tuple[Arrival, str]] = []

    def add(self, sched: Scheduler, arrival: Arrival) -> None:
        request_id = str(len(self.arrivals))
        try:
            # The prompt's ids never matter to the clock: one shared id keeps memory small.
            sched.add_request(request_id, [1] * arrival.prompt_len,
                              SamplingParams(max_tokens=arrival.output_len, ignore_eos=True))
        except InvalidRequestError as e:
            self.rejected.append((arrival, str(e)))
            return
        self.arrivals.append(arrival)
        nan = float("nan")
        self.first.append(nan)
        self.last.append(nan)
        self.finish.append(nan)

    def run(self, sched: Scheduler, plan, cost: RooflineCost, now: float) -> float:
        """Price the plan, advance the clock, stamp the tokens; returns the new time."""
        rows_of = plan.num_scheduled_tokens
        chunks = [(rows_of[c.request_id], c.num_computed_tokens + rows_of[c.request_id])
                  for c in plan.cached_requests]
        chunks += [(rows_of[r.request_id], r.num_computed_tokens + rows_of[r.request_id])
                   for r in plan.new_requests]
        sampled = {}
        for request_id, rows in rows_of.items():
            if sched.get_request(request_id).num_uncomputed_tokens == rows:
                sampled[request_id] = _DUMMY
        ms = cost.iteration_ms(chunks)
        now += ms / 1e3
        outputs = sched.update(plan, StepResult(plan.step, sampled))
        max_gap = self._stamp(outputs, now)
        decode_rows = sum(1 for q, _ in chunks if q == 1)
        t = self.timeline
        t.end_s.append(now)
        t.ms.append(ms)
        t.decode_rows.append(decode_rows)
        t.prefill_rows.append(plan.total_tokens - decode_rows)
        t.num_running.append(sched.num_running)
        t.num_waiting.append(sched.num_waiting)
        t.max_tbt_ms.append(max_gap)
        return now

    def _stamp(self, outputs, now: float) -> float:
        first, last, tbt = self.first, self.last, self.tbt
        max_gap = 0.0
        for out in outputs:
            i = int(out.request_id)
            previous = last[i]
            if previous == previous:                 # not nan: a gap since the last token
                gap = (now - previous) * 1e3
                tbt.append(gap)
                max_gap = gap if gap > max_gap else max_gap
            else:
                first[i] = now
            last[i] = now
            if out.finished:
                self.finish[i] = now
        return max_gap
