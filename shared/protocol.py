"""Typed control-plane messages and their msgpack codec (never pickle).

Every message is one msgpack map `{"v": SCHEMA_VERSION, "kind": <kind>, ...fields}`; `decode`
refuses another version, an unknown kind, and unknown or missing fields with a ProtocolError.

Who sends what (key names in `shared/keys.py`):

    gateway   --RequestMsg-->  requests stream  --> scheduler (consumer group)
    gateway   --AbortMsg---->  aborts stream    --> every scheduler
    P/D: prefill scheduler --ReserveMsg/HandoffMsg/CancelMsg--> a decode instance's handoff
         stream; decode scheduler --ReservedMsg--> the prefill instance's reservations stream
    scheduler --PlanMsg----->  plans stream     --> worker rank 0
    worker 0  --StepResultMsg> results stream   --> scheduler
    worker 0  --TokenBatch-->  tokens:{gateway} --> gateway (one per iteration per gateway)
    scheduler --FinishEvent->  tokens:{gateway} --> gateway
    any       --Heartbeat--->  hb:* keys (value of the TTL key)

Token batches and finish events come from different processes, so a gateway may see a
request's FinishEvent before its last tokens: a request ends once the FinishEvent arrived AND
`num_output_tokens` token events (indices 0..n-1) were received. Hot per-iteration lists
(cached requests, sampled tokens, token events) travel as arrays rather than maps.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from collections.abc import Iterable
from typing import Any, ClassVar

import msgpack

from shared.errors import PacerError
from shared.plan import (CachedRequestData, IterationPlan, KVCheck, KVSend, NewRequestData,
                         PromptLogprobs, SampledToken, StepResult)
from shared.sampling import SamplingParams

# The protocol version every message carries ("v"), heartbeats too. Bump it with ANY change to a
# message's fields or to what a field means, an added field with a default included: services
# of two versions meeting in one Redis (a rolling upgrade) then refuse each other by their
# heartbeats (`protocol_disagreement`), rather than exchange messages one of them misreads.
# Kept under these names in every version, so that a request read by a scheduler of another
# version still ends with an error its gateway shows (`foreign_message`): a request's
# "request_id", "reply_to" and "gateway_id", a finish event's "request_id".
# 2: plans carry "after" (docs/design.md#overlap)
# 3: ReservedMsg.num_cached_blocks (shared blocks a prefill instance must not write),
#    TokenBatch.instance
# 4: SamplingParams.max_tokens_default (a scheduler refuses a request longer than its context,
#    or cuts a default max_tokens to it)
SCHEMA_VERSION = 4
STREAM_FIELD = "m"       # streams carry one field holding the encoded message
FINISH_REASONS = ("stop", "length", "abort", "error")

TopLogprobs = list[tuple[int, float]]


class ProtocolError(PacerError):
    """Bytes that are not a message of this schema version."""


_KINDS: dict[str, type] = {}


def _kind(name: str):
    """Register a message class under its wire `kind`."""
    def register(cls):
        cls.KIND = name
        _KINDS[name] = cls
        return cls
    return register


def _tops(raw: list | None) -> TopLogprobs | None:
    return None if raw is None else [(int(t), float(lp)) for t, lp in raw]


def _check_strings(msg: Any, *names: str) -> None:
    """Stream entries may be written by hand (redis-cli XADD): a field the reader uses as a
    key or a channel must be a string, or the entry is malformed (a ProtocolError)."""
    for name in names:
        if not isinstance(getattr(msg, name), str):
            raise TypeError(f"{name} must be a string, got {_short(getattr(msg, name))}")


def _check_list(msg: Any, name: str, kind: type) -> None:
    """As `_check_strings`, for a list of ints (token ids), of strings or of dicts."""
    value = getattr(msg, name)
    if not isinstance(value, (list, tuple)) or not all(type(v) is kind for v in value):
        what = {int: "integers", str: "strings", dict: "mappings"}[kind]
        raise TypeError(f"{name} must be a list of {what}, got {_short(value)}")


class _CarriesRequest:
    """A P/D message that carries its request encoded. It is decoded once, as the carrier is
    read (`request_msg`): decoded only when the scheduler acted on it, a hand-written or
    damaged one crashed it there."""

    def __post_init__(self) -> None:
        self.request_msg        # noqa: B018 (decoded and checked now, kept)

    @functools.cached_property
    def request_msg(self) -> RequestMsg:
        data = self.request
        if not isinstance(data, bytes) or not isinstance(msg := decode(data), RequestMsg):
            raise TypeError(f"request must be an encoded request message, got {_short(data)}")
        return msg


def _finite(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _short(value: Any) -> str:
    """A value for an error message, cut short (a prompt may hold thousands of ids)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _Plain:
    """Messages whose fields travel as they are."""
    KIND: ClassVar[str]

    def _to_body(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def _from_body(cls, body: dict):
        return cls(**body)


@_kind("request")
@dataclass(frozen=True)
class RequestMsg(_Plain):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_to: str                    # pub/sub channel for this request's tokens and finish
    gateway_id: str
    arrival_time: float              # when the gateway received the request (shared/clock.py)
    deadline: float | None = None    # when the request may be dropped (on that clock too)
    # P/D: the prefill instance the gateway's router chose (docs/design.md#cache-aware-routing);
    # a prefill scheduler that reads a request chosen for another live one hands it over there
    instance: str = ""

    def __post_init__(self) -> None:
        # an entry written by hand (redis-cli, a script) reaches the scheduler unchecked by
        # any gateway: a wrong type here crashed the scheduler later (a deadline compared with
        # the clock, a reply channel Redis refuses), restart after restart
        _check_strings(self, "request_id", "reply_to", "gateway_id", "instance")
        _check_list(self, "prompt_token_ids", int)
        for name in ("arrival_time", "deadline"):
            value = getattr(self, name)
            if not (value is None and name == "deadline") and not _finite(value):
                raise TypeError(f"{name} must be a finite number, got {value!r}")

    def _to_body(self) -> dict:
        body = super()._to_body()
        body["sampling"] = self.sampling.to_dict()
        return body

    @classmethod
    def _from_body(cls, body: dict) -> "RequestMsg":
        return cls(**{**body, "sampling": SamplingParams.from_dict(body["sampling"])})


@_kind("abort")
@dataclass(frozen=True)
class AbortMsg(_Plain):
    request_id: str
    reason: str = ""                 # "client disconnected", "stop string", ...

    def __post_init__(self) -> None:
        # every scheduler reads every abort, and a restarted one reads them again from before
        # its oldest request: an unhashable id crashed each of them, restart after restart
        _check_strings(self, "request_id", "reason")


@_kind("plan")
@dataclass(frozen=True)
class PlanMsg:
    plan: IterationPlan
    KIND: ClassVar[str]

    def _to_body(self) -> dict:
        p = self.plan
        return {
            "step": p.step,
            "new": [_new_to_wire(r) for r in p.new_requests],
            # [request_id, new_block_ids, num_computed_tokens]
            "cached": [[r.request_id, r.new_block_ids, r.num_computed_tokens]
                       for r in p.cached_requests],
            # pairs keep the flat batch's row order explicit
            "sched": [[rid, n] for rid, n in p.num_scheduled_tokens.items()],
            "finished": p.finished_request_ids,
            "preempted": p.preempted_request_ids,
            "kv_sends": [[k.request_id, k.peer, k.src_block_ids, k.dst_block_ids, k.peers]
                         for k in p.kv_sends],
            "kv_checks": [[c.request_id, c.block_ids, c.digests] for c in p.kv_checks],
            "after": p.after_step,
        }

    @classmethod
    def _from_body(cls, body: dict) -> "PlanMsg":
        plan = IterationPlan(
            step=body["step"],
            new_requests=[_new_from_wire(r) for r in body["new"]],
            cached_requests=[CachedRequestData(rid, list(blocks), n)
                             for rid, blocks, n in body["cached"]],
            num_scheduled_tokens={rid: n for rid, n in body["sched"]},
            finished_request_ids=list(body["finished"]),
            preempted_request_ids=list(body["preempted"]),
            kv_sends=[KVSend(rid, peer, list(src), list(dst), list(peers))
                      for rid, peer, src, dst, peers in body["kv_sends"]],
            kv_checks=[KVCheck(rid, list(blocks), [list(d) for d in digests])
                       for rid, blocks, digests in body["kv_checks"]],
            after_step=body["after"],
        )
        return cls(plan)


def _new_to_wire(r: NewRequestData) -> dict:
    return {"request_id": r.request_id, "token_ids": r.token_ids,
            "num_prompt_tokens": r.num_prompt_tokens, "sampling": r.sampling.to_dict(),
            "block_table": r.block_table, "num_computed_tokens": r.num_computed_tokens,
            "reply_to": r.reply_to, "kv_received": r.kv_received,
            "num_cached_tokens": r.num_cached_tokens}


def _new_from_wire(d: dict) -> NewRequestData:
    return NewRequestData(**{**d, "sampling": SamplingParams.from_dict(d["sampling"])})


@_kind("step_result")
@dataclass(frozen=True)
class StepResultMsg:
    result: StepResult
    KIND: ClassVar[str]

    def _to_body(self) -> dict:
        # sampled: [request_id, token_id, logprob, top_logprobs]
        return {"step": self.result.step, "forward_ms": self.result.forward_ms,
                "wide_from_rows": self.result.wide_from_rows,
                "sampled": [[rid, s.token_id, s.logprob, s.top_logprobs]
                            for rid, s in self.result.sampled.items()],
                "kv_failed": self.result.kv_failed, "kv_stats": self.result.kv_stats,
                "kv_digests": self.result.kv_digests,
                "kv_verified": self.result.kv_verified}

    @classmethod
    def _from_body(cls, body: dict) -> "StepResultMsg":
        sampled = {rid: SampledToken(tok, lp, _tops(top))
                   for rid, tok, lp, top in body["sampled"]}
        return cls(StepResult(step=body["step"], sampled=sampled,
                              forward_ms=body.get("forward_ms"),
                              wide_from_rows=body.get("wide_from_rows"),
                              kv_failed=list(body.get("kv_failed", ())),
                              kv_stats=body.get("kv_stats"),
                              kv_digests={rid: [list(d) for d in per_rank] for rid, per_rank
                                          in body.get("kv_digests", {}).items()},
                              kv_verified=list(body.get("kv_verified", ()))))


@dataclass(frozen=True)
class TokenEvent:
    """One output token of one request; `index` is its output position (0, 1, 2, ...)."""
    request_id: str
    index: int
    token_id: int
    logprob: float | None = None
    top_logprobs: TopLogprobs | None = None


@dataclass(frozen=True)
class PromptLogprobsEvent:
    """Prompt log-probabilities of one request from one chunk; a recomputed prompt sends
    some positions again."""
    request_id: str
    logprobs: PromptLogprobs


@_kind("token_batch")
@dataclass(frozen=True)
class TokenBatch:
    """All token events of one iteration for the requests of one gateway, and the prompt
    log-probabilities it computed (before the tokens: a request's come before its first)."""
    events: list[TokenEvent] = field(default_factory=list)
    prompt: list[PromptLogprobsEvent] = field(default_factory=list)
    # request id -> its prompt tokens the prefix cache held when it was first scheduled, for
    # the requests whose first token is here (the usage's cached tokens, known to the gateway
    # also where it ends a stream itself, at a stop string, before the finish event)
    cached: dict[str, int] = field(default_factory=dict)
    # the engine instance whose workers sent the batch ("" for a colocated engine): the
    # requests in `cached` had their prompt computed there, so its prefix cache holds it (a
    # router's memory of where a prefix is: gateway/router.py)
    instance: str = ""
    KIND: ClassVar[str]

    def _to_body(self) -> dict:
        # events: [request_id, index, token_id, logprob, top_logprobs]
        body = {"events": [[e.request_id, e.index, e.token_id, e.logprob, e.top_logprobs]
                           for e in self.events]}
        if self.cached:
            body["cached"] = self.cached
            if self.instance:
                body["instance"] = self.instance
        if self.prompt:
            # prompt: [request_id, start, logprobs, ranks, top_logprobs]
            body["prompt"] = [[e.request_id, e.logprobs.start, e.logprobs.logprobs,
                               e.logprobs.ranks, e.logprobs.top_logprobs] for e in self.prompt]
        return body

    @classmethod
    def _from_body(cls, body: dict) -> "TokenBatch":
        return cls([TokenEvent(rid, idx, tok, lp, _tops(top))
                    for rid, idx, tok, lp, top in body["events"]],
                   [PromptLogprobsEvent(rid, PromptLogprobs(
                       start, list(lps), list(ranks),
                       None if tops is None else [_tops(t) for t in tops]))
                    for rid, start, lps, ranks, tops in body.get("prompt", ())],
                   dict(body.get("cached", {})), str(body.get("instance", "")))


@_kind("finish")
@dataclass(frozen=True)
class FinishEvent(_Plain):
    request_id: str
    finish_reason: str               # one of FINISH_REASONS
    num_prompt_tokens: int
    num_output_tokens: int           # token events the gateway must have before it ends
    error: str | None = None         # set when finish_reason == "error"
    # OpenAI error type: "invalid_request_error" (the request can never be served as given,
    # answered 4xx) or "server_error"
    error_type: str = "server_error"
    num_cached_tokens: int = 0       # of the prompt, found in the prefix cache

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ProtocolError(f"finish_reason must be one of {FINISH_REASONS}, "
                                f"got {self.finish_reason!r}")


# ---- P/D hand-off (docs/design.md#pd-disaggregation) --------------------------------------

@_kind("reserve")
@dataclass(frozen=True)
class ReserveMsg(_CarriesRequest, _Plain):
    """Prefill instance -> a decode instance's handoff stream: hold blocks for this prompt
    (without room there, the ask waits, and is answered once room frees)."""
    request: bytes                   # the encoded RequestMsg
    prefill_instance: str

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_strings(self, "prefill_instance")


@_kind("reserved")
@dataclass(frozen=True)
class ReservedMsg(_Plain):
    """Decode instance -> the prefill instance's reservations stream: where to write, or why
    not (`error`; empty block_ids)."""
    request_id: str
    decode_instance: str
    decode_consumer: str             # its scheduler's consumer name (the XCLAIM target)
    block_ids: list[int]
    peers: list[dict]                # the KV connector descriptor of each decode rank
    incarnation: float               # the decode scheduler's start time
    error: str = ""
    # the leading block_ids the decode pool's prefix cache already holds the prompt's K/V in:
    # shared there, never written (the prefill instance sends the blocks after them)
    num_cached_blocks: int = 0

    def __post_init__(self) -> None:
        _check_strings(self, "request_id", "decode_instance", "decode_consumer", "error")
        _check_list(self, "block_ids", int)
        _check_list(self, "peers", dict)        # read with .get: anything else crashed it
        if type(self.num_cached_blocks) is not int or \
                not 0 <= self.num_cached_blocks < max(len(self.block_ids), 1):
            raise TypeError(f"num_cached_blocks must be an integer below the "
                            f"{len(self.block_ids)} blocks, got {_short(self.num_cached_blocks)}")


@_kind("handoff")
@dataclass(frozen=True)
class HandoffMsg(_CarriesRequest, _Plain):
    """Prefill instance -> decode instance: the request is yours (its request-stream entry
    was XCLAIMed to you in the same script). Also prefill instance -> the prefill instance
    the gateway's router chose for a request the first one read (on the latter's
    reservations stream, with no tokens and no K/V). `output_token_ids`: what its client already
    has (the first token, or none for a short prompt the decode side prefills itself);
    `kv_received`: the sessions its prompt's K/V were written into, one per rank (empty:
    recompute); `kv_check`: [destination block ids, per rank the digests of what was sent into
    them], verified on the decode side before the K/V is trusted."""
    request: bytes                   # the encoded RequestMsg
    entry_id: str                    # its entry in the requests stream
    output_token_ids: list[int]
    kv_received: list[str]
    num_cached_tokens: int = 0       # of the prompt, in the prefill side's prefix cache
    kv_check: list = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_strings(self, "entry_id")
        _check_list(self, "output_token_ids", int)
        _check_list(self, "kv_received", str)


@_kind("cancel")
@dataclass(frozen=True)
class CancelMsg(_Plain):
    """Prefill instance -> decode instance: free the reservation, the request is not coming.
    `kv_pending`: a write into it failed or was given up at its deadline and may still land
    (the decode side holds the blocks until the writers say it cannot)."""
    request_id: str
    reason: str = ""
    kv_pending: bool = False

    def __post_init__(self) -> None:
        _check_strings(self, "request_id", "reason")


@_kind("heartbeat")
@dataclass(frozen=True)
class Heartbeat(_Plain):
    service: str                     # "scheduler" | "worker" | "gateway"
    id: str
    time: float
    extra: dict[str, Any] = field(default_factory=dict)


Message = (RequestMsg | AbortMsg | PlanMsg | StepResultMsg | TokenBatch | FinishEvent | Heartbeat
           | ReserveMsg | ReservedMsg | HandoffMsg | CancelMsg)


def encode(msg: Message) -> bytes:
    kind = getattr(type(msg), "KIND", None)
    if _KINDS.get(kind) is not type(msg):
        raise ProtocolError(f"{type(msg).__name__} is not a protocol message")
    return msgpack.packb({"v": SCHEMA_VERSION, "kind": kind, **msg._to_body()},
                         use_bin_type=True)


def heartbeat_of(value: bytes | None) -> Heartbeat | None:
    """The heartbeat a key holds; None for a missing key or a value that is not one."""
    try:
        msg = decode(value) if value else None
    except ProtocolError:
        return None
    return msg if isinstance(msg, Heartbeat) else None


def protocol_disagreement(value: bytes | None, peer: str, me: str) -> str | None:
    """Why a heartbeat key's value names a peer this process must not talk to: it was written
    in another protocol version (`peer` says who it is, `me` who reads it: "worker rank 0 of
    this instance", "scheduler"). None for our version, a missing key or no heartbeat. Read
    as a bare msgpack map: `decode` refuses another version, which made such a peer look
    absent rather than incompatible."""
    try:
        obj = msgpack.unpackb(value, raw=False) if value else None
    except (ValueError, msgpack.UnpackException):
        return None
    if not isinstance(obj, dict) or obj.get("kind") != "heartbeat" \
            or obj.get("v") == SCHEMA_VERSION:
        return None
    return version_mismatch(obj.get("v"), peer, me)


def version_mismatch(version: Any, peer: str, me: str) -> str:
    """The one line that says a peer speaks another protocol version (`protocol_disagreement`)."""
    return (f"{peer} speaks protocol version {_short(version)}, this {me} version "
            f"{SCHEMA_VERSION}: run the same pacer release on both (each would misread the "
            f"other's messages)")


def foreign_message(data: Any) -> dict | None:
    """The bare map of a message written in another protocol version, which `decode` refuses:
    its reader ends the request it names with an error (the names it reads are kept in every
    version, see SCHEMA_VERSION) rather than drop it, its client waiting for nothing. None
    for a message of this version, or bytes that are no message."""
    try:
        obj = msgpack.unpackb(data, raw=False) if isinstance(data, bytes) else None
    except (ValueError, msgpack.UnpackException):
        return None
    if not isinstance(obj, dict) or "v" not in obj or obj["v"] == SCHEMA_VERSION:
        return None
    return obj


def colocated_lengths(values: Iterable[bytes | None]) -> dict[str, int]:
    """Each engine instance's --max-model-len ("" for the colocated engine), from these
    scheduler heartbeat key values: the colocated schedulers', those that serve a request
    whole (a P/D prefill instance sends it on to a decode instance, which the prefill side
    picks by its own length), that state one."""
    return {str(beat.extra.get("instance", "")): n for beat in map(heartbeat_of, values)
            if beat is not None and beat.service == "scheduler"
            and beat.extra.get("role", "colocated") == "colocated"
            and isinstance(n := beat.extra.get("max_model_len"), int) and n > 1}


def scheduler_instances(values: list[bytes | None]) -> set[str]:
    """The engine instances ("" for the colocated engine) whose scheduler heartbeats are among
    these heartbeat key values: a scheduler's heartbeat names its instance (an expired key
    reads as None; a value that is no heartbeat counts for none)."""
    return {str(beat.extra.get("instance", "")) for beat in map(heartbeat_of, values)
            if beat is not None and beat.service == "scheduler"}


def decode(data: bytes) -> Message:
    try:
        obj = msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise ProtocolError(f"not a msgpack message: {e}") from e
    if not isinstance(obj, dict):
        raise ProtocolError(f"a message is a msgpack map, got {type(obj).__name__}")
    version, kind = obj.pop("v", None), obj.pop("kind", None)
    if version != SCHEMA_VERSION:
        raise ProtocolError(f"message schema version {version!r} is not supported "
                            f"(this build speaks version {SCHEMA_VERSION})")
    cls = _KINDS.get(kind)
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r} (known: {sorted(_KINDS)})")
    try:
        return cls._from_body(obj)
    except (KeyError, TypeError, ValueError, PacerError) as e:
        raise ProtocolError(f"malformed {kind} message: {e}") from e


