"""An iteration-cost model fitted online from measured forward times (docs/design.md#the-online-cost-model).

    ms ≈ fixed + per_decode_row · decode rows + per_prefill_row · prefill rows + per_pair · pairs

over an iteration's chunks `(q_rows, kv_len)` (a decode is a chunk of one row; pairs: the causal
query-key pairs attention scores). Decode and prefill rows are priced apart: a decode row also
carries its sampling and its attention over a whole cached context, while prefill rows go
through the GEMMs many at a time. Worker rank 0 reports each forward's time; `observe` folds it into an exponentially
forgetting least-squares fit (recursive least squares with forgetting, solved in closed form:
4 unknowns), pulled gently toward a prior so that directions the traffic has not yet shown (all
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
NAMES = ("fixed_ms", "per_decode_row_ms", "per_prefill_row_ms", "per_pair_ms")
# features are scaled to similar magnitudes for a well-conditioned solve
_SCALE = (1.0, 1e-1, 1e-2, 1e-5)
# A prior for a small model on a CPU; a few iterations' measurements outweigh it.
CPU_PRIOR_MS = (20.0, 0.3, 0.25, 1e-4)


def features(chunks: Sequence[Chunk]) -> tuple[float, float, float, float]:
    decode_rows = prefill_rows = pairs = 0
    for q, kv in chunks:
        if q == 1:
            decode_rows += 1
        else:
            prefill_rows += q
        pairs += q * kv - q * (q - 1) // 2       # q·prefix + q(q+1)/2
    return (1.0, decode_rows * _SCALE[1], prefill_rows * _SCALE[2], pairs * _SCALE[3])


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
    model before its first measurement."""
    fit = OnlineIterationCost(prior_ms=(0.0,) * 4, forgetting=1.0, prior_weight=1e-9)
    for chunks in _seed_shapes():
        fit.observe(chunks, cost.iteration_ms(chunks))
    return tuple(fit.coefficients_ms.values())


class OnlineIterationCost:
    """The fitted model; mutable: `observe` after every forward."""

    def __init__(self, prior_ms: Sequence[float] = CPU_PRIOR_MS, forgetting: float = 0.98,
                 prior_weight: float = 0.5) -> None:
        self.prior_ms = tuple(prior_ms)
        self.forgetting = forgetting
        # prior coefficients in scaled units, and how many observations' worth they count for
        self._prior = [p / s for p, s in zip(prior_ms, _SCALE)]
        self._prior_weight = prior_weight
        self._a = [[0.0] * 4 for _ in range(4)]      # Σ λ^k x xᵀ
        self._b = [0.0] * 4                          # Σ λ^k x y
        self.theta = list(self._prior)
        self.observations = 0
        self.mean_abs_error = 0.0                    # |predicted − measured| / measured, EWMA

    @classmethod
    def seeded_from(cls, cost, **kw) -> OnlineIterationCost:
        """An online model whose prior is `cost`'s predictions (the roofline of a profile)."""
        return cls(prior_from(cost), **kw)

    def fresh(self) -> OnlineIterationCost:
        """The same model before any measurement: one per scheduler (each learns its own)."""
        return OnlineIterationCost(self.prior_ms, self.forgetting, self._prior_weight)

    @property
    def coefficients_ms(self) -> dict[str, float]:
        return {name: t * s for name, t, s in zip(NAMES, self.theta, _SCALE)}

    def observe(self, chunks: Sequence[Chunk], measured_ms: float) -> None:
        if not chunks or not (measured_ms > 0 and math.isfinite(measured_ms)):
            return
        x = features(chunks)
        predicted = self.iteration_ms(chunks)
        err = abs(predicted - measured_ms) / measured_ms
        self.mean_abs_error = err if self.observations == 0 else 0.9 * self.mean_abs_error + 0.1 * err
        lam = self.forgetting
        for i in range(4):
            self._b[i] = lam * self._b[i] + x[i] * measured_ms
            for j in range(4):
                self._a[i][j] = lam * self._a[i][j] + x[i] * x[j]
        self.observations += 1
        w = self._prior_weight
        a = [[self._a[i][j] + (w if i == j else 0.0) for j in range(4)] for i in range(4)]
        b = [self._b[i] + w * self._prior[i] for i in range(4)]
        theta = _solve(a, b)
        self.theta = [max(0.0, t) for t in theta] if all(map(math.isfinite, theta)) else self.theta

    def iteration_ms(self, chunks: Sequence[Chunk]) -> float:
        return sum(t * f for t, f in zip(self.theta, features(chunks)))

    def max_prefill_rows(self, budget_ms: float, chunks: Sequence[Chunk], prefix_len: int) -> int:
        """Largest N such that `chunks + [(N, prefix_len + N)]` is predicted within budget_ms."""
        _, per_decode, per_row, per_pair = (t * s for t, s in zip(self.theta, _SCALE))
        left = budget_ms - self.iteration_ms(chunks)             # the fixed cost is in there

        def added_ms(x: int) -> float:  # what a chunk of x rows over the prefix adds
            pairs = x * prefix_len + x * (x + 1) // 2
            return (per_decode if x == 1 else per_row * x) + per_pair * pairs

        if left <= 0:
            return 0
        # per_pair/2 · N² + (per_prefill_row + per_pair · (prefix + 1/2)) · N <= left
        a = per_pair / 2
        b = per_row + per_pair * (prefix_len + 0.5)
        if a <= 0:
            n = left / b if b > 0 else float(1 << 30)
        else:
            n = (-b + math.sqrt(b * b + 4 * a * left)) / (2 * a)
        guess = max(0, int(math.floor(min(n, float(1 << 30)))))
        # floating point (and a 1-row chunk, priced as a decode row) can put it a row off
        while guess > 0 and added_ms(guess) > left:
            guess -= 1
        while guess < (1 << 30) and added_ms(guess + 1) <= left:
            guess += 1
        return guess
