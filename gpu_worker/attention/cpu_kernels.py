"""A C++ kernel for decode attention on CPU, built on first use with torch's extension
builder (g++ and ninja; cached under ~/.cache/torch_extensions, so later processes only load
it). It reads K and V in place through the block table instead of gathering them first —
about 3x faster than gather + scaled_dot_product_attention per layer at 64 requests.

Without a compiler (a slim container), or with PACER_CPU_KERNELS=0, `decode_kernel()` is None
and the torch path serves every chunk.
"""
from __future__ import annotations

import os
import sys
import threading

import structlog

log = structlog.get_logger("worker")

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "paged_decode.cpp")
_lock = threading.Lock()
_loaded = False
_kernel = None


def decode_kernel():
    """The compiled `paged_decode_attention`, or None when it cannot be built here."""
    global _loaded, _kernel
    with _lock:
        if not _loaded:
            _loaded = True
            _kernel = _build()
    return _kernel


def _build():
    if os.environ.get("PACER_CPU_KERNELS", "1") == "0":
        return None
    # ninja may live beside this interpreter (a venv that is not on PATH)
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils.cpp_extension import load
        ext = load(name="pacer_paged_decode", sources=[_SOURCE],
                   extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                   extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:   # no compiler or ninja: the torch path is correct, only slower
        log.warning("CPU decode kernel unavailable; using torch attention", error=str(e)[:200])
        return None
    return ext.paged_decode_attention
