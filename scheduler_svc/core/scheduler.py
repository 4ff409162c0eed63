"""Iteration-level scheduling (ORCA) with chunked prefill piggybacked on decodes
(docs/design.md#iteration-level-scheduling).

Every iteration is decided afresh, in this order:

1. continue the running requests in order of arrival — a decode takes 1 row, a partial prefill
   min(remaining, budget left) rows, leaving the decodes after it theirs — growing their block
   tables; when the pool runs dry the
   running request that arrived last is preempted (blocks freed, recomputed later);
2. if nothing was preempted, admit waiting requests first come, first served while the token
   budget and the sequence cap allow; a prompt longer than the budget left is cut into a chunk
   that rides along with the decodes. One exception (chunked prefill): a short prompt (its
   rows fit one iteration's token budget) does not wait behind a long one; while one waits
   for rows, queued or part-way through its prefill, the long prompts' chunks are sized
   after it, where the pool has room for both; a long prompt whose chunks meet the latency
   budget's floor admits nothing beside it until it is through
   (docs/design.md#short-prompts-beside-long-ones). With prefix caching a request first
   takes the longest run of cached blocks matching its tokens and computes only from there
   (docs/design.md#prefix-caching); blocks are registered in the cache by `update()`, once
   the iteration that filled them is done.

A P/D prefill instance may have a TTFT goal (`ttft_goal.py`): then the requests still
prefilling are ordered by their deadlines before each iteration (running ones too), and every
chunk placed bounds how long the iteration may grow.

With `max_iteration_ms` set, a latency budget also sizes every prefill chunk (continued or
new): the decodes are reserved first and the chunk is cut to what the cost model says still
fits (`latency_budget.py`). ORCA-only mode then limits how many whole prompts join one
iteration instead.

The caller drives it in a strict loop: `plan = schedule()`, run the plan, `update(plan,
result)`, repeat. `update()` advances `num_computed_tokens`, so a second `schedule()` before it
would schedule the same rows twice and is refused. The served loop overlaps: with one plan in
flight, `schedule_ahead()` makes the next as if the first's result were in, and results are
applied in order (docs/design.md#overlap).

Aborts are reported by the next `update()` as `RequestOutput(finished=True,
finish_reason="abort")`; `has_unfinished()` stays true until they have been reported.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import chain, islice

from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.latency_budget import IterationLatency
from scheduler_svc.core.policy import FcfsPolicy
from scheduler_svc.core.request import Request, RequestStatus, stop_status
from scheduler_svc.core.ttft_goal import TtftGoal
from shared.config import AUTO_TTFT_FACTOR, SchedulerConfig
from shared.errors import InvalidRequestError
from shared.outputs import RequestOutput
from shared.plan import (NO_TOKEN, NO_TOKEN_ERRORS, CachedRequestData, IterationPlan,
                         NewRequestData, SampledToken, StepResult)
from shared.sampling import SamplingParams, token_id_set


@dataclass
class _Iteration:
    """What one `schedule()` call has decided so far."""
    token_budget: int
    latency: IterationLatency | None = None
    scheduled: list[tuple[Request, int]] = field(default_factory=list)   # (request, rows)
    samples: list[str] = field(default_factory=list)   # whose chunk reaches their last token
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    num_tokens: int = 0
    ahead: int | None = None    # planned while this step runs: it never preempts
    stalled: bool = False       # ...and stops where it would have had to
    now: float = 0.0            # the clock when it was decided (read only with a TTFT goal)
    # requests the token in flight ends (a plan made ahead): no rows for them
    finishing: frozenset[Request] = frozenset()

    @property
    def budget_left(self) -> int:
        return max(0, self.token_budget - self.num_tokens)

    def add_cached(self, request: Request, rows: int, new_block_ids: list[int]) -> None:
        self.cached_requests.append(
            CachedRequestData(request.request_id, new_block_ids, request.num_computed_tokens))
        self._add(request, rows)

    def add_new(self, request: Request, rows: int) -> None:
        self.new_requests.append(NewRequestData(
            request_id=request.request_id, token_ids=request.all_token_ids,
            num_prompt_tokens=request.num_prompt_tokens, sampling=request.sampling,
            block_table=list(request.block_table),
            num_computed_tokens=request.num_computed_tokens, reply_to=request.reply_to,
            kv_received=request.kv_received or [],
            num_cached_tokens=request.num_cached_prompt_tokens or 0))
        request.kv_received = None
        self._add(request, rows)

    def _add(self, request: Request, rows: int) -> None:
        self.scheduled.append((request, rows))
        self.num_tokens += rows
        if rows == request.num_uncomputed_tokens:
            self.samples.append(request.request_id)


_PLACEHOLDER = -1           # the token a plan in flight samples, while the next is planned
STRETCH_MIN_STREAMS = 4     # the token-gap target's stretch counts at least this many streams
STRETCH_POWER = 2           # ... and is that ratio squared (docs/design.md#the-token-gap-target)
# the rows the first prompt chunk of an iteration may always take, whatever the latency
# budget (so that a prompt always moves), where a GEMM costs by its rows (no widening step):
# a few rows beside the decodes, not a KV block's 16 — over a long prefix each row's
# attention costs more than a decode row, and 16 of them alone were 2-3 decode steps
# (docs/design.md#the-token-gap-target)
MIN_PREFILL_ROWS = 4
# a long prompt's prefill waits for short prompts this many iterations in a row at most, then
# takes its turn first (docs/design.md#short-prompts-beside-long-ones)
MAX_DEFERRALS = 8
# the longest iteration the prompts' TTFT pace may ask for, in multiples of the decodes alone
# (the pace stretches the token-gap target to decodes / (1 - share)): the most a long prompt
# may cost the streams' token gap; prompts that cannot make their goals at that pace miss
# them (10x gave the streams gaps of 8-10x their median beside two long prompts). Where the
# long prompts outnumber the streams (counted as at least STRETCH_MIN_STREAMS) it stretches
# by (prompts / streams) ** STRETCH_POWER, to PACE_MAX_STRETCHED_GAP at most
# (docs/design.md#the-prompts-pace)
PACE_MAX_GAP = 3.0
PACE_MAX_STRETCHED_GAP = 10.0


@dataclass(slots=True)
class _Flight:
    """A plan sent and not yet update()d: its (request, rows), the ids that sample, and
    whether any of its requests stopped running since it was made (then update() skips
    them)."""
    step: int
    scheduled: list[tuple[Request, int]]
    samples: list[str]
    dirty: bool = False


class Scheduler:
    def __init__(self, config: SchedulerConfig,
                 eos_token_ids: tuple[int, ...] | int | None = None,
                 max_model_len: int | None = None, policy: FcfsPolicy | None = None,
                 clock: Callable[[], float] = time.time, vocab_size: int | None = None) -> None:
        """`max_model_len` is the effective context length (the caller takes the smaller of
        the model's and the config's); None means `config.max_model_len`. `vocab_size`: the
        model's embedding rows, every token id of a request must be below it (None: not
        checked). `clock`: seconds,
        read only by a TTFT goal and by the token-gap target's pace (served, Redis's clock, which
        the gateway stamps arrivals with: shared/clock.py)."""
        self.config = config
        self.max_model_len = config.max_model_len if max_model_len is None else max_model_len
        self.eos_token_ids = token_id_set(eos_token_ids)
        self.vocab_size = vocab_size
        self.policy = policy or FcfsPolicy()
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self._caching = config.enable_prefix_caching
        self.num_preemptions_total = 0
        self._requests: dict[str, Request] = {}      # every live (unfinished) request
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []            # in order of arrival (`FcfsPolicy.place_running`)
        self._finished_ids: list[str] = []           # workers drop these with the next plan
        self._preempted_ids: list[str] = []          # ...and these, recomputed later
        self._aborted: list[RequestOutput] = []      # reported by the next update()
        # P/D decode side: blocks held for prompts a prefill instance is computing
        self._reserved: dict[str, Request] = {}
        # requests aborted while plans in flight still run their rows (the workers learn of an
        # abort from a later plan), with the newest such plan's step: their blocks go back to
        # the pool once that plan's result is in, never to a reservation meanwhile, which a
        # prefill instance would write in no order with the plans (docs/design.md#overlap)
        self._free_after: list[tuple[int, Request]] = []
        self._num_arrivals = 0
        self._next_step = 0
        self._probe_step = -2           # the last plan of decodes alone for the cost model
        # a long prompt whose prefill met the latency budget's floor: nothing is admitted
        # beside it until it is through (`_long_prompt_walled`)
        self._walled: Request | None = None
        # plans awaiting update(), oldest first: one, or two once `schedule_ahead()` ran
        self._flights: deque[_Flight] = deque()
        self._sync_next = False       # a plan made ahead stalled: the next one waits
        self.last_latency_budget: IterationLatency | None = None   # the last plan's, if any
        self.clock = clock
        self.ttft_goal = None if config.target_ttft_ms is None and \
            config.target_ttft_factor is None else TtftGoal(
                config.iteration_cost, config.max_num_batched_tokens, config.target_ttft_ms,
                config.target_ttft_factor)
        # the TTFT goal the auto token-gap target keeps long prompts on course for (the
        # prompts' pace; never an order of the queue)
        # (its predictions of a prompt's prefill alone also tell when a long prompt stuck at the
        # latency budget's floor walls the queue off, with a fixed budget too:
        # `_long_prompt_walled`)
        self._long_goal = TtftGoal(config.iteration_cost, config.max_num_batched_tokens,
                                   factor=AUTO_TTFT_FACTOR) \
            if config.iteration_cost is not None and self.ttft_goal is None else None
        self._pace_goal = self._long_goal if config.target_tbt_factor is not None else None

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling: SamplingParams, reply_to: str = "",
                    output_token_ids: list[int] | None = None,
                    arrival_s: float | None = None) -> None:
        """Queue a request; InvalidRequestError if it could never be served as given.

        `output_token_ids`: tokens it already generated elsewhere (a request taken over from
        a scheduler that died); it is recomputed from prompt + those, like a preempted one.
        `arrival_s`: when it arrived by `clock` (default: now).
        """
        self._validate(request_id, prompt_token_ids, sampling)
        request = Request(request_id, list(prompt_token_ids), sampling, self._num_arrivals,
                          output_token_ids=list(output_token_ids or ()), reply_to=reply_to,
                          arrival_s=self.clock() if arrival_s is None else arrival_s)
        self._num_arrivals += 1
        self._requests[request_id] = request
        self.policy.enqueue(self._waiting, request)

    def abort(self, request_id: str) -> None:
        """Stop a request in any state and free its blocks: now, or where plans in flight
        still run its rows, once their results are in. Unknown ids are ignored."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
            self._finished_ids.append(request_id)   # workers hold its state
        elif self._reserved.pop(request_id, None) is not None:
            pass                                    # held blocks only
        else:
            self._waiting.remove(request)           # never sent, or dropped at preemption
        if request.status is RequestStatus.RUNNING and self._flights:
            self._free_after.append((self._flights[-1].step, request))
        else:
            self.block_manager.free(request)
        request.status = RequestStatus.FINISHED_ABORTED
        self._aborted.append(_output(request, []))
        self._left_running()

    # ---- P/D: the decode side (docs/design.md#pd-disaggregation) -------------------------

    def reserve(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                reply_to: str = "") -> list[int] | None:
        """Hold the blocks a prompt's K/V will be written into by a prefill instance, plus
        room for the first decode; its leading blocks this pool's prefix cache holds are
        shared, not written (`reserved_cached_blocks` says how many). Returns the block ids
        (the same ones again for an id already reserved), or None when the pool has no room now, requests already wait here
        (a preempted one must not starve behind new reservations) or max_num_seqs run or are
        on their way. InvalidRequestError if the request could never be served here."""
        held = self._reserved.get(request_id)
        if held is not None:
            return list(held.block_table)
        self._validate(request_id, prompt_token_ids, sampling)
        if self._waiting or self._walled_in():
            return None         # requests already here (preempted ones, say) go first, and
            #                     nothing joins beside a prompt walled in (`_long_prompt_walled`)
        if self._seats_left() <= 0:
            return None
        request = Request(request_id, list(prompt_token_ids), sampling, self._num_arrivals,
                          reply_to=reply_to)
        # the prompt's leading blocks already in this pool's prefix cache are taken, shared,
        # as an admission takes them: only the rest is written by the prefill instance
        cached_prefix = self.block_manager.find_cached_prefix(request)
        request.num_computed_tokens = len(cached_prefix) * self.block_manager.block_size
        if self.block_manager.allocate(request, len(prompt_token_ids) + 1
                                       - request.num_computed_tokens, cached_prefix) is None:
            return None
        self.block_manager.count_admission(request, request.num_computed_tokens)
        self._num_arrivals += 1
        self._requests[request_id] = request
        self._reserved[request_id] = request
        return list(request.block_table)

    def activate(self, request_id: str, first_token_id: int,
                 kv_received: list[str] | None, num_cached_tokens: int = 0,
                 hold: bool = False) -> None:
        """A reserved request handed over with its first token: with `kv_received` (the
        prompt's K/V arrived) it runs on as a decode; without, its K/V did not arrive and it
        is recomputed here from prompt + first token, like a preempted request (`hold`: in
        other blocks, its reserved ones set aside until `block_manager.release_aside`).
        `num_cached_tokens`: what the prefill side's prefix cache held of the prompt."""
        request = self._reserved.pop(request_id)
        request.output_token_ids.append(first_token_id)
        request.num_cached_prompt_tokens = num_cached_tokens
        if kv_received:
            request.num_computed_tokens = request.num_prompt_tokens
            request.kv_received = list(kv_received)
            request.status = RequestStatus.RUNNING
            self.policy.place_running(self._running, request)
            # the workers verified its prompt's K/V in the pool (the caller's check): its
            # full blocks join the prefix cache now, for a prompt sharing them that asks
            # before its first decode's result
            if self._caching:
                self.block_manager.cache_computed_blocks(request)
            return
        self._let_go(request, hold)
        request.num_computed_tokens = 0         # its cached prefix (if any) went with them
        request.status = RequestStatus.PREEMPTED
        self.policy.requeue_preempted(self._waiting, request)

    def cancel_reservation(self, request_id: str, hold: bool = False) -> bool:
        """Free a reservation whose request will not come (its prefill side gave it up);
        `hold`: set its blocks aside until `block_manager.release_aside` instead."""
        request = self._reserved.pop(request_id, None)
        if request is None:
            return False
        self._let_go(request, hold)
        del self._requests[request_id]
        return True

    def _let_go(self, reserved: Request, hold: bool) -> None:
        """A reservation's blocks back to the pool, or, where its prefill instance may still
        be writing into them (a transfer it gave up at its deadline can land later), kept
        from every request until `block_manager.release_aside` (docs/failure-modes.md)."""
        if hold:
            self.block_manager.set_aside(reserved)
        else:
            self.block_manager.free(reserved)

    def _seats_left(self) -> int:
        """How many more requests may run: max_num_seqs less those running and those
        reserved (on a P/D decode instance each reservation becomes a running request when
        its hand-off comes, without asking; a request admitted from the queue into a seat a
        reservation holds would take the instance past max_num_seqs then)."""
        return self.config.max_num_seqs - len(self._running) - len(self._reserved)

    def is_reserved(self, request_id: str) -> bool:
        return request_id in self._reserved

    def reserved_cached_blocks(self, request_id: str) -> int:
        """How many of a reservation's leading blocks came from the prefix cache (no prefill
        instance writes into them)."""
        return self._reserved[request_id].num_cached_blocks

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    def has_schedulable(self) -> bool:
        """Work a plan can carry now: running or waiting requests, or aborts to report
        (reservations wait for their K/V)."""
        return bool(self._running) or bool(self._waiting) or bool(self._aborted)

    def recompute_running(self) -> list[str]:
        """The workers lost their KV cache (a worker died): forget the plan in flight and send
        every running request back to the waiting queue, ahead of those that arrived after it,
        to be recomputed from its prompt plus the tokens it generated (preemption, for all of
        them at once). The prefix cache is emptied too: no block's content is known any more.
        Returns their ids in the running order."""
        self._flights.clear()
        self._free_aborted(self._next_step)     # no plan runs any more
        self._sync_next = False
        lost, self._running = self._running, []
        for request in reversed(lost):       # each goes back by its arrival
            self.block_manager.free(request)
            request.num_computed_tokens = 0
            request.kv_received = None
            request.status = RequestStatus.PREEMPTED
            self.policy.requeue_preempted(self._waiting, request)
        self.block_manager.reset_prefix_cache()
        lost_ids = [r.request_id for r in lost]
        self._preempted_ids.extend(lost_ids)  # a worker that survived drops their state
        return lost_ids

    def take_aborted(self) -> list[RequestOutput]:
        """The aborts to report while no plan can carry them (the worker group is lost and
        nothing runs: `recompute_running`); their blocks are free already, and the ids the
        workers must forget ride on the next plan."""
        self._require_updated()
        outputs, self._aborted = self._aborted, []
        return outputs

    def get_request(self, request_id: str) -> Request | None:
        """The live request with this id, or None once it finished or was never added."""
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        """Live requests, or aborts not yet reported. Ids the workers must still forget ride
        on the next plan, whenever one is made."""
        return bool(self._requests) or bool(self._aborted)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # ---- one iteration -------------------------------------------------------------------

    def schedule(self) -> IterationPlan:
        """Decide the next iteration. An empty plan still carries the ids to drop."""
        self._require_updated()
        return self._emit_plan(self._decide(ahead=None))

    def can_schedule_ahead(self) -> bool:
        """Whether `schedule_ahead()` may run now: exactly one plan in flight, and the last
        plan made ahead did not stall for want of blocks (then the next one waits for the
        results, so that it can preempt)."""
        return len(self._flights) == 1 and not self._sync_next

    def schedule_ahead(self) -> IterationPlan:
        """Decide the iteration after the one in flight, before its result is in
        (docs/design.md#overlap): every request of the plan in flight is taken to have
        computed its rows and, where it samples, to have drawn one more token that stops
        nothing. Requests that the token will certainly end (max_tokens, the context length)
        get no rows; one that an EOS or stop token ends gets a row the workers skip and
        `update()` drops. It never preempts: where it would have to, it stops, and the next
        plan is made with the results in (`can_schedule_ahead()` is then False)."""
        if not self.can_schedule_ahead():
            raise RuntimeError("schedule_ahead() needs exactly one plan in flight and no "
                               "stalled plan before it")
        flight = self._flights[0]
        assumed = self._assume_done(flight)
        try:
            iteration = self._decide(ahead=flight.step, finishing=assumed[1])
        finally:
            self._undo_assumed(assumed[0])
        return self._emit_plan(iteration)

    def _decide(self, ahead: int | None,
                finishing: frozenset[Request] = frozenset()) -> _Iteration:
        self.last_latency_budget = self._latency_budget()
        iteration = _Iteration(self.config.max_num_batched_tokens, self.last_latency_budget,
                               ahead=ahead, finishing=finishing)
        if self.ttft_goal is not None:
            self._decide_by_deadline(iteration)
            return iteration
        walled = self._long_prompt_walled(iteration)
        short_waits = not walled and self._short_prompt_waits()
        deferred = self._continue_running(iteration, short_waits)
        if short_waits and not iteration.preempted_ids and not iteration.stalled:
            self._admit_short(iteration)
        if deferred:
            for request in deferred:
                self._continue_deferred(request, iteration)
            if not iteration.scheduled and not iteration.stalled:
                # nothing could move (no free block for anyone): the deferred prompts take
                # their blocks as before, preempting; nobody is in the iteration yet
                for request in deferred:
                    request.num_deferred = 0
                    if request.status is RequestStatus.RUNNING and not self._continue_one(
                            request, self._running.index(request), iteration):
                        break
        if not walled and not iteration.preempted_ids and not iteration.stalled:
            self._admit_waiting(iteration)
        return iteration

    def _decide_by_deadline(self, iteration: _Iteration) -> None:
        """With a TTFT goal (`ttft_goal.py`): running prefills and waiting prompts in one
        order of urgency, each placed while the budgets allow. Both lists are kept sorted by
        it, so the last running is the least urgent (preemption takes it first) and the head of
        the queue the most urgent waiting one (nobody overtakes it)."""
        iteration.now = now = self.clock()
        finishing = iteration.finishing
        key = self.ttft_goal.priority
        keys = {r: key(r, now) for r in (*self._running, *self._waiting)}
        self._running.sort(key=keys.__getitem__)
        self._waiting = deque(sorted(self._waiting, key=keys.__getitem__))
        waiting = set(self._waiting)
        admitting, placed = True, 0     # running[:placed]: decided this iteration
        for request in sorted(keys, key=keys.__getitem__):      # stable: running first on ties
            if iteration.budget_left == 0:
                return
            if request in waiting:
                head = self._waiting[0]
                admitting = admitting and not iteration.preempted_ids and \
                    not iteration.stalled and self._admit(head, iteration)
                if admitting:   # it goes among the more urgent ones, ahead of the rest
                    self._running.remove(head)
                    self._running.insert(placed, head)
                    placed += 1
            elif request.status is RequestStatus.RUNNING:   # not preempted meanwhile
                if request not in finishing and \
                        not self._continue_one(request, placed, iteration):
                    return
                placed += 1

    def _assume_done(self, flight: _Flight) -> tuple[list[tuple[Request, int, bool]],
                                                      frozenset[Request]]:
        """Advance the requests of the plan in flight as if its result were in, with a
        placeholder for each token it samples; returns what to undo, and the requests that
        token would end whatever it is."""
        done, finishing = [], []
        running, max_model_len = RequestStatus.RUNNING, self.max_model_len
        for request, rows in flight.scheduled:
            if request.status is not running:
                continue            # aborted since: no longer in the running list
            samples = rows == request.num_uncomputed_tokens
            request.num_computed_tokens += rows
            if samples:
                request.output_token_ids.append(_PLACEHOLDER)
                if len(request.output_token_ids) >= request.sampling.max_tokens \
                        or request.num_tokens >= max_model_len:
                    finishing.append(request)
            done.append((request, rows, samples))
        return done, frozenset(finishing)

    @staticmethod
    def _undo_assumed(done: list[tuple[Request, int, bool]]) -> None:
        for request, rows, samples in done:
            request.num_computed_tokens -= rows
            if samples:
                request.output_token_ids.pop()

    def update(self, plan: IterationPlan, result: StepResult) -> list[RequestOutput]:
        """Apply what the workers did with `plan`: advance computed tokens, append sampled
        tokens, apply stop conditions. Returns one output per request that got a token or
        finished (pending aborts first)."""
        flight = self._flight_for(plan, result)
        if flight is None:          # an empty plan: only aborts to report
            outputs, self._aborted = self._aborted, []
            return outputs
        scheduled = flight.scheduled
        # A scheduled request is running unless it was aborted (its abort waits in `_aborted`
        # to be reported) or, for a plan made ahead, stopped by the result before this one
        # (identity, not is_finished: this runs for every row of every iteration).
        running = RequestStatus.RUNNING
        live = scheduled if not flight.dirty else \
            [(request, rows) for request, rows in scheduled if request.status is running]
        _check_sampled(plan.step, scheduled, live, flight.samples, result)
        self._observe_cost(live, result)
        self._flights.popleft()
        if self._free_after:        # this plan and every one before it have run
            self._free_aborted(plan.step)
        outputs, self._aborted = self._aborted, []
        block_size = self.block_manager.block_size
        caching, sampled, max_model_len = self._caching, result.sampled, self.max_model_len
        eos_token_ids, add_output = self.eos_token_ids, outputs.append
        goal = self.ttft_goal
        now = self.clock() if goal is not None else 0.0
        for request, rows in live:
            computed = request.num_computed_tokens = request.num_computed_tokens + rows
            # a block just filled (K/V of all its tokens now computed) joins the prefix cache
            if caching and computed >= (request.num_cached_blocks + 1) * block_size:
                self.block_manager.cache_computed_blocks(request)
            output_ids = request.output_token_ids
            num_prompt = len(request.prompt_token_ids)
            if num_prompt + len(output_ids) != computed:
                continue                # a prompt chunk short of the end samples nothing
            # the sampled token appended; the common case (it stops nothing) inline: one per
            # request per iteration comes through here
            token = sampled[request.request_id]
            token_id = token.token_id
            if token_id < 0:            # no token (shared/plan.NO_TOKEN_ERRORS says why)
                add_output(self._fail(request, NO_TOKEN_ERRORS.get(token_id,
                                                                   NO_TOKEN_ERRORS[NO_TOKEN])))
                continue
            output_ids.append(token_id)
            sampling = request.sampling
            num_output = len(output_ids)
            if goal is not None and num_output == 1:
                goal.first_token(request, now)
            if num_output < sampling.max_tokens and num_prompt + num_output < max_model_len \
                    and token_id not in sampling.stop_token_ids \
                    and (sampling.ignore_eos or token_id not in eos_token_ids):
                add_output(RequestOutput(request.request_id, [token], False, None, num_prompt,
                                         num_output))
            else:
                add_output(self._stop(request, token))
        return outputs

    def samples_in_flight(self) -> list[str]:
        """The requests of the oldest plan in flight whose chunk reaches the end of their
        tokens: those the workers sample a token for (a simulator's stand-in for them asks)."""
        return list(self._flights[0].samples) if self._flights else []

    # ---- scheduling steps ----------------------------------------------------------------

    def _observe_cost(self, scheduled: list[tuple[Request, int]], result: StepResult) -> None:
        """Feed the measured forward time to a cost model that learns (shared/online_cost.py)."""
        observe = getattr(self.config.iteration_cost, "observe", None)
        # rows scored for their prompt log-probabilities run the LM head each: a shape the
        # fit has no term for, kept out of it rather than bending it
        scoring = any(r.sampling.prompt_logprobs is not None and r.num_computed_tokens <
                      r.num_prompt_tokens for r, _ in scheduled)
        if observe is not None and result.forward_ms is not None and scheduled and not scoring:
            observe([(rows, r.num_computed_tokens + rows) for r, rows in scheduled],
                    result.forward_ms, result.wide_from_rows)

    def _latency_budget(self) -> IterationLatency | None:
        """This iteration's time budget: `max_iteration_ms` always; the token-gap target only
        while decodes run (else no one waits between tokens and prefill takes the whole token
        budget); None: the token budget alone."""
        config, cost = self.config, self.config.iteration_cost
        if cost is None:
            return None
        # Every decode is reserved up front, so a prefill earlier in the running list cannot
        # take the time of a decode later in it (their tokens: `_chunk_rows`).
        decodes = [(1, r.num_tokens) for r in self._running if self._rows_wanted(r) == 1]
        budget_ms = None
        if config.max_iteration_ms is not None:
            budget_ms = config.max_iteration_ms
        elif not decodes:
            pass
        elif config.target_tbt_ms is not None:
            budget_ms = config.target_tbt_ms
        elif config.target_tbt_factor is not None:
            probe = getattr(cost, "decode_probe_due", None)
            if probe is not None and probe() and self._prefill_waits() and \
                    self._next_step > self._probe_step + 1:     # not one planned ahead
                # this once the decodes alone, so that the cost model measures their price
                # (the unit of the target and of the prompts' pace); the prompts wait
                self._probe_step = self._next_step
                return IterationLatency(cost, 0.0, 0, decodes)
            # a multiple of the decodes alone (the best-measured shape there is: steady, where
            # a fit of the mixed shapes swings), and at least the cheapest iteration that
            # moves a waiting prompt, the decodes and the rows a prompt may always take; where
            # the GEMMs widen their weights from some row count on (a cost per iteration
            # however few the rows), at least one fewer times the decodes and a block, so that
            # each widening moves factor - 1 blocks' worth of time
            factor, rows = config.target_tbt_factor, self._min_prefill_rows()
            floor = factor - 1 if self._widens() else 1.0
            decodes_ms = cost.iteration_ms(decodes)
            budget_ms = max(factor * decodes_ms,
                            floor * cost.iteration_ms(decodes + [(rows, rows)]))
            # Prompts waiting for their first token, those whose whole prompt fits one
            # iteration's tokens, stretch it by ((streams + prompts) / streams) squared,
            # streams counted as at least a few: a longer iteration delays each running
            # stream once but brings every waiting prompt's first token nearer, and a burst
            # admitted faster decodes in fuller iterations (docs/design.md#the-token-gap-target).
            # Of the queue, the first max_num_seqs at most: no iteration admits more, and a
            # long queue costs this per-iteration count nothing more.
            # None while a long prompt is walled in: they wait for it whatever the budget
            waiting = () if self._walled is not None else \
                islice(self._waiting, config.max_num_seqs)
            prompts = sum(1 for r in chain(waiting, self._running)
                          if r.num_tokens <= config.max_num_batched_tokens
                          and r.num_tokens - r.num_computed_tokens > 1)
            streams = len(decodes)
            budget_ms *= max(1.0, (streams + prompts)
                             / max(streams, STRETCH_MIN_STREAMS)) ** STRETCH_POWER
            if self._pace_goal is not None and (times := self._prefill_pace(streams)):
                budget_ms = max(budget_ms, times * decodes_ms)
        if budget_ms is None and self.ttft_goal is None:
            return None         # a TTFT goal bounds the iteration as its prefills are placed
        return IterationLatency(cost, budget_ms, self._min_prefill_rows(), decodes)

    def _prefill_waits(self) -> bool:
        """Whether a prompt would get rows in this iteration but for the decodes' probe."""
        return bool(self._waiting) and self._seats_left() > 0 or any(
            self._rows_wanted(r) > 1 for r in self._running)

    def _prefill_pace(self, streams: int) -> float:
        """How many times the decodes alone an iteration may take to keep the long prompts on
        course for their TTFT goals (docs/design.md#the-prompts-pace); 0: the target as it
        is. Every iteration from now on needs a share U of its time for prefill: beside
        decodes of D ms, it may take D / (1 - U), PACE_MAX_GAP x D at most (stretched where
        the long prompts outnumber the `streams`). The prompts counted are those longer than
        the token budget (shorter ones stretch the target instead), being prefilled or in
        the queue where a free place could take them: prompts that wait for a place wait for
        the streams to end, which longer iterations would only delay, and a prompt's goal
        counts from when a place was first free for it (`Request.place_s`; its arrival if it
        never waited for one). In the order they get rows, each prompt's deadline must hold
        its own prefill alone and that of every prompt before it: the largest such sum over
        the time left is U. The first prompt past its deadline, or out of reach of it, asks
        for the most; one further back asks for nothing: what it waits for is the prompts
        before it, and a longer iteration would go to them."""
        goal, now = self._pace_goal, self.clock()
        longer = self.config.max_num_batched_tokens
        placed = list(islice(self._waiting, max(self._seats_left(), 0)))
        for request in placed:           # queued prompts a free place could take now
            if request.place_s is None:
                request.place_s = now
        prompts = [r for r in chain(self._running, placed)
                   if not r.output_token_ids and r.num_prompt_tokens > longer
                   and r.num_computed_tokens < r.num_prompt_tokens]
        if not prompts:
            return 0.0
        # the iterations are the prompts' where they outnumber the streams, and few pay
        most = min(PACE_MAX_STRETCHED_GAP, PACE_MAX_GAP * max(
            1.0, len(prompts) / max(streams, STRETCH_MIN_STREAMS)) ** STRETCH_POWER)
        share = work = 0.0
        for index, request in enumerate(prompts):
            work += goal.prefill_ms(request.num_computed_tokens, request.num_prompt_tokens)
            left = (goal.deadline(request, request.place_s) - now) * 1e3
            if left > work:
                share = max(share, work / left)
            elif index == 0:
                return most
            if share >= 1.0 - 1.0 / most:
                return most              # no prompt further back can ask for more
        return 1.0 / (1.0 - share) if share else 0.0

    def _min_prefill_rows(self) -> int:
        """What the first prompt chunk of an iteration may always take: MIN_PREFILL_ROWS, or a
        whole KV block where the GEMMs widen their weights from some row count (a widening
        paid for a few rows is the dearest iteration there is)."""
        block = self.config.block_size
        return block if self._widens() else min(block, MIN_PREFILL_ROWS)

    def _widens(self) -> bool:
        """Whether the cost model knows of a row count from which the GEMMs widen."""
        return getattr(self.config.iteration_cost, "wide_from_rows", None) is not None

    def _continue_running(self, iteration: _Iteration,
                          defer_long: bool = False) -> list[Request]:
        """Rows for the running requests, in order of arrival; with `defer_long`, the
        prefills longer than the token budget are left out and returned, for
        `_continue_deferred` once the short prompts are in."""
        deferred: list[Request] = []
        running, finishing = self._running, iteration.finishing
        max_model_len = self.max_model_len
        block_size = self.block_manager.block_size
        budget = iteration.token_budget
        add_cached, add_scheduled = iteration.cached_requests.append, iteration.scheduled.append
        add_sample, allocate = iteration.samples.append, self.block_manager.allocate
        index, num_tokens_so_far = 0, iteration.num_tokens    # written back before the calls
        while index < len(running) and num_tokens_so_far < budget:   # budget left
            # The common case, spelled out (this runs for every decode of every iteration): a
            # run of decodes already known to the workers, each with room left in its last
            # block or a free block to take, one row each, as many as the budget has rows.
            # It is what the general path below does for them, without the calls; with no
            # block free, that path preempts.
            decodes_from = num_tokens_so_far
            for request in islice(running, index, index + budget - num_tokens_so_far):
                computed = request.num_computed_tokens
                num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
                if num_tokens - computed != 1 or num_tokens > max_model_len \
                        or request.kv_received is not None \
                        or finishing and request in finishing \
                        or (new_block_ids := [] if computed < len(request.block_table) * block_size
                            else allocate(request, 1)) is None:
                    break
                request_id = request.request_id
                add_cached(CachedRequestData(request_id, new_block_ids, computed))
                add_scheduled((request, 1))
                add_sample(request_id)
                num_tokens_so_far += 1
            index += num_tokens_so_far - decodes_from
            if index == len(running) or num_tokens_so_far >= budget:
                break
            request = running[index]
            if finishing and request in finishing:
                index += 1      # the token in flight ends it: nothing to plan
                continue
            if defer_long and request.num_deferred < MAX_DEFERRALS \
                    and self._rows_wanted(request) > budget and request.kv_received is None:
                deferred.append(request)
                index += 1
                continue
            request.num_deferred = 0    # its turn first, this once, or no short prompt waits
            iteration.num_tokens = num_tokens_so_far
            if not self._continue_one(request, index, iteration):
                return deferred  # it preempted itself (the last one running), or stalled
            num_tokens_so_far = iteration.num_tokens
            index += 1
        iteration.num_tokens = num_tokens_so_far
        return deferred

    def _continue_one(self, request: Request, index: int, iteration: _Iteration) -> bool:
        """Rows for running[index] (`request`), if the budgets leave any; False when it
        preempted itself (the last one running) or stalled: the iteration stops there."""
        rows = self._chunk_rows(request, iteration, index)
        if rows == 0:
            return True         # its prefill waits for an iteration with time to spare
        new_block_ids = self._allocate_or_preempt(request, rows, index, iteration)
        if new_block_ids is None:
            return False
        self._add_chunk(request, rows, new_block_ids, iteration)
        return True

    def _continue_deferred(self, request: Request, iteration: _Iteration) -> None:
        """A long prompt's chunk, placed after the short prompts admitted past it: what the
        budgets and the free blocks leave (it never preempts: the requests it would take
        blocks from may be in this iteration already); no rows, and it waits, if none."""
        free_rows = (len(request.block_table) + self.block_manager.num_free_blocks) \
            * self.block_manager.block_size - request.num_computed_tokens
        rows = min(self._chunk_rows(request, iteration), free_rows)
        if rows <= 0 or (new_block_ids := self.block_manager.allocate(request, rows)) is None:
            request.num_deferred += 1
            return
        request.num_deferred = 0
        self._add_chunk(request, rows, new_block_ids, iteration)

    def _chunk_rows(self, request: Request, iteration: _Iteration, index: int | None = None
                    ) -> int:
        """Rows of a running request this iteration: a decode's one, or a prefill chunk cut
        to the token budget left and to the latency budget (placed there by `_add_chunk`,
        once its blocks are in hand). A chunk of running[index] leaves the decodes after it
        in the running list their tokens, as the latency budget leaves them their time, but
        for the rows a prompt may always take (a token budget below the decodes' count would
        stop it): a short prompt let in past a long one decodes after it, and waited for
        the whole prefill."""
        wanted = self._rows_wanted(request)
        if wanted == 1:
            return 1            # a decode; the caller checked that budget is left
        left = rows = iteration.budget_left
        if index is not None:
            finishing = iteration.finishing
            decodes = sum(1 for r in islice(self._running, index + 1, None)
                          if self._rows_wanted(r) == 1 and r not in finishing)
            rows = max(left - decodes, min(left, self._min_prefill_rows()))
        rows = min(wanted, rows)
        if iteration.latency is not None:   # decodes were reserved already
            rows = iteration.latency.prefill_rows(rows, request.num_computed_tokens)
        return rows

    def _add_chunk(self, request: Request, rows: int, new_block_ids: list[int],
                   iteration: _Iteration) -> None:
        """A running request's rows, their blocks allocated, join the iteration (a prefill
        chunk its latency budget too)."""
        if iteration.latency is not None and self._rows_wanted(request) > 1:
            self._place_prefill(iteration, request, rows)
        if request.kv_received is not None:
            iteration.add_new(request, rows)    # handed over: new to the workers
        else:
            iteration.add_cached(request, rows, new_block_ids)

    def _place_prefill(self, iteration: _Iteration, request: Request, rows: int) -> None:
        """A prefill chunk joins the iteration's latency budget; with a TTFT goal, it also
        bounds how long the iteration may grow."""
        latency = iteration.latency
        latency.add_prefill(rows, request.num_computed_tokens)
        if self.ttft_goal is not None:
            latency.tighten(self.ttft_goal.iteration_limit_ms(request, rows, iteration.now))

    def _allocate_or_preempt(self, request: Request, rows: int, index: int,
                             iteration: _Iteration) -> list[int] | None:
        """Blocks for `rows` more rows of running[index], preempting until they fit (a plan
        made ahead stalls instead: None)."""
        while (new_block_ids := self.block_manager.allocate(request, rows)) is None:
            if iteration.ahead is not None:
                iteration.stalled = True
                return None
            # Only requests not yet scheduled this iteration may lose their blocks.
            victim = self.policy.pick_victim(self._running[index:])
            self._preempt(victim, iteration)
            if victim is request:
                return None
        return new_block_ids

    def _preempt(self, victim: Request, iteration: _Iteration) -> None:
        """Recompute, not swap: drop the KV and start over with prompt + generated tokens."""
        self._running.remove(victim)
        self.block_manager.free(victim)
        victim.num_computed_tokens = 0
        victim.kv_received = None
        victim.status = RequestStatus.PREEMPTED
        self.policy.requeue_preempted(self._waiting, victim)
        iteration.preempted_ids.append(victim.request_id)
        self.num_preemptions_total += 1
        self._left_running()

    def _long_prompt_walled(self, iteration: _Iteration) -> bool:
        """Whether a long prompt being prefilled is stuck: its chunks at the latency budget's
        floor (the decodes alone fill the budget, as they come to over a long cached prefix,
        where each chunk reads all of it), at a pace that would take more than
        MAX_DEFERRALS + 1 times its prefill alone (the most short prompts may slow it by
        their turns, too). From then on nothing is admitted beside it, short or not, until it
        is through (`_walled`): every stream admitted would slow it further, for as long as
        that stream lasts, and it waits for the streams to thin out, first come, first served.
        Lifted as soon as the floor was, the short prompts let in at once brought it straight
        back: a 100k-token prompt beside 4 requests/s of short ones on an H100 crawled four
        rows an iteration for a minute, at 40 times its pace alone
        (docs/design.md#short-prompts-beside-long-ones). Raised only while requests wait
        (with nobody waiting there is nobody to hold back); a P/D decode instance takes no
        handed-over stream while one stands (`reserve`)."""
        if self._walled_in():
            return True
        latency, alone = iteration.latency, self._long_goal
        if latency is None or alone is None or not self._waiting or \
                not self.config.enable_chunked_prefill:
            return False        # (with nobody waiting, nobody to hold back)
        budget = self.config.max_num_batched_tokens
        for request in self._running:
            if (wanted := self._rows_wanted(request)) > budget and (ms := latency.floor_pace_ms(
                    wanted, computed := request.num_computed_tokens)) is not None and \
                    ms > (MAX_DEFERRALS + 1) * alone.prefill_ms(computed, computed + wanted):
                self._walled = request
                return True
        return False

    def _walled_in(self) -> bool:
        """Whether the prompt `_long_prompt_walled` walled in is still being prefilled."""
        walled = self._walled
        if walled is not None and (walled.status is not RequestStatus.RUNNING
                                   or self._rows_wanted(walled) <= 1):
            self._walled = walled = None
        return walled is not None

    def _short_prompt_waits(self) -> bool:
        """Whether a short prompt (its rows fit one iteration's token budget) waits for rows:
        part-way through its prefill, or queued where it may go first (`_queued_shorts`).
        Then the long prompts' chunks wait for it within the iteration (chunked prefill,
        FCFS scheduling); first come, first served alone left it waiting until every prompt
        admitted before it was prefilled (docs/design.md#short-prompts-beside-long-ones)."""
        if not self.config.enable_chunked_prefill:
            return False
        budget = self.config.max_num_batched_tokens
        if any(1 < self._rows_wanted(r) <= budget for r in self._running):
            return True
        return bool(self._waiting) and self._seats_left() > 0 and \
            next(self._queued_shorts(), None) is not None

    def _queued_shorts(self) -> Iterator[tuple[Request, list[Request]]]:
        """The short prompts of the queue's first max_num_seqs that may go before the long
        ones queued ahead of them, in order, each with the long ones it passes. It stops at
        a long one passed MAX_DEFERRALS times in a row (its turn: first come, first served)
        and at a short one the pool has no room for beside the rest of every long prompt it
        would go before, running or queued: else the short ones would take the blocks a long
        one needs, and the decodes beside it would preempt one another until it is through."""
        longest, queued = self.config.max_num_batched_tokens, []
        blocks = self.block_manager
        claimed = sum(blocks.blocks_needed(r.num_computed_tokens + wanted) - len(r.block_table)
                      for r in self._running if (wanted := self._rows_wanted(r)) > longest)
        for request in list(islice(self._waiting, self.config.max_num_seqs)):
            wanted = self._rows_wanted(request)
            if wanted > longest:
                if request.num_deferred >= MAX_DEFERRALS:
                    return
                queued.append(request)
                claimed += blocks.blocks_needed(wanted) - len(blocks.find_cached_prefix(request))
            elif blocks.num_free_blocks - blocks.blocks_needed(wanted) < claimed:
                return
            else:
                yield request, queued

    def _admit_short(self, iteration: _Iteration) -> None:
        """Admit the short prompts `_queued_shorts` lets go first, while the budgets, the
        sequence cap and the pool allow."""
        passed = set()
        for request, queued in self._queued_shorts():
            if not self._admit(request, iteration):
                break
            passed.update(queued)
        for request in passed:
            request.num_deferred += 1

    def _admit_waiting(self, iteration: _Iteration) -> None:
        while self._waiting and self._admit(self._waiting[0], iteration):
            pass                # FCFS (short prompts went first already: `_admit_short`)

    def _admit(self, request: Request, iteration: _Iteration) -> bool:
        """Admit `request`, from the waiting queue, if the budgets, the sequence cap and the
        pool allow; False if not."""
        if self._seats_left() <= 0:
            return False
        cached_prefix = self.block_manager.find_cached_prefix(request)
        num_cached_tokens = len(cached_prefix) * self.block_manager.block_size
        request.num_computed_tokens = num_cached_tokens
        rows = self._admission_rows(request, iteration)
        if rows == 0 or self.block_manager.allocate(request, rows, cached_prefix) is None:
            request.num_computed_tokens = 0
            return False
        if iteration.latency is not None:    # placed once its blocks are in hand
            self._place_prefill(iteration, request, rows)
        request.num_deferred = 0
        self.block_manager.count_admission(request, num_cached_tokens)
        if request.num_cached_prompt_tokens is None:
            request.num_cached_prompt_tokens = min(num_cached_tokens, request.num_prompt_tokens)
        if self._waiting[0] is request:
            self._waiting.popleft()
        else:
            self._waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self.policy.place_running(self._running, request)
        iteration.add_new(request, rows)
        return True

    def _admission_rows(self, request: Request, iteration: _Iteration) -> int:
        rows = self._admission_rows_by_tokens(request, iteration)
        latency = iteration.latency
        if rows == 0 or latency is None:
            return rows
        prefix = request.num_computed_tokens
        if self.config.enable_chunked_prefill:
            rows = latency.prefill_rows(rows, prefix)
        elif not latency.whole_prefill_fits(rows, prefix):
            rows = 0
        return rows

    def _admission_rows_by_tokens(self, request: Request, iteration: _Iteration) -> int:
        wanted = self._rows_wanted(request)
        if self.config.enable_chunked_prefill:
            return min(wanted, iteration.budget_left)
        if wanted <= iteration.budget_left:
            return wanted
        # ORCA-only mode never splits a prompt. One longer than the whole budget could never
        # fit, so it goes whole as the iteration's only admission (the decodes still ride).
        if wanted > iteration.token_budget and not iteration.new_requests:
            return wanted
        return 0

    def _rows_wanted(self, request: Request) -> int:
        num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)  # hot path
        return min(num_tokens, self.max_model_len) - request.num_computed_tokens

    def _emit_plan(self, iteration: _Iteration) -> IterationPlan:
        plan = IterationPlan(
            step=self._next_step,
            new_requests=iteration.new_requests,
            cached_requests=iteration.cached_requests,
            num_scheduled_tokens={r.request_id: rows for r, rows in iteration.scheduled},
            finished_request_ids=self._finished_ids,
            preempted_request_ids=self._preempted_ids + iteration.preempted_ids,
            after_step=iteration.ahead)
        self._finished_ids, self._preempted_ids = [], []
        if iteration.scheduled:     # an empty plan has nothing for update() to apply
            self._flights.append(_Flight(plan.step, iteration.scheduled, iteration.samples))
        self._sync_next = iteration.stalled
        self._next_step += 1
        return plan

    # ---- bookkeeping ---------------------------------------------------------------------

    def _require_updated(self) -> None:
        if self._flights:
            raise RuntimeError(f"plan {self._flights[0].step} has not been update()d; "
                               "call update(plan, result) before the next schedule()")

    def _flight_for(self, plan: IterationPlan, result: StepResult) -> _Flight | None:
        if result.step != plan.step:
            raise ValueError(f"result of step {result.step} given for plan {plan.step}")
        flight = self._flights[0] if self._flights else None
        if flight is not None and flight.step == plan.step:
            return flight
        if plan.is_empty:
            if result.sampled:
                raise ValueError(f"step {plan.step}: expected sampled tokens for [], got "
                                 f"{sorted(result.sampled)}")
            return None
        waiting_for = None if flight is None else flight.step
        raise ValueError(f"update() got plan {plan.step}, but the plan awaiting its result "
                         f"is {waiting_for}")

    def _free_aborted(self, step: int) -> None:
        """Free the blocks of aborted requests whose plans in flight ran up to `step`."""
        keep = []
        for after, request in self._free_after:
            if after <= step:
                self.block_manager.free(request)
            else:
                keep.append((after, request))
        self._free_after = keep

    def _left_running(self) -> None:
        """A request stopped running: plans in flight that carry it must skip it."""
        for flight in self._flights:
            flight.dirty = True

    def _stop(self, request: Request, token: SampledToken) -> RequestOutput:
        """The token just appended ended the request, or will not: `stop_status` decides (the
        update loop tests its conditions inline first)."""
        status = stop_status(request, self.eos_token_ids, self.max_model_len)
        if status is None:
            return RequestOutput(request.request_id, [token], False, None,
                                 len(request.prompt_token_ids), len(request.output_token_ids))
        self._finish(request, status)
        return _output(request, [token])

    def _fail(self, request: Request, error: str) -> RequestOutput:
        """The request ends with an error its workers found (no token could be sampled)."""
        self._finish(request, RequestStatus.FINISHED_ERROR)
        output = _output(request, [])
        output.error = error
        return output

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self._running.remove(request)
        self.block_manager.free(request)
        del self._requests[request.request_id]
        self._finished_ids.append(request.request_id)
        self._left_running()

    def _validate(self, request_id: str, prompt_token_ids: list[int],
                  sampling: SamplingParams) -> None:
        # an aborted request keeps its id until plans in flight let go of its blocks: the
        # pool books blocks by request id, and a second holder of one id crashed the core
        if request_id in self._requests or any(r.request_id == request_id
                                               for _, r in self._free_after):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise InvalidRequestError(f"request {request_id!r} has an empty prompt")
        if num_prompt >= self.max_model_len:
            raise InvalidRequestError(
                f"request {request_id!r}: prompt of {num_prompt} tokens leaves no room to "
                f"generate within the model's context of {self.max_model_len} tokens")
        self._check_vocabulary(request_id, prompt_token_ids, sampling)
        longest = min(num_prompt + sampling.max_tokens, self.max_model_len)
        blocks = self.block_manager.blocks_needed(longest)
        if blocks > self.block_manager.num_total_blocks:
            raise InvalidRequestError(
                f"request {request_id!r}: {longest} tokens (prompt {num_prompt} + max_tokens "
                f"{sampling.max_tokens}) need {blocks} KV blocks, but the whole pool has "
                f"{self.block_manager.num_total_blocks}; lower max_tokens or add KV memory")

    def _check_vocabulary(self, request_id: str, prompt_token_ids: list[int],
                          sampling: SamplingParams) -> None:
        """Every id the workers index a table with must be a row of it: a request written
        into the stream by hand, unchecked by a gateway, took the worker group down with an
        IndexError each time it ran (stop_token_ids are only compared, never looked up)."""
        if self.vocab_size is None:
            return
        for param, ids in (("prompt_token_ids", prompt_token_ids),
                           ("allowed_token_ids", sampling.allowed_token_ids),
                           ("logit_bias", [t for t, _ in sampling.logit_bias]),
                           ("bad_words_token_ids",
                            [t for seq in sampling.bad_words_token_ids for t in seq])):
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(f"request {request_id!r}: {param}: token id {bad} "
                                          f"is outside the vocabulary [0, {self.vocab_size})")


def _output(request: Request, new_tokens: list[SampledToken]) -> RequestOutput:
    return RequestOutput(
        request_id=request.request_id, new_tokens=new_tokens,
        finished=request.status.is_finished, finish_reason=request.status.finish_reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        num_cached_tokens=request.num_cached_prompt_tokens or 0)


def _check_sampled(step: int, scheduled: list[tuple[Request, int]],
                   live: list[tuple[Request, int]], samples: list[str],
                   result: StepResult) -> None:
    """The workers must sample exactly the requests whose chunk reached their last token
    (aborted ones may or may not have a token; it is dropped). `samples`: those ids, as
    `schedule()` found them; with no abort since, nothing has changed them."""
    sampled = result.sampled
    if live is scheduled and len(sampled) == len(samples) and \
            all(map(sampled.__contains__, samples)):
        return
    expected = {r.request_id for r, rows in live if rows == r.num_uncomputed_tokens}
    got = set(result.sampled)
    if len(live) < len(scheduled):
        got -= {r.request_id for r, _ in scheduled if r.status.is_finished}
    if got != expected:
        raise ValueError(f"step {step}: expected sampled tokens for {sorted(expected)}, "
                         f"got {sorted(got)}")
