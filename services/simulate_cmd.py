"""`pacer simulate`: the scheduling core on a fake clock priced by the roofline cost model.

Why chunked prefill (docs/design.md#why-chunked-prefill), side by side (Llama-2-7B on H100,
steady decodes, a 100k-token prompt now and then; ORCA only vs chunked prefill under a
2048-row / 20 ms budget):

    pacer simulate --compare --model llama-2-7b --hw h100 --num-requests 3000 \\
        --request-rate 4 --prompt-len uniform:256:1024 --output-len uniform:128:512 \\
        --long-prompt-rate 0.005 --long-prompt-len 100000 --max-iteration-ms 20 --plot sim.png

P/D disaggregation against colocated chunked prefill on as many GPUs, one run
(docs/design.md#pd-disaggregation-pricing-the-hop); `--sweep` repeats it over one knob:

    pacer simulate --disagg 1:1 --fabric ib-hdr --request-rate 2 \\
        --prompt-len uniform:2000:6000 --output-len uniform:128:512 --max-iteration-ms 20
    pacer simulate --disagg 1:1 --sweep request-rate=1,2,3,4 ...

The serving default's cost model and token-gap target (docs/design.md#the-online-cost-model):
the core plans with the online fit, seeded from the roofline, learning from the clock:

    pacer simulate --cost online --target-tbt-ms auto ...

The memory wall (docs/design.md#the-memory-wall): the KV pool as the device holds it, what
`--gpu-memory-utilization` of its memory leaves after the weights:

    pacer simulate --kv-cache-memory auto --prompt-len 16000 ...

How far each cost model is from a real run's measured iterations (the `iterations` of
`bench/interference.py --json`), the online fit learning as it goes:

    pacer simulate --replay docs/interference_defaults.json --model smollm2-135m
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, fields, replace

from services.bench_cmd import _json_safe
from services.cost_cmd import add_precision_args, check_count, precision_of, precision_text
from shared.config import (AUTO_TBT_FACTOR, AUTO_TBT_TEXT, SchedulerConfig, check_block_size,
                           num_blocks_for_memory)
from shared.engine_args import parse_latency_target
from shared.fabric import FABRIC_RANGE_TEXT, FABRICS
from shared.errors import PacerError
from shared.json_file import check_output_path

MODES = {"orca": False, "chunked": True}     # mode name -> enable_chunked_prefill
DEFAULT_MODEL, DEFAULT_HW = "llama-2-7b", "h100"
SWEEP_KNOBS = ("request-rate", "prompt-len", "output-len", "fabric")
# Goodput's SLOs: a second to the first token; every gap within ~5 pure-decode iterations of a
# 7B model on an H100 (a stall a reader notices).
DEFAULT_TTFT_SLO_MS = 1000.0
DEFAULT_TBT_SLO_MS = 50.0
# The most KV blocks a simulated pool may have: the core books each block in Python lists
# (~50 bytes a block), and --num-kv-blocks 100000000000 died of a MemoryError building them.
# 2**24 blocks of 16 tokens are 268M tokens, far past what max_num_seqs requests can fill.
MAX_SIM_KV_BLOCKS = 2**24
# The most requests a simulated workload may hold: 10**5 take ~45 s and ~0.8 GiB on one core;
# 10**11 (a typo) filled memory drawing the arrival times, as did a --long-prompt-rate whose
# stream would hold that many.
MAX_SIM_REQUESTS = 10**6
# The most instances a P/D run may simulate (P + D, and as many colocated): each holds its
# own core and KV pool, ~0.5 MB; --disagg 1:99999999999999 filled memory until the kernel
# killed the run.
MAX_SIM_INSTANCES = 1024
# The scheduler's own counts, bounded as `pacer cost` bounds its counts: a budget of 10**20
# was a ValueError traceback from the core (an islice past sys.maxsize).
COUNT_FLAGS = ("max_num_batched_tokens", "max_num_seqs", "max_model_len",
               "prefill_max_num_batched_tokens", "disagg_min_prompt_tokens")


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
                   help="N | uniform:LO:HI | lognormal:MEDIAN:SIGMA[:MAX], in tokens, at "
                        "most 2**24")
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
    s.add_argument("--model", default=None,
                   help="llama-2-7b (default), llama-2-13b, llama-3-8b, smollm2-135m, a .gguf "
                        "file, or a Hugging Face model folder or its config.json")
    s.add_argument("--hw", default=None,
                   help="h100 (default), h200, a100, or a `pacer calibrate` JSON; with --replay "
                        "the profile the file records, if any")
    s.add_argument("--dtype-bytes", type=float, default=None,
                   help="activation element size, and the weights' and the KV cache's unless "
                        "given apart (default 2; with --replay the run's)")
    add_precision_args(s)
    s.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget (default 2048, a GPU-sized one)")
    s.add_argument("--max-num-seqs", type=int, default=256)
    s.add_argument("--max-iteration-ms", type=float, default=None,
                   help="latency budget: cut prefill chunks to fit this many ms")
    s.add_argument("--target-tbt-ms", default="off", type=parse_latency_target,
                   help="token-gap target while decodes run, as the served flag: auto "
                        f"({AUTO_TBT_TEXT}), ms, or "
                        "off (default)")
    s.add_argument("--cost", default="roofline", choices=("roofline", "online"),
                   help="the cost model the core plans with: the roofline of --hw (default), "
                        "or the served default's online fit, seeded from that roofline and "
                        "learning from each iteration's time on the clock")
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks (overrides --kv-cache-memory); at most 2**24")
    s.add_argument("--kv-cache-memory", default="60GiB",
                   help="KV pool size per instance, e.g. 60GiB (default), or auto: what "
                        "--gpu-memory-utilization of the profile's memory leaves after the "
                        "weights and a forward's activations")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="with --kv-cache-memory auto: the share of the device's memory used")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the longest request of the workload)")
    m = p.add_argument_group("modes and output")
    m.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                   help="ORCA only: whole prompts in one iteration")
    m.add_argument("--compare", action="store_true",
                   help="run ORCA only and chunked prefill on the same arrivals")
    d = p.add_argument_group("P/D disaggregation (docs/design.md#pd-disaggregation-pricing-the-hop)")
    d.add_argument("--disagg", default=None, metavar="P:D",
                   help="P prefill and D decode instances, the KV of every prompt moved "
                        "between them, against P+D colocated chunked-prefill instances")
    d.add_argument("--fabric", default="ib-hdr",
                   help=f"{', '.join(FABRICS)} or a bandwidth {FABRIC_RANGE_TEXT} "
                        "(default ib-hdr)")
    d.add_argument("--no-layer-streaming", dest="layer_streaming", action="store_false",
                   help="send a prompt's K/V only once its prefill is over")
    d.add_argument("--prefill-max-num-batched-tokens", type=int, default=None,
                   help="the prefill instances' token budget (default: --max-num-batched-tokens; "
                        "no latency budget there, no decode waits on them)")
    d.add_argument("--disagg-min-prompt-tokens", type=int, default=0,
                   help="prompts shorter than this are prefilled by a decode instance itself, "
                        "as the served system's flag (default 0: every prompt goes over)")
    d.add_argument("--ttft-slo-ms", type=float, default=DEFAULT_TTFT_SLO_MS,
                   help=f"goodput counts requests whose TTFT is within this "
                        f"(default {DEFAULT_TTFT_SLO_MS:g})")
    d.add_argument("--tbt-slo-ms", type=float, default=DEFAULT_TBT_SLO_MS,
                   help=f"...and whose every token gap is within this (default {DEFAULT_TBT_SLO_MS:g})")
    d.add_argument("--sweep", default=None, metavar="KNOB=V1,V2,...",
                   help=f"with --disagg: one run per value of a knob ({', '.join(SWEEP_KNOBS)}), "
                        "a table of both modes' goodput and tails; --plot draws it")
    m.add_argument("--replay", default=None, metavar="FILE.json",
                   help="instead of a simulation: each cost model's prediction against the "
                        "measured iterations ({chunks, ms}) of a real run, e.g. the JSON of "
                        "bench/interference.py")
    m.add_argument("--json", action="store_true", help="print one JSON object")
    m.add_argument("--timeline", default=None, help="write the per-iteration timeline JSON here")
    m.add_argument("--plot", default=None, help="draw TBT timeline and CDF to this PNG")
    p.set_defaults(run=run)
    return p


def build_arrivals(args: argparse.Namespace) -> list:
    from scheduler_svc.arrivals import occasional, read_trace, synthetic

    if args.trace:
        return read_trace(args.trace)
    if not 1 <= args.num_requests <= MAX_SIM_REQUESTS:
        raise PacerError(f"--num-requests must be from 1 to {MAX_SIM_REQUESTS:,}, got {args.num_requests:,}")
    arrivals = synthetic(args.num_requests, args.request_rate, args.burstiness,
                         args.prompt_len, args.output_len, args.seed)
    if not 0 <= args.long_prompt_rate < math.inf:      # nan or below 0 read as none
        raise PacerError("--long-prompt-rate must be a finite number >= 0 (0: none), got "
                         f"{args.long_prompt_rate}")
    if args.long_prompt_rate > 0:
        # The long stream runs over the main one's arrivals, which rate inf puts all at t=0.
        if math.isinf(args.request_rate):
            raise PacerError("--long-prompt-rate runs over the main stream's arrivals, and "
                             "--request-rate inf sends them all at t=0: give a finite rate")
        expected = args.long_prompt_rate * arrivals[-1].arrival_s
        if expected > MAX_SIM_REQUESTS:
            raise PacerError(f"--long-prompt-rate {args.long_prompt_rate:g} over the main "
                             f"stream's {arrivals[-1].arrival_s:.3g} s is ~{expected:.3g} "
                             f"requests: a workload holds at most {MAX_SIM_REQUESTS:,}")
        arrivals += occasional(args.long_prompt_rate, arrivals[-1].arrival_s,
                               args.long_prompt_len, args.long_output_len, args.seed)
    return sorted(arrivals, key=lambda a: a.arrival_s)


def kv_pool_memory(args: argparse.Namespace, model, cost) -> str | int:
    """--kv-cache-memory (per rank, as served), or with `auto` what the device holds for K/V
    (docs/design.md#the-memory-wall)."""
    if args.kv_cache_memory != "auto":
        return args.kv_cache_memory
    from shared.cost_model import kv_capacity
    return kv_capacity(model, cost.hw, cost.precision, args.gpu_memory_utilization,
                       args.max_num_batched_tokens, args.max_num_seqs).kv_bytes


def scheduler_config(args: argparse.Namespace, model, arrivals, cost) -> SchedulerConfig:
    """`cost` is the roofline the clock runs on; the core plans with it, or with an online fit
    seeded from it (--cost online)."""
    block_bytes = cost.precision.kv_block_bytes(model, args.block_size)
    if block_bytes < 1:
        raise PacerError(f"a KV block of {args.block_size} tokens at --kv-bytes "
                         f"{cost.kv_bytes:g} holds less than a byte: raise either")
    num_blocks = args.num_kv_blocks or num_blocks_for_memory(
        kv_pool_memory(args, model, cost), block_bytes)
    if num_blocks > MAX_SIM_KV_BLOCKS:
        raise PacerError(f"a KV pool of {num_blocks:,} blocks: the simulator holds at most "
                         f"2**24 ({MAX_SIM_KV_BLOCKS:,}); lower --num-kv-blocks or "
                         "--kv-cache-memory, or raise --block-size")
    longest = max(a.prompt_len + a.output_len for a in arrivals)
    tbt = args.target_tbt_ms
    budgeted = args.max_iteration_ms is not None or tbt != "off"
    return SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        num_kv_blocks=num_blocks, block_size=args.block_size,
        max_model_len=args.max_model_len or longest,
        enable_chunked_prefill=args.enable_chunked_prefill,
        max_iteration_ms=args.max_iteration_ms,
        target_tbt_ms=None if tbt in ("auto", "off") else float(tbt),
        target_tbt_factor=AUTO_TBT_FACTOR if tbt == "auto" else None,
        iteration_cost=planning_cost(args, cost) if budgeted else None)


