"""Named scopes for torch's profiler (`bench/offline_throughput.py` reads "layers" (the
decoder layers in one native call), "attention", "lm_head" and "sampling") that cost nothing when no profiler runs: `record_function` itself
takes ~12 µs on a 2-core CPU even then, and the decode path enters a scope per layer."""
from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function

_NOTHING = contextlib.nullcontext()


def scope(name: str):
    """`record_function(name)` while a profiler is collecting, else a no-op context."""
    return record_function(name) if torch._C._autograd._profiler_enabled() else _NOTHING
