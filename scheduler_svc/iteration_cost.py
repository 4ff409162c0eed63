"""The roofline cost model as the scheduler and the simulator call it: every iteration, so in
closed form rather than by search.

`cost_model.py` states the model (FLOPs and bytes per chunk, time = max(FLOPs / rate,
bytes / bandwidth)); this module evaluates the same sums straight from a list of chunks and
solves "how many prefill rows still fit" as a quadratic (attention pairs grow with N²) instead
of a bisection over `estimate_iteration`. Tests hold the two to the same answers.

Stdlib only, like the core it serves.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scheduler_svc.cost_model import ModelShape, model_shape_of
from shared.errors import PacerError
from shared.hardware import HardwareProfile, load_hardware

Chunk = tuple[int, int]   # (q_rows, kv_len)


def _sums(chunks: Sequence[Chunk]) -> tuple[int, int, float, int]:
    """(Q rows, chunks, causal (query, key) pairs, KV rows read + written)."""
    rows = kv = pairs = 0
    for q, kv_len in chunks:
        rows += q
        kv += kv_len
        pairs += q * kv_len - q * (q - 1) // 2     # q·prefix + q(q+1)/2
    return rows, len(chunks), pairs, kv + rows


@dataclass(frozen=True)
class RooflineCost:
    """One model on one machine: `iteration_ms(chunks)` and `max_prefill_rows(...)`."""

    model: ModelShape
    hw: HardwareProfile
    dtype_bytes: float = 2

    def __post_init__(self) -> None:
        m, d = self.model, self.dtype_bytes
        # Per-unit costs, fixed for the model and the machine (frozen: set via object.__setattr__).
        consts = {
            "_row_flops": 2.0 * m.num_layers * m.layer_matmul_params,
            "_chunk_flops": 2.0 * m.lm_head_params,     # the sampling row's LM head
            "_pair_flops": float(m.attention_flops_per_pair),
            "_kv_bytes": m.kv_bytes_per_token(d),
            "_weight_bytes": m.params_read_per_iteration * d,
            "_flops_per_ms": self.hw.flops_per_s(d) / 1e3,
            "_bytes_per_ms": self.hw.bytes_per_s / 1e3,
        }
        for name, value in consts.items():
            object.__setattr__(self, name, value)

    def _flops(self, rows: float, chunks: float, pairs: float) -> float:
        return self._row_flops * rows + self._chunk_flops * chunks + self._pair_flops * pairs

    def iteration_ms(self, chunks: Sequence[Chunk]) -> float:
        """The roofline wall time of one forward over `chunks`, as `estimate_iteration`."""
        rows, n, pairs, kv = _sums(chunks)
        return max(self._flops(rows, n, pairs) / self._flops_per_ms,
                   (self._weight_bytes + self._kv_bytes * kv) / self._bytes_per_ms)

    def max_prefill_rows(self, budget_ms: float, chunks: Sequence[Chunk], prefix_len: int) -> int:
        """Largest N such that `chunks + [(N, prefix_len + N)]` runs within `budget_ms`."""
        rows, n, pairs, kv = _sums(chunks)
        s = prefix_len
        # Memory: weights + K_tok · (kv + S + 2N) <= bandwidth · budget; linear in N.
        by_bytes = ((self._bytes_per_ms * budget_ms - self._weight_bytes) / self._kv_bytes
                    - kv - s) / 2
        # Compute: a·N² + b·N + c <= 0 with the new chunk's N·S + N(N+1)/2 pairs.
        a = self._pair_flops / 2
        b = self._row_flops + self._pair_flops * (s + 0.5)
        c = self._flops(rows, n + 1, pairs) - self._flops_per_ms * budget_ms
        by_flops = (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a) if c <= 0 else -1.0
        return self._settle(max(0, math.floor(min(by_bytes, by_flops))), budget_ms,
                            (rows, n, pairs, kv), s)

    def _settle(self, guess: int, budget_ms: float, base: tuple[int, int, float, int],
                s: int) -> int:
        """Floating point can put the closed form one row off the exact boundary."""
        def fits(x: int) -> bool:
            rows, n, pairs, kv = base
            flops = self._flops(rows + x, n + 1, pairs + x * s + x * (x + 1) // 2)
            nbytes = self._weight_bytes + self._kv_bytes * (kv + s + 2 * x)
            return max(flops / self._flops_per_ms, nbytes / self._bytes_per_ms) <= budget_ms

        while guess > 0 and not fits(guess):
            guess -= 1
        while fits(guess + 1):
            guess += 1
        return guess


def latency_cost_for(max_iteration_ms: float | None, hw: str | None, model_config: Any,
                     dtype_bytes: float) -> RooflineCost | None:
    """The cost model behind `--max-iteration-ms`, for a served model's `ModelConfig`; None
    when no latency budget is asked for."""
    if max_iteration_ms is None:
        return None
    if hw is None:
        raise PacerError("--max-iteration-ms needs --hw: a built-in profile (h100, h200, a100) "
                         "or a JSON written by `pacer calibrate`")
    return RooflineCost(model_shape_of(model_config, "served model"), load_hardware(hw),
                        dtype_bytes)
