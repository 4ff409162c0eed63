"""Every Redis key, stream, group and channel name in one place.

Which key is which, its type, who writes it and who reads it, as an operator sees them with
`redis-cli`: the table in docs/architecture.md#redis-keys (one table, kept there).

With P/D disaggregation (docs/design.md#pd-disaggregation) every engine instance owns its
plans, results, stats, worker heartbeats and rendezvous under `pacer:inst:{id}:` (e.g.
`pacer:inst:p0:plans`, `pacer:inst:d0:hb:worker:0`); the colocated engine, whose id is empty,
keeps the plain names. The requests and aborts streams, token channels, gateway and scheduler
heartbeats and progress records are shared by all instances.

Every stream is trimmed with `MAXLEN ~`, every per-request key but `submitted` (kept its TTL,
for a submit retried late) is deleted when the request ends and expires if nobody is left to
delete it; nothing stored is pickled (see
`shared/protocol.py`). An engine instance's own keys outlive it, bounded: which, why, and how an
operator removes them is in docs/architecture.md#redis-keys.
"""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "pacer:"
SCHEDULERS_GROUP = "schedulers"

# Approximate stream lengths kept by `XADD ... MAXLEN ~ n`: enough to survive a slow consumer,
# bounded so a stream never grows without limit.
REQUESTS_MAXLEN = 10_000    # an entry carries its prompt's ids: ~25 KB at 7,600 tokens
ABORTS_MAXLEN = 10_000
PLANS_MAXLEN = 1_000
RESULTS_MAXLEN = 1_000

# A service refreshes its heartbeat key every HEARTBEAT_INTERVAL_S with a TTL of
# HEARTBEAT_TTL_S; a key that expired means the service stopped. Worker keys live shorter: the
# scheduler recomputes every running request once a worker's key is gone, and should know
# within about two seconds.
HEARTBEAT_INTERVAL_S = 0.5
# keys a SCAN step asks for: the keyspace holds a progress record per live request and a
# `submitted` key per recent one, and a step of Redis' default 10 is a round trip per 10
SCAN_COUNT = 1000
HEARTBEAT_TTL_S = 5
WORKER_HEARTBEAT_TTL_S = 2

# A progress record outlives a request nobody finishes (its scheduler and gateway both died)
# by at most this long; it is refreshed while tokens keep coming.
PROGRESS_TTL_S = 3600

