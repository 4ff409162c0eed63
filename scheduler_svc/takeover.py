"""Requests a scheduler takes over: its own unfinished ones after a restart, and those of a
scheduler that died, from the consumer group's pending entries list (PEL).

    pending  XREADGROUP from id 0: the entries delivered to this consumer name and never acked
             (a scheduler restarted under the same id); read once, at start
    claimed  XAUTOCLAIM of entries idle longer than CLAIM_IDLE_MS, whoever holds them (a
             scheduler with another id that died); polled while there is room
    leases   a live scheduler keeps its own entries from looking idle: every LEASE_REFRESH_S it
             XCLAIMs them to itself (JUSTID, no delivery count), so nobody claims a request
             that is merely long; only those still its own (one script checks the owner
             first): a request another scheduler claimed while this one stalled is that
             one's now, and this one drops it, unfinished and unacked (`take_lost`)

A request taken over resumes from its progress record (`shared/progress.py`): the tokens its
client already has are added as generated tokens and recomputed, and the next token event
carries the next output index, so the client's stream continues without a repeat.

A request that was live each time its scheduler stopped, MAX_TAKEOVERS times over, ends with
an error instead: the group counts each delivery (a take-back and a claim count, a lease
does not), and a request that kills the scheduler serving it must not keep every scheduler
down, restart after restart, with every other request it holds.

One death counts once. With P/D, a prefill scheduler that claimed a dead decode scheduler's
request hands it to a decode instance, maybe to the dead one's name again (it restarts under
it); its take-back would count the same death a second time. So a take-back counts only the
entries its predecessor held: each lease refresh notes its time, on Redis's clock, in the
scheduler's `leases_at` key, and an entry delivered to this name more than HANDED_LATER_MS
after the last one noted was handed to it after it died (its delivery count is kept as it
was). Without a note (no lease refreshed, or Redis restarted) every entry counts.
"""
from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from scheduler_svc.book import RequestBook
from shared.lifecycle import cancel_requested, stream_id_text
from shared.keys import HEARTBEAT_TTL_S, Keys
from shared.progress import decode_progress
from shared.protocol import RequestMsg
from shared.scripts import Script, execute

log = structlog.get_logger("scheduler.takeover")

CLAIM_IDLE_MS = 5_000
LEASE_REFRESH_S = 1.0
PENDING_BATCH = 256
MAX_TAKEOVERS = 3
# an entry delivered to a scheduler's name this long after its last lease refresh was not its
# when it died (a claim comes CLAIM_IDLE_MS after that refresh at the soonest)
HANDED_LATER_MS = int(2 * LEASE_REFRESH_S * 1000)
LEASES_AT_TTL_S = 24 * 3600
CONSUMER_SWEEP_S = 60.0
CLAIMED_SWEEP_S = 2 * HEARTBEAT_TTL_S
# Redis's clock in ms, the one that XPENDING's idle times are counted on
_NOW_MS = "local t = redis.call('TIME')\nlocal now = t[1] * 1000 + math.floor(t[2] / 1000)\n"
# XCLAIM takes an entry from whoever holds it; a lease must not take back what another
# scheduler claimed while this one stalled (both would then serve the request, taking it from
# each other every second, and a sampled stream would splice two runs). KEYS[1]: the request
# stream, KEYS[2]: this scheduler's leases_at; ARGV: the group, this consumer, the TTL of
# leases_at, the entry ids. Returns those another consumer holds.
_KEEP_LEASES = Script(_NOW_MS + """
local lost = {}
for i = 4, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)[1]
  if p and p[2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    lost[#lost + 1] = ARGV[i]          -- claimed by another, or finished (acked) by it
  end
end
redis.call('SET', KEYS[2], now, 'EX', ARGV[3])
return lost
""")
# A take-back: the pending entries of this consumer after ARGV[3] ('-' or '(' id), ARGV[4]
# at most, delivered to it again (their leases new); each one's delivery count goes up by one
# only if the predecessor held it (delivered no later than its last lease refresh, ARGV[5],
# '' if unknown, and HANDED_LATER_MS, ARGV[6]). KEYS[1]: the request stream; ARGV[1], [2]:
# the group, this consumer (made if new: it reads with XREADGROUP '>' only, which makes it
# only once an entry comes, and `XINFO GROUPS` would show no consumer for an idle scheduler).
# Returns [id, fields or nil (trimmed from the stream)] each.
_TAKE_BACK = Script(_NOW_MS + """
redis.call('XGROUP', 'CREATECONSUMER', KEYS[1], ARGV[1], ARGV[2])
local out = {}
for _, p in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], '+', ARGV[4], ARGV[2])) do
  local count = p[4]
  if ARGV[5] == '' or now - p[3] <= tonumber(ARGV[5]) + tonumber(ARGV[6]) then
    count = count + 1
  end
  local e = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, p[1], 'RETRYCOUNT', count)[1]
  out[#out + 1] = {p[1], e and e[2] or false}
end
return out
""")

