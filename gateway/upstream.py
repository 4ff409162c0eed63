"""What the gateway writes to Redis: requests, aborts, its heartbeat; and what /health reads.

The heartbeat loop also watches Redis itself: a server with another run_id restarted (its
token events published meanwhile are lost), and one unreachable (or out of memory) for
REDIS_UNREACHABLE_S cannot deliver token events. Either way the open requests can no longer
complete, so they end with an error event instead of hanging. A request whose submission is
still on its way when that happens is judged by the run_id its XADD reports (`replaced`):
only the old server's requests are lost. Every ENTRY_CHECK_S it also looks up the entries of
the requests that heard nothing for that long (queued, or lost): one whose entry is gone
from the request stream (deleted, evicted under an allkeys-* maxmemory policy, trimmed while
no scheduler ran), or that a scheduler acked without an answer (one of another release
that could not read it), will never be served, and ends with an error too (`check_entries`).

Aborts that could not be sent (Redis away, stalled, out of memory) are kept, a bounded few,
and sent once a heartbeat gets through again: the scheduler would otherwise decode a request
the gateway ended itself to its max_tokens, for nobody. One that Redis refuses for good is dropped.
A heartbeat's reply, and the entries' lookup, are waited for HEARTBEAT_REPLY_S: a stalled
Redis counts as failing then, not at the socket timeout.

After a restart the connection pool still holds connections to the old server; the first
command on each fails. Submitting and aborting drop those idle connections and try once more,
so the first requests after Redis is back are not refused. A connection can also break after
Redis ran the command and before its reply came: a submit is one script that adds the entry
only if the request id's `submitted` key is new, so a retried submit never enqueues a request
twice (two schedulers reading one stream would each serve a copy); the key holds the entry's
id, which a repeat returns, so the retried request's entry is looked up like any other's. A
retried submit goes where the first try was sent (replica or prefill instance, chosen once),
so the router counts the request where it lives.
"""
from __future__ import annotations

import asyncio
import os
import time
from collections import OrderedDict, deque
from dataclasses import replace
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError

from gateway.router import ReplicaRouter, missing_ranks
from gateway.streams import TokenRouter
from shared import clock
from shared.lifecycle import (cancel_requested, scheduler_heartbeats, stream_id_order,
                              stream_id_text)
from shared.keys import (ABORTS_MAXLEN, HEARTBEAT_INTERVAL_S, HEARTBEAT_TTL_S, REQUESTS_MAXLEN,
                         Keys)
from shared.protocol import (AbortMsg, Heartbeat, RequestMsg, colocated_lengths, encode,
                             protocol_disagreement, scheduler_instances, to_fields)
from shared.redis_retry import TRANSIENT, redis_trouble, retry_redis
from shared.sampling import SamplingParams
from shared.scripts import Script, execute

log = structlog.get_logger("gateway.upstream")

REDIS_UNREACHABLE_S = 3.0
HEARTBEAT_REPLY_S = 1.0     # a heartbeat's reply waited for at most this long
# a submit's, choosing its replica included: a stalled Redis (SIGSTOP, a full disk) held the
# client for the pool's socket timeout (10 s) before its 503; no longer than Redis may fail
# before the open streams end
SUBMIT_REPLY_S = REDIS_UNREACHABLE_S
REDIS_RESTARTED = "Redis restarted and lost the request; send it again"
REQUEST_LOST = ("the request's entry is gone from Redis's request stream (trimmed at its "
                "length cap, deleted, or evicted under maxmemory) before a scheduler finished "
                "it; send it again")
REQUEST_DROPPED = ("a scheduler took the request from Redis's request stream and dropped it "
                   "without an answer (as a scheduler of another pacer release does with a "
                   "request it cannot read); send it again")
ENTRY_CHECK_S = 2.0         # how often, and after how long without news, a request's entry is
                            # looked up
