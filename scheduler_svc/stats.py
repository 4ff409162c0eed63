"""What the scheduler measures about itself, and the `stats` hash it writes for /metrics.

Per-iteration overhead is the host time on the critical path between two forwards, as the
scheduler sees it: from the moment a step result arrived to the moment the next plan was
sent (update, finish events and acks, intake, schedule, encode, the XADD round trip). The
worker measures the other side, the whole gap it idles between sending a result and getting
the next plan (`worker_plan_wait_seconds_total`), and writes it into the same hash.
"""
from __future__ import annotations

import time

from scheduler_svc.core import Scheduler
from shared.lifecycle import Stopwatch

STATS_INTERVAL_S = 0.1      # at most this often while busy; always on going idle


class SchedulerStats:
    def __init__(self) -> None:
        self.overhead = Stopwatch()          # result received -> next plan sent
        self.round_trip = Stopwatch()        # plan sent -> its result received
        self.num_overhead_samples = 0
        self.num_plans_sent = 0
        self._written_at = 0.0
        self._dirty = True

    def result_received(self) -> None:
        self.round_trip.stop()
        self.overhead.start()
        self._dirty = True

    def plan_sent(self) -> None:
        if self.overhead.stop() > 0.0:
            self.num_overhead_samples += 1
        self.num_plans_sent += 1
        self.round_trip.start()

    def went_idle(self) -> None:
        """No next plan follows this result: the gap is idleness, not overhead."""
        self.overhead.discard()

    def mark_dirty(self) -> None:
        self._dirty = True

    def due(self, idle: bool) -> bool:
        if not self._dirty:
            return False
        return idle or time.monotonic() - self._written_at >= STATS_INTERVAL_S

    def snapshot(self, core: Scheduler) -> dict[str, float]:
        """The hash fields (every value a number: the gateway parses them as floats)."""
        self._written_at = time.monotonic()
        self._dirty = False
        return {
            "num_requests_running": core.num_running,
            "num_requests_waiting": core.num_waiting,
            "kv_cache_usage_perc": round(core.block_manager.usage, 6),
            "num_preemptions_total": core.num_preemptions_total,
            "prefix_cache_queries_total": core.block_manager.prefix_cache_queries,
            "prefix_cache_hits_total": core.block_manager.prefix_cache_hits,
            "block_size": core.block_manager.block_size,      # the gateway's router hashes by it
            "num_iterations_total": self.num_plans_sent,
            "scheduler_overhead_seconds_total": round(self.overhead.total_s, 6),
            "scheduler_overhead_iterations_total": self.num_overhead_samples,
            "scheduler_round_trip_seconds_total": round(self.round_trip.total_s, 6),
            **cost_model_fields(core.config.iteration_cost),
            **ttft_goal_fields(core),
            "updated_at": round(time.time(), 3),
        }


def cost_model_fields(cost) -> dict[str, float]:
    """The online iteration-cost model's coefficients and prediction error, when it learns."""
    if not hasattr(cost, "coefficients_ms"):
        return {}
    return {**{f"cost_{name}": round(v, 9) for name, v in cost.coefficients_ms.items()},
            "cost_wide_from_rows": cost.wide_from_rows or 0,
            "cost_prediction_error": round(cost.mean_abs_error, 6),
            "cost_observations_total": cost.observations}


def ttft_goal_fields(core: Scheduler) -> dict[str, float]:
    """A prefill instance's TTFT goal attainment: prompts whose first token met / missed it."""
    goal = core.ttft_goal
    if goal is None:
        return {}
    return {"ttft_goal_met_total": goal.met_total, "ttft_goal_missed_total": goal.missed_total}
