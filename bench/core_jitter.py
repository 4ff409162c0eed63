"""How steady one core of this machine is: the floor under any worst/median token-gap ratio.

The same fixed piece of work (one thread, sized to take about `--step-ms`, the length of a
decode step here) timed back to back for `--seconds`, pinned to one core, with nothing of ours
running beside it unless `--beside` asks. The work (`--work`):

  cache   float32 256x256 matmuls written in place: compute in the core's own caches
  memory  sums over a 128 MB float32 buffer: read from memory, as a decode step reads the
          weights and the KV cache

What runs beside it (`--beside`):

  idle   nothing else (the default)
  spin   a second process spinning on the other core (a prefill pool's core kept busy)

Prints the steps' median, p99, worst, worst/median and how many steps were over 1.5x the median,
and the worst/median within each window of `--window` steps (a `bench/disaggregation.py` stream
decodes 200 tokens: 200 steps), so that a served run's worst/median can be read against what the machine itself
gives a loop that has no Python, no Redis and no other thread in it.

    python bench/core_jitter.py [--seconds 30] [--step-ms 11] [--core -1] [--work memory|cache]
        [--beside idle|spin]
        [--window 200] [--json out.json]
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import torch, write_json  # noqa: E402
from shared.cpu import cpu_flags  # noqa: E402


def spin(core: int, stop) -> None:
    os.sched_setaffinity(0, {core})
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def piece(work: str):
    """One small unit of `work` that allocates nothing (no page fault in the loop)."""
    if work == "cache":
        a, b, out = torch.randn(256, 256), torch.randn(256, 256), torch.empty(256, 256)
        return lambda: torch.mm(a, b, out=out)
    buffer, total = torch.ones(32 * 1024 * 1024), torch.empty(())
    chunks = buffer.split(1024 * 1024)           # 4 MB each, read in turn
    state = {"next": 0}

    def read() -> None:
        torch.sum(chunks[state["next"]], dim=0, out=total)
        state["next"] = (state["next"] + 1) % len(chunks)
    return read


def calibrate(work: str, step_ms: float) -> tuple[object, int]:
    """The unit of work and a repeat count that takes about `step_ms`."""
    unit = piece(work)
    for _ in range(50):
        unit()
    t = time.perf_counter()
    for _ in range(200):
        unit()
    one_ms = (time.perf_counter() - t) / 200 * 1e3
    return unit, max(1, round(step_ms / one_ms))


def measure(work: str, seconds: float, step_ms: float) -> np.ndarray:
    unit, reps = calibrate(work, step_ms)
    steps = []
    end = time.perf_counter() + seconds
    while True:
        t = time.perf_counter()
        for _ in range(reps):
            unit()
        now = time.perf_counter()
        steps.append((now - t) * 1e3)
        if now > end:
            return np.array(steps)


def summary(steps: np.ndarray, window: int) -> dict:
    median = float(np.median(steps))
    ratios = [float(w.max() / np.median(w)) for w in
              (steps[i:i + window] for i in range(0, len(steps) - window + 1, window))]
    return {"steps": len(steps), "median_ms": round(median, 3),
            "p99_ms": round(float(np.percentile(steps, 99)), 3),
            "worst_ms": round(float(steps.max()), 3),
            "worst_over_median": round(float(steps.max()) / median, 3),
            "over_1_5x_median": int((steps > 1.5 * median).sum()),
            "window": window,
            "windows_median_worst_over_median": round(float(np.median(ratios)), 3)
            if ratios else None,
            "windows_over_1_5": f"{sum(r > 1.5 for r in ratios)} of {len(ratios)}",
            "windows_worst_over_median": [round(r, 3) for r in ratios]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--step-ms", type=float, default=11.0)
    ap.add_argument("--core", type=int, default=-1, help="the core to time on (-1: the last)")
    ap.add_argument("--work", choices=("cache", "memory"), default="memory")
    ap.add_argument("--beside", choices=("idle", "spin"), default="idle")
    ap.add_argument("--window", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    core = cores[args.core]
    other = next((c for c in cores if c != core), None)
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {core})
    stop = multiprocessing.Event()
    spinner = None
    if args.beside == "spin" and other is not None:
        spinner = multiprocessing.Process(target=spin, args=(other, stop), daemon=True)
        spinner.start()
    try:
        result = summary(measure(args.work, args.seconds, args.step_ms), args.window)
    finally:
        stop.set()
        if spinner is not None:
            spinner.join(5)
    flags = " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
                     if f in cpu_flags())
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(f"CPU flags: {flags}; cores: {len(cores)}; {args.work} work timed on core {core}, "
          f"beside: {args.beside}; "
          f"load average at the end {load}")
    for key, value in result.items():
        print(f"{key}: {value}")
    write_json(args.json, {"cpu_flags": flags, "core": core, "work": args.work,
                           "beside": args.beside, **result})


if __name__ == "__main__":
    main()
