"""Interference, measured: steady decode streams while ~1.5k-token prompts arrive
(docs/design.md#why-chunked-prefill).

The default model in the in-process engine. Each run starts `--streams` decode streams (short
prompts, long outputs, EOS ignored) and adds a long prompt at fixed iterations; every token is
stamped with the wall clock when the iteration that sampled it returns. Three modes alternate
on the same engine and weights: ORCA only (`--no-chunked-prefill`), chunked prefill at a fixed
token budget (`--target-tbt-ms off`), and the serving defaults (chunked, with the token-gap
target `--target-tbt-ms auto` and the iteration-cost model fitted online, kept across runs as
a server keeps it). Reported per mode: median and worst inter-token gap of the decode streams,
the long prompts' TTFT; per iteration kind, how far the calibrated roofline's prediction and
the online fit's are from the measured iteration time.

    python bench/interference.py [--repeats 2] [--dtype auto] [--quantization auto] [--hw hw.json]
        [--json out.json]
        [--plot docs/interference.png] [--max-num-batched-tokens N] [--max-iteration-ms MS]

Without --hw it runs `pacer calibrate --quick` in-process first.

`--throughput-repeats N` adds, on the same engine afterwards, what the token-gap target costs in
throughput: the concurrency-32 workload (32 prompts of ~100 tokens at once, 64 new tokens each,
EOS ignored) at the fixed budget (`--target-tbt-ms off`) and at the defaults (`auto`),
alternated A, B, N times; output tokens per second of each.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from bench.common import print_table, random_prompts, write_json  # noqa: E402
from shared.config import AUTO_TBT_FACTOR  # noqa: E402
from scheduler_svc.cost_replay import iteration_kind, prediction_errors  # noqa: E402
from shared.cost_model import RooflineCost, model_shape_of  # noqa: E402
from shared.online_cost import OnlineIterationCost  # noqa: E402
from scheduler_svc.build import build_scheduler  # noqa: E402
from services.engine import LLMEngine  # noqa: E402
from shared.engine_layout import DTYPE_BYTES  # noqa: E402
from shared.engine_args import EngineArgs  # noqa: E402
from shared.hardware import hardware_from_dict, load_hardware  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402

MODES = ("orca", "budget", "default")
LONG_SPREAD = 100            # the long prompts' lengths: --long-len, give or take this many


@dataclass
class Run:
    mode: str
    token_times: dict[str, list[float]] = field(default_factory=dict)   # request -> stamps
    added_at: dict[str, float] = field(default_factory=dict)
    iterations: list[dict] = field(default_factory=list)  # start_s, ms, chunks, kind


def one_step(engine: LLMEngine, run: Run, t0: float) -> None:
    """`LLMEngine.step()` spelled out so that the plan's chunks are seen for the cost model."""
    start = time.perf_counter()
    plan = engine.scheduler.schedule()
    latency = engine.scheduler.last_latency_budget       # what that plan was made to
    chunks = [(plan.num_scheduled_tokens[r.request_id],
               r.num_computed_tokens + plan.num_scheduled_tokens[r.request_id])
              for r in [*plan.new_requests, *plan.cached_requests]]
    cost = engine.scheduler.config.iteration_cost
    predicted_ms = cost.iteration_ms(chunks) if cost is not None and chunks else None
    result = engine.runner.execute(plan)
    outputs = engine.scheduler.update(plan, result)
    now = time.perf_counter()
    for out in outputs:
        if out.new_tokens:
            run.token_times.setdefault(out.request_id, []).append(now - t0)
    if chunks:
        run.iterations.append({"start_s": start - t0, "ms": (now - start) * 1e3,
                               "forward_ms": result.forward_ms,
                               "wide_from_rows": result.wide_from_rows, "chunks": chunks,
                               "kind": iteration_kind(chunks), "predicted_ms": predicted_ms,
                               "budget_ms": latency.budget_ms if latency else None})


def mode_config(base, mode: str, online: OnlineIterationCost):
    """The scheduler configuration of one mode, on the engine's own budgets."""
    if mode == "orca":
        return replace(base, enable_chunked_prefill=False, target_tbt_factor=None,
                       target_tbt_ms=None)
    if mode == "budget":
        return replace(base, enable_chunked_prefill=True, target_tbt_factor=None,
                       target_tbt_ms=None)
    return replace(base, enable_chunked_prefill=True, target_tbt_factor=AUTO_TBT_FACTOR,
                   target_tbt_ms=None, iteration_cost=online)


