"""The serving benchmark's client side: send streamed requests on a Gamma arrival schedule
under a concurrency cap, time every chunk at the client, and turn the timelines into
vLLM `bench serve`'s metrics:

- TTFT: request sent -> first streamed chunk that carries text
- E2EL: request sent -> end of the stream
- TPOT: (E2EL - TTFT) / (output tokens - 1), per request with more than one token
- ITL: every gap between consecutive text-carrying chunks, pooled over requests
- throughput over the run (first send -> last completion): requests/s, output and total
  tokens/s; goodput: requests/s of those that met every SLO given

Output token counts come from the usage chunk (`stream_options.include_usage`); without it a
request's count falls back to its number of text chunks, a lower bound.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import aiohttp
import numpy as np

from services.bench_dataset import BenchRequest

SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class ApiTarget:
    base_url: str                      # e.g. http://127.0.0.1:8000
    endpoint: str = "/v1/completions"
    model: str = "smollm2-135m"
    api_key: str | None = None

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("/chat/completions")

    @property
    def responses(self) -> bool:
        """OpenAI's Responses API: typed events, the usage in the last one."""
        return self.endpoint.rstrip("/").endswith("/responses")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint


@dataclass(frozen=True)
class SendOptions:
    temperature: float = 0.0
    ignore_eos: bool = True
    timeout_s: float = 300.0           # per request, from send to the end of its stream
    # completions: ask for each token's logprob, so that every chunk names its tokens
    # (`RequestResult.chunk_tokens`: a chunk may carry several, e.g. the pieces of one character)
    logprobs: bool = False
    # more fields of every request (e.g. structured_outputs), over the ones above
    extra_body: dict = field(default_factory=dict)


@dataclass
class RequestResult:
    """One request's timeline, in seconds from the moment it was sent."""
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float | None = None          # None: no chunk carried text
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    sent_at: float = 0.0               # perf_counter() at send, for the run's own clock
    error: str = ""
    chunk_tokens: list[int] = field(default_factory=list)   # tokens of each text chunk

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens <= 1:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


# ---- one request -------------------------------------------------------------------------

def request_body(target: ApiTarget, req: BenchRequest, opts: SendOptions) -> dict:
    if target.responses:
        if not isinstance(req.prompt, str):
            raise ValueError("the responses endpoint takes text prompts, not token ids")
        return {"model": target.model, "input": req.prompt, "max_output_tokens": req.output_len,
                "temperature": opts.temperature, "ignore_eos": opts.ignore_eos, "stream": True,
                **opts.extra_body}
    body = {"model": target.model, "max_tokens": req.output_len,
            "temperature": opts.temperature, "ignore_eos": opts.ignore_eos, "stream": True,
            "stream_options": {"include_usage": True}}
    if target.chat:
        text = req.prompt if isinstance(req.prompt, str) else None
        if text is None:
            raise ValueError("the chat endpoint takes text prompts, not token ids")
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = req.prompt
        if opts.logprobs:
            body["logprobs"] = 0
    return {**body, **opts.extra_body}


def chunk_text(data: dict, chat: bool) -> str:
    choices = data.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


class _Stream:
    """Folds SSE data lines into a RequestResult as they arrive."""

    def __init__(self, result: RequestResult, chat: bool, responses: bool = False) -> None:
        self.result, self.chat, self.responses = result, chat, responses
        self.last_text_at: float | None = None
        self.text_chunks = 0
        self.done = False

    def feed(self, payload: str, now: float) -> None:
        if payload == "[DONE]":
            self.done = True
            return
        data = json.loads(payload)
        try:
            self._feed_data(data, now)
        except (AttributeError, TypeError, KeyError, ValueError) as e:
            # not the shape an OpenAI stream's chunks have: this request failed, and the run
            # goes on (an exception here would end every other request's measurement too)
            raise ValueError(f"a stream chunk of an unexpected shape: {payload[:200]}") from e

    def _feed_data(self, data: dict, now: float) -> None:
        r = self.result
        if "error" in data:
            # OpenAI's {"error": {"message": ...}}, or a bare message (TGI's {"error": "..."})
            error = data["error"]
            r.error = str(error.get("message", error) if isinstance(error, dict) else error)
            return
        if self.responses:
            self._feed_event(data, now)
            return
        if chunk_text(data, self.chat):
            self._text_at(now)
            logprobs = (data.get("choices") or [{}])[0].get("logprobs") or {}
            if logprobs.get("tokens"):
                r.chunk_tokens.append(len(logprobs["tokens"]))
        usage = data.get("usage")
        if usage:
            r.output_tokens = int(usage.get("completion_tokens", 0))
            r.prompt_len = int(usage.get("prompt_tokens", r.prompt_len))

    def _text_at(self, now: float) -> None:
        r = self.result
        if self.last_text_at is None:
            r.ttft = now - r.sent_at
        else:
            r.itl.append(now - self.last_text_at)
        self.last_text_at = now
        self.text_chunks += 1

    def _feed_event(self, event: dict, now: float) -> None:
        """A Responses API event: text deltas timed; the last event, its usage or error."""
        kind = event.get("type")
        if kind == "response.output_text.delta" and event.get("delta"):
            self._text_at(now)
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            self.done = True
            response = event.get("response") or {}
            if response.get("error"):
                self.result.error = str(response["error"].get("message", response["error"]))
            usage = response.get("usage") or {}
            self.result.output_tokens = int(usage.get("output_tokens", 0))
            self.result.prompt_len = int(usage.get("input_tokens", self.result.prompt_len))


