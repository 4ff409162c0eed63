"""P/D disaggregation in the scheduler service: what a prefill instance and a decode instance
do beyond the colocated loop (docs/design.md#pd-disaggregation).

A request's life, and who owns its entry in the requests stream at each point:

    gateway        XADD requests                                   (pending: nobody yet)
    prefill P      XREADGROUP: the entry is P's. A prompt shorter than
                   --disagg-min-prompt-tokens is handed over at once (below).
                   Otherwise XADD ReserveMsg -> decode D's handoff stream
    decode D       allocates blocks for prompt + 1 token (without room, the ask waits there,
                   answered as room frees, in arrival order), XADD ReservedMsg -> P
    prefill P      admits the request with max_tokens 1; every plan carries KV sends for the
                   blocks its chunk fills (layer by layer, into D's reserved blocks); the
                   worker streams the first token to the client and answers once the sends
                   are done
    prefill P      one script, while the entry is still P's: XCLAIM the entry to D's consumer
                   name, XADD HandoffMsg (first token, the sessions written into) -> D (an
                   entry acked meanwhile: CancelMsg instead); the core already freed P's
                   blocks (the sends completed before the result came)
    decode D       the reserved request becomes a running decode at num_computed_tokens =
                   prompt length (or, when its K/V did not all arrive, is recomputed here)
                   and ends like any request: finish event, XACK of the entry

Every failure falls back on the rules of the colocated service: an entry is owned by exactly
one live scheduler, which resumes it from its progress record if it restarts (`takeover.py`),
and K/V that may be missing is recomputed, never trusted.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import structlog

from scheduler_svc.book import RequestBook, deadline_passed
from scheduler_svc.core import Scheduler
from scheduler_svc.core.request import Request, stop_status
from shared import clock
from shared.errors import InvalidRequestError
from shared.lifecycle import stream_id_order, stream_id_text
from shared.keys import HEARTBEAT_INTERVAL_S, HEARTBEAT_TTL_S, Keys
from shared.kv_layout import KVLayoutError, check_peer_layout, other_model
from shared.outputs import RequestOutput
from shared.plan import IterationPlan, KVCheck, KVSend, StepResult
from shared.prefix_hash import cacheable_hashes, overloaded
from shared.protocol import (CancelMsg, HandoffMsg, Heartbeat, ProtocolError, RequestMsg,
                             ReservedMsg, ReserveMsg, decode, encode, from_fields, heartbeat_of,
                             to_fields)
from shared.scripts import Script

log = structlog.get_logger("scheduler.disagg")

HANDOFF_MAXLEN = 100_000
# An inbox (a decode instance's handoff stream, a prefill instance's reservations stream) has
# one reader, its instance's scheduler, which starts at the tail: it trims what it read this
# long before the newest entry it read (left for `pacer inspect`). A request's entries carry
# its prompt: left to HANDOFF_MAXLEN they came to gigabytes.
INBOX_KEPT_MS = 10_000
# no answer to a ReserveMsg this long (or a NO_ROOM answer): ask again, maybe another instance.
# A decode instance without room keeps an ask waiting and answers it once room frees, so this
# is only the fallback for a decode instance lost, or restarted (its waiting asks with it).
RESERVE_RETRY_S = 5.0
# the asks of one prefill instance a decode instance keeps waiting for room; past them it
# answers NO_ROOM (memory: each carries its whole request)
WAITING_ASKS_MAX = 256
# an ask waiting for room is tried again as soon as room may have grown (more free blocks, a
# seat, fewer requests queued), and at least this often (the core's other reasons to refuse,
# a long prompt being prefilled there, change no count)
WAITING_TRY_S = 1.0
# a waiting ask its prefill side has not asked again for this long is dropped (it asks again
# every RESERVE_RETRY_S while it waits)
WAITING_ASK_GONE_S = 3 * RESERVE_RETRY_S
# a new decode scheduler waits this long before its first plan: a prefill worker still writing
# into blocks its predecessor reserved has finished that iteration and seen the restart
DECODE_QUARANTINE_S = 2.0
RESERVATION_TTL_S = 600.0      # a reservation nobody handed over nor cancelled is freed
# block hashes a prefill scheduler remembers the decode instance of (`PrefillSide._placed`)
PLACED_MAX = 1 << 16
# blocks held for a prefill instance's late writes go back after this long in any case
HELD_MAX_S = 600.0
# ... or once a rank of it has had no heartbeat this long: dead (a stopped one that long is
# killed by `pacer up`'s watchdog, 30 s by default, and comes back another process)
HELD_GONE_S = 60.0
# ... or this long after another process is first seen in its rank's heartbeat. That one holds
# the rank's claim, so the old one's lapsed (it died, or was stopped or cut off from Redis
# past the claim's TTL): run again, it starts no write (its connector's fence,
# gpu_worker/kv_transfer/connector.py); this covers what it had on the way then
HELD_REPLACED_S = HEARTBEAT_TTL_S + HEARTBEAT_INTERVAL_S
# A request entry to another scheduler, with its notice, only while it is this one's.
# KEYS[1]: the request stream, KEYS[2]: the stream the notice goes to; ARGV: the group, this
# consumer, the new owner, the entry id, the notice stream's MAXLEN, the notice's field count
# n, its n fields and values, then those of the notice that goes instead when the entry is
# no one's any more (acked: its request ended), if any. Returns 1 moved; 0 no one's; or the
# consumer whose entry it is now (the new owner's: an earlier try of this exchange moved it).
_MOVE = Script("""
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[4], ARGV[4], 1)[1]
local n = tonumber(ARGV[6])
if p and p[2] == ARGV[2] then
  redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, ARGV[4], 'JUSTID')
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', unpack(ARGV, 7, 6 + n))
  return 1
elseif p then
  return p[2]                          -- another scheduler's now: it ends or hands it over
elseif #ARGV > 6 + n then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', unpack(ARGV, 7 + n, #ARGV))
end
return 0
""")
NO_ROOM = (f"no room now, and {WAITING_ASKS_MAX} asks of this prefill instance already wait "
           f"for room there")


@dataclass
class _Decoder:
    """A decode instance as its scheduler's heartbeat describes it."""
    instance: str
    consumer: str
    free_blocks: int
    running: int
    started_at: float
    model: str = ""                # the model it serves: its name, and the weights compared
    weights: str = ""
    # the longest request it holds, prompt + max_tokens (its --max-model-len; 0: not said)
    max_model_len: int = 0

    def holds(self, tokens: int) -> bool:
        """Whether a request of `tokens` (prompt + max_tokens) runs to its end there: past
        its context a decode instance stops it with "length", cutting an answer the gateway
        accepted."""
        return not self.max_model_len or tokens <= self.max_model_len