def summary_fields(msg: Message) -> dict[str, int | str]:
    """What a person reading a stream with redis-cli sees in clear beside the encoded message
    (`XREVRANGE pacer:plans + - COUNT 1`). Readers decode the message and ignore these.
    A plan's decode rows are its running requests advancing by one row."""
    if isinstance(msg, PlanMsg):
        p = msg.plan
        decode_rows = sum(p.num_scheduled_tokens.get(c.request_id) == 1
                          for c in p.cached_requests)
        return {"step": p.step, "requests": len(p.num_scheduled_tokens),
                "prefill_rows": p.total_tokens - decode_rows, "decode_rows": decode_rows}
    if isinstance(msg, StepResultMsg):
        return {"step": msg.result.step, "sampled": len(msg.result.sampled)}
    if isinstance(msg, RequestMsg):
        routed = {"instance": msg.instance} if msg.instance else {}
        return {"request_id": msg.request_id, "prompt_tokens": len(msg.prompt_token_ids),
                **routed}
    if isinstance(msg, (ReservedMsg, CancelMsg)):
        return {"kind": msg.KIND, "request_id": msg.request_id}
    if isinstance(msg, (ReserveMsg, HandoffMsg)):
        inner = decode(msg.request)
        return {"kind": msg.KIND, "request_id": inner.request_id,
                "prompt_tokens": len(inner.prompt_token_ids)}
    return {}


def to_fields(msg: Message, **sender: str) -> dict[str, bytes | int | str]:
    """The field map for XADD: the readable summary and `sender` (who wrote it, e.g.
    scheduler="vm") first, then the encoded message."""
    return {**summary_fields(msg), **sender, STREAM_FIELD: encode(msg)}


def message_bytes(fields: dict) -> bytes:
    """The encoded message of a stream entry's field map as redis-py returns it (bytes or str
    keys), undecoded."""
    data = fields.get(STREAM_FIELD.encode(), fields.get(STREAM_FIELD))
    if data is None:
        raise ProtocolError(f"stream entry has no {STREAM_FIELD!r} field: {sorted(fields)}")
    return data


def from_fields(fields: dict) -> Message:
    """Decode a stream entry's field map as redis-py returns it (bytes or str keys)."""
    return decode(message_bytes(fields))
