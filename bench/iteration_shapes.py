"""What one iteration costs, by its shape: the worker's measured forward time (the online cost
model's input, docs/design.md#the-online-cost-model) over a grid of decode rows and prefill
rows, on the in-process engine at the served defaults (or the flags given).

For each decode batch b and prefill chunk n: b decode streams are started, timed for a few
pure-decode iterations, then a prompt of several chunks of n rows rides along with them
(fixed token budget b + n, so every mixed iteration is b decodes + n prefill rows). Every
timed iteration's chunks and forward_ms go to --json, for fitting cost models offline
(`python bench/iteration_shapes.py --fit runs.json` fits the online model to a saved run).

    python bench/iteration_shapes.py [--decodes 1,8,16,24,32,64] [--prefill 0,16,64,256,512]
        [--dtype auto] [--quantization auto] [--json out.json]
    python bench/iteration_shapes.py --fit out.json [--wide-from-rows 24]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import print_table, random_prompts, write_json  # noqa: E402
from shared.engine_args import EngineArgs  # noqa: E402
from shared.online_cost import OnlineIterationCost  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402


def timed_iterations(engine, batch: int, chunk: int, args, vocab: int, avoid) -> list[dict]:
    """b streams, a few pure decodes, then a prompt in chunks of `chunk` rows beside them."""
    from scheduler_svc.build import build_scheduler

    config = replace(engine.layout.scheduler_config, enable_chunked_prefill=True,
                     max_num_batched_tokens=max(batch * 48, batch + chunk), target_tbt_ms=None,
                     target_tbt_factor=None, target_ttft_ms=None, target_ttft_factor=None,
                     max_iteration_ms=None, iteration_cost=None, max_num_seqs=max(batch + 1, 8))
    engine.scheduler = build_scheduler(replace(engine.layout, scheduler_config=config))
    sp = SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True)
    streams = [engine.add_request(p, sp) for p in random_prompts(batch, 16, 48, vocab, batch, avoid)]
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler._running) \
            or engine.scheduler._waiting:
        engine.step()
    out = []

    def step(label: str) -> None:
        plan = engine.scheduler.schedule()
        chunks = [(plan.num_scheduled_tokens[r.request_id],
                   r.num_computed_tokens + plan.num_scheduled_tokens[r.request_id])
                  for r in [*plan.new_requests, *plan.cached_requests]]
        result = engine.runner.execute(plan)
        engine.scheduler.update(plan, result)
        out.append({"kind": label, "decodes": batch, "prefill_rows": sum(q for q, _ in chunks if q > 1),
                    "chunks": chunks, "forward_ms": result.forward_ms,
                    "wide_from_rows": result.wide_from_rows})

    for _ in range(args.decode_iterations):
        step("decode")
    if chunk:
        engine.scheduler.config = replace(engine.scheduler.config,
                                          max_num_batched_tokens=batch + chunk)
        long_prompt = random_prompts(1, chunk * args.chunks, chunk * args.chunks, vocab, 7, avoid)[0]
        engine.add_request(long_prompt, SamplingParams(max_tokens=1, temperature=0.0))
        for _ in range(args.chunks):
            step("mixed" if batch else "prefill")
    for rid in streams:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return out


def fit(iterations: list[dict], widening: bool = True,
        wide_from_rows: int | None = None) -> OnlineIterationCost:
    """The online model after every iteration in the order measured (as a scheduler learns,
    without forgetting); `widening=False`: without the widening threshold (the four-coefficient
    model); `wide_from_rows` where the file does not record what the worker reported."""
    model = OnlineIterationCost(forgetting=1.0)
    for it in iterations:
        model.observe([tuple(c) for c in it["chunks"]], it["forward_ms"],
                      it.get("wide_from_rows", wide_from_rows) if widening else None)
    return model


def mean_error(iterations: list[dict], model: OnlineIterationCost) -> float:
    return statistics.mean(abs(model.iteration_ms([tuple(c) for c in it["chunks"]])
                               - it["forward_ms"]) / it["forward_ms"] for it in iterations)


def summary(iterations: list[dict], model: OnlineIterationCost | None) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for it in iterations:
        groups.setdefault((it["decodes"], it["prefill_rows"]), []).append(it)
    rows = []
    for (b, n), its in sorted(groups.items()):
        ms = statistics.median(it["forward_ms"] for it in its)
        row = {"decodes": b, "prefill_rows": n, "iterations": len(its), "forward_ms": ms}
        if model is not None:
            row["fit_ms"] = statistics.median(model.iteration_ms([tuple(c) for c in it["chunks"]])
                                              for it in its)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decodes", default="1,4,8,16,23,24,32,64")
    ap.add_argument("--prefill", default="0,8,16,32,64,128,256,512")
    ap.add_argument("--decode-iterations", type=int, default=4)
    ap.add_argument("--chunks", type=int, default=3, help="prefill chunks timed per (b, n)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--json", default=None)
    ap.add_argument("--fit", default=None, help="fit a saved --json run instead of measuring")
    ap.add_argument("--wide-from-rows", type=int, default=None,
                    help="with --fit: the worker's widening threshold, where the file lacks it")
    args = ap.parse_args()
    if args.fit:
        import json
        with open(args.fit) as f:
            iterations = json.load(f)["iterations"]
    else:
        from services.engine import LLMEngine
        engine = LLMEngine(EngineArgs(dtype=args.dtype, quantization=args.quantization),
                           progress=False)
        vocab, avoid = engine.model_config.vocab_size, tuple(engine.model_config.eos_token_ids)
        engine.generate(random_prompts(2, 512, 512, vocab, 99, avoid),
                        [SamplingParams(max_tokens=4, temperature=0.0)] * 2)      # warm-up
        iterations = []
        for b in [int(x) for x in args.decodes.split(",")]:
            for n in [int(x) for x in args.prefill.split(",")]:
                if b or n:
                    iterations += timed_iterations(engine, b, n, args, vocab, avoid)
        print(f"{engine.args.dtype}, quantization {engine.args.quantization}, "
              f"torch threads {__import__('torch').get_num_threads()}")
    model, plain = fit(iterations, wide_from_rows=args.wide_from_rows), fit(iterations, False)
    print_table(summary(iterations, model),
                ["decodes", "prefill_rows", "iterations", "forward_ms", "fit_ms"])
    print(f"least squares over every iteration (no forgetting), widening from "
          f"{model.wide_from_rows} rows: {model.coefficients_ms}")
    print(f"mean |error| of that fit: {mean_error(iterations, model):.1%}; of the four "
          f"coefficients without the widening terms: {mean_error(iterations, plain):.1%}")
    write_json(args.json, {"iterations": iterations, "args": vars(args),
                           "coefficients_ms": model.coefficients_ms,
                           "wide_from_rows": model.wide_from_rows,
                           "mean_abs_error": mean_error(iterations, model),
                           "mean_abs_error_four_coefficients": mean_error(iterations, plain)})


if __name__ == "__main__":
    main()
