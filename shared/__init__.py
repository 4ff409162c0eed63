"""What more than one service imports: sampling parameters, the iteration plan, errors,
config parsing, the tokenizer and chat template, model sources, the Redis protocol.

Nothing here imports torch at module level (the scheduler core must stay torch-free).

One process-wide setting lives here because it must be in place before torch loads its
OpenMP runtime: how OpenMP threads wait between parallel regions (`bench/omp_wait.py`, on a
2-core machine). Spinning without bound (GNU OpenMP's ACTIVE) collapses ops 20-80x as soon
as other processes — the gateway, the scheduler, Redis, a second rank — want the cores;
sleeping at once (PASSIVE) costs a wake-up per region, a third of a decode iteration here.
The default is a bounded spin; set OMP_WAIT_POLICY yourself to choose another.
"""
import os as _os

if "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
    _os.environ.setdefault("GOMP_SPINCOUNT", "20000")