def planning_cost(args: argparse.Namespace, cost):
    """The model the core plans with (each simulated scheduler gets its own fresh copy of an
    online one: scheduler_svc/simulator.py)."""
    if args.cost == "online":
        from shared.online_cost import OnlineIterationCost
        return OnlineIterationCost.seeded_from(cost)
    return cost


def run(args: argparse.Namespace) -> int:
    from shared.cost_model import Precision, RooflineCost, load_model_shape
    from shared.hardware import load_hardware

    if args.replay:
        if args.tp != 1 or args.weight_bytes is not None or args.kv_bytes is not None:
            print("pacer simulate: error: --replay prices the recorded run as it ran: leave "
                  "out --tp, --weight-bytes and --kv-bytes", file=sys.stderr)
            return 2
        from services.replay_cmd import run_replay
        return run_replay(args)
    args.model, args.hw = args.model or DEFAULT_MODEL, args.hw or DEFAULT_HW
    args.dtype_bytes = 2.0 if args.dtype_bytes is None else args.dtype_bytes
    try:
        if not 0 < args.gpu_memory_utilization <= 1:
            raise PacerError("--gpu-memory-utilization must be in (0, 1], got "
                             f"{args.gpu_memory_utilization}")
        check_block_size(args.block_size)
        for flag in COUNT_FLAGS:
            if getattr(args, flag) is not None:
                check_count(f"--{flag.replace('_', '-')}", getattr(args, flag))
        if args.cost == "online" and args.max_iteration_ms is None and args.target_tbt_ms == "off":
            raise PacerError("--cost online is the model a latency budget plans with: give "
                             "--max-iteration-ms or --target-tbt-ms (without either the core "
                             "plans by the token budget alone and asks no cost model)")
        for flag, path in (("--plot", args.plot), ("--timeline", getattr(args, "timeline", None))):
            if path:
                check_output_path(path, flag)
        model, hw = load_model_shape(args.model), load_hardware(args.hw)
        cost = RooflineCost.of(model, hw, precision_of(args, [model]))
        pools = _check_disagg_flags(args)
        if args.sweep:
            return _run_sweep(args, model, hw, cost, pools, *parse_sweep(args.sweep, args))
        arrivals = build_arrivals(args)
        config = scheduler_config(args, model, arrivals, cost)
        results = _run_modes(args, arrivals, config, cost, pools)
        summaries = [_summary(args, r) for r in results]
    except PacerError as e:
        print(f"pacer simulate: error: {e}", file=sys.stderr)
        return 2
    _write_outputs(args, results)
    if args.json:
        print(json.dumps(_json_safe({"model": model.name, "hardware": hw.name,
                                     "precision": asdict(cost.precision),
                                     "config": _config_dict(config),
                                     "workload": _workload_dict(args, arrivals)}
                                    | _disagg_dict(args, pools)
                                    | {"modes": {s["mode"]: s for s in summaries}}), indent=2))
    else:
        shown = "" if cost.precision == Precision() else f" ({precision_text(cost.precision)})"
        print(f"{model.name} on {hw.name}{shown}: {len(arrivals)} requests, "
              f"{config.max_num_batched_tokens}-row budget"
              + (f", {config.max_iteration_ms:g} ms latency budget" if config.max_iteration_ms
                 else "") + f", {config.num_kv_blocks} KV blocks of {config.block_size}"
              + "".join(f"\n{s['mode']}: {s['instances']}" for s in summaries if pools))
        from scheduler_svc.sim_report import format_table
        print(format_table(summaries))
    return 0


