"""Prometheus metrics on the gateway's own registry.

Latencies are measured here, where the client's clock is: TTFT from request arrival to the
first token event, inter-token latency between token events, E2E to the end of the request.
Queue and cache state is the scheduler's: read from its `stats` hash at scrape time.
"""
from __future__ import annotations

import asyncio
import math

import redis.asyncio as aioredis
import structlog
from prometheus_client import (CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from redis.exceptions import RedisError

from shared.keys import SCHEDULERS_GROUP

log = structlog.get_logger("gateway.metrics")
disable_created_metrics()       # no `_created` series beside each counter, as vLLM exports

# vLLM's bucket edges, so dashboards built for it read ours the same way; the token gaps
# also below 10 ms, where one stream's gap lies on a CPU
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# stats hash field -> (metric name, help, counter?)
_SCHEDULER_STATS = {
    "num_requests_running": ("pacer:num_requests_running", "Requests in the running batch", False),
    "num_requests_waiting": ("pacer:num_requests_waiting", "Requests waiting to be admitted", False),
    "kv_cache_usage_perc": ("pacer:kv_cache_usage_perc", "KV cache usage, 0..1", False),
    "num_preemptions_total": ("pacer:num_preemptions", "Preemptions since the scheduler started", True),
    # vLLM's prefix cache counters, in tokens: prompt tokens looked up at admission, and found
    "prefix_cache_queries_total": ("pacer:prefix_cache_queries",
                                   "Prompt tokens looked up in the prefix cache", True),
    "prefix_cache_hits_total": ("pacer:prefix_cache_hits",
                                "Prompt tokens found in the prefix cache", True),
    # worker rank 0: the host's share of an iteration is plan_wait / (plan_wait + busy)
    "worker_plan_wait_seconds_total": ("pacer:worker_plan_wait_seconds",
                                       "Seconds worker rank 0 waited for the next plan", True),
    "worker_busy_seconds_total": ("pacer:worker_busy_seconds",
                                  "Seconds worker rank 0 spent running plans", True),
    "worker_forward_seconds_total": ("pacer:worker_forward_seconds",
                                     "Of the busy seconds, those rank 0's runner timed as "
                                     "its forward (the rest: handing plans over, the GIL, "
                                     "P/D's exposed sends)", True),
    "worker_iterations_total": ("pacer:worker_iterations", "Plans worker rank 0 ran", True),
    "worker_publish_seconds_total": ("pacer:worker_publish_seconds",
                                     "Seconds worker rank 0 spent sending results and tokens",
                                     True),
    # the scheduler's side: its host time between a result and the next plan (overhead), and
    # a plan's time from sent to its result (round trip)
    "num_iterations_total": ("pacer:iterations", "Plans the scheduler sent", True),
    "scheduler_overhead_seconds_total": ("pacer:scheduler_overhead_seconds",
                                         "Seconds from a result to the next plan sent", True),
    "scheduler_overhead_iterations_total": ("pacer:scheduler_overhead_iterations",
                                            "Plans sent right after a result (the overhead's "
                                            "samples)", True),
    "scheduler_round_trip_seconds_total": ("pacer:scheduler_round_trip_seconds",
                                           "Seconds from a plan sent to its result", True),
    # the iteration-cost model fitted online (docs/design.md#the-online-cost-model)
    "cost_fixed_ms": ("pacer:iteration_cost_fixed_ms", "Fitted fixed cost of an iteration, ms", False),
    "cost_per_decode_row_ms": ("pacer:iteration_cost_per_decode_row_ms",
                               "Fitted cost per decode row, ms", False),
    "cost_per_prefill_row_ms": ("pacer:iteration_cost_per_prefill_row_ms",
                                "Fitted cost per prefill row, ms", False),
    "cost_per_pair_ms": ("pacer:iteration_cost_per_pair_ms",
                         "Fitted cost per attended query-key pair, ms", False),
    "cost_widen_ms": ("pacer:iteration_cost_widen_ms", "Fitted cost of widening packed weights, "
                      "per iteration from cost_wide_from_rows rows on, ms", False),
    "cost_per_narrow_row_ms": ("pacer:iteration_cost_per_narrow_row_ms", "Fitted extra cost "
                               "per row below cost_wide_from_rows (packed-weight kernels), ms",
                               False),
    "cost_wide_from_rows": ("pacer:iteration_cost_wide_from_rows", "Rows from which the "
                            "worker widens packed weights (0: never)", False),
    "cost_prediction_error": ("pacer:iteration_cost_prediction_error",
                              "Mean |predicted - measured| / measured iteration time (EWMA)", False),
    "cost_observations_total": ("pacer:iteration_cost_observations",
                                "Iteration times the cost model has fitted", True),
    # P/D (docs/design.md#pd-disaggregation): the prefill side's KV sends, both sides' hand-offs
    "kv_transfer_bytes_total": ("pacer:kv_transfer_bytes", "KV cache bytes sent to decode "
                                "instances", True),
    "kv_transfer_seconds_total": ("pacer:kv_transfer_seconds",
                                  "Seconds KV sends took, first submit to last completion", True),
    "kv_transfer_exposed_seconds_total": ("pacer:kv_transfer_exposed_seconds",
                                          "Seconds of KV sends not hidden behind the forward",
                                          True),
    "kv_transfer_failures_total": ("pacer:kv_transfer_failures",
                                   "Requests whose KV sends failed (recomputed)", True),
    "handoffs_total": ("pacer:handoffs", "Requests handed from prefill to decode", True),
    "handoffs_with_kv_total": ("pacer:handoffs_with_kv", "Requests handed over with their "
                               "prompt's K/V (the rest are prefilled on the decode side)", True),
    "handoffs_recomputed_total": ("pacer:handoffs_recomputed",
                                  "Hand-offs whose K/V did not arrive (recomputed)", True),
    "kv_check_failures_total": ("pacer:kv_check_failures",
                                "Decode side: received K/V whose digests differed from what "
                                "was sent (recomputed; docs/design.md#kv-integrity)", True),
    "requests_forwarded_total": ("pacer:requests_forwarded",
                                 "Prefill side: new requests handed to the prefill instance "
                                 "the router chose", True),
    "ttft_goal_met_total": ("pacer:ttft_goal_met", "Prefill side: prompts whose first token met "
                            "the TTFT goal (docs/design.md#the-ttft-goal)", True),
    "ttft_goal_missed_total": ("pacer:ttft_goal_missed",
                               "Prefill side: prompts whose first token missed the TTFT goal",
                               True),
    "num_requests_reserved": ("pacer:num_requests_reserved",
                              "Decode side: prompts with blocks reserved, K/V on the way", False),
    "num_reservations_waiting": ("pacer:num_reservations_waiting",
                                 "Decode side: prefill instances' asks for blocks waiting for "
                                 "room, answered in arrival order as it frees", False),
    "kv_blocks_held": ("pacer:kv_blocks_held",
                       "Decode side: KV blocks of given-up reservations kept from every request "
                       "while a prefill worker's late write may still land in them", False),
    "num_requests_awaiting_reservation": ("pacer:num_requests_awaiting_reservation",
                                          "Prefill side: prompts waiting for decode blocks",
                                          False),
}
# reported for every instance even when unknown; the P/D fields only where they apply
_CORE_FIELDS = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                "num_preemptions_total")