def use_mode(engine: LLMEngine, mode: str, online: OnlineIterationCost) -> None:
    """Give the idle engine a scheduler configured for `mode`."""
    old = engine.scheduler                  # idle: one empty plan tells the runner which
    plan = old.schedule()                   # requests it finished last, then the policy swaps
    old.update(plan, engine.runner.execute(plan))
    base = engine.layout.scheduler_config
    if mode != "default" and base.max_iteration_ms is None:   # (a colocated engine has no
        base = replace(base, iteration_cost=None,                # TTFT goal: build_scheduler)
                       target_ttft_ms=None, target_ttft_factor=None)
    layout = replace(engine.layout, scheduler_config=mode_config(base, mode, online))
    engine.scheduler = build_scheduler(layout)


def run_mode(engine: LLMEngine, mode: str, args: argparse.Namespace, vocab: int,
             avoid: tuple[int, ...], seed: int, online: OnlineIterationCost) -> Run:
    """One run: the streams, long prompts at fixed iterations, until everything finished."""
    use_mode(engine, mode, online)
    stream_prompts = random_prompts(args.streams, 16, 48, vocab, seed, avoid)
    long_prompts = random_prompts(len(args.long_at), args.long_len - LONG_SPREAD,
                                  args.long_len + LONG_SPREAD, vocab, seed + 1, avoid)
    decode_sp = SamplingParams(max_tokens=args.stream_tokens, temperature=0.0, ignore_eos=True)
    long_sp = SamplingParams(max_tokens=args.long_tokens, temperature=0.0, ignore_eos=True)
    run = Run(mode)
    t0 = time.perf_counter()
    for i, p in enumerate(stream_prompts):
        engine.add_request(p, decode_sp, request_id=f"s{i}")
        run.added_at[f"s{i}"] = 0.0
    step = 0
    while engine.has_unfinished():
        for j, at in enumerate(args.long_at):
            if step == at:
                engine.add_request(long_prompts[j], long_sp, request_id=f"long{j}")
                run.added_at[f"long{j}"] = time.perf_counter() - t0
        one_step(engine, run, t0)
        step += 1
    return run


