"""`pacer cost`: the roofline estimate of one iteration, or of one request's P/D hop, from
the command line.

    pacer cost --model llama-2-7b --hw h100 --decode 8x1024 --prefill 4096 --prefill 1024@2048
    pacer cost --transfer 4096 --fabric ib-hdr      # KV bytes of a 4k prompt, time over IB HDR
    pacer cost --transfer 4096                      # every fabric, beside a GQA model
    pacer cost --decode 8x1024 --weight-bytes 0.5    # 4-bit weights beside a 16-bit cache
    pacer cost --decode 8x1024 --tp 2               # one of two ranks, with its all-reduces
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict

from shared.config import shown_count
from shared.cost_model import (ChunkGroup, ChunkShape, IterationCost, KVCapacity, ModelShape,
                               Precision, TransferCost, estimate_groups, estimate_transfer,
                               kv_capacity, load_model_shape)
from shared.errors import PacerError
from shared.fabric import FABRIC_RANGE_TEXT, FABRICS, load_fabric
from shared.hardware import HardwareProfile, load_hardware

_DECODE = re.compile(r"(\d+)[xX](\d+)")
_PREFILL = re.compile(r"(\d+)(?:@(\d+))?")


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "cost", help="roofline estimate of one iteration's wall time",
        description="Estimate one iteration (a forward over decode steps and prefill chunks) "
                    "with the roofline: time = max(FLOPs / peak FLOP/s, bytes / bandwidth).")
    p.add_argument("--model", default="llama-2-7b",
                   help="llama-2-7b, llama-2-13b, llama-3-8b, smollm2-135m, a .gguf file, or a "
                        "Hugging Face model folder or its config.json")
    p.add_argument("--hw", default="h100", help="h100, h200, a100, or a JSON from `pacer calibrate`")
    p.add_argument("--hw-tflops", type=float, help="override the matmul rate (TFLOP/s, all dtypes)")
    p.add_argument("--hw-bandwidth-tbps", type=float, help="override the memory bandwidth (TB/s)")
    # Kept as strings and parsed in run() so that a bad spec is one error line, not argparse usage.
    p.add_argument("--decode", action="append", default=[], metavar="BxL",
                   help="B requests decoding at context L (repeatable)")
    p.add_argument("--prefill", action="append", default=[], metavar="N[@S]",
                   help="a prefill chunk of N tokens over a cached prefix of S (repeatable)")
    t = p.add_argument_group("the P/D hop (docs/design.md#pd-disaggregation-pricing-the-hop)")
    t.add_argument("--transfer", type=int, metavar="L_P",
                   help="instead of an iteration: the KV cache of an L_P-token prompt moved "
                        "from a prefill to a decode instance, its bytes and transfer time")
    t.add_argument("--fabric", default="all",
                   help=f"{', '.join(FABRICS)}, a bandwidth {FABRIC_RANGE_TEXT}, a comma "
                        "list, or all "
                        "(default: a table of every built-in fabric)")
    t.add_argument("--vs", default=None, metavar="MODEL",
                   help="a second model beside --model (default: llama-3-8b, GQA with 8 KV "
                        "heads of 32, in the table of several fabrics; none beside one "
                        "fabric); none to leave it out")
    p.add_argument("--dtype-bytes", type=float, default=2.0,
                   help="bytes per activation element, and per weight and KV element unless "
                        "given apart (default 2: fp16/bf16)")
    add_precision_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)
    return p


# The narrowest element priced: one bit. Anything narrower is a typo, and would leave a KV
# block without a byte.
MIN_ELEMENT_BYTES = 0.125
# The widest: float64. Anything wider is a typo too, and a huge one (1e308) made the weights'
# bytes infinite: an OverflowError traceback, or an infinite wall time reported as a result.
MAX_ELEMENT_BYTES = 8.0


def add_precision_args(group) -> None:
    """--weight-bytes, --kv-bytes and --tp, as `pacer cost` and `pacer simulate` take them."""
    group.add_argument("--weight-bytes", type=float, default=None,
                       help="bytes per weight (default: --dtype-bytes; 0.5 for int4 weights, "
                            "1 for int8)")
    group.add_argument("--kv-bytes", type=float, default=None,
                       help="bytes per KV cache element (default: --dtype-bytes)")
    group.add_argument("--tp", type=int, default=1,
                       help="tensor-parallel ranks: each does 1/tp of the FLOPs and bytes, and "
                            "the forward's all-reduces go over the profile's interconnect "
                            "(default 1)")


def precision_of(args: argparse.Namespace, models: list[ModelShape]) -> Precision:
    """The element sizes and TP degree the flags give, checked: sizes from one bit to a
    float64, and a TP degree that divides each model's heads."""
    from shared.model_config import check_tp_fits

    for flag in ("dtype_bytes", "weight_bytes", "kv_bytes"):
        value = getattr(args, flag)
        if value is not None and not MIN_ELEMENT_BYTES <= value <= MAX_ELEMENT_BYTES:
            raise PacerError(f"--{flag.replace('_', '-')} must be a number of bytes from "
                             f"{MIN_ELEMENT_BYTES:g} (one bit) to {MAX_ELEMENT_BYTES:g} "
                             f"(float64), got {value:g}")
    for model in models:
        check_tp_fits(model, args.tp)          # its error names the model
    return Precision(args.dtype_bytes, args.weight_bytes, args.kv_bytes, args.tp)


