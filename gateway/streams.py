"""One pub/sub listener per gateway process, routing token events to the requests waiting.

    worker rank 0 --TokenBatch--> tokens:{gateway_id} --+
    scheduler   --FinishEvent--> tokens:{gateway_id} --+--> TokenRouter.run --> RequestStream
                                                                         (one per request)

Token batches and finish events come from different publishers, so a finish event may
overtake the last tokens; events carry their output `index`, so duplicates are dropped and
gaps noticed. A stream is complete once its finish event arrived and every token before
`num_output_tokens` was received (or, if some never come, after a grace period).

The gateway can also end a stream itself (`RequestStream.fail`, `TokenRouter.fail_all`): its
deadline passed, the server is shutting down, or Redis lost the request. The client then gets
the tokens received so far and an error event, never a stream that stays open; and the
scheduler, which knows nothing of it, is told to abort the request (`ended_here`).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from shared.lifecycle import cancel_requested
from shared.plan import PromptEntry
from shared.protocol import (FinishEvent, PromptLogprobsEvent, ProtocolError, TokenBatch,
                             TokenEvent, decode, foreign_message, version_mismatch)
from shared.redis_retry import RETRY_FIRST_S, retry_redis

log = structlog.get_logger("gateway.streams")



@dataclass(frozen=True)
class LocalFailure:
    """The gateway ends a stream without waiting for the scheduler."""
    error: str
    error_type: str = "server_error"


Item = TokenEvent | PromptLogprobsEvent | FinishEvent | LocalFailure


class RequestStream:
    """The events of one request, in output order, without duplicates."""

    def __init__(self, request_id: str, finish_grace_s: float = 5.0) -> None:
        self.request_id = request_id
        self.redis_run_id: str | None = None    # the Redis that took the request
        # (stream key, entry id) of the request's entry, once submitted (None: not yet); see
        # Upstream.check_entries
        self.entry: tuple[str, bytes | str] | None = None
        self.last_event_at = time.monotonic()   # when it was opened or last heard of
        self.ended_here = False     # the gateway ended it, not the scheduler's finish event
        # its entry was found acked with no finish event (Upstream.check_entries)
        self.acked_unanswered = False
        self._queue: asyncio.Queue[Item] = asyncio.Queue()
        self._grace_s = finish_grace_s
        self._next_index = 0
        self._pending: dict[int, TokenEvent] = {}     # arrived ahead of a gap
        self._finish: FinishEvent | None = None
        self._gave_up = False
        # prompt position -> its entry, as computed (SamplingParams.prompt_logprobs); all of
        # them are in before the first token (published in order, ahead of it)
        self.prompt_logprobs: dict[int, PromptEntry] = {}
        # of the prompt, the tokens the prefix cache held: sent with the first token, and in
        # the scheduler's finish event (a stream the gateway ends at a stop string has no
        # finish event)
        self.num_cached_tokens: int | None = None
        # the engine instance that computed the prompt (its prefix cache holds it), as the
        # batch of the first token says; None until then, or where it does not say
        self.computed_on: str | None = None

    def push(self, item: Item) -> None:
        self.last_event_at = time.monotonic()
        self._queue.put_nowait(item)

    def cached(self, num_tokens: int | None, computed_on: str | None = None) -> None:
        """What the prefix cache held of the prompt when the request was first scheduled, and
        the instance that computed it: the first report stands (a scheduler that took the
        request over after a restart admits it again, against a cache of its own, and reports
        that)."""
        if self.num_cached_tokens is None:
            self.num_cached_tokens = num_tokens
        if self.computed_on is None:
            self.computed_on = computed_on

    def fail(self, error: str, error_type: str = "server_error") -> None:
        """End the stream with an error after the tokens already received."""
        self.push(LocalFailure(error, error_type))

    @property
    def finish(self) -> FinishEvent | None:
        return self._finish

    async def next(self) -> tuple[list[TokenEvent], FinishEvent | None]:
        """Wait for new in-order tokens; returns them, and the finish event once complete."""
        ready: list[TokenEvent] = []
        while True:
            while not self._queue.empty():
                self._accept(self._queue.get_nowait(), ready)
            if self._complete():
                return self._trim(ready), self._finish
            if ready:
                return ready, None
            await self._wait(ready)

    async def _wait(self, ready: list[TokenEvent]) -> None:
        if self._finish is None:
            self._accept(await self._queue.get(), ready)
            return
        try:
            self._accept(await asyncio.wait_for(self._queue.get(), self._grace_s), ready)
        except TimeoutError:
            log.error("token events missing after finish", request_id=self.request_id,
                      received=self._next_index, expected=self._finish.num_output_tokens,
                      missing_from=self._next_index)
            ready.extend(self._pending[i] for i in sorted(self._pending))
            self._pending.clear()
            self._gave_up = True

    def _accept(self, item: Item, ready: list[TokenEvent]) -> None:
        if isinstance(item, PromptLogprobsEvent):
            for pos, entry in item.logprobs.by_position():
                self.prompt_logprobs.setdefault(pos, entry)      # a recompute's come again
            return
        if isinstance(item, FinishEvent):
            self._finish = self._finish or item
            self.cached(item.num_cached_tokens)
            return
        if isinstance(item, LocalFailure):
            if self._finish is None:
                self._finish = FinishEvent(self.request_id, "error", 0, self._next_index,
                                           item.error, item.error_type)
                self._gave_up = True
                self.ended_here = True
            return
        if item.index < self._next_index or item.index in self._pending:
            log.debug("duplicate token event dropped", request_id=self.request_id, index=item.index)
            return
        if item.index > self._next_index:
            log.warning("token event gap", request_id=self.request_id,
                        expected=self._next_index, got=item.index)
            self._pending[item.index] = item
            return
        ready.append(item)
        self._next_index += 1
        while self._next_index in self._pending:
            ready.append(self._pending.pop(self._next_index))
            self._next_index += 1

    def _complete(self) -> bool:
        return self._finish is not None and (
            self._gave_up or self._next_index >= self._finish.num_output_tokens)

    def _trim(self, ready: list[TokenEvent]) -> list[TokenEvent]:
        # the scheduler's count is authoritative: a token sampled after it decided to stop
        # the request (e.g. in flight during an abort) is not part of the output
        return [e for e in ready if e.index < self._finish.num_output_tokens]


class TokenRouter:
    """Subscribes to this gateway's channel and hands each event to its request's stream."""

    def __init__(self, redis: aioredis.Redis, channel: str, finish_grace_s: float = 5.0) -> None:
        self._redis = redis
        self.channel = channel
        self._grace_s = finish_grace_s
        self._streams: dict[str, RequestStream] = {}
        self.subscribed = asyncio.Event()
        # why the channel is not subscribed, for a request refused meanwhile: the last failure
        # to subscribe or listen (None before the first)
        self.failure: BaseException | None = None

    def open(self, request_id: str) -> RequestStream:
        """Register before the request is sent upstream, so no event can be missed."""
        stream = RequestStream(request_id, self._grace_s)
        self._streams[request_id] = stream
        return stream

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    @property
    def num_open(self) -> int:
        return len(self._streams)

    def quiet(self, for_s: float) -> list[RequestStream]:
        """The open streams with a known request entry that heard nothing for `for_s`: queued,
        or lost (see Upstream.check_entries). A stream that is being served is not."""
        since = time.monotonic() - for_s
        return [s for s in self._streams.values()
                if s.entry is not None and s.finish is None and s.last_event_at < since]

    def fail_all(self, error: str, error_type: str = "server_error",
                 keep_run_id: str | None = None) -> int:
        """End every open stream with an error, except, given `keep_run_id`, those the Redis
        with that run id took (sent after a restart) and those still being submitted (their
        submission tells which Redis took them, see `Upstream.replaced`); returns how many
        were ended."""
        ended = [s for s in self._streams.values() if keep_run_id is None
                 or s.redis_run_id is not None and s.redis_run_id != keep_run_id]
        for stream in ended:
            stream.fail(error, error_type)
        if ended:
            log.warning("open streams ended", count=len(ended), error=error)
        return len(ended)

    def route(self, data: bytes) -> None:
        """Hand a message's events to their streams. A message that cannot be, whatever is
        wrong with it, is logged and dropped: raised, it ended the listener, and every stream
        after it waited forever."""
        try:
            self._route(decode(data))
        except ProtocolError as e:
            if not self._other_version(data):
                log.warning("undecodable message on token channel", error=str(e))
        except Exception as e:      # decoded, but not as the protocol means (an id not a str)
            log.error("malformed message on token channel dropped",
                      error=f"{type(e).__name__}: {e}")

    def _other_version(self, data: bytes) -> bool:
        """A message of another protocol version naming an open request: a scheduler of
        another release read the request and cannot serve it (it ends it with such a message,
        see RequestBook): the request ends with an error naming both versions. Skipped as
        undecodable, its client waited until its timeout (forever without one)."""
        obj = foreign_message(data)
        stream = self._streams.get(obj.get("request_id")) \
            if obj and isinstance(obj.get("request_id"), str) else None
        if stream is None:
            return False
        error = version_mismatch(obj["v"], "the scheduler that read the request", "gateway")
        log.error("request answered in another protocol version", request_id=stream.request_id,
                  error=error)
        # the scheduler's answer, not the gateway's: it acked the entry, no abort is owed
        stream.push(FinishEvent(stream.request_id, "error", 0, 0, error))
        return True

    def _route(self, msg) -> None:
        if isinstance(msg, TokenBatch):
            for rid, cached in msg.cached.items():
                if (stream := self._streams.get(rid)) is not None:
                    stream.cached(cached, msg.instance or None)
            for prompt in msg.prompt:
                self._deliver(prompt.request_id, prompt)
            for event in msg.events:
                self._deliver(event.request_id, event)
        elif isinstance(msg, FinishEvent):
            self._deliver(msg.request_id, msg)
        else:
            log.warning("unexpected message on token channel", kind=type(msg).__name__)

    def _deliver(self, request_id: str, item: Item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.push(item)   # unknown ids: requests that already ended (stop string, abort)

    async def run(self) -> None:
        """Listen until cancelled. Subscribing is tried with `retry_redis`'s backoff; a
        connection that drops once subscribed ends the open streams (what was published
        meanwhile is gone) and subscribing starts again afresh: every outage is met as the
        first was."""
        while not cancel_requested():
            try:
                await retry_redis(self._listen, "listen on the token channel", log,
                                  errors=(RedisError, OSError), give_up=self.subscribed.is_set)
            except (RedisError, OSError) as e:
                self.subscribed.clear()
                log.warning("token channel connection lost", open_requests=self.num_open,
                            error=str(e), retry_in_s=RETRY_FIRST_S)
                self.fail_all("the connection to Redis dropped and token events were "
                              "lost; send the request again")
                await asyncio.sleep(RETRY_FIRST_S)
        raise asyncio.CancelledError           # _listen returns only once cancelled

    async def _listen(self) -> None:
        """Until cancelled (then returns) or the connection drops (raises)."""
        pubsub = self._redis.pubsub()
        try:
            await pubsub.subscribe(self.channel)
            while not cancel_requested():
                message = await pubsub.get_message(timeout=1.0)
                if message is None:
                    continue
                if message["type"] == "message":
                    self.route(message["data"])
                elif message["type"] == "subscribe":
                    # confirmed by the server: from now on no event published to us is lost
                    self.subscribed.set()
                    log.info("subscribed", channel=self.channel)
        except (RedisError, OSError) as e:
            self.failure = e
            raise
        finally:
            await pubsub.aclose()
