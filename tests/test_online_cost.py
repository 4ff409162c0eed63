"""The online iteration-cost model, from plain numbers: it converges on iteration times drawn
from a known model with noise, follows a change of machine speed, and sizes prefill chunks to a
budget."""
from __future__ import annotations

import random

import pytest

from shared.online_cost import NAMES, OnlineIterationCost

TRUE = {"fixed_ms": 12.0, "per_decode_row_ms": 0.5, "per_prefill_row_ms": 0.4,
        "per_pair_ms": 2e-5, "widen_ms": 0.0, "per_narrow_row_ms": 0.0}
# int4 weights on a CPU, near what was measured (docs/benchmarks.md#iteration-cost-by-shape):
# from 24 rows on each GEMM widens its weight first (41 ms an iteration); below, each row costs
# 1.2 ms more
INT4 = {"fixed_ms": 12.0, "per_decode_row_ms": 1.3, "per_prefill_row_ms": 0.34,
        "per_pair_ms": 7e-4, "widen_ms": 41.0, "per_narrow_row_ms": 1.2}
WIDE_FROM = 24


def true_ms(chunks, model=TRUE, speed=1.0, wide_from=None) -> float:
    """The known model, written out here apart from the one under test."""
    decodes = sum(1 for q, _ in chunks if q == 1)
    prefill = sum(q for q, _ in chunks if q > 1)
    pairs = sum(q * kv - q * (q - 1) // 2 for q, kv in chunks)
    rows = decodes + prefill
    if wide_from is None:
        step = 0.0
    elif rows >= wide_from:
        step = model["widen_ms"]
    else:
        step = model["per_narrow_row_ms"] * rows
    return speed * (model["fixed_ms"] + model["per_decode_row_ms"] * decodes
                    + model["per_prefill_row_ms"] * prefill + model["per_pair_ms"] * pairs + step)


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


def int4_traffic(rng: random.Random):
    """What a server on int4 weights sees: small decode batches (the per-row path), larger
    ones, and prefill chunks beside them (past the threshold: widened)."""
    decodes = [(1, rng.randint(50, 1500)) for _ in range(rng.choice([1, 4, 8, 8, 16, 32, 64]))]
    if rng.random() < 0.4:
        rows = rng.choice([4, 16, 64, 128, 256, 512])
        decodes.append((rows, rng.randint(0, 1500) + rows))
    return decodes


def test_converges_on_the_widening_model_with_noise():
    """Int4 weights: a cost per iteration from the threshold on, a cost per row below it.
    The fit learns both from the threshold the worker reports, where four coefficients
    cannot follow the step."""
    rng = random.Random(3)
    cost, plain = OnlineIterationCost(), OnlineIterationCost()
    for _ in range(500):
        chunks = int4_traffic(rng)
        ms = true_ms(chunks, INT4, wide_from=WIDE_FROM) * rng.uniform(0.95, 1.05)
        cost.observe(chunks, ms, wide_from_rows=WIDE_FROM)
        plain.observe(chunks, ms)
    assert cost.wide_from_rows == WIDE_FROM and plain.wide_from_rows is None

    def mean_error(model):
        probes = [int4_traffic(rng) for _ in range(300)]
        return sum(abs(model.iteration_ms(c) - true_ms(c, INT4, wide_from=WIDE_FROM))
                   / true_ms(c, INT4, wide_from=WIDE_FROM) for c in probes) / len(probes)

    # noise of ±5 % on iterations of 500 ms blurs the 15 ms ones most: the mean is the test
    assert mean_error(cost) < 0.06, cost.coefficients_ms
    # what the step costs a model without it (its per-kind bias takes out a part)
    assert mean_error(plain) > 0.09
    assert cost.coefficients_ms["widen_ms"] == pytest.approx(INT4["widen_ms"], rel=0.25)
    # what the token-gap target asks: eight decodes alone (the per-row path), with one block
    # of prefill (widened), with a chunk of 128 over a prefix
    for probe in ([(1, 400)] * 8, [(1, 400)] * 8 + [(16, 16)], [(1, 400)] * 8 + [(128, 800)]):
        assert cost.iteration_ms(probe) == pytest.approx(
            true_ms(probe, INT4, wide_from=WIDE_FROM), rel=0.08)


def test_the_widening_fit_follows_a_change_of_machine_speed():
    rng = random.Random(4)
    cost = OnlineIterationCost()
    for speed, n in ((1.0, 300), (1.6, 200)):
        for _ in range(n):
            chunks = int4_traffic(rng)
            cost.observe(chunks, true_ms(chunks, INT4, speed, WIDE_FROM), WIDE_FROM)
    for probe in ([(1, 500)] * 8, [(1, 500)] * 8 + [(128, 700)], [(1, 500)] * 32):
        assert cost.iteration_ms(probe) == pytest.approx(
            true_ms(probe, INT4, 1.6, WIDE_FROM), rel=0.05)


def test_a_noisy_neighbours_bursts_barely_move_the_fit():
    """On a shared machine one iteration in ten may take 3-15x its time (another job ran):
    those weigh little (Huber), and the fit stays near the truth; least squares without the
    cap would follow them."""
    rng = random.Random(6)
    cost = OnlineIterationCost()
    for _ in range(600):
        chunks = int4_traffic(rng)
        ms = true_ms(chunks, INT4, wide_from=WIDE_FROM) * rng.uniform(0.95, 1.05)
        cost.observe(chunks, ms * (rng.uniform(3, 15) if rng.random() < 0.1 else 1.0), WIDE_FROM)
    for probe in ([(1, 400)] * 8, [(1, 400)] * 8 + [(16, 16)], [(1, 400)] * 8 + [(128, 800)],
                  [(1, 400)] * 32):
        assert cost.iteration_ms(probe) == pytest.approx(
            true_ms(probe, INT4, wide_from=WIDE_FROM), rel=0.25), cost.coefficients_ms


def test_a_coefficient_held_at_zero_leaves_the_others_fitted():
    """Where the per-row path is cheaper than the widened one's per-row price (a coefficient
    the data want below 0), the fit holds it at 0 and fits the rest without it: the widened
    iterations stay right, the per-row ones as close as non-negative coefficients allow."""
    rng = random.Random(7)
    truth = {**INT4, "per_narrow_row_ms": -0.5}
    cost = OnlineIterationCost()
    for _ in range(400):
        chunks = int4_traffic(rng)
        cost.observe(chunks, true_ms(chunks, truth, wide_from=WIDE_FROM), WIDE_FROM)
    assert cost.coefficients_ms["per_narrow_row_ms"] == 0.0
    assert all(v >= 0 for v in cost.coefficients_ms.values())
    for probe in ([(1, 400)] * 8 + [(128, 800)], [(1, 400)] * 32, [(1, 400)] * 8):
        assert cost.iteration_ms(probe) == pytest.approx(
            true_ms(probe, truth, wide_from=WIDE_FROM), rel=0.1), cost.coefficients_ms


@pytest.mark.parametrize("wide_from", [None, WIDE_FROM])
def test_the_cap_is_the_largest_chunk_within_budget_never_over(wide_from):
    """Against an exhaustive search: across the threshold the cost steps (up by the widening,
    or down where the per-row path was dearer), so the largest fitting chunk may sit past a
    gap of chunks that do not fit; the cap never exceeds the budget."""
    rng = random.Random(5)
    cost = OnlineIterationCost(prior_ms=[INT4[n] for n in NAMES], wide_from_rows=wide_from)
    for _ in range(300):
        decodes = [(1, rng.randint(10, 2000)) for _ in range(rng.choice([0, 1, 3, 8, 20, 23, 40]))]
        prefix = rng.choice([0, 16, 300, 1500])
        budget = rng.uniform(5.0, 600.0)
        n = cost.max_prefill_rows(budget, decodes, prefix)

        def ms(x):
            return cost.iteration_ms(decodes + [(x, prefix + x)])

        assert n == 0 or ms(n) <= budget
        assert all(ms(x) > budget for x in range(n + 1, 2048)), (budget, len(decodes), prefix, n)
    # a lone prefill, widened from its first GEMM on, still gets rows from a roomy budget
    assert cost.max_prefill_rows(200.0, [], 0) > 100


def test_bad_measurements_are_ignored():
    cost = OnlineIterationCost()
    before = list(cost.theta)
    for bad in (0.0, -3.0, float("nan"), float("inf")):
        cost.observe([(1, 10)], bad)
    cost.observe([], 5.0)
    assert cost.theta == before and cost.observations == 0


def test_each_kind_of_iteration_keeps_its_own_bias():
    """A cost the linear terms cannot express: here an iteration with decodes and a prompt
    chunk together costs 1.4x what its rows would (on a CPU: the prefill kernel's few tasks
    for a small chunk, one thread idle). The fit splits the difference among the kinds; each
    kind's own measured / predicted average takes it out, so both shapes the token-gap
    target compares, decodes alone and decodes with a chunk, come out right."""
    rng = random.Random(5)
    cost = OnlineIterationCost()

    def measured(chunks):
        mixed = any(q > 1 for q, _ in chunks) and any(q == 1 for q, _ in chunks)
        return true_ms(chunks) * (1.4 if mixed else 1.0)

    decodes = [(1, 600)] * 6
    for i in range(300):
        chunks = decodes + [(rng.choice([16, 32, 48]), rng.randint(100, 1500))] \
            if i % 3 else decodes
        cost.observe(chunks, measured(chunks) * rng.uniform(0.97, 1.03))
    assert cost.bias["mixed"] > 1.02
    for probe in (decodes, decodes + [(32, 900)]):
        assert cost.iteration_ms(probe) == pytest.approx(measured(probe), rel=0.06)
    # and the chunk sized to a budget is the one that meets it
    budget = 3 * measured(decodes)
    rows = cost.max_prefill_rows(budget, decodes, 800)
    assert measured(decodes + [(rows, 800 + rows)]) <= budget * 1.06
    assert measured(decodes + [(rows + 4, 804 + rows)]) > budget * 0.94
