"""An iteration-cost model fitted online from measured forward times (docs/design.md#the-online-cost-model).

    ms ≈ fixed + per_decode_row · decode rows + per_prefill_row · prefill rows + per_pair · pairs
         + (widen                     when the iteration's rows ≥ wide_from_rows
            per_narrow_row · rows      when fewer)

over an iteration's chunks `(q_rows, kv_len)` (a decode is a chunk of one row; pairs: the causal
query-key pairs attention scores). Decode and prefill rows are priced apart: a decode row also
carries its sampling and its attention over a whole cached context, while prefill rows go
through the GEMMs many at a time. The last two terms are for workers whose GEMMs take two paths
by row count (int4/int8 weights on CPU, gpu_worker/quant/linear.py): below `wide_from_rows`
rows a kernel that reads the packed weight and costs per row; from there on the weight is
widened once per GEMM (a cost per iteration, whatever the rows) and then multiplied cheaply.
The worker reports the threshold with each result (None: one path, both terms stay 0).

Worker rank 0 reports each forward's time; `observe` folds it into an exponentially
forgetting least-squares fit (recursive least squares with forgetting, solved in closed form:
6 unknowns), pulled gently toward a prior so that directions the traffic has not yet shown (all
iterations pure decodes, say) stay sane instead of drifting. A change of machine speed is
followed within a few dozen iterations (the forgetting factor's memory).

It answers what the latency budget asks (`shared.config.IterationCostModel`): `iteration_ms`
and `max_prefill_rows`. Stdlib only, like the core it serves; the simulator can drive it with
plain numbers.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

Chunk = tuple[int, int]   # (q_rows, kv_len)
NAMES = ("fixed_ms", "per_decode_row_ms", "per_prefill_row_ms", "per_pair_ms", "widen_ms",
         "per_narrow_row_ms")
_N = len(NAMES)
# features are scaled to similar magnitudes for a well-conditioned solve
_SCALE = (1.0, 1e-1, 1e-2, 1e-5, 1.0, 1e-1)
# A prior for a small model on a CPU; a few iterations' measurements outweigh it.
CPU_PRIOR_MS = (20.0, 0.3, 0.25, 1e-4, 0.0, 0.0)
# a measured time off its prediction by more than this share weighs less (robust to outliers)
_HUBER = 0.3
# Each kind of iteration (decodes alone, decodes with prefill, prefill alone) also keeps how far
# the fit is off it, measured / predicted, as a moving average of this weight per observation
# (each ratio held within 1 ± _HUBER of the average so far: a neighbour's burst moves it
# little); the prediction is the fit's times that.
_BIAS_RATE = 0.15
KINDS = ("decode", "mixed", "prefill")
# Iterations with prompt rows in a row, at most, before the scheduler gives one to the decodes
# alone (`decode_probe_due`): the decodes' own price is only measured there, and the fit's
# memory (the forgetting factor's) is about this long.
DECODE_PROBE_EVERY = 50


def _features(decode_rows: int, prefill_rows: int, pairs: int,
              wide_from_rows: int | None) -> tuple[float, ...]:
    rows = decode_rows + prefill_rows
    wide = wide_from_rows is not None and rows >= wide_from_rows
    narrow_rows = rows if wide_from_rows is not None and not wide else 0
    return (1.0, decode_rows * _SCALE[1], prefill_rows * _SCALE[2], pairs * _SCALE[3],
            1.0 if wide else 0.0, narrow_rows * _SCALE[5])


def _moved(average: float, value: float) -> float:
    """One step of the moving averages above, the value held within 1 ± _HUBER of the
    average so far."""
    held = min(max(value, average * (1 - _HUBER)), average * (1 + _HUBER))
    return average + _BIAS_RATE * (held - average)


def kind_of(decode_rows: int, prefill_rows: int) -> str:
    return "decode" if not prefill_rows else "prefill" if not decode_rows else "mixed"


def _shape(chunks: Sequence[Chunk]) -> tuple[int, int, int]:
    """(decode rows, prefill rows, query-key pairs) of an iteration."""
    decode_rows = prefill_rows = pairs = 0
    for q, kv in chunks:
        if q == 1:
            decode_rows += 1
        else:
            prefill_rows += q
        pairs += q * kv - q * (q - 1) // 2       # q·prefix + q(q+1)/2
    return decode_rows, prefill_rows, pairs


def features(chunks: Sequence[Chunk], wide_from_rows: int | None = None) -> tuple[float, ...]:
    return _features(*_shape(chunks), wide_from_rows)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (a is small and positive definite)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def _solve_non_negative(a: list[list[float]], b: list[float]) -> list[float]:
    """The least-squares solution with every coefficient ≥ 0: a coefficient that comes out
    negative is held at 0 and the others solved again without it (an active set). Clipping
    it without solving again would leave the others fitted around a value it does not have:
    with the widening terms, a per-row cost below the threshold that wants to be negative,
    clipped, once left eight decodes predicted at 350 ms where they took 30."""
    free = list(range(len(b)))
    theta = [0.0] * len(b)
    while free:
        x = _solve([[a[i][j] for j in free] for i in free], [b[i] for i in free])
        if not all(map(math.isfinite, x)):
            return x + [math.nan] * (len(b) - len(x))
        worst = min(range(len(free)), key=lambda k: x[k])
        if x[worst] >= 0:
            for k, i in enumerate(free):
                theta[i] = x[k]
            return theta
        free.pop(worst)
    return theta


def _seed_shapes() -> list[list[Chunk]]:
    """Iterations a server sees, to fit a prior to another cost model: pure decodes at a few
    batch sizes and contexts, prefill chunks alone and beside decodes."""
    shapes: list[list[Chunk]] = [[(1, ctx)] * b for b in (1, 8, 32, 128) for ctx in (256, 2048)]
    for n in (32, 128, 512, 2048):
        for prefix in (0, 2048):
            shapes.append([(n, prefix + n)])
            shapes.append([(1, 1024)] * 8 + [(n, prefix + n)])
    return shapes


def prior_from(cost) -> tuple[float, ...]:
    """Coefficients (NAMES, in ms) fitted by least squares to what `cost` (anything with
    `iteration_ms`, the roofline say) predicts for `_seed_shapes()`: the seed of an online
    model before its first measurement (a roofline has one GEMM path: no widening terms)."""
    fit = OnlineIterationCost(prior_ms=(0.0,) * _N, forgetting=1.0, prior_weight=1e-9)
    for chunks in _seed_shapes():
        fit.observe(chunks, cost.iteration_ms(chunks))
    return tuple(fit.coefficients_ms.values())


class OnlineIterationCost:
    """The fitted model; mutable: `observe` after every forward."""

    def __init__(self, prior_ms: Sequence[float] = CPU_PRIOR_MS, forgetting: float = 0.98,
                 prior_weight: float = 0.05, wide_from_rows: int | None = None) -> None:
        self.prior_ms = tuple(prior_ms) + (0.0,) * (_N - len(prior_ms))
        self.forgetting = forgetting
        # the worker's row count from which its GEMMs widen their weights (None: no such path)
        self.wide_from_rows = wide_from_rows
        # prior coefficients in scaled units, and how many observations' worth they count for
        self._prior = [p / s for p, s in zip(self.prior_ms, _SCALE)]
        self._prior_weight = prior_weight
        self._a = [[0.0] * _N for _ in range(_N)]    # Σ λ^k x xᵀ
        self._b = [0.0] * _N                         # Σ λ^k x y
        self.theta = list(self._prior)
        # the prior's time for one decode: the unit of the weights (see `observe`)
        self._unit_ms = max(self._prior_ms_of(features([(1, 1)], wide_from_rows)), 1e-9)
        self.observations = 0
        self.mean_abs_error = 0.0                    # |predicted − measured| / measured, EWMA
        # per kind of iteration, measured / the fit's prediction, a moving average: a linear
        # fit over every kind leaves each kind a bias of its own (on a 2-core CPU it priced
        # decodes alone 13 % high and decodes with a prompt chunk 15 % low: the iterations the
        # token-gap target sizes), which this takes out
        self.bias = dict.fromkeys(KINDS, 1.0)     # ("decode": only until one is measured)
        # Decodes alone are priced from their own measured time instead (a moving average,
        # and the features of the last one): while a long prompt is chunked no iteration is
        # of decodes alone, the fit learns from mixed ones only and its price of the decodes
        # drifts (8.4 -> 14.1 ms over one prompt here, against 10-11 measured), and with it
        # the token-gap target it sets. The fit only scales it to the shape asked.
        self._decode_ms: float | None = None
        self._decode_x: tuple[float, ...] | None = None
        # iterations with prompt rows since the last of decodes alone (as many as it takes
        # for a probe before the first one)
        self.since_decode = DECODE_PROBE_EVERY

    @classmethod
    def seeded_from(cls, cost, **kw) -> OnlineIterationCost:
        """An online model whose prior is `cost`'s predictions (the roofline of a profile)."""
        return cls(prior_from(cost), **kw)

    def fresh(self) -> OnlineIterationCost:
        """The same model before any measurement: one per scheduler (each learns its own)."""
        return OnlineIterationCost(self.prior_ms, self.forgetting, self._prior_weight,
                                   self.wide_from_rows)

    @property
    def coefficients_ms(self) -> dict[str, float]:
        return {name: t * s for name, t, s in zip(NAMES, self.theta, _SCALE)}

    def observe(self, chunks: Sequence[Chunk], measured_ms: float,
                wide_from_rows: int | None = None) -> None:
        """Fold in one forward's time; `wide_from_rows` as the worker reported it with the
        result (it learns the threshold from there; None leaves what it knows)."""
        if wide_from_rows is not None:
            self.wide_from_rows = wide_from_rows
        if not chunks or not (measured_ms > 0 and math.isfinite(measured_ms)):
            return
        decode_rows, prefill_rows, pairs = _shape(chunks)
        x = _features(decode_rows, prefill_rows, pairs, self.wide_from_rows)
        kind = kind_of(decode_rows, prefill_rows)
        predicted = self._fit_ms(x)
        guess = self._ms(decode_rows, prefill_rows, pairs)
        err = abs(guess - measured_ms) / measured_ms
        self.mean_abs_error = err if self.observations == 0 else 0.9 * self.mean_abs_error + 0.1 * err
        if kind == "decode":        # the earlier average, carried to this shape by the fit
            self._decode_ms = _moved(guess if self._decode_ms else measured_ms, measured_ms)
            self._decode_x = x
            self.since_decode = 0
        else:
            self.since_decode += 1
            self.bias[kind] = _moved(self.bias[kind], measured_ms / max(predicted, 1e-9))
        # What counts is the error relative to the iteration's size (5 ms off a 10 ms decode
        # step matters, off a 500 ms prefill not): each iteration weighs 1/size, its size as
        # the prior prices its shape (a fixed scale, so that a change of machine speed leaves
        # old and new iterations of one shape weighing alike), against a one-decode iteration.
        # A time far off the prediction (a noisy neighbour's burst) weighs less (Huber).
        r = self._unit_ms / max(self._prior_ms_of(x), 1e-9)
        off = abs(measured_ms - predicted) / max(predicted, 1e-9)
        if self.observations and off > _HUBER:
            r *= _HUBER / off
        lam = self.forgetting
        for i in range(_N):
            self._b[i] = lam * self._b[i] + r * x[i] * measured_ms
            for j in range(_N):
                self._a[i][j] = lam * self._a[i][j] + r * x[i] * x[j]
        self.observations += 1
        w = self._prior_weight
        a = [[self._a[i][j] + (w if i == j else 0.0) for j in range(_N)] for i in range(_N)]
        b = [self._b[i] + w * self._prior[i] for i in range(_N)]
        theta = _solve_non_negative(a, b)
        if all(map(math.isfinite, theta)):
            self.theta = theta

    def decode_probe_due(self) -> bool:
        """Whether the next iteration that has decodes should run them alone, its prompts
        waiting one iteration: none was measured in the last DECODE_PROBE_EVERY (or ever). A
        long prompt chunked beside the streams, or a queue of them, leaves no iteration of
        decodes alone, and the fit of mixed ones alone prices a decode at several times its
        time (docs/design.md#the-prompts-pace)."""
        return self.since_decode >= DECODE_PROBE_EVERY

    def _prior_ms_of(self, x: Sequence[float]) -> float:
        return sum(p * f for p, f in zip(self._prior, x))

    def _fit_ms(self, x: Sequence[float]) -> float:
        return sum(t * f for t, f in zip(self.theta, x))

    def _ms(self, decode_rows: int, prefill_rows: int, pairs: int) -> float:
        x = _features(decode_rows, prefill_rows, pairs, self.wide_from_rows)
        kind = kind_of(decode_rows, prefill_rows)
        if kind == "decode" and self._decode_ms is not None:
            return self._decode_ms * self._fit_ms(x) / max(self._fit_ms(self._decode_x), 1e-9)
        return self._fit_ms(x) * self.bias[kind]

    def iteration_ms(self, chunks: Sequence[Chunk]) -> float:
        return self._ms(*_shape(chunks))

    def max_prefill_rows(self, budget_ms: float, chunks: Sequence[Chunk], prefix_len: int) -> int:
        """Largest N such that `chunks + [(N, prefix_len + N)]` is predicted within budget_ms.

        The cost of N rows rises with N on each side of the widening threshold and may step
        either way across it, so each side is solved on its own: the wide side (N from where
        the iteration reaches the threshold) first, as it holds the larger N."""
        decodes, prefill, pairs = _shape(chunks)
        big = 1 << 30

        def ms(x: int) -> float:      # a chunk of one row is priced as a decode row
            return self._ms(decodes + (x == 1), prefill + (x if x > 1 else 0),
                            pairs + x * prefix_len + x * (x + 1) // 2)

        if ms(0) >= budget_ms:
            return 0
        rows0 = decodes + prefill
        edge = big if self.wide_from_rows is None else max(0, self.wide_from_rows - rows0)
        # [lo, hi): first the wide side, then the narrow one; on each, ms rises with N
        for lo, hi in ((edge, big), (0, edge)):
            n = self._largest_on_side(ms, budget_ms, lo, hi, prefix_len,
                                      self.bias[kind_of(decodes, 2)]) if lo < hi else None
            if n is not None:
                return n
        return 0

    def _largest_on_side(self, ms, budget_ms: float, lo: int, hi: int, prefix_len: int,
                         bias: float) -> int | None:
        """Largest x in [lo, hi) with ms(x) <= budget_ms, ms rising on the interval; None if
        none. The quadratic in x (pairs grow as x²) gives a guess, corrected row by row."""
        if ms(lo) > budget_ms:
            return None
        per_row = self.theta[2] * _SCALE[2] * bias
        per_pair = self.theta[3] * _SCALE[3] * bias
        base = ms(lo)
        left = budget_ms - base
        a = per_pair / 2
        b = per_row + per_pair * (prefix_len + lo + 0.5)
        if a <= 0:
            n = left / b if b > 0 else float(hi)
        else:
            n = (-b + math.sqrt(b * b + 4 * a * left)) / (2 * a)
        guess = lo + max(0, int(math.floor(min(n, float(hi)))))
        guess = min(guess, hi - 1)
        # floating point, the narrow term and a 1-row chunk priced as a decode row put it a
        # few rows off
        while guess > lo and ms(guess) > budget_ms:
            guess -= 1
        while guess + 1 < hi and ms(guess + 1) <= budget_ms:
            guess += 1
        return guess
