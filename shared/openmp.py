"""How OpenMP threads wait between parallel regions, set by the entry points that run torch
(`pacer`'s command line, the benchmarks) before torch loads its OpenMP runtime, never at import.

Measured by `bench/omp_wait.py` on a 2-core machine: spinning without bound (GNU OpenMP's
ACTIVE) collapses ops 20-80x as soon as other processes — the gateway, the scheduler, Redis,
a second rank — want the cores; sleeping at once (PASSIVE) costs a wake-up per region, a third
of a decode iteration there. The default is a bounded spin; set OMP_WAIT_POLICY yourself to
choose another. Child processes (the services `pacer up` starts, tensor-parallel followers)
inherit it.
"""
from __future__ import annotations

import os


def default_omp_wait_policy() -> None:
    """A bounded spin, unless OMP_WAIT_POLICY is set already. Call before importing torch."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
        os.environ.setdefault("GOMP_SPINCOUNT", "20000")
