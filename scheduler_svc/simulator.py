"""The scheduling core on a fake clock: the roofline cost model stands in for the workers.

Each iteration the real `Scheduler` plans; the plan's chunks `(q_rows, kv_len)` are priced by
`RooflineCost.iteration_ms` and the clock moves on by that much; every request that reached
the end of its tokens "samples" a dummy token (never EOS, so it stops at its output length).
A token is stamped with the clock at the end of the iteration that produced it, which gives
TTFT (arrival → first token) and TBT (gap between a request's consecutive tokens) exactly as
docs/design.md#why-chunked-prefill counts them: a decode shares the wall time of everything
it rode with.

A run is a cluster of engine instances, each a `Scheduler` of its own with its own clock,
driven by one queue of events (an iteration ends, a request arrives):

- `simulate`: `instances` colocated ones, each running prefill chunks beside its decodes;
  arrivals go to the one with the fewest prompt tokens still to prefill;
- `simulate_disaggregated` (docs/design.md#pd-disaggregation-pricing-the-hop): prefill and
  decode instances, as the served system runs them (docs/design.md#pd-disaggregation). A
  request first has a decode instance `reserve` blocks for its prompt plus one token (the
  one with the most free blocks; with no room anywhere it waits, first come first served);
  then the least loaded prefill instance runs it with `max_tokens` 1. Each forward there sends
  its chunks' K/V over the instance's `KVLink`, layer by layer as the forward runs (or a
  prompt's whole K/V after its last chunk), and the instance answers once its sends are done,
  as the served worker does; at that answer the decode instance `activate`s the request,
  which decodes on. Prompts shorter than `min_prompt_tokens` are prefilled by a decode
  instance itself (conditional disaggregation).

  TTFT counts as the worked example of P/D does, prefill + transfer + first decode: up to the
  first token out of the decode pool. The token the prefill side samples first (which the
  served system streams at once) is reported apart, and the gap after it is not a TBT.
"""
from __future__ import annotations

import gc
import heapq
import math
import time
from array import array
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from operator import itemgetter

from scheduler_svc.arrivals import Arrival
from scheduler_svc.core import Scheduler
from shared.config import SchedulerConfig
from shared.cost_model import RooflineCost
from shared.errors import InvalidRequestError
from shared.fabric import Fabric, KVLink
from shared.plan import SampledToken, StepResult
from shared.sampling import SamplingParams

_DUMMY = SampledToken(0)
_ROWS = itemgetter(0)                        # a chunk's q_rows
_TIMELINE_FIELDS = ("end_s", "ms", "decode_rows", "prefill_rows", "num_running",
                    "num_waiting", "max_tbt_ms", "instance")


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
    instance: array = field(default_factory=lambda: array("l"))     # which instance ran it

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
    worst_tbt_ms: list[float] = field(default_factory=list)   # per request; nan: one token
    # P/D only, per request (nan where it never went over the fabric): the prefill side's
    # first token, the transfer alone on the fabric, and what of it came after the prefill.
    prefill_done_s: list[float] = field(default_factory=list)
    transfer_ms: list[float] = field(default_factory=list)
    exposed_ms: list[float] = field(default_factory=list)
    instances: str = ""                      # what ran it, in words
    kv_tokens: int = 0                       # the KV pool of one instance, in tokens
    # --cost online: each iteration's |predicted - clock| / clock, as the core's model saw it
    # before learning from that iteration, and the first instance's fitted coefficients
    cost_errors: array = field(default_factory=lambda: array("d"))
    cost_coefficients_ms: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Hop:
    """How a prefilled request's K/V reach a decode instance."""
    fabric: Fabric
    kv_bytes_per_token: float
    num_layers: int
    layer_streaming: bool = True
    # the TP ranks of an instance, each sending its share over a link of its own (KVLink)
    links: int = 1
    # each side's digest of the K/V it sent or received, per token (docs/design.md#kv-integrity)
    digest_ms_per_token: float = 0.0

    @classmethod
    def of(cls, cost: RooflineCost, fabric: Fabric, layer_streaming: bool = True) -> Hop:
        return cls(fabric, cost.model.kv_bytes_per_token(cost.kv_bytes), cost.model.num_layers,
                   layer_streaming, cost.tp, cost.kv_digest_ms(1))


