"""The picture of docs/design.md#why-chunked-prefill: TBT over time and its CDF, one colour
per mode; for P/D (docs/design.md#pd-disaggregation-pricing-the-hop) a third panel, the
TTFT CDF, and for a sweep goodput and the tails against the swept knob.

matplotlib (Agg, no display) is imported only when a plot is asked for.
"""
from __future__ import annotations

import numpy as np

from scheduler_svc.simulator import SimResult

_BINS = 1000       # the timeline shows the worst TBT per bin: a run can have 10^6 iterations


def _worst_per_bin(ends: np.ndarray, worst: np.ndarray, span: float) -> tuple[np.ndarray, np.ndarray]:
    edges = np.linspace(0.0, span, _BINS + 1)
    index = np.clip(np.searchsorted(edges, ends, side="right") - 1, 0, _BINS - 1)
    out = np.zeros(_BINS)
    np.maximum.at(out, index, worst)
    keep = out > 0
    return edges[:-1][keep], out[keep]


def _cdf_levels(n: int) -> np.ndarray:
    """Quantile levels even in the body and logarithmic into the tail, up to 1 - 1/n."""
    body = np.linspace(0.01, 0.99, 99)
    tail = 1 - np.logspace(-2, -np.log10(max(n, 100)), 200)
    return np.unique(np.concatenate([body, tail]))


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _cdf(ax, values: np.ndarray, label: str) -> None:
    if values.size:
        levels = _cdf_levels(values.size)
        ax.plot(np.quantile(values, levels), levels, lw=1.5, label=label)


def _finish(fig, axes, path: str, title: str) -> None:
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)


def plot(results: list[SimResult], path: str, title: str = "", ttft: bool = False) -> None:
    """Left: worst TBT per time bin against simulated time. Middle: CDF of every TBT, on a
    logit axis so that the tail (where ORCA's stalls live) is as visible as the median.
    With `ttft`, right: the CDF of every request's TTFT."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3 if ttft else 2, figsize=(19 if ttft else 13, 4.8))
    timeline, cdf = axes[:2]
    span = max((r.timeline.end_s[-1] for r in results if len(r.timeline)), default=1.0)
    for result in results:
        ends = np.frombuffer(result.timeline.end_s, dtype=float)
        worst = np.frombuffer(result.timeline.max_tbt_ms, dtype=float)
        timeline.step(*_worst_per_bin(ends, worst, span), where="post", lw=1, label=result.mode)
        tbt = np.frombuffer(result.tbt_ms, dtype=float) if len(result.tbt_ms) else np.empty(0)
        _cdf(cdf, tbt, result.mode)
        if ttft:
            arrival = np.asarray([a.arrival_s for a in result.arrivals])
            _cdf(axes[2], (np.asarray(result.first_token_s) - arrival) * 1e3, result.mode)
    if ttft:
        axes[2].set(xscale="log", yscale="logit", xlabel="TTFT (ms)",
                    ylabel="fraction of requests ≤ x", title="TTFT CDF")
    timeline.set(yscale="log", xlabel="simulated time (s)", ylabel="worst TBT (ms)",
                 title=f"TBT timeline (worst per {span / _BINS:.2g} s bin)")
    cdf.set(xscale="log", yscale="logit", xlabel="TBT (ms)", ylabel="fraction of gaps ≤ x",
            title="TBT CDF (logit axis: the tail is stretched)")
    _finish(fig, axes, path, title)


def plot_sweep(knob: str, values: list[str], points: list[dict], path: str,
               title: str = "") -> None:
    """One point per swept value: goodput, TTFT p99 and the worst TBT, one line per mode.
    `points[i]` maps a mode to its summary at `values[i]`."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6))
    x = np.arange(len(values))
    panels = [("goodput (req/s meeting both SLOs)", lambda s: s["goodput_rps"], "linear"),
              ("TTFT p99 (ms)", lambda s: s["ttft_ms"]["p99"], "log"),
              ("worst TBT (ms)", lambda s: s["tbt_ms"]["max"], "log")]
    for ax, (label, get, scale) in zip(axes, panels):
        for mode in points[0]:
            ax.plot(x, [get(p[mode]) for p in points], marker="o", label=mode)
        ax.set(xticks=x, xlabel=knob, ylabel=label, yscale=scale)
        ax.set_xticklabels(values, rotation=20)
    _finish(fig, axes, path, title)
