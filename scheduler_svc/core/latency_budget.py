"""The latency budget of one iteration (docs/design.md#the-latency-budget): besides "at most
N Q rows", "at most M ms", as a cost model estimates it.

Decodes always run: their chunks are reserved before any prefill is sized, and a prefill chunk
is cut to what still fits. So that a waiting prompt cannot starve behind decodes that alone
fill the budget, the first prefill of an iteration may always take `min_rows` (a few rows, or
one KV block where the GEMMs widen their weights: the scheduler's `_min_prefill_rows`): the
iteration then runs over budget by that many rows, and the queue moves.

A TTFT goal (`ttft_goal.py`) may lower the budget as prefills are placed (`tighten`); with
no other budget it starts unbounded (`budget_ms` None).

The cost model is passed in (`shared.config.IterationCostModel`), so the core reads no
hardware profile and imports nothing beyond the stdlib.
"""
from __future__ import annotations

from shared.config import IterationCostModel
from shared.cost_model import ChunkShape


class IterationLatency:
    """One `schedule()` call's view of the budget: the chunks placed so far."""

    def __init__(self, cost: IterationCostModel, budget_ms: float | None, min_rows: int,
                 decode_chunks: list[ChunkShape]) -> None:
        self._cost = cost
        self._budget_ms = budget_ms
        self._min_rows = min_rows
        self._chunks = decode_chunks
        self._has_prefill = False

    @property
    def budget_ms(self) -> float | None:
        return self._budget_ms

    def prefill_rows(self, wanted: int, prefix_len: int) -> int:
        """How many of `wanted` prefill rows over a cached `prefix_len` fit; may be 0."""
        floor = 0 if self._has_prefill else min(wanted, self._min_rows)
        if wanted <= floor or self._budget_ms is None:
            return wanted
        fits = self._cost.max_prefill_rows(self._budget_ms, self._chunks, prefix_len)
        return min(wanted, max(fits, floor))

    def floor_pace_ms(self, wanted: int, prefix_len: int) -> float | None:
        """Where the decodes alone leave a first prefill chunk of `wanted` rows over a cached
        `prefix_len` no more than the floor every first prefill may take: how long all of
        them would take at that pace, an iteration of these decodes and the floor's rows
        each. None where more fits (or in an iteration of decodes alone, with no floor: the
        decodes' price being measured)."""
        rows = self._min_rows
        if self._budget_ms is None or not 0 < rows < wanted or \
                self._cost.max_prefill_rows(self._budget_ms, self._chunks, prefix_len) > rows:
            return None
        return -(-wanted // rows) * self._cost.iteration_ms(
            [*self._chunks, (rows, prefix_len + rows)])

    def whole_prefill_fits(self, rows: int, prefix_len: int) -> bool:
        """ORCA mode never cuts a prompt: it goes whole if it fits, or if it is the first
        prefill of the iteration (else a long prompt would wait for ever)."""
        return not self._has_prefill or self.prefill_rows(rows, prefix_len) == rows

    def tighten(self, limit_ms: float | None) -> None:
        """The iteration may take at most `limit_ms` (None: no new bound)."""
        if limit_ms is not None:
            self._budget_ms = limit_ms if self._budget_ms is None else min(self._budget_ms,
                                                                           limit_ms)

    def add_prefill(self, rows: int, prefix_len: int) -> None:
        self._chunks.append((rows, prefix_len + rows))
        self._has_prefill = True