def simulate(arrivals: Iterable[Arrival], config: SchedulerConfig, cost: RooflineCost,
             mode: str = "", instances: int = 1) -> SimResult:
    """Run every arrival to completion on the fake clock, on `instances` colocated engine
    instances alike; deterministic for its inputs."""
    clock = SimClock()
    pool = [_Instance(i, "both", _scheduler(config, clock)) for i in range(instances)]
    return _Cluster(pool, cost, clock).run(arrivals, mode,
                                    f"{instances} instance(s), prefill beside decode")


def simulate_disaggregated(arrivals: Iterable[Arrival], prefill_config: SchedulerConfig,
                           decode_config: SchedulerConfig, cost: RooflineCost, hop: Hop,
                           num_prefill: int = 1, num_decode: int = 1, mode: str = "disagg",
                           min_prompt_tokens: int = 0) -> SimResult:
    """The same arrivals on `num_prefill` prefill instances and `num_decode` decode instances,
    the K/V of every prompt priced over `hop` between them."""
    clock = SimClock()
    pool = [_Instance(i, "prefill", _scheduler(prefill_config, clock), KVLink(hop.fabric, hop.links))
            for i in range(num_prefill)]
    pool += [_Instance(num_prefill + i, "decode", _scheduler(decode_config, clock))
             for i in range(num_decode)]
    return _Cluster(pool, cost, clock, hop, min_prompt_tokens).run(
        arrivals, mode, f"{num_prefill} prefill + {num_decode} decode instance(s), K/V over "
        f"{hop.fabric.name} ({hop.fabric.gb_per_s:g} GB/s)"
        + (", layer streaming" if hop.layer_streaming else ", sent after the prefill"))


