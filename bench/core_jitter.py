"""How steady one core of this machine is: the floor under any worst/median token-gap ratio.

The same fixed piece of work (one thread, sized to take about `--step-ms`, the length of a
decode step here) timed back to back for `--seconds`, pinned to one core, with nothing of ours
running beside it unless `--beside` asks. The work (`--work`):

  cache   float32 256x256 matmuls written in place: compute in the core's own caches
  memory  sums over a 128 MB float32 buffer: read from memory, as a decode step reads the
          weights and the KV cache
  decode  the real thing: the default model at the defaults (`LLMEngine`, one thread), six
          requests decoding, one `step()` a step (`--step-ms` does not apply)

What runs beside it (`--beside`), on the other core:

  idle     nothing else (the default)
  spin     a process spinning in registers (a core kept busy, no memory traffic)
  stream   a process summing a 128 MB buffer without pause (memory traffic only)
  prefill  the default model prefilling ~1.5k-token prompts back to back (`LLMEngine`, one
           thread, max_tokens 1): what a P/D prefill pool does beside the decode pool

Prints the steps' median, p99, worst, worst/median and how many steps were over 1.5x the median,
and the worst/median within each window of `--window` steps (a `bench/disaggregation.py` stream
decodes 200 tokens: 200 steps), so that a served run's worst/median can be read against what the machine itself
gives a loop that has no Python, no Redis and no other thread in it.

    python bench/core_jitter.py [--seconds 30] [--step-ms 11] [--core -1]
        [--work memory|cache|decode] [--beside idle|spin|stream|prefill]
        [--window 200] [--json out.json]
"""
from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import random_prompts, torch, write_json  # noqa: E402
from shared.cpu import cpu_flags  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402


DECODE_STREAMS = 6               # as bench/disaggregation.py's
PROMPT_TOKENS, LONG_PROMPT_TOKENS = 100, 1500


def neighbour(kind: str, core: int, ready, stop) -> None:
    """What runs beside the timed core: `kind` on `core` until `stop`; `ready` once it runs."""
    os.sched_setaffinity(0, {core})
    if kind == "spin":
        x = 0
        ready.set()
        while not stop.is_set():
            for _ in range(100_000):
                x += 1
    elif kind == "stream":
        read = piece("memory")
        ready.set()
        while not stop.is_set():
            for _ in range(32):
                read()
    else:                                       # prefill
        torch.set_num_threads(1)
        engine = default_engine()
        prompts = fresh_prompts(engine, LONG_PROMPT_TOKENS, seed=1)
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        ready.set()
        while not stop.is_set():
            engine.add_request(next(prompts), one)
            while engine.has_unfinished():
                engine.step()


def default_engine():
    from services.engine import LLMEngine
    from shared.engine_args import EngineArgs
    return LLMEngine(EngineArgs(), progress=False)


def fresh_prompts(engine, length: int, seed: int):
    """Endless prompts of random token ids (`random_prompts`), none found in a prefix cache."""
    vocab = engine.model_config.vocab_size
    return itertools.chain.from_iterable(
        random_prompts(16, length, length, vocab, seed=seed + 1000 * i) for i in itertools.count())


def measure_decode(seconds: float) -> np.ndarray:
    """The times of `step()` of an engine with DECODE_STREAMS requests decoding; a request
    that ends is replaced, and the steps that carry its prompt are not counted."""
    engine = default_engine()
    prompts = fresh_prompts(engine, PROMPT_TOKENS, seed=0)
    sampling = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    started: set[str] = set()              # requests past their first token
    steps = []
    end = time.perf_counter() + seconds
    while True:
        while engine.scheduler.num_running + engine.scheduler.num_waiting < DECODE_STREAMS:
            engine.add_request(next(prompts), sampling)
        t = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        if all(out.request_id in started for out in outputs) and \
                len(outputs) == DECODE_STREAMS:
            steps.append((now - t) * 1e3)    # decodes only
        started.update(out.request_id for out in outputs)
        if now > end:
            return np.array(steps)


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
    ap.add_argument("--work", choices=("cache", "memory", "decode"), default="memory")
    ap.add_argument("--beside", choices=("idle", "spin", "stream", "prefill"), default="idle")
    ap.add_argument("--window", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    core = cores[args.core]
    other = next((c for c in cores if c != core), None)
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {core})
    spawn = multiprocessing.get_context("spawn")
    stop, ready = spawn.Event(), spawn.Event()
    beside = None
    if args.beside != "idle" and other is not None:
        beside = spawn.Process(target=neighbour, args=(args.beside, other, ready, stop),
                               daemon=True)
        beside.start()
        if not ready.wait(600):
            sys.exit(f"the {args.beside} process beside did not start")
    try:
        steps = measure_decode(args.seconds) if args.work == "decode" else \
            measure(args.work, args.seconds, args.step_ms)
        result = summary(steps, args.window)
    finally:
        stop.set()
        if beside is not None:
            beside.join(30)
            if beside.is_alive():
                beside.kill()
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
