"""`pacer simulate` with the served default's cost model and token-gap target, with the KV pool
a device holds, and `--replay` of a real run's measured iterations
(docs/design.md#the-online-cost-model, docs/design.md#the-memory-wall)."""
from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from scheduler_svc.arrivals import Arrival, synthetic
from scheduler_svc.cost_replay import (iteration_kind, prediction_errors, predictions,
                                      read_iterations)
from scheduler_svc.sim_report import summarize
from scheduler_svc.simulator import simulate
from services.cli import main
from shared.config import AUTO_TBT_FACTOR
from shared.cost_model import MODELS, kv_capacity
from shared.hardware import HARDWARE
from shared.online_cost import NAMES, OnlineIterationCost, prior_from
from tests.test_simulator import H100_7B, config


def test_an_online_model_seeded_from_the_roofline_starts_near_it():
    online = OnlineIterationCost.seeded_from(H100_7B)
    assert online.observations == 0
    for chunks in ([(1, 1024)] * 32, [(1, 1024)] * 8 + [(512, 512)], [(2048, 4096)]):
        assert online.iteration_ms(chunks) == pytest.approx(H100_7B.iteration_ms(chunks), rel=0.3)
    assert online.fresh().coefficients_ms == online.coefficients_ms
    assert online.fresh() is not online
    assert len(prior_from(H100_7B)) == len(NAMES) and prior_from(H100_7B)[4:] == (0.0, 0.0)


def test_the_simulator_plans_with_the_online_fit_and_it_learns_from_the_clock():
    arrivals = synthetic(200, 4.0, 1.0, "uniform:256:1024", "uniform:32:128", seed=4)
    arrivals = sorted(arrivals + [Arrival(5.0, 20_000, 4, "long")], key=lambda a: a.arrival_s)
    online = OnlineIterationCost.seeded_from(H100_7B)
    base = config(target_tbt_factor=AUTO_TBT_FACTOR, iteration_cost=online)
    result = simulate(arrivals, base, H100_7B)
    # every iteration was predicted, then learned from; the model handed in stays untouched
    assert len(result.cost_errors) == len(result.timeline)
    assert online.observations == 0
    summary = summarize(result)
    assert summary["online_cost"]["median_abs_error_pct"] < 10
    assert set(summary["online_cost"]["coefficients_ms"]) == set(online.coefficients_ms)
    # the token-gap target held the long prompt's chunks to a few pure-decode iterations
    fixed = summarize(simulate(arrivals, config(), H100_7B))
    assert summary["tbt_ms"]["max"] < fixed["tbt_ms"]["max"] / 2
    assert summary["tbt_max_over_median"] < 8


def test_kv_capacity_walls_the_batch():
    # 4k-token requests on an H100 with Llama-2-7B: ~119k tokens of K/V hold ~29 of them,
    # far fewer than the 256 the sequence cap allows; one longer than the pool is refused.
    # (Whole prompts, so that every running request holds its whole prompt's blocks.)
    cap = kv_capacity(MODELS["llama-2-7b"], HARDWARE["h100"])
    blocks = cap.kv_bytes // (16 * cap.kv_bytes_per_token)
    arrivals = [Arrival(0.0, 4000, 64) for _ in range(80)] + [Arrival(0.0, 150_000, 2)]
    result = simulate(arrivals, config(num_kv_blocks=int(blocks), enable_chunked_prefill=False,
                                       max_num_batched_tokens=8192), H100_7B)
    summary = summarize(result)
    assert summary["kv_capacity_tokens"] == blocks * 16 <= cap.tokens
    assert summary["running_max"] <= cap.tokens // 4000
    assert summary["running_max"] >= cap.tokens // 4064 - 1
    assert summary["rejected"] == 1


def test_cli_online_cost_and_auto_kv_pool(capsys):
    assert main(["simulate", "--num-requests", "80", "--request-rate", "8", "--json",
                 "--cost", "online", "--target-tbt-ms", "auto", "--kv-cache-memory", "auto",
                 "--prompt-len", "uniform:64:512", "--output-len", "uniform:8:32"]) == 0
    out = json.loads(capsys.readouterr().out)
    chunked = out["modes"]["chunked"]
    cap = kv_capacity(MODELS["llama-2-7b"], HARDWARE["h100"], max_num_batched_tokens=2048,
                      max_num_seqs=256)
    assert out["config"]["num_kv_blocks"] == cap.kv_bytes // (16 * cap.kv_bytes_per_token)
    assert out["config"]["target_tbt_factor"] == AUTO_TBT_FACTOR
    assert chunked["online_cost"]["median_abs_error_pct"] >= 0
    assert main(["simulate", "--kv-cache-memory", "auto", "--hw", "h100", "--model",
                 "llama-2-13b", "--gpu-memory-utilization", "0.3"]) == 2
    assert "no room" in capsys.readouterr().err