@dataclass
class _Reservation:
    decode_instance: str
    decode_consumer: str
    block_ids: list[int]
    peers: list[dict]
    incarnation: float
    # the leading blocks the decode pool's prefix cache holds already: never sent into
    cached: int = 0
    sent_ok: bool = True           # every send so far completed
    # a send failed: a write given up at its deadline may still land in these blocks, so
    # nothing sent into them again is trusted (the decode side recomputes the request)
    failed: bool = False
    # destination block -> per rank, the digest of what was last sent into it
    digests: dict[int, list[int]] = field(default_factory=dict)

    def kv_check(self, num_prompt_tokens: int, block_size: int) -> list:
        """[blocks, per rank their digests] of the prompt's blocks sent (those past the
        decode pool's cached ones), for the decode side to verify; [] if some block's digest
        is missing."""
        blocks = self.block_ids[self.cached:-(-num_prompt_tokens // block_size)]
        if not blocks or any(b not in self.digests for b in blocks):
            return []
        ranks = len(self.digests[blocks[0]])
        return [blocks, [[self.digests[b][r] for b in blocks] for r in range(ranks)]]


@dataclass
class _Pending:
    """A long prompt waiting for a decode instance's reservation."""
    entry_id: bytes | str
    msg: RequestMsg
    output_token_ids: list[int]
    asked: str = ""                # the decode instance asked
    asked_at: float = 0.0
    hashes: list[bytes] | None = None    # its prompt's cacheable block hashes, once needed


@dataclass
class Outgoing:
    """What the prefill side owes Redis after an iteration."""
    reserves: list[tuple[str, ReserveMsg]] = field(default_factory=list)   # (instance, msg)
    cancels: list[tuple[str, CancelMsg]] = field(default_factory=list)
    handoffs: list[tuple[str, str, bytes | str, HandoffMsg]] = field(default_factory=list)
    # new requests for the prefill instance the router chose: (instance, consumer, entry, msg)
    forwards: list[tuple[str, str, bytes | str, HandoffMsg]] = field(default_factory=list)


def trim_read(pipe, stream: str, cursor: bytes | str) -> None:
    """Queue the trim of an inbox's entries older than INBOX_KEPT_MS before `cursor`, the
    newest entry its one reader has read: all of them read (entry ids grow with time)."""
    if stream_id_text(cursor) == "$":        # not read yet
        return
    ms, _ = stream_id_order(cursor)
    if ms > INBOX_KEPT_MS:
        pipe.xtrim(stream, minid=f"{ms - INBOX_KEPT_MS}-0", approximate=False)


def stream_messages(reply) -> Iterator[tuple[bytes | str, object]]:
    """(entry id, message) of an XREAD reply; an undecodable entry is logged and skipped
    (its id still comes, as None's, so the cursor moves past it)."""
    for _, entries in reply or []:
        for entry_id, fields in entries:
            try:
                yield entry_id, from_fields(fields)
            except ProtocolError as e:
                log.error("undecodable P/D message skipped", error=str(e))
                yield entry_id, None


def kv_descriptors(values: list[bytes | None]) -> list[dict]:
    """The KV connector descriptor in each worker rank's heartbeat ({} where none, or where
    it is no mapping: read with .get, it crashed the scheduler)."""
    out = []
    for value in values:
        try:
            kv = decode(value).extra.get("kv")
        except (ProtocolError, AttributeError, TypeError):
            kv = None
        out.append(kv if isinstance(kv, dict) else {})
    return out


def descriptors_pending(values: list[bytes | None]) -> list[int]:
    """The ranks of a P/D worker group whose heartbeat carries no KV connector descriptor yet
    while rank 0's does. Rank 0 beats only once the whole group has loaded, but a follower
    beats from its start, while it loads, and its beat takes the descriptor only at the next
    write (HEARTBEAT_INTERVAL_S): read in between, the pool looked like one without a
    connector, and a decode instance refused every reservation (a prefill instance took the
    decode pool for another layout) until a worker restarted."""
    kv = kv_descriptors(values)
    return [rank for rank, d in enumerate(kv) if kv[0] and not d]


def scheduler_beats(values: list[bytes | None], role: str) -> list[Heartbeat]:
    """The heartbeats of schedulers in `role` among scheduler heartbeat values."""
    return [b for b in map(heartbeat_of, values) if b is not None and b.extra.get("role") == role]


def decoders_from(values: list[bytes | None]) -> dict[str, _Decoder]:
    """Decode instances among scheduler heartbeat values."""
    return {b.extra["instance"]: _Decoder(b.extra["instance"], b.id,
                                          int(b.extra.get("free_blocks", 0)),
                                          int(b.extra.get("running", 0)),
                                          float(b.extra.get("started_at", 0.0)),
                                          str(b.extra.get("model", "")),
                                          str(b.extra.get("weights", "")),
                                          int(b.extra.get("max_model_len", 0)))
            for b in scheduler_beats(values, "decode")}


def prefills_from(values: list[bytes | None]) -> dict[str, str]:
    """Prefill instances among scheduler heartbeat values: instance -> consumer name."""
    return {b.extra["instance"]: b.id for b in scheduler_beats(values, "prefill")}


class PrefillSide:
    def __init__(self, keys: Keys, instance: str, core: Scheduler, book: RequestBook,
                 min_prompt_tokens: int, model: dict[str, str] | None = None,
                 consumer: str = "") -> None:
        """`model`: the model this instance serves ({"model", "weights"}, as
        shared/model_source.py:model_identity gives it); `consumer`: its scheduler's name in
        the request stream's group (the owner of the entries it hands over)."""
        self.keys, self.instance, self.core, self.book = keys, instance, core, book
        self.consumer = consumer
        self.min_prompt_tokens = min_prompt_tokens
        self.model = model or {}
        # the decode instances up that serve this model (the only partners)
        self.decoders: dict[str, _Decoder] = {}
        # decode instance -> the incarnation found serving another model: no partner at all
        # (see `_partner`)
        self._foreign: dict[str, float] = {}
        # decode instance -> the incarnation said to have a shorter --max-model-len than ours
        self._shorter: dict[str, float] = {}
        self._other_protocols: set[str] = set()      # said of schedulers of another version
        self.prefills: dict[str, str] = {}           # live prefill instances: their consumers
        self._promised: dict[str, int] = {}          # blocks asked of each since its heartbeat
        self._asked: dict[str, int] = {}             # requests sent to each since then
        # block hash -> (decode instance, its incarnation) the prompt holding that block last
        # went to: its prefix cache likely holds it (see `_choose`); a hint, never trusted
        self._placed: OrderedDict[bytes, tuple[str, float]] = OrderedDict()
        self._pending: dict[str, _Pending] = {}
        self._reservations: dict[str, _Reservation] = {}
        self._msgs: dict[str, tuple[bytes | str, RequestMsg]] = {}
        self.out = Outgoing()
        self.cursor: bytes | str = "$"
        # the request group's last delivered entry, as the last intake saw it: an idle
        # scheduler wakes for the requests past it (service.py's `_wake`)
        self.requests_tail: bytes | str = "0-0"
        self.own: list[dict] = []            # this instance's workers' KV descriptors
        # decode instance -> the incarnation (its scheduler's started_at) whose KV pool does
        # not match ours: its long prompts go to it whole, without asking for blocks each time
        self._refused: dict[str, float] = {}
        # the worker group was lost and no result of the next one is in yet: a rank that only
        # stopped may still write into reserved blocks (see `plans_lost`)
        self._old_writers = False
        self.kv_bytes_total = 0
        self.kv_send_ms_total = 0.0
        self.kv_exposed_ms_total = 0.0
        self.handoffs_total = 0
        self.handoffs_with_kv_total = 0
        self.kv_failed_total = 0
        self.forwarded_total = 0             # new requests handed to the prefill instance chosen

    def pending_entry_ids(self) -> list[bytes | str]:
        """The entries of the requests waiting for a reservation: this scheduler's, though
        not yet in its book (their leases are kept as the book's are)."""
        return [p.entry_id for p in self._pending.values()]

    # ---- in ------------------------------------------------------------------------------

    def route(self, entry_id: bytes | str, msg: RequestMsg) -> None:
        """A new entry of the request stream: this instance's, unless the gateway's router
        chose another live prefill instance (which holds its prefix): that one is handed the
        entry. Only new entries: one taken over is kept (its chosen instance may be dead)."""
        consumer = self.prefills.get(msg.instance) if msg.instance != self.instance else None
        if consumer is None:
            self.admit(entry_id, msg)
            return
        entry = stream_id_text(entry_id)
        self.out.forwards.append((msg.instance, consumer, entry_id,
                                  HandoffMsg(encode(msg), entry, [], [])))
        self.forwarded_total += 1

    def admit(self, entry_id: bytes | str, msg: RequestMsg,
              output_token_ids: list[int] | None = None) -> None:
        """A request this instance now owns (new, or taken back with the tokens its client
        has). A short prompt, or one that already has its first token, goes to a decode
        instance as it is; a long one first gets blocks reserved there."""
        tokens = list(output_token_ids or ())
        pending = self._pending.get(msg.request_id)
        if pending is not None:     # not in the book yet: the book would add it to the core
            self.book.duplicate(msg.request_id, entry_id, pending.entry_id)
            return
        if msg.request_id in self._msgs:
            self.book.admit(entry_id, msg)          # a duplicate (the book acks it) or ours
            return
        pending = self._pending[msg.request_id] = _Pending(entry_id, msg, tokens)
        if tokens or len(msg.prompt_token_ids) < self.min_prompt_tokens:
            self._hand_over_whole(pending)
        else:
            self._ask(pending)

    def lose(self, entry_id: bytes | str) -> None:
        """Another prefill scheduler claimed this entry while this one stalled: forget the
        request's reservation ask and sends, with no cancel (the decode instance holds one
        reservation per request id, the one the new owner's ask gets too)."""
        same = stream_id_text(entry_id)
        for rid, pending in list(self._pending.items()):
            if stream_id_text(pending.entry_id) == same:
                del self._pending[rid]
        for rid, (held, _) in list(self._msgs.items()):
            if stream_id_text(held) == same:
                del self._msgs[rid]
                self._reservations.pop(rid, None)

    def set_workers(self, values: list[bytes | None]) -> None:
        """This instance's worker heartbeats: the KV descriptors a decode pool must match.
        Workers restarted (perhaps with another layout) may match a pool refused before, so
        the refusals are forgotten when the descriptors change."""
        own = kv_descriptors(values)
        if own != self.own:
            self._refused.clear()
        self.own = own

    def _choose(self, blocks: int, writes_kv: bool = False, hashes: Sequence[bytes] = (),
                tokens: int = 0) -> _Decoder | None:
        """The decode instance a request needing `blocks` goes to: the one its prompt's
        leading blocks (`hashes`) last went to, whose prefix cache likely holds them, if it
        has room for the rest (free blocks, less what was asked of it since its last
        heartbeat) and is not overloaded (`overloaded`: its running requests, plus those
        sent since, beside the least loaded one's); else the one with the most free blocks,
        then the fewest running requests. Only among those that hold a request of `tokens`
        (prompt + max_tokens) to its end; with `writes_kv`, whose KV pool ours can write into
        (as far as is known)."""
        candidates = [d for d in self.decoders.values() if d.holds(tokens)
                      and not (writes_kv and self._refused.get(d.instance) == d.started_at)]
        if not candidates:
            return None

        def free(d: _Decoder) -> int:
            return d.free_blocks - self._promised.get(d.instance, 0)

        def load(d: _Decoder) -> int:
            return d.running + self._asked.get(d.instance, 0)

        holder, held = self._holder(hashes)
        if holder in candidates and free(holder) >= blocks - held and \
                not overloaded(load(holder), min(map(load, candidates))):
            chosen, blocks = holder, max(0, blocks - held)
        else:
            chosen = max(candidates, key=lambda d: (free(d), -d.running))
        self._promised[chosen.instance] = self._promised.get(chosen.instance, 0) + blocks
        self._asked[chosen.instance] = self._asked.get(chosen.instance, 0) + 1
        return chosen

    def _holder(self, hashes: Sequence[bytes]) -> tuple[_Decoder | None, int]:
        """The decode instance (the same incarnation) a prompt's leading blocks last went to,
        and how many of them: the blocks of a prompt handed over there join its prefix
        cache. Remembered here, with no Redis read: a stale guess (blocks evicted since)
        costs the transfer a cache hit would have saved, never a wrong token."""
        where, run = None, 0
        for h in hashes:
            at = self._placed.get(h)
            if at is None or where is not None and at != where:
                break
            where, run = at, run + 1
        d = self.decoders.get(where[0]) if where is not None else None
        return (d, run) if d is not None and d.started_at == where[1] else (None, 0)

    def _hashes(self, pending: _Pending) -> list[bytes]:
        if pending.hashes is None:
            pending.hashes = cacheable_hashes(pending.msg.prompt_token_ids,
                                              self.core.block_manager.block_size)
        return pending.hashes

    def _place(self, pending: _Pending, instance: str, incarnation: float) -> None:
        """The prompt goes to this decode instance: its blocks will be cached there."""
        for h in self._hashes(pending):
            self._placed[h] = (instance, incarnation)
            self._placed.move_to_end(h)
        while len(self._placed) > PLACED_MAX:
            self._placed.popitem(last=False)

    def _ask(self, pending: _Pending) -> None:
        """Ask a decode instance for blocks. A decode instance holds one reservation per
        request id and answers a repeated ask with the same blocks, so asking the same one
        again needs no cancel (one would free the blocks the answer names); asking another
        cancels the reservation left behind."""
        if self._too_long(pending):
            return
        block_size = self.core.block_manager.block_size
        decoder = self._choose(-(-(len(pending.msg.prompt_token_ids) + 1) // block_size),
                               writes_kv=True, hashes=self._hashes(pending),
                               tokens=_tokens(pending.msg))
        pending.asked_at = time.monotonic()
        left, pending.asked = pending.asked, decoder.instance if decoder else ""
        if left and left != pending.asked:
            self.out.cancels.append((left, CancelMsg(pending.msg.request_id, "asked elsewhere")))
        if decoder is None and (self.decoders or self._foreign):
            # every decode instance up has a pool ours cannot write into: one prefills it
            # (or none serves this model: this instance serves the request itself)
            self._hand_over_whole(pending)
        elif decoder is not None:
            self.out.reserves.append((decoder.instance, ReserveMsg(encode(pending.msg),
                                                                   self.instance)))

    def _hand_over_whole(self, pending: _Pending) -> None:
        if self._too_long(pending):
            return
        decoder = self._choose(0, hashes=self._hashes(pending), tokens=_tokens(pending.msg))
        pending.asked_at = time.monotonic()
        if decoder is None:
            pending.asked = ""
            if self._foreign:
                self._serve_here(pending)
            return
        del self._pending[pending.msg.request_id]
        if self.book.aborted_early(pending.msg.request_id):
            self.book.finish_now(pending.entry_id, pending.msg, "abort",
                                 len(pending.output_token_ids))
            return
        self._place(pending, decoder.instance, decoder.started_at)     # prefilled there
        self._queue_handoff(decoder.instance, decoder.consumer, pending.entry_id, pending.msg,
                            pending.output_token_ids, [])

    def _too_long(self, pending: _Pending) -> bool:
        """Whether the request ended here, with an error naming the lengths, because no decode
        instance up holds it to its end: each one's --max-model-len is shorter than its prompt
        + max_tokens (which the gateway accepted). Sent there, it was cut short with "length"."""
        msg, tokens = pending.msg, _tokens(pending.msg)
        if not self.decoders or any(d.holds(tokens) for d in self.decoders.values()):
            return False
        lengths = ", ".join(f"{d.instance} {d.max_model_len}"
                            for d in sorted(self.decoders.values(), key=lambda d: d.instance))
        what = (f"a prompt of {tokens - 1} tokens leaves no room in" if
                msg.sampling.max_tokens_default else
                f"prompt {len(msg.prompt_token_ids)} + max_tokens {msg.sampling.max_tokens} = "
                f"{tokens} tokens, more than")
        error = (f"request {msg.request_id!r}: {what} the --max-model-len of every decode "
                 f"instance ({lengths}); give the gateway and every instance the same "
                 "--max-model-len")
        del self._pending[msg.request_id]
        if pending.asked:
            self.out.cancels.append((pending.asked, CancelMsg(msg.request_id, "too long")))
        self.book.finish_now(pending.entry_id, msg, "error", len(pending.output_token_ids),
                             error, "invalid_request_error")
        return True

    def _serve_here(self, pending: _Pending) -> None:
        """Decode instances are up, but none serves this instance's model: the request is
        served here whole, as on a colocated instance, rather than wait for one that may
        never come (a misconfiguration is not fixed in seconds)."""
        del self._pending[pending.msg.request_id]
        self.book.admit(pending.entry_id, pending.msg, pending.output_token_ids)

    def _queue_handoff(self, instance: str, consumer: str, entry_id: bytes | str,
                       msg: RequestMsg, tokens: list[int], kv_received: list[str],
                       num_cached_tokens: int = 0, kv_check: list | None = None) -> None:
        entry = stream_id_text(entry_id)
        self.out.handoffs.append((instance, consumer, entry_id,
                                  HandoffMsg(encode(msg), entry, tokens, kv_received,
                                             num_cached_tokens, kv_check or [])))
        self.handoffs_total += 1
        self.handoffs_with_kv_total += bool(kv_received)
        log.info("request handed over", request_id=msg.request_id, decode_instance=instance,
                 with_kv=bool(kv_received), output_tokens=len(tokens))

    def receive_reservations(self, reply) -> None:
        for entry_id, msg in stream_messages(reply):
            self.cursor = entry_id
            if isinstance(msg, ReservedMsg):
                self._reserved(msg)
            elif isinstance(msg, HandoffMsg):        # another prefill instance forwarded it
                self.admit(msg.entry_id, msg.request_msg)

    def _reserved(self, msg: ReservedMsg) -> None:
        pending = self._pending.get(msg.request_id)
        if pending is None or pending.asked != msg.decode_instance:
            # nobody wants it any more (aborted, or asked elsewhere); but a late answer to an
            # ask repeated at the instance whose blocks the request now uses names those same
            # blocks: cancelling it would free them under the sends
            res = self._reservations.get(msg.request_id)
            if msg.block_ids and (res is None or res.decode_instance != msg.decode_instance):
                self.out.cancels.append((msg.decode_instance,
                                         CancelMsg(msg.request_id, "not wanted")))
            return
        if not msg.block_ids:
            log.info("decode instance refused a reservation", request_id=msg.request_id,
                     decode_instance=msg.decode_instance, error=msg.error)
            if msg.error == NO_ROOM:      # its waiting asks are full: ask again later
                pending.asked_at = time.monotonic()
            else:       # it cannot take K/V (or the request): it prefills it, or refuses it
                self._hand_over_whole(pending)
            return
        why = next(filter(None, map(other_model, self.own, msg.peers)), "")
        if why:     # it restarted with another model since its heartbeat: ask another
            self.out.cancels.append((msg.decode_instance, CancelMsg(msg.request_id, why)))
            self._no_partner(msg.decode_instance, msg.incarnation, why)
            pending.asked = ""
            self._ask(pending)
            return
        mismatch = self._layout_mismatch(msg.peers)
        if mismatch:
            if self._refused.get(msg.decode_instance) != msg.incarnation:
                self._refused[msg.decode_instance] = msg.incarnation
                log.error("decode instance's KV pool cannot take ours; its requests are "
                          "prefilled there", decode_instance=msg.decode_instance,
                          error=mismatch)
            self.out.cancels.append((msg.decode_instance, CancelMsg(msg.request_id, mismatch)))
            self._hand_over_whole(pending)
            return
        del self._pending[msg.request_id]
        rid = msg.request_id
        if self.book.aborted_early(rid):
            self.out.cancels.append((msg.decode_instance, CancelMsg(rid, "aborted")))
            self.book.finish_now(pending.entry_id, pending.msg, "abort", 0)
            return
        # the first token only: min_tokens at most 1 keeps EOS and stop tokens from it, as the
        # whole request's min_tokens does
        sampling = pending.msg.sampling
        prefill_only = replace(pending.msg, sampling=replace(
            sampling, max_tokens=1, min_tokens=min(sampling.min_tokens, 1)))
        self.book.admit(pending.entry_id, prefill_only)
        if self.core.get_request(rid) is None:    # refused (an invalid request): finished
            self.out.cancels.append((msg.decode_instance, CancelMsg(rid, "refused")))
            return
        self._msgs[rid] = (pending.entry_id, pending.msg)
        self._reservations[rid] = _Reservation(msg.decode_instance, msg.decode_consumer,
                                               list(msg.block_ids), list(msg.peers),
                                               msg.incarnation, msg.num_cached_blocks)
        self._place(pending, msg.decode_instance, msg.incarnation)

    def _layout_mismatch(self, peers: list[dict]) -> str:
        """Why this instance's ranks cannot write into `peers` ("" if they can)."""
        if len(peers) != len(self.own):
            return (f"this prefill instance has TP {len(self.own)}, the decode instance TP "
                    f"{len(peers)}: both sides need the same degree")
        try:
            for own, peer in zip(self.own, peers):
                check_peer_layout(own, peer)
        except KVLayoutError as e:
            return str(e)
        return ""

    def housekeeping(self, decoders: dict[str, _Decoder], prefills: dict[str, str]) -> None:
        """New heartbeats of the decode and prefill instances: forget what was promised since,
        ask again where no answer came, stop sending into an instance that restarted."""
        self._promised, self._asked, self.prefills = {}, {}, prefills
        self._foreign = {i: at for i, at in self._foreign.items()
                         if i in decoders and decoders[i].started_at == at}
        self.decoders = {i: d for i, d in decoders.items() if self._partner(d)}
        self._shorter = {i: at for i, at in self._shorter.items()
                         if i in self.decoders and self.decoders[i].started_at == at}
        for d in self.decoders.values():
            if d.holds(self.core.max_model_len) or d.instance in self._shorter:
                continue
            self._shorter[d.instance] = d.started_at
            log.error(f"decode instance {d.instance} has --max-model-len {d.max_model_len}, "
                      f"this prefill instance {self.core.max_model_len}: a longer request "
                      "(prompt + max_tokens) goes to a decode instance that holds it, or ends "
                      "with an error where none does; give every instance the same "
                      "--max-model-len", decode_instance=d.instance)
        for rid, res in self._reservations.items():
            now = decoders.get(res.decode_instance)
            if res.sent_ok and (now is None or now.started_at != res.incarnation):
                log.warning("decode instance restarted or gone; its reservation is void",
                            request_id=rid, decode_instance=res.decode_instance)
                res.sent_ok = False
        self.retry()

    def other_protocols(self, whys: set[str]) -> None:
        """The schedulers beating in another protocol version (`protocol_disagreement`, one
        line each): no partner, whatever their role (their heartbeats read as none, so no
        request goes to them); each said once while it beats."""
        for why in sorted(whys - self._other_protocols):
            log.error(why)
        self._other_protocols = whys

    def _partner(self, decoder: _Decoder) -> bool:
        """Whether a decode instance serves this instance's model. One that serves another
        (other weights, whatever their shape) is no partner at all: its pool must not take
        our K/V, nor may it be handed a prompt whole, which it would answer with its own
        model's tokens."""
        if self._foreign.get(decoder.instance) == decoder.started_at:
            return False
        if decoder.weights == self.model.get("weights", ""):
            return True
        self._no_partner(decoder.instance, decoder.started_at,
                         f"it serves {decoder.model!r} with weights {decoder.weights!r}, this "
                         f"instance {self.model.get('model', '')!r} with weights "
                         f"{self.model.get('weights', '')!r}")
        return False

    def _no_partner(self, instance: str, incarnation: float, why: str) -> None:
        """A decode instance found serving another model: no partner of this one until it
        restarts; said once."""
        self.decoders.pop(instance, None)
        if self._foreign.get(instance) == incarnation:
            return
        self._foreign[instance] = incarnation
        log.error("decode instance serves another model: no request goes to it; they go to "
                  "the decode instances of this model, or are served here while none is up",
                  decode_instance=instance, error=why)

    def retry(self) -> None:
        now = time.monotonic()
        for pending in list(self._pending.values()):
            if self._ended(pending) or now - pending.asked_at < RESERVE_RETRY_S and pending.asked:
                continue
            if pending.output_token_ids or \
                    len(pending.msg.prompt_token_ids) < self.min_prompt_tokens:
                self._hand_over_whole(pending)
            else:
                self._ask(pending)

    def _ended(self, pending: _Pending) -> bool:
        """A request still waiting for its reservation whose client went away or whose
        deadline passed ends now, as one the core holds would, and asks for nothing more."""
        msg, wall = pending.msg, clock.now()
        if self.book.aborted_early(msg.request_id):
            reason, error, kind = "abort", None, "server_error"
        elif msg.deadline is not None and msg.deadline <= wall:
            reason, error, kind = "error", deadline_passed(msg.deadline, wall), "timeout_error"
        else:
            return False
        del self._pending[msg.request_id]
        if pending.asked:
            self.out.cancels.append((pending.asked, CancelMsg(msg.request_id, reason)))
        self.book.finish_now(pending.entry_id, msg, reason, len(pending.output_token_ids),
                             error, kind)
        return True

    # ---- each iteration ------------------------------------------------------------------

    def add_sends(self, plan: IterationPlan) -> IterationPlan:
        """The K/V each scheduled chunk fills goes to its reserved blocks, layer by layer."""
        sends = []
        block_size = self.core.block_manager.block_size
        # a request new to the workers may start after a cached prefix (prefix caching): its
        # blocks are sent too, with the first chunk; those the decode pool has cached are not
        fresh = {r.request_id for r in plan.new_requests}
        for rid, rows in plan.num_scheduled_tokens.items():
            res = self._reservations.get(rid)
            request = self.core.get_request(rid)
            if res is None or request is None:
                continue
            start = request.num_computed_tokens
            if start == 0:              # a fresh start sends everything again
                res.sent_ok = not res.failed and self._still_there(res)
                res.digests.clear()
            if not res.sent_ok:
                continue
            first = max(0 if rid in fresh else start // block_size, res.cached)
            last = (start + rows - 1) // block_size
            if first > last:
                continue                # this chunk fills only blocks cached there
            sends.append(KVSend(rid, res.decode_instance, request.block_table[first:last + 1],
                                res.block_ids[first:last + 1], res.peers))
        return replace(plan, kv_sends=sends) if sends else plan

    def _still_there(self, res: _Reservation) -> bool:
        now = self.decoders.get(res.decode_instance)
        return now is not None and now.started_at == res.incarnation

    def plans_lost(self) -> None:
        """The plans in flight will not be answered (the worker group lost). A request that
        ends before a result of the next group is in (aborted, past its deadline, while the
        scheduler waits for that group) is cancelled with its K/V pending: a rank that only
        stopped may resume a send into its reserved blocks, after the decode side gave them
        to another request. Once a result is in, the old group is gone."""
        self._old_writers = True

    def observe(self, plan: IterationPlan, result: StepResult) -> None:
        self._old_writers = False
        for send in plan.kv_sends:
            per_rank = result.kv_digests.get(send.request_id)
            res = self._reservations.get(send.request_id)
            if per_rank and res is not None:
                for i, block in enumerate(send.dst_block_ids):
                    res.digests[block] = [d[i] for d in per_rank]
        for rid in result.kv_failed:
            res = self._reservations.get(rid)
            if res is not None and res.sent_ok:
                log.warning("KV transfer failed; the decode side will recompute", request_id=rid,
                            decode_instance=res.decode_instance)
                res.sent_ok, res.failed = False, True
                self.kv_failed_total += 1
        stats = result.kv_stats or {}
        self.kv_bytes_total += int(stats.get("bytes", 0))
        self.kv_send_ms_total += float(stats.get("send_ms", 0.0))
        self.kv_exposed_ms_total += float(stats.get("exposed_ms", 0.0))

    def finished(self, output: RequestOutput) -> bool:
        """A request the prefill core finished after its first token: hand it over (True),
        or, when that token really ended it, let the book finish it (False)."""
        rid = output.request_id
        entry = self._msgs.pop(rid, None)
        res = self._reservations.pop(rid, None)
        if entry is None or res is None:
            return False
        entry_id, msg = entry
        tokens = [t.token_id for t in output.new_tokens]
        # ended before its first token (a client gone, a deadline passed mid-prefill): nothing
        # to hand over, and no last token to ask stop_status about
        ended = None if not tokens else stop_status(
            Request(rid, msg.prompt_token_ids, msg.sampling, 0, output_token_ids=tokens),
            self.core.eos_token_ids, self.core.max_model_len)
        if output.finish_reason == "abort" or ended is not None or not tokens:
            # the decode side frees the blocks at once unless a write into them failed or was
            # given up at its deadline (its last plan's result is in: a prefill instance plans
            # nothing ahead)
            self.out.cancels.append((res.decode_instance, CancelMsg(
                rid, "finished", not res.sent_ok or self._old_writers)))
            if ended is not None:
                self.book.finished(replace(output, finish_reason=ended.finish_reason))
                return True
            return False
        self.book.hand_off(rid)
        check = res.kv_check(len(msg.prompt_token_ids), self.core.block_manager.block_size) \
            if res.sent_ok else []
        received = [p["session"] for p in res.peers] if check else []
        self._queue_handoff(res.decode_instance, res.decode_consumer, entry_id, msg, tokens,
                            received, output.num_cached_tokens, check)
        return True

    def forget_all(self) -> None:
        """Redis was lost: every request ended with an error event; nothing is pending."""
        self._pending.clear()
        self._reservations.clear()
        self._msgs.clear()
        self.out = Outgoing()
        self.requests_tail = "0-0"

    # ---- out -----------------------------------------------------------------------------

    def take(self) -> Outgoing:
        out, self.out = self.out, Outgoing()
        return out

    def queue(self, pipe, out: Outgoing) -> None:
        # cancels first: one for a request asked again of the same instance must not free the
        # blocks of the ask after it
        for instance, msg in out.cancels:
            self._notify(pipe, self.keys.for_instance(instance).handoff, msg)
        for instance, msg in out.reserves:
            self._notify(pipe, self.keys.for_instance(instance).handoff, msg)
        for instance, consumer, entry_id, msg in out.handoffs:
            # ended elsewhere: its reservation freed (held where no K/V was trusted to land)
            cancel = CancelMsg(msg.request_msg.request_id, "ended elsewhere",
                               kv_pending=not msg.kv_received)
            self._move(pipe, consumer, entry_id, self.keys.for_instance(instance).handoff, msg,
                       cancel)
        for instance, consumer, entry_id, msg in out.forwards:
            self._move(pipe, consumer, entry_id, self.keys.for_instance(instance).reservations,
                       msg)

    @staticmethod
    def moves_skipped(out: Outgoing, replies: list) -> None:
        """Log each hand-off and forward of `out` that the move script skipped, from the
        replies of the commands `queue` queued (in its order): the entry was no longer this
        scheduler's."""
        moves = [*out.handoffs, *out.forwards]
        done = replies[len(out.cancels) + len(out.reserves):][:len(moves)]
        for (instance, consumer, entry_id, msg), reply in zip(moves, done):
            owner = reply.decode() if isinstance(reply, bytes) else reply
            if owner == 1 or owner == consumer:     # moved (by an earlier try, the latter)
                continue
            why = ("its request ended first (its entry was acked)" if owner == 0 else
                   f"scheduler {owner} claimed its entry meanwhile")
            log.warning("request entry not moved: no longer this scheduler's",
                        request_id=msg.request_msg.request_id, to_instance=instance,
                        entry=stream_id_text(entry_id), why=why)

    def _move(self, pipe, consumer: str, entry_id, stream: str, notice, ended=None) -> None:
        """A request entry to another scheduler: ownership moves first (XCLAIM), then the
        notice; should the notice be lost, that scheduler still finds the entry among its own
        pending ones at its next restart. Only while the entry is still this scheduler's (one
        script checks first): one another scheduler claimed while this one stalled is that
        one's (an XCLAIM would take it from it), and one acked meanwhile ended there (a
        hand-off would start it again on the decode instance, for nobody). For an ended one
        `ended` goes instead, if given: the cancel of its reservation."""
        fields = [x for kv in to_fields(notice).items() for x in kv]
        _MOVE.queue(pipe, (self.keys.requests, stream), self.keys.requests_group,
                    self.consumer, consumer, stream_id_text(entry_id), HANDOFF_MAXLEN,
                    len(fields), *fields,
                    *([x for kv in to_fields(ended).items() for x in kv] if ended else []))

    @staticmethod
    def _notify(pipe, stream: str, msg) -> None:
        pipe.xadd(stream, to_fields(msg), maxlen=HANDOFF_MAXLEN, approximate=True)

    def put_back(self, out: Outgoing) -> None:
        self.out.reserves[:0] = out.reserves
        self.out.handoffs[:0] = out.handoffs
        self.out.cancels[:0] = out.cancels
        self.out.forwards[:0] = out.forwards

    def stats(self) -> dict[str, float]:
        return {"kv_transfer_bytes_total": self.kv_bytes_total,
                "kv_transfer_seconds_total": round(self.kv_send_ms_total / 1e3, 6),
                "kv_transfer_exposed_seconds_total": round(self.kv_exposed_ms_total / 1e3, 6),
                "kv_transfer_failures_total": self.kv_failed_total,
                "handoffs_total": self.handoffs_total,
                "handoffs_with_kv_total": self.handoffs_with_kv_total,
                "requests_forwarded_total": self.forwarded_total,
                "num_requests_awaiting_reservation": self.num_awaiting_reservation,
                # the gateway's router reads it: it chooses no prefill instance for a
                # shorter prompt (docs/design.md#cache-aware-routing)
                "disagg_min_prompt_tokens": self.min_prompt_tokens}

    @property
    def num_awaiting_reservation(self) -> int:
        return len(self._pending)

    def counts(self) -> tuple[int, int, int]:
        """What of `stats()` moves outside iterations (at intake)."""
        return self.num_awaiting_reservation, self.handoffs_total, self.forwarded_total


def _tokens(msg: RequestMsg) -> int:
    """What a request may grow to: its prompt and max_tokens (the gateway's check); a default
    max_tokens (`SamplingParams.fit_context`) only what the decode instance holds: its
    prompt and a token."""
    return len(msg.prompt_token_ids) + (1 if msg.sampling.max_tokens_default
                                        else msg.sampling.max_tokens)


@dataclass
class Writers:
    """Prefill workers that may still write into some blocks, watched through their
    heartbeats (key -> beat, None where there is none) until none may: each must have beaten
    since the first look without naming the write, or have had another process in its place
    (`_replaced`) for HELD_REPLACED_S, or no heartbeat for HELD_GONE_S (a stopped worker's
    beat lapses, and it writes again when it runs); after HELD_MAX_S they are let go of in any
    case. Another process alone is not enough: it may have taken the rank over from one
    stopped (SIGSTOP) past its claim's TTL, which, resumed, went on with the layer writes of
    the iteration it was stopped in."""
    since: float = field(default_factory=lambda: time.monotonic())
    first: dict[str, tuple[float, object]] | None = None    # key -> (time, started_at)
    gone_since: dict[str, float] = field(default_factory=dict)
    replaced_since: dict[str, float] = field(default_factory=dict)

    @property
    def expired(self) -> bool:
        return time.monotonic() - self.since >= HELD_MAX_S

    def done(self, beats: dict[str, Heartbeat | None],
             writing: Callable[[Heartbeat], bool]) -> bool:
        """Whether none of these may write any more; `writing(beat)`: that beat says it may."""
        now = time.monotonic()
        for key, beat in beats.items():
            if beat is None:
                self.gone_since.setdefault(key, now)
            else:
                self.gone_since.pop(key, None)
        if self.expired:
            return True
        if self.first is None:
            self.first = {k: (b.time, b.extra.get("started_at"))
                          for k, b in beats.items() if b is not None}
            return False
        return all(self._let_go(key, beat, now, writing) for key, beat in beats.items())

    def _let_go(self, key: str, beat: Heartbeat | None, now: float,
                writing: Callable[[Heartbeat], bool]) -> bool:
        if beat is None:
            return now - self.gone_since[key] >= HELD_GONE_S
        first = self.first.get(key)
        if self._replaced(first, beat, now):
            # its writes are not the old one's: what it names says nothing of those
            return now - self.replaced_since.setdefault(key, now) >= HELD_REPLACED_S
        return (first is None or beat.time > first[0]) and not writing(beat)

    def _replaced(self, first: tuple[float, object] | None, beat: Heartbeat,
                  now: float) -> bool:
        """Whether `beat` is another process's than the one that may have written: not the
        process of the first look, or (no beat then: the writer may have been stopped) one
        younger than this watch (its age at its beat, on its own clock, under the watch's:
        one started just before the watch is taken for new too, and waited for)."""
        started = beat.extra.get("started_at")
        if first is not None:
            return started != first[1]
        try:
            return beat.time - float(started) < now - self.since
        except (TypeError, ValueError):
            return True                 # names no start: it cannot be told from a new one


@dataclass
class _Held:
    """A reservation's blocks set aside (docs/failure-modes.md#a-kv-transfer-fails-never-
    completes-or-lies): its prefill instance's workers may still be writing into them."""
    prefill_instance: str
    writers: Writers = field(default_factory=Writers)


class DecodeSide:
    def __init__(self, keys: Keys, instance: str, consumer: str, core: Scheduler,
                 book: RequestBook, started_at: float) -> None:
        self.keys, self.instance, self.consumer = keys, instance, consumer
        self.core, self.book, self.started_at = core, book, started_at
        self.cursor: bytes | str = "$"
        # the request group's last delivered entry, as the last intake saw it: an idle
        # scheduler wakes for the requests past it (service.py's `_wake`)
        self.requests_tail: bytes | str = "0-0"
        self.peers: list[dict] = []          # this instance's workers' KV descriptors
        self._replies: list[tuple[str, ReservedMsg]] = []
        # asks that found no room, in arrival order, answered as room frees (`grant_waiting`):
        # request id -> (the ask, when it was last asked, monotonic); the head's id, the room
        # then (`_room`) and when, while it finds none
        self._asks: dict[str, tuple[ReserveMsg, float]] = {}
        self._stuck: tuple[str, tuple[int, int, int], float] | None = None
        # reserved request id -> (when, monotonic; its request's deadline, on Redis's clock,
        # or None)
        self._reserved_at: dict[str, tuple[float, float | None]] = {}
        self._writer: dict[str, str] = {}    # reserved request id -> its prefill instance
        self._held: dict[str, _Held] = {}
        self._prefill_tp: dict[str, int] = {}
        # handed-over requests whose received K/V the workers verify before they run
        # (docs/design.md#kv-integrity); those in `_due` ride on the next plan, the others'
        # check is in flight
        self._checks: dict[str, tuple[KVCheck, HandoffMsg]] = {}
        self._due: set[str] = set()
        self.handoffs_total = 0
        self.recomputed_total = 0
        self.kv_check_failures_total = 0

    def set_workers(self, values: list[bytes | None]) -> None:
        """This instance's worker heartbeats: the KV descriptors handed to prefill sides."""
        self.peers = kv_descriptors(values)

    def receive(self, reply) -> bool:
        """The hand-off stream's new messages; whether any came (reservations and cancels
        change the pool between plans)."""
        came = False
        for entry_id, msg in stream_messages(reply):
            came = True
            self.cursor = entry_id
            if isinstance(msg, ReserveMsg):
                self._reserve(msg)
            elif isinstance(msg, HandoffMsg):
                self._take(msg)
            elif isinstance(msg, CancelMsg):
                if self._asks.pop(msg.request_id, None) is not None:
                    log.info("waiting ask cancelled", request_id=msg.request_id,
                             reason=msg.reason)
                elif self._give_up(msg.request_id, msg.kv_pending):
                    self._reserved_at.pop(msg.request_id, None)
                    log.info("reservation cancelled", request_id=msg.request_id,
                             reason=msg.reason)
        self.grant_waiting()
        return came

    def _reserve(self, msg: ReserveMsg) -> None:
        """An ask for blocks is answered in its turn after those already waiting, at once
        where there is room (`grant_waiting`); asked again, it keeps its place, and one
        already granted is answered again with the same blocks. Past WAITING_ASKS_MAX of its
        prefill instance waiting, it is answered NO_ROOM (that side asks again in
        RESERVE_RETRY_S)."""
        rid = msg.request_msg.request_id
        if self.core.is_reserved(rid):
            self._answer(msg)
            return
        if rid not in self._asks and WAITING_ASKS_MAX <= sum(
                m.prefill_instance == msg.prefill_instance for m, _ in self._asks.values()):
            self._replies.append((msg.prefill_instance, ReservedMsg(
                rid, self.instance, self.consumer, [], [], self.started_at, NO_ROOM)))
            return
        # a repeated ask keeps its place, answered to its sender
        self._asks[rid] = (msg, time.monotonic())
        self.grant_waiting()        # answered now if none waits before it and there is room

    def _room(self) -> tuple[int, int, int]:
        """What a reservation needs of the pool, each larger with more room: free blocks,
        seats, and (fewer) requests queued here, which go first."""
        c = self.core
        return (c.block_manager.num_free_blocks, -(c.num_running + c.num_reserved),
                -c.num_waiting)

    def grant_waiting(self) -> bool:
        """Answer the asks waiting for room, oldest first, while there is room: the first
        that finds none keeps the rest waiting (arrival order); one whose request ended is
        dropped. Tried again only once room may have grown (or WAITING_TRY_S on): a try looks
        the prompt up in the prefix cache, milliseconds for a long one, and this runs at
        every intake. Whether any ask went."""
        before, wall = len(self._asks), clock.now()
        while self._asks:
            rid, (msg, _) = next(iter(self._asks.items()))
            if self._drop_gone(rid, wall):
                continue
            room, now = self._room(), time.monotonic()
            if self._stuck is not None and self._stuck[0] == rid and \
                    now - self._stuck[2] < WAITING_TRY_S and \
                    all(a <= b for a, b in zip(room, self._stuck[1])):
                break
            if not self._answer(msg):
                self._stuck = (rid, room, now)
                break
            del self._asks[rid]
        else:
            self._stuck = None
        return len(self._asks) != before

    def _drop_gone(self, rid: str, wall: float) -> bool:
        """Drop a waiting ask whose request ended (its prefill side ends it too), or that
        was not asked again for WAITING_ASK_GONE_S: its prefill side asks again every
        RESERVE_RETRY_S while it waits, so it no longer wants it (it restarted, or is gone),
        and granted, its blocks would wait RESERVATION_TTL_S for nobody."""
        msg, at = self._asks[rid]
        why = self._ended(rid, msg.request_msg.deadline, wall) or \
            (f"not asked again for {WAITING_ASK_GONE_S:g} s"
             if time.monotonic() - at > WAITING_ASK_GONE_S else "")
        if why:
            del self._asks[rid]
            log.info("waiting ask dropped", request_id=rid, why=why)
        return bool(why)

    def _ended(self, rid: str, deadline: float | None, wall: float) -> str:
        """Why a request asked for or reserved here has ended ("" if it has not): its
        client's abort came, its deadline passed."""
        if self.book.aborted_early(rid, forget=False):
            return "its request was aborted"
        if deadline is not None and deadline <= wall:
            return "its request's deadline passed"
        return ""

    def _answer(self, msg: ReserveMsg) -> bool:
        """Reserve blocks for an ask and answer it: with them, or with why it never gets any
        here. False, with no answer, when there is no room now."""
        request = msg.request_msg
        rid = request.request_id
        error, blocks = "", []
        if not all(p.get("session") for p in self.peers):
            error = "this decode instance's workers publish no KV connector"
        else:
            try:
                blocks = self.core.reserve(rid, request.prompt_token_ids, request.sampling,
                                           request.reply_to) or []
            except InvalidRequestError as e:
                error = str(e)
            if not blocks and not error:
                return False
        cached = 0
        if blocks:
            self._reserved_at.setdefault(rid, (time.monotonic(), request.deadline))
            self._writer[rid] = msg.prefill_instance
            cached = self.core.reserved_cached_blocks(rid)
        self._replies.append((msg.prefill_instance, ReservedMsg(
            rid, self.instance, self.consumer, blocks, self.peers if blocks else [],
            self.started_at, error, cached)))
        return True

    def _take(self, msg: HandoffMsg) -> None:
        request = msg.request_msg
        rid = request.request_id
        self._reserved_at.pop(rid, None)
        self._asks.pop(rid, None)       # handed over whole: it asks for nothing any more
        self.handoffs_total += 1
        if self.book.aborted_early(rid):
            self._give_up(rid, True)
            self.book.finish_now(msg.entry_id, request, "abort", len(msg.output_token_ids))
            return
        if self.core.get_request(rid) is not None and not self.core.is_reserved(rid):
            return          # a repeated hand-off of a request this instance already runs
        if self.core.is_reserved(rid) and msg.output_token_ids:
            self.book.track(msg.entry_id, request)
            ours = [p.get("session") for p in self.peers]
            check = self._check_for(rid, msg) if msg.kv_received == ours else None
            if check is not None:
                self._checks[rid] = (check, msg)
                self._due.add(rid)
            else:
                self._activate(rid, msg, False)
            return
        self._give_up(rid, True)
        self.book.admit(msg.entry_id, request, output_token_ids=msg.output_token_ids)

    def _check_for(self, rid: str, msg: HandoffMsg) -> KVCheck | None:
        """The check of a hand-off's K/V: the digests it carries, one list per rank of this
        instance, of the prompt's blocks of our reservation past those our prefix cache held;
        None where it carries none that fits (then the prompt is recomputed, never
        trusted)."""
        table = self.core.get_request(rid).block_table
        cached = self.core.reserved_cached_blocks(rid)
        try:
            blocks, digests = msg.kv_check
            fits = (0 < len(blocks) <= len(table) - cached
                    and list(blocks) == table[cached:cached + len(blocks)]
                    and len(digests) == len(self.peers)
                    and all(len(d) == len(blocks) and all(type(x) is int for x in d)
                            for d in digests))
        except (TypeError, ValueError):
            fits = False
        if not fits:
            log.warning("hand-off without a fitting K/V check; recomputing", request_id=rid)
            return None
        return KVCheck(rid, list(blocks), [list(d) for d in digests])

    def _activate(self, rid: str, msg: HandoffMsg, kv_intact: bool) -> None:
        """The reserved request runs on as a decode, or is recomputed here."""
        if not self.core.is_reserved(rid):
            self._writer.pop(rid, None)
            return                      # aborted meanwhile: the core reported it
        if kv_intact:
            self._writer.pop(rid, None)
            self.core.activate(rid, msg.output_token_ids[0], list(msg.kv_received),
                               msg.num_cached_tokens)
            return
        self.recomputed_total += 1
        self.core.activate(rid, msg.output_token_ids[0], None, msg.num_cached_tokens,
                           hold=True)
        self._hold(rid, True)

    def _give_up(self, rid: str, hold: bool = False) -> bool:
        """Cancel a reservation; `hold`: its blocks set aside while a write into them may
        still land, else freed now."""
        if not self.core.cancel_reservation(rid, hold=hold):
            return False
        self._hold(rid, hold)
        return True

    def _hold(self, rid: str, hold: bool) -> None:
        """The blocks of a reservation let go of without its K/V (a transfer failed or given
        up, a check failed, a request that ended on the prefill side after a write failed)
        stay set aside while a write into them may still land: until its prefill instance's
        workers let go (`Writers`), their beats no longer naming the request among the writes
        they gave up on (gpu_worker/kv_transfer/connector.py). Such a write would otherwise
        land in another request's K/V. (A prefill instance has the result of a request's last
        plan before it hands the request over or cancels it: it plans nothing ahead.)"""
        instance = self._writer.pop(rid, "")
        if not hold:
            return                      # freed already
        if instance:
            self._held[rid] = _Held(instance)
        else:                           # not reserved for a prefill instance: nobody writes
            self.core.block_manager.release_aside(rid)

    def writes_here(self, beat: Heartbeat) -> bool:
        """Whether a prefill worker's beat names one of this instance's workers among the
        peers its writes may still land in."""
        ours = {p.get("session") for p in self.peers}
        return bool(ours & set(beat.extra.get("kv_writing_to", ())))

    def held_heartbeats(self) -> list[tuple[str, str]]:
        """(prefill instance, heartbeat key) of the worker heartbeats that say when held
        blocks can go back (none: nothing held)."""
        return [(instance, self.keys.for_instance(instance).hb_worker(rank))
                for instance in sorted({h.prefill_instance for h in self._held.values()})
                for rank in range(self._prefill_tp.get(instance, 1))]

    def release_settled(self, asked: list[tuple[str, str]], values: list[bytes | None]) -> bool:
        """Give back the held blocks no write can reach any more, from the heartbeats
        `held_heartbeats` named; whether any went back."""
        ranks: dict[str, dict[str, Heartbeat | None]] = {}
        for (instance, key), value in zip(asked, values):
            ranks.setdefault(instance, {})[key] = heartbeat_of(value)
        released = False
        for rid, held in list(self._held.items()):
            beats = ranks.get(held.prefill_instance)
            if beats is None:
                continue                # held after these were asked for
            tp = max((int(b.extra.get("tp", 1)) for b in beats.values() if b is not None),
                     default=1)
            if tp > len(beats):
                self._prefill_tp[held.prefill_instance] = tp    # read them all next time
                continue
            if not held.writers.done(beats, lambda b: rid in b.extra.get("kv_unsettled", ())):
                continue
            del self._held[rid]
            blocks = self.core.block_manager.release_aside(rid)
            if held.writers.expired:
                log.warning("blocks of a given-up reservation back in the pool after "
                            f"{HELD_MAX_S:.0f} s, its prefill instance still naming its write",
                            request_id=rid, blocks=blocks)
            else:
                log.info("blocks of a given-up reservation back in the pool", request_id=rid,
                         blocks=blocks)
            released = True
        return released

    @property
    def checks_due(self) -> bool:
        return bool(self._due)

    def add_checks(self, plan: IterationPlan) -> IterationPlan:
        """The due K/V checks ride on this plan. One whose K/V went to a worker that has
        since restarted (another session: a check in flight when the group was lost) is not
        checked but recomputed, as such a hand-off is when it comes (`receive`): the new
        pool never held it, and a check there would count as K/V that differed."""
        if not self._due:
            return plan
        ours = [p.get("session") for p in self.peers]
        for rid in [rid for rid in self._due if self._checks[rid][1].kv_received != ours]:
            self._due.discard(rid)
            self._activate(rid, self._checks.pop(rid)[1], False)
        checks = [self._checks[rid][0] for rid in self._due]
        self._due.clear()
        return replace(plan, kv_checks=checks) if checks else plan

    def observe(self, plan: IterationPlan, result: StepResult) -> None:
        """Each checked request runs on with the K/V it received if every rank verified it;
        else it is recomputed."""
        verified = set(result.kv_verified)
        for check in plan.kv_checks:
            rid = check.request_id
            if rid in self._due or rid not in self._checks:
                continue                # due again (its plan was lost), or already done
            _, msg = self._checks.pop(rid)
            intact = rid in verified
            if not intact:
                self.kv_check_failures_total += 1
                log.warning("received K/V failed its check; recomputing", request_id=rid)
            self._activate(rid, msg, intact)

    def plans_lost(self) -> None:
        """The plans in flight were lost (a worker died, a plan went missing): the core is
        about to empty its prefix cache (`Scheduler.recompute_running`), what its cached
        blocks hold being unknown from then on. A reservation that took leading blocks from
        that cache would trust them still (no prefill instance writes into them, no check
        covers them), beside another reservation sharing them that no cache names: it is let
        go now, its other blocks held while a write may land, and its request recomputed
        here when its hand-off comes; one handed over already is recomputed now. The other
        checks in flight go again (`add_checks` recomputes instead those whose worker has
        restarted since)."""
        for rid in [*self._reserved_at, *self._checks]:
            if not self.core.is_reserved(rid) or not self.core.reserved_cached_blocks(rid):
                continue
            log.warning("reservation on a cached prefix let go: the workers' blocks are "
                        "unknown after a lost plan", request_id=rid)
            self._reserved_at.pop(rid, None)
            checked = self._checks.pop(rid, None)
            self._due.discard(rid)
            if checked is not None:
                self._activate(rid, checked[1], False)
            else:
                self._give_up(rid, True)
        self._due.update(self._checks)

    def expire(self) -> bool:
        """Let go of reservations whose request ended while its K/V was on the way (its
        client's abort came, its deadline passed) or that were never handed over, and of
        waiting asks whose request ended. Their prefill side cancels them too, but a prefill
        scheduler that restarted in between does not know what its predecessor asked for.
        Whether any went."""
        now, wall, freed = time.monotonic(), clock.now(), False
        for rid, (at, deadline) in list(self._reserved_at.items()):
            if self._ended(rid, deadline, wall):
                why = "its request ended"       # a late hand-off ends there: abort, deadline
                hold = True                     # its prefill worker may be writing still
            elif now - at > RESERVATION_TTL_S:
                why, hold = "never handed over", False
            else:
                continue
            del self._reserved_at[rid]
            if self._give_up(rid, hold):
                freed = True
                log.warning("reservation let go", request_id=rid, why=why)
        for rid in list(self._asks):
            freed |= self._drop_gone(rid, wall)
        return self.grant_waiting() or freed

    def forget_all(self) -> None:
        """Redis was lost: the reservations' prefill sides will ask again. Their blocks are
        held, not freed: a prefill worker may have been writing into them when Redis went,
        and its write lands whatever Redis does (`_hold`)."""
        for rid in [*self._reserved_at, *self._checks]:
            self._give_up(rid, True)
        self._reserved_at.clear()
        self._checks.clear()
        self._due.clear()
        self._replies.clear()
        self._asks.clear()
        self._stuck = None
        self.cursor = "0-0"

    def take_replies(self) -> list[tuple[str, ReservedMsg]]:
        """The reservation answers owed, taken before the exchange that sends them (a
        retried exchange sends them again: a repeated answer names the same blocks); first
        the waiting asks the room freed since (requests ended, reservations let go) lets in."""
        self.grant_waiting()
        replies, self._replies = self._replies, []
        return replies

    def queue(self, pipe, replies: list[tuple[str, ReservedMsg]]) -> None:
        for instance, msg in replies:
            pipe.xadd(self.keys.for_instance(instance).reservations, to_fields(msg),
                      maxlen=HANDOFF_MAXLEN, approximate=True)

    def stats(self) -> dict[str, float]:
        return {"num_requests_reserved": self.core.num_reserved,
                "num_reservations_waiting": len(self._asks),
                "handoffs_total": self.handoffs_total,
                "handoffs_recomputed_total": self.recomputed_total,
                "kv_check_failures_total": self.kv_check_failures_total,
                "kv_blocks_held": self.core.block_manager.num_aside_blocks}