@dataclass(frozen=True)
class Keys:
    """Key names under one prefix, so that several deployments can share one Redis."""

    prefix: str = DEFAULT_PREFIX
    instance: str = ""              # the engine instance whose keys these are ("": colocated)
    # a data-parallel replica reads its own request stream (`instance_requests`), which the
    # gateway's router feeds, instead of the shared one
    own_requests: bool = False

    def for_instance(self, instance: str) -> "Keys":
        return Keys(self.prefix, instance)

    @property
    def _own(self) -> str:
        """Where the keys an engine instance owns live."""
        return f"{self.prefix}inst:{self.instance}:" if self.instance else self.prefix

    def owning_requests(self) -> "Keys":
        """These keys, with `requests` naming this instance's own request stream."""
        return Keys(self.prefix, self.instance, own_requests=True)

    @property
    def requests(self) -> str:
        """The request stream this scheduler reads: the shared one, or its own."""
        return self.instance_requests if self.own_requests else f"{self.prefix}requests"

    @property
    def instance_requests(self) -> str:
        """A replica's own request stream (group `schedulers`), fed by the gateway's router."""
        return f"{self._own}requests"

    @property
    def cached_blocks(self) -> str:
        """A replica's (or P/D prefill instance's) prefix cache as a set of block hashes (32
        raw bytes each): SADD when a block is cached, SREM when evicted, DEL when the index
        empties."""
        return f"{self._own}cached_blocks"

    @property
    def requests_group(self) -> str:
        return SCHEDULERS_GROUP

    @property
    def aborts(self) -> str:
        return f"{self.prefix}aborts"

    @property
    def plans(self) -> str:
        return f"{self._own}plans"

    @property
    def plans_fence(self) -> str:
        """The entry id of the newest plan the scheduler gave up on (its worker group lost,
        or the plan): rank 0 sends nothing for a plan at or before it (gpu_worker/service.py)."""
        return f"{self._own}plans_fence"

    @property
    def results(self) -> str:
        return f"{self._own}results"

    @property
    def stats(self) -> str:
        return f"{self._own}stats"

    @property
    def restarts(self) -> str:
        """`pacer up`'s count of its restarts, a hash: service name -> restarts."""
        return f"{self.prefix}restarts"

    def tokens(self, gateway_id: str) -> str:
        """The pub/sub channel carrying token batches and finish events for one gateway."""
        return f"{self.prefix}tokens:{gateway_id}"

    def hb_scheduler(self, scheduler_id: str) -> str:
        return f"{self.prefix}hb:scheduler:{scheduler_id}"

    @property
    def hb_scheduler_pattern(self) -> str:
        """For SCAN MATCH: any scheduler's heartbeat."""
        return f"{self.prefix}hb:scheduler:*"

    def leases_at(self, scheduler_id: str) -> str:
        """When a scheduler last refreshed its leases, in ms on Redis's clock: the entries
        its successor takes back that came later were handed to it after it stopped
        (scheduler_svc/takeover.py)."""
        return f"{self.prefix}leases_at:{scheduler_id}"

    def hb_worker(self, rank: int) -> str:
        return f"{self._own}hb:worker:{rank}"

    def claim_scheduler(self, scheduler_id: str) -> str:
        """Which process runs as this scheduler id: set with NX at its start, before any
        heartbeat, so that a second one under the id is refused (shared/lifecycle.py:claimed)."""
        return f"{self.prefix}claim:scheduler:{scheduler_id}"

    def claim_worker(self, rank: int) -> str:
        """Which process runs as this instance's worker rank (as `claim_scheduler`)."""
        return f"{self._own}claim:worker:{rank}"

    @property
    def hb_instance_workers_pattern(self) -> str:
        """For SCAN MATCH: the worker heartbeats of every engine instance (P/D, replicas)."""
        return f"{self.prefix}inst:*:hb:worker:*"

    def hb_gateway(self, gateway_id: str) -> str:
        return f"{self.prefix}hb:gateway:{gateway_id}"

    def submitted(self, request_id: str) -> str:
        """Set (with a TTL) by the submit that enqueued the request: a retried submit sees it
        and adds no second entry (gateway/upstream.py)."""
        return f"{self.prefix}submitted:{request_id}"

    def progress(self, request_id: str) -> str:
        """The output tokens a request has streamed so far (`shared/progress.py`)."""
        return f"{self.prefix}progress:{request_id}"

    @property
    def progress_pattern(self) -> str:
        """For SCAN MATCH: every progress record."""
        return f"{self.prefix}progress:*"

    @property
    def tp_rendezvous(self) -> str:
        """Where worker rank 0 writes the torch.distributed address of its TP group (JSON)."""
        return f"{self._own}tp:rendezvous"

    @property
    def handoff(self) -> str:
        """A decode instance's inbox: reservations asked, requests handed over, cancels."""
        return f"{self._own}handoff"

    @property
    def pool_untold(self) -> str:
        """Set by `pacer up` in a Redis it has just started, before any other process of its
        own, for each decode instance: the first scheduler of that instance takes it (DEL) and
        knows no prefill worker was ever told where its pool is (docs/failure-modes.md)."""
        return f"{self._own}pool_untold"

    @property
    def reservations(self) -> str:
        """A prefill instance's inbox: the blocks decode instances reserved for it, and the
        requests other prefill schedulers read but the gateway's router chose it for."""
        return f"{self._own}reservations"
