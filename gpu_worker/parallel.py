"""The tensor-parallel group a worker belongs to.

A single-rank group makes every collective a no-op, so the model code is the same at tp=1
and tp=N (Megatron's pattern, docs/design.md#tensor-parallelism): column-parallel layers need
no communication, row-parallel layers end in `all_reduce`, the vocab-parallel LM head ends in
`all_gather`.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from shared.errors import PacerError


class CollectiveError(RuntimeError):
    """A collective failed: a peer rank died, dropped the connection or hung past the
    group's timeout. Told apart from the rank's own failures (out of memory in its forward,
    say), which are not a peer's doing and are named as this rank's."""


@contextmanager
def collective():
    """Around a torch.distributed call: its RuntimeError becomes a CollectiveError."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:
        raise CollectiveError(str(e)) from e


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    # counts collectives in forward passes (tests check two all-reduces per layer)
    num_all_reduces: int = 0
    num_all_gathers: int = 0
    # when set, wall time spent inside collectives accumulates here (bench/tp_scaling.py);
    # it includes waiting for the slowest rank, which is part of what TP costs
    timed: bool = False
    comm_seconds: float = 0.0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        import torch.distributed as dist
        self.num_all_reduces += 1
        with self._timing(x), collective():
            dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., n * size], rank order."""
        if self.size == 1:
            return x
        import torch.distributed as dist
        self.num_all_gathers += 1
        parts = [torch.empty_like(x) for _ in range(self.size)]
        with self._timing(x), collective():
            dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    @contextmanager
    def _timing(self, x: torch.Tensor):
        if not self.timed:
            yield
            return
        # NCCL collectives are asynchronous on the stream: fence both ends to time them
        sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
        sync()
        start = time.perf_counter()
        yield
        sync()
        self.comm_seconds += time.perf_counter() - start

    def shard(self, total: int, what: str) -> int:
        """Size of this rank's slice of `total` units (heads, rows); must divide evenly."""
        if total % self.size:
            raise PacerError(f"{what} = {total} does not divide by tp = {self.size}")
        return total // self.size


SINGLE = TPGroup()
