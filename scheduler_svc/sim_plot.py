"""The picture of docs/design.md#why-chunked-prefill: TBT over time and its CDF, one colour
per mode.

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


def plot(results: list[SimResult], path: str, title: str = "") -> None:
    """Left: worst TBT per time bin against simulated time. Right: CDF of every TBT, on a
    logit axis so that the tail (where ORCA's stalls live) is as visible as the median."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (timeline, cdf) = plt.subplots(1, 2, figsize=(13, 4.8))
    span = max((r.timeline.end_s[-1] for r in results if len(r.timeline)), default=1.0)
    for result in results:
        ends = np.frombuffer(result.timeline.end_s, dtype=float)
        worst = np.frombuffer(result.timeline.max_tbt_ms, dtype=float)
        timeline.step(*_worst_per_bin(ends, worst, span), where="post", lw=1, label=result.mode)
        tbt = np.frombuffer(result.tbt_ms, dtype=float) if len(result.tbt_ms) else np.empty(0)
        if tbt.size:
            levels = _cdf_levels(tbt.size)
            cdf.plot(np.quantile(tbt, levels), levels, lw=1.5, label=result.mode)
    timeline.set(yscale="log", xlabel="simulated time (s)", ylabel="worst TBT (ms)",
                 title=f"TBT timeline (worst per {span / _BINS:.2g} s bin)")
    cdf.set(xscale="log", yscale="logit", xlabel="TBT (ms)", ylabel="fraction of gaps ≤ x",
            title="TBT CDF (logit axis: the tail is stretched)")
    for ax in (timeline, cdf):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