def _summary(args: argparse.Namespace, result) -> dict:
    """The result's figures; the requests the core refused, and why, on stderr."""
    from scheduler_svc.sim_report import format_rejections, summarize
    summary = summarize(result, args.ttft_slo_ms, args.tbt_slo_ms)
    if result.rejected:
        print(f"pacer simulate: {format_rejections(result)}", file=sys.stderr)
    return summary


def parse_disagg(spec: str) -> tuple[int, int]:
    """'1:3' -> (1, 3): prefill and decode instances."""
    parts = spec.split(":")
    try:
        p, d = (int(x) for x in parts)
    except ValueError:
        p = d = 0
    if len(parts) != 2 or p < 1 or d < 1:
        raise PacerError(f"--disagg {spec!r}: expected P:D with P, D >= 1, e.g. 1:1")
    if p + d > MAX_SIM_INSTANCES:
        raise PacerError(f"--disagg {spec!r}: the simulator runs at most {MAX_SIM_INSTANCES:,} "
                         "instances (P + D)")
    return p, d


def parse_sweep(spec: str, args: argparse.Namespace) -> tuple[str, list[str]]:
    """'request-rate=1,2,4' -> ('request-rate', ['1', '2', '4']), each value checked."""
    from scheduler_svc.arrivals import parse_length
    from shared.fabric import load_fabric

    knob, _, values = spec.partition("=")
    values = [v.strip() for v in values.split(",") if v.strip()]
    if knob not in SWEEP_KNOBS or not values:
        raise PacerError(f"--sweep {spec!r}: expected KNOB=V1,V2,... with KNOB one of "
                         f"{', '.join(SWEEP_KNOBS)}")
    if args.trace and knob != "fabric":
        raise PacerError(f"--sweep {knob}: the workload comes from --trace")
    check = {"request-rate": _rate, "prompt-len": parse_length, "output-len": parse_length,
             "fabric": lambda value: load_fabric(value, "--sweep fabric")}[knob]
    for value in values:
        check(value)
    return knob, values


