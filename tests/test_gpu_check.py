"""bench/gpu_check.sh in its CPU smoke mode runs end to end and writes its JSON, so that the
prepared GPU check is not broken when a GPU arrives (docs/gpu.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_smoke_mode(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run([os.path.join(ROOT, "bench", "gpu_check.sh"), "--device", "cpu",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["smoke"] and report["parity"]["greedy_equal"]
    assert report["parity"]["bf16_top1_agreement"] >= report["parity"]["bf16_threshold"]
    assert report["parity"]["prompt_logprobs_max_abs_error"] < 1e-3
    rows = report["speed"]["rows"]
    assert [r["what"].split()[0] for r in rows] == ["decode"] * 3 + ["prefill"]
    assert all(r["tok_s"] > 0 and r["roofline_ms"] > 0 for r in rows)
