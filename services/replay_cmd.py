"""`pacer simulate --replay FILE.json`: the cost models the simulator and the scheduler can
plan with, each against the measured iterations of a real run (scheduler_svc/cost_replay.py).

    python bench/interference.py --json run.json
    pacer simulate --replay run.json                 # model, dtype and profile from the file
    pacer simulate --replay docs/interference_defaults.json --model smollm2-135m

Three models: the roofline of the profile (the file's calibrated one, or --hw), the online fit
as a served scheduler starts it (its CPU prior), and the online fit seeded from that roofline
(what `pacer simulate --cost online` plans with). The online ones learn as they go.
"""
from __future__ import annotations

import argparse
import json
import sys

from shared.errors import PacerError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FIELDS = ["model", "kind", "iterations", "measured_median_ms", "predicted_median_ms",
          "mape_pct", "measured_over_predicted"]


def _setup(args: argparse.Namespace, meta: dict):
    """(model shape, hardware, dtype bytes): the flags first, then what the file records."""
    from shared.cost_model import load_model_shape
    from shared.hardware import hardware_from_dict, load_hardware

    recorded = meta.get("args") if isinstance(meta.get("args"), dict) else {}
    model = load_model_shape(args.model or meta.get("model") or "llama-2-7b")
    if args.hw:
        hw = load_hardware(args.hw)
    elif isinstance(meta.get("hardware"), dict):
        hw = hardware_from_dict(meta["hardware"], default_name="the run's profile")
    else:
        raise PacerError(f"{args.replay} records no hardware profile: give --hw")
    dtype_bytes = args.dtype_bytes or DTYPE_BYTES.get(recorded.get("dtype"), 2)
    return model, hw, dtype_bytes


def replay_report(args: argparse.Namespace) -> dict:
    from scheduler_svc.cost_replay import prediction_errors, predictions, read_iterations
    from shared.cost_model import RooflineCost
    from shared.online_cost import OnlineIterationCost

    iterations, meta = read_iterations(args.replay)
    model, hw, dtype_bytes = _setup(args, meta)
    roofline = RooflineCost(model, hw, dtype_bytes)
    models = {"roofline": roofline, "online (served prior)": OnlineIterationCost(),
              "online (seeded from the roofline)": OnlineIterationCost.seeded_from(roofline)}
    rows = []
    for name, cost in models.items():
        rows += [{"model": name} | row
                 for row in prediction_errors(iterations, predictions(iterations, cost))]
    return {"replay": args.replay, "model": model.name, "hardware": hw.to_dict(),
            "dtype_bytes": dtype_bytes, "iterations": len(iterations), "errors": rows,
            "online_coefficients_ms": {name: cost.coefficients_ms for name, cost in models.items()
                                       if hasattr(cost, "coefficients_ms")}}


def format_report(report: dict) -> str:
    hw = report["hardware"]
    lines = [f"{report['iterations']} measured iterations of {report['replay']}; "
             f"{report['model']}, {report['dtype_bytes']:g} B/elem, roofline of {hw['name']} "
             f"(r½ {hw['gemm_half_rows']:g} rows)"]
    table = [FIELDS] + [[_cell(row[f]) for f in FIELDS] for row in report["errors"]]
    widths = [max(len(r[i]) for r in table) for i in range(len(FIELDS))]
    lines += ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in
                        enumerate(zip(r, widths))) for r in table]
    for name, coefficients in report["online_coefficients_ms"].items():
        lines.append(f"{name}, fitted at the end: " + ", ".join(
            f"{k} {v:.3g}" for k, v in coefficients.items()))
    return "\n".join(lines)


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value)


def run_replay(args: argparse.Namespace) -> int:
    try:
        report = replay_report(args)
    except PacerError as e:
        print(f"pacer simulate: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
