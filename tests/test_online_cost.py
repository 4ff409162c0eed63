"""The online iteration-cost model, from plain numbers: it converges on iteration times drawn
from a known model with noise, follows a change of machine speed, and sizes prefill chunks to a
budget."""
from __future__ import annotations

import random

import pytest

from shared.online_cost import NAMES, OnlineIterationCost

TRUE = {"fixed_ms": 12.0, "per_decode_row_ms": 0.5, "per_prefill_row_ms": 0.4,
        "per_pair_ms": 2e-5}


def true_ms(chunks, model=TRUE, speed=1.0) -> float:
    decodes = sum(1 for q, _ in chunks if q == 1)
    prefill = sum(q for q, _ in chunks if q > 1)
    pairs = sum(q * kv - q * (q - 1) // 2 for q, kv in chunks)
    return speed * (model["fixed_ms"] + model["per_decode_row_ms"] * decodes
                    + model["per_prefill_row_ms"] * prefill + model["per_pair_ms"] * pairs)


def traffic(rng: random.Random):
    """Served-like iterations: decodes of various contexts, sometimes a prefill chunk."""
    decodes = [(1, rng.randint(50, 2000)) for _ in range(rng.randint(1, 48))]
    if rng.random() < 0.4:
        rows = rng.choice([16, 64, 128, 512])
        decodes.append((rows, rng.randint(0, 1500) + rows))
    return decodes


def test_converges_on_a_known_model_with_noise():
    rng = random.Random(0)
    cost = OnlineIterationCost()
    for _ in range(400):
        chunks = traffic(rng)
        cost.observe(chunks, true_ms(chunks) * rng.uniform(0.95, 1.05))
    errors = [abs(cost.iteration_ms(c) - true_ms(c)) / true_ms(c)
              for c in (traffic(rng) for _ in range(200))]
    assert max(errors) < 0.08 and sum(errors) / len(errors) < 0.03, cost.coefficients_ms
    assert cost.coefficients_ms["fixed_ms"] == pytest.approx(12.0, rel=0.2)
    assert cost.mean_abs_error < 0.06


def test_follows_a_change_of_machine_speed():
    rng = random.Random(1)
    cost = OnlineIterationCost()
    for _ in range(300):
        chunks = traffic(rng)
        cost.observe(chunks, true_ms(chunks))
    for _ in range(150):                         # the machine gets 2x slower (a noisy neighbour)
        chunks = traffic(rng)
        cost.observe(chunks, true_ms(chunks, speed=2.0))
    probe = [(1, 500)] * 16 + [(128, 700)]
    assert cost.iteration_ms(probe) == pytest.approx(true_ms(probe, speed=2.0), rel=0.05)


def test_only_decodes_seen_stays_sane():
    """Pure-decode traffic shows nothing of prefill rows: the prior keeps that coefficient
    sane, the fit usable and every coefficient non-negative."""
    rng = random.Random(2)
    cost = OnlineIterationCost()
    for _ in range(300):
        chunks = [(1, rng.randint(100, 1000)) for _ in range(rng.randint(4, 32))]
        cost.observe(chunks, true_ms(chunks))
    assert all(v >= 0 for v in cost.coefficients_ms.values())
    probe = [(1, 400)] * 20
    assert cost.iteration_ms(probe) == pytest.approx(true_ms(probe), rel=0.05)


def test_max_prefill_rows_meets_the_budget():
    cost = OnlineIterationCost(prior_ms=[TRUE[n] for n in NAMES])
    decodes = [(1, 800)] * 16
    for budget in (20.0, 40.0, 100.0, 400.0):
        n = cost.max_prefill_rows(budget, decodes, prefix_len=300)
        assert n > 0 or budget == 20.0
        assert n == 0 or cost.iteration_ms(decodes + [(n, 300 + n)]) <= budget
        assert cost.iteration_ms(decodes + [(n + 1, 301 + n)]) > budget
    assert cost.max_prefill_rows(10.0, decodes, 0) == 0         # the decodes alone fill it
    assert cost.max_prefill_rows(50.0, [], 0) > 0               # a lone prefill


def test_bad_measurements_are_ignored():
    cost = OnlineIterationCost()
    before = list(cost.theta)
    for bad in (0.0, -3.0, float("nan"), float("inf")):
        cost.observe([(1, 10)], bad)
    cost.observe([], 5.0)
    assert cost.theta == before and cost.observations == 0
