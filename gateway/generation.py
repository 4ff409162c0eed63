"""One request in flight: submitted upstream, its token events turned into text deltas.

    async with Generation(...) as gen:
        await gen.start()                  # register for events, then XADD the request
        async for delta in gen.deltas():   # one delta per batch of token events
            await write(delta)

Leaving the block early (client gone, handler cancelled, a stop string found) aborts the
request upstream, so the scheduler frees its KV blocks; so does an end the gateway made itself
(its deadline, Redis away or out of memory, the token channel dropped): the scheduler has not
ended it, and would decode it to max_tokens for nobody. A request with a deadline is ended by
the scheduler when it passes; should that word not come (the scheduler is gone), the gateway
ends it itself DEADLINE_GRACE_S later.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import structlog

from gateway.metrics import GatewayMetrics
from gateway.openai_schema import StopReason, TokenLogprob, vllm_prompt_logprobs
from gateway.state import WaitingSlot
from gateway.streams import RequestStream, TokenRouter
from shared.text_output import TextOutput
from gateway.upstream import REDIS_RESTARTED, Upstream
from shared import clock
from shared.detokenizer import IncrementalDetokenizer
from shared.protocol import FinishEvent, TokenEvent
from shared.sampling import SamplingParams
from shared.tokenizer import Tokenizer

log = structlog.get_logger("gateway.generation")

DEADLINE_GRACE_S = 2.0
# an echo's logprobs go this many at a time, top ones and the token's text counted
# (~1 ms of JSON)
ECHO_PIECE_ITEMS = 1024


@dataclass
class Delta:
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None      # set on the last delta
    error: str | None = None              # finish_reason == "error"
    error_type: str = "server_error"
    stop_reason: StopReason = None        # on the last delta (openai_schema.StopReason)


class Generation:
    def __init__(self, *, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 stop: tuple[str, ...], tokenizer: Tokenizer, upstream: Upstream,
                 router: TokenRouter, metrics: GatewayMetrics, arrival: float,
                 slot: WaitingSlot | None = None, timeout_s: float | None = None,
                 echo: str | None = None, include_stop: bool = False,
                 skip_special_tokens: bool = True, echo_only: bool = False,
                 tokens_as_ids: bool = False) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling = sampling
        self._tokenizer = tokenizer
        # how logprobs name a token: its text, or (vLLM's return_tokens_as_token_ids) its id,
        # which tells apart tokens whose texts are alike (special ones are all "")
        self._token_name = token_id_name if tokens_as_ids else tokenizer.token_text
        self._upstream, self._router, self._metrics = upstream, router, metrics
        eos = frozenset(tokenizer.eos_token_ids)
        self._eos_id = tokenizer.eos_token_id
        self._last_token_id: int | None = None
        self._text = TextOutput(IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                                       skip_special_tokens=skip_special_tokens),
                                stop, sampling.min_tokens, include_stop,
                                ends=lambda token_id: sampling.stops_on(token_id, eos))
        self._arrival = arrival                 # time.monotonic() when the request came in
        self._last_token_at: float | None = None
        self._first_token_at: float | None = None
        self._submitted = False
        # the submit was sent (it may have reached Redis even if it then failed, or was
        # cancelled with the client's connection): an abort follows if the request ends here
        self._sent = False
        self._done_upstream = False             # the scheduler finished it, or was told to
        self._slot = slot                       # its place in the queue until a first event
        # logprobs not yet sent, each with where its token's text starts: one is sent with the
        # text its token begins, so the logprobs cover exactly the text (none for a stop string)
        self._pending: list[tuple[int, TokenLogprob]] = []
        self._timeout_s = timeout_s
        self._timer: asyncio.TimerHandle | None = None
        self.num_output_tokens = 0
        self.finish_reason: str | None = None
        self._error: str | None = None          # why it failed, for its last log line
        self._stream: RequestStream | None = None
        self._echo = echo                       # the prompt's text, sent before the output
        self._text_offset = len(echo or "")     # where the output's text starts in the choice's
        self._skip_special_tokens = skip_special_tokens
        self._echo_only = echo_only             # the generated token left out of the answer

    @property
    def num_cached_tokens(self) -> int | None:
        """Of the prompt, the tokens the prefix cache held (None before the first token)."""
        return None if self._stream is None else self._stream.num_cached_tokens

    @property
    def stop_reason(self) -> StopReason:
        """The stop string found, or the stop token that ended it, once finished with "stop":
        as vLLM's, the model's one EOS (unless ignored) gives null, and its other end-of-turn
        ids (stop tokens here, as there) their id."""
        if self._text.stopped:
            return self._text.stop_string
        last, sampling = self._last_token_id, self.sampling
        if self.finish_reason != "stop" or last not in sampling.stop_token_ids or \
                (not sampling.ignore_eos and last == self._eos_id):
            return None
        return last

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    async def __aenter__(self) -> "Generation":
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop_waiting()
        if self._timer is not None:
            self._timer.cancel()
        self._router.close(self.request_id)
        self._upstream.ended(self.request_id)
        self._abort_upstream("client disconnected" if self._submitted else "not submitted")
        # a request whose client left before its end counts as vLLM counts it: "abort", with
        # the tokens it generated (so the latency histograms and the token counter agree)
        reason = self.finish_reason or ("abort" if self._submitted else None)
        e2e = time.monotonic() - self._arrival
        if reason is not None:
            self._metrics.e2e_request_latency.observe(e2e)
            self._metrics.generation_tokens.inc(self.num_output_tokens)
            self._metrics.request_success.labels(reason).inc()
        # the one line that says how a request went: its end, and the latencies the metrics
        # only show as histograms
        ttft = None if self._first_token_at is None else self._first_token_at - self._arrival
        log.info("request ended", request_id=self.request_id, finish_reason=reason,
                 prompt_tokens=self.num_prompt_tokens, output_tokens=self.num_output_tokens,
                 ttft_s=None if ttft is None else round(ttft, 4), e2e_s=round(e2e, 4),
                 error=self._error)

    async def start(self) -> None:
        self._stream = self._router.open(self.request_id)
        now = clock.now()           # the scheduler compares with its own clock.now()
        deadline = None if self._timeout_s is None else now + self._timeout_s
        self._sent = True
        self._stream.redis_run_id, self._stream.entry = await self._upstream.submit(
            self.request_id, self.prompt_token_ids, self.sampling, arrival_time=now,
            deadline=deadline)
        self._submitted = True
        if self._upstream.replaced(self._stream.redis_run_id):
            # a Redis that restarted while the request was on its way to it
            self._stream.fail(REDIS_RESTARTED)
        if self._timeout_s is not None:
            self._timer = asyncio.get_running_loop().call_later(
                self._timeout_s + DEADLINE_GRACE_S, self._stream.fail,
                f"the request's deadline of {self._timeout_s:g} s passed", "timeout_error")
        self._metrics.prompt_tokens.inc(self.num_prompt_tokens)

    def _abort_upstream(self, reason: str) -> None:
        """Have the scheduler end the request unless it ended it itself (or was told to)."""
        if self._sent and not self._done_upstream:
            self._done_upstream = True
            self._upstream.abort_soon(self.request_id, reason)

    def _stop_waiting(self) -> None:
        if self._slot is not None:
            self._slot.release()
        # no stream: the request ended before it was opened (refused on its way in)
        self._upstream.prefilled(self.request_id,
                                 None if self._stream is None else self._stream.computed_on)

    async def deltas(self) -> AsyncIterator[Delta]:
        while True:
            events, finish = await self._stream.next()
            self._stop_waiting()
            if self._echo is not None:
                if finish is None or finish.error is None:
                    async for delta in self._echo_deltas():
                        yield delta
                self._echo = None
            self._consume([] if self._echo_only else events)
            if finish is not None and self._stream.ended_here:
                self._abort_upstream(f"ended by the gateway: {finish.error}")
            self._done_upstream = finish is not None
            if self._text.stopped or finish is not None:
                # no longer load on its instance before the client can see the end: a client
                # that sends its next request at once is routed without it (ended() is
                # idempotent; __aexit__ calls it again for every other way out)
                self._upstream.ended(self.request_id)
            if self._text.stopped:
                # at once, not when the response ends: with n > 1 or several prompts that is
                # when the last choice ends, and this one would decode to max_tokens meanwhile
                self._abort_upstream("stop string")
                self.finish_reason = "stop"
                yield Delta(self._text.take(final=True), self._take_logprobs(), "stop",
                            stop_reason=self.stop_reason)
                return
            if finish is not None:
                yield self._last_delta(finish)
                return
            piece = self._text.take()
            logprobs = self._take_logprobs()
            if piece or logprobs:
                yield Delta(piece, logprobs)

    async def _echo_deltas(self) -> AsyncIterator[Delta]:
        """The prompt, and with logprobs each of its tokens' (the first has none): they
        arrived ahead of the first token. Its logprobs go a piece at a time, each with the
        text its tokens begin, the event loop free between pieces: a prompt of 32k tokens
        with 20 top ones each made one chunk whose JSON held the loop, and every stream,
        for ~0.4 s (json.dumps holds the GIL, on a thread too)."""
        if self.sampling.prompt_logprobs is None:
            yield Delta(self._echo)
            return
        # a decode or more a prompt token: a batch of prompts as long as the context took
        # seconds on the event loop, every stream stalled meanwhile
        entries = await asyncio.to_thread(self._prompt_entries)
        size = max(1, ECHO_PIECE_ITEMS // (2 + self.sampling.prompt_logprobs))
        start = 0
        for first in range(0, len(entries), size):
            rest = entries[first + size:first + size + 1]
            end = len(self._echo) if not rest else min(max(rest[0].offset, start),
                                                        len(self._echo))
            if first:
                await asyncio.sleep(0)      # the other streams' turn
            yield Delta(self._echo[start:end], entries[first:first + size])
            start = end

    def _prompt_entries(self) -> list[TokenLogprob]:
        """Echo's logprobs: each prompt token's, placed in the prompt's text as the output's
        are in theirs. CPU-bound: run it off the event loop."""
        ids, known = self.prompt_token_ids, self._stream.prompt_logprobs
        offsets = self._prompt_offsets()
        name = self._token_name
        entries = [TokenLogprob(name(ids[0]), None, None, offset=0)]
        for pos in range(1, len(ids)):
            entry = known.get(pos)
            entries.append(TokenLogprob(
                name(ids[pos]), entry and entry.logprob,
                [(name(t), lp) for t, lp in (entry and entry.top) or []],
                offset=offsets[pos]))
        if len(known) < len(ids) - 1:
            log.error("prompt logprobs missing", request_id=self.request_id,
                      missing=len(ids) - 1 - len(known))
        return entries

    def _prompt_offsets(self) -> list[int]:
        """Each prompt token's place in the echoed prompt, found as the output's are. A
        token-id prompt's echo is its decoded text; a text prompt's is the text as sent, with
        the special tokens written in it (so decoded with them) and without those the
        tokenizer added in front (BOS: decoded, then counted off, so that they stand at 0)."""
        found = []
        for skip in dict.fromkeys((self._skip_special_tokens, False)):
            text = IncrementalDetokenizer(self._tokenizer, skip_special_tokens=skip)
            offsets = []
            for t in self.prompt_token_ids:
                offsets.append(len(text.text))
                text.add(t)
            text.flush()
            if text.text.endswith(self._echo):
                added = len(text.text) - len(self._echo)
                return [max(at - added, 0) for at in offsets]
            found.append(offsets)
        return found[0]     # a text the tokenizer does not give back as written

    def prompt_logprobs(self, top: int) -> list[dict | None]:
        """vLLM's `prompt_logprobs` of this request's prompt (once its answer is in)."""
        return vllm_prompt_logprobs(self.prompt_token_ids, self._stream.prompt_logprobs, top,
                                    self._token_name)

    def _consume(self, events: list[TokenEvent]) -> None:
        """Feed tokens to the text until a stop string appears; their logprobs wait."""
        if events:
            self._observe_latency(len(events))
        for event in events:
            self.num_output_tokens += 1
            self._last_token_id = event.token_id
            start = len(self._text.text)
            self._text.add(event.token_id)
            if self.sampling.logprobs is not None:
                self._pending.append((start, self._logprob(event, self._text_offset + start)))
            if self._text.stopped:
                break

    def _take_logprobs(self, final: bool = False) -> list[TokenLogprob]:
        """The logprobs of the tokens whose text has been taken (all of them once `final`
        without a stop string); after a stop, the rest are the stop string's and dropped."""
        n = len(self._pending) if final and not self._text.stopped else \
            sum(1 for start, _ in self._pending if start < self._text.sent)
        taken = [entry for _start, entry in self._pending[:n]]
        self._pending = [] if self._text.stopped else self._pending[n:]
        return taken

    def _last_delta(self, finish: FinishEvent) -> Delta:
        self.finish_reason, self._error = finish.finish_reason, finish.error
        if not self._echo_only:
            self.num_output_tokens = max(self.num_output_tokens, finish.num_output_tokens)
        elif finish.error is None:
            self.finish_reason = "length"       # max_tokens 0 reached: nothing generated
        if finish.error is None:
            # the detokenizer's incomplete character is released only at a real end: one a
            # failure cut short would have been completed by the next token, and sent as
            # U+FFFD it is text the output never had
            self._text.finish()
        if self._text.stopped:      # the flushed tail completed a stop string
            self.finish_reason = "stop"
        return Delta(self._text.take(final=True), self._take_logprobs(final=True),
                     self.finish_reason, finish.error, finish.error_type, self.stop_reason)

    def _observe_latency(self, num_tokens: int) -> None:
        now = time.monotonic()
        if self._last_token_at is None:
            self._first_token_at = now
            self._metrics.time_to_first_token.observe(now - self._arrival)
            # the first token's companions came with it: no gap after it (one observation a
            # token past the first, so the count is the tokens less the requests, as vLLM's)
            for _ in range(num_tokens - 1):
                self._metrics.inter_token_latency.observe(0.0)
        else:
            # tokens that arrive together share the gap since the previous arrival
            gap = (now - self._last_token_at) / num_tokens
            for _ in range(num_tokens):
                self._metrics.inter_token_latency.observe(gap)
        self._last_token_at = now

    def _logprob(self, event: TokenEvent, offset: int) -> TokenLogprob:
        ids = [event.token_id, *(t for t, _ in event.top_logprobs or [])]
        texts = [self._tokenizer.token_text(t) for t in ids]
        names = texts if self._token_name == self._tokenizer.token_text else \
            [self._token_name(t) for t in ids]
        return TokenLogprob(token=names[0], logprob=event.logprob,
                            top=[(name, lp) for name, (_, lp) in
                                 zip(names[1:], event.top_logprobs or [])],
                            # a token's bytes stay its text's, whatever names it
                            raw=tuple(map(self._tokenizer.token_bytes, ids, texts)),
                            offset=offset)


def token_id_name(token_id: int) -> str:
    """A token named by its id, as vLLM's return_tokens_as_token_ids names it."""
    return f"token_id:{token_id}"


async def merged_deltas(gens: list[Generation]) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) from every generation as each comes. Closed early (aclosing),
    it stops reading them all; their owners abort what is still running upstream."""
    if len(gens) == 1:           # the usual request: no task, no queue
        async for delta in gens[0].deltas():
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, gen: Generation) -> None:
        try:
            async for delta in gen.deltas():
                queue.put_nowait((index, delta))
            queue.put_nowait((index, None))
        except Exception as e:   # the consumer raises it
            queue.put_nowait((index, e))

    tasks = [asyncio.create_task(pump(i, gen)) for i, gen in enumerate(gens)]
    try:
        live = len(tasks)
        while live:
            index, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
