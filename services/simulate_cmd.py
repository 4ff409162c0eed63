"""`pacer simulate`: the scheduling core on a fake clock priced by the roofline cost model.

Why chunked prefill (docs/design.md#why-chunked-prefill), side by side (Llama-2-7B on H100,
steady decodes, a 100k-token prompt now and then; ORCA only vs chunked prefill under a
2048-row / 20 ms budget):

    pacer simulate --compare --model llama-2-7b --hw h100 --num-requests 3000 \\
        --request-rate 4 --prompt-len uniform:256:1024 --output-len uniform:128:512 \\
        --long-prompt-rate 0.005 --long-prompt-len 100000 --max-iteration-ms 20 --plot sim.png
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import fields, replace

from shared.config import SchedulerConfig, kv_block_bytes, num_blocks_for_memory
from shared.errors import PacerError

MODES = {"orca": False, "chunked": True}     # mode name -> enable_chunked_prefill


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate", help="simulate the scheduler with the cost model standing in for workers",
        description="Drive the real scheduling core with synthetic or traced arrivals; each "
                    "iteration advances a fake clock by its roofline time. Prints TTFT/TBT "
                    "distributions and throughput per mode.")
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=1000)
    w.add_argument("--request-rate", type=float, default=10.0,
                   help="requests/s (inf: all at t=0)")
    w.add_argument("--burstiness", type=float, default=1.0,
                   help="Gamma shape of the gaps: 1 is Poisson, smaller is burstier")
    w.add_argument("--prompt-len", default="uniform:128:1024",
                   help="N | uniform:LO:HI | lognormal:MEDIAN:SIGMA[:MAX]")
    w.add_argument("--output-len", default="uniform:32:256", help="as --prompt-len")
    w.add_argument("--long-prompt-rate", type=float, default=0.0,
                   help="a second Poisson stream of long prompts, in requests per "
                        "simulated second (0.005: one every 200 s; 0: none)")
    w.add_argument("--long-prompt-len", default="100000", help="their prompt length spec")
    w.add_argument("--long-output-len", default="16", help="their output length spec")
    w.add_argument("--trace", default=None,
                   help='JSONL of {"arrival_s", "prompt_len", "output_len"} (replaces the above)')
    w.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("model, hardware and scheduler")
    s.add_argument("--model", default="llama-2-7b",
                   help="llama-2-7b, llama-2-13b, llama-3-8b, smollm2-135m, or a config.json")
    s.add_argument("--hw", default="h100", help="h100, h200, a100, or a `pacer calibrate` JSON")
    s.add_argument("--dtype-bytes", type=float, default=2.0, help="weight and KV element size")
    s.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget (default 2048, a GPU-sized one)")
    s.add_argument("--max-num-seqs", type=int, default=256)
    s.add_argument("--max-iteration-ms", type=float, default=None,
                   help="latency budget: cut prefill chunks to fit this many ms")
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks (overrides --kv-cache-memory)")
    s.add_argument("--kv-cache-memory", default="60GiB", help="KV pool size, e.g. 60GiB")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the longest request of the workload)")
    m = p.add_argument_group("modes and output")
    m.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                   help="ORCA only: whole prompts in one iteration")
    m.add_argument("--compare", action="store_true",
                   help="run ORCA only and chunked prefill on the same arrivals")
    m.add_argument("--json", action="store_true", help="print one JSON object")
    m.add_argument("--timeline", default=None, help="write the per-iteration timeline JSON here")
    m.add_argument("--plot", default=None, help="draw TBT timeline and CDF to this PNG")
    p.set_defaults(run=run)
    return p


def build_arrivals(args: argparse.Namespace) -> list:
    from scheduler_svc.arrivals import occasional, read_trace, synthetic

    if args.trace:
        return read_trace(args.trace)
    if args.num_requests < 1:
        raise PacerError(f"--num-requests must be >= 1, got {args.num_requests}")
    arrivals = synthetic(args.num_requests, args.request_rate, args.burstiness,
                         args.prompt_len, args.output_len, args.seed)
    if args.long_prompt_rate > 0:
        until = arrivals[-1].arrival_s if math.isfinite(args.request_rate) else 0.0
        arrivals += occasional(args.long_prompt_rate, until, args.long_prompt_len,
                               args.long_output_len, args.seed)
    return sorted(arrivals, key=lambda a: a.arrival_s)


def scheduler_config(args: argparse.Namespace, model, arrivals, cost) -> SchedulerConfig:
    num_blocks = args.num_kv_blocks or num_blocks_for_memory(
        args.kv_cache_memory, int(kv_block_bytes(model.num_layers, model.num_kv_heads,
                                                 model.head_dim, args.block_size,
                                                 args.dtype_bytes)))
    longest = max(a.prompt_len + a.output_len for a in arrivals)
    return SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        num_kv_blocks=num_blocks, block_size=args.block_size,
        max_model_len=args.max_model_len or longest,
        enable_chunked_prefill=args.enable_chunked_prefill,
        max_iteration_ms=args.max_iteration_ms,
        iteration_cost=cost if args.max_iteration_ms is not None else None)


def run(args: argparse.Namespace) -> int:
    from scheduler_svc.sim_report import format_table, summarize
    from scheduler_svc.simulator import simulate
    from shared.cost_model import RooflineCost, load_model_shape
    from shared.hardware import load_hardware

    try:
        if not args.dtype_bytes > 0:
            raise PacerError(f"--dtype-bytes must be > 0, got {args.dtype_bytes}")
        model, hw = load_model_shape(args.model), load_hardware(args.hw)
        cost = RooflineCost(model, hw, args.dtype_bytes)
        arrivals = build_arrivals(args)
        config = scheduler_config(args, model, arrivals, cost)
    except PacerError as e:
        print(f"pacer simulate: error: {e}", file=sys.stderr)
        return 2
    modes = list(MODES) if args.compare else [
        next(k for k, v in MODES.items() if v == config.enable_chunked_prefill)]
    results = [simulate(arrivals, replace(config, enable_chunked_prefill=MODES[mode]), cost, mode)
               for mode in modes]
    summaries = [summarize(r) for r in results]
    _write_outputs(args, results)
    if args.json:
        print(json.dumps({"model": model.name, "hardware": hw.name,
                          "config": _config_dict(config),
                          "workload": _workload_dict(args, arrivals),
                          "modes": {s["mode"]: s for s in summaries}}, indent=2))
    else:
        print(f"{model.name} on {hw.name}: {len(arrivals)} requests, "
              f"{config.max_num_batched_tokens}-row budget"
              + (f", {config.max_iteration_ms:g} ms latency budget" if config.max_iteration_ms
                 else "") + f", {config.num_kv_blocks} KV blocks of {config.block_size}")
        print(format_table(summaries))
    return 0


def _write_outputs(args: argparse.Namespace, results: list) -> None:
    if args.timeline:
        with open(args.timeline, "w", encoding="utf-8") as f:
            json.dump({r.mode: r.timeline.to_dict() for r in results}, f)
    if args.plot:
        from scheduler_svc.sim_plot import plot
        plot(results, args.plot, title=f"{args.model} on {args.hw}")


def _config_dict(config: SchedulerConfig) -> dict:
    per_mode_or_object = ("iteration_cost", "enable_chunked_prefill")
    return {f.name: getattr(config, f.name) for f in fields(config)
            if f.name not in per_mode_or_object}


def _workload_dict(args: argparse.Namespace, arrivals: list) -> dict:
    keys = (["trace"] if args.trace else
            ["num_requests", "request_rate", "burstiness", "prompt_len", "output_len",
             "long_prompt_rate", "long_prompt_len", "long_output_len"])
    return {k: getattr(args, k) for k in keys} | {"seed": args.seed, "requests": len(arrivals)}
