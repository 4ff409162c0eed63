"""`pacer cost`: the roofline estimate of one iteration, from the command line.

    pacer cost --model llama-2-7b --hw h100 --decode 8x1024 --prefill 4096 --prefill 1024@2048
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict

from shared.cost_model import ChunkShape, IterationCost, estimate_iteration, load_model_shape
from shared.errors import PacerError
from shared.hardware import HardwareProfile, load_hardware

_DECODE = re.compile(r"(\d+)[xX](\d+)")
_PREFILL = re.compile(r"(\d+)(?:@(\d+))?")


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "cost", help="roofline estimate of one iteration's wall time",
        description="Estimate one iteration (a forward over decode steps and prefill chunks) "
                    "with the roofline: time = max(FLOPs / peak FLOP/s, bytes / bandwidth).")
    p.add_argument("--model", default="llama-2-7b",
                   help="llama-2-7b, llama-2-13b, llama-3-8b, smollm2-135m, or a config.json path")
    p.add_argument("--hw", default="h100", help="h100, h200, a100, or a JSON from `pacer calibrate`")
    p.add_argument("--hw-tflops", type=float, help="override the matmul rate (TFLOP/s, all dtypes)")
    p.add_argument("--hw-bandwidth-tbps", type=float, help="override the memory bandwidth (TB/s)")
    # Kept as strings and parsed in run() so that a bad spec is one error line, not argparse usage.
    p.add_argument("--decode", action="append", default=[], metavar="BxL",
                   help="B requests decoding at context L (repeatable)")
    p.add_argument("--prefill", action="append", default=[], metavar="N[@S]",
                   help="a prefill chunk of N tokens over a cached prefix of S (repeatable)")
    p.add_argument("--dtype-bytes", type=float, default=2.0,
                   help="bytes per weight and KV element (default 2: fp16/bf16)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)
    return p


def parse_decode(spec: str) -> list[ChunkShape]:
    """'8x1024' -> eight (1, 1024) chunks."""
    m = _DECODE.fullmatch(spec.strip())
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise PacerError(f"--decode {spec!r}: expected BxL with B, L >= 1, e.g. 8x1024")
    return [(1, int(m.group(2)))] * int(m.group(1))


def parse_prefill(spec: str) -> ChunkShape:
    """'4096' -> (4096, 4096); '1024@2048' -> (1024, 3072): 1024 new rows over 2048 cached."""
    m = _PREFILL.fullmatch(spec.strip())
    if not m or int(m.group(1)) < 1:
        raise PacerError(f"--prefill {spec!r}: expected N or N@S with N >= 1, e.g. 4096 or 1024@2048")
    n, prefix = int(m.group(1)), int(m.group(2) or 0)
    return (n, prefix + n)


def _hardware(args: argparse.Namespace) -> HardwareProfile:
    hw = load_hardware(args.hw)
    for flag, value in (("--hw-tflops", args.hw_tflops), ("--hw-bandwidth-tbps", args.hw_bandwidth_tbps)):
        if value is not None and not value > 0:
            raise PacerError(f"{flag} must be > 0, got {value}")
    return hw.with_overrides(args.hw_tflops, args.hw_bandwidth_tbps)


def run(args: argparse.Namespace) -> int:
    try:
        chunks = [c for spec in args.decode for c in parse_decode(spec)]
        chunks += [parse_prefill(spec) for spec in args.prefill]
        if not chunks:
            raise PacerError("nothing to run: give --decode BxL and/or --prefill N[@S]")
        if not args.dtype_bytes > 0:
            raise PacerError(f"--dtype-bytes must be > 0, got {args.dtype_bytes}")
        model, hw = load_model_shape(args.model), _hardware(args)
        cost = estimate_iteration(chunks, model, hw, args.dtype_bytes)
    except PacerError as e:
        print(f"pacer cost: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = asdict(cost) | {"model": model.name, "hardware": hw.name,
                              "ridge": hw.ridge(args.dtype_bytes), "decode": args.decode,
                              "prefill": args.prefill}
        print(json.dumps(out, indent=2))
    else:
        work = ", ".join([f"decode {d}" for d in args.decode] + [f"prefill {p}" for p in args.prefill])
        print(format_table(cost, model.name, hw, args.dtype_bytes, work))
    return 0


def _si(value: float, unit: str) -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def format_table(cost: IterationCost, model: str, hw: HardwareProfile, dtype_bytes: float,
                 work: str) -> str:
    rows = [
        ("model / hardware", f"{model} on {hw.name} ({dtype_bytes:g} B/elem)"),
        ("iteration", f"{work}: {cost.num_tokens} Q rows"),
        ("linear FLOPs", _si(cost.linear_flops, "FLOP")),
        ("attention FLOPs", _si(cost.attention_flops, "FLOP")),
        ("total FLOPs", _si(cost.flops, "FLOP")),
        ("weight bytes", _si(cost.weight_bytes, "B")),
        ("KV bytes", _si(cost.kv_bytes, "B")),
        ("total bytes", _si(cost.bytes, "B")),
        ("intensity", f"{cost.intensity:.3g} FLOP/B (ridge {hw.ridge(dtype_bytes):.3g})"),
        ("compute time", f"{cost.compute_ms:.3f} ms"),
        ("memory time", f"{cost.memory_ms:.3f} ms"),
        ("wall time", f"{cost.time_ms:.3f} ms ({cost.bound}-bound)"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
