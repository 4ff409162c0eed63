"""A raw SSE client for the resilience tests: every chunk's arrival time, the text, and an
explicit error event are kept apart (the openai client would raise or hide them).

    result = await stream_completion(session, base_url, body, deadline_s=60)
    result.text, result.error, result.finish_reason, result.longest_gap_s
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

from tests.served_fixture import API_KEY

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@dataclass
class StreamResult:
    status: int
    text: str = ""
    finish_reason: str | None = None
    error: dict | None = None
    done: bool = False                       # saw `data: [DONE]`
    chunk_times: list[float] = field(default_factory=list)
    headers: dict = field(default_factory=dict)
    body: dict | None = None                 # a non-streaming or error answer
    response_id: str | None = None           # the chunks' `id`: the gateway's request id

    @property
    def longest_gap_s(self) -> float:
        gaps = [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]
        return max(gaps, default=0.0)


async def stream_completion(session: aiohttp.ClientSession, base_url: str, body: dict,
                            deadline_s: float, on_chunk=None,
                            path: str = "/v1/completions") -> StreamResult:
    """POST a streaming completion (`path` "/v1/chat/completions": a chat one); fails the
    test if the stream is open past `deadline_s`."""
    return await asyncio.wait_for(_stream(session, base_url, body, on_chunk, path), deadline_s)


async def _stream(session, base_url, body, on_chunk, path) -> StreamResult:
    async with session.post(f"{base_url}{path}", json={**body, "stream": True},
                            headers=HEADERS) as r:
        result = StreamResult(r.status, headers=dict(r.headers))
        if r.status != 200:
            result.body = await r.json(content_type=None)
            return result
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                result.done = True
                continue
            _take(result, json.loads(data))
            if on_chunk is not None:
                on_chunk(result)
        return result


def _take(result: StreamResult, chunk: dict) -> None:
    if "error" in chunk:
        result.error = chunk["error"]
        return
    result.response_id = chunk.get("id", result.response_id)
    choice = chunk["choices"][0]
    text = choice["text"] if "text" in choice else choice["delta"].get("content")
    if text:
        result.text += text
        result.chunk_times.append(time.monotonic())
    result.finish_reason = choice["finish_reason"] or result.finish_reason


async def post_json(session: aiohttp.ClientSession, base_url: str, path: str,
                    body: dict) -> tuple[int, dict, dict]:
    async with session.post(f"{base_url}{path}", json=body, headers=HEADERS) as r:
        return r.status, await r.json(content_type=None), dict(r.headers)
