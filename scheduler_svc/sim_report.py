"""What a simulation run reports: TTFT and TBT distributions, throughput, iteration times.

Latencies in ms as mean, median, p99 and max (as vLLM's benchmark reports them). The
headline (docs/design.md#why-chunked-prefill) is `tbt max / median`: hundreds without chunking
when a long prompt lands, a few with it.

Goodput (DistServe's measure, docs/design.md#pd-disaggregation-pricing-the-hop): requests per
second that met both a TTFT SLO and a TBT SLO, the latter on each request's worst gap (every
stall is felt, so a mean per request would hide what chunked prefill and disaggregation are
about). A P/D run adds the transfer: alone on the fabric, what of it came after the prefill,
and the first token as the prefill side would have streamed it.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from scheduler_svc.simulator import SimResult
from shared.errors import PacerError

_REQUEST_ID = re.compile(r"^request '[^']*': ")


def latency_stats(values_ms: Sequence[float]) -> dict[str, float | int]:
    """mean, median, p99 and max of a sample (nan for an empty one)."""
    a = np.asarray(values_ms, dtype=float)
    if a.size == 0:
        return {"n": 0, "mean": math.nan, "median": math.nan, "p99": math.nan, "max": math.nan}
    return {"n": int(a.size), "mean": float(a.mean()), "median": float(np.median(a)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def rejection_reasons(result: SimResult) -> dict[str, int]:
    """Why the core refused requests (too long for the context, or for the whole KV pool):
    one of its messages for each kind (the same words, other numbers), the request id left
    out, and how many it stands for, most frequent first."""
    counts: Counter[str] = Counter()
    example: dict[str, str] = {}
    for _, reason in result.rejected:
        reason = _REQUEST_ID.sub("", reason)
        kind = re.sub(r"\d+", "#", reason)
        example.setdefault(kind, reason)
        counts[kind] += 1
    return {example[kind]: n for kind, n in counts.most_common()}


def format_rejections(result: SimResult) -> str:
    """'2 of 3 requests rejected (chunked): 2 like "<reason>"'."""
    total = len(result.arrivals) + len(result.rejected)
    return f"{len(result.rejected)} of {total} requests rejected" + \
        (f" ({result.mode})" if result.mode else "") + ": " + \
        "; ".join(f"{n} like: {reason}" for reason, n in rejection_reasons(result).items())


def summarize(result: SimResult, ttft_slo_ms: float = math.inf,
              tbt_slo_ms: float = math.inf) -> dict[str, Any]:
    """PacerError when every request was rejected: there is nothing to report."""
    if not result.arrivals:
        raise PacerError(f"nothing to report, {format_rejections(result)}")
    first = np.asarray(result.first_token_s)
    finish = np.asarray(result.finish_s)
    arrival = np.asarray([a.arrival_s for a in result.arrivals])
    kinds = np.asarray([a.kind for a in result.arrivals])
    tbt = np.frombuffer(result.tbt_ms, dtype=float) if len(result.tbt_ms) else np.empty(0)
    ttft_ms = (first - arrival) * 1e3
    out_tokens = sum(a.output_len for a in result.arrivals)
    in_tokens = sum(a.prompt_len for a in result.arrivals)
    span = float(finish.max() - arrival.min()) if finish.size else math.nan
    tbt_stats = latency_stats(tbt)
    worst = np.asarray(result.worst_tbt_ms, dtype=float)
    met = (ttft_ms <= ttft_slo_ms) & ~(worst > tbt_slo_ms)     # nan worst: a single token
    summary: dict[str, Any] = {
        "mode": result.mode,
        "instances": result.instances,
        "requests": len(result.arrivals),
        "rejected": len(result.rejected),
        "rejected_reasons": rejection_reasons(result),
        "ttft_ms": latency_stats(ttft_ms),
        "tbt_ms": tbt_stats,
        "tbt_max_over_median": tbt_stats["max"] / tbt_stats["median"] if tbt.size else math.nan,
        "slo": {"ttft_ms": ttft_slo_ms, "tbt_ms": tbt_slo_ms},
        # a rejected request missed both SLOs
        "slo_attainment": int(met.sum()) / (met.size + len(result.rejected)),
        "goodput_rps": int(met.sum()) / span,
        "iteration_ms": latency_stats(np.frombuffer(result.timeline.ms, dtype=float)),
        "iterations": len(result.timeline),
        "preemptions": result.num_preemptions,
        # the memory wall (docs/design.md#the-memory-wall): what one instance's pool holds,
        # and the most requests it ran at once
        "kv_capacity_tokens": result.kv_tokens,
        "running_max": max(result.timeline.num_running, default=0),
        "duration_s": span,
        "requests_per_s": len(result.arrivals) / span,
        "output_tokens_per_s": out_tokens / span,
        "total_tokens_per_s": (in_tokens + out_tokens) / span,
        "sim_wall_s": result.wall_s,
        "sim_cpu_s": result.cpu_s,
    }
    if len(result.cost_errors):
        errors = np.frombuffer(result.cost_errors, dtype=float) * 100
        summary["online_cost"] = {
            "median_abs_error_pct": float(np.median(errors)),
            "p90_abs_error_pct": float(np.percentile(errors, 90)),
            "coefficients_ms": result.cost_coefficients_ms}
    for kind in sorted(set(kinds.tolist()) - {"main"}):
        summary[f"ttft_ms_{kind}"] = latency_stats(ttft_ms[kinds == kind])
    prefill_done = np.asarray(result.prefill_done_s, dtype=float)
    moved = ~np.isnan(prefill_done)
    if moved.any():
        transfer = np.asarray(result.transfer_ms, dtype=float)[moved]
        exposed = np.asarray(result.exposed_ms, dtype=float)[moved]
        summary |= {
            "ttft_prefill_side_ms": latency_stats((prefill_done - arrival)[moved] * 1e3),
            "transfer_ms": latency_stats(transfer),
            "exposed_transfer_ms": latency_stats(exposed),
            "transfer_hidden": 1 - float(exposed.sum() / transfer.sum()),
        }
    return summary


_ROWS = [("TTFT mean ms", "ttft_ms", "mean"), ("TTFT median ms", "ttft_ms", "median"),
         ("TTFT p99 ms", "ttft_ms", "p99"), ("TTFT max ms", "ttft_ms", "max"),
         ("TBT mean ms", "tbt_ms", "mean"), ("TBT median ms", "tbt_ms", "median"),
         ("TBT p99 ms", "tbt_ms", "p99"), ("TBT max ms", "tbt_ms", "max"),
         ("TBT max / median", "tbt_max_over_median", None),
         ("SLO attainment", "slo_attainment", None), ("goodput req/s", "goodput_rps", None),
         ("TTFT p99, token 1 from prefill side", "ttft_prefill_side_ms", "p99"),
         ("transfer median ms", "transfer_ms", "median"),
         ("exposed transfer median ms", "exposed_transfer_ms", "median"),
         ("exposed transfer max ms", "exposed_transfer_ms", "max"),
         ("transfer hidden", "transfer_hidden", None),
         ("iteration median ms", "iteration_ms", "median"),
         ("iteration max ms", "iteration_ms", "max"),
         ("online cost model error median %", "online_cost", "median_abs_error_pct"),
         ("online cost model error p90 %", "online_cost", "p90_abs_error_pct"),
         ("iterations", "iterations", None), ("preemptions", "preemptions", None),
         ("KV capacity tokens (per instance)", "kv_capacity_tokens", None),
         ("running max (per instance)", "running_max", None),
         ("requests (rejected)", None, None),
         ("requests/s", "requests_per_s", None), ("output tok/s", "output_tokens_per_s", None),
         ("total tok/s", "total_tokens_per_s", None), ("simulated s", "duration_s", None),
         ("sim wall s (cpu s)", None, None)]


_SHARES = ("slo_attainment", "transfer_hidden")


def _cell(summary: dict[str, Any], label: str, key: str | None, sub: str | None) -> str:
    if label.startswith("requests ("):
        return f"{summary['requests']} ({summary['rejected']})"
    if label.startswith("sim wall"):
        return f"{summary['sim_wall_s']:.2f} ({summary['sim_cpu_s']:.2f})"
    if key not in summary:
        return "-"
    value = summary[key][sub] if sub else summary[key]
    if key in _SHARES:
        return f"{value:.1%}"
    if isinstance(value, int):
        return str(value)
    return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.3g}"


def format_table(summaries: list[dict[str, Any]]) -> str:
    """The modes side by side, one row per metric."""
    rows = list(_ROWS)
    extra = sorted({k for s in summaries for k in s if k.startswith("ttft_ms_")})
    for key in extra:
        kind = key.removeprefix("ttft_ms_")
        rows += [(f"TTFT {kind} median ms", key, "median"), (f"TTFT {kind} max ms", key, "max")]
    slo = summaries[0]["slo"]
    rows = [(f"{label} (TTFT <= {slo['ttft_ms']:g} ms, every TBT <= {slo['tbt_ms']:g} ms)"
             if key == "slo_attainment" else label, key, sub) for label, key, sub in rows]
    if not any("transfer_ms" in s for s in summaries):
        rows = [r for r in rows if "transfer" not in r[0] and "prefill side" not in r[0]]
    if not any("online_cost" in s for s in summaries):
        rows = [r for r in rows if r[1] != "online_cost"]
    header = ["metric"] + [s["mode"] for s in summaries]
    table = [header] + [[label] + [_cell(s, label, key, sub) for s in summaries]
                        for label, key, sub in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))) for r in table)