def _rate(value: str) -> float:
    try:
        rate = float(value)
    except ValueError:
        rate = math.nan
    if not rate > 0:
        raise PacerError(f"a request rate must be a number > 0 (or inf), got {value!r}")
    return rate


def _check_disagg_flags(args: argparse.Namespace) -> tuple[int, int] | None:
    for flag in ("ttft_slo_ms", "tbt_slo_ms"):
        if not getattr(args, flag) > 0:
            raise PacerError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if not args.disagg:
        if args.sweep:
            raise PacerError("--sweep compares the two modes of --disagg: give --disagg P:D")
        return None
    if args.compare:
        raise PacerError("--disagg compares colocated with disaggregated; leave out --compare")
    budget = args.prefill_max_num_batched_tokens
    if budget is not None and budget < 1:
        raise PacerError(f"--prefill-max-num-batched-tokens must be >= 1, got {budget}")
    if args.disagg_min_prompt_tokens < 0:
        raise PacerError("--disagg-min-prompt-tokens must be >= 0, got "
                         f"{args.disagg_min_prompt_tokens}")
    return parse_disagg(args.disagg)


def _run_modes(args: argparse.Namespace, arrivals: list, config: SchedulerConfig, cost,
               pools: tuple[int, int] | None) -> list:
    """ORCA and/or chunked on one instance, or colocated vs disaggregated on P+D GPUs."""
    from scheduler_svc.simulator import Hop, simulate, simulate_disaggregated
    from shared.fabric import load_fabric

    if pools is None:
        modes = list(MODES) if args.compare else [
            next(k for k, v in MODES.items() if v == config.enable_chunked_prefill)]
        return [simulate(arrivals, replace(config, enable_chunked_prefill=MODES[mode]), cost,
                         mode) for mode in modes]
    p, d = pools
    hop = Hop.of(cost, load_fabric(args.fabric), args.layer_streaming)
    # The prefill side: its own token budget and no latency budget (no decode rides there).
    prefill = replace(config, max_num_batched_tokens=args.prefill_max_num_batched_tokens
                      or config.max_num_batched_tokens, max_iteration_ms=None,
                      iteration_cost=None)
    return [simulate(arrivals, config, cost, "colocated", instances=p + d),
            simulate_disaggregated(arrivals, prefill, config, cost, hop, p, d, "disagg",
                                   args.disagg_min_prompt_tokens)]


