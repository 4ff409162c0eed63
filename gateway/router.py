"""Which data-parallel replica a request goes to (docs/design.md#cache-aware-routing).

`pacer up --replicas N` runs N engine instances (r0, r1, ...), each the only consumer of its
own request stream `pacer:inst:{id}:requests`; the gateway's `ReplicaRouter` picks one per
request and the upstream XADDs there. With P/D and several prefill instances (`pacer up
--prefill-workers P`, P > 1) the candidates are the prefill instances: the request goes to
the shared stream naming the one chosen, and whichever prefill scheduler reads it hands it
to that one (`PrefillSide.route`); the request stops loading it at its first token, when it
moves to a decode instance. A prompt under their --disagg-min-prompt-tokens, which a decode
instance prefills, is sent to no prefill instance and loads none. Policies (`--router`):

- `round-robin`: in turn.
- `least-loaded`: the fewest requests in flight (running + waiting, as the instance's `stats`
  hash says, or as this gateway counts those it sent and that have not ended, whichever is
  more), then the emptier KV cache.
- `prefix` (the default with replicas): a prefix stays where it is cached. The replica whose
  cached prefix of the prompt is longer than every other's by at least STICKY_SHARE of the
  prompt gets the request, unless it is clearly overloaded (`shared.prefix_hash.overloaded`:
  more than twice the requests in flight of the least loaded replica plus 4) or its KV cache
  is over 90 % full. Otherwise (a new prefix, one cached on several replicas alike, or an
  overloaded holder) the cheapest by

      cost = prompt tokens not cached there + the work already queued there, in tokens
             (+ a penalty as its KV cache fills)

  The queued work is what this gateway sent there and is not done with: each request's
  uncached prompt tokens until its first token comes back, then DECODE_TOKENS until it ends
  (a decode shares its iteration with the others); requests the instance's stats count
  beyond those (another gateway's) are UNKNOWN_TOKENS each. With no prefix cached anywhere
  this is the least work queued. Why a prefix sticks rather than being weighed against the
  load each time: docs/design.md#cache-aware-routing.

An instance whose scheduler has no live heartbeat (stopped, or restarting), or one of whose
worker ranks has none (dead, hung, loading its model again; its ranks are as many as the
gateway's `--instances ID:TP` says, checked as /health checks them), is left out of the choice,
whatever the policy, while another has them all: its stream would hold the request until the
scheduler and its ranks are back. The live set is read from the scheduler heartbeats the
upstream reads every LIVE_REFRESH_S (`Upstream.keep_schedulers_read`), never on a request's way.

What an instance holds cached is the set of block hashes its scheduler publishes
(`pacer:inst:{id}:cached_blocks`, SADD on caching, SREM on eviction, DEL when its index
empties); the router computes the prompt's chained block hashes with the core's own hash
(`shared/prefix_hash.py`) and asks every set at once with SMISMEMBER, in one pipelined round
trip with the load. A block is published only once computed, so the router also remembers
the prefixes it routed in the last RECENT_S seconds: a burst of requests sharing a new system
prompt follows the first one instead of spreading before it is cached. At a request's first
token, whose batch names the instance that computed the prompt, its prefix is remembered
there instead (with P/D a prompt a decode instance prefilled, handed over whole to a pool
of another layout, is no candidate's: it is forgotten; a prefill scheduler may keep an entry
named for another). The published sets
and that memory are hints: a wrong guess costs a cache miss, never a wrong token; one that
cannot be read (a key holding another type, a count that is nan) is left out, not an error.
"""
from __future__ import annotations

import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog

from gateway.config import POLICIES
from shared.keys import Keys
from shared.prefix_hash import cacheable_hashes, overloaded
from shared.protocol import colocated_lengths, scheduler_instances