def precision_text(p: Precision) -> str:
    """'2 B/elem', '2 B/elem, weights 0.5 B', ... '; tp 2'."""
    text = f"{p.dtype_bytes:g} B/elem"
    if p.weight_bytes != p.dtype_bytes:
        text += f", weights {p.weight_bytes:g} B"
    if p.kv_bytes != p.dtype_bytes:
        text += f", KV {p.kv_bytes:g} B"
    return text + (f"; one rank of tp {p.tp}" if p.tp > 1 else "")


# The largest count (requests, tokens) a flag takes: far beyond any batch or context, and
# small enough that every FLOP and byte sum built from it stays a finite float.
MAX_COUNT = 2**40


def check_count(flag: str, value: int) -> int:
    """`value` unless it is over MAX_COUNT, then a one-line error naming `flag`."""
    if value > MAX_COUNT:
        raise PacerError(f"{flag}: counts must be at most 2**40 ({MAX_COUNT:,}), got "
                         f"{shown_count(value)}")
    return value


def parse_decode(spec: str) -> ChunkGroup:
    """'8x1024' -> eight (1, 1024) chunks, as (8, (1, 1024))."""
    m = _DECODE.fullmatch(spec.strip())
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise PacerError(f"--decode {spec!r}: expected BxL with B, L >= 1, e.g. 8x1024")
    batch, context = (check_count("--decode", int(g)) for g in m.groups())
    return batch, (1, context)


def parse_prefill(spec: str) -> ChunkShape:
    """'4096' -> (4096, 4096); '1024@2048' -> (1024, 3072): 1024 new rows over 2048 cached."""
    m = _PREFILL.fullmatch(spec.strip())
    if not m or int(m.group(1)) < 1:
        raise PacerError(f"--prefill {spec!r}: expected N or N@S with N >= 1, e.g. 4096 or 1024@2048")
    n, prefix = (check_count("--prefill", int(g or 0)) for g in m.groups())
    return (n, prefix + n)


# --hw-tflops and --hw-bandwidth-tbps: a millionth of a unit to a million units. Past them
# lies a typo: 1e-320 priced an iteration at an infinite wall time, inf was refused naming
# the profile's field rather than the flag.
HW_OVERRIDE_RANGE = (1e-6, 1e6)


def _hardware(args: argparse.Namespace) -> HardwareProfile:
    hw = load_hardware(args.hw)
    low, high = HW_OVERRIDE_RANGE
    for flag, value in (("--hw-tflops", args.hw_tflops), ("--hw-bandwidth-tbps", args.hw_bandwidth_tbps)):
        if value is not None and not low <= value <= high:      # NaN fails it too
            raise PacerError(f"{flag} must be from {low:g} to {high:g}, got {value:g}")
    return hw.with_overrides(args.hw_tflops, args.hw_bandwidth_tbps)


