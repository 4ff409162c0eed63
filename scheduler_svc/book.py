"""Between the request stream and the scheduling core: what each request came in as, and what
must go back out when it ends.

The core knows a request only while it lives; the service must still know, when it ends, which
stream entry to XACK and which gateway channel to tell. Until that XACK the entry stays in the
consumer group's pending list, so a restarted scheduler can re-read what it never finished.

    book = RequestBook(core)
    book.receive(entry_id, fields)     # decode, validate, add to the core (or finish at once)
    book.abort(request_id)             # from the aborts stream
    book.finished(output)              # for each RequestOutput with finished=True
    outbox = book.take_outbox()        # FinishEvents to publish and entry ids to XACK
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import structlog

from scheduler_svc.core import Scheduler
from shared.errors import InvalidRequestError
from shared.outputs import RequestOutput
from shared.protocol import (AbortMsg, FinishEvent, ProtocolError, RequestMsg, encode,
                             from_fields)

log = structlog.get_logger("scheduler.book")

# Aborts for ids not yet read from the request stream (the client left while its request
# was queued); remembered so the request is finished on arrival instead of run for nobody.
EARLY_ABORTS_KEPT = 10_000


@dataclass
class Outbox:
    """What one iteration owes Redis: (channel, encoded FinishEvent) pairs and entry ids."""
    finishes: list[tuple[str, bytes]] = field(default_factory=list)
    acks: list[bytes | str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.finishes or self.acks)


@dataclass(frozen=True)
class _Entry:
    entry_id: bytes | str
    reply_to: str


class RequestBook:
    def __init__(self, core: Scheduler) -> None:
        self.core = core
        self._entries: dict[str, _Entry] = {}
        self._early_aborts: OrderedDict[str, None] = OrderedDict()
        self._outbox = Outbox()

    @property
    def num_live(self) -> int:
        return len(self._entries)

    def receive(self, entry_id: bytes | str, fields: dict) -> None:
        """One entry of the request stream: into the core, or finished at once if it cannot
        be served (an error) or was aborted before it arrived."""
        try:
            msg = from_fields(fields)
        except ProtocolError as e:
            # nobody to answer: without a decoded message there is no reply channel
            log.error("undecodable request dropped", entry_id=_text(entry_id), error=str(e))
            self._outbox.acks.append(entry_id)
            return
        if not isinstance(msg, RequestMsg):
            log.error("not a request on the request stream", kind=type(msg).__name__)
            self._outbox.acks.append(entry_id)
            return
        self._add(entry_id, msg)

    def _add(self, entry_id: bytes | str, msg: RequestMsg) -> None:
        rid = msg.request_id
        if rid in self._entries:
            # a redelivery of a request this scheduler is already running
            log.warning("duplicate request ignored", request_id=rid)
            self._outbox.acks.append(entry_id)
            return
        if rid in self._early_aborts:
            del self._early_aborts[rid]
            self._finish_now(entry_id, msg, "abort")
            return
        try:
            self.core.add_request(rid, msg.prompt_token_ids, msg.sampling, reply_to=msg.reply_to)
        except InvalidRequestError as e:
            self._finish_now(entry_id, msg, "error", str(e), "invalid_request_error")
            return
        self._entries[rid] = _Entry(entry_id, msg.reply_to)
        log.info("request admitted to queue", request_id=rid, gateway_id=msg.gateway_id,
                 prompt_tokens=len(msg.prompt_token_ids), max_tokens=msg.sampling.max_tokens)

    def _finish_now(self, entry_id: bytes | str, msg: RequestMsg, reason: str,
                    error: str | None = None, error_type: str = "server_error") -> None:
        event = FinishEvent(msg.request_id, reason, len(msg.prompt_token_ids), 0, error,
                            error_type)
        self._outbox.finishes.append((msg.reply_to, encode(event)))
        self._outbox.acks.append(entry_id)
        log.info("request finished on arrival", request_id=msg.request_id,
                 finish_reason=reason, error=error)

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

    def finished(self, output: RequestOutput) -> None:
        """A request the core finished: tell its gateway, release its stream entry."""
        entry = self._entries.pop(output.request_id, None)
        if entry is None:
            return
        event = FinishEvent(output.request_id, output.finish_reason,
                            output.num_prompt_tokens, output.num_output_tokens)
        self._outbox.finishes.append((entry.reply_to, encode(event)))
        self._outbox.acks.append(entry.entry_id)
        log.info("request finished", request_id=output.request_id,
                 finish_reason=output.finish_reason, prompt_tokens=output.num_prompt_tokens,
                 output_tokens=output.num_output_tokens)

    def release(self, entry_id: bytes | str) -> None:
        """Ack an entry with nothing in it (a pending entry whose data the stream trimmed)."""
        self._outbox.acks.append(entry_id)

    def take_outbox(self) -> Outbox:
        outbox, self._outbox = self._outbox, Outbox()
        return outbox


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