async def send_request(session: aiohttp.ClientSession, target: ApiTarget, req: BenchRequest,
                       opts: SendOptions) -> RequestResult:
    """Never raises for a failed request: the failure is recorded in the result."""
    result = RequestResult(prompt_len=req.prompt_len)
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    stream = _Stream(result, target.chat, target.responses)
    result.sent_at = time.perf_counter()
    try:
        body = request_body(target, req, opts)
        async with session.post(target.url, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=opts.timeout_s)) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                result.error = f"HTTP {resp.status}: {text}"
                return result
            async for raw in resp.content:
                now = time.perf_counter()
                line = raw.decode("utf-8", errors="replace").strip()
                if line.startswith("data:"):
                    stream.feed(line[5:].strip(), now)
        result.e2el = time.perf_counter() - result.sent_at
    except asyncio.TimeoutError:
        result.error = f"timed out after {opts.timeout_s:g} s"
        return result
    except (aiohttp.ClientError, OSError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    if not result.error and not stream.done:
        result.error = "the stream ended without [DONE]"
    if not result.output_tokens:
        result.output_tokens = stream.text_chunks
    result.success = not result.error
    return result


# ---- many requests -----------------------------------------------------------------------

def arrival_gaps(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Gaps between sends: Gamma(shape=b, scale=1/(rate·b)), whose mean is 1/rate for any b
    (b=1 is Poisson; smaller b is burstier). rate=inf sends everything at once."""
    if not (rate > 0 and 0 < burstiness < math.inf):        # NaN fails both
        raise ValueError("request rate and burstiness must be > 0 (burstiness finite)")
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n).tolist()


def send_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """When each request is due, in seconds after the start; the first goes at once."""
    gaps = arrival_gaps(n, rate, burstiness, seed)
    return [0.0, *np.cumsum(gaps[:-1]).tolist()][:n]


async def run_requests(target: ApiTarget, requests: Sequence[BenchRequest], opts: SendOptions,
                       rate: float = math.inf, burstiness: float = 1.0,
                       max_concurrency: int | None = None, seed: int = 0,
                       on_done: Callable[[RequestResult], None] | None = None,
                       ) -> tuple[list[RequestResult], float]:
    """Send every request on schedule (capped at `max_concurrency` in flight); returns the
    results in input order and the run's duration (first send -> last completion)."""
    offsets = send_offsets(len(requests), rate, burstiness, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    # a connection per request: servers that close a kept-alive connection after so many
    # requests (llama-server) otherwise fail the request that raced the close
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, force_close=True)
    ended = [asyncio.Event() for _ in requests]

    async with aiohttp.ClientSession(connector=connector) as session:
        async def one(index: int, req: BenchRequest, due: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + due - time.perf_counter()))
            if req.after is not None:       # a later turn: after the one it continues
                await ended[req.after].wait()
            try:
                if limit is None:
                    result = await send_request(session, target, req, opts)
                else:
                    async with limit:
                        result = await send_request(session, target, req, opts)
            finally:
                ended[index].set()
            if on_done is not None:
                on_done(result)
            return result

        start = time.perf_counter()
        results = await asyncio.gather(*(one(i, r, t)
                                         for i, (r, t) in enumerate(zip(requests, offsets))))
        duration = time.perf_counter() - start
    return list(results), duration


# ---- metrics -----------------------------------------------------------------------------

def parse_goodput(specs: Sequence[str]) -> dict[str, float]:
    """['ttft:2000', 'tpot:200'] -> {'ttft': 2000.0, 'tpot': 200.0} (milliseconds)."""
    slos = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput SLO {spec!r}: use NAME:MS with NAME one of {SLO_METRICS}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {spec!r}: the limit must be a number of ms") from None
        if not slos[name] > 0:
            raise ValueError(f"goodput SLO {spec!r}: the limit must be > 0 ms")
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    values_ms = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2el}
    for name, limit_ms in slos.items():
        v = values_ms[name]
        if v is None or v * 1e3 > limit_ms:
            return False
    return True


def summarize(values_s: Sequence[float], prefix: str) -> dict[str, float]:
    """mean, median, std and p99 in ms (NaN when there is nothing to summarise)."""
    if not values_s:
        return {f"{s}_{prefix}_ms": math.nan for s in ("mean", "median", "std", "p99")}
    ms = np.asarray(values_s, dtype=float) * 1e3
    return {f"mean_{prefix}_ms": float(ms.mean()), f"median_{prefix}_ms": float(np.median(ms)),
            f"std_{prefix}_ms": float(ms.std()), f"p99_{prefix}_ms": float(np.percentile(ms, 99))}


def compute_metrics(results: Sequence[RequestResult], duration_s: float,
                    slos: dict[str, float] | None = None) -> dict:
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    metrics = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration_s,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
    }
    if slos:
        metrics["request_goodput"] = sum(meets_slos(r, slos) for r in ok) / duration_s
    metrics.update(summarize([r.ttft for r in ok if r.ttft is not None], "ttft"))
    metrics.update(summarize([r.tpot for r in ok if r.tpot is not None], "tpot"))
    metrics.update(summarize([g for r in ok for g in r.itl], "itl"))
    metrics.update(summarize([r.e2el for r in ok], "e2el"))
    return metrics


def error_summary(results: Sequence[RequestResult], limit: int = 5) -> list[tuple[str, int]]:
    """The most frequent failure messages with their counts, each message on one line (an
    HTTP error's body may be a proxy's HTML page)."""
    counts: dict[str, int] = {}
    for r in results:
        if not r.success:
            error = " ".join(r.error.split())
            counts[error] = counts.get(error, 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[1])[:limit]


def result_records(results: Sequence[RequestResult]) -> list[dict]:
    return [asdict(r) for r in results]
