"""What this machine's CPU can do, read from /proc/cpuinfo (no torch): the ISA level of the
CPU kernels and the dtype `--dtype auto` serves in."""
from __future__ import annotations

import functools

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


def auto_dtype(device: str, flags: frozenset[str] | None = None) -> str:
    """`--dtype auto`: bfloat16 on CUDA and on CPUs with native bf16 dot products, where it is
    the fast dtype (docs/benchmarks.md has the measurement on both kinds of CPU); float32 on
    other CPUs, where bf16 is the slow one."""
    if device.startswith("cuda"):
        return "bfloat16"
    flags = cpu_flags() if flags is None else flags
    return "bfloat16" if device == "cpu" and NATIVE_BF16_FLAGS & flags else "float32"
