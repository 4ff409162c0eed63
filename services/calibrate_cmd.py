"""`pacer calibrate`: measure this machine's matmul rate and memory bandwidth with torch and
write a hardware profile that `pacer cost --hw hw.json` (and the scheduler) can load.

Besides the rates it fits the GEMM efficiency curve (docs/design.md#small-chunks-run-below-peak):
matmuls of M rows against one K x N weight, M from a few rows to thousands, each priced as
`2·M·K·N / (rate · M / (M + r½))`; `gemm_half_rows` is the r½ that fits them best (the median
of what each M implies), fitted on bfloat16, the serving dtype where it is native. And it
records the memory the device holds (`memory_gib`: the GPU's, or this host's RAM), for the
KV capacity (docs/design.md#the-memory-wall).

Each figure is the best of several timed repetitions after a warm-up: a roofline wants what
the machine can sustain, and a busy neighbour only ever makes a repetition slower.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from shared.errors import PacerError
from shared.json_file import check_output_path, read_json_object
from shared.hardware import hardware_from_dict

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Plan:
    """What to measure: sizes depend on the device and on --quick."""

    matmul_sizes: tuple[int, ...]
    gemm_rows: tuple[int, ...]              # M of the efficiency curve's matmuls...
    gemm_kn: int                            # ...against one gemm_kn x gemm_kn weight
    copy_mib: int                           # several times any last-level cache
    attention: tuple[int, int, int, int]    # batch, heads, seq, head_dim
    min_seconds: float                      # time each measurement for at least this long
    max_reps: int


PLANS = {
    ("cpu", True): Plan((256, 512, 1024), (8, 32, 128, 512), 1024, 256, (1, 8, 512, 64),
                        0.15, 20),
    ("cpu", False): Plan((512, 1024, 2048), (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048),
                         2048, 1024, (1, 8, 2048, 64), 1.0, 50),
    ("cuda", True): Plan((1024, 4096), (64, 256, 1024, 4096), 4096, 256, (2, 16, 2048, 128),
                         0.1, 50),
    ("cuda", False): Plan((2048, 4096, 8192), (16, 32, 64, 128, 256, 512, 1024, 2048, 4096,
                                               8192), 8192, 1024, (4, 32, 4096, 128), 0.5, 200),
}
CURVE_DTYPE = "bfloat16"


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "calibrate", help="measure matmul rate and memory bandwidth; write a hardware profile",
        description="Measure this machine with torch (matmul per dtype, copy/reduction "
                    "bandwidth, scaled_dot_product_attention) and write a JSON profile for "
                    "`pacer cost --hw`.")
    p.add_argument("--output", default="hw.json",
                   help="where to write the profile (default hw.json); it replaces an earlier "
                        "profile there, and refuses a file that is none")
    p.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.set_defaults(run=run)
    return p


def _best_seconds(fn: Callable[[], Any], sync: Callable[[], None], plan: Plan) -> float:
    fn()                                    # warm-up: allocation, kernel selection, caches
    sync()
    best, spent, reps = float("inf"), 0.0, 0
    while reps < 2 or (spent < plan.min_seconds and reps < plan.max_reps):
        start = time.perf_counter()
        fn()
        sync()
        elapsed = time.perf_counter() - start
        best, spent, reps = min(best, elapsed), spent + elapsed, reps + 1
    return best


def measure_matmul(torch: Any, device: str, sync: Callable[[], None], plan: Plan) -> list[dict]:
    rows = []
    for dtype in DTYPES:
        for n in plan.matmul_sizes:
            a = torch.randn(n, n, device=device, dtype=getattr(torch, dtype))
            b = torch.randn(n, n, device=device, dtype=getattr(torch, dtype))
            seconds = _best_seconds(lambda: torch.mm(a, b), sync, plan)
            rows.append({"dtype": dtype, "m": n, "n": n, "k": n, "seconds": seconds,
                         "tflops": 2 * n**3 / seconds / 1e12})
    return rows


def measure_gemm_rows(torch: Any, device: str, sync: Callable[[], None], plan: Plan) -> list[dict]:
    """Matmuls of M rows against one square weight, as a layer's GEMM over an iteration's rows."""
    rows = []
    kn = plan.gemm_kn
    for dtype in DTYPES:
        w = torch.randn(kn, kn, device=device, dtype=getattr(torch, dtype))
        for m in plan.gemm_rows:
            x = torch.randn(m, kn, device=device, dtype=getattr(torch, dtype))
            seconds = _best_seconds(lambda: torch.mm(x, w), sync, plan)
            rows.append({"dtype": dtype, "m": m, "n": kn, "k": kn, "seconds": seconds,
                         "tflops": 2 * m * kn * kn / seconds / 1e12})
    return rows


def fit_gemm_half_rows(rows: list[dict], tflops: float) -> float:
    """The r½ of `rate · M / (M + r½)` that the matmuls of `rows` (one dtype) fit best against
    the sustained `tflops`: each M implies r½ = seconds · rate / (2·K·N) − M; the median of
    those, never below 0 (a tall matmul that beat the square ones implies none)."""
    implied = sorted(r["seconds"] * tflops * 1e12 / (2 * r["k"] * r["n"]) - r["m"] for r in rows)
    if not implied:
        return 0.0
    mid = len(implied) // 2
    median = implied[mid] if len(implied) % 2 else (implied[mid - 1] + implied[mid]) / 2
    return max(0.0, round(median, 1))


def device_memory_gib(torch: Any, device: str) -> float | None:
    """What the device holds: the GPU's memory, or this host's RAM."""
    try:
        if device == "cuda":
            return torch.cuda.get_device_properties(0).total_memory / 2**30
        import os
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError, RuntimeError):
        return None


def measure_bandwidth(torch: Any, device: str, sync: Callable[[], None], plan: Plan) -> list[dict]:
    numel = plan.copy_mib * 2**20 // 4
    src = torch.rand(numel, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    size = numel * 4
    rows = []
    # copy reads and writes every byte; a sum only reads, like a decode reading weights.
    for kind, fn, moved in (("copy", lambda: dst.copy_(src), 2 * size), ("sum", src.sum, size)):
        seconds = _best_seconds(fn, sync, plan)
        rows.append({"kind": kind, "bytes": moved, "seconds": seconds,
                     "tbps": moved / seconds / 1e12})
    return rows


def measure_attention(torch: Any, device: str, sync: Callable[[], None], plan: Plan) -> list[dict]:
    batch, heads, seq, head_dim = plan.attention
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = []
    for dtype in DTYPES:
        q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device,
                               dtype=getattr(torch, dtype)) for _ in range(3))
        seconds = _best_seconds(lambda: sdpa(q, k, v, is_causal=True), sync, plan)
        # Counted like the cost model: 4·d_head per (query, key) pair, causal pairs only.
        flops = 4 * head_dim * heads * batch * seq * (seq + 1) / 2
        rows.append({"dtype": dtype, "batch": batch, "heads": heads, "seq": seq,
                     "head_dim": head_dim, "causal": True, "seconds": seconds,
                     "tflops": flops / seconds / 1e12})
    return rows


def _device(torch: Any, wanted: str) -> tuple[str, str, Callable[[], None]]:
    """(device, its name, a sync that waits for queued kernels)."""
    if wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise PacerError("--device cuda: torch sees no CUDA device")
        return "cuda", torch.cuda.get_device_name(), torch.cuda.synchronize
    return "cpu", platform.processor() or platform.machine() or "cpu", lambda: None


def calibrate(quick: bool, device: str = "auto") -> dict[str, Any]:
    """Measure and return the profile as the JSON object `--hw` accepts."""
    import torch   # here, not at import time: `pacer --help` must not pay for torch

    dev, dev_name, sync = _device(torch, device)
    plan = PLANS[(dev, quick)]
    torch.manual_seed(0)
    matmul = measure_matmul(torch, dev, sync, plan)
    gemm_rows = measure_gemm_rows(torch, dev, sync, plan)
    bandwidth = measure_bandwidth(torch, dev, sync, plan)
    attention = measure_attention(torch, dev, sync, plan)
    tflops = {d: max(r["tflops"] for r in matmul + gemm_rows if r["dtype"] == d) for d in DTYPES}
    half_rows = {d: fit_gemm_half_rows([r for r in gemm_rows if r["dtype"] == d], tflops[d])
                 for d in DTYPES}
    memory = device_memory_gib(torch, dev)
    return {
        "name": f"calibrated {dev} ({dev_name})",
        "tflops": tflops,
        "bandwidth_tbps": max(r["tbps"] for r in bandwidth),
        "gemm_half_rows": half_rows[CURVE_DTYPE],
        "memory_gib": None if memory is None else round(memory, 2),
        "measured_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "measurements": {"device": dev, "device_name": dev_name, "torch": torch.__version__,
                         "threads": torch.get_num_threads(), "quick": quick,
                         "matmul": matmul, "gemm_rows": gemm_rows,
                         "gemm_half_rows": half_rows, "bandwidth": bandwidth,
                         "attention": attention},
    }


def format_table(profile: dict[str, Any]) -> str:
    m = profile["measurements"]
    lines = [f"{profile['name']}, torch {m['torch']}, {m['threads']} threads",
             f"{'measurement':<34} {'seconds':>10} {'rate':>16}"]
    for r in m["matmul"]:
        what = f"matmul {r['dtype']} {r['m']}x{r['k']}x{r['n']}"
        lines.append(f"{what:<34} {r['seconds']:>10.5f} {r['tflops'] * 1e3:>9.1f} GFLOP/s")
    for r in m.get("gemm_rows", []):
        what = f"matmul {r['dtype']} {r['m']} rows x{r['k']}x{r['n']}"
        lines.append(f"{what:<34} {r['seconds']:>10.5f} {r['tflops'] * 1e3:>9.1f} GFLOP/s")
    for r in m["bandwidth"]:
        what = f"{r['kind']} {r['bytes'] / 2**20:.0f} MiB moved"
        lines.append(f"{what:<34} {r['seconds']:>10.5f} {r['tbps'] * 1e3:>12.1f} GB/s")
    for r in m["attention"]:
        what = f"sdpa {r['dtype']} b{r['batch']} h{r['heads']} s{r['seq']} d{r['head_dim']}"
        lines.append(f"{what:<34} {r['seconds']:>10.5f} {r['tflops'] * 1e3:>9.1f} GFLOP/s")
    rates = ", ".join(f"{d} {t * 1e3:.1f} GFLOP/s" for d, t in profile["tflops"].items())
    lines.append(f"profile: {rates}; bandwidth {profile['bandwidth_tbps'] * 1e3:.1f} GB/s")
    halves = ", ".join(f"{d} {v:g}" for d, v in m.get("gemm_half_rows", {}).items())
    memory = profile.get("memory_gib")
    lines.append(f"GEMM half-rate rows (r½): {halves} (the profile takes {CURVE_DTYPE}'s); "
                 f"memory {'unknown' if memory is None else f'{memory:g} GiB'}")
    return "\n".join(lines)


def profile_replaced(path: str) -> str | None:
    """What the profile at `path` was measured as, where one is there to replace; None where
    there is no file. PacerError for a file that is no profile: a mistyped --output (the
    model's config.json, another tool's result) would be lost to the measurements."""
    if not os.path.exists(path):
        return None
    try:
        old = hardware_from_dict(read_json_object(path, "file"))
    except PacerError as e:
        raise PacerError(f"--output {path}: already exists and is not a hardware profile "
                         f"({e}); give another path or remove it") from None
    return old.name + (f", measured at {old.measured_at}" if old.measured_at else "")


def run(args: argparse.Namespace) -> int:
    try:
        check_output_path(args.output, "--output")      # before the minutes of measuring
        replaced = profile_replaced(args.output)
        profile = calibrate(args.quick, args.device)
        hardware_from_dict(profile)          # refuse to write what `--hw` could not load
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(profile, f, indent=2)
            f.write("\n")
    except (PacerError, OSError) as e:
        print(f"pacer calibrate: error: {e}", file=sys.stderr)
        return 1
    print(format_table(profile))
    print(f"wrote {args.output}" + (f" (replacing its profile {replaced})" if replaced else ""))
    return 0