class SchedulerStats:
    """A collector that reports the last snapshot of each engine instance's `stats` hash:
    unlabelled for the colocated engine, labelled `instance` for P/D instances. The gauges of
    an instance whose scheduler has no live heartbeat are NaN (unknown: its last snapshot is
    stale); its counters keep their last values."""

    def __init__(self) -> None:
        self.snapshots: dict[str, dict[str, float]] = {"": {}}
        self.queued = math.nan
        self.restarts: dict[str, float] = {}        # service -> restarts by `pacer up`

    async def refresh(self, redis: aioredis.Redis, keys: dict[str, str], live: set[str],
                      request_streams: list[str], restarts_key: str) -> None:
        """`keys`: instance id ("" for the colocated engine) -> its stats hash key; `live`:
        the instances whose scheduler beats; `request_streams`: the streams schedulers read
        requests from, whose unread entries are `pacer:num_requests_queued`; `restarts_key`:
        the hash `pacer up` counts its restarts of each service in."""
        snapshots: dict[str, dict[str, float]] = {}
        queued = await _unread(redis, request_streams)
        restarts = self.restarts
        try:
            restarts = {_text(k): float(v)
                        for k, v in (await redis.hgetall(restarts_key)).items()}
        except (RedisError, ValueError) as e:   # another type; a count that is no number
            log.warning("service restarts unreadable", key=restarts_key, error=str(e))
        for instance, key in keys.items():
            try:
                raw = await redis.hgetall(key)
            except RedisError as e:
                log.warning("scheduler stats unreadable", error=str(e), instance=instance)
                raw = {}
            snapshot = snapshots[instance] = {}
            for field, value in raw.items():
                try:
                    snapshot[_text(field)] = float(value)
                except ValueError:
                    log.warning("scheduler stat is not a number", field=_text(field))
            if instance not in live:
                for field, (_, _, is_counter) in _SCHEDULER_STATS.items():
                    if not is_counter and field in snapshot:
                        snapshot[field] = math.nan
        # set at once, after the last await: scrapes run side by side (two Prometheus
        # servers, a dashboard), and one that collected while another was half way through
        # here lost the series not read back yet
        self.snapshots, self.queued, self.restarts = snapshots, queued, restarts

    def unknown(self, keys: dict[str, str]) -> None:
        """Every instance's numbers unknown (NaN), Redis not having said."""
        self.snapshots = {instance: {} for instance in keys}
        self.queued = math.nan

    def collect(self):
        labelled = list(self.snapshots) != [""]
        for field, (name, doc, is_counter) in _SCHEDULER_STATS.items():
            kind = CounterMetricFamily if is_counter else GaugeMetricFamily
            family = kind(name, doc, labels=["instance"]) if labelled else None
            for instance, snapshot in self.snapshots.items():
                # no scheduler yet: NaN says "unknown", where 0 would claim an empty queue; a
                # field its scheduler never reports (P/D's on a colocated engine) is left out
                value = snapshot.get(field, math.nan)
                if math.isnan(value) and field not in _CORE_FIELDS:
                    continue
                if labelled:
                    family.add_metric([instance], value)
                else:
                    family = kind(name, doc, value=value)
            if family is not None:
                yield family
        restarts = CounterMetricFamily(
            "pacer:service_restarts", "Restarts by `pacer up` of a service that died or hung (a "
            "worker group counts once however many of its ranks died)", labels=["service"])
        for service, count in sorted(self.restarts.items()):
            restarts.add_metric([service], count)
        yield restarts
        yield GaugeMetricFamily("pacer:num_requests_queued", "Requests in the request streams "
                                "that no scheduler has read yet (num_requests_waiting counts "
                                "those a scheduler holds)", value=self.queued)


