"""`pacer calibrate --quick` measures this machine and writes a profile the cost model loads."""
from __future__ import annotations

import argparse
import json
import math

from shared.cost_model import MODELS, estimate_iteration
from services import calibrate_cmd
from shared.hardware import load_hardware


def test_quick_calibration_writes_a_profile_the_cost_model_loads(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="pacer")
    calibrate_cmd.register(parser.add_subparsers(dest="command", required=True))
    output = tmp_path / "hw.json"
    args = parser.parse_args(["calibrate", "--quick", "--output", str(output)])
    assert args.run(args) == 0
    assert f"wrote {output}" in capsys.readouterr().out

    data = json.loads(output.read_text())
    assert {"name", "tflops", "bandwidth_tbps", "measured_at", "measurements"} <= data.keys()
    assert set(data["tflops"]) == {"float32", "bfloat16"}
    raw = data["measurements"]
    assert raw["matmul"] and raw["bandwidth"] and raw["attention"]
    for row in raw["matmul"] + raw["attention"]:
        assert math.isfinite(row["tflops"]) and row["tflops"] > 0
    assert data["bandwidth_tbps"] == max(row["tbps"] for row in raw["bandwidth"])

    hw = load_hardware(str(output))
    for dtype_bytes in (2, 4):
        cost = estimate_iteration([(1, 512)] * 8 + [(256, 256)], MODELS["smollm2-135m"], hw,
                                  dtype_bytes)
        for ms in (cost.time_ms, cost.compute_ms, cost.memory_ms):
            assert math.isfinite(ms) and ms > 0
        assert cost.time_ms == max(cost.compute_ms, cost.memory_ms)