def run(args: argparse.Namespace) -> int:
    if args.transfer is not None:
        return run_transfer(args)
    try:
        groups = [parse_decode(spec) for spec in args.decode]
        groups += [(1, parse_prefill(spec)) for spec in args.prefill]
        if not groups:
            raise PacerError("nothing to run: give --decode BxL and/or --prefill N[@S]")
        model, hw = load_model_shape(args.model), _hardware(args)
        precision = precision_of(args, [model])
        cost = estimate_groups(groups, model, hw, precision)
        capacity, no_capacity = _capacity(model, hw, precision)
    except PacerError as e:
        print(f"pacer cost: error: {e}", file=sys.stderr)
        return 2
    longest = max(kv for _, (_, kv) in groups)
    if args.json:
        out = asdict(cost) | {"model": model.name, "hardware": hw.name,
                              "precision": asdict(precision),
                              "ridge": hw.ridge(args.dtype_bytes), "decode": args.decode,
                              "prefill": args.prefill,
                              "kv_capacity": None if capacity is None else
                              asdict(capacity) | {"sequences_at_longest_context":
                                                  capacity.sequences(longest)},
                              "kv_capacity_error": no_capacity}
        print(json.dumps(out, indent=2))
    else:
        work = ", ".join([f"decode {d}" for d in args.decode] + [f"prefill {p}" for p in args.prefill])
        print(format_table(cost, model.name, hw, precision, work))
        if capacity is not None:
            print(format_capacity(capacity, longest))
        elif no_capacity is not None:
            print(f"{'KV capacity':<16}  none: {no_capacity}")
    return 0


# `pacer cost` sizes the pool at kv_capacity's defaults (0.9 of the memory, a 2048-token
# forward): what it has a flag for is the profile, the weights' bytes and the TP degree
COST_REMEDY = ("try a --hw with more memory, fewer --weight-bytes (or --dtype-bytes), or a "
               "larger --tp")


def _capacity(model, hw: HardwareProfile,
              precision: Precision) -> tuple[KVCapacity | None, str | None]:
    """The KV capacity where the profile states its memory, else (None, None); (None, why)
    when the weights leave it no room."""
    if hw.memory_gib is None:
        return None, None
    try:
        return kv_capacity(model, hw, precision, remedy=COST_REMEDY), None
    except PacerError as e:
        return None, str(e)


def format_capacity(capacity: KVCapacity, context_len: int) -> str:
    """docs/design.md#the-memory-wall: what the pool holds, and the batch that allows."""
    gib = 2**30
    return (f"{'KV capacity':<16}  {capacity.tokens:,} tokens ({capacity.kv_bytes / gib:.1f} GiB "
            f"of {capacity.memory_bytes / gib:g} GiB at {capacity.utilization:g}, after "
            f"{capacity.weight_bytes / gib:.1f} GiB of weights): "
            f"{capacity.sequences(context_len):,} requests at a {context_len:,}-token context")


def run_transfer(args: argparse.Namespace) -> int:
    try:
        if args.decode or args.prefill:
            raise PacerError("--transfer prices a hop, not an iteration: leave out --decode "
                             "and --prefill")
        if args.transfer < 1:
            raise PacerError(f"--transfer must be >= 1 token, got {args.transfer}")
        check_count("--transfer", args.transfer)
        specs = list(FABRICS) if args.fabric.lower() == "all" else args.fabric.split(",")
        one_fabric = args.fabric.lower() != "all" and len(specs) == 1
        vs = args.vs or ("none" if one_fabric else "llama-3-8b")
        names = [args.model] + ([] if vs.lower() in ("none", args.model.lower()) else [vs])
        models = [load_model_shape(name) for name in names]
        precision = precision_of(args, models)
        fabrics = [load_fabric(spec) for spec in specs]
        hw = _hardware(args)
        rows = [[estimate_transfer(m, args.transfer, f, hw, precision) for m in models]
                for f in fabrics]
    except PacerError as e:
        print(f"pacer cost: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"prompt_len": args.transfer, "hardware": hw.name,
                          "dtype_bytes": args.dtype_bytes, "precision": asdict(precision),
                          "rows": [asdict(c) for row in rows for c in row]}, indent=2))
    elif one_fabric:
        print("\n\n".join(format_transfer(cost, hw.name, precision) for cost in rows[0]))
    else:
        print(format_transfer_table(rows, models, hw.name, precision))
    return 0


def _bytes(n: float) -> str:
    return f"{_si(n, 'B')} ({n / 2**30:.3g} GiB)" if n >= 2**30 else _si(n, "B")


