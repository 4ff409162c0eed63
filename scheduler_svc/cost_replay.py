"""Cost models against a real run's measured iterations (docs/design.md#the-online-cost-model).

A run's iterations are `{"chunks": [[q_rows, kv_len], ...], "ms": measured}` in the order they
ran (`bench/interference.py --json` records them under `iterations`, one list per run, the
runs one after another on one engine). Each model predicts every iteration; one that learns
(`observe`, the online fit) predicts an iteration before it sees its time, as the scheduler
does, so its error is what a served scheduler would have planned with.

Reported per iteration kind (pure decodes, prefill beside decodes, prefill alone): the median
absolute error in percent and the median measured / predicted.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from shared.errors import PacerError

# (chunks, measured ms, the worker's wide_from_rows: None for float weights or an older file)
Iteration = tuple[list[tuple[int, int]], float, "int | None"]
KINDS = ("decode", "mixed", "prefill")


def iteration_kind(chunks: Sequence[tuple[int, int]]) -> str:
    prefill = any(q > 1 for q, _ in chunks)
    decode = any(q == 1 for q, _ in chunks)
    return "mixed" if prefill and decode else "prefill" if prefill else "decode"


def read_iterations(path: str) -> tuple[list[Iteration], dict[str, Any]]:
    """The iterations a JSON file records, in order, and the file's other top-level fields
    (`hardware`, `args`, `model`, ...). PacerError naming what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise PacerError(f"cannot read {path}: {e}") from None
    found = data.get("iterations") if isinstance(data, dict) else data
    runs = found.values() if isinstance(found, dict) else [found]
    out: list[Iteration] = []
    try:
        for run in runs:
            for it in run:
                chunks = [(int(q), int(kv)) for q, kv in it["chunks"]]
                ms = float(it["ms"])
                wide = it.get("wide_from_rows")
                if chunks and ms > 0:
                    out.append((chunks, ms, None if wide is None else int(wide)))
    except (TypeError, KeyError, ValueError) as e:
        raise PacerError(f"{path}: expected iterations of {{\"chunks\": [[q_rows, kv_len], "
                         f"...], \"ms\": measured}} ({e!r})") from None
    if not out:
        raise PacerError(f"{path} records no iterations")
    return out, data if isinstance(data, dict) else {}


def predictions(iterations: Iterable[Iteration], cost) -> np.ndarray:
    """What `cost` predicts for each iteration; a model that learns sees each measured time
    only after predicting it."""
    observe = getattr(cost, "observe", None)
    out = []
    for chunks, ms, wide_from_rows in iterations:
        out.append(cost.iteration_ms(chunks))
        if observe is not None:             # the threshold as the worker reported it
            observe(chunks, ms, wide_from_rows=wide_from_rows)
    return np.asarray(out, dtype=float)


def prediction_errors(iterations: Sequence[Iteration], predicted: np.ndarray,
                      skip: int = 0) -> list[dict]:
    """Per kind, over the iterations after the first `skip`: how many, measured and predicted
    medians, the median absolute percentage error, the median measured / predicted."""
    rows = []
    for kind in (*KINDS, "all"):
        picked = [i for i in range(skip, len(iterations))
                  if kind == "all" or iteration_kind(iterations[i][0]) == kind]
        if not picked:
            continue
        measured = np.array([iterations[i][1] for i in picked])
        guess = predicted[picked]
        rows.append({"kind": kind, "iterations": len(picked),
                     "measured_median_ms": float(np.median(measured)),
                     "predicted_median_ms": float(np.median(guess)),
                     "mape_pct": float(np.median(np.abs(guess - measured) / measured) * 100),
                     "measured_over_predicted": float(np.median(measured / guess))})
    return rows