UNSENT_ABORTS_KEPT = 10_000
REPLACED_KEPT = 64          # run ids of servers that restarted away, remembered
# tries of a request's submit or abort when its connection is dead (~0.3 s of waiting when
# Redis is really away: the client gets its 503 soon)
LIVE_CONNECTION_TRIES = 3
SUBMITTED_TTL_S = 60        # how long a request id is remembered against a repeated submit
# KEYS: the requests stream, the id's `submitted` key; ARGV: its TTL, MAXLEN, the entry's
# fields and values. Returns the entry's id: the one added, or for a repeat the one the first
# try added (the `submitted` key holds it), so a retried request is checked for a lost entry
# like any other (`check_entries`)
_SUBMIT_ONCE = Script("""
local first = redis.call('GET', KEYS[2])
if first then
  return first
end
local id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', unpack(ARGV, 3))
redis.call('SET', KEYS[2], id, 'EX', ARGV[1])
return id
""")
LIVE_REFRESH_S = 1.0        # how often the scheduler heartbeats are read (`keep_schedulers_read`)
T = TypeVar("T")


class Upstream:
    def __init__(self, redis: aioredis.Redis, keys: Keys, gateway_id: str,
                 replicas: ReplicaRouter | None = None, prefill: bool = False) -> None:
        self.redis = redis
        self.keys = keys
        # data-parallel replicas: each request goes to the stream of the one this picks; with
        # `prefill` (P/D), to the shared stream, naming the prefill instance this picks
        self.replicas = replicas
        self.prefill = prefill
        self.gateway_id = gateway_id
        self.reply_to = keys.tokens(gateway_id)
        self._pending_aborts: set[asyncio.Task] = set()
        self._unsent_aborts: OrderedDict[str, str] = OrderedDict()     # request id -> reason
        self._replaced: deque[str] = deque(maxlen=REPLACED_KEPT)
        # why this gateway's last heartbeat was not written (None: it was): a Redis that
        # refuses writes (out of memory, a read-only replica) lets every heartbeat key expire,
        # and /health must not blame the services for it
        self.heartbeat_failure: BaseException | None = None
        # why each scheduler of another protocol version beating at the last read must not
        # be sent requests (`protocol_disagreement`): new requests are refused while any does
        self.other_versions: list[str] = []
        # the longest --max-model-len of the schedulers that serve requests whole beating at
        # the last read (`colocated_lengths`; None: none states one): a request that does not
        # fit it is refused (gateway/prompts.py sampling_params), not cut short there
        self.served_max_model_len: int | None = None

    def replaced(self, run_id: str) -> bool:
        """Whether the Redis with this run_id is known to have restarted (lost everything)."""
        return run_id in self._replaced

    async def submit(self, request_id: str, prompt_token_ids: list[int],
                     sampling: SamplingParams, arrival_time: float,
                     deadline: float | None = None
                     ) -> tuple[str, tuple[str, bytes | str]]:
        """`arrival_time`, `deadline` (after which the scheduler ends the request): on Redis's
        clock (shared/clock.py), which the schedulers read, whatever their machines'. Returns the
        run id of the Redis that took the request (when Redis restarts, only the requests
        the old one took are lost) and where its entry is, (stream, entry id) (a retry
        refused as a repeat: where the first try added it).
        Raises TimeoutError when Redis does not answer within SUBMIT_REPLY_S (the request
        may still land once it does: the caller aborts it as any other it sent)."""
        msg = RequestMsg(
            request_id=request_id, prompt_token_ids=prompt_token_ids, sampling=sampling,
            reply_to=self.reply_to, gateway_id=self.gateway_id, arrival_time=arrival_time,
            deadline=deadline)

        instance: str | None = None

        async def send() -> tuple[str, tuple[str, bytes | str]]:
            nonlocal instance
            stream, fields = self.keys.requests, to_fields(msg)
            if self.replicas is not None:
                # chosen once: a try whose reply was lost may have added the entry there, and
                # the retry (refused as a repeat) must not count the request elsewhere
                if instance is None:
                    instance = await self.replicas.choose(
                        request_id, prompt_token_ids,
                        len(prompt_token_ids) + (sampling.max_tokens or 0))
                if self.prefill:
                    fields = to_fields(replace(msg, instance=instance))
                else:
                    stream = self.keys.for_instance(instance).instance_requests
            pipe = self.redis.pipeline(transaction=False)
            _SUBMIT_ONCE.queue(pipe, (stream, self.keys.submitted(request_id)),
                               SUBMITTED_TTL_S, REQUESTS_MAXLEN,
                               *(x for kv in fields.items() for x in kv))
            pipe.info("server")
            entry_id, info = await execute(pipe)
            return info["run_id"], (stream, entry_id)

        return await asyncio.wait_for(self._live_connection(send, "submit request"),
                                      SUBMIT_REPLY_S)

    def prefilled(self, request_id: str, computed_on: str | None = None) -> None:
        """The request's first token came back, its prompt computed on instance `computed_on`
        (None: not said) (P/D: it has left its prefill instance)."""
        if self.replicas is not None:
            self.replicas.prefilled(request_id, computed_on)
            if self.prefill:
                self.replicas.ended(request_id)

    def ended(self, request_id: str) -> None:
        """The request ended, however: it no longer loads its replica."""
        if self.replicas is not None:
            self.replicas.ended(request_id)

    async def abort(self, request_id: str, reason: str) -> None:
        await self._live_connection(lambda: self._send_abort(self.redis, request_id, reason),
                                    "abort request")
        log.info("request aborted upstream", request_id=request_id, reason=reason)

    async def _live_connection(self, op: Callable[[], Awaitable[T]], what: str) -> T:
        """Run `op`; if its connection was dead, drop the pool's idle connections (after a
        restart they all lead to the old server) and run it again, LIVE_CONNECTION_TRIES in
        all: requests sent together after a restart each meet a dead connection, and one
        in use elsewhere while the idle ones were dropped can come back to the pool after
        that (seen in CI: a request's second try failed too)."""
        return await retry_redis(op, what, log, errors=(RedisConnectionError,),
                                 attempts=LIVE_CONNECTION_TRIES,
                                 before_retry=self._drop_idle_connections)

    async def _drop_idle_connections(self) -> None:
        await self.redis.connection_pool.disconnect(inuse_connections=False)

    def abort_soon(self, request_id: str, reason: str) -> None:
        """Abort from code that may itself be cancelled (a client that went away)."""
        task = asyncio.get_running_loop().create_task(self._abort_logged(request_id, reason))
        self._pending_aborts.add(task)
        task.add_done_callback(self._pending_aborts.discard)

    async def _abort_logged(self, request_id: str, reason: str) -> None:
        try:
            await self.abort(request_id, reason)
        except (RedisError, OSError) as e:
            self._not_sent(request_id, reason, e)

    def _not_sent(self, request_id: str, reason: str, error: BaseException) -> None:
        """An abort Redis did not take: kept for a later heartbeat where it could not take it
        yet (away, stalled, out of memory); dropped where it refused it for good (the aborts
        key holds another type, an ACL forbids it): kept, it would fail every heartbeat."""
        if not isinstance(error, TRANSIENT):
            self._unsent_aborts.pop(request_id, None)
            log.error("abort not sent: redis refused it", request_id=request_id, reason=reason,
                      error=str(error))
            return
        if request_id not in self._unsent_aborts:
            log.warning("abort not sent yet; it goes once redis answers",
                        request_id=request_id, reason=reason, error=str(error))
        self._unsent_aborts[request_id] = reason
        if len(self._unsent_aborts) > UNSENT_ABORTS_KEPT:
            dropped, _ = self._unsent_aborts.popitem(last=False)
            log.error("abort not sent", request_id=dropped)

    def _queue_unsent_aborts(self, pipe) -> list[str]:
        """The aborts kept since Redis refused them, queued on `pipe`; their request ids."""
        rids = list(self._unsent_aborts)
        for rid in rids:
            self._send_abort(pipe, rid, self._unsent_aborts[rid])
        return rids

    def _send_abort(self, client, request_id: str, reason: str):
        """The one XADD of an abort, on a client (awaitable) or a pipeline (queued)."""
        return client.xadd(self.keys.aborts, to_fields(AbortMsg(request_id, reason)),
                           maxlen=ABORTS_MAXLEN, approximate=True)

    def _settle_unsent_aborts(self, rids: list[str], replies: list) -> None:
        """Forget the kept aborts Redis took; the others as `_not_sent` says."""
        for rid, reply in zip(rids, replies):
            if isinstance(reply, Exception):
                self._not_sent(rid, self._unsent_aborts.get(rid, ""), reply)
            else:
                self._unsent_aborts.pop(rid, None)
        sent = sum(not isinstance(r, Exception) for r in replies)
        if sent:
            log.info("aborts sent once redis answered", count=sent)

    async def drain(self) -> None:
        """Wait for aborts still being sent (at shutdown)."""
        if self._pending_aborts:
            await asyncio.gather(*self._pending_aborts, return_exceptions=True)

    async def keep_heartbeat_watching_redis(self, router: TokenRouter) -> None:
        """Keep the heartbeat key alive; end the open streams of `router` when Redis restarted
        or has failed for REDIS_UNREACHABLE_S, and those whose entry is gone; send the aborts
        kept meanwhile once Redis takes them."""
        key = self.keys.hb_gateway(self.gateway_id)
        # who beats: `pacer up` tells a restarted gateway that came up from its dead predecessor
        incarnation = {"pid": os.getpid(), "started_at": time.time()}
        run_id: str | None = None
        failing_since: float | None = None
        checked_at = time.monotonic()
        while not cancel_requested():
            tried_at = time.monotonic()
            failed = "heartbeat not written"
            try:
                pipe = self.redis.pipeline(transaction=False)
                beat = Heartbeat("gateway", self.gateway_id, time.time(), incarnation)
                pipe.set(key, encode(beat), ex=HEARTBEAT_TTL_S)
                pipe.info("server")
                pipe.time()
                aborts = self._queue_unsent_aborts(pipe)
                # bounded: a stalled Redis would hold it for the pool's socket timeout (10 s)
                # and end the streams only after twice that
                before = time.time()
                written, info, redis_time, *sent = await asyncio.wait_for(
                    pipe.execute(raise_on_error=False), HEARTBEAT_REPLY_S)
                for reply in (written, info):
                    if isinstance(reply, Exception):
                        self.heartbeat_failure = reply
                        raise reply
                self.heartbeat_failure = None
                if not isinstance(redis_time, Exception):
                    clock.measured(before, redis_time, time.time())
                self._settle_unsent_aborts(aborts, sent)
                replaced, run_id, failing_since = run_id, info["run_id"], None
                if replaced is not None and run_id != replaced:
                    self._replaced.append(replaced)
                    router.fail_all(REDIS_RESTARTED, keep_run_id=run_id)
                    # the idle connections in the pool all lead to the old server
                    await self._drop_idle_connections()
                if time.monotonic() - checked_at >= ENTRY_CHECK_S:
                    checked_at = time.monotonic()
                    failed = "request entries not checked"
                    # bounded alike: a Redis that stalls now would hold this loop, and the
                    # streams it ends, for the socket timeout
                    await asyncio.wait_for(self.check_entries(router), HEARTBEAT_REPLY_S)
            except (RedisError, OSError) as e:       # OSError: TimeoutError too
                log.warning(failed, error=str(e) or type(e).__name__)
                now = time.monotonic()
                failing_since = failing_since or tried_at
                if now - failing_since >= REDIS_UNREACHABLE_S:
                    router.fail_all(f"{redis_trouble(e)}; the request cannot complete")
                    failing_since = now
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
        raise asyncio.CancelledError

    async def check_entries(self, router: TokenRouter) -> int:
        """End the streams quiet for ENTRY_CHECK_S whose request entry is gone, or was acked
        with no finish event at two checks in a row: no scheduler will serve them (one
        pipeline: an XRANGE and an XPENDING of one id each, the group of each stream);
        returns how many."""
        quiet = router.quiet(ENTRY_CHECK_S)
        if not quiet:
            return 0
        pipe = self.redis.pipeline(transaction=False)
        for stream in quiet:
            key, entry_id = stream.entry
            pipe.xrange(key, min=entry_id, max=entry_id, count=1)
            pipe.xpending_range(key, self.keys.requests_group, min=entry_id, max=entry_id,
                                count=1)
        streams = sorted({s.entry[0] for s in quiet})
        for key in streams:
            pipe.xinfo_groups(key)
        # each reply on its own: a key that holds another type now (the stream deleted and
        # the name reused) has lost its entries too, and its error must not hide the others
        replies = await pipe.execute(raise_on_error=False)
        delivered = {key: _last_delivered(groups, self.keys.requests_group)
                     for key, groups in zip(streams, replies[2 * len(quiet):])}
        lost, acked = [], []
        for i, stream in enumerate(quiet):
            found, pending = replies[2 * i], replies[2 * i + 1]
            if stream.finish is not None:
                continue
            if not found or _wrong_type(found):
                lost.append(stream)
            elif isinstance(found, list) and pending == [] and \
                    stream_id_order(stream.entry[1]) <= delivered[stream.entry[0]]:
                # a finish event published with the ack may still be on its way: the next
                # check decides
                if stream.acked_unanswered:
                    acked.append(stream)
                stream.acked_unanswered = True
        # an XPENDING or XINFO refused (no group yet, the stream gone) proves no ack
        refused = [r for r in replies[:2 * len(quiet):2]
                   if isinstance(r, Exception) and not _wrong_type(r)]
        if refused:
            log.warning("request entries not looked up", count=len(refused),
                        error=str(refused[0]))
        for stream in lost:
            stream.fail(REQUEST_LOST)
        if lost:
            log.error("requests lost: their entries are gone from the request stream",
                      count=len(lost), request_ids=[s.request_id for s in lost][:16])
        if acked:
            error = REQUEST_DROPPED + "".join(f"; {why}" for why in self.other_versions[:1])
            for stream in acked:
                stream.fail(error)
            log.error("requests dropped: a scheduler acked their entries without an answer",
                      count=len(acked), request_ids=[s.request_id for s in acked][:16])
        return len(lost) + len(acked)

    async def keep_schedulers_read(self) -> None:
        """Read the scheduler heartbeats every LIVE_REFRESH_S, for the gateway's life: which
        speak another protocol version (`other_versions`), and with replicas the router's live
        set. Each request finds them at most that old; a read that fails keeps the last (the
        heartbeat loop reports Redis's failures)."""
        while not cancel_requested():
            try:
                beats = await scheduler_heartbeats(self.redis, self.keys)
                self.other_versions = _other_versions(beats)
                # with replicas of unequal lengths the longest: one that fits none is refused
                self.served_max_model_len = max(colocated_lengths(beats.values()).values(),
                                                default=None)
                if self.replicas is not None:
                    await self.replicas.read_live(beats)
            except (RedisError, OSError) as e:
                log.debug("scheduler heartbeats not read", error=str(e) or type(e).__name__)
            await asyncio.sleep(LIVE_REFRESH_S)
        raise asyncio.CancelledError

    async def live_schedulers(self, instances: tuple[tuple[str, int], ...] = ()) -> set[str]:
        """The engine instances with a scheduler beating ("" for the colocated engine's)."""
        return _live(await scheduler_heartbeats(self.redis, self.keys), instances)

    async def missing_services(self, tp: int,
                               instances: tuple[tuple[str, int], ...] = ()) -> list[str]:
        """Which services /health needs but whose heartbeat key has expired: the scheduler and
        every worker rank of the colocated engine, or of each engine instance (replica or P/D
        instance; a scheduler's heartbeat names its instance). Then each scheduler of another
        protocol version: it shares the request stream, and cannot serve the requests it
        reads of this gateway's."""
        beats = await scheduler_heartbeats(self.redis, self.keys)
        up = _live(beats, instances)
        missing = [] if instances or "" in up else ["scheduler"]
        missing += [f"instance {inst} scheduler" for inst, _ in instances if inst not in up]
        missing += [f"instance {inst} worker rank {r}" if inst else f"worker rank {r}"
                    for inst, r in await missing_ranks(self.redis, self.keys,
                                                       instances or (("", tp),))]
        return missing + _other_versions(beats)