class SimClock:
    """The simulated time in seconds, as every simulated scheduler reads it (a TTFT goal's
    deadlines, the token-gap target's pace): moved by the cluster's event loop."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _scheduler(config: SchedulerConfig, clock: SimClock) -> Scheduler:
    # Every simulated prompt is the same id repeated (below): prefix caching would turn each
    # into a hit, so it is off — arrivals carry lengths, not contents. A cost model that
    # learns (shared/online_cost.py) is copied fresh: each instance fits its own, as each
    # served scheduler does.
    fresh = getattr(config.iteration_cost, "fresh", None)
    return Scheduler(replace(config, enable_prefix_caching=False,
                             iteration_cost=fresh() if fresh else config.iteration_cost),
                     eos_token_ids=None, max_model_len=config.max_model_len, clock=clock)


@dataclass(eq=False)
class _Instance:
    index: int
    role: str                                # "both", "prefill" or "decode"
    sched: Scheduler
    link: KVLink | None = None               # a prefill instance's way out for K/V
    plan: object = None                      # the plan in flight, None when idle
    chunks: list = field(default_factory=list)
    ms: float = 0.0                          # the iteration, its sends' wait included
    forward_ms: float = 0.0                  # ...and without it: what a worker would time
    queued_prompt_tokens: int = 0            # routed here, not yet through their prefill
    # a decode instance's hand-overs (request id, first token, prompt tokens) whose received
    # K/V the next plan checks (docs/design.md#kv-integrity), and those the plan in flight does
    checks_due: list = field(default_factory=list)
    checking: list = field(default_factory=list)

    @property
    def load(self) -> tuple:
        """Least loaded first: prompt tokens still to prefill, then requests held."""
        sched = self.sched
        return (self.queued_prompt_tokens, sched.num_running + sched.num_waiting, self.index)

    @property
    def room(self) -> tuple:
        """Roomiest first: free KV blocks, then the fewest running requests."""
        sched = self.sched
        return (-sched.block_manager.num_free_blocks, sched.num_running, self.index)


class _Cluster:
    def __init__(self, pool: list[_Instance], cost: RooflineCost, clock: SimClock,
                 hop: Hop | None = None, min_prompt_tokens: int = 0) -> None:
        self.pool = pool
        self.clock = clock
        self.cost = cost
        self.hop = hop
        self.min_prompt_tokens = min_prompt_tokens
        self.entry = [i for i in pool if i.role != "decode"]       # where prompts go
        self.decoders = [i for i in pool if i.role == "decode"]
        self.events: list[tuple[float, int, _Instance]] = []       # iterations' ends
        self.seq = 0
        self.state = _State()
        self.reserved: dict[str, _Instance] = {}   # request id -> the decode instance
        self.no_room: deque[Arrival] = deque()     # waiting for a decode instance's blocks

    def run(self, arrivals: Iterable[Arrival], mode: str, instances: str) -> SimResult:
        started, started_cpu = time.perf_counter(), time.process_time()
        # The run allocates objects by the million and frees them by reference count (it makes
        # no cycles): the cyclic collector would only walk the ever-growing heap of requests,
        # ~10 % of the run (docs/benchmarks.md#simulator-speed).
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._loop(arrivals)
        finally:
            if collecting:
                gc.enable()
        stuck = [i.index for i in self.pool if i.sched.has_unfinished()]
        if stuck or self.no_room:
            raise RuntimeError(f"instances {stuck} planned nothing with work waiting and no "
                               "event to come")
        first, state = self.pool[0].sched, self.state
        return SimResult(mode, state.arrivals, state.first, state.finish, state.tbt,
                         state.timeline, state.rejected,
                         sum(i.sched.num_preemptions_total for i in self.pool),
                         time.perf_counter() - started, time.process_time() - started_cpu,
                         state.worst, state.prefill_done, state.transfer_ms, state.exposed_ms,
                         instances, first.config.num_kv_blocks * first.config.block_size,
                         state.cost_errors,
                         getattr(first.config.iteration_cost, "coefficients_ms", {}))

    def _loop(self, arrivals: Iterable[Arrival]) -> None:
        pending = deque(sorted(arrivals, key=lambda a: a.arrival_s))
        events = self.events
        while events or pending:
            now = min(events[0][0] if events else math.inf,
                      pending[0].arrival_s if pending else math.inf)
            self.clock.now = now
            while events and events[0][0] <= now:
                self._end_iteration(heapq.heappop(events)[2], now)
            while pending and pending[0].arrival_s <= now:
                self._arrive(pending.popleft())
            for instance in self.pool:
                if instance.plan is None and (instance.sched.has_schedulable()
                                              or instance.checks_due):
                    self._start_iteration(instance, now)

    # ---- arrivals ----------------------------------------------------------------------

    def _arrive(self, arrival: Arrival) -> None:
        if not self.decoders or arrival.output_len == 1:    # nothing to decode elsewhere
            self._prefill_at(min(self.entry, key=lambda i: i.load), arrival, None)
        elif arrival.prompt_len < self.min_prompt_tokens:  # not worth the hop
            self.state.add(min(self.decoders, key=lambda i: i.room).sched, arrival)
        else:
            self.no_room.append(arrival)
            self._reserve_in_order()

    def _reserve_in_order(self) -> None:
        """Reservations first come, first served: the head waits for room, the rest behind."""
        state = self.state
        while self.no_room:
            arrival = self.no_room[0]
            request_id = str(len(state.arrivals))     # the id it gets once admitted
            target = min(self.decoders, key=lambda i: i.room)
            try:
                blocks = target.sched.reserve(request_id, [1] * arrival.prompt_len,
                                              _sampling(arrival.output_len))
            except InvalidRequestError as e:
                state.rejected.append((arrival, str(e)))
                blocks = []
            if blocks is None:
                return
            self.no_room.popleft()
            if not blocks:
                continue
            if self._prefill_at(min(self.entry, key=lambda i: i.load), arrival, 1):
                self.reserved[request_id] = target
            else:
                target.sched.cancel_reservation(request_id)

    def _prefill_at(self, instance: _Instance, arrival: Arrival, max_tokens: int | None) -> bool:
        added = self.state.add(instance.sched, arrival, max_tokens)
        if added:
            instance.queued_prompt_tokens += arrival.prompt_len
        return added

    # ---- iterations --------------------------------------------------------------------

    def _start_iteration(self, instance: _Instance, now: float) -> None:
        sched = instance.sched
        plan = sched.schedule()
        checks, instance.checks_due = instance.checks_due, []
        if plan.is_empty and not checks:     # it waits for an arrival or for room to free up
            sched.update(plan, StepResult(plan.step, {}))
            return
        rows_of = plan.num_scheduled_tokens
        chunks = [(rows, c.num_computed_tokens + rows) for c in plan.cached_requests
                  for rows in (rows_of[c.request_id],)]
        chunks += [(rows_of[r.request_id], r.num_computed_tokens + rows_of[r.request_id])
                   for r in plan.new_requests]
        forward_ms = ms = self.cost.iteration_ms(chunks) if chunks else 0.0
        if checks:                   # each rank digests the received blocks first
            ms += self.hop.digest_ms_per_token * sum(n for _, _, n in checks)
        instance.checking = checks
        if instance.link is not None:
            ids = [c.request_id for c in plan.cached_requests] + \
                  [r.request_id for r in plan.new_requests]
            ms = self._send(instance, ids, chunks, now, ms)
        instance.plan, instance.chunks, instance.ms = plan, chunks, ms
        instance.forward_ms = forward_ms
        heapq.heappush(self.events, (now + ms / 1e3, self.seq, instance))
        self.seq += 1

    def _send(self, instance: _Instance, ids: list[str], chunks: list, now: float,
              ms: float) -> float:
        """A prefill forward's K/V sends for the requests that go on to a decode instance; the
        worker answers once they are done. Returns the iteration's ms, the wait included."""
        hop, sched, state = self.hop, instance.sched, self.state
        computed_s = now + ms / 1e3
        going = [(request_id, q) for request_id, (q, _) in zip(ids, chunks)
                 if request_id in self.reserved]
        if not going:
            return ms
        if hop.layer_streaming:
            sending = going
            done = instance.link.send_layers(now, computed_s, hop.num_layers,
                                             [q * hop.kv_bytes_per_token for _, q in going])
        else:                    # a prompt's whole K/V once its last chunk is computed
            sending = [(request_id, q) for request_id, q in going
                       if sched.get_request(request_id).num_uncomputed_tokens == q]
            done = [instance.link.send(computed_s, sched.get_request(request_id).num_prompt_tokens
                                       * hop.kv_bytes_per_token)
                    for request_id, _ in sending]
        # Each request is charged what of its own send came after the compute; a request of
        # the forward that sent nothing (its prefill goes on) waited on others' transfers.
        for (request_id, _), arrived_s in zip(sending, done):
            state.add_exposed(int(request_id), max(0.0, (arrived_s - computed_s) * 1e3))
        wait_ms = max(0.0, (max(done, default=computed_s) - computed_s) * 1e3)
        # then the digests of the blocks sent, for the decode side's check
        return ms + wait_ms + hop.digest_ms_per_token * sum(q for _, q in going)

    def _end_iteration(self, instance: _Instance, now: float) -> None:
        sched, plan = instance.sched, instance.plan
        sampled = dict.fromkeys(sched.samples_in_flight(), _DUMMY)
        learning = sched.config.iteration_cost
        if hasattr(learning, "observe") and instance.chunks:  # it learns from the clock
            predicted = learning.iteration_ms(instance.chunks)
            self.state.cost_errors.append(abs(predicted - instance.forward_ms)
                                          / instance.forward_ms)
        outputs = sched.update(plan, StepResult(plan.step, sampled, instance.forward_ms))
        instance.plan = None
        for request_id, token, _ in instance.checking:   # checked: they decode from here
            sched.activate(request_id, token, ["simulated"])
        instance.checking = []
        if instance.role == "prefill":
            for out in outputs:
                if out.num_output_tokens == 1:       # its prefill is over
                    instance.queued_prompt_tokens -= out.num_prompt_tokens
            outputs = [out for out in outputs if not self._hand_over(out, now)]
        prefilled = self.state.record(instance, sched, instance.chunks, instance.ms,
                                      plan.total_tokens, outputs, now)
        if instance.role == "both":       # every output stamped: first tokens end prefills
            instance.queued_prompt_tokens -= prefilled
        if instance.role == "decode" and self.no_room:
            self._reserve_in_order()                 # blocks may have been freed

    def _hand_over(self, out, now: float) -> bool:
        """A prefilled request, its K/V sent: the decode instance holding its reservation
        takes it on with the first token."""
        target = self.reserved.pop(out.request_id, None)
        if target is None:
            return False
        i = int(out.request_id)
        target.checks_due.append((out.request_id, out.new_tokens[0].token_id,
                                  self.state.arrivals[i].prompt_len))
        self.state.handed_over(i, now, self.hop.fabric.transfer_ms(
            self.state.arrivals[i].prompt_len * self.hop.kv_bytes_per_token / self.hop.links))
        return True


