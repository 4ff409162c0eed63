"""Paged KV block accounting: which block of the pool belongs to which request.

The pool is `num_blocks` pages of `block_size` token slots. A request's block table maps its
token position p to slot `block_table[p // block_size] * block_size + p % block_size`.
Nothing here touches memory; the worker owns the tensors, this owns the ids.

Built for prefix caching later: blocks are ref-counted and tables only ever grow (until the
request frees them all), so a block shared by two requests would simply carry ref count 2.
"""
from __future__ import annotations

from collections import deque

from scheduler_svc.core.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, "
                             f"got {num_blocks} and {block_size}")
        self.num_total_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        # request id -> that request's block_table (the same list object, not a copy)
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests, 0..1."""
        return self.num_used_blocks / self.num_total_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` slots."""
        return -(-num_tokens // self.block_size)

    def allocate(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Grow the request's table to cover `num_computed_tokens + num_new_tokens` slots.

        Returns the ids appended (possibly none), or None — changing nothing — when the pool
        has too few free blocks.
        """
        table = request.block_table
        needed = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        if table and needed <= len(table):
            return []           # the common decode: its last block still has room
        registered = self._tables.get(request.request_id)
        assert registered is None or registered is table, \
            f"request {request.request_id!r} holds a second block table"
        missing = needed - len(table)
        if missing > len(self._free):
            return None
        new_ids = [self._free.popleft() for _ in range(max(missing, 0))]
        for block_id in new_ids:
            self._ref_counts[block_id] += 1
        table.extend(new_ids)
        if table:
            self._tables[request.request_id] = table
        return new_ids

    def free(self, request: Request) -> None:
        """Drop the request's hold on its blocks and empty its table. Safe to call twice."""
        table = self._tables.pop(request.request_id, None)
        if table is None:
            return
        # Tail first: with prefix caching the head blocks are the likeliest to be shared, so
        # they should be the last to be reused.
        for block_id in reversed(table):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)
        table.clear()

    def check_integrity(self) -> None:
        """Raise AssertionError unless the pool's books balance."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is in the free queue twice"
        owners: dict[int, list[str]] = {}
        for request_id, table in self._tables.items():
            assert table, f"request {request_id!r} is registered with an empty table"
            for block_id in table:
                owners.setdefault(block_id, []).append(request_id)
        for block_id, holders in owners.items():
            # No sharing exists until prefix caching arrives; then this becomes a hash check.
            assert len(holders) == 1, f"block {block_id} is in the tables of {holders}"
            assert block_id not in free, f"block {block_id} is free but held by {holders}"
        for block_id, count in enumerate(self._ref_counts):
            expected = len(owners.get(block_id, ()))
            assert count == expected, f"block {block_id} has ref count {count}, {expected} tables"
            assert (count == 0) == (block_id in free), f"block {block_id} ref {count} vs free queue"
        assert len(free) + len(owners) == self.num_total_blocks, \
            f"free {len(free)} + used {len(owners)} != total {self.num_total_blocks}"
