"""Helpers the benchmarks share: seeded workloads, bandwidth measurement, table printing."""
from __future__ import annotations

import json
import random
import time

from shared.openmp import default_omp_wait_policy

default_omp_wait_policy()      # before torch loads OpenMP
import torch  # noqa: E402


def random_prompts(n: int, min_len: int, max_len: int, vocab: int, seed: int = 0,
                   avoid: tuple[int, ...] = ()) -> list[list[int]]:
    """n prompts of random token ids with lengths uniform in [min_len, max_len] (vLLM's
    'random' dataset); special ids in `avoid` are skipped."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = []
        length = rng.randint(min_len, max_len)
        while len(ids) < length:
            t = rng.randrange(vocab)
            if t not in avoid:
                ids.append(t)
        out.append(ids)
    return out


def measure_bandwidth_gbs(mb: int = 256, repeats: int = 5) -> float:
    """Read bandwidth from summing a large float32 tensor (best of a few)."""
    x = torch.ones(mb * 1024 * 1024 // 4)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return "" if v is None else str(v)


def best_ms(fn, repeats: int = 5) -> float:
    """The fastest of `repeats` calls of fn, in ms (a shared, noisy machine: the best run is
    the one least disturbed)."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def write_json(path: str | None, data: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)