def _sampling(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


class _State:
    """Per-request times and the timeline, in flat lists indexed by request id."""

    def __init__(self) -> None:
        self.arrivals: list[Arrival] = []
        self.first: list[float] = []
        self.last: list[float] = []
        self.finish: list[float] = []
        self.worst: list[float] = []
        self.prefill_done: list[float] = []
        self.transfer_ms: list[float] = []
        self.exposed_ms: list[float] = []
        self.index_of: dict[str, int] = {}         # request id -> i (int() costs 6x more)
        self.tbt = array("d")
        self.cost_errors = array("d")
        self.timeline = Timeline()
        self.rejected: list[tuple[Arrival, str]] = []

    def add(self, sched: Scheduler, arrival: Arrival, max_tokens: int | None = None) -> bool:
        """Queue the arrival on `sched` as request str(its index); False if it was rejected.
        `max_tokens`: 1 on a prefill instance (the rest is decoded elsewhere)."""
        request_id = str(len(self.arrivals))
        try:
            # The prompt's ids never matter to the clock: one shared id keeps memory small.
            sched.add_request(request_id, [1] * arrival.prompt_len,
                              _sampling(max_tokens or arrival.output_len),
                              arrival_s=arrival.arrival_s)
        except InvalidRequestError as e:
            self.rejected.append((arrival, str(e)))
            return False
        self.index_of[request_id] = len(self.arrivals)
        self.arrivals.append(arrival)
        nan = float("nan")
        for column in (self.first, self.last, self.finish, self.worst, self.prefill_done,
                       self.transfer_ms, self.exposed_ms):
            column.append(nan)
        return True

    def add_exposed(self, i: int, ms: float) -> None:
        """A prefill forward of request i waited `ms` for its K/V sends."""
        self.exposed_ms[i] = ms if self.exposed_ms[i] != self.exposed_ms[i] else \
            self.exposed_ms[i] + ms

    def handed_over(self, i: int, now: float, transfer_ms: float) -> None:
        """Request i's first token, sampled on the prefill side, reached the decode side."""
        self.prefill_done[i] = now
        self.transfer_ms[i] = transfer_ms

    def record(self, instance: _Instance, sched: Scheduler, chunks: list, ms: float,
               total_rows: int, outputs, now: float) -> int:
        """Stamp the tokens of an iteration that ended at `now` and add it to the timeline.
        Returns the prompt tokens of the requests whose first token this was."""
        max_gap, prefilled = self._stamp(outputs, now)
        decode_rows = list(map(_ROWS, chunks)).count(1)
        t = self.timeline
        t.end_s.append(now)
        t.ms.append(ms)
        t.decode_rows.append(decode_rows)
        t.prefill_rows.append(total_rows - decode_rows)
        t.num_running.append(sched.num_running)
        t.num_waiting.append(sched.num_waiting)
        t.max_tbt_ms.append(max_gap)
        t.instance.append(instance.index)
        return prefilled

    def _stamp(self, outputs, now: float) -> tuple[float, int]:
        """(the longest gap, the prompt tokens of first tokens)."""
        first, last, tbt, worst = self.first, self.last, self.tbt, self.worst
        index_of, add_gap = self.index_of, tbt.append
        max_gap, prefilled = 0.0, 0
        for out in outputs:
            i = index_of[out.request_id]
            previous = last[i]
            if previous == previous:                 # not nan: a gap since the last token
                gap = (now - previous) * 1e3
                add_gap(gap)
                max_gap = gap if gap > max_gap else max_gap
                if not gap <= worst[i]:              # also when worst is still nan
                    worst[i] = gap
            else:
                first[i] = now
                prefilled += out.num_prompt_tokens
            last[i] = now
            if out.finished:
                self.finish[i] = now
        return max_gap, prefilled