def _run_sweep(args: argparse.Namespace, model, hw, cost, pools: tuple[int, int],
               knob: str, values: list[str]) -> int:
    points = []
    for value in values:
        point = argparse.Namespace(**vars(args))
        setattr(point, knob.replace("-", "_"), _rate(value) if knob == "request-rate" else value)
        arrivals = build_arrivals(point)
        config = scheduler_config(point, model, arrivals, cost)
        summaries = [_summary(args, r) for r in _run_modes(point, arrivals, config, cost, pools)]
        points.append({s["mode"]: s for s in summaries})
    if args.plot:
        from scheduler_svc.sim_plot import plot_sweep
        plot_sweep(knob, values, points, args.plot,
                   title=f"{model.name} on {hw.name}, {args.disagg} vs {sum(pools)} colocated")
    if args.json:
        disagg = _disagg_dict(args, pools)
        if knob == "fabric":
            del disagg["disagg"]["fabric"]
        print(json.dumps(_json_safe(
            {"model": model.name, "hardware": hw.name, "workload": _workload_dict(args, None)}
            | disagg
            | {"sweep": {"knob": knob, "values": values},
               "points": [{"value": v, "modes": p} for v, p in zip(values, points)]}),
            indent=2))
    else:
        print(f"{model.name} on {hw.name}: {sum(pools)} colocated instances vs "
              f"{pools[0]} prefill + {pools[1]} decode; goodput: TTFT <= {args.ttft_slo_ms:g} ms "
              f"and every TBT <= {args.tbt_slo_ms:g} ms")
        print(format_sweep(knob, values, points))
    return 0


