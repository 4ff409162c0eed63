"""Between the request stream and the scheduling core: what each request came in as, and what
must go back out when it ends.

The core knows a request only while it lives; the service must still know, when it ends, which
stream entry to XACK, which gateway channel to tell, and whether it ended in an error of the
service's making (a deadline, a lost Redis). Until that XACK the entry stays in the consumer
group's pending list, so a restarted scheduler can re-read what it never finished.

    book = RequestBook(core)
    book.receive(entry_id, fields)     # decode, validate, add to the core (or finish at once)
    book.admit(entry_id, msg, output_token_ids)   # a request taken over mid-stream
    book.abort(fields)                 # from the aborts stream
    book.stop(request_id, error, error_type)      # end it with an error event
    book.expire(now)                   # stop every request past its deadline
    book.finished(output)              # for each RequestOutput with finished=True
    outbox = book.take_outbox()        # FinishEvents to publish, entry ids to XACK
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

import structlog

from scheduler_svc.core import Scheduler
from scheduler_svc.core.request import Request, stop_status
from shared.errors import InvalidRequestError
from shared.lifecycle import stream_id_text
from shared.outputs import RequestOutput
from shared.protocol import (AbortMsg, FinishEvent, ProtocolError, RequestMsg, encode,
                             foreign_message, from_fields, message_bytes, version_mismatch)

log = structlog.get_logger("scheduler.book")

# Aborts for ids not yet read from the request stream (the client left while its request
# was queued); remembered so the request is finished on arrival instead of run for nobody.
EARLY_ABORTS_KEPT = 10_000
# Deadlines of ended requests the heap may hold beyond twice the live requests' before it is
# rebuilt without them (so that a few requests do not rebuild it every iteration).
DEADLINES_SLACK = 64


@dataclass
class Outbox:
    """What one iteration owes Redis: (channel, encoded FinishEvent) pairs, entry ids to
    XACK, and the ids of requests that ended (their progress records are deleted)."""
    finishes: list[tuple[str, bytes]] = field(default_factory=list)
    acks: list[bytes | str] = field(default_factory=list)
    ended_ids: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.finishes or self.acks)


@dataclass(frozen=True)
class _Entry:
    entry_id: bytes | str
    reply_to: str
    gateway_id: str


class RequestBook:
    def __init__(self, core: Scheduler) -> None:
        self.core = core
        self._entries: dict[str, _Entry] = {}
        self._errors: dict[str, tuple[str, str]] = {}     # request id -> (error, error_type)
        self._deadlines: list[tuple[float, str]] = []       # a heap
        self._early_aborts: OrderedDict[str, None] = OrderedDict()
        self._outbox = Outbox()

    @property
    def num_live(self) -> int:
        return len(self._entries)

    def live_entry_ids(self) -> list[bytes | str]:
        return [e.entry_id for e in self._entries.values()]

    def leased_entry_ids(self) -> list[bytes | str]:
        """The live entries, those ending with an error included: they end at the next
        iteration, which may be seconds away (the worker group lost), and a lease left to
        lapse meanwhile let another scheduler claim one and serve it for nobody."""
        return self.live_entry_ids()

    def gateways(self) -> dict[str, list[str]]:
        """Live request ids by the gateway that holds their client."""
        by_gateway: dict[str, list[str]] = {}
        for rid, entry in self._entries.items():
            by_gateway.setdefault(entry.gateway_id, []).append(rid)
        return by_gateway

    # ---- in ------------------------------------------------------------------------------

    def receive(self, entry_id: bytes | str, fields: dict) -> None:
        """One new entry of the request stream: into the core, or finished at once if it
        cannot be served (an error) or was aborted before it arrived."""
        msg = self.decode(entry_id, fields)
        if msg is not None:
            self.admit(entry_id, msg)

    def decode(self, entry_id: bytes | str, fields: dict) -> RequestMsg | None:
        """The entry's request; None (and the entry acked) if it is not one."""
        try:
            msg = from_fields(fields)
        except ProtocolError as e:
            if self._other_version(entry_id, fields):
                return None
            # nobody to answer: without a decoded message there is no reply channel
            log.error("undecodable request dropped", entry_id=stream_id_text(entry_id),
                      error=str(e))
            self._outbox.acks.append(entry_id)
            return None
        if not isinstance(msg, RequestMsg):
            log.error("not a request on the request stream", kind=type(msg).__name__)
            self._outbox.acks.append(entry_id)
            return None
        return msg

    def _other_version(self, entry_id: bytes | str, fields: dict) -> bool:
        """End a request written in another protocol version (by a gateway of another release,
        in a rolling upgrade) with an error naming both versions; False if the entry is no
        such request. Dropped in silence, its client waited until its timeout (forever
        without one). Its gateway cannot decode this version's finish event either, but reads
        the request id it names (`foreign_message`), and ends the request with its own line."""
        try:
            obj = foreign_message(message_bytes(fields))
        except ProtocolError:
            return False
        rid, reply_to = (obj.get("request_id"), obj.get("reply_to")) if obj else (None, None)
        if not isinstance(rid, str) or not isinstance(reply_to, str):
            return False
        gateway = obj.get("gateway_id")
        error = version_mismatch(obj["v"], f"gateway {gateway}" if isinstance(gateway, str)
                                 else "the gateway that sent it", "scheduler")
        prompt = obj.get("prompt_token_ids")
        self._finish_entry(entry_id, reply_to, FinishEvent(
            rid, "error", len(prompt) if isinstance(prompt, list) else 0, 0, error))
        log.error("request of another protocol version ended", request_id=rid,
                  entry_id=stream_id_text(entry_id), error=error)
        return True

    def admit(self, entry_id: bytes | str, msg: RequestMsg,
              output_token_ids: list[int] | None = None) -> None:
        """Add a request to the core; `output_token_ids` are tokens its client already has."""
        rid = msg.request_id
        if rid in self._entries:
            self.duplicate(rid, entry_id, self._entries[rid].entry_id)
            return
        if rid in self._early_aborts:
            del self._early_aborts[rid]
            self.finish_now(entry_id, msg, "abort", len(output_token_ids or ()))
            return
        if output_token_ids and self._already_done(entry_id, msg, output_token_ids):
            return
        try:
            # a gateway that read no heartbeat of this scheduler yet checked the request
            # against its own --max-model-len: one that does not fit here is refused, not cut
            sampling = msg.sampling.fit_context(len(msg.prompt_token_ids),
                                                self.core.max_model_len)
            self.core.add_request(rid, msg.prompt_token_ids, sampling, reply_to=msg.reply_to,
                                  output_token_ids=output_token_ids, arrival_s=msg.arrival_time)
        except InvalidRequestError as e:
            self.finish_now(entry_id, msg, "error", 0, str(e), "invalid_request_error")
            return
        self.track(entry_id, msg)
        log.info("request admitted to queue", request_id=rid, gateway_id=msg.gateway_id,
                 prompt_tokens=len(msg.prompt_token_ids), max_tokens=msg.sampling.max_tokens,
                 resumed_at=len(output_token_ids or ()))

    def duplicate(self, request_id: str, entry_id: bytes | str,
                  held_entry_id: bytes | str) -> None:
        """Another delivery of a request this scheduler holds (under `held_entry_id`): a
        second entry of it is acked and ignored; its own entry handed back to it (a claim)
        changes nothing. Entry ids come as bytes from Redis and as str inside hand-off
        messages: one entry either way."""
        if stream_id_text(entry_id) != stream_id_text(held_entry_id):
            log.warning("duplicate request ignored", request_id=request_id)
            self._outbox.acks.append(entry_id)

    def track(self, entry_id: bytes | str, msg: RequestMsg) -> None:
        """Answer for a request the core holds: its entry, channel and deadline."""
        self._entries[msg.request_id] = _Entry(entry_id, msg.reply_to, msg.gateway_id)
        if msg.deadline is not None:
            heapq.heappush(self._deadlines, (msg.deadline, msg.request_id))

    def aborted_early(self, request_id: str, forget: bool = True) -> bool:
        """Whether an abort for this id came before the request (forgotten once asked,
        unless `forget` is false: the request may still come, and must end then)."""
        if not forget:
            return request_id in self._early_aborts
        return self._early_aborts.pop(request_id, False) is None

    def hand_off(self, request_id: str) -> bool:
        """P/D: the request now belongs to a decode instance; forget it without a finish
        event or an ack (its entry was XCLAIMed to the new owner)."""
        self._errors.pop(request_id, None)
        return self._entries.pop(request_id, None) is not None

    def lose(self, entry_id: bytes | str) -> bool:
        """Another scheduler holds this entry now (it claimed it while this one stalled): stop
        computing its request and forget it, without a finish event or an ack (the other
        one finishes it). False if no live request has this entry."""
        rid = next((rid for rid, e in self._entries.items()
                    if stream_id_text(e.entry_id) == stream_id_text(entry_id)), None)
        if rid in self._errors:
            # it ends with its error at the next iteration, and its client must read it: the
            # entry is gone with a Redis that restarted, or the one that took it ends it too
            return False
        if rid is None or not self.hand_off(rid):
            return False
        self.core.abort(rid)
        # or its entry left the group: trimmed from the request stream (an XAUTOCLAIM drops
        # those from the pending list), and the gateway tells its client
        log.warning("request left: another scheduler claimed it while this one stalled, or "
                    "its entry was trimmed from the request stream", request_id=rid)
        return True

    def _already_done(self, entry_id: bytes | str, msg: RequestMsg, tokens: list[int]) -> bool:
        """A taken-over request whose last streamed token already ended it (its scheduler
        died before sending the finish event): finish it now."""
        probe = Request(msg.request_id, msg.prompt_token_ids, msg.sampling, 0,
                        output_token_ids=list(tokens))
        status = stop_status(probe, self.core.eos_token_ids, self.core.max_model_len)
        if status is None:
            return False
        self.finish_now(entry_id, msg, status.finish_reason, len(tokens))
        return True

    def finish_now(self, entry_id: bytes | str, msg: RequestMsg, reason: str,
                    num_output_tokens: int, error: str | None = None,
                    error_type: str = "server_error") -> None:
        self._finish_entry(entry_id, msg.reply_to, FinishEvent(
            msg.request_id, reason, len(msg.prompt_token_ids), num_output_tokens, error,
            error_type))
        log.info("request finished on arrival", request_id=msg.request_id,
                 finish_reason=reason, error=error)

    def _finish_entry(self, entry_id: bytes | str, reply_to: str, event: FinishEvent) -> None:
        """Publish a finish event for a request the core never held, and ack its entry."""
        self._outbox.finishes.append((reply_to, encode(event)))
        self._outbox.acks.append(entry_id)
        self._outbox.ended_ids.append(event.request_id)

    # ---- stopping requests ---------------------------------------------------------------

    def abort(self, fields: dict) -> None:
        """One entry of the aborts stream."""
        try:
            msg = from_fields(fields)
        except ProtocolError as e:
            log.error("undecodable abort dropped", error=str(e))
            return
        if not isinstance(msg, AbortMsg):
            log.error("not an abort on the aborts stream", kind=type(msg).__name__)
            return
        if msg.request_id in self._entries:
            # the core reports it through the next update(); blocks are free right now
            self.core.abort(msg.request_id)
            log.info("request abort", request_id=msg.request_id, reason=msg.reason)
            return
        self._early_aborts[msg.request_id] = None
        if len(self._early_aborts) > EARLY_ABORTS_KEPT:
            self._early_aborts.popitem(last=False)

    def stop(self, request_id: str, error: str | None = None,
             error_type: str = "server_error") -> None:
        """End a live request now, with an error event when `error` is given (else an
        abort); its blocks are free at once."""
        if request_id not in self._entries or request_id in self._errors:
            return
        if error is not None:
            self._errors[request_id] = (error, error_type)
        self.core.abort(request_id)
        log.info("request stopped", request_id=request_id, error=error)

    def stop_all(self, error: str) -> int:
        live = list(self._entries)
        for rid in live:
            self.stop(rid, error)
        return len(live)

    def expire(self, now: float) -> None:
        """Stop every request whose deadline has passed by `now` (both on Redis's clock,
        shared/clock.py). The deadlines of requests that ended before them are dropped once
        they outnumber the live requests: left until due, a deadline of hours
        (--request-timeout, a client's `timeout`) kept every request served in those hours in
        the heap."""
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, rid = heapq.heappop(self._deadlines)
            if rid in self._entries:
                self.stop(rid, deadline_passed(deadline, now), "timeout_error")
        if len(self._deadlines) > 2 * len(self._entries) + DEADLINES_SLACK:
            self._deadlines = [d for d in self._deadlines if d[1] in self._entries]
            heapq.heapify(self._deadlines)

    # ---- out -----------------------------------------------------------------------------

    def finished(self, output: RequestOutput) -> None:
        """A request the core finished: tell its gateway, release its stream entry."""
        entry = self._entries.pop(output.request_id, None)
        if entry is None:
            return
        error, error_type = self._errors.pop(output.request_id, (
            output.error, "invalid_request_error" if output.error else "server_error"))
        reason = "error" if error is not None else output.finish_reason
        event = FinishEvent(output.request_id, reason, output.num_prompt_tokens,
                            output.num_output_tokens, error, error_type,
                            output.num_cached_tokens)
        self._outbox.finishes.append((entry.reply_to, encode(event)))
        self._outbox.acks.append(entry.entry_id)
        self._outbox.ended_ids.append(output.request_id)
        log.info("request finished", request_id=output.request_id, finish_reason=reason,
                 prompt_tokens=output.num_prompt_tokens, output_tokens=output.num_output_tokens,
                 error=error)

    def release(self, entry_id: bytes | str) -> None:
        """Ack an entry with nothing in it (a pending entry whose data the stream trimmed)."""
        self._outbox.acks.append(entry_id)

    def take_outbox(self) -> Outbox:
        outbox, self._outbox = self._outbox, Outbox()
        return outbox

    def put_back(self, outbox: Outbox) -> None:
        """An outbox whose round trip failed: its finish events go out with the next one."""
        self._outbox.finishes[:0] = outbox.finishes
        self._outbox.acks[:0] = outbox.acks
        self._outbox.ended_ids[:0] = outbox.ended_ids


def deadline_passed(deadline: float, now: float) -> str:
    """The error of a request ended at its deadline (both on one clock)."""
    late = now - deadline
    return "the request reached its deadline" + (f" ({late:.1f} s ago)" if late >= 0.05 else "")