DECODE_TOKENS = 64           # prompt tokens' worth of work a request is once it decodes
UNKNOWN_TOKENS = 256         # ...and one in flight that another gateway sent
KV_FULL_TOKENS = 2048        # added as an instance's KV cache goes from 90 to 100 % full
RECENT_S = 10.0              # how long a routed prefix counts as on its way to being cached
RECENT_MAX = 1 << 16         # block hashes remembered at most
STICKY_SHARE = 0.5           # a cached prefix leading by this share of the prompt stays put,
KV_FULL = 0.9                # unless overloaded (`overloaded`) or its KV cache is fuller
STATS_FIELDS = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")

log = structlog.get_logger("gateway.router")


@dataclass(frozen=True)
class Candidate:
    """One instance as the router sees it for one request."""
    instance: str
    cached_tokens: int = 0       # the prompt's leading tokens it holds (or was just sent)
    load: int = 0                # requests in flight there
    kv_usage: float = 0.0        # 0..1
    queued_tokens: int = 0       # the work in flight there, in prompt tokens' worth


def cost(c: Candidate, prompt_len: int) -> float:
    """Tokens' worth of work before this request's first token if it goes to `c` (the prefix
    policy's score)."""
    pressure = KV_FULL_TOKENS * max(0.0, c.kv_usage - KV_FULL) / (1.0 - KV_FULL)
    return prompt_len - c.cached_tokens + c.queued_tokens + pressure