def format_sweep(knob: str, values: list[str], points: list[dict]) -> str:
    """One row per value: each mode's goodput and tails, and which mode's goodput is higher
    (by more than 2 %: the runs end at slightly different times)."""
    def ms(x: float) -> str:
        return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"

    header = [knob, "goodput co", "goodput pd", "TTFT p99 co", "TTFT p99 pd", "TBT max co",
              "TBT max pd", "exposed ms", "better"]
    table = [header]
    for value, point in zip(values, points):
        co, pd = point["colocated"], point["disagg"]
        ratio = pd["goodput_rps"] / co["goodput_rps"] if co["goodput_rps"] else math.inf
        better = "disagg" if ratio > 1.02 else "colocated" if ratio < 1 / 1.02 else "tie"
        table.append([value, f"{co['goodput_rps']:.3g}", f"{pd['goodput_rps']:.3g}",
                      ms(co["ttft_ms"]["p99"]), ms(pd["ttft_ms"]["p99"]),
                      ms(co["tbt_ms"]["max"]), ms(pd["tbt_ms"]["max"]),
                      ms(pd.get("exposed_transfer_ms", {}).get("median", math.nan)), better])
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))) for r in table)


def _write_outputs(args: argparse.Namespace, results: list) -> None:
    if args.timeline:
        with open(args.timeline, "w", encoding="utf-8") as f:
            json.dump({r.mode: r.timeline.to_dict() for r in results}, f)
    if args.plot:
        from scheduler_svc.sim_plot import plot
        plot(results, args.plot, title=f"{args.model} on {args.hw}"
             + (f", {args.disagg} over {args.fabric}" if args.disagg else ""),
             ttft=bool(args.disagg))


def _disagg_dict(args: argparse.Namespace, pools: tuple[int, int] | None) -> dict:
    if pools is None:
        return {}
    return {"disagg": {"prefill_instances": pools[0], "decode_instances": pools[1],
                       "colocated_instances": sum(pools), "fabric": args.fabric,
                       "layer_streaming": args.layer_streaming,
                       "prefill_max_num_batched_tokens": args.prefill_max_num_batched_tokens,
                       "min_prompt_tokens": args.disagg_min_prompt_tokens},
            "slo": {"ttft_ms": args.ttft_slo_ms, "tbt_ms": args.tbt_slo_ms}}


def _config_dict(config: SchedulerConfig) -> dict:
    per_mode_or_object = ("iteration_cost", "enable_chunked_prefill")
    return {f.name: getattr(config, f.name) for f in fields(config)
            if f.name not in per_mode_or_object}


def _workload_dict(args: argparse.Namespace, arrivals: list | None) -> dict:
    keys = (["trace"] if args.trace else
            ["num_requests", "request_rate", "burstiness", "prompt_len", "output_len",
             "long_prompt_rate", "long_prompt_len", "long_output_len"])
    out = {k: getattr(args, k) for k in keys} | {"seed": args.seed}
    return out if arrivals is None else out | {"requests": len(arrivals)}
