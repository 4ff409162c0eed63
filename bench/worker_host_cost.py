"""Where a decode iteration's time goes on the worker: host work (plan bookkeeping, inputs,
attention metadata, sampling, the update after it) against the model's forward.

A batch of `--batch` requests (random ~`--input-len`-token prompts) is prefilled, then
`--steps` decode iterations are timed phase by phase (ModelRunner.execute's parts, wrapped
here by timers; the scheduler's schedule() and update() beside them for context). Each
phase's median over the steps is printed, in ms per iteration. The token-gap target is held
off by default (`--target-tbt-ms off`): at `auto` a loaded machine's measured forwards made the
schedule decode a few rows an iteration, and `--batch 32` timed 4-5 of them. The rows each
timed iteration decoded are printed; fewer than `--batch` is said.

    python bench/worker_host_cost.py [--batch 32] [--steps 40] [--dtype bfloat16] [--temperature 1]
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import engine_arg_parser, random_prompts, write_json  # noqa: E402  (OpenMP policy first)
import gpu_worker.model_runner as model_runner  # noqa: E402
from services.engine import LLMEngine  # noqa: E402
from shared.engine_args import EngineArgs, parse_latency_target  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402

PHASES = ("schedule", "apply plan", "inputs", "attention metadata", "forward", "sampling",
          "after sampling", "update")


class Timers:
    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[name] += (time.perf_counter() - t) * 1e3
        return timed

    def end_step(self) -> None:
        self.steps.append(dict(self.current))
        self.current.clear()


def main() -> None:
    ap = engine_arg_parser(__doc__)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=150)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0 (default): greedy; above it every row is drawn (the API's default is 1)")
    ap.set_defaults(target_tbt_ms=parse_latency_target("off"))
    args = ap.parse_args()
    engine = LLMEngine(EngineArgs.from_cli(args), progress=False)
    runner, sched = engine.runner, engine.scheduler
    timers = Timers()
    for name, owner, attr in (("apply plan", runner, "_apply"), ("inputs", runner, "_inputs"),
                              ("forward", runner.model, "forward"),
                              ("sampling", runner.sampler, "sample"),
                              ("schedule", sched, "schedule"), ("update", sched, "update")):
        setattr(owner, attr, timers.wrap(name, getattr(owner, attr)))
    model_runner.build_attention_metadata = timers.wrap(
        "attention metadata", model_runner.build_attention_metadata)
    execute = runner.execute

    def timed_execute(plan):
        t = time.perf_counter()
        result = execute(plan)
        timers.current["execute"] += (time.perf_counter() - t) * 1e3
        return result
    runner.execute = timed_execute

    prompts = random_prompts(args.batch, args.input_len, args.input_len,
                             engine.model_config.vocab_size, seed=0,
                             avoid=engine.model_config.eos_token_ids)
    sp = SamplingParams(max_tokens=args.steps + 8, temperature=args.temperature, ignore_eos=True)
    ids = {engine.add_request(p, sp) for p in prompts}
    started: set[str] = set()
    while started != ids:                   # the prefills
        started.update(o.request_id for o in engine.step())
    for _ in range(4):
        engine.step()                       # warm decodes
    timers.steps.clear()
    timers.current.clear()
    rows = []
    for _ in range(args.steps):
        rows.append(len(engine.step()))
        timers.end_step()

    med = {name: statistics.median(s.get(name, 0.0) for s in timers.steps)
           for name in (*PHASES, "execute")}
    named = sum(med[n] for n in ("apply plan", "inputs", "attention metadata", "forward",
                                 "sampling"))
    med["after sampling"] = max(0.0, med["execute"] - named)
    total = med["execute"] + med["schedule"] + med["update"]
    print(f"batch {args.batch} decodes, median over {args.steps} iterations (ms):")
    if statistics.median(rows) < args.batch:
        print(f"  (the iterations decoded {min(rows)}-{max(rows)} rows, median "
              f"{statistics.median(rows):g}, not {args.batch}: the schedule held the batch back)")
    for name in PHASES:
        print(f"  {name:20s} {med[name]:8.2f}  {100 * med[name] / total:5.1f} %")
    host = total - med["forward"]
    print(f"  host work outside the forward: {host:.2f} ms of {total:.2f} ms "
          f"({100 * host / total:.1f} %)")
    write_json(args.json, {"batch": args.batch, "steps": args.steps, "median_ms": med,
                           "rows": rows})
    engine.shutdown()


if __name__ == "__main__":
    main()
