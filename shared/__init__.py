"""What more than one service imports: sampling parameters, the iteration plan, errors,
config parsing, the tokenizer and chat template, model sources, the Redis protocol.

Nothing here imports torch at module level (the scheduler core must stay torch-free).

One process-wide setting lives here because it must be in place before torch loads its
OpenMP runtime: OpenMP threads that spin while they wait collapse a CPU forward by up to
100x as soon as another process (the gateway, the scheduler, Redis, a second rank) wants the
same cores — measured on a 2-core machine, `bench/omp_wait.py`. Passive waiting costs little
on an idle machine. Set OMP_WAIT_POLICY yourself to override.
"""
import os as _os

_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
