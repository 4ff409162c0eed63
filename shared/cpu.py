"""What this machine's CPU can do, read from /proc/cpuinfo (no torch): the ISA level of the
CPU kernels and the dtype `--dtype auto` serves in."""
from __future__ import annotations

import functools
import os

# bfloat16 dot products in hardware: AVX512-BF16 (Cooper Lake, Zen 4 and later) or AMX
# (Sapphire Rapids and later). Without them a bf16 GEMM widens to float32 in software.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The feature flags of the first CPU (empty where /proc/cpuinfo has none). Read once per
    process: the kernel pickers ask on every GEMM (0.04 ms a read alone; served, one-row decode
    steps spent ~5 % of the forward thread's samples in it)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


# PACER_CPU_ISA levels below AVX-512 (gpu_worker/kernel_build.py names them all): a process
# held there decides as a CPU of that level would, which has no native bf16
HELD_BELOW_AVX512 = frozenset({"generic", "avx2"})


def native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether this process serves bf16 dot products in hardware: the CPU has them and
    PACER_CPU_ISA does not hold it below AVX-512 (held to AVX2, `--dtype auto` and the GEMM
    paths choose as on an AVX2-only CPU)."""
    flags = cpu_flags() if flags is None else flags
    return (bool(NATIVE_BF16_FLAGS & flags)
            and os.environ.get("PACER_CPU_ISA", "").strip() not in HELD_BELOW_AVX512)


def auto_dtype(device: str, flags: frozenset[str] | None = None) -> str:
    """`--dtype auto`: bfloat16 on CUDA and on CPUs with native bf16 dot products, where it is
    the fast dtype (docs/benchmarks.md has the measurement on both kinds of CPU); float32 on
    other CPUs, and where PACER_CPU_ISA holds this one below AVX-512, where bf16 is the slow
    one."""
    if device.startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if device == "cpu" and native_bf16(flags) else "float32"


# ---- cores for the forward threads -------------------------------------------------------
# Two compute threads on one core take turns at the kernel scheduler's granularity: on two
# cores a P/D prefill thread that woke beside the decode thread held it off its core for
# 8 ms while the other core sat idle (docs/design.md#cores-for-the-forward-threads). `pacer
# up` therefore gives each engine instance's forward threads cores of their own where there
# are enough (`place_instances`), and each worker rank pins its forward thread to its
# instance's cores (`pin_forward_thread`); other threads (the event loop, the K/V transfer)
# stay free to run wherever a core is idle.

_forward_cpus: frozenset[int] | None = None


def parse_cpu_list(text: str) -> list[int]:
    """Reads the kernel's CPU list format: "0-3,6" is [0, 1, 2, 3, 6]."""
    bad = ValueError(f"not a CPU list: {text!r} (e.g. 0-3,6)")
    cpus: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, dash, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi if dash else lo)
        except ValueError:
            raise bad from None
        if first < 0 or last < first:
            raise bad
        cpus += range(first, last + 1)
    if not cpus:
        raise bad
    return sorted(set(cpus))


def format_cpu_list(cpus: list[int]) -> str:
    return ",".join(map(str, sorted(cpus)))


def place_instances(threads: list[int], cores: list[int]) -> list[list[int]] | None:
    """Disjoint cores for engine instances that run `threads[i]` compute threads in all, in
    order, or None when they do not fit (then none is pinned: sharing is better than
    stacking) or when there is one instance (it has every core anyway)."""
    if len(threads) < 2 or sum(threads) > len(cores):
        return None
    placed, at = [], 0
    for n in threads:
        placed.append(cores[at:at + n])
        at += n
    return placed


def set_forward_cpus(cpus: list[int] | None) -> None:
    """The cores this process's forward thread is to run on (None: wherever)."""
    global _forward_cpus
    if cpus:
        allowed = os.sched_getaffinity(0)
        if not set(cpus) <= allowed:
            raise ValueError(f"CPUs {format_cpu_list(sorted(set(cpus) - allowed))} are not "
                             f"available to this process (it may use "
                             f"{format_cpu_list(sorted(allowed))})")
    _forward_cpus = frozenset(cpus) if cpus else None


def pin_forward_thread() -> None:
    """Called by the thread that runs the forwards, before its first: keeps it (and the
    OpenMP team it starts, which inherits its mask) on its cores."""
    if _forward_cpus:
        os.sched_setaffinity(0, _forward_cpus)      # pid 0: the calling thread