# XGROUP DELCONSUMER drops the consumer's pending entries with it: only one with none left,
# and none of KEYS[2..] (its heartbeat and claim: it is alive, or starting) there. KEYS[1]:
# the request stream; ARGV: the group, the consumer. Returns 1 if it was deleted.
_FORGET = Script("""
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then return 0 end
end
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return 1
""")


class Takeover:
    def __init__(self, redis: aioredis.Redis, keys: Keys, consumer: str,
                 book: RequestBook, admit=None, held=None) -> None:
        """`admit(entry_id, msg, output_token_ids)`: where a taken-over request goes
        (default: the book; a P/D prefill instance routes it first). `held()`: entries this
        scheduler owns beyond its book's live ones (a P/D prefill instance's requests waiting
        for a reservation), whose leases it keeps too."""
        self.redis, self.keys, self.consumer, self.book = redis, keys, consumer, book
        self.admit = admit or book.admit
        self.held = held
        self.claim_cursor: bytes | str = "0-0"
        # the server the leases are kept on (Recovery notes it): a Redis that restarted empty
        # holds none of them, which says nothing of another scheduler (see refresh_leases)
        self.run_id: str | None = None
        self._lost: list[bytes | str] = []
        self.refreshed_at = time.monotonic()
        self.swept_at = float("-inf")
        self._claimed_at = float("-inf")

    async def take_back_pending(self) -> int:
        """Every entry this consumer was given and never acked, resumed; returns how many.
        Its leases are refreshed at once: the leases_at noted from now on are this one's."""
        since = await self.redis.get(self.keys.leases_at(self.consumer))
        cursor = "-"
        taken = 0
        while True:
            reply = await _TAKE_BACK.run(
                self.redis, (self.keys.requests,), self.keys.requests_group, self.consumer,
                cursor, PENDING_BATCH, since or "", HANDED_LATER_MS)
            if not reply:
                await self.refresh_leases()
                return taken
            cursor = "(" + stream_id_text(reply[-1][0])
            taken += await self.resume([(entry_id, _field_map(flat))
                                        for entry_id, flat in reply])

    def queue_claim(self, pipe, count: int) -> None:
        pipe.xautoclaim(self.keys.requests, self.keys.requests_group, self.consumer,
                        CLAIM_IDLE_MS, start_id=self.claim_cursor, count=count)

    def claimed(self, reply) -> list:
        """The entries an XAUTOCLAIM reply handed to us (the cursor moves on)."""
        self.claim_cursor, entries = reply[0], reply[1]
        if len(reply) > 2 and reply[2]:
            # Redis 7 drops from the group the pending entries the stream's length cap
            # trimmed, and names them only here: nobody can answer their clients now
            log.error("requests lost: trimmed from the request stream before a scheduler "
                      "claimed them; their clients get no answer",
                      entries=[stream_id_text(e) for e in reply[2]])
        if entries:
            self._claimed_at = time.monotonic()
        return entries

    @property
    def sweep_due(self) -> bool:
        """Whether to look for dead consumers: a claim took entries lately (their holder may
        have none left), or the last look was CONSUMER_SWEEP_S ago."""
        now = time.monotonic()
        return now - self._claimed_at <= CLAIMED_SWEEP_S or now - self.swept_at > CONSUMER_SWEEP_S

    async def forget_dead(self) -> list[str]:
        """Delete from the group the consumers of schedulers that are gone and hold no
        pending entry (`XINFO CONSUMERS` grew by one per scheduler id ever seen); returns
        their names. One with entries left stays until they are claimed."""
        self.swept_at = time.monotonic()
        gone = []
        for consumer in await self.redis.xinfo_consumers(self.keys.requests,
                                                         self.keys.requests_group):
            name = stream_id_text(consumer["name"])
            if name != self.consumer and not consumer["pending"] and await self._forget(
                    name, self.keys.hb_scheduler(name), self.keys.claim_scheduler(name)):
                gone.append(name)
        if gone:
            log.info("stopped schedulers removed from the request group", consumers=gone)
        return gone

    async def leave(self) -> bool:
        """At a clean exit: delete this scheduler from the group if it holds no entry (a
        successor under its name is made one again at its take-back)."""
        return await self._forget(self.consumer)

    async def _forget(self, consumer: str, *alive: str) -> bool:
        return bool(await _FORGET.run(self.redis, (self.keys.requests, *alive),
                                      self.keys.requests_group, consumer))

    async def resume(self, entries: list) -> int:
        """Admit stream entries with the tokens their clients already have (one MGET)."""
        msgs = []
        for entry_id, fields in entries:
            if not fields:           # the entry was trimmed from the stream: nothing to serve
                self.book.release(entry_id)
                continue
            msg = self.book.decode(entry_id, fields)
            if msg is not None:
                msgs.append((entry_id, msg))
        if not msgs:
            return 0
        pipe = self.redis.pipeline(transaction=False)
        pipe.mget([self.keys.progress(m.request_id) for _, m in msgs])
        for entry_id, _ in msgs:
            pipe.xpending_range(self.keys.requests, self.keys.requests_group, min=entry_id,
                                max=entry_id, count=1)
        records, *pending = await pipe.execute()
        for (entry_id, msg), record, info in zip(msgs, records, pending):
            tokens = decode_progress(record)
            takeovers = info[0]["times_delivered"] - 1 if info else 0
            if takeovers >= MAX_TAKEOVERS:
                log.error("request dropped: its scheduler stopped each time it served it",
                          request_id=msg.request_id, takeovers=takeovers)
                self.book.finish_now(entry_id, msg, "error", len(tokens), error=(
                    f"the scheduler serving this request stopped {takeovers} times while it "
                    f"ran, so it was dropped (it may be what stops it); see the server's log"))
                continue
            self._resume_one(entry_id, msg, tokens)
        return len(msgs)

    def _resume_one(self, entry_id: bytes | str, msg: RequestMsg, tokens: list[int]) -> None:
        log.info("request taken over", request_id=msg.request_id,
                 tokens_already_streamed=len(tokens))
        self.admit(entry_id, msg, output_token_ids=tokens)

    async def keep_leases(self) -> None:
        """Until cancelled: keep this scheduler's live entries from looking abandoned."""
        while not cancel_requested():
            await asyncio.sleep(LEASE_REFRESH_S)
            try:
                await self.refresh_leases()
            except RedisError as e:
                log.warning("leases not refreshed", error=str(e))
        raise asyncio.CancelledError

    async def refresh_leases(self) -> None:
        """Entries missing from this consumer's pending list are another scheduler's, if the
        server is the one the scheduler serves (its run_id read in the same pipeline): after
        a restart the service's recovery ends them all, as lost with Redis."""
        ids = self.book.leased_entry_ids() + (self.held() if self.held else [])
        if ids:
            pipe = self.redis.pipeline(transaction=False)
            pipe.info("server")
            _KEEP_LEASES.queue(pipe, (self.keys.requests, self.keys.leases_at(self.consumer)),
                               self.keys.requests_group, self.consumer, LEASES_AT_TTL_S, *ids)
            info, lost = await execute(pipe)
            if info["run_id"] == self.run_id:
                # (an entry handed to a decode instance meanwhile reads as lost too: nothing
                # of it is left here to drop)
                self._lost += lost
        self.refreshed_at = time.monotonic()

    @property
    def overdue(self) -> bool:
        """The leases were refreshed longer ago than the refresh comes round: this process
        was stopped (SIGSTOP, swapping) or its loop held, and another scheduler may have
        claimed, or even finished, requests of this one meanwhile."""
        return time.monotonic() - self.refreshed_at > 2 * LEASE_REFRESH_S

    def take_lost(self) -> list[bytes | str]:
        """The entries another scheduler now holds, since the last call: drop their requests."""
        lost, self._lost = self._lost, []
        return lost


def _field_map(flat: list | None) -> dict | None:
    """An entry's fields as a Lua script returns them ([f1, v1, f2, v2, ...]), as a dict."""
    return None if flat is None else dict(zip(flat[::2], flat[1::2]))