# ---- replay -------------------------------------------------------------------------------

def true_ms(chunks) -> float:
    """A CPU-like machine: a fixed 30 ms, 0.3 ms per decode row, 0.4 ms per prefill row."""
    return 30 + sum(0.3 if q == 1 else 0.4 * q for q, _ in chunks)


def recorded_run(n: int = 120) -> list[dict]:
    rng = random.Random(1)
    its = []
    for _ in range(n):
        chunks = [(1, rng.randint(20, 400)) for _ in range(8)]
        if rng.random() < 0.3:
            rows = rng.choice([64, 256, 512])
            chunks.append((rows, rows + rng.randint(0, 1000)))
        its.append({"chunks": chunks, "ms": true_ms(chunks) * rng.uniform(0.97, 1.03),
                    "kind": iteration_kind(chunks)})
    return its


def test_the_online_fit_predicts_each_iteration_before_it_learns_from_it():
    its = [(it["chunks"], it["ms"], None) for it in recorded_run()]
    online = OnlineIterationCost()
    predicted = predictions(its, online)
    assert online.observations == len(its)
    late = prediction_errors(its, predicted, skip=40)
    assert {row["kind"] for row in late} == {"decode", "mixed", "all"}
    assert all(row["mape_pct"] < 6 for row in late)
    # a model that does not learn is simply evaluated
    roof = prediction_errors(its, predictions(its, H100_7B))
    assert all(row["measured_over_predicted"] > 3 for row in roof)    # an H100 roofline on a CPU


def test_the_replay_hands_the_workers_widening_threshold_to_the_fit(tmp_path):
    """A run of int4 weights records the row count from which the worker widens them
    (`wide_from_rows`); the replay passes it on, so the online fit learns the widening cost."""
    rng = random.Random(2)
    its = []
    for _ in range(150):
        chunks = [(1, rng.randint(20, 400)) for _ in range(rng.randint(1, 8))]
        if rng.random() < 0.5:
            rows = rng.choice([8, 16, 64, 256])
            chunks.append((rows, rows))
        rows = sum(q for q, _ in chunks)
        ms = 25 + (50 + 0.3 * rows if rows >= 24 else 2.5 * rows)
        its.append({"chunks": chunks, "ms": ms * rng.uniform(0.98, 1.02), "wide_from_rows": 24})
    path = tmp_path / "int4.json"
    path.write_text(json.dumps({"iterations": {"default-0": its}}))
    iterations, _ = read_iterations(str(path))
    assert {w for _, _, w in iterations} == {24}
    online = OnlineIterationCost()
    late = prediction_errors(iterations, predictions(iterations, online), skip=60)
    assert online.coefficients_ms["widen_ms"] > 30
    assert all(row["mape_pct"] < 10 for row in late), late


def test_cli_replay_reads_a_bench_json(tmp_path, capsys):
    path = tmp_path / "run.json"
    hw = replace(HARDWARE["h100"], name="recorded").to_dict()
    path.write_text(json.dumps({"model": "smollm2-135m", "hardware": hw,
                                "args": {"dtype": "float32"},
                                "iterations": {"a-0": recorded_run(60), "b-0": recorded_run(60)}}))
    assert main(["simulate", "--replay", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "smollm2-135m" and out["dtype_bytes"] == 4
    assert out["hardware"]["name"] == "recorded" and out["iterations"] == 120
    models = {row["model"] for row in out["errors"]}
    assert models == {"roofline", "online (served prior)", "online (seeded from the roofline)"}
    assert main(["simulate", "--replay", str(path), "--hw", "a100"]) == 0
    assert "roofline of a100" in capsys.readouterr().out
    path.write_text(json.dumps({"iterations": [{"chunks": "x"}]}))
    assert main(["simulate", "--replay", str(path)]) == 2
    assert "expected iterations" in capsys.readouterr().err
