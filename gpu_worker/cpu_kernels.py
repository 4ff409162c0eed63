"""C++ kernels for CPU, built ahead of time once per x86 ISA level (kernel_build.py, run by
`make setup` or `pacer build-kernels`) and picked here by the CPU's features. A serving
process never compiles. The attention kernels read K and V in place through the block tables
instead of gathering them first:

- `paged_decode_attention` (csrc/paged_decode.cpp): one query row per request — about 3x
  faster than gather + scaled_dot_product_attention per layer at 64 requests;
- `paged_prefill_attention` (csrc/paged_prefill.cpp): chunks of any length over their cached
  prefix, flash-attention style (AVX-512 levels; head_dim 64 or 128);
- `add_rms_norm`, `rotary_` and `silu_and_mul` (csrc/fused_ops.cpp): residual add + RMSNorm +
  cast, RoPE in place, SwiGLU — each one pass instead of several torch ops (used with
  bfloat16 weights);
- `DecoderStack` (csrc/decoder.cpp): every layer of an iteration of decodes alone in one call,
  where the matrices are int4 in the VNNI layout (docs/design.md#one-call-per-decode-step).

The level is the best one the CPU runs (`generic` < `avx2` < `avx512`); PACER_CPU_ISA=<level>
forces a lower one (a higher one than the CPU runs is refused). With PACER_CPU_KERNELS=0, or
when the level's library is not built, `cpu_kernels()` is None (logged once) and torch ops
serve everything, correctly but slower.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import threading

import structlog

from gpu_worker import kernel_build
from shared.cpu import cpu_flags
from shared.errors import PacerError

log = structlog.get_logger("worker")

_lock = threading.Lock()
_loaded: dict[str, object] = {}      # level -> module (or None when it cannot load)


def best_level(flags: frozenset[str] | None = None) -> str:
    """The highest ISA level this CPU runs, or the one PACER_CPU_ISA asks for if it runs (a
    PacerError, one line at the command, where the variable names no level this CPU runs)."""
    flags = cpu_flags() if flags is None else flags
    runnable = kernel_build.supported_levels(flags)
    forced = os.environ.get("PACER_CPU_ISA", "").strip()
    if not forced:
        return runnable[-1]
    if forced not in kernel_build.LEVEL_NAMES:
        raise PacerError(f"PACER_CPU_ISA={forced!r}: one of {', '.join(kernel_build.LEVEL_NAMES)}")
    if forced not in runnable:
        raise PacerError(f"PACER_CPU_ISA={forced}: this CPU runs only {', '.join(runnable)}")
    return forced


def cpu_kernels(level: str | None = None):
    """The extension module of the CPU's ISA level (or `level`), or None when unavailable."""
    if os.environ.get("PACER_CPU_KERNELS", "1") == "0":
        return None
    level = level or best_level()
    with _lock:
        if level not in _loaded:
            _loaded[level] = _load(level)
    return _loaded[level]


def _load(level: str):
    folder = kernel_build.default_dir()
    path = kernel_build.library_path(folder, level)
    if os.environ.get("PACER_KERNEL_DIR") and not os.path.isdir(folder):
        # a mistyped or stale variable is the cause, not a build never made
        log.warning("PACER_KERNEL_DIR names no folder; using torch ops (slower). Point it at "
                    "built kernels (`pacer build-kernels --out DIR`) or unset it", path=folder)
        return None
    if not os.path.exists(path):
        log.warning("CPU kernels not built for this CPU; using torch ops (slower). Build them "
                    "with `make setup` or `pacer build-kernels`", level=level, path=path)
        return None
    try:
        # the library links torch's own libraries (libc10, ...), found once torch is loaded;
        # unset, PACER_KERNEL_DIR's place is worked out by importing torch, set it is not
        import torch  # noqa: F401
        name = kernel_build.module_name(level)
        loader = importlib.machinery.ExtensionFileLoader(name, path)
        spec = importlib.util.spec_from_file_location(name, path, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except ImportError as e:    # built against another torch: rebuild
        log.warning("CPU kernels failed to load; using torch ops (slower). Rebuild them with "
                    "`pacer build-kernels`", level=level, path=path, error=str(e)[:200])
        return None
    module.level = level
    return module