async def _unread(redis: aioredis.Redis, streams: list[str]) -> float:
    """The schedulers' group's lag summed over the request streams (NaN where Redis cannot
    say: a stream trimmed past entries never read). A stream without the group is unread
    whole: no scheduler has started on it yet (one still loading its model), and the group
    it makes starts at the stream's beginning."""
    total = 0.0
    for stream in streams:
        try:
            groups = await redis.xinfo_groups(stream)
            group = next((g for g in groups if _text(g["name"]) == SCHEDULERS_GROUP), None)
            unread = await redis.xlen(stream) if group is None else group.get("lag")
        except RedisError:              # no such stream yet: nothing was ever queued there
            continue
        total += math.nan if unread is None else int(unread)
    return total


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.time_to_first_token = Histogram(
            "pacer:time_to_first_token_seconds", "Time from request arrival to the first token",
            buckets=_TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "pacer:inter_token_latency_seconds", "Time between consecutive output tokens",
            buckets=_ITL_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram(
            "pacer:e2e_request_latency_seconds", "Time from request arrival to its last token",
            buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pacer:prompt_tokens", "Prompt tokens submitted", registry=r)
        self.generation_tokens = Counter("pacer:generation_tokens", "Output tokens received",
                                         registry=r)
        self.request_success = Counter("pacer:request_success", "Requests finished, by reason",
                                       ["finished_reason"], registry=r)
        self.requests_rejected = Counter("pacer:requests_rejected",
                                         "Requests answered 429 because the queue was full",
                                         registry=r)
        self.scheduler_stats = SchedulerStats()
        r.register(self.scheduler_stats)

    async def render(self, redis: aioredis.Redis, stats_keys: dict[str, str], live: set[str],
                     request_streams: list[str], redis_timeout_s: float,
                     restarts_key: str) -> bytes:
        """The exposition; the schedulers' numbers are NaN (unknown) where Redis does not
        answer within `redis_timeout_s` (stalled): the gateway's own are there all the same."""
        try:
            await asyncio.wait_for(self.scheduler_stats.refresh(
                redis, stats_keys, live, request_streams, restarts_key), redis_timeout_s)
        except TimeoutError:
            log.warning("scheduler stats unreadable: redis did not answer",
                        timeout_s=redis_timeout_s)
            self.scheduler_stats.unknown(stats_keys)
        return generate_latest(self.registry)