def sticky_holder(candidates: Sequence[Candidate], order: Sequence[int],
                  prompt_len: int) -> int | None:
    """The candidate a request's prefix sticks to: the one whose cached prefix leads every
    other's by at least STICKY_SHARE of the prompt, if it is not clearly overloaded."""
    holder = max(order, key=lambda i: candidates[i].cached_tokens)
    runner_up = max((candidates[i].cached_tokens for i in order if i != holder), default=0)
    lead = candidates[holder].cached_tokens - runner_up
    if lead <= 0 or lead < STICKY_SHARE * prompt_len:
        return None
    least = min(c.load for c in candidates)
    h = candidates[holder]
    if overloaded(h.load, least) or h.kv_usage > KV_FULL:
        return None
    return holder


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
        holder = sticky_holder(candidates, order, prompt_len)
        if holder is not None:
            return holder
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

    def __init__(self, redis: aioredis.Redis, keys: Keys, instances: Sequence[tuple[str, int]],
                 policy: str = "prefix") -> None:
        """`instances`: each with its TP degree, as configured (`--instances ID:TP`)."""
        if policy not in POLICIES:
            raise ValueError(f"unknown router policy {policy!r}; one of {POLICIES}")
        if not instances:
            raise ValueError("a router needs at least one instance")
        self.redis, self.policy, self._root_keys = redis, policy, keys
        self._degrees = list(instances)
        self.instances = [inst for inst, _ in instances]
        self._keys = [keys.for_instance(i) for i in self.instances]
        self._turns = itertools.count()
        self._outstanding = [0] * len(self.instances)         # requests in flight
        self._queued = [0] * len(self.instances)              # their work, in tokens
        # request id -> (instance index, the work it counts for there)
        self._sent_to: dict[str, tuple[int, int]] = {}
        self._recent: OrderedDict[bytes, tuple[int, float]] = OrderedDict()
        # request id -> (instance index, its prompt's hashes) remembered there, until its
        # first token says where the prompt was computed
        self._prefixes: dict[str, tuple[int, list[bytes]]] = {}
        self.block_size: int | None = None                    # learnt from the stats hashes
        # P/D: the prefill instances' --disagg-min-prompt-tokens, learnt with the block size;
        # a shorter prompt is prefilled by the decode instance it is handed to
        self.min_prompt_tokens = 0
        self.chosen = [0] * len(self.instances)              # requests sent to each, ever
        self._all = list(range(len(self.instances)))
        self._live = self._all
        # each colocated replica's --max-model-len, from its scheduler's heartbeat (None: not
        # stated, or a P/D prefill instance, whose decode side checks the length)
        self._lengths: list[int | None] = [None] * len(self.instances)
        self._refused: set[str] = set()                      # keys whose hint was refused

    async def choose(self, request_id: str, prompt_token_ids: Sequence[int],
                     length: int = 0) -> str:
        """The instance the request goes to; counts it in flight there. Once per request:
        a submit retried after a dropped connection goes where it was first sent. "" (P/D):
        none, for a prompt under the prefill instances' --disagg-min-prompt-tokens, which
        whichever prefill scheduler reads it hands to a decode instance to prefill: counted
        at a prefill instance until its first token, it loaded one that never computed it
        (while it waited for a decode instance's seat, say), and a reader forwarded it there
        first. `length`: the tokens the request may take (prompt + max_tokens): only the
        replicas whose --max-model-len holds them are candidates, a shorter one would cut
        the answer with "length" (where none does, the gateway refused the request)."""
        if len(self.instances) > 1 and not self.block_size:
            await self._learn_sizes()
        if len(prompt_token_ids) < self.min_prompt_tokens:
            return ""
        turn = next(self._turns)
        work = len(prompt_token_ids)
        live = [i for i in self._live if (self._lengths[i] or length) >= length] or self._live
        if self.policy == "round-robin" or len(live) == 1:
            index = live[turn % len(live)]
        else:
            candidates, hashes = await self._candidates(prompt_token_ids)
            index = live[pick(self.policy, [candidates[i] for i in live],
                              len(prompt_token_ids), turn)]
            work -= candidates[index].cached_tokens
            if self.policy == "prefix" and hashes:
                self._remember(hashes, index)
                self._prefixes[request_id] = (index, hashes)
        self._outstanding[index] += 1
        self._queued[index] += work
        self.chosen[index] += 1
        self._sent_to[request_id] = (index, work)
        return self.instances[index]

    def prefilled(self, request_id: str, computed_on: str | None = None) -> None:
        """The request's first token came, its prompt computed on instance `computed_on`
        (None: not said): from now on it weighs as a decode, and its prefix is remembered
        where that instance's cache holds it. That is not always the instance chosen: with
        P/D a prompt handed over whole is computed by the decode instance it goes to (no
        candidate: forgotten), and a prefill scheduler keeps an entry named for a peer it
        does not see live (remembered there)."""
        index, hashes = self._prefixes.pop(request_id, (None, []))
        if hashes and computed_on is not None:
            if computed_on in self.instances:
                self._remember(hashes, self.instances.index(computed_on))
            else:
                self._forget(hashes, index)
        entry = self._sent_to.get(request_id)
        if entry is not None and entry[1] != DECODE_TOKENS:
            index, work = entry
            self._queued[index] += DECODE_TOKENS - work
            self._sent_to[request_id] = (index, DECODE_TOKENS)

    def ended(self, request_id: str) -> None:
        """The request ended (however): it no longer loads its instance."""
        self._prefixes.pop(request_id, None)
        entry = self._sent_to.pop(request_id, None)
        if entry is not None:
            index, work = entry
            self._outstanding[index] -= 1
            self._queued[index] -= work

    async def read_live(self, beats: dict[str, bytes | None]) -> None:
        """Read the instances that can serve from these scheduler heartbeat keys and values
        (`scheduler_heartbeats`): their scheduler and every worker rank it has heartbeat.
        While none can, those whose scheduler beats (their ranks are on their way back);
        while no scheduler beats, every one (no verdict: Redis restarted, or nothing started
        yet). One instance is always the choice: nothing is read."""
        if len(self.instances) < 2:
            return
        lengths = colocated_lengths(beats.values())
        self._lengths = [lengths.get(inst) for inst in self.instances]
        up = scheduler_instances(list(beats.values()))
        broken = {inst for inst, _ in await missing_ranks(
            self.redis, self._root_keys, [(inst, tp) for inst, tp in self._degrees if inst in up])}
        self._live = ([i for i, inst in enumerate(self.instances) if inst in up - broken]
                      or [i for i, inst in enumerate(self.instances) if inst in up] or self._all)

    async def _candidates(self, prompt_token_ids: Sequence[int]
                          ) -> tuple[list[Candidate], list[bytes]]:
        hashes = (cacheable_hashes(prompt_token_ids, self.block_size)
                  if self.policy == "prefix" and self.block_size else [])
        pipe = self.redis.pipeline(transaction=False)
        for k in self._keys:
            pipe.hmget(k.stats, STATS_FIELDS)
            if hashes:
                pipe.smismember(k.cached_blocks, hashes)
        replies = await pipe.execute(raise_on_error=False)
        step = 2 if hashes else 1
        now = time.monotonic()
        recent = [self._recent_owner(h, now) for h in hashes]
        candidates = []
        for index, instance in enumerate(self.instances):
            running, waiting, usage = (_number(v) for v in self._hint(
                replies[index * step], [None] * len(STATS_FIELDS), self._keys[index].stats))
            cached = 0
            if hashes:
                published = self._hint(replies[index * step + 1], [False] * len(hashes),
                                       self._keys[index].cached_blocks)
                cached = self.block_size * leading(
                    [p or r == index for p, r in zip(published, recent)])
            mine = self._outstanding[index]
            others = max(0, int(running + waiting) - mine)      # another gateway's
            candidates.append(Candidate(instance, cached, mine + others, usage,
                                        self._queued[index] + UNKNOWN_TOKENS * others))
        return candidates, hashes

    async def _learn_sizes(self) -> None:
        """The block size (and, with P/D, `min_prompt_tokens`) from the instances' stats
        hashes, before the first prompt is hashed: learnt only from the replies of the same
        round trip, the first request of a prefix went unhashed and unremembered, and the
        second could be sent elsewhere."""
        pipe = self.redis.pipeline(transaction=False)
        for k in self._keys:
            pipe.hmget(k.stats, ["block_size", "disagg_min_prompt_tokens"])
        for k, reply in zip(self._keys, await pipe.execute(raise_on_error=False)):
            size, least = (_number(v) for v in self._hint(reply, [None, None], k.stats))
            if int(size) > 0:
                self.block_size, self.min_prompt_tokens = int(size), int(least)
                return

    def _hint(self, reply, default, key: str):
        """A reply of the hints' round trip, or `default` where Redis refused it (a key that
        holds another type): a wrong hint costs a cache miss, so it must not refuse every
        request. Logged once per key."""
        if not isinstance(reply, Exception):
            return reply
        if key not in self._refused:
            self._refused.add(key)
            log.warning("routing hint not read; routed without it", key=key, error=str(reply))
        return default

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

    def _forget(self, hashes: list[bytes], index: int) -> None:
        """Forget these hashes where they are remembered at instance `index`."""
        for h in hashes:
            if self._recent.get(h, (None,))[0] == index:
                del self._recent[h]


def _number(value) -> float:
    """A number of a stats hash; 0 for none, one that is not a number, or nan and inf (they
    would break the router's arithmetic and fail every request)."""
    try:
        number = float(value) if value is not None else 0.0
    except ValueError:
        return 0.0
    return number if math.isfinite(number) else 0.0


async def missing_ranks(redis: aioredis.Redis, keys: Keys,
                        degrees: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
    """Of these engine instances ("" for a colocated engine), each with its TP degree as the
    gateway is configured, the worker ranks whose heartbeat key is gone, as (instance, rank)
    in order: one MGET. The degree is never read from a scheduler's heartbeat: an instance
    whose scheduler is gone still has its ranks checked."""
    wanted = [(inst, rank) for inst, tp in degrees for rank in range(tp)]
    beats = (await redis.mget([keys.for_instance(inst).hb_worker(rank) for inst, rank in wanted])
             if wanted else [])
    return [w for w, beat in zip(wanted, beats) if beat is None]