def format_transfer(cost: TransferCost, hw: str, precision: Precision) -> str:
    rows = [
        ("model", f"{cost.model} ({precision_text(precision)})"),
        ("prompt", f"{cost.prompt_len} tokens"),
        ("KV per token", f"{cost.kv_bytes_per_token / 1024:g} KiB"),
        ("KV per request", _bytes(cost.kv_bytes)),
        ("fabric", f"{cost.fabric}: {cost.gb_per_s:g} GB/s ({FABRICS[cost.fabric].what})"
                   if cost.fabric in FABRICS else cost.fabric),
        ("transfer", f"{cost.transfer_ms:.3g} ms (all of it after the prefill)"
                     + (f"; each of {cost.links} ranks sends its share over a link of its own"
                        if cost.links > 1 else "")),
        ("prefill", f"{cost.prefill_ms:.3g} ms on {hw}, one iteration"),
        ("layer streamed", f"{cost.exposed_ms:.3g} ms exposed after the prefill "
                           f"(hidden while the fabric moves >= {cost.hiding_gb_per_s:.3g} GB/s)"),
    ]
    return _key_values(rows)


def format_transfer_table(rows: list[list[TransferCost]], models: list, hw: str,
                          precision: Precision) -> str:
    """One row per fabric; per model, the transfer alone and what layer streaming leaves."""
    first = rows[0]
    lines = [f"KV cache of a {first[0].prompt_len}-token prompt ({precision_text(precision)}), "
             f"prefilled in one iteration on {hw}:"]
    for model, cost in zip(models, first):
        ratio = first[0].kv_bytes / cost.kv_bytes
        gqa = (f"; {model.num_kv_heads} KV heads of {model.num_heads}: {ratio:.3g}x fewer bytes "
               f"than {first[0].model}" if cost is not first[0] else "")
        lines.append(f"  {cost.model}: {cost.kv_bytes_per_token / 1024:g} KiB/token, "
                     f"{_bytes(cost.kv_bytes)}; prefill {cost.prefill_ms:.3g} ms, hides the "
                     f"transfer above {cost.hiding_gb_per_s:.3g} GB/s{gqa}")
    header = ["fabric", "GB/s"]
    for cost in first:
        header += [f"{cost.model} ms", "streamed ms"]
    table = [header] + [[row[0].fabric, f"{row[0].gb_per_s:g}"]
                        + [f"{v:.3g}" for c in row for v in (c.transfer_ms, c.exposed_ms)]
                        for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                        enumerate(zip(r, widths))) for r in table]
    lines.append("ms: the transfer alone; streamed: what is left after the prefill when each "
                 "layer's K/V leave as soon as it is computed"
                 + (f"; each of {first[0].links} ranks sends its share over a link of its own"
                    if first[0].links > 1 else ""))
    return "\n".join(lines)


def _key_values(rows: list[tuple[str, str]]) -> str:
    """One 'key  value' line a row, the values aligned."""
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _si(value: float, unit: str) -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def format_table(cost: IterationCost, model: str, hw: HardwareProfile, precision: Precision,
                 work: str) -> str:
    dtype_bytes = precision.dtype_bytes
    rows = [
        ("model / hardware", f"{model} on {hw.name} ({precision_text(precision)})"),
        ("iteration", f"{work}: {cost.num_tokens} Q rows"),
        ("linear FLOPs", _si(cost.linear_flops, "FLOP")),
        ("attention FLOPs", _si(cost.attention_flops, "FLOP")),
        ("total FLOPs", _si(cost.flops, "FLOP")),
        ("weight bytes", _si(cost.weight_bytes, "B")),
        ("KV bytes", _si(cost.kv_bytes, "B")),
        ("total bytes", _si(cost.bytes, "B")),
        ("intensity", f"{cost.intensity:.3g} FLOP/B (ridge {hw.ridge(dtype_bytes):.3g})"),
        ("compute time", f"{cost.compute_ms:.3f} ms (GEMMs at {cost.gemm_efficiency:.0%} of "
                         f"the rate, r½ {hw.gemm_half_rows:g} rows)"),
        ("memory time", f"{cost.memory_ms:.3f} ms"),
    ]
    if cost.tp > 1:
        rows.append(("all-reduce time", f"{cost.allreduce_ms:.3f} ms, and {cost.allgather_ms:.3f} "
                                        f"ms gathering the logits ({cost.tp} ranks at "
                                        f"{hw.interconnect_gb_per_s:g} GB/s, added)"))
    rows += [
        ("wall time", f"{cost.time_ms:.3f} ms ({cost.bound}-bound)"),
    ]
    return _key_values(rows)
