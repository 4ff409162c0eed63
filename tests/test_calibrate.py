"""`pacer calibrate --quick` measures this machine and writes a profile the cost model loads."""
from __future__ import annotations

import argparse
import json
import math

import pytest

from shared.cost_model import MODELS, estimate_iteration
from services import calibrate_cmd
from shared.hardware import HARDWARE, load_hardware


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pacer")
    calibrate_cmd.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["calibrate", *argv])


def test_quick_calibration_writes_a_profile_the_cost_model_loads(tmp_path, capsys):
    output = tmp_path / "hw.json"
    # an earlier profile there is replaced, and the output says so
    output.write_text(json.dumps(HARDWARE["a100"].to_dict() | {"measured_at": "2026-01-02"}))
    args = _args("--quick", "--output", str(output))
    assert args.run(args) == 0
    assert (f"wrote {output} (replacing its profile a100, measured at 2026-01-02)"
            in capsys.readouterr().out)

    data = json.loads(output.read_text())
    assert {"name", "tflops", "bandwidth_tbps", "measured_at", "measurements"} <= data.keys()
    assert set(data["tflops"]) == {"float32", "bfloat16"}
    raw = data["measurements"]
    assert raw["matmul"] and raw["bandwidth"] and raw["attention"]
    for row in raw["matmul"] + raw["attention"]:
        assert math.isfinite(row["tflops"]) and row["tflops"] > 0
    assert data["bandwidth_tbps"] == max(row["tbps"] for row in raw["bandwidth"])
    # the efficiency curve, fitted on matmuls of a few rows to hundreds; the memory held
    assert {row["m"] for row in raw["gemm_rows"]} == set(calibrate_cmd.PLANS[("cpu", True)].gemm_rows)
    assert data["gemm_half_rows"] == raw["gemm_half_rows"]["bfloat16"] >= 0
    assert data["memory_gib"] > 0

    hw = load_hardware(str(output))
    for dtype_bytes in (2, 4):
        cost = estimate_iteration([(1, 512)] * 8 + [(256, 256)], MODELS["smollm2-135m"], hw,
                                  dtype_bytes)
        for ms in (cost.time_ms, cost.compute_ms, cost.memory_ms):
            assert math.isfinite(ms) and ms > 0
        assert cost.time_ms == max(cost.compute_ms, cost.memory_ms)


def test_gemm_half_rows_fit_from_plain_numbers():
    # a 1 TFLOP/s machine whose GEMMs follow M / (M + 40) exactly, and one that is flat
    def row(m, half):
        return {"m": m, "k": 100, "n": 100, "seconds": 2 * 100 * 100 * (m + half) / 1e12}

    assert calibrate_cmd.fit_gemm_half_rows([row(m, 40) for m in (8, 64, 512)], 1.0) == 40
    assert calibrate_cmd.fit_gemm_half_rows([row(m, 0) for m in (8, 64, 512)], 1.0) == 0
    # noise on one point does not move the median; faster than the rate implies none
    noisy = [row(8, 40), row(64, 40), row(512, 400)]
    assert calibrate_cmd.fit_gemm_half_rows(noisy, 1.0) == 40
    assert calibrate_cmd.fit_gemm_half_rows([row(64, -30)], 1.0) == 0


def test_a_file_that_is_no_profile_is_refused_before_measuring(tmp_path, capsys, monkeypatch):
    # a mistyped --output (the model's config.json, say) was overwritten without a word
    monkeypatch.setattr(calibrate_cmd, "calibrate", lambda *a: pytest.fail("measured"))
    for text in ('{"hidden_size": 4096, "model_type": "llama"}', "not json", "[1, 2]"):
        output = tmp_path / "config.json"
        output.write_text(text)
        args = _args("--quick", "--output", str(output))
        assert args.run(args) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"pacer calibrate: error: --output {output}: already exists and "
                              "is not a hardware profile (")
        assert err.count("\n") == 1 and "Traceback" not in err
        assert output.read_text() == text
