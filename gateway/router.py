"""Which data-parallel replica a request goes to (docs/design.md#cache-aware-routing).

`pacer up --replicas N` runs N engine instances (r0, r1, ...), each the only consumer of its
own request stream `pacer:inst:{id}:requests`; the gateway's `ReplicaRouter` picks one per
request and the upstream XADDs there. Policies (`--router`):

- `round-robin`: in turn.
- `least-loaded`: the fewest requests in flight (running + waiting, as the instance's `stats`
  hash says, or as this gateway counts those it sent and that have not ended, whichever is
  more), then the emptier KV cache.
- `prefix` (the default with replicas): the cheapest by

      cost = prompt tokens not cached there + LOAD_TOKENS · load + a full-cache penalty

  so the instance holding the longest prefix wins unless it is busier by more than that
  prefix is worth; with no prefix cached anywhere this is least-loaded.

What an instance holds cached is the set of block hashes its scheduler publishes
(`pacer:inst:{id}:cached_blocks`, SADD on caching, SREM on eviction, DEL when its index
empties); the router computes the prompt's chained block hashes with the core's own hash
(`shared/prefix_hash.py`) and asks every set at once with SMISMEMBER, in one pipelined round
trip with the load. A block is published only once computed, so the router also remembers
the prefixes it routed in the last RECENT_S seconds: a burst of requests sharing a new system
prompt follows the first one instead of spreading before it is cached. The published sets
and that memory are hints: a wrong guess costs a cache miss, never a wrong token.
"""
from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared.keys import Keys
from shared.prefix_hash import cacheable_hashes

POLICIES = ("round-robin", "least-loaded", "prefix")
LOAD_TOKENS = 256            # prompt tokens one request in flight is worth, against a prefix
KV_FULL_LOAD = 8             # requests' worth added as an instance's KV cache goes 90 -> 100 %
RECENT_S = 10.0              # how long a routed prefix counts as on its way to being cached
RECENT_MAX = 1 << 16         # block hashes remembered at most
STATS_FIELDS = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                "block_size")


@dataclass(frozen=True)
class Candidate:
    """One instance as the router sees it for one request."""
    instance: str
    cached_tokens: int = 0       # the prompt's leading tokens it holds (or was just sent)
    load: int = 0                # requests in flight there
    kv_usage: float = 0.0        # 0..1


def cost(c: Candidate, prompt_len: int) -> float:
    """Tokens' worth of work a request adds by going to `c` (the prefix policy's score)."""
    pressure = KV_FULL_LOAD * max(0.0, c.kv_usage - 0.9) / 0.1
    return prompt_len - c.cached_tokens + LOAD_TOKENS * (c.load + pressure)


def pick(policy: str, candidates: Sequence[Candidate], prompt_len: int, turn: int) -> int:
    """The index of the chosen candidate. `turn` counts the router's choices: round-robin
    follows it, and ties go to the first candidate at or after it (so equals share work)."""
    n = len(candidates)
    order = [(turn + k) % n for k in range(n)]
    if policy == "round-robin":
        return order[0]
    if policy == "least-loaded":
        return min(order, key=lambda i: (candidates[i].load, candidates[i].kv_usage))
    if policy == "prefix":
        return min(order, key=lambda i: (cost(candidates[i], prompt_len), candidates[i].load))
    raise ValueError(f"unknown router policy {policy!r}; one of {POLICIES}")


def leading(flags: Sequence) -> int:
    """How many of `flags` are true before the first false one."""
    count = 0
    for flag in flags:
        if not flag:
            break
        count += 1
    return count


class ReplicaRouter:
    """Chooses the replica of each request and keeps count of what it sent where."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, instances: Sequence[str],
                 policy: str = "prefix") -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown router policy {policy!r}; one of {POLICIES}")
        if not instances:
            raise ValueError("a router needs at least one instance")
        self.redis, self.policy = redis, policy
        self.instances = list(instances)
        self._keys = [keys.for_instance(i) for i in self.instances]
        self._turns = itertools.count()
        self._outstanding = [0] * len(self.instances)
        self._sent_to: dict[str, int] = {}                    # request id -> instance index
        self._recent: OrderedDict[bytes, tuple[int, float]] = OrderedDict()
        self.block_size: int | None = None                    # learnt from the stats hashes
        self.chosen = [0] * len(self.instances)              # requests sent to each, ever

    async def choose(self, request_id: str, prompt_token_ids: Sequence[int]) -> str:
        """The request stream to XADD the request to; counts it in flight there."""
        turn = next(self._turns)
        if self.policy == "round-robin" or len(self.instances) == 1:
            index = turn % len(self.instances)
        else:
            candidates, hashes = await self._candidates(prompt_token_ids)
            index = pick(self.policy, candidates, len(prompt_token_ids), turn)
            if self.policy == "prefix":
                self._remember(hashes, index)
        self._outstanding[index] += 1
        self.chosen[index] += 1
        self._sent_to[request_id] = index
        return self._keys[index].instance_requests

    def ended(self, request_id: str) -> None:
        """The request ended (however): it no longer loads its instance."""
        index = self._sent_to.pop(request_id, None)
        if index is not None:
            self._outstanding[index] -= 1

    async def _candidates(self, prompt_token_ids: Sequence[int]
                          ) -> tuple[list[Candidate], list[bytes]]:
        hashes = (cacheable_hashes(prompt_token_ids, self.block_size)
                  if self.policy == "prefix" and self.block_size else [])
        pipe = self.redis.pipeline(transaction=False)
        for k in self._keys:
            pipe.hmget(k.stats, STATS_FIELDS)
            if hashes:
                pipe.smismember(k.cached_blocks, hashes)
        replies = await pipe.execute()
        step = 2 if hashes else 1
        now = time.monotonic()
        recent = [self._recent_owner(h, now) for h in hashes]
        candidates = []
        for index, instance in enumerate(self.instances):
            running, waiting, usage, block_size = (_number(v) for v in replies[index * step])
            if block_size and not self.block_size:
                self.block_size = int(block_size)
            cached = 0
            if hashes:
                published = replies[index * step + 1]
                cached = self.block_size * leading(
                    [p or r == index for p, r in zip(published, recent)])
            load = max(int(running + waiting), self._outstanding[index])
            candidates.append(Candidate(instance, cached, load, usage))
        return candidates, hashes

    def _recent_owner(self, h: bytes, now: float) -> int | None:
        entry = self._recent.get(h)
        return entry[0] if entry is not None and now - entry[1] < RECENT_S else None

    def _remember(self, hashes: list[bytes], index: int) -> None:
        now = time.monotonic()
        for h in hashes:
            self._recent[h] = (index, now)
            self._recent.move_to_end(h)
        while len(self._recent) > RECENT_MAX:
            self._recent.popitem(last=False)


def _number(value) -> float:
    try:
        return float(value) if value is not None else 0.0
    except ValueError:
        return 0.0
