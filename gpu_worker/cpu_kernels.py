"""C++ kernels for CPU, built on first use with torch's extension builder (g++ and ninja;
cached under ~/.cache/torch_extensions, so later processes only load them). The attention
kernels read K and V in place through the block tables instead of gathering them first:

- `paged_decode_attention` (csrc/paged_decode.cpp): one query row per request — about 3x
  faster than gather + scaled_dot_product_attention per layer at 64 requests;
- `paged_prefill_attention` (csrc/paged_prefill.cpp): chunks of any length over their cached
  prefix, flash-attention style on AVX-512 (head_dim 64 or 128);
- `add_rms_norm`, `rotary_` and `silu_and_mul` (csrc/fused_ops.cpp): residual add + RMSNorm +
  cast, RoPE in place, SwiGLU — each one pass instead of several torch ops (used with
  bfloat16 weights).

Without a compiler (a slim container), or with PACER_CPU_KERNELS=0, `cpu_kernels()` is None
and torch ops serve everything.
"""
from __future__ import annotations

import os
import sys
import threading

import structlog

log = structlog.get_logger("worker")

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_SOURCES = [os.path.join(_CSRC, f) for f in ("bindings.cpp", "paged_decode.cpp", "paged_prefill.cpp", "fused_ops.cpp")]
_lock = threading.Lock()
_loaded = False
_module = None


def cpu_kernels():
    """The compiled extension module, or None when it cannot be built here."""
    global _loaded, _module
    with _lock:
        if not _loaded:
            _loaded = True
            _module = _build()
    return _module


def _build():
    if os.environ.get("PACER_CPU_KERNELS", "1") == "0":
        return None
    # ninja may live beside this interpreter (a venv that is not on PATH)
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils.cpp_extension import load
        return load(name="pacer_cpu_kernels", sources=_SOURCES,
                    extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:   # no compiler or ninja: the torch path is correct, only slower
        log.warning("CPU kernels unavailable; using torch ops", error=str(e)[:200])
        return None