def _other_versions(beats: dict[str, bytes | None]) -> list[str]:
    """Why each of these scheduler heartbeats names a scheduler of another protocol version
    (`protocol_disagreement`), in key order."""
    return [why for key, value in sorted(beats.items())
            if (why := protocol_disagreement(value, f"scheduler {key}", "gateway"))]


def _live(beats: dict[str, bytes | None], instances: tuple[tuple[str, int], ...]) -> set[str]:
    """The engine instances (`live_schedulers`) among scheduler heartbeats. A colocated
    engine's scheduler counts by its key alone, unless it speaks another protocol version."""
    if instances:
        return scheduler_instances(list(beats.values()))
    ours = [v for v in beats.values()
            if v is not None and protocol_disagreement(v, "", "") is None]
    return {""} if ours else set()


def _last_delivered(groups, name: str) -> tuple[int, int]:
    """The last entry id the consumer group `name` delivered, of an XINFO GROUPS reply; (-1,
    -1) where the group or the stream is not there (nothing delivered)."""
    if isinstance(groups, list):
        for group in groups:
            if stream_id_text(group["name"]) == name:
                return stream_id_order(group["last-delivered-id"])
    return -1, -1


def _wrong_type(reply) -> bool:
    """Whether a reply is Redis's refusal of a key that holds another type."""
    return isinstance(reply, ResponseError) and str(reply).startswith("WRONGTYPE")
