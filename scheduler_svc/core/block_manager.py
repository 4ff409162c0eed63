"""Paged KV block accounting: which block of the pool belongs to which request, and which
blocks hold a known prefix (docs/design.md#prefix-caching).

The pool is `num_blocks` pages of `block_size` token slots. A request's block table maps its
token position p to slot `block_table[p // block_size] * block_size + p % block_size`.
Nothing here touches memory; the worker owns the tensors, this owns the ids.

Prefix caching: a full block whose K/V have been computed is registered under a hash chained
over its parent block's hash and its own token ids (`block_hash`), so the hash names the whole
prefix up to the block's end. A request admitted later takes the longest run of registered
blocks matching its own chain (ref count +1 each) and computes only the rest. Blocks are
shared only that way, and only once full and computed, so nobody ever writes into a shared
block. A freed block keeps its hash; free blocks are handed out unregistered ones first, then
registered ones least recently used first (evicting their hash).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from scheduler_svc.core.request import Request
# the hash lives in shared/ so the gateway's router computes the same names
from shared.prefix_hash import ROOT_HASH, block_hash, block_hashes  # noqa: F401


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, "
                             f"got {num_blocks} and {block_size}")
        self.num_total_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        # Free blocks: unregistered ones (content unknown or unwanted), handed out first...
        self._free_plain: deque[int] = deque(range(num_blocks))
        # ...then registered ones, least recently used first; taking one evicts its hash.
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._block_of: dict[bytes, int] = {}       # the prefix cache index: hash -> block
        # request id -> the request holding blocks (its block_table is the list it grows)
        self._holders: dict[str, Request] = {}
        # blocks taken from their request but not yet back in the pool (`set_aside`): request
        # id -> the blocks, held until `release_aside`
        self._aside: dict[str, list[int]] = {}
        # vLLM's counters, in tokens: prompt tokens looked up at admission, and found cached
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # what the index gained and lost, for a service that publishes it (None: not kept):
        # ("stored", hash), ("removed", hash), ("cleared", b"")
        self._events: list[tuple[str, bytes]] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included (they are handed out when needed)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def num_aside_blocks(self) -> int:
        return sum(map(len, self._aside.values()))

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache index, held or free."""
        return len(self._block_of)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests, 0..1."""
        return self.num_used_blocks / self.num_total_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` slots."""
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------

    def request_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The request's chained block hashes, computed up to `num_blocks` full blocks (its
        tokens only ever grow, so they are computed once and kept on the request)."""
        hashes = request.block_hashes
        if len(hashes) < num_blocks:
            size = self.block_size
            tokens = request.all_token_ids
            parent = hashes[-1] if hashes else ROOT_HASH
            for start in range(len(hashes) * size, num_blocks * size, size):
                parent = block_hash(parent, tokens[start:start + size])
                hashes.append(parent)
        return hashes

    def looks_up(self, request: Request) -> bool:
        """Whether admission looks the request up in the cache: not with caching off, nor for
        a request that wants its prompt's log-probabilities (it computes every row: they
        come from the logits)."""
        return self.enable_prefix_caching and request.sampling.prompt_logprobs is None

    def find_cached_prefix(self, request: Request) -> list[int]:
        """The blocks of the longest cached run of the request's leading full blocks; changes
        nothing. The last token is always left out: it must be computed for its logits, and
        its K/V must go into a block the request holds alone."""
        if request.block_table or not self.looks_up(request):
            return []
        num_blocks = (request.num_tokens - 1) // self.block_size
        found = []
        for h in self.request_hashes(request, num_blocks)[:num_blocks]:
            block_id = self._block_of.get(h)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose K/V are all computed. Call only after the
        iteration that computed them is done (`Scheduler.update`), or once the workers
        verified K/V received into them (P/D, `Scheduler.activate`): a plan that failed, or
        a check in flight or failed, never registers anything. A block whose hash another
        block already has stays unregistered (the same prefix computed twice at once) and
        goes back plain when freed."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_table))
        start = request.num_cached_blocks
        if num_full <= start:
            return
        hashes = self.request_hashes(request, num_full)
        table = request.block_table
        for index in range(start, num_full):
            h, block_id = hashes[index], table[index]
            assert self._hash_of[block_id] is None, f"block {block_id} was written while cached"
            if h not in self._block_of:
                self._block_of[h] = block_id
                self._hash_of[block_id] = h
                if self._events is not None:
                    self._events.append(("stored", h))
        request.num_cached_blocks = num_full

    def keep_events(self) -> None:
        """From now on, record every hash the index gains and loses (`take_events`): the
        scheduler service publishes them for the gateway's router. Off by default."""
        if self._events is None:
            self._events = []

    def take_events(self) -> list[tuple[str, bytes]]:
        """The index's changes since the last call, oldest first."""
        events, self._events = self._events, [] if self._events is not None else None
        return events or []

    def reset_prefix_cache(self) -> None:
        """Forget every registered block: their content is unknown from now on (the workers
        lost their KV cache). Held blocks stay held, free ones become plain."""
        self._block_of.clear()
        if self._events is not None:
            self._events[:] = [("cleared", b"")]
        self._hash_of = [None] * self.num_total_blocks
        self._free_plain.extend(self._free_cached)
        self._free_cached.clear()

    # ---- allocation ----------------------------------------------------------------------

    def allocate(self, request: Request, num_new_tokens: int,
                 cached_prefix: Sequence[int] = ()) -> list[int] | None:
        """Grow the request's table to cover `num_computed_tokens + num_new_tokens` slots.

        `cached_prefix`: blocks from `find_cached_prefix` for a request holding none yet (its
        `num_computed_tokens` already counts their tokens); they are taken first, shared.
        Returns the ids appended (possibly none), or None — changing nothing — when the pool
        has too few free blocks.
        """
        table = request.block_table
        needed = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        if table and not cached_prefix:
            if needed <= len(table):
                return []       # the common decode: its last block still has room
            if needed == len(table) + 1 and self._free_plain:
                # the next most common: a decode starting a block (what the general path below
                # does for it, without the calls; the request holds blocks already)
                block_id = self._free_plain.popleft()
                self._ref_counts[block_id] += 1
                table.append(block_id)
                return [block_id]
        holder = self._holders.get(request.request_id)
        assert holder is None or holder is request, \
            f"request id {request.request_id!r} is held by another request object"
        assert not cached_prefix or not table, "a cached prefix is taken at admission only"
        # A cached block that is free would count twice: it cannot also be handed out fresh.
        free_in_prefix = sum(1 for b in cached_prefix if self._ref_counts[b] == 0) \
            if cached_prefix else 0
        missing = needed - len(table) - len(cached_prefix)
        if missing > self.num_free_blocks - free_in_prefix:
            return None
        for block_id in cached_prefix:
            if self._ref_counts[block_id] == 0:
                del self._free_cached[block_id]
            self._ref_counts[block_id] += 1
        new_ids = list(cached_prefix)
        if missing > 0:
            # unregistered blocks first, in one go (a prompt takes dozens), then cached ones
            num_plain = min(missing, len(self._free_plain))
            take_plain = self._free_plain.popleft
            fresh = [take_plain() for _ in range(num_plain)]
            if missing > num_plain:
                fresh += [self._take_free() for _ in range(missing - num_plain)]
            ref_counts = self._ref_counts
            for block_id in fresh:
                ref_counts[block_id] += 1
            new_ids += fresh
        table.extend(new_ids)
        if cached_prefix:
            request.num_cached_blocks = len(cached_prefix)
        if table:
            self._holders[request.request_id] = request
        return new_ids

    def count_admission(self, request: Request, num_cached_tokens: int) -> None:
        """One lookup at admission, in tokens (vLLM's prefix_cache_queries / _hits); none for
        a request that takes nothing from the cache."""
        if self.looks_up(request):
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_cached_tokens

    def _take_free(self) -> int:
        if self._free_plain:
            return self._free_plain.popleft()
        block_id, _ = self._free_cached.popitem(last=False)      # least recently used
        del self._block_of[self._hash_of[block_id]]
        if self._events is not None:
            self._events.append(("removed", self._hash_of[block_id]))
        self._hash_of[block_id] = None
        return block_id

    def free(self, request: Request) -> None:
        """Drop the request's hold on its blocks and empty its table. Safe to call twice.
        Registered blocks keep their hash and content until the pool needs them."""
        self._drop(self._take_table(request))

    def set_aside(self, request: Request) -> None:
        """Take the request's blocks from it (its table empties, as `free` leaves it) without
        returning them to the pool: no request gets them until `release_aside(request_id)`.
        For blocks another process may still write into (a P/D transfer given up on). Its
        leading blocks from the prefix cache go back now, as `free` lets go of them: nobody
        writes into those (others may share them)."""
        cached = request.num_cached_blocks
        table = self._take_table(request)
        self._drop(table[:cached])
        self._aside.setdefault(request.request_id, []).extend(table[cached:])

    def _take_table(self, request: Request) -> list[int]:
        """The request's blocks, its table emptied; none if it holds none (any more)."""
        if self._holders.pop(request.request_id, None) is None:
            return []
        table = list(request.block_table)
        request.block_table.clear()
        request.num_cached_blocks = 0
        return table

    def release_aside(self, request_id: str) -> int:
        """The blocks `set_aside` took from `request_id` go back to the pool; how many."""
        table = self._aside.pop(request_id, [])
        self._drop(table)
        return len(table)

    def _drop(self, table: list[int]) -> None:
        ref_counts, hash_of = self._ref_counts, self._hash_of
        free_plain, free_cached = self._free_plain.append, self._free_cached
        # Tail first: the head blocks are the likeliest to be shared, so they become the most
        # recently used and are evicted last.
        for block_id in reversed(table):
            ref_counts[block_id] -= 1
            if ref_counts[block_id] == 0:
                if hash_of[block_id] is None:
                    free_plain(block_id)
                else:
                    free_cached[block_id] = None

    # ---- books ---------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError unless the pool's books balance."""
        plain, cached = set(self._free_plain), set(self._free_cached)
        assert len(plain) == len(self._free_plain), "a block is in the free queue twice"
        assert not plain & cached, f"blocks {plain & cached} are in both free queues"
        free = plain | cached
        owners: dict[int, list[str]] = {}
        for request_id, request in self._holders.items():
            table = request.block_table
            assert table, f"request {request_id!r} is registered with an empty table"
            assert len(set(table)) == len(table), f"request {request_id!r} holds a block twice"
            computed_blocks = request.num_computed_tokens // self.block_size
            for index, block_id in enumerate(table):
                owners.setdefault(block_id, []).append(request_id)
                h = self._hash_of[block_id]
                if h is None:
                    continue
                # a cached block: its hash is this request's chain there, and it is full and
                # computed for this request, so the request never writes into it
                assert index < computed_blocks, \
                    f"request {request_id!r} will write into cached block {block_id}"
                assert index < len(request.block_hashes) and request.block_hashes[index] == h, \
                    f"cached block {block_id} does not hold request {request_id!r}'s tokens"
        for request_id, table in self._aside.items():
            for block_id in table:
                owners.setdefault(block_id, []).append(f"{request_id} (set aside)")
        for block_id, holders in owners.items():
            assert len(holders) == 1 or self._hash_of[block_id] is not None, \
                f"block {block_id} is in the tables of {holders} but is not a cached block"
            assert block_id not in free, f"block {block_id} is free but held by {holders}"
        for block_id, count in enumerate(self._ref_counts):
            expected = len(owners.get(block_id, ()))
            assert count == expected, f"block {block_id} has ref count {count}, {expected} tables"
            assert (count == 0) == (block_id in free), f"block {block_id} ref {count} vs free queue"
        for block_id in cached:
            assert self._hash_of[block_id] is not None, f"free cached block {block_id} has no hash"
        for block_id in plain:
            assert self._hash_of[block_id] is None, f"free plain block {block_id} has a hash"
        for h, block_id in self._block_of.items():
            assert self._hash_of[block_id] == h, f"index and block {block_id} disagree"
        assert sum(h is not None for h in self._hash_of) == len(self._block_of), \
            "a block has a hash the index does not know"
        assert len(free) + len(owners) == self.num_total_blocks, \
            f"free {len(free)} + used {len(owners)} != total {self.num_total_blocks}"
