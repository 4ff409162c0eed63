"""The prefill scheduler's TTFT goal (docs/design.md#the-ttft-goal): which waiting prompt goes
first, how long an iteration may grow, and whether each prompt's first token came in time.

Every prompt has a deadline: its arrival plus the goal — `target_ms`, or with `factor`
(`--target-ttft-ms auto`) `factor` × what the cost model predicts for its whole prompt alone,
plus one full-budget iteration (the one it may find in flight when it arrives, which nobody
can shorten). Prompts still to prefill are ordered in three classes:

    0  starving: past its deadline by more than its own goal — first, so nothing waits for
       ever (earliest deadline first among them)
    1  can still make it: what is left of its prompt, alone, ends before its deadline —
       earliest deadline first (optimal for deadlines on one machine that can switch
       between jobs, as chunked prefill can at every chunk)
    2  will miss anyway — after those that can still make it, earliest deadline first

Each chunk placed in an iteration for a prompt of class 1 bounds how long the iteration may
take: its end plus the prompt's chunks after this one must stay before the deadline. Later
chunks are cut to what still fits (`IterationLatency.tighten`), so batching more prompts
(throughput: the fixed cost of an iteration is shared) never costs a prompt placed before
them its goal.

Times: `now` and arrivals in seconds of one clock; goals and predictions in ms. Stdlib only;
the cost model is passed in (`shared.config.IterationCostModel`).
"""
from __future__ import annotations

from scheduler_svc.core.request import Request
from shared.config import IterationCostModel

STARVING, CAN_MAKE_IT, WILL_MISS = 0, 1, 2


class TtftGoal:
    def __init__(self, cost: IterationCostModel, token_budget: int,
                 target_ms: float | None = None, factor: float | None = None) -> None:
        if (target_ms is None) == (factor is None):
            raise ValueError("a TTFT goal is either target_ms or factor")
        self.cost, self.token_budget = cost, token_budget
        self.target_ms, self.factor = target_ms, factor
        self.met_total = 0
        self.missed_total = 0

    # ---- predictions ---------------------------------------------------------------------

    def prefill_ms(self, start: int, end: int) -> float:
        """Predicted ms to compute prompt rows [start, end) alone, in token-budget chunks."""
        total, budget = 0.0, self.token_budget
        while start < end:
            rows = min(budget, end - start)
            total += self.cost.iteration_ms([(rows, start + rows)])
            start += rows
        return total

    def goal_ms(self, num_prompt_tokens: int) -> float:
        if self.target_ms is not None:
            return self.target_ms
        return (self.factor * self.prefill_ms(0, num_prompt_tokens)
                + self.prefill_ms(0, self.token_budget))

    def deadline(self, request: Request, since: float | None = None) -> float:
        """When its first token is due: the goal after its arrival, or after `since`."""
        start = request.arrival_s if since is None else since
        return start + self.goal_ms(request.num_prompt_tokens) / 1e3

    # ---- ordering and sizing ---------------------------------------------------------------

    def priority(self, request: Request, now: float) -> tuple[int, float]:
        """Sort key: (class, deadline). A request that already has tokens (a decode, or one
        resumed) is not a prefill this goal is about: (-1, 0), kept where it was."""
        if request.output_token_ids:
            return (-1, 0.0)
        goal_s = self.goal_ms(request.num_prompt_tokens) / 1e3
        deadline = request.arrival_s + goal_s
        if now - deadline > goal_s:
            return (STARVING, deadline)
        left_s = self.prefill_ms(request.num_computed_tokens, request.num_prompt_tokens) / 1e3
        return (CAN_MAKE_IT if now + left_s <= deadline else WILL_MISS, deadline)

    def iteration_limit_ms(self, request: Request, rows: int, now: float) -> float | None:
        """With `rows` more rows of `request` in this iteration (from its num_computed_tokens),
        the longest the iteration may take and still let it meet its goal; None when its goal
        does not bound the iteration (it will miss anyway, or is no prefill)."""
        if self.priority(request, now)[0] != CAN_MAKE_IT:
            return None
        after = self.prefill_ms(request.num_computed_tokens + rows, request.num_prompt_tokens)
        return (self.deadline(request) - now) * 1e3 - after

    # ---- attainment ----------------------------------------------------------------------

    def first_token(self, request: Request, now: float) -> None:
        """The request just sampled its first token: count whether it met its goal."""
        if (now - request.arrival_s) * 1e3 <= self.goal_ms(request.num_prompt_tokens):
            self.met_total += 1
        else:
            self.missed_total += 1
