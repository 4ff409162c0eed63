"""The tensor-parallel group a worker belongs to.

A single-rank group makes every collective a no-op, so the model code is the same at tp=1
and tp=N (Megatron's pattern, article 03): column-parallel layers need no communication,
row-parallel layers end in `all_reduce`, the vocab-parallel LM head ends in `all_gather`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    # counts collectives in forward passes (tests check two all-reduces per layer)
    num_all_reduces: int = 0
    num_all_gathers: int = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        import torch.distributed as dist
        self.num_all_reduces += 1
        dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., n * size], rank order."""
        if self.size == 1:
            return x
        import torch.distributed as dist
        self.num_all_gathers += 1
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def shard(self, total: int, what: str) -> int:
        """Size of this rank's slice of `total` units (heads, rows); must divide evenly."""
        if total % self.size:
            from shared.errors import PacerError
            raise PacerError(f"{what} = {total} does not divide by tp = {self.size}")
        return total // self.size


SINGLE = TPGroup()