def run_throughput(engine: LLMEngine, mode: str, args: argparse.Namespace, vocab: int,
                   avoid: tuple[int, ...], seed: int, online: OnlineIterationCost) -> dict:
    """The concurrency-32 workload in `mode`: every prompt at once, until all are done."""
    use_mode(engine, mode, online)
    prompts = random_prompts(args.throughput_prompts, 90, 110, vocab, 1000 + seed, avoid)
    sp = SamplingParams(max_tokens=args.throughput_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = engine.generate(prompts, [sp] * len(prompts))
    seconds = time.perf_counter() - start
    tokens = sum(len(o.tokens) for o in outputs)
    return {"mode": mode, "repeat": seed, "seconds": seconds, "output_tokens": tokens,
            "output_tok_per_s": tokens / seconds}


def gaps_ms(run: Run, prefix: str) -> np.ndarray:
    return np.concatenate([np.diff(t) * 1e3 for rid, t in run.token_times.items()
                           if rid.startswith(prefix) and len(t) > 1] or [np.empty(0)])


def summarize(run: Run) -> dict:
    gaps = gaps_ms(run, "s")
    ttft = [(run.token_times[r][0] - run.added_at[r]) * 1e3 for r in run.token_times
            if r.startswith("long")]
    return {"mode": run.mode, "gap_median_ms": float(np.median(gaps)),
            "gap_p99_ms": float(np.percentile(gaps, 99)), "gap_max_ms": float(gaps.max()),
            "gap_max_over_median": float(gaps.max() / np.median(gaps)),
            "long_ttft_median_ms": float(np.median(ttft)), "long_ttft_max_ms": float(max(ttft)),
            "iterations": len(run.iterations)}


def cost_model_error(runs: list[Run], cost) -> list[dict]:
    """Per iteration kind: the median absolute percentage error of the prediction, and the
    median measured / predicted (how far the machine runs from the model); `cost` as it is
    now (the online fit is not taught again: it learned during the runs)."""
    its = [(it["chunks"], it["ms"]) for r in runs for it in r.iterations]
    predicted = np.array([cost.iteration_ms(chunks) for chunks, _ in its])
    return [row for row in prediction_errors(its, predicted) if row["kind"] != "all"]


def hardware(args: argparse.Namespace):
    if args.hw:
        return load_hardware(args.hw), None
    from services.calibrate_cmd import calibrate
    profile = calibrate(quick=True, device="cpu")
    return hardware_from_dict(profile), profile


def plot(runs: list[Run], cost: RooflineCost, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    colours = {"orca": "C0", "budget": "C1", "default": "C2"}
    for run in runs[:len(MODES)]:              # the first run of each mode
        streams = [t for rid, t in sorted(run.token_times.items())
                   if rid.startswith("s") and len(t) > 1]
        for i, t in enumerate(streams):
            left.plot(t[1:], np.diff(t) * 1e3, ".", ms=3,
                      color=colours[run.mode],
                      label=run.mode if i == 0 else None)
        for rid, at in run.added_at.items():
            if rid.startswith("long"):
                left.axvline(at, color=colours[run.mode], ls=":", lw=0.8)
    left.set(yscale="log", xlabel="wall time since start (s)", ylabel="decode inter-token gap (ms)",
             title="decode streams (dotted: a long prompt arrives)")
    for kind, colour in (("decode", "C3"), ("mixed", "C4"), ("prefill", "C5")):
        its = [it for r in runs for it in r.iterations if it["kind"] == kind]
        if its:
            right.scatter([cost.iteration_ms(it["chunks"]) for it in its],
                          [it["ms"] for it in its], s=6, color=colour, label=kind)
    lo, hi = right.get_xlim()[0], max(right.get_ylim()[1], right.get_xlim()[1])
    right.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="measured = predicted")
    right.set(xscale="log", yscale="log", xlabel="roofline prediction (ms)",
              ylabel="measured iteration (ms)", title=f"cost model vs measured ({cost.hw.name})")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-tokens", type=int, default=40)
    ap.add_argument("--long-len", type=int, default=1500)
    ap.add_argument("--long-tokens", type=int, default=4)
    ap.add_argument("--long-at", default="8,24", help="iterations at which long prompts arrive")
    ap.add_argument("--repeats", type=int, default=2, help="A, B pairs")
    ap.add_argument("--hw", default=None, help="hardware JSON (default: calibrate --quick now)")
    ap.add_argument("--dtype", default="auto", help="as pacer up (default auto)")
    ap.add_argument("--quantization", default="auto", help="as pacer up (default auto)")
    ap.add_argument("--max-num-batched-tokens", type=int,
                    default=EngineArgs.max_num_batched_tokens, help="as pacer up")
    ap.add_argument("--max-iteration-ms", type=float, default=None,
                    help="as pacer up: cap each iteration's predicted time (chunked mode)")
    ap.add_argument("--throughput-repeats", type=int, default=0,
                    help="then the concurrency-32 throughput, fixed budget vs defaults, "
                         "alternated this many times (0: not run)")
    ap.add_argument("--throughput-prompts", type=int, default=32)
    ap.add_argument("--throughput-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    args.long_at = [int(x) for x in args.long_at.split(",")]
    if args.long_len <= LONG_SPREAD:
        ap.error(f"--long-len must be > {LONG_SPREAD} (the long prompts are {LONG_SPREAD} tokens "
                 f"either side of it), got {args.long_len}")

    hw, profile = hardware(args)
    hw_path = args.hw
    if args.max_iteration_ms is not None and hw_path is None:   # the engine reads a file
        hw_path = os.path.join(tempfile.mkdtemp(), "hw.json")
        write_json(hw_path, profile)
    engine = LLMEngine(EngineArgs(dtype=args.dtype, quantization=args.quantization,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_iteration_ms=args.max_iteration_ms, hw=hw_path),
                       progress=False)
    args.dtype = engine.args.dtype          # auto, resolved
    args.quantization = engine.runner.quantization
    cost = RooflineCost(model_shape_of(engine.model_config, "smollm2-135m"), hw,
                        DTYPE_BYTES[args.dtype])
    online = OnlineIterationCost()          # the serving default's model, learning all along
    vocab, avoid = engine.model_config.vocab_size, tuple(engine.model_config.eos_token_ids)
    warm = random_prompts(2, args.long_len, args.long_len, vocab, 99, avoid)
    engine.generate(warm, [SamplingParams(max_tokens=4, temperature=0.0)] * 2)   # warm-up
    runs = [run_mode(engine, mode, args, vocab, avoid, seed=rep, online=online)
            for rep in range(args.repeats) for mode in MODES]
    summaries = [summarize(r) | {"repeat": i // len(MODES)} for i, r in enumerate(runs)]
    errors = cost_model_error(runs, cost)
    online_errors = cost_model_error(runs, online)
    print(f"{args.streams} decode streams, {len(args.long_at)} prompts of ~{args.long_len} "
          f"tokens per run, budget {engine.scheduler_config.max_num_batched_tokens} rows"
          + (f" and {args.max_iteration_ms:g} ms per iteration" if args.max_iteration_ms else "")
          + ", "
          f"{args.dtype}, quantization {args.quantization}, "
          f"torch threads {__import__('torch').get_num_threads()}")
    print_table(summaries, ["repeat", "mode", "gap_median_ms", "gap_p99_ms", "gap_max_ms",
                            "gap_max_over_median", "long_ttft_median_ms", "long_ttft_max_ms",
                            "iterations"])
    by_mode = {m: [s for s in summaries if s["mode"] == m] for m in MODES}
    ratios = {
        "default_gap_max_over_median": float(np.median(
            [s["gap_max_over_median"] for s in by_mode["default"]])),
        "default_over_orca_long_ttft": float(np.median(
            [d["long_ttft_median_ms"] / o["long_ttft_median_ms"]
             for d, o in zip(by_mode["default"], by_mode["orca"])])),
        "orca_over_default_gap_max": float(np.median(
            [o["gap_max_ms"] / d["gap_max_ms"] for d, o in zip(by_mode["default"], by_mode["orca"])])),
        # against a gap with no prefill in it: ORCA's median is a pure-decode gap (its long
        # prompts take one iteration each), where the defaults' median may be a chunked one
        "default_gap_max_over_orca_gap_median": float(np.median(
            [d["gap_max_ms"] / o["gap_median_ms"]
             for d, o in zip(by_mode["default"], by_mode["orca"])])),
    }
    print("medians over repeats: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    print(f"\nroofline ({hw.name}) vs measured iteration time:")
    print_table(errors, ["kind", "iterations", "measured_median_ms", "predicted_median_ms",
                         "mape_pct", "measured_over_predicted"])
    print(f"\nonline fit vs measured iteration time (coefficients {online.coefficients_ms}):")
    print_table(online_errors, ["kind", "iterations", "measured_median_ms", "predicted_median_ms",
                                "mape_pct", "measured_over_predicted"])
    throughput = [run_throughput(engine, mode, args, vocab, avoid, seed=rep, online=online)
                  for rep in range(args.throughput_repeats) for mode in ("budget", "default")]
    if throughput:
        by = {m: [t["output_tok_per_s"] for t in throughput if t["mode"] == m]
              for m in ("budget", "default")}
        ratios["default_over_budget_throughput"] = float(np.median(
            [d / b for d, b in zip(by["default"], by["budget"])]))
        print(f"\nconcurrency {args.throughput_prompts}, ~100-token prompts x "
              f"{args.throughput_tokens} tokens, alternated:")
        print_table(throughput, ["repeat", "mode", "seconds", "output_tokens", "output_tok_per_s"])
        print(f"default / fixed budget throughput (median of pairs): "
              f"{ratios['default_over_budget_throughput']:.3f}")
    write_json(args.json, {"runs": summaries, "ratios": ratios, "cost_model": errors,
                           "throughput": throughput,
                           "online_cost_model": online_errors,
                           "online_coefficients_ms": online.coefficients_ms,
                           "hardware": hw.to_dict() if profile is None else profile,
                           "args": vars(args),
                           "model": "smollm2-135m",
                           "iterations": {f"{r.mode}-{i // len(MODES)}": r.iterations
                                          for i, r in enumerate(runs)}})
    if args.plot:
        plot(runs, cost, args.plot)


if __name__ == "__main__":
    main()
