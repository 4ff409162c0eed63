"""The gateway end to end over a real redis-server, with a stand-in for the scheduler.

The gateway runs in-process on a free port (the same `serve()` production uses). Requests go
through Redis exactly as in production; what answers them is `FakeScheduler` below.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import dataclasses
import errno
import importlib.metadata
import json
import math
import os
import re
import socket
import threading
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken

from gateway.app import create_app, serve
from gateway.config import GatewayConfig
from gateway.state import STATE
from gateway.streams import RequestStream, TokenRouter
from shared.text_output import TextOutput
from shared.detokenizer import IncrementalDetokenizer
from shared.keys import Keys
from shared.plan import PromptLogprobs
from shared.protocol import (AbortMsg, FinishEvent, Heartbeat, PromptLogprobsEvent, RequestMsg,
                             TokenBatch, TokenEvent, encode, from_fields)
from shared.sampling import SamplingParams
from shared.tokenizer import Tokenizer
from tests.helpers_tiny_model import BOS_TOKEN_ID, CHAT_TEMPLATE, EOS_TOKEN_ID, tiny_tokenizer
from tests.redis_fixture import redis_server  # noqa: F401  (the fixture)

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "test-model"
PREFIX = "gwtest:"
MAX_MODEL_LEN = 128
REPLY = "Hello world, this is pacer. STOP here and more words."
EMOJI_REPLY = "Party 🎉 你好"
SPECIAL_ID = 1          # the default model's <|im_start|>: a special token, not its EOS
TOOL_REPLY = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


# ---- STAND-IN FOR THE REAL SCHEDULER ---------------------------------------------------------
# The scheduler service (scheduler_svc) and the workers do not exist yet. This fake plays both
# roles at the protocol level only: it reads the requests stream through the `schedulers`
# consumer group, and publishes one TokenBatch per "iteration" plus a FinishEvent on the
# request's reply channel. Its output is REPLY's tokens then EOS, cut at max_tokens. Markers in
# the prompt change its behaviour to exercise the gateway's event handling:
#   [slow]          one token every 50 ms, REPLY repeated, until max_tokens or an abort
#   [dup]           every token batch is published twice
#   [finish-first]  the FinishEvent overtakes the last token batch
#   [error]         the request fails with finish_reason "error" after two tokens
#   [error3]        ... after three (with [emoji]: in the middle of a character's bytes)
#   [invalid]       the scheduler rejects the request as one that can never be served
#   [deadline]      the scheduler ends the request at once as one whose deadline passed
#   [tool]          the output is TOOL_REPLY, a call in the hermes format, then EOS
#   [call-first]    the output is TOOL_REPLY's call alone (no words before it), then EOS
#   [special]       the output is "Hi", a special token (not EOS), " there", then EOS
#   [emoji]         the output is EMOJI_REPLY (tokens that split its characters), then EOS
#   [queued]        nothing: the request waits as if no scheduler had room for it
#   [on-NAME]       the first token's batch says engine instance NAME computed the prompt (by
#                   default the instance the request names: P/D's prefill instance chosen)

class FakeScheduler:
    def __init__(self, redis: aioredis.Redis, keys: Keys, tokenizer: Tokenizer) -> None:
        self.redis, self.keys, self.tok = redis, keys, tokenizer
        self.reply_ids = tokenizer.encode(REPLY)
        self.received: dict[str, RequestMsg] = {}
        self.finished: list[tuple[str, str]] = []       # (request id, reason) as they end
        self._tasks: set[asyncio.Task] = set()

    async def run(self) -> None:
        await self.redis.xgroup_create(self.keys.requests, self.keys.requests_group, id="0",
                                       mkstream=True)
        while True:
            reply = await self.redis.xreadgroup(self.keys.requests_group, "fake-0",
                                                {self.keys.requests: ">"}, count=16, block=100)
            for _stream, entries in reply or []:
                for entry_id, fields in entries:
                    msg = from_fields(fields)
                    self.received[msg.request_id] = msg
                    task = asyncio.create_task(self._serve_and_ack(entry_id, msg))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)

    async def _serve_and_ack(self, entry_id: bytes, msg: RequestMsg) -> None:
        """As a scheduler does, the entry is acked once its request ended (a queued one stays
        pending: acked with no answer, the gateway ends it as dropped)."""
        if await self._serve(msg):
            await self.redis.xack(self.keys.requests, self.keys.requests_group, entry_id)

    async def _serve(self, msg: RequestMsg) -> bool:
        """False for a request left queued."""
        prompt = self.tok.decode(msg.prompt_token_ids, skip_special_tokens=False)
        if "[queued]" in prompt:
            return False
        slow = "[slow]" in prompt
        output = self._output(msg, repeat=slow)
        ends = (self.tok.eos_token_id, *msg.sampling.stop_token_ids)
        sent, reason = 0, ("stop" if output[-1] in ends else "length")
        if msg.sampling.prompt_logprobs is not None:     # each prompt token after the first
            n, k = len(msg.prompt_token_ids) - 1, msg.sampling.prompt_logprobs
            await self.redis.publish(msg.reply_to, encode(TokenBatch([], [PromptLogprobsEvent(
                msg.request_id, PromptLogprobs(1, [-0.25] * n, [2] * n,
                                               [[(7 + j, -1.0 - j) for j in range(k)]] * n))])))
        for i, token_id in enumerate(output):
            if ("[error]" in prompt and i == 2) or ("[error3]" in prompt and i == 3) \
                    or "[invalid]" in prompt or "[deadline]" in prompt:
                reason = "error"
                break
            if slow:
                await asyncio.sleep(0.05)
                if await self._aborted(msg.request_id):
                    reason = "abort"
                    break
            finish_first = "[finish-first]" in prompt and i == len(output) - 1
            if finish_first:
                await self._finish(msg, reason, len(output))
            first = {msg.request_id: len(msg.prompt_token_ids) // 2} if i == 0 else {}
            on = re.search(r"\[on-(\w+)\]", prompt)
            batch = encode(TokenBatch([self._event(msg, i, token_id)], cached=first,
                                      instance=on[1] if on else msg.instance))
            for _ in range(2 if "[dup]" in prompt else 1):
                await self.redis.publish(msg.reply_to, batch)
            sent += 1
            if finish_first:
                return True
        await self._finish(msg, reason, sent)
        return True

    def _output(self, msg: RequestMsg, repeat: bool) -> list[int]:
        sp = msg.sampling
        prompt = self.tok.decode(msg.prompt_token_ids, skip_special_tokens=False)
        if "[tool]" in prompt or "[call-first]" in prompt:
            reply = TOOL_REPLY if "[tool]" in prompt else TOOL_REPLY.removeprefix("Checking.")
            return (self.tok.encode(reply) + [self.tok.eos_token_id])[:sp.max_tokens]
        if "[emoji]" in prompt:
            return (self.tok.encode(EMOJI_REPLY) + [self.tok.eos_token_id])[:sp.max_tokens]
        if "[special]" in prompt:
            return (self.tok.encode("Hi") + [SPECIAL_ID] + self.tok.encode(" there") +
                    [self.tok.eos_token_id])[:sp.max_tokens]
        if repeat or sp.ignore_eos:
            ids = (self.reply_ids * (sp.max_tokens // len(self.reply_ids) + 1))[:sp.max_tokens]
        else:
            ids = (self.reply_ids + [self.tok.eos_token_id])[:sp.max_tokens]
        stops = [i for i, t in enumerate(ids) if t in sp.stop_token_ids]
        return ids[:stops[0] + 1] if stops else ids

    def _event(self, msg: RequestMsg, index: int, token_id: int) -> TokenEvent:
        n = msg.sampling.logprobs
        if n is None:
            return TokenEvent(msg.request_id, index, token_id)
        top = [(token_id + k, -0.5 - k) for k in range(n)]
        return TokenEvent(msg.request_id, index, token_id, -0.5, top)

    async def _finish(self, msg: RequestMsg, reason: str, num_output_tokens: int) -> None:
        prompt = self.tok.decode(msg.prompt_token_ids, skip_special_tokens=False)
        invalid, late = "[invalid]" in prompt, "[deadline]" in prompt
        self.finished.append((msg.request_id, reason))
        error = "needs more KV blocks than the pool has" if invalid else \
            "the request reached its deadline" if late else "the fake worker failed"
        event = FinishEvent(msg.request_id, reason, len(msg.prompt_token_ids), num_output_tokens,
                            error if reason == "error" else None,
                            "invalid_request_error" if invalid else
                            "timeout_error" if late else "server_error",
                            num_cached_tokens=len(msg.prompt_token_ids) // 2)
        await self.redis.publish(msg.reply_to, encode(event))

    async def _aborted(self, request_id: str) -> bool:
        return request_id in await aborts(self.redis, self.keys)


async def aborts(redis: aioredis.Redis, keys: Keys) -> dict[str, str]:
    """request id -> reason of every AbortMsg on the aborts stream."""
    entries = await redis.xrange(keys.aborts)
    msgs = [from_fields(fields) for _id, fields in entries]
    return {m.request_id: m.reason for m in msgs if isinstance(m, AbortMsg)}


async def wait_for_abort(h: "Harness", request_id: str) -> str:
    for _ in range(200):
        found = await aborts(h.redis, h.keys)
        if request_id in found:
            return found[request_id]
        await asyncio.sleep(0.05)
    raise AssertionError(f"no AbortMsg for {request_id} on {h.keys.aborts}")


# ---- fixtures --------------------------------------------------------------------------------

@dataclass
class Harness:
    url: str
    session: aiohttp.ClientSession
    redis: aioredis.Redis
    keys: Keys
    fake: FakeScheduler
    tok: Tokenizer
    config: GatewayConfig
    state: object = None           # the gateway's GatewayState

    async def post(self, path: str, body: dict) -> tuple[int, dict]:
        async with self.session.post(self.url + path, json=body) as r:
            return r.status, await r.json()

    async def sse(self, path: str, body: dict) -> list[str]:
        """The `data:` payloads of a stream, in order."""
        async with self.session.post(self.url + path, json={**body, "stream": True}) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            raw = (await r.read()).decode()
        events = raw.split("\n\n")
        assert events[-1] == ""      # every event ends with a blank line
        assert all(e.startswith("data: ") for e in events[:-1])
        return [e[len("data: "):] for e in events[:-1]]


@pytest.fixture(scope="module")
def config(redis_server: str) -> GatewayConfig:
    return GatewayConfig(port=0, redis_url=redis_server, key_prefix=PREFIX, tp=2,
                         served_model_name=MODEL, max_model_len=MAX_MODEL_LEN,
                         max_body_bytes=64 * 1024, tool_call_parser="hermes")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def h(config: GatewayConfig, redis_server: str):
    app = create_app(config)
    # the fake scheduler's client outlasts the pauses tests make (redis-py's default socket
    # timeout is shorter: its reads timed out, and the fake was gone for the tests after)
    redis = aioredis.Redis.from_url(redis_server, socket_timeout=30)
    keys = Keys(PREFIX)
    fake = FakeScheduler(redis, keys, app[STATE].tokenizer)
    fake_task = asyncio.create_task(fake.run())
    async with serve(config, app) as url, aiohttp.ClientSession() as session:
        yield Harness(url, session, redis, keys, fake, app[STATE].tokenizer, config, app[STATE])
    fake_task.cancel()
    await asyncio.gather(fake_task, return_exceptions=True)
    await redis.aclose()


def completion(**kw) -> dict:
    return {"model": MODEL, "prompt": "Say hello.", **kw}


def chat(text: str = "Say hello.", **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **kw}


def reply_text(tok: Tokenizer, n: int) -> str:
    return tok.decode(tok.encode(REPLY)[:n])


# ---- shapes ----------------------------------------------------------------------------------

async def test_models_lists_the_served_model(h: Harness) -> None:
    async with h.session.get(h.url + "/v1/models") as r:
        body = await r.json()
    assert r.status == 200
    assert [m["id"] for m in body["data"]] == [MODEL]
    assert body["data"][0]["max_model_len"] == MAX_MODEL_LEN
    async with h.session.get(h.url + f"/v1/models/{MODEL}") as r:
        assert r.status == 200 and (await r.json())["id"] == MODEL
    async with h.session.get(h.url + "/v1/models/another") as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
    async with h.session.get(h.url + "/version") as r:
        assert r.status == 200 and (await r.json())["version"] == importlib.metadata.version(
            "pacer")


async def test_a_models_created_time_is_the_same_on_every_call(h: Harness) -> None:
    """The gateway's start, not the time of the call (a client caching the list saw the
    model change every second)."""
    async with h.session.get(h.url + "/v1/models") as r:
        [first] = (await r.json())["data"]
    await asyncio.sleep(1.0)        # past the next whole second
    async with h.session.get(h.url + "/v1/models") as r:
        [again] = (await r.json())["data"]
    async with h.session.get(h.url + f"/v1/models/{MODEL}") as r:
        one = await r.json()
    assert first["created"] == again["created"] == one["created"] <= time.time()


async def test_completion_shape_usage_and_the_request_message(h: Harness) -> None:
    status, body = await h.post("/v1/completions", completion(max_tokens=5, temperature=0.5,
                                                              top_p=0.9, top_k=7, seed=3))
    assert status == 200
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == MODEL
    [choice] = body["choices"]
    assert choice == {"index": 0, "text": reply_text(h.tok, 5), "logprobs": None,
                      "finish_reason": "length", "stop_reason": None}
    prompt_ids = h.tok.encode("Say hello.", add_special_tokens=True)
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 5,
                             "total_tokens": len(prompt_ids) + 5,
                             "prompt_tokens_details": {"cached_tokens": len(prompt_ids) // 2}}
    msg = h.fake.received[body["id"]]
    assert msg.prompt_token_ids == prompt_ids
    assert msg.reply_to == h.keys.tokens(h.config.gateway_id)
    assert msg.gateway_id == h.config.gateway_id
    sp = msg.sampling
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed) == (5, 0.5, 0.9, 7, 3)


async def test_a_submit_repeated_after_a_lost_reply_enqueues_the_request_once(
        h: Harness) -> None:
    # a connection that breaks after Redis ran the submit and before its reply came is
    # retried: the second try must not add a second entry (two schedulers reading the stream
    # would each serve one); another request id is a new entry
    before = await h.redis.xlen(h.keys.requests)
    for rid in ("dup-1", "dup-1", "dup-2"):
        await h.state.upstream.submit(rid, [1, 2, 3], SamplingParams(max_tokens=1), 0.0)
    entries = await h.redis.xrange(h.keys.requests)
    ids = [m.request_id for _, f in entries[before:] if isinstance(m := from_fields(f), RequestMsg)]
    assert ids == ["dup-1", "dup-2"]
    assert 0 < await h.redis.ttl(h.keys.submitted("dup-1")) <= 60


async def test_completion_defaults_to_16_tokens_and_accepts_token_ids(h: Harness) -> None:
    status, body = await h.post("/v1/completions", completion(prompt=[9, 10, 11], ignore_eos=True))
    assert status == 200
    msg = h.fake.received[body["id"]]
    assert msg.prompt_token_ids == [9, 10, 11]
    assert msg.sampling.max_tokens == 16 and msg.sampling.ignore_eos
    assert body["usage"]["completion_tokens"] == 16


async def test_chat_runs_to_eos_and_defaults_max_tokens_to_the_context(h: Harness) -> None:
    status, body = await h.post("/v1/chat/completions", chat())
    assert status == 200
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": REPLY}
    assert choice["finish_reason"] == "stop"
    msg = h.fake.received[body["id"]]
    assert msg.prompt_token_ids == h.tok.encode_chat([{"role": "user", "content": "Say hello."}])
    assert msg.sampling.max_tokens == MAX_MODEL_LEN - len(msg.prompt_token_ids)
    assert body["usage"]["completion_tokens"] == len(h.tok.encode(REPLY)) + 1   # + EOS


async def test_chat_accepts_every_openai_role(h: Harness) -> None:
    messages = [{"role": r, "content": "x"} for r in ("developer", "system", "user", "assistant",
                                                       "tool", "user")]
    status, body = await h.post("/v1/chat/completions", {**chat(max_tokens=2), "messages": messages})
    assert status == 200, body
    # "developer" is OpenAI's newer "system": the template is shown the role it knows
    shown = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    assert h.fake.received[body["id"]].prompt_token_ids == h.tok.encode_chat(shown)
    assert h.tok.encode_chat(shown) != h.tok.encode_chat(messages)


async def test_an_assistant_refusal_part_is_replayed_as_its_words(h: Harness) -> None:
    refused = {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}
    messages = [{"role": "user", "content": "x"}, refused, {"role": "user", "content": "y"}]
    status, body = await h.post("/v1/chat/completions", {**chat(max_tokens=2), "messages": messages})
    assert status == 200, body
    assert h.fake.received[body["id"]].prompt_token_ids == h.tok.encode_chat(
        [messages[0], {"role": "assistant", "content": "I can't."}, messages[2]])


async def test_chat_logprobs_bytes_join_into_the_text(h: Harness) -> None:
    """OpenAI's `bytes`: a token that holds part of a character carries those bytes (its text
    alone is a replacement character), so the bytes join into the answer's UTF-8."""
    status, body = await h.post("/v1/chat/completions", chat("[emoji]", logprobs=True,
                                                             top_logprobs=1))
    assert status == 200, body
    content = body["choices"][0]["logprobs"]["content"]
    assert any("\ufffd" in e["token"] for e in content)
    assert content[-1]["token"] == h.tok.decode([h.tok.eos_token_id], skip_special_tokens=False)
    assert bytes(b for e in content[:-1] for b in e["bytes"]) == EMOJI_REPLY.encode("utf-8")
    assert body["choices"][0]["message"]["content"] == EMOJI_REPLY


async def test_chat_continues_the_final_message_when_asked(h: Harness) -> None:
    """vLLM's continue_final_message (with add_generation_prompt false): the prompt ends with
    the final message's content, no end of turn after it, so the answer goes on with it."""
    messages = [{"role": "user", "content": "Say hello."},
                {"role": "assistant", "content": "The answer is"}]
    body = {**chat(max_tokens=2), "messages": messages}
    status, answer = await h.post("/v1/chat/completions", {
        **body, "continue_final_message": True, "add_generation_prompt": False})
    assert status == 200, answer
    prompt = h.tok.decode(h.fake.received[answer["id"]].prompt_token_ids, skip_special_tokens=False)
    whole = h.tok.apply_chat_template(messages, add_generation_prompt=False)
    assert prompt.endswith("The answer is") and whole.startswith(prompt) and len(whole) > len(prompt)
    status, answer = await h.post("/v1/chat/completions", {**body, "add_generation_prompt": False})
    assert status == 200, answer           # no new turn opened for the answer
    assert h.fake.received[answer["id"]].prompt_token_ids == h.tok.encode(whole)
    status, tokenized = await h.post("/tokenize", {"messages": messages, "add_generation_prompt":
                                                   False, "continue_final_message": True})
    assert status == 200 and h.tok.decode(tokenized["tokens"], skip_special_tokens=False) == prompt
    for path in ("/v1/chat/completions", "/tokenize"):   # both true: a 400 that says why
        status, error = await h.post(path, {**body, "continue_final_message": True})
        assert status == 400 and error["error"]["param"] == "continue_final_message", error
    # content the template also writes around it ("\n", ">", "end"): cut where it is written
    for final in ("\n", ">", "end"):
        ask = [messages[0], {"role": "assistant", "content": final}]
        status, tokenized = await h.post("/tokenize", {"messages": ask, "add_generation_prompt":
                                                       False, "continue_final_message": True})
        head = h.tok.apply_chat_template(messages[:1], add_generation_prompt=True)
        assert h.tok.decode(tokenized["tokens"], skip_special_tokens=False) == head + final


async def test_tokenize_returns_token_strings_when_asked(h: Harness) -> None:
    status, got = await h.post("/tokenize", {"prompt": "hi there", "return_token_strs": True})
    assert status == 200 and got["token_strs"] == [h.tok.id_to_token(t) for t in got["tokens"]]
    status, got = await h.post("/tokenize", {"prompt": "hi there"})
    assert "token_strs" not in got


async def test_text_parts_are_joined_as_vllm_joins_them(h: Harness) -> None:
    """A message's text parts with a newline between (as vLLM, and as `pacer generate`), on
    chat and on the Responses API."""
    parts = [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]
    want = h.tok.encode_chat([{"role": "user", "content": "A\nB"}])
    status, tokenized = await h.post("/tokenize", {"messages": [{"role": "user", "content": parts}]})
    assert status == 200 and tokenized["tokens"] == want
    status, _ = await h.post("/v1/responses", {"model": MODEL, "max_output_tokens": 2, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": t} for t in "AB"]}]})
    assert status == 200 and list(h.fake.received.values())[-1].prompt_token_ids == want
    status, error = await h.post("/v1/chat/completions", chat(max_tokens=2) | {"messages": [
        {"role": "user", "content": [{"type": "text", "text": 5}]}]})
    assert status == 400 and error["error"]["param"] == "messages[0].content", error
    assert error["error"]["message"] == "messages[0].content[0].text must be a string", error


@pytest.mark.parametrize("path,item,param,message", [
    ("/v1/chat/completions", {"role": "user", "content": [{"type": "image_url"}]},
     "messages[0].content", 'messages[0].content[0] must be a text part, {"type": "text", '
     '"text": "..."} (the types served: text), not \'image_url\''),
    ("/v1/responses", {"role": "user", "content": [{"type": "input_image"}]},
     "input[0].content", 'input[0].content[0] must be a text part, {"type": "input_text", '
     '"text": "..."} (the types served: input_text, output_text, text), not \'input_image\''),
    ("/v1/responses", {"type": "function_call_output", "call_id": "c", "output": [5]},
     "input[1].output", 'input[1].output[0] must be a text part, {"type": "input_text", '
     '"text": "..."} (the types served: input_text, output_text, text), not a JSON integer'),
])
async def test_a_part_that_is_not_text_is_refused_naming_the_types_served(
        h: Harness, path: str, item: dict, param: str, message: str) -> None:
    """Each endpoint names its own text part's type: /v1/responses said {"type": "text"},
    a type it takes but not the one its clients send (input_text)."""
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    items = [item] if item.get("role") else [call, item]
    body = chat() | {"messages": items} if path == "/v1/chat/completions" else \
        {"model": MODEL, "input": items}
    status, error = await h.post(path, body)
    assert status == 400 and error["error"]["message"] == message, error
    assert error["error"]["param"] == param, error


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_skip_special_tokens_false_keeps_them_in_the_text(h: Harness, path: str) -> None:
    special = h.tok.decode([SPECIAL_ID], skip_special_tokens=False)
    body = completion(prompt="[special]") if path == "/v1/completions" else chat("[special]")

    async def text(**kw) -> str:
        status, answer = await h.post(path, {**body, **kw})
        assert status == 200, answer
        choice = answer["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]

    assert await text() == "Hi there"
    assert await text(skip_special_tokens=False) == f"Hi{special} there"


async def test_chat_sse_shape_with_usage_chunk(h: Harness) -> None:
    data = await h.sse("/v1/chat/completions",
                       chat(max_tokens=4, stream_options={"include_usage": True}))
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finish = chunks[-2]["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    assert all(c["usage"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text == reply_text(h.tok, 4)


async def test_completion_sse_without_usage(h: Harness) -> None:
    data = await h.sse("/v1/completions", completion(max_tokens=6))
    chunks = [json.loads(d) for d in data[:-1]]
    assert data[-1] == "[DONE]"
    assert all("usage" not in c and c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == reply_text(h.tok, 6)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_openai_client_streams_a_chat(h: Harness) -> None:
    async with openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hello."}], stream=True,
            stream_options={"include_usage": True})
        chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == REPLY
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(h.tok.encode(REPLY)) + 1


async def test_openai_client_streams_a_text_completion(h: Harness) -> None:
    async with openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0) as client:
        stream = await client.completions.create(model=MODEL, prompt="Say hello.", max_tokens=30,
                                                 stream=True)
        chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == REPLY
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_concurrent_requests_each_get_their_own_tokens(h: Harness) -> None:
    lengths = [1, 2, 3, 5, 8, 13]
    results = await asyncio.gather(*(h.post("/v1/completions", completion(max_tokens=n))
                                     for n in lengths))
    assert [body["choices"][0]["text"] for _status, body in results] == \
        [reply_text(h.tok, n) for n in lengths]


# ---- stop strings, logprobs, event order -----------------------------------------------------

async def test_stop_string_cuts_the_text_and_aborts_upstream(h: Harness) -> None:
    status, body = await h.post("/v1/completions", completion(max_tokens=40, stop=["STOP", "zzz"]))
    assert status == 200
    assert body["choices"][0]["text"] == "Hello world, this is pacer. "
    assert body["choices"][0]["finish_reason"] == "stop"
    assert await wait_for_abort(h, body["id"]) == "stop string"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_stop_reason_names_the_stop_string_or_token_as_vllm_does(h: Harness, path: str,
                                                                       stream: bool) -> None:
    third = h.tok.encode(REPLY)[2]
    base = completion(max_tokens=40) if path == "/v1/completions" else chat(max_tokens=40)
    for extra, reason, stop_reason in (
            ({"stop": ["zzz", "STOP"]}, "stop", "STOP"),
            ({"stop_token_ids": [third]}, "stop", third),
            ({}, "stop", None),                        # EOS
            ({"max_tokens": 2}, "length", None)):
        if stream:
            chunks = [json.loads(d) for d in (await h.sse(path, {**base, **extra}))[:-1]]
            last = chunks[-1]["choices"][0]
            assert all(c["choices"][0]["stop_reason"] is None for c in chunks[:-1]), chunks
        else:
            status, body = await h.post(path, {**base, **extra})
            assert status == 200, body
            last = body["choices"][0]
        assert (last["finish_reason"], last["stop_reason"]) == (reason, stop_reason), extra


async def test_streamed_text_never_shows_the_start_of_a_stop_string(h: Harness) -> None:
    # "STOP" arrives as " ST" + "OP": " ST" must be held back until "OP" proves it a stop
    data = await h.sse("/v1/chat/completions", chat(stop="STOP"))
    chunks = [json.loads(d) for d in data[:-1]]
    pieces = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    assert not any("ST" in p for p in pieces)
    assert "".join(pieces) == "Hello world, this is pacer. "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_chat_logprobs_shape(h: Harness) -> None:
    status, body = await h.post("/v1/chat/completions",
                                chat(max_tokens=3, logprobs=True, top_logprobs=2))
    assert status == 200
    content = body["choices"][0]["logprobs"]["content"]
    ids = h.tok.encode(REPLY)[:3]
    assert [c["token"] for c in content] == [h.tok.decode([t]) for t in ids]
    assert all(c["logprob"] == -0.5 and c["bytes"] == list(c["token"].encode()) for c in content)
    assert [len(c["top_logprobs"]) for c in content] == [2, 2, 2]
    assert content[0]["top_logprobs"][1] == {"token": h.tok.decode([ids[0] + 1]), "logprob": -1.5,
                                             "bytes": list(h.tok.decode([ids[0] + 1]).encode())}


async def test_return_tokens_as_token_ids_names_each_token_by_its_id(h: Harness) -> None:
    """vLLM's return_tokens_as_token_ids: logprobs name each token (chosen, top, and the
    echoed prompt's) "token_id:N" instead of its text, which tells apart tokens whose texts
    are alike (every special token's is ""); the text itself and the bytes stay the
    token's. It used to be refused as not served."""
    ids = h.tok.encode(REPLY)[:3]
    status, body = await h.post("/v1/chat/completions", chat(
        max_tokens=3, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True))
    assert status == 200, body
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in ids]
    assert [c["bytes"] for c in content] == [list(h.tok.decode([t]).encode()) for t in ids]
    assert content[0]["top_logprobs"][1]["token"] == f"token_id:{ids[0] + 1}"
    assert body["choices"][0]["message"]["content"] == h.tok.decode(ids)
    status, body = await h.post("/v1/completions", completion(
        max_tokens=3, logprobs=1, echo=True, return_tokens_as_token_ids=True))
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    prompt_ids = h.fake.received[body["id"]].prompt_token_ids
    assert lp["tokens"] == [f"token_id:{t}" for t in [*prompt_ids, *ids]]
    assert lp["top_logprobs"][-1] == {f"token_id:{ids[-1]}": -0.5}


async def test_completion_logprobs_shape(h: Harness) -> None:
    status, body = await h.post("/v1/completions", completion(max_tokens=3, logprobs=1))
    lp = body["choices"][0]["logprobs"]
    ids = h.tok.encode(REPLY)[:3]
    tokens = [h.tok.decode([t]) for t in ids]
    assert lp["tokens"] == tokens
    assert lp["token_logprobs"] == [-0.5] * 3
    assert lp["top_logprobs"] == [{t: -0.5} for t in tokens]
    assert lp["text_offset"] == [0, len(tokens[0]), len(tokens[0]) + len(tokens[1])]


# ---- several choices: n and a batch of prompts ------------------------------------------------

async def test_n_and_a_prompt_batch_are_choices_in_openais_order(h: Harness) -> None:
    """Choice i * n + j is prompt i's j-th sample, a request of its own upstream whose seed
    is the request's + j; each choice's logprobs count text offsets from its own start;
    usage counts each prompt once and every choice's tokens."""
    prompts = ["Say hello.", [5, 6, 7]]
    status, body = await h.post("/v1/completions", completion(
        prompt=prompts, n=2, seed=7, max_tokens=3, logprobs=0))
    assert status == 200, body
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert all(c["text"] == reply_text(h.tok, 3) for c in choices)
    assert all(c["logprobs"]["text_offset"][0] == 0 for c in choices)
    sent = {i: h.fake.received[f"{body['id']}-{i}"] for i in range(4)}
    assert [sent[i].sampling.seed for i in range(4)] == [7, 8, 7, 8]
    # int64's last seed (vLLM takes it; it was refused): the next choice's wraps to int64's first
    status, top = await h.post("/v1/completions", completion(
        prompt="Say hello.", n=2, seed=2**63 - 1, max_tokens=3))
    assert status == 200, top
    assert [h.fake.received[f"{top['id']}-{j}"].sampling.seed for j in range(2)] == \
        [2**63 - 1, -2**63]
    first = h.tok.encode("Say hello.", add_special_tokens=True)
    assert [sent[i].prompt_token_ids for i in range(4)] == [first, first, [5, 6, 7], [5, 6, 7]]
    assert body["usage"] == {"prompt_tokens": len(first) + 3, "completion_tokens": 12,
                             "total_tokens": len(first) + 15,    # each prompt once: its cache
                             "prompt_tokens_details": {"cached_tokens": len(first) // 2 + 1}}


async def test_a_streamed_chat_with_n_sends_each_choice_whole(h: Harness) -> None:
    data = await h.sse("/v1/chat/completions", chat(n=3, max_tokens=4,
                                                    stream_options={"include_usage": True}))
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    usage = chunks.pop()
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    by_index: dict[int, list[dict]] = {}
    for c in chunks:
        (choice,) = c["choices"]
        by_index.setdefault(choice["index"], []).append(choice)
    assert sorted(by_index) == [0, 1, 2]
    for choices in by_index.values():
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in choices) == reply_text(h.tok, 4)
        assert [c["finish_reason"] for c in choices][-1] == "length"
        assert all(c["finish_reason"] is None for c in choices[:-1])
    assert len({c["id"] for c in chunks}) == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_a_failed_choice_ends_the_answer_and_aborts_the_others(h: Harness,
                                                                    stream: bool) -> None:
    body = completion(prompt=["[error]", "[slow]"], max_tokens=100)
    if stream:
        data = await h.sse("/v1/completions", body)
        assert "the fake worker failed" in json.loads(data[-2])["error"]["message"]
        assert data[-1] == "[DONE]"
    else:
        status, answer = await h.post("/v1/completions", body)
        assert status == 500 and "the fake worker failed" in answer["error"]["message"]
    # the slow one went upstream last (choices start one by one, in order)
    slow = [rid for rid, msg in h.fake.received.items()
            if h.tok.decode(msg.prompt_token_ids).endswith("[slow]")][-1]
    assert slow.endswith("-1")
    await wait_for_abort(h, slow)


async def test_a_choice_that_meets_its_stop_string_is_aborted_before_the_others_end(
        h: Harness) -> None:
    """Choice 0 meets "STOP" in its eighth token or so; choice 1 (no "STOP" in its text)
    runs on for ~1.5 s. Choice 0 must not go on decoding, for nobody, until then."""
    body = completion(prompt=["[slow] a", "[slow][tool] b"], max_tokens=60, stop=["STOP"])
    status, answer = await h.post("/v1/completions", body)
    assert status == 200, answer
    assert [c["finish_reason"] for c in answer["choices"]] == ["stop", "stop"]
    first, second = ([rid for rid, msg in h.fake.received.items()
                      if h.tok.decode(msg.prompt_token_ids).endswith(prompt)][-1]
                     for prompt in body["prompt"])
    ends = [rid for rid, _reason in h.fake.finished]
    assert ends.index(first) < ends.index(second), h.fake.finished
    assert dict(h.fake.finished)[first] == "abort"


# ---- echo --------------------------------------------------------------------------------------

async def _echo_answer(h: Harness, body: dict, stream: bool) -> tuple[str, dict, dict | None]:
    """A completion's text and logprobs, streamed (joined) or not; the usage when not."""
    if not stream:
        status, answer = await h.post("/v1/completions", body)
        assert status == 200, answer
        return answer["choices"][0]["text"], answer["choices"][0]["logprobs"], answer["usage"]
    chunks = [json.loads(d)["choices"][0] for d in (await h.sse("/v1/completions", body))[:-1]]
    assert chunks[0]["text"] == body["prompt"]              # the first chunk is the prompt
    lp = {key: [v for c in chunks if c["logprobs"] for v in c["logprobs"][key]]
          for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    return "".join(c["text"] for c in chunks), lp, None


@pytest.mark.parametrize("stream", [False, True])
async def test_echo_puts_the_prompt_and_its_logprobs_first(h: Harness, stream: bool) -> None:
    """OpenAI's echo: the text starts with the prompt; with logprobs the tokens do too, the
    first with none (what evaluation harnesses read a prompt's score from)."""
    prompt = "Say hello."
    ids = h.tok.encode(prompt, add_special_tokens=True)
    body = completion(prompt=prompt, echo=True, logprobs=1, max_tokens=2)
    text, lp, usage = await _echo_answer(h, body, stream)
    if usage is not None:
        assert usage["prompt_tokens"] == len(ids)
    assert text == prompt + reply_text(h.tok, 2)
    assert lp["tokens"][:len(ids)] == [h.tok.decode([t], skip_special_tokens=False) for t in ids]
    assert lp["token_logprobs"][:len(ids)] == [None] + [-0.25] * (len(ids) - 1)
    # the fake's top prompt token is id 7; the prompt's own token stands beside it, as OpenAI's
    # legacy shape holds the chosen token too (up to logprobs + 1 entries)
    assert ids[1] != 7
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {
        h.tok.decode([7], skip_special_tokens=False): -1.0,
        h.tok.decode([ids[1]], skip_special_tokens=False): -0.25}
    assert len(lp["tokens"]) == len(ids) + 2
    assert lp["text_offset"][len(ids)] == len(prompt)        # the output's text follows it


async def test_a_long_echo_streams_its_logprobs_in_pieces(h: Harness) -> None:
    """Echo's logprobs were one chunk: a prompt of 32k tokens with 20 top ones each took
    ~0.4 s to serialize (json.dumps holds the GIL, a thread would not help), every stream
    stalled meanwhile. They go a piece at a time, each piece with the text its tokens begin;
    joined, the stream is the whole answer."""
    from gateway.generation import ECHO_PIECE_ITEMS
    prompt = " ".join(f"w{i}" for i in range(40))
    ids = h.tok.encode(prompt, add_special_tokens=True)
    most = ECHO_PIECE_ITEMS // (2 + 20)         # tokens a piece, with 20 top ones each
    assert len(ids) > 2 * most and len(ids) + 2 <= MAX_MODEL_LEN
    body = completion(prompt=prompt, echo=True, logprobs=20, max_tokens=2)
    text, lp, _ = await _echo_answer(h, body, stream=False)
    chunks = [json.loads(d)["choices"][0] for d in (await h.sse("/v1/completions", body))[:-1]]
    echo, count = [], 0             # the chunks before the output's: the prompt's tokens
    while count < len(ids):
        echo.append(chunks[len(echo)])
        count += len(echo[-1]["logprobs"]["tokens"])
    assert count == len(ids) and len(echo) >= 3 and all(len(c["logprobs"]["tokens"]) <= most for c in echo)
    assert "".join(c["text"] for c in echo) == prompt
    for c in echo:                  # each piece's text is where its tokens stand
        assert prompt.startswith(c["text"], c["logprobs"]["text_offset"][0])
    streamed = {key: [v for c in chunks if c["logprobs"] for v in c["logprobs"][key]]
                for key in lp}
    assert "".join(c["text"] for c in chunks) == text and streamed == lp


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_vllms_prompt_logprobs_field(h: Harness, path: str) -> None:
    """vLLM's shape: None for the first token, then {token id: {logprob, rank,
    decoded_token}} of the token and the top ones; a chat's at the top, a completion's in
    each choice; refused with a stream."""
    chat_path = path.endswith("chat/completions")
    body = (chat if chat_path else completion)(max_tokens=2, prompt_logprobs=1, n=2)
    status, answer = await h.post(path, body)
    assert status == 200, answer
    sent = h.fake.received[f"{answer['id']}-0"]
    ids = sent.prompt_token_ids
    assert sent.sampling.prompt_logprobs == 1
    lists = [answer["prompt_logprobs"]] if chat_path else \
        [c["prompt_logprobs"] for c in answer["choices"]]
    for got in lists:
        assert len(got) == len(ids) and got[0] is None
        text = h.tok.decode([ids[1]], skip_special_tokens=False)
        assert got[1] == {str(ids[1]): {"logprob": -0.25, "rank": 2, "decoded_token": text},
                          "7": {"logprob": -1.0, "rank": 1,
                                "decoded_token": h.tok.decode([7], skip_special_tokens=False)}}
    status, answer = await h.post(path, {**body, "stream": True})
    assert status == 400 and answer["error"]["param"] == "prompt_logprobs"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("skip", [True, False])
async def test_echo_offsets_point_into_a_text_prompt_with_special_tokens(
        h: Harness, stream: bool, skip: bool) -> None:
    """A text prompt is echoed as sent, special tokens written in it included, whatever
    skip_special_tokens says (that is the output's): each token's text_offset is where its
    text stands in that echo."""
    prompt = "<|im_start|>user\nSay hello.<|im_end|>"
    body = completion(prompt=prompt, echo=True, logprobs=0, max_tokens=2,
                      skip_special_tokens=skip)
    text, lp, _ = await _echo_answer(h, body, stream)
    assert text.startswith(prompt)
    for token, at in zip(lp["tokens"], lp["text_offset"]):
        assert text.startswith(token, at), (text, token, at)


async def test_echo_without_logprobs_asks_for_none_and_chat_refuses_it(h: Harness) -> None:
    status, answer = await h.post("/v1/completions", completion(prompt=[5, 6], echo=True,
                                                                max_tokens=2))
    assert status == 200 and answer["choices"][0]["text"] == \
        h.tok.decode([5, 6]) + reply_text(h.tok, 2)
    assert h.fake.received[answer["id"]].sampling.prompt_logprobs is None
    status, answer = await h.post("/v1/chat/completions", chat(echo=True))
    assert status == 400 and answer["error"]["param"] == "echo"


# ---- the tokenizer's routes (vLLM's) ----------------------------------------------------------

async def test_tokenize_and_detokenize_are_the_generation_paths_own(h: Harness) -> None:
    status, body = await h.post("/tokenize", {"model": MODEL, "prompt": "Say hello."})
    assert status == 200, body
    assert body["tokens"] == h.tok.encode("Say hello.", add_special_tokens=True)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    messages = [{"role": "user", "content": "hi"}]
    status, chat_ids = await h.post("/tokenize", {"messages": messages})
    assert status == 200 and chat_ids["tokens"] == h.tok.encode_chat(messages)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    status, with_tools = await h.post("/tokenize", {"messages": messages, "tools": tools})
    assert status == 200 and with_tools["tokens"] == h.tok.encode_chat(messages, tools)
    status, text = await h.post("/detokenize", {"tokens": chat_ids["tokens"]})
    assert status == 200 and text["prompt"] == h.tok.apply_chat_template(messages)
    for path, bad, param in (("/tokenize", {"prompt": "x", "messages": messages}, None),
                             ("/tokenize", {"prompt": 5}, "prompt"),
                             ("/tokenize", {"messages": messages, "tools": [{}]}, "tools"),
                             ("/detokenize", {"tokens": [10**9]}, "tokens"),
                             ("/detokenize", {"tokens": "abc"}, "tokens")):
        status, answer = await h.post(path, bad)
        assert status == 400 and answer["error"]["param"] == param, (path, bad, answer)
    status, answer = await h.post("/tokenize", {"model": "gpt-4", "prompt": "x"})
    assert status == 404


class LoopProbe:
    """Holds the first call of a method (a tokenizer's, a module's function) until another
    request was answered, which
    only an event loop left free can do: `waited` is [True] where the call ran off the loop,
    [False] where it held the loop (it gave up after 5 s, and nothing was answered). `when`
    picks the call to hold by its arguments (the fake scheduler's own calls are on the loop)."""

    def __init__(self, monkeypatch, owner: Any, name: str,
                 when: Callable[..., bool] = lambda *args, **kw: True) -> None:
        self.entered, self.answered = threading.Event(), threading.Event()
        self.waited: list[bool] = []
        self.real = real = getattr(owner, name)

        def gated(*args, **kw):
            if not self.entered.is_set() and when(*args, **kw):
                self.entered.set()
                self.waited.append(self.answered.wait(5))
            return real(*args, **kw)
        monkeypatch.setattr(owner, name, gated)

    async def post(self, h: Harness, path: str, body: dict) -> tuple[int, dict]:
        """`body` to `path`, another request answered while the held call waits."""
        posted = asyncio.create_task(h.post(path, body))
        while not self.entered.is_set():
            await asyncio.sleep(0.01)
        async with h.session.get(h.url + "/v1/models") as r:
            assert r.status == 200
        self.answered.set()
        return await asyncio.wait_for(posted, 10)


async def test_tokenize_builds_its_answer_off_the_event_loop(h: Harness, monkeypatch) -> None:
    """A body's worth of text is a million ids: their token strings and their JSON took ~1 s
    on the event loop, every stream stalled meanwhile."""
    probe = LoopProbe(monkeypatch, h.tok, "id_to_token")
    status, body = await probe.post(h, "/tokenize", {"prompt": "Say hello.",
                                                     "return_token_strs": True})
    assert status == 200 and probe.waited == [True], body
    ids = h.tok.encode("Say hello.", add_special_tokens=True)
    assert body == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                    "token_strs": [probe.real(t) for t in ids]}


async def test_an_echo_is_decoded_off_the_event_loop(h: Harness, monkeypatch) -> None:
    """A batch of token-id prompts, each as long as the context, is a body's worth of ids:
    decoding them for `echo` took ~1 s on the event loop, every stream stalled meanwhile."""
    ids = h.tok.encode("Say hello.", add_special_tokens=False)
    probe = LoopProbe(monkeypatch, h.tok, "decode")
    status, body = await probe.post(h, "/v1/completions", completion(
        prompt=ids, echo=True, max_tokens=2))
    assert status == 200 and probe.waited == [True], body
    assert body["choices"][0]["text"].startswith("Say hello.")


async def test_echos_prompt_logprobs_are_built_off_the_event_loop(h: Harness,
                                                                   monkeypatch) -> None:
    """Echo with logprobs (a harness's loglikelihood) decodes every prompt token, each more
    than once, to place it in the text: a batch of prompts as long as the context took
    seconds on the event loop, every stream stalled meanwhile."""
    # the first decode for text (skipping special tokens) is the echo's: the fake's are not
    probe = LoopProbe(monkeypatch, h.tok, "decode",
                      when=lambda ids, skip_special_tokens=True: skip_special_tokens)
    status, body = await probe.post(h, "/v1/completions", completion(
        echo=True, logprobs=1, max_tokens=2))
    assert status == 200 and probe.waited == [True], body
    ids = h.tok.encode("Say hello.", add_special_tokens=True)
    assert body["choices"][0]["logprobs"]["tokens"][:len(ids)] == [
        probe.real([t], skip_special_tokens=False) for t in ids]


async def test_vllms_prompt_logprobs_are_built_off_the_event_loop(h: Harness,
                                                                   monkeypatch) -> None:
    """vLLM's prompt_logprobs decode each prompt token and each of its top ones: a batch of
    prompts as long as the context took seconds on the event loop, every stream stalled
    meanwhile (the answer's JSON is built on a thread with them)."""
    # the first decode of one id for its token's text is the answer's: the fake's decode
    # whole prompts, the output's text skips special tokens
    probe = LoopProbe(monkeypatch, h.tok, "decode",
                      when=lambda ids, skip_special_tokens=True: len(ids) == 1
                      and not skip_special_tokens)
    status, body = await probe.post(h, "/v1/completions", completion(
        max_tokens=2, prompt_logprobs=1))
    assert status == 200 and probe.waited == [True], body
    ids = h.fake.received[body["id"]].prompt_token_ids
    assert body["choices"][0]["prompt_logprobs"][1][str(ids[1])]["decoded_token"] == \
        probe.real([ids[1]], skip_special_tokens=False)


async def test_a_request_is_checked_off_the_event_loop(h: Harness, monkeypatch) -> None:
    """A body's worth of tools or messages took up to seconds to check (30,000 tools that
    tool_choice "required" makes a grammar of: over a second), every stream stalled
    meanwhile: the request is read on the tokenizer's thread."""
    from gateway import openai_schema
    probe = LoopProbe(monkeypatch, openai_schema, "tool_call_constraint")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    status, body = await probe.post(h, "/v1/chat/completions", chat(
        max_tokens=2, tools=tools, tool_choice="required"))
    assert status == 200 and probe.waited == [True], body


async def test_tokenizes_messages_are_checked_off_the_event_loop(h: Harness,
                                                                  monkeypatch) -> None:
    """A body's worth of messages to /tokenize took ~0.2 s to check on the event loop, every
    stream stalled meanwhile."""
    from gateway import openai_schema
    probe = LoopProbe(monkeypatch, openai_schema, "parse_tokenize")
    messages = [{"role": "user", "content": "hi"}]
    status, body = await probe.post(h, "/tokenize", {"messages": messages})
    assert status == 200 and probe.waited == [True], body
    assert body["tokens"] == h.tok.encode_chat(messages)


async def test_messages_the_chat_template_cannot_take_are_a_400_naming_them(h: Harness) -> None:
    """Refused by the chat template's checks (an earlier call's arguments that are not JSON),
    a request's error names 'messages' (on /v1/responses, the input item), as every other bad
    field is named (it named none)."""
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": calls}]
    for path, body in (("/v1/chat/completions", chat(max_tokens=2)),
                       ("/tokenize", {"model": MODEL})):
        status, answer = await h.post(path, {**body, "messages": messages})
        assert status == 400 and answer["error"]["param"] == "messages", answer
        assert "arguments is not valid JSON" in answer["error"]["message"]
    status, answer = await h.post("/v1/responses", {"model": MODEL, "input": [
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{oops"}]})
    assert status == 400 and answer["error"]["param"] == "input[0]", answer   # the item's
    assert answer["error"]["message"] == "input[0].arguments is not valid JSON"


async def test_a_clients_request_id_is_sent_back_and_logged(h: Harness, capsys) -> None:
    """X-Request-Id (vLLM reads it too): sent back with the answer and the stream, and
    logged beside our id; without one, ours is sent."""
    for stream in (False, True):
        async with h.session.post(h.url + "/v1/completions", headers={"X-Request-Id": "job-7/a"},
                                  json=completion(max_tokens=2, stream=stream)) as r:
            assert r.status == 200 and r.headers["X-Request-Id"] == "job-7/a"
            await r.read()
    async with h.session.post(h.url + "/v1/completions", json=completion(max_tokens=2)) as r:
        assert r.headers["X-Request-Id"] == (await r.json())["id"]
    assert "client_request_id=job-7/a" in capsys.readouterr().out
    async with h.session.post(h.url + "/v1/completions", headers={"X-Request-Id": "x" * 129},
                              json=completion(max_tokens=2)) as r:
        assert r.status == 400


async def test_a_bad_request_id_with_several_choices_keeps_no_place_in_the_queue(
        h: Harness) -> None:
    """Refused for its X-Request-Id header, a request of n choices gives back every place
    it took (they were kept, and a few such requests left the queue full for good: 429s)."""
    for n in (1, 5):
        async with h.session.post(h.url + "/v1/completions", headers={"X-Request-Id": "a\tb"},
                                  json=completion(max_tokens=2, n=n)) as r:
            answer = await r.json()
        assert r.status == 400 and "X-Request-Id" in answer["error"]["message"], answer
        assert h.state.num_waiting == 0


async def test_continuous_usage_stats_count_every_chunk(h: Harness) -> None:
    data = await h.sse("/v1/completions", completion(
        max_tokens=5, n=2, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    chunks = [json.loads(d) for d in data[:-1]]
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 10
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10


async def test_duplicate_and_overtaken_events_still_give_the_exact_text(h: Harness) -> None:
    for marker in ("[dup]", "[finish-first]", "[dup][finish-first]"):
        status, body = await h.post("/v1/completions", completion(prompt=marker, max_tokens=40))
        assert status == 200, body
        assert body["choices"][0]["text"] == REPLY, marker
        assert body["usage"]["completion_tokens"] == len(h.tok.encode(REPLY)) + 1


async def test_a_request_the_scheduler_rejects_is_a_client_error(h: Harness) -> None:
    status, body = await h.post("/v1/completions", completion(prompt="[invalid]", max_tokens=10))
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error"
    assert "KV blocks" in body["error"]["message"]


async def test_a_failed_generation_is_a_server_error(h: Harness) -> None:
    status, body = await h.post("/v1/completions", completion(prompt="[error]", max_tokens=10))
    assert status == 500
    assert "the fake worker failed" in body["error"]["message"]
    data = await h.sse("/v1/completions", completion(prompt="[error]", max_tokens=10))
    assert "the fake worker failed" in json.loads(data[-2])["error"]["message"]
    assert data[-1] == "[DONE]"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
async def test_a_request_past_its_deadline_is_not_retried_by_the_openai_client(
        h: Harness, path: str) -> None:
    """The 408 of a request whose deadline passed while it ran: the client's own `timeout` (or
    --request-timeout) spent, the work done and dropped. The official client retries a 408
    (twice by default): each retry ran the whole deadline again, 3x the compute and the
    wait. The answer says `x-should-retry: false`, which the client obeys."""
    tag = f"[deadline] {path}"
    async with openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="unused") as client:
        with pytest.raises(openai.APIStatusError) as failed:
            if path == "/v1/completions":
                await client.completions.create(model=MODEL, prompt=tag, max_tokens=10)
            elif path == "/v1/chat/completions":
                await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": tag}], max_tokens=10)
            else:
                await client.responses.create(model=MODEL, input=tag, max_output_tokens=10)
    assert failed.value.status_code == 408 and "deadline" in failed.value.message
    assert failed.value.response.headers["x-should-retry"] == "false"
    sent = [m for m in h.fake.received.values() if tag in h.tok.decode(m.prompt_token_ids)]
    assert len(sent) == 1


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_failed_stream_still_sends_the_text_it_held_back(h: Harness, path: str) -> None:
    """A stop string the output so far could still grow into holds that text back; should
    the generation then fail, the text goes out before the error event, not with it lost."""
    received = reply_text(h.tok, 2)          # the fake's two tokens before its failure
    fields = dict(max_tokens=10, stop=[received + "!"])
    body = completion(prompt="[error]", **fields) if path == "/v1/completions" else \
        chat("[error]", **fields)
    data = await h.sse(path, body)
    assert data[-1] == "[DONE]"
    assert "the fake worker failed" in json.loads(data[-2])["error"]["message"]
    choices = [c for d in data[:-2] for c in json.loads(d)["choices"]]
    assert "".join(c.get("text") or c.get("delta", {}).get("content") or ""
                   for c in choices) == received
    assert all(c["finish_reason"] is None for c in choices)


async def test_a_stream_that_fails_mid_character_sends_no_replacement_character(
        h: Harness) -> None:
    """The output so far ends with the first bytes of a character ("Party " and part of 🎉);
    the generation then fails: what was sent is a prefix of the text the output would have
    had, with no U+FFFD for the bytes the next token would have completed."""
    data = await h.sse("/v1/completions", completion(prompt="[emoji][error3]", max_tokens=10))
    assert data[-1] == "[DONE]" and "error" in json.loads(data[-2])
    text = "".join(c["text"] for d in data[:-2] for c in json.loads(d)["choices"])
    assert text.startswith("Party") and EMOJI_REPLY.startswith(text), text


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


async def test_tool_choice_auto_parses_the_models_own_format(h: Harness) -> None:
    """With --tool-call-parser hermes, "auto" (the default with tools) is served: the words
    before the call are the content, the call is a tool call, streamed or not; words alone
    stay words."""
    body = chat("[tool] Weather in Paris?", tools=TOOLS)
    status, answer = await h.post("/v1/chat/completions", body)
    assert status == 200, answer
    [choice] = answer["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    sent = list(h.fake.received.values())[-1]
    assert sent.prompt_token_ids == h.tok.encode_chat(body["messages"], TOOLS)  # the template's
    assert sent.sampling.structured_outputs is None                   # nothing constrained
    chunks = [json.loads(d) for d in (await h.sse("/v1/chat/completions", body))[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    [streamed] = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert streamed["index"] == 0 and streamed["function"] == call["function"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    status, words = await h.post("/v1/chat/completions", chat(tools=TOOLS))
    assert words["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
    assert words["choices"][0]["finish_reason"] == "stop"
    # a call of a function the client never offered is words, streamed or not
    other = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    status, words = await h.post("/v1/chat/completions", {**body, "tools": other})
    assert words["choices"][0]["message"] == {"role": "assistant", "content": TOOL_REPLY}
    chunks = [json.loads(d) for d in
              (await h.sse("/v1/chat/completions", {**body, "tools": other}))[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == TOOL_REPLY
    assert not any("tool_calls" in c["choices"][0]["delta"] for c in chunks)


async def test_tool_call_tags_that_are_special_tokens_still_make_calls(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Some models' vocabularies (Hermes 2 Pro's) have <tool_call> as a special token: under
    "auto" with the hermes parser the text keeps special tokens (as vLLM's does), or the
    tags would be left out and the call come back as words."""
    backend = tiny_tokenizer()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in ("<tool_call>", "</tool_call>")])
    tok = Tokenizer(backend, bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID,
                    chat_template=CHAT_TEMPLATE)
    assert tok.decode(tok.encode("<tool_call>")) == ""          # skipped by default
    monkeypatch.setattr(h.state, "tokenizer", tok)
    monkeypatch.setattr(h.fake, "tok", tok)
    status, answer = await h.post("/v1/chat/completions", chat("[tool]", tools=TOOLS))
    assert status == 200, answer
    message = answer["choices"][0]["message"]
    assert (message["content"], message["tool_calls"][0]["function"]) == \
        ("Checking.", {"name": "get_weather", "arguments": '{"city": "Paris"}'})
    deltas = [json.loads(d)["choices"][0]["delta"]
              for d in (await h.sse("/v1/chat/completions", chat("[tool]", tools=TOOLS)))[:-1]]
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", [])] == \
        ["get_weather"]
    # without tools the request's own skip_special_tokens holds: the tags are left out
    status, words = await h.post("/v1/chat/completions", chat("[tool]"))
    assert words["choices"][0]["message"]["content"] == TOOL_REPLY.replace(
        "<tool_call>", "").replace("</tool_call>", "")


@pytest.mark.parametrize("prompt, tool_choice, reply", [
    ("[call-first][error]", "auto", TOOL_REPLY.removeprefix("Checking.")),
    ("[error]", "required", REPLY)], ids=["auto", "required"])
async def test_a_failed_stream_sends_the_text_a_tool_choice_held(h: Harness, prompt: str,
                                                                 tool_choice: str,
                                                                 reply: str) -> None:
    """Under a tool choice the text that may be a call is held ("auto": from where a call
    begins; 'required': the whole list); should the generation fail, that text goes out as
    words before the error event, on chat and on the Responses API, not lost with it."""
    received = h.tok.decode(h.tok.encode(reply)[:2])     # the fake's tokens before it fails
    body = chat(prompt, max_tokens=10, tools=TOOLS, tool_choice=tool_choice)
    data = await h.sse("/v1/chat/completions", body)
    assert data[-1] == "[DONE]"
    assert "the fake worker failed" in json.loads(data[-2])["error"]["message"]
    deltas = [c["delta"] for d in data[:-2] for c in json.loads(d)["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == received
    assert not any("tool_calls" in d for d in deltas)
    tool = {"type": "function", "name": "get_weather",
            "parameters": TOOLS[0]["function"]["parameters"]}
    events = await _response_events(h, {"model": MODEL, "input": prompt, "tools": [tool],
                                        "tool_choice": tool_choice, "max_output_tokens": 10})
    assert events[-1]["type"] == "response.failed"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") \
        == received
    [message] = events[-1]["response"]["output"]
    assert message["content"][0]["text"] == received


async def _response_events(h: Harness, body: dict) -> list[dict]:
    async with h.session.post(h.url + "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status == 200
        raw = (await r.read()).decode()
    events = []
    for block in raw.split("\n\n")[:-1]:
        kind, data = block.split("\n")
        events.append(json.loads(data.removeprefix("data: ")))
        assert kind == f"event: {events[-1]['type']}"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


async def test_responses_api_shape_and_its_failed_event(h: Harness) -> None:
    body = {"model": MODEL, "instructions": "Be brief.", "max_output_tokens": 4,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]}
    status, answer = await h.post("/v1/responses", body)
    assert status == 200 and answer["object"] == "response" and answer["id"].startswith("resp_")
    assert answer["status"] == "incomplete"
    assert answer["incomplete_details"] == {"reason": "max_output_tokens"}
    [message] = answer["output"]
    assert message["content"][0]["text"] == reply_text(h.tok, 4)
    assert answer["usage"]["output_tokens"] == 4 and answer["instructions"] == "Be brief."
    usage = answer["usage"]                                  # the fake caches half a prompt
    assert usage["input_tokens_details"]["cached_tokens"] == usage["input_tokens"] // 2
    sent = list(h.fake.received.values())[-1]               # the latest request
    assert h.tok.decode(sent.prompt_token_ids).count("Be brief.") == 1
    events = await _response_events(h, {**body, "max_output_tokens": 60})
    assert [e["type"] for e in events[:4]] == ["response.created", "response.in_progress",
                                               "response.output_item.added",
                                               "response.content_part.added"]
    assert events[-1]["type"] == "response.completed"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") \
        == events[-1]["response"]["output"][0]["content"][0]["text"] == REPLY
    # the output text's logprobs (the fake's: -0.5 each, its top ones next to it)
    status, scored = await h.post("/v1/responses", {**body, "top_logprobs": 2})
    entries = scored["output"][0]["content"][0]["logprobs"]
    assert [e["logprob"] for e in entries] == [-0.5] * 4
    assert all(len(e["top_logprobs"]) == 2 for e in entries)
    assert "".join(e["token"] for e in entries) == reply_text(h.tok, 4)
    events = await _response_events(h, {**body, "include": ["message.output_text.logprobs"]})
    streamed = [x for e in events if e["type"] == "response.output_text.delta"
                for x in e["logprobs"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in entries]
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == streamed
    # to the end of turn: its token, which has no text of its own, has its entry streamed too
    whole_body = {**body, "max_output_tokens": 60, "top_logprobs": 1}
    status, whole = await h.post("/v1/responses", whole_body)
    entries = whole["output"][0]["content"][0]["logprobs"]
    assert len(entries) == whole["usage"]["output_tokens"] == len(h.tok.encode(REPLY)) + 1
    events = await _response_events(h, whole_body)
    streamed = [x for e in events if e["type"] == "response.output_text.delta"
                for x in e["logprobs"]]
    assert streamed == entries == events[-1]["response"]["output"][0]["content"][0]["logprobs"]
    async with h.session.get(f"{h.url}/v1/responses/{answer['id']}") as r:
        assert r.status == 404 and "keeps none" in (await r.json())["error"]["message"]
    status, failed = await h.post("/v1/responses", {"model": MODEL, "input": "[error]"})
    assert status == 500 and "the fake worker failed" in failed["error"]["message"]
    events = await _response_events(h, {"model": MODEL, "input": "[error]"})
    assert events[-1]["type"] == "response.failed"
    assert "the fake worker failed" in events[-1]["response"]["error"]["message"]
    # the tokens that came before and with the failure are streamed, and are its output
    received = reply_text(h.tok, 2)
    assert "".join(e["delta"] for e in events
                   if e["type"] == "response.output_text.delta") == received
    [item] = events[-1]["response"]["output"]
    assert item["status"] == "incomplete" and item["content"][0]["text"] == received


@pytest.mark.parametrize("prompt", ["Hi", "[tool]", "[error]", "[invalid]", "[deadline]"])
async def test_responses_answers_and_events_validate_in_the_openai_clients_types(
        h: Harness, prompt: str) -> None:
    """Every response and stream event, validated strictly by the official client's own
    pydantic types (the client itself builds them leniently, so a field it requires but does
    not find is None, and a value outside its Literal passes unnoticed; strict consumers, a
    proxy or agent framework that validates, refuse them): the usage's
    `input_tokens_details.cache_write_tokens` is required (0: nothing is written to a cache
    the client pays for), and a failed response's `error.code` is one of the client's codes
    (`server_error`, `invalid_prompt`), the error's own type beside it."""
    from openai.types.responses import Response, ResponseStreamEvent
    event_types = {typing.get_args(kind.model_fields["type"].annotation)[0]: kind
                   for kind in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}
    tools = [{"type": "function", "name": "get_weather",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    body = {"model": MODEL, "input": prompt, "max_output_tokens": 60,
            **({"tools": tools, "tool_choice": "auto"} if prompt == "[tool]" else {})}
    status, answer = await h.post("/v1/responses", body)
    if status == 200:
        Response.model_validate(answer)
    events = await _response_events(h, body)
    for event in events:
        event_types[event["type"]].model_validate(event)
    last = events[-1]["response"]
    if prompt in ("Hi", "[tool]"):
        assert last["usage"]["input_tokens_details"]["cache_write_tokens"] == 0
    else:
        assert last["error"]["code"] == ("invalid_prompt" if prompt == "[invalid]"
                                         else "server_error")
        assert last["error"]["type"] == {"[error]": "server_error", "[deadline]": "timeout_error",
                                         "[invalid]": "invalid_request_error"}[prompt]


async def test_a_responses_stream_makes_its_logprobs_once_and_sends_them_in_pieces(
        h: Harness, monkeypatch) -> None:
    """A stream's four closing events (the text's, the part's, the item's, the response's)
    each carry the message's logprobs: each made them afresh, and each was one json.dumps,
    on the event loop (8k tokens with 20 top ones: seconds, every stream stalled). They are
    made once, a delta's at a time as the deltas go out, and written a piece at a time."""
    from gateway import openai_schema, responses_api
    from gateway.responses import SSEResponse
    piece = 1024
    monkeypatch.setattr(responses_api, "JSON_PIECE_CHARS", piece, raising=False)
    made: list[int] = []            # the entries each call turned into OpenAI's shape
    shaped = openai_schema.chat_logprobs
    monkeypatch.setattr(openai_schema, "chat_logprobs",
                        lambda entries, **kw: made.append(len(entries)) or shaped(entries, **kw))
    writes: list[int] = []
    write = SSEResponse.write

    async def counted(self, data) -> None:
        writes.append(len(data))
        await write(self, data)
    monkeypatch.setattr(SSEResponse, "write", counted)
    events = await _response_events(h, {"model": MODEL, "input": "Hi", "max_output_tokens": 60,
                                        "top_logprobs": 20})
    streamed = [x for e in events if e["type"] == "response.output_text.delta"
                for x in e["logprobs"]]
    by_type = {e["type"]: e for e in events}
    assert len(streamed) == events[-1]["response"]["usage"]["output_tokens"] == sum(made)
    assert by_type["response.output_text.done"]["logprobs"] == streamed
    assert by_type["response.content_part.done"]["part"]["logprobs"] == streamed
    assert by_type["response.output_item.done"]["item"]["content"][0]["logprobs"] == streamed
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == streamed
    assert len(json.dumps(streamed)) > 6 * piece       # several pieces' worth
    assert max(writes) <= 3 * piece


@pytest.mark.parametrize("path, body", [
    ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 60,
                       "top_logprobs": 20}),
    ("/v1/chat/completions", chat(max_tokens=60, logprobs=True, top_logprobs=20)),
    ("/v1/completions", completion(prompt=" ".join(f"w{i}" for i in range(40)), echo=True,
                                   logprobs=20, max_tokens=2)),
    ("/tokenize", {"model": MODEL, "prompt": " ".join(f"w{i}" for i in range(1500)),
                   "return_token_strs": True}),
])
async def test_a_whole_answer_s_json_is_made_in_pieces(h: Harness, monkeypatch, path: str,
                                                       body: dict) -> None:
    """A whole answer's JSON was one json.dumps, which holds the GIL however long it runs, on
    a thread too (a 32k-token prompt's logprobs with 20 top ones: ~0.4 s, every stream
    stalled; /v1/responses' on the event loop itself). It is made a piece at a time, the
    same text as one json.dumps makes."""
    from gateway import responses
    piece = 2048
    monkeypatch.setattr(responses, "JSON_PIECE_CHARS", piece, raising=False)
    dumps, made = json.dumps, []

    def counted(*args, **kw) -> str:
        made.append(len(text := dumps(*args, **kw)))
        return text
    monkeypatch.setattr(json, "dumps", counted)
    async with h.session.post(h.url + path, json=body) as r:
        assert r.status == 200
        raw = await r.text()
    monkeypatch.setattr(json, "dumps", dumps)
    assert json.dumps(json.loads(raw)) == raw and len(raw) > 4 * 2 * piece
    assert made, "the answer's JSON was not made by json.dumps"
    assert max(made) <= 2 * piece


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_a_whole_chat_answer_s_logprobs_are_made_a_piece_at_a_time(api: str) -> None:
    """A whole chat answer's (or Responses answer's) logprobs were made at once before its
    JSON was written: 43 containers a token with 20 top ones, hundreds of thousands alive
    together for a long answer, which the cyclic collector's full passes walked with the GIL
    held (75 ms and more, every stream's next token waiting). They are made as their JSON is
    written, a piece's worth alive at a time: fewer containers than tokens, the same JSON."""
    import gc
    from types import SimpleNamespace

    from gateway import openai_schema as oai
    from gateway.responses import Shape, json_pieces
    from gateway.responses_api import ResponseShape
    tokens, top = 2000, 20
    req = oai.parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                          "logprobs": True, "top_logprobs": top})
    entries = [oai.TokenLogprob(f"t{i}", -0.5, [(f"a{i}-{k}", -1.0 - k) for k in range(top)],
                                raw=tuple(f"x{i}-{k}".encode() for k in range(top + 1)))
               for i in range(tokens)]
    text = "".join(e.token for e in entries)
    if api == "chat":
        shape = Shape(req, "chatcmpl-1", MODEL, num_prompt_tokens=1)
        answer = lambda: shape.choice(0, text, entries, "length")     # noqa: E731
    else:
        shape = ResponseShape("resp_1", MODEL, {}, 1, {})
        gen = SimpleNamespace(finish_reason="length", num_output_tokens=tokens,
                              num_cached_tokens=0)
        answer = lambda: shape.final(text, None, gen, entries)        # noqa: E731
    gc.collect()
    gc.disable()                # counts of the containers alive, nothing freed behind them
    try:
        alive = len(gc.get_objects())
        choice = answer()
        most = len(gc.get_objects()) - alive
        pieces = []
        for piece in json_pieces(choice):
            pieces.append(piece)
            if len(pieces) % 8 == 0:
                most = max(most, len(gc.get_objects()) - alive)
    finally:
        gc.enable()
    assert most < tokens, f"{most} containers alive for {tokens} tokens' logprobs"
    content = [{"token": e.token, "logprob": e.logprob, "bytes": list(e.raw[0]),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(b)}
                                 for (t, lp), b in zip(e.top, e.raw[1:])]} for e in entries]
    if api == "chat":
        assert "".join(pieces) == json.dumps({**choice, "logprobs": {"content": content}})
    else:
        made = json.loads("".join(pieces))
        assert made["output"][0]["content"][0]["logprobs"] == content


async def test_responses_api_takes_vllm_s_chat_fields(h: Harness) -> None:
    """What chat takes of vLLM's (structured outputs, truncate_prompt_tokens) means the same
    on /v1/responses, never dropped on the way."""
    body = {"model": MODEL, "input": "yes or no?", "max_output_tokens": 2}
    for extra, constraint in [({"structured_outputs": {"choice": ["yes", "no"]}}, "choice"),
                              ({"guided_regex": "[a-z]+"}, "regex")]:
        status, _ = await h.post("/v1/responses", {**body, **extra})
        assert status == 200
        sent = list(h.fake.received.values())[-1]
        assert sent.sampling.structured_outputs[0] == constraint
    status, _ = await h.post("/v1/responses", {**body, "truncate_prompt_tokens": 3})
    assert status == 200 and len(list(h.fake.received.values())[-1].prompt_token_ids) == 3
    for refused in ({"best_of": 2}, {"echo": True}, {"prompt_logprobs": 1},
                    {"truncation": "auto", "truncate_prompt_tokens": 3}, {"messages": []},
                    {"stream_options": {"include_usage": True}}, {"store": "yes"}):
        status, error = await h.post("/v1/responses", {**body, **refused})
        assert status == 400 and error["error"]["param"] in refused, error
    # store true is answered false (nothing is stored), not refused
    status, answer = await h.post("/v1/responses", {**body, "store": True})
    assert status == 200 and answer["store"] is False, answer
    # sampling fields sent as null: their defaults
    status, answer = await h.post("/v1/responses", {**body, "temperature": None, "top_p": None})
    assert status == 200 and (answer["temperature"], answer["top_p"]) == (1.0, 1.0), answer
    # OpenAI's one stream option here, streamed; without stream, a 400 as on chat (vLLM's)
    events = await _response_events(h, {**body, "stream_options": {"include_obfuscation": False}})
    assert events[-1]["type"] == "response.incomplete"        # max_output_tokens reached
    status, error = await h.post("/v1/responses", {
        **body, "stream_options": {"include_obfuscation": False}})
    assert status == 400 and error["error"] == {
        "message": "'stream_options' needs 'stream' to be true", "param": "stream_options",
        "type": "invalid_request_error", "code": None}, error
    # what the chat path refuses is named as /v1/responses spells it
    for wrong, param in (({"input": "word " * 200}, "input"),
                         ({"max_output_tokens": MAX_MODEL_LEN}, "max_output_tokens")):
        status, error = await h.post("/v1/responses", {**body, **wrong})
        assert status == 400 and error["error"]["code"] == "context_length_exceeded", error
        assert error["error"]["param"] == param, error
        assert "max_tokens" not in error["error"]["message"], error


async def _words_only(h: Harness, body: dict, text: str) -> None:
    """The response is one message of `text`, streamed or not."""
    status, answer = await h.post("/v1/responses", body)
    assert [o["type"] for o in answer["output"]] == ["message"]
    assert answer["output"][0]["content"][0]["text"] == text
    events = await _response_events(h, body)
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") \
        == text == events[-1]["response"]["output"][0]["content"][0]["text"]


async def test_responses_api_function_tools_and_their_history(h: Harness) -> None:
    """Function tools on /v1/responses: the hermes call the fake writes becomes a
    function_call item after the message, streamed or not; earlier calls and outputs in
    `input` reach the chat template as the assistant's tool calls and a tool message."""
    tool = {"type": "function", "name": "get_weather",
            "parameters": TOOLS[0]["function"]["parameters"]}
    body = {"model": MODEL, "input": "[tool] Weather in Paris?", "tools": [tool]}
    status, answer = await h.post("/v1/responses", body)
    assert status == 200, answer
    message, call = answer["output"]
    assert message["content"][0]["text"] == "Checking." and answer["status"] == "completed"
    assert (call["type"], call["name"], call["arguments"]) == \
        ("function_call", "get_weather", '{"city": "Paris"}')
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    assert answer["tools"] == [tool] and answer["tool_choice"] == "auto"
    events = await _response_events(h, body)
    kinds = [e["type"] for e in events]
    assert kinds[-5:] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    final = events[-1]["response"]["output"]
    assert final[0]["content"][0]["text"] == "Checking."
    assert {k: final[1][k] for k in ("name", "arguments")} == \
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert events[-3]["arguments"] == final[1]["arguments"]
    # a named call cut short by max_output_tokens: an incomplete item, streamed or not
    named = {**body, "tool_choice": {"type": "function", "name": "get_weather"},
             "max_output_tokens": 3}
    status, cut = await h.post("/v1/responses", named)
    assert status == 200 and cut["status"] == "incomplete", cut
    assert [o["status"] for o in cut["output"] if o["type"] == "function_call"] == ["incomplete"]
    events = await _response_events(h, named)
    assert [o["status"] for o in events[-1]["response"]["output"]
            if o["type"] == "function_call"] == ["incomplete"]
    assert [e["item"]["status"] for e in events if e["type"] == "response.output_item.done"
            and e["item"]["type"] == "function_call"] == ["incomplete"]
    # chat's shapes are refused in this API's words, not chat's
    for wrong, param in (({"tool_choice": {"type": "function",
                                           "function": {"name": "get_weather"}}}, "tool_choice"),
                         ({"tools": [{"type": "function", "function": tool}]}, "tools")):
        status, error = await h.post("/v1/responses", {**body, **wrong})
        assert status == 400 and error["error"]["param"] == param, error
        assert '"name": ' in error["error"]["message"] and \
            '"function": {"name"' not in error["error"]["message"], error
    # a call of a function not offered: the message's words, streamed or not
    await _words_only(h, {**body, "tools": [{**tool, "name": "get_time"}]}, TOOL_REPLY)
    # 'required' whose output is no list of calls (the fake ignores the constraint; on a
    # server, max_output_tokens cut short): its text comes back as the message, streamed too
    await _words_only(h, {**body, "input": "Weather in Paris?", "tool_choice": "required"},
                      REPLY)
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                "arguments": '{"city": "Paris"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}]
    status, reply = await h.post("/v1/responses", {**body, "input": history})
    assert status == 200 and reply["output"][0]["content"][0]["text"] == REPLY
    sent = list(h.fake.received.values())[-1]
    chat_tools = [{"type": "function", "function": {"name": "get_weather",
                                                    "parameters": tool["parameters"]}}]
    assert sent.prompt_token_ids == h.tok.encode_chat([
        history[0],
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}], chat_tools)
    # a response's own output replayed (its message, then its call): one assistant turn, the
    # words and the call, as the same history on chat completions renders
    said = {"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": "Checking."}]}
    status, _ = await h.post("/v1/responses", {**body, "input": [
        history[0], said, *history[1:]]})
    assert status == 200 and list(h.fake.received.values())[-1].prompt_token_ids == \
        h.tok.encode_chat([history[0], {
            "role": "assistant", "content": "Checking.", "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}], chat_tools)
    # a call whose arguments are no JSON: a 400 naming the item as sent (with instructions,
    # the chat messages are one more than the items)
    bad = [history[0], {**history[1], "arguments": "{oops"}]
    status, error = await h.post("/v1/responses", {**body, "instructions": "Be brief.",
                                                   "input": bad})
    assert status == 400 and error["error"]["param"] == "input[1]", error
    assert error["error"]["message"] == "input[1].arguments is not valid JSON"
    # an output of text parts, as OpenAI takes it too: the same prompt
    parts = [{"type": "input_text", "text": "18 C"}]
    status, _ = await h.post("/v1/responses", {**body, "input": [
        *history[:2], {**history[2], "output": parts}]})
    assert status == 200 and list(h.fake.received.values())[-1].prompt_token_ids == \
        sent.prompt_token_ids


async def test_the_token_listener_resubscribes_after_its_connection_drops(h: Harness) -> None:
    channel = h.keys.tokens(h.config.gateway_id)

    async def subscribers() -> int:
        return dict(await h.redis.pubsub_numsub(channel))[channel.encode()]

    assert await subscribers() == 1
    await h.redis.client_kill_filter(_type="pubsub")
    assert await subscribers() == 0
    for _ in range(200):
        if await subscribers() == 1:
            break
        await asyncio.sleep(0.05)
    status, body = await h.post("/v1/completions", completion(max_tokens=3))
    assert status == 200 and body["choices"][0]["text"] == reply_text(h.tok, 3)


async def test_the_token_listener_backs_off_afresh_after_each_subscription() -> None:
    """The listener's backoff starts again from its first delay once it has subscribed:
    before, it kept growing across outages (2 s after the first one, for good)."""
    from structlog.testing import capture_logs
    from redis.exceptions import ConnectionError as RedisConnectionError

    # per subscribe try: fail at once, or subscribe and then lose the connection; the last
    # try stays subscribed
    tries = iter(["fail", "fail", "drop", "fail", "stay"])
    stayed = asyncio.Event()

    class PubSub:
        async def subscribe(self, channel):
            self.how = next(tries)
            if self.how == "fail":
                raise RedisConnectionError("refused")
            self.confirmed = False

        async def get_message(self, timeout):
            if not self.confirmed:
                self.confirmed = True
                return {"type": "subscribe"}
            if self.how == "drop":
                raise RedisConnectionError("dropped")
            stayed.set()
            await asyncio.sleep(timeout)

        async def aclose(self):
            pass

    class Redis:
        def pubsub(self):
            return PubSub()

    router = TokenRouter(Redis(), "channel")
    with capture_logs() as logs:
        task = asyncio.create_task(router.run())
        await asyncio.wait_for(stayed.wait(), 10)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    # two failures, the drop, then a failure backed off from the start again
    assert [e["retry_in_s"] for e in logs if "retry_in_s" in e] == [0.1, 0.2, 0.1, 0.1]
    assert router.subscribed.is_set()


async def test_health_is_503_while_the_token_channel_is_not_subscribed(h: Harness) -> None:
    for rank in (0, 1):
        await h.redis.set(h.keys.hb_worker(rank), b"x", ex=30)
    await h.redis.set(h.keys.hb_scheduler("s0"), b"x", ex=30)
    try:
        async with h.session.get(h.url + "/health") as r:
            assert r.status == 200
        h.state.router.subscribed.clear()
        async with h.session.get(h.url + "/health") as r:
            assert r.status == 503
            assert (await r.json())["missing"] == ["token channel (not subscribed on Redis)"]
    finally:
        h.state.router.subscribed.set()
        await h.redis.delete(h.keys.hb_worker(0), h.keys.hb_worker(1), h.keys.hb_scheduler("s0"))


async def test_health_and_metrics_answer_soon_while_redis_stalls(h: Harness) -> None:
    """Redis stops answering (paused here, SIGSTOP in the field): /health says so with a 503
    and /metrics answers with what the gateway knows, each well within the 10 s socket
    timeout they waited for before."""
    await h.redis.execute_command("CLIENT", "PAUSE", "4000", "ALL")
    try:
        timeout = aiohttp.ClientTimeout(total=3.5)
        async with h.session.get(h.url + "/health", timeout=timeout) as r:
            assert r.status == 503
            assert (await r.json())["missing"] == ["redis (no answer within 1.5 s)"]
        async with h.session.get(h.url + "/metrics", timeout=timeout) as r:
            assert r.status == 200 and "pacer:prompt_tokens_total" in await r.text()
    finally:
        await h.redis.execute_command("CLIENT", "UNPAUSE")


@contextlib.asynccontextmanager
async def redis_out_of_memory(h: Harness):
    """Redis refusing every write (maxmemory 1 with noeviction) inside the block; after it,
    room again and the gateway's heartbeat written once more, so that a later test's /health
    does not still name the refusal (the gateway keeps the last heartbeat's error until the
    next one gets through)."""
    await h.redis.config_set("maxmemory", "1")
    try:
        yield
    finally:
        await h.redis.config_set("maxmemory", "0")
        for _ in range(100):
            async with h.session.get(h.url + "/health") as r:
                if not any(m.startswith("redis") for m in (await r.json()).get("missing", [])):
                    break
            await asyncio.sleep(0.1)


async def test_a_request_is_refused_naming_a_redis_out_of_memory(h: Harness) -> None:
    """A 503 that a retry may not meet a moment later: with Retry-After, as a 429 has."""
    async with redis_out_of_memory(h):
        async with h.session.post(h.url + "/v1/completions", json=completion(max_tokens=3)) as r:
            status, headers, body = r.status, r.headers, await r.json()
    assert status == 503 and headers.get("Retry-After") == "1", (status, dict(headers))
    assert "Redis is out of memory (maxmemory)" in body["error"]["message"], body


async def test_a_request_is_refused_while_the_token_channel_is_not_connected(
        h: Harness, monkeypatch) -> None:
    """Its tokens would be lost: a 503 naming the channel, with Retry-After."""
    import gateway.handlers
    monkeypatch.setattr(gateway.handlers, "SUBSCRIBE_WAIT_S", 0.1)
    h.state.router.subscribed.clear()
    try:
        async with h.session.post(h.url + "/v1/completions", json=completion(max_tokens=3)) as r:
            status, headers, body = r.status, r.headers, await r.json()
    finally:
        h.state.router.subscribed.set()
    assert status == 503 and headers.get("Retry-After") == "1", (status, dict(headers))
    assert body["error"]["message"].startswith("the token channel is not connected"), body


async def test_health_names_a_redis_that_refuses_the_heartbeats(h: Harness) -> None:
    """Out of memory (noeviction), Redis refuses every heartbeat: the services' keys expire.
    /health must name Redis first (it listed the scheduler and the worker ranks alone, which
    sends an operator to look at services that are fine)."""
    async with redis_out_of_memory(h):
        for _ in range(100):            # until the gateway's next heartbeat is refused
            async with h.session.get(h.url + "/health") as r:
                missing = (await r.json())["missing"]
            if missing[0].startswith("redis"):
                break
            await asyncio.sleep(0.1)
    assert r.status == 503
    assert missing[0] == "redis (heartbeats cannot be written: Redis is out of memory " \
                         "(maxmemory))", missing
    assert "scheduler" in missing and "worker rank 0" in missing, missing


async def test_health_is_503_once_redis_refuses_a_heartbeat_before_any_key_expires(
        h: Harness) -> None:
    """Out of memory, every request is refused (503) at once; /health said ok until the
    services' heartbeat keys expired (2 s for a worker's, 5 s for a scheduler's; never with
    these long ones). A load balancer should take the gateway out as a request would find it:
    503 from the gateway's first refused heartbeat, naming Redis alone."""
    for key in (h.keys.hb_worker(0), h.keys.hb_worker(1), h.keys.hb_scheduler("s0")):
        await h.redis.set(key, b"x", ex=60)
    try:
        async with h.session.get(h.url + "/health") as r:
            assert r.status == 200, await r.text()
        async with redis_out_of_memory(h):
            for _ in range(100):            # until the gateway's next heartbeat is refused
                async with h.session.get(h.url + "/health") as r:
                    status, body = r.status, await r.json()
                if status != 200:
                    break
                await asyncio.sleep(0.1)
        assert status == 503 and body["missing"] == [
            "redis (heartbeats cannot be written: Redis is out of memory (maxmemory))"], body
        async with h.session.get(h.url + "/health") as r:     # room again: healthy at once
            assert r.status == 200, await r.text()
    finally:
        await h.redis.delete(h.keys.hb_worker(0), h.keys.hb_worker(1), h.keys.hb_scheduler("s0"))


async def test_a_request_whose_entry_is_lost_ends_with_an_error(h: Harness) -> None:
    """Its entry leaves the request stream while no scheduler serves it (deleted, evicted
    under an allkeys-* maxmemory policy): it would have waited forever. A request that is
    only queued as long is left alone."""
    async with aiohttp.ClientSession() as session:
        async def stream(prompt: str) -> list[str]:
            async with session.post(h.url + "/v1/completions", json=completion(
                    prompt=prompt, max_tokens=4, stream=True)) as r:
                return [line async for line in r.content]
        lost = asyncio.create_task(stream("[queued] lost"))
        queued = asyncio.create_task(stream("[queued] only waits"))
        entries = {}
        while len(entries) < 2:
            entries = {m.request_id: e for e, m in [(e, from_fields(f)) for e, f in
                       await h.redis.xrange(h.keys.requests)] if "[queued]" in h.tok.decode(
                           m.prompt_token_ids)}
            await asyncio.sleep(0.05)
        lost_id = next(rid for rid, m in h.fake.received.items() if "lost" in h.tok.decode(
            m.prompt_token_ids))
        await h.redis.xdel(h.keys.requests, entries[lost_id])
        lines = await asyncio.wait_for(lost, 15)
        assert any(b"gone from Redis's request stream" in line for line in lines), lines
        assert not queued.done()
        queued.cancel()
        await asyncio.gather(queued, return_exceptions=True)
    assert (await wait_for_abort(h, lost_id)).startswith("ended by the gateway")


async def test_a_stream_the_gateway_ends_itself_is_aborted_upstream(h: Harness) -> None:
    """The gateway ends a stream without the scheduler (its token channel dropped, Redis
    stalled or out of memory): the scheduler is told, or it decodes the request to
    max_tokens for nobody."""
    async with aiohttp.ClientSession() as session:
        async with session.post(h.url + "/v1/completions", json=completion(
                prompt="[slow]", max_tokens=100, stream=True)) as r:
            first = json.loads((await r.content.readuntil(b"\n\n"))[len(b"data: "):])
            h.state.router.fail_all("the token channel dropped (a test)")
            rest = await r.read()
    assert b"the token channel dropped (a test)" in rest
    assert await wait_for_abort(h, first["id"]) == \
        "ended by the gateway: the token channel dropped (a test)"
    for _ in range(200):
        if (first["id"], "abort") in h.fake.finished:
            break
        await asyncio.sleep(0.05)
    assert (first["id"], "abort") in h.fake.finished


async def test_an_abort_redis_refused_is_sent_once_it_takes_writes_again(h: Harness) -> None:
    """The gateway ends a stream while Redis refuses writes (out of memory here; away or
    stalled alike): the abort is kept and sent with the first heartbeat that gets through."""
    async with aiohttp.ClientSession() as session:
        async with session.post(h.url + "/v1/completions", json=completion(
                prompt="[slow]", max_tokens=100, stream=True)) as r:
            first = json.loads((await r.content.readuntil(b"\n\n"))[len(b"data: "):])
            async with redis_out_of_memory(h):
                h.state.router.fail_all("Redis is out of memory (a test)")
                await r.read()
                await asyncio.sleep(0.3)
                assert first["id"] not in await aborts(h.redis, h.keys)
    assert await wait_for_abort(h, first["id"]) == \
        "ended by the gateway: Redis is out of memory (a test)"


async def test_an_abort_redis_refuses_for_good_is_dropped_not_kept(h: Harness) -> None:
    """An abort kept while Redis was out of memory meets, once it has room, a refusal that
    stays (its key holds another type here; an ACL alike): it is dropped with an error. Kept,
    it failed every heartbeat after it, and the gateway ended every stream as if Redis were
    away."""
    upstream = h.state.upstream
    await h.redis.set(h.keys.aborts, b"not a stream")
    try:
        async with redis_out_of_memory(h):
            upstream.abort_soon("refused-for-good", "a test")
            await upstream.drain()
            assert "refused-for-good" in upstream._unsent_aborts
        for _ in range(60):
            if "refused-for-good" not in upstream._unsent_aborts:
                break
            await asyncio.sleep(0.05)
        assert "refused-for-good" not in upstream._unsent_aborts
    finally:
        await h.redis.delete(h.keys.aborts)


async def test_a_stalled_redis_ends_the_streams_before_the_socket_timeout(h: Harness) -> None:
    """Redis stops answering (paused here, SIGSTOP in the field) while a stream runs: the
    heartbeat gives up on a reply after HEARTBEAT_REPLY_S, so the stream ends with an error
    naming a stalled Redis within ~REDIS_UNREACHABLE_S. It waited for the pool's 10 s socket
    timeout before: the stream ended after ~20 s, and not at all if Redis came back sooner."""
    # a connection of its own, made before the pause: one made during it waits too
    admin = aioredis.Redis.from_url(h.config.redis_url, single_connection_client=True)
    await admin.ping()
    async with aiohttp.ClientSession() as session:
        async with session.post(h.url + "/v1/completions", json=completion(
                prompt="[slow]", max_tokens=100, stream=True)) as r:
            await r.content.readuntil(b"\n\n")
            await admin.execute_command("CLIENT", "PAUSE", "9000", "ALL")
            paused_at = time.monotonic()
            try:
                rest = await asyncio.wait_for(r.read(), 8.5)
                print(f"\nstalled Redis: the stream ended {time.monotonic() - paused_at:.1f} s "
                      "after it stopped answering")
            finally:
                await admin.execute_command("CLIENT", "UNPAUSE")
                await admin.aclose()
    assert b"Redis does not answer (stalled); the request cannot complete" in rest, rest[-500:]


async def test_a_request_sent_while_redis_stalls_is_refused_naming_it(h: Harness) -> None:
    """Redis stops answering (paused here, SIGSTOP in the field) before a request comes: its
    submit is given up on after SUBMIT_REPLY_S, a 503 naming a stalled Redis. It waited for
    the pool's 10 s socket timeout before (and for the pause's end, here 9 s)."""
    admin = aioredis.Redis.from_url(h.config.redis_url, single_connection_client=True,
                                    socket_timeout=30)
    await admin.ping()
    await admin.execute_command("CLIENT", "PAUSE", "9000", "ALL")
    try:
        status, body = await asyncio.wait_for(h.post("/v1/completions", completion()), 8)
    finally:
        await admin.execute_command("CLIENT", "UNPAUSE")
        await admin.aclose()
    assert status == 503, body
    assert body["error"]["message"] == ("the request could not be queued: Redis does not "
                                        "answer (stalled); try again later"), body


# ---- disconnects -----------------------------------------------------------------------------

async def test_streaming_client_that_disconnects_is_aborted(h: Harness) -> None:
    before = await _metric_values(h)
    async with aiohttp.ClientSession() as session:
        async with session.post(h.url + "/v1/completions",
                                json=completion(prompt="[slow]", max_tokens=100, stream=True)) as r:
            first = json.loads((await r.content.readuntil(b"\n\n"))[len(b"data: "):])
    assert await wait_for_abort(h, first["id"]) == "client disconnected"
    # counted as vLLM counts it: an "abort", with the tokens it generated
    after = await _metric_values(h)
    key = 'pacer:request_success_total{finished_reason="abort"}'
    assert after.get(key, 0) == before.get(key, 0) + 1
    assert after["pacer:generation_tokens_total"] > before.get("pacer:generation_tokens_total", 0)
    assert after["pacer:e2e_request_latency_seconds_count"] == \
        before.get("pacer:e2e_request_latency_seconds_count", 0) + 1


async def test_a_streaming_client_that_stops_reading_is_dropped(h: Harness) -> None:
    """A client that reads nothing while its stream's output waits (the socket's buffers
    full) is cut off after `stalled_client_timeout_s` (1 s here; 60 by default): the
    connection is reset and the handler ends, its request counted, instead of waiting on the
    socket for as long as the client keeps it open. Reset, not closed: closed, the server's
    kernel kept the MBs of output it held and sent them, then the FIN, only as the client read
    (a client that read again got them at the pace of the kernel's zero-window probes, which
    back off to minutes; one that never did kept that memory and its connection)."""
    before = await _metric_values(h)
    body = completion(prompt="[slow] x", max_tokens=100, n=128, logprobs=20, stream=True)
    async with _never_reading_client(h, "/v1/completions", body) as sock:
        ended = "pacer:e2e_request_latency_seconds_count"
        for _ in range(200):         # 128 streams of 100 tokens take 5 s; cut off before
            await asyncio.sleep(0.05)
            if (await _metric_values(h)).get(ended, 0) >= before.get(ended, 0) + 128:
                break
        assert (await _metric_values(h)).get(ended, 0) == before.get(ended, 0) + 128
        # still reading nothing, the client learns that the server dropped it
        await _until_reset(sock, 200)


async def test_a_client_that_never_reads_its_whole_answer_is_dropped(h: Harness) -> None:
    """A non-streamed answer of MBs (many choices with their logprobs) to a client that
    keeps its connection open and reads nothing is given up after `stalled_client_timeout_s`,
    as a stream's is: the connection is reset. Before, the gateway held the connection and
    the MBs the kernel did not take for as long as the client kept it open."""
    # ~3 MB: more than the kernel takes for a client whose window is small
    body = chat(max_tokens=60, n=128, logprobs=True, top_logprobs=20)
    async with _never_reading_client(h, "/v1/chat/completions", body) as sock:
        await _until_reset(sock, 600)       # the answer takes a few seconds to make, then 1 s


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
async def test_a_client_that_never_reads_a_big_tokenizer_answer_is_dropped(
        h: Harness, monkeypatch, path: str) -> None:
    """/tokenize's answer for a long text (~7 MB for a million ids with their strings) and
    /detokenize's for a long context are given up on as a generation's are. Written whole
    (web.Response), they were held, with the connection, for as long as the client kept it
    open."""
    # answers of ~7 MB: more than the kernel's send buffer takes (4 MB at most here)
    hello = h.tok.encode(" hello", add_special_tokens=False)
    body = {"prompt": " hello" * 400_000, "return_token_strs": True} if path == "/tokenize" \
        else {"tokens": hello * 1_200_000}
    monkeypatch.setattr(h.state, "max_model_len", 2 * 10 ** 6)
    async with _never_reading_client(h, path, body, max_body_bytes=16 * 2 ** 20) as sock:
        await _until_reset(sock, 600)


@contextlib.asynccontextmanager
async def _never_reading_client(h: Harness, path: str, body: dict, **config):
    """A socket that sent `body` to `path` and reads nothing, its window small, while the
    gateway gives up on a stalled client after 1 s (and takes `config` too)."""
    raw = json.dumps(body).encode()
    host, port = h.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)     # a small window, never read
    sock.setblocking(False)
    h.state.config = dataclasses.replace(h.config, stalled_client_timeout_s=1.0, **config)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_connect(sock, (host, int(port)))
        await loop.sock_sendall(sock, f"POST {path} HTTP/1.1\r\nHost: x\r\n".encode()
                                + b"Connection: close\r\n"
                                b"Content-Type: application/json\r\nContent-Length: "
                                + str(len(raw)).encode() + b"\r\n\r\n" + raw)
        yield sock
    finally:
        sock.close()
        h.state.config = h.config


async def _until_reset(sock: socket.socket, polls: int) -> None:
    """Until the server reset the connection (a poll every 50 ms, a safety net)."""
    for _ in range(polls):
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == errno.ECONNRESET:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the connection of a client that read nothing was not reset")


async def _metric_values(h: Harness) -> dict[str, float]:
    async with h.session.get(h.url + "/metrics") as r:
        text = await r.text()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


async def test_a_client_gone_from_a_responses_stream_is_aborted(h: Harness) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(h.url + "/v1/responses", json={
                "model": MODEL, "input": "[slow]", "max_output_tokens": 60,
                "stream": True}) as r:
            assert r.status == 200, await r.text()
            created = (await r.content.readuntil(b"\n\n")).decode().split("\n")[1]
            await r.content.readuntil(b"response.output_text.delta")   # tokens flowing
    response_id = json.loads(created[len("data: "):])["response"]["id"]
    assert await wait_for_abort(h, response_id) == "client disconnected"


async def test_a_client_gone_from_a_stream_of_choices_aborts_every_one(h: Harness) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(h.url + "/v1/completions",
                                json=completion(prompt="[slow]", max_tokens=100, stream=True,
                                                n=3)) as r:
            first = json.loads((await r.content.readuntil(b"\n\n"))[len(b"data: "):])
    for j in range(3):
        assert await wait_for_abort(h, f"{first['id']}-{j}") == "client disconnected"


async def test_non_streaming_client_that_disconnects_is_aborted(h: Harness) -> None:
    before = set(h.fake.received)
    async with aiohttp.ClientSession() as session:
        post = asyncio.create_task(session.post(h.url + "/v1/completions",
                                                json=completion(prompt="[slow]", max_tokens=100)))
        while not set(h.fake.received) - before:
            await asyncio.sleep(0.02)
        post.cancel()
        await asyncio.gather(post, return_exceptions=True)
    [request_id] = set(h.fake.received) - before
    assert await wait_for_abort(h, request_id) == "client disconnected"


# ---- health, metrics, auth -------------------------------------------------------------------

async def test_health_needs_a_scheduler_and_every_worker_rank(h: Harness) -> None:
    async def health() -> tuple[int, dict]:
        async with h.session.get(h.url + "/health") as r:
            return r.status, await r.json()

    status, body = await health()
    assert status == 503
    assert body["missing"] == ["scheduler", "worker rank 0", "worker rank 1"]
    await h.redis.set(h.keys.hb_scheduler("s0"), b"x", ex=30)
    await h.redis.set(h.keys.hb_worker(0), b"x", ex=30)
    status, body = await health()
    assert (status, body["missing"]) == (503, ["worker rank 1"])
    await h.redis.set(h.keys.hb_worker(1), b"x", ex=30)
    assert (await health())[0] == 200
    await h.redis.delete(h.keys.hb_scheduler("s0"))
    assert await health() == (503, {"status": "unhealthy", "missing": ["scheduler"]})


async def test_health_names_a_scheduler_of_another_protocol_version(h: Harness) -> None:
    """A scheduler of another pacer release (a rolling upgrade) beating in this Redis reads
    this gateway's requests from the shared stream and drops each as undecodable, its client
    waiting with no answer: /health said 200 (its key was there). It is 503, naming that
    scheduler and both protocol versions, also beside a scheduler of this version (the two
    share the request stream)."""
    import msgpack

    from shared.protocol import SCHEMA_VERSION

    async def health() -> tuple[int, list[str]]:
        async with h.session.get(h.url + "/health") as r:
            return r.status, (await r.json()).get("missing", [])

    old = msgpack.packb({"v": SCHEMA_VERSION - 1, "kind": "heartbeat", "service": "scheduler",
                         "id": "old", "time": 0.0, "extra": {}})
    why = (f"scheduler {h.keys.hb_scheduler('old')} speaks protocol version "
           f"{SCHEMA_VERSION - 1}, this gateway version {SCHEMA_VERSION}")
    await h.redis.set(h.keys.hb_worker(0), b"x", ex=30)
    await h.redis.set(h.keys.hb_worker(1), b"x", ex=30)
    try:
        await h.redis.set(h.keys.hb_scheduler("old"), old, ex=30)
        status, missing = await health()
        assert status == 503 and missing[0] == "scheduler"
        assert missing[1].startswith(why) and len(missing) == 2
        await h.redis.set(h.keys.hb_scheduler("s0"), b"x", ex=30)
        status, missing = await health()
        assert status == 503 and len(missing) == 1 and missing[0].startswith(why)
        await h.redis.delete(h.keys.hb_scheduler("old"))
        assert await health() == (200, [])
    finally:
        await h.redis.delete(h.keys.hb_scheduler("old"), h.keys.hb_scheduler("s0"),
                             h.keys.hb_worker(0), h.keys.hb_worker(1))


async def test_a_request_is_refused_while_a_scheduler_of_another_protocol_version_beats(
        h: Harness) -> None:
    """Such a scheduler reads this gateway's requests from the shared stream, cannot decode
    them and drops them: the client waited until its timeout (forever without one). A new
    request is refused at once with a 503 naming that scheduler and both versions, as the
    gateway last read the scheduler heartbeats; once it is gone, requests are served again."""
    import msgpack

    from shared.protocol import SCHEMA_VERSION

    async def answers() -> tuple[int, dict]:
        """The first answer that is not a 200 (the heartbeats are read every second), or the
        last 200."""
        for _ in range(100):
            status, body = await h.post("/v1/completions", completion(max_tokens=1))
            if status != 200:
                break
            await asyncio.sleep(0.05)
        return status, body

    old = msgpack.packb({"v": SCHEMA_VERSION - 1, "kind": "heartbeat", "service": "scheduler",
                         "id": "old", "time": 0.0, "extra": {}})
    try:
        await h.redis.set(h.keys.hb_scheduler("old"), old, ex=30)
        status, body = await answers()
        assert status == 503, body
        message = body["error"]["message"]
        assert (f"scheduler {h.keys.hb_scheduler('old')} speaks protocol version "
                f"{SCHEMA_VERSION - 1}, this gateway version {SCHEMA_VERSION}") in message
        assert "run the same pacer release" in message and body["error"]["type"] == "server_error"
        await h.redis.delete(h.keys.hb_scheduler("old"))
        for _ in range(100):
            status, body = await h.post("/v1/completions", completion(max_tokens=1))
            if status == 200:
                break
            assert status == 503 and "another protocol version" in body["error"]["message"]
            await asyncio.sleep(0.05)
        assert status == 200, body
    finally:
        await h.redis.delete(h.keys.hb_scheduler("old"))


async def test_health_with_replicas_needs_each_replicas_scheduler_and_workers(
        h: Harness, config: GatewayConfig) -> None:
    import dataclasses
    import time
    replicas = dataclasses.replace(config, key_prefix="gwhealth:", gateway_id="replicas",
                                   instances=(("r0", 1), ("r1", 1)), router="prefix")
    keys = Keys("gwhealth:")

    def beat(instance: str) -> bytes:
        return encode(Heartbeat("scheduler", f"host-{instance}", time.time(),
                                {"instance": instance, "role": "colocated"}))

    async with serve(replicas) as url:
        async def health() -> tuple[int, list[str]]:
            async with h.session.get(url + "/health") as r:
                return r.status, (await r.json()).get("missing", [])

        for i in ("r0", "r1"):
            await h.redis.set(keys.for_instance(i).hb_worker(0), b"x", ex=30)
        # r0's scheduler alone is not enough: r1 would take requests nobody reads
        await h.redis.set(keys.hb_scheduler("host-r0"), beat("r0"), ex=30)
        assert await health() == (503, ["instance r1 scheduler"])
        await h.redis.set(keys.hb_scheduler("junk"), b"not a heartbeat", ex=30)
        assert await health() == (503, ["instance r1 scheduler"])
        await h.redis.set(keys.hb_scheduler("host-r1"), beat("r1"), ex=30)
        assert await health() == (200, [])
        await h.redis.delete(keys.for_instance("r1").hb_worker(0))
        assert await health() == (503, ["instance r1 worker rank 0"])
        await h.redis.delete(keys.hb_scheduler("host-r0"))
        assert await health() == (503, ["instance r0 scheduler", "instance r1 worker rank 0"])
    await h.redis.delete(*[k async for k in h.redis.scan_iter(match="gwhealth:*")])


async def test_the_router_remembers_a_prefix_where_its_prompt_was_computed(
        h: Harness, config: GatewayConfig) -> None:
    """P/D with two prefill instances: the router remembers a prompt's prefix at the prefill
    instance it chose, until its first token says which instance computed it. A prompt under
    --disagg-min-prompt-tokens is computed by the decode instance; a prefill scheduler keeps
    an entry named for a peer it does not see live. The memory stayed at the instance chosen,
    which does not hold the prefix, and the next prompt sharing it was sent there (sticky)
    rather than where the cache is, or where the load says."""
    pd = dataclasses.replace(config, gateway_id="pd-router", router="prefix",
                             instances=(("p0", 1), ("p1", 1), ("d0", 1)),
                             route_prefill=("p0", "p1"))
    stats = {i: h.keys.for_instance(i).stats for i in ("p0", "p1")}

    async def idle(busy: str = "") -> None:
        """The prefill instances' stats, idle but for one request waiting at `busy` (another
        gateway's)."""
        for inst, key in stats.items():
            await h.redis.hset(key, mapping={
                "num_requests_running": 0, "num_requests_waiting": int(inst == busy),
                "kv_cache_usage_perc": 0.0, "block_size": 4})

    system = "The quick brown fox jumps over the lazy dog and runs far away. " * 3
    other = "Pack my box with five dozen liquor jugs, said the sphinx of black quartz. " * 3

    async def sent_to(prompt: str) -> str:
        async with h.session.post(url + "/v1/completions", json=completion(
                prompt=prompt, max_tokens=2)) as r:
            assert r.status == 200, await r.text()
            return h.fake.received[(await r.json())["id"]].instance

    try:
        await idle()
        async with serve(pd) as url:
            # prefilled by the decode instance, which no request is routed to: forgotten
            assert await sent_to(system + "[on-d0]") == "p0"
            await idle(busy="p0")
            assert await sent_to(system + "What next?") == "p1"
            # routed to p0 (p1 busy), kept and computed by p1: remembered at p1
            await idle(busy="p1")
            assert await sent_to(other + "[on-p1]") == "p0"
            assert await sent_to(other + "What next?") == "p1"
    finally:
        await h.redis.delete(*stats.values())


async def test_a_gateway_that_stops_cleanly_takes_its_heartbeat_key_with_it(
        h: Harness, config: GatewayConfig) -> None:
    """As a scheduler and a worker do: /health and the schedulers (which end a gone gateway's
    requests) see it gone at once, not after the key's TTL."""
    leaving = dataclasses.replace(config, gateway_id="leaving")
    key = h.keys.hb_gateway("leaving")
    async with serve(leaving) as url:
        async with h.session.get(url + "/v1/models") as r:
            assert r.status == 200
        for _ in range(100):
            if await h.redis.exists(key):
                break
            await asyncio.sleep(0.05)
        assert await h.redis.exists(key)
    assert not await h.redis.exists(key)


async def test_metrics_exposes_gateway_and_scheduler_numbers(h: Harness) -> None:
    await h.post("/v1/completions", completion(max_tokens=4))
    await h.redis.hset(h.keys.stats, mapping={"num_requests_running": 3, "num_requests_waiting": 5,
                                              "kv_cache_usage_perc": 0.25,
                                              "num_preemptions_total": 7,
                                              "prefix_cache_queries_total": 96,
                                              "prefix_cache_hits_total": 64,
                                              "num_iterations_total": 11})
    await h.redis.set(h.keys.hb_scheduler("s-metrics"), b"x", ex=30)
    async with h.session.get(h.url + "/metrics") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    lines = set(text.splitlines())
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds"):
        assert f"# TYPE pacer:{name} histogram" in lines
    assert "pacer:num_requests_running 3.0" in lines
    assert "pacer:num_requests_waiting 5.0" in lines
    assert "pacer:kv_cache_usage_perc 0.25" in lines
    assert "pacer:num_preemptions_total 7.0" in lines
    assert "pacer:prefix_cache_queries_total 96.0" in lines
    assert "pacer:prefix_cache_hits_total 64.0" in lines
    values = {line.split()[0]: float(line.split()[1]) for line in lines
              if line and not line.startswith("#")}
    assert values["pacer:prompt_tokens_total"] > 0
    assert values["pacer:generation_tokens_total"] >= 4
    assert values["pacer:time_to_first_token_seconds_count"] >= 1
    assert values["pacer:inter_token_latency_seconds_count"] >= 3
    assert values["pacer:iterations_total"] == 11 and values["pacer:num_requests_queued"] == 0
    # a colocated engine reports no P/D figures: left out, not NaN (a NaN counter breaks rate())
    assert not any(n.startswith(("pacer:handoffs", "pacer:kv_transfer")) for n in values)
    assert not [n for n, v in values.items() if math.isnan(v)]
    assert not [n for n in values if n.endswith("_created")]       # as vLLM: no _created series
    await h.redis.delete(h.keys.hb_scheduler("s-metrics"))


async def test_metrics_count_unread_requests_and_know_a_stopped_schedulers_gauges_are_stale(
        h: Harness, config: GatewayConfig) -> None:
    """Requests no scheduler has read yet are `num_requests_queued` (the request stream's lag),
    and the gauges of a scheduler whose heartbeat is gone are NaN, not its last snapshot; its
    counters stay."""
    alone = dataclasses.replace(config, key_prefix="gwmetrics:", gateway_id="metrics")
    keys = Keys("gwmetrics:")
    await h.redis.hset(keys.stats, mapping={"num_requests_running": 3, "num_requests_waiting": 2,
                                            "num_iterations_total": 9})
    await h.redis.xgroup_create(keys.requests, keys.requests_group, id="0", mkstream=True)
    for i in range(3):
        await h.redis.xadd(keys.requests, {"n": i})

    async def scrape(url: str) -> dict[str, float]:
        async with h.session.get(url + "/metrics") as r:
            return {line.split()[0]: float(line.split()[1])
                    for line in (await r.text()).splitlines() if line and line[0] != "#"}
    async with serve(alone) as url:
        values = await scrape(url)
        assert math.isnan(values["pacer:num_requests_running"])
        assert math.isnan(values["pacer:num_requests_waiting"])
        assert values["pacer:iterations_total"] == 9 and values["pacer:num_requests_queued"] == 3
        await h.redis.set(keys.hb_scheduler("s0"), b"x", ex=30)
        await h.redis.xreadgroup(keys.requests_group, "c", {keys.requests: ">"}, count=2)
        values = await scrape(url)
        assert values["pacer:num_requests_running"] == 3 and values["pacer:num_requests_waiting"] == 2
        assert values["pacer:num_requests_queued"] == 1
    await h.redis.delete(*[k async for k in h.redis.scan_iter(match="gwmetrics:*")])


async def test_metrics_count_requests_queued_before_any_scheduler_started(
        h: Harness, config: GatewayConfig) -> None:
    """No scheduler has made its group on the request stream yet (the first one still loads
    its model): every entry there is unread, not none (the group it makes starts at 0)."""
    alone = dataclasses.replace(config, key_prefix="gwqueued:", gateway_id="queued")
    keys = Keys("gwqueued:")
    for i in range(2):
        await h.redis.xadd(keys.requests, {"n": i})
    async with serve(alone) as url, h.session.get(url + "/metrics") as r:
        lines = (await r.text()).splitlines()
    await h.redis.delete(*[k async for k in h.redis.scan_iter(match="gwqueued:*")])
    assert "pacer:num_requests_queued 2.0" in lines


async def test_metrics_scraped_side_by_side_each_hold_every_series(h: Harness) -> None:
    """Scrapes that overlap (two Prometheus servers, a dashboard beside them) each report the
    scheduler's gauges: one must not collect another's half-read snapshot and lose them."""
    import random
    rng = random.Random(0)
    await h.redis.hset(h.keys.stats, mapping={"num_requests_running": 3,
                                              "num_requests_waiting": 1})
    await h.redis.set(h.keys.hb_scheduler("s-side"), b"x", ex=30)

    async def scrape() -> str:
        await asyncio.sleep(rng.random() * 0.05)      # starts spread over each other's reads
        async with h.session.get(h.url + "/metrics") as r:
            return await r.text()
    texts = await asyncio.gather(*(scrape() for _ in range(100)))
    await h.redis.delete(h.keys.hb_scheduler("s-side"))
    missing = [t for t in texts if "pacer:num_requests_running 3.0" not in t.splitlines()]
    assert not missing, f"{len(missing)} of {len(texts)} scrapes lost the scheduler's gauges"


async def test_the_api_docs_name_every_series_metrics_exports(
        h: Harness, config: GatewayConfig) -> None:
    """docs/api.md#metrics is where a user looks up what to scrape: every series /metrics can
    export (a scheduler's stats hash with every field it may hold, P/D's too, and a restart)
    is named there. The latency histograms, the 429 counter and the cost model's fit were
    exported and named nowhere."""
    from gateway.metrics import _SCHEDULER_STATS
    alone = dataclasses.replace(config, key_prefix="gwdocs:", gateway_id="docs")
    keys = Keys("gwdocs:")
    await h.redis.hset(keys.stats, mapping={field: 1 for field in _SCHEDULER_STATS})
    await h.redis.hset(keys.restarts, mapping={"scheduler": 1})
    await h.redis.set(keys.hb_scheduler("s-docs"), b"x", ex=30)
    async with serve(alone) as url, h.session.get(url + "/metrics") as r:
        text = await r.text()
    await h.redis.delete(*[k async for k in h.redis.scan_iter(match="gwdocs:*")])
    exported = re.findall(r"^# TYPE (\S+) ", text, re.M)
    assert len(exported) > len(_SCHEDULER_STATS), exported
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "docs", "api.md")) as f:
        section = f.read().split("\n## Metrics\n", 1)[-1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(pacer:\w+)", section))
    assert not [n for n in exported if n not in named], sorted(set(exported) - named)


async def test_api_key_is_required_on_the_openai_routes(h: Harness, config: GatewayConfig) -> None:
    import dataclasses
    keyed = dataclasses.replace(config, api_key="sekret", gateway_id="keyed")
    async with serve(keyed) as url:
        async with h.session.get(url + "/v1/models") as r:
            assert r.status == 401
            assert (await r.json())["error"]["code"] == "invalid_api_key"
        async with h.session.post(url + "/v1/completions", json=completion(),
                                  headers={"Authorization": "Bearer wrong"}) as r:
            assert r.status == 401
        async with h.session.post(url + "/v1/completions", json=completion(max_tokens=2),
                                  headers={"Authorization": "Bearer sekret"}) as r:
            assert r.status == 200
            assert (await r.json())["choices"][0]["text"] == reply_text(h.tok, 2)
        async with h.session.post(url + "/tokenize", json={"prompt": "x"}) as r:
            assert r.status == 401              # the tokenizer's routes too
        async with h.session.get(url + "/health") as r:
            assert r.status in (200, 503)       # not behind the key


async def test_an_api_key_header_that_is_not_utf8_is_a_401(h: Harness,
                                                           config: GatewayConfig) -> None:
    """A key's bytes that are not UTF-8 (anyone may send them, before any key is checked)
    were a 500 and a traceback in the log; they are a wrong key. A key given as such bytes
    (a command line's, read with surrogateescape) is taken when they come."""
    for key, sent, expected in (("sekret", b"\xff\xfe", b"HTTP/1.1 401"),
                                ("sekret", b"sekret", b"HTTP/1.1 200"),
                                ("s\udcffkret", b"s\xffkret", b"HTTP/1.1 200")):
        keyed = dataclasses.replace(config, api_key=key, gateway_id="keyed-bytes")
        async with serve(keyed) as url:
            host, port = url.removeprefix("http://").rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                         b"Authorization: Bearer " + sent + b"\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), 10.0)
            writer.close()
            assert answer.startswith(expected), (key, sent, answer[:300])


def _logprob_tokens(endpoint: str, chunks: list[dict]) -> tuple[str, list[str]]:
    """The text and the logprob tokens of a response, or of a stream's chunks."""
    text, tokens = "", []
    for c in chunks:
        for choice in c.get("choices", []):
            if endpoint == "chat":
                part = choice.get("message") or choice.get("delta") or {}
                text += part.get("content") or ""
                tokens += [e["token"] for e in (choice["logprobs"] or {}).get("content", [])]
            else:
                text += choice["text"]
                tokens += (choice["logprobs"] or {}).get("tokens", [])
    return text, tokens


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_logprobs_cover_the_text_cut_at_a_stop_string(h: Harness, endpoint: str,
                                                                     stream: bool) -> None:
    # the logprobs are those of the tokens whose text starts in the text returned: the "."
    # token is all stop string, so it has none; of "STOP" (" ST" + "OP") the returned text
    # ends with the space of " ST", whose logprob is sent with it, while "OP" has none
    body = (chat(logprobs=True, top_logprobs=1) if endpoint == "chat"
            else completion(logprobs=1, max_tokens=40))
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    for stop, expected, expected_tokens in (
            (["."], "Hello world, this is pacer", "Hello world, this is pacer"),
            (["STOP"], "Hello world, this is pacer. ", "Hello world, this is pacer. ST")):
        if stream:
            data = await h.sse(path, {**body, "stop": stop})
            chunks = [json.loads(d) for d in data[:-1]]
        else:
            status, answer = await h.post(path, {**body, "stop": stop})
            assert status == 200, answer
            chunks = [answer]
        text, tokens = _logprob_tokens(endpoint, chunks)
        assert text == expected
        assert "".join(tokens) == expected_tokens, tokens


# ---- bad requests ----------------------------------------------------------------------------

BAD_REQUESTS = {
    "malformed json": ("/v1/completions", b'{"model": "test-model", "prompt": ', 400),
    "body not an object": ("/v1/completions", [1, 2], 400),
    "unknown model": ("/v1/completions", completion(model="gpt-4"), 404),
    "max_tokens 0": ("/v1/completions", completion(max_tokens=0), 400),
    "max_tokens negative": ("/v1/chat/completions", chat(max_tokens=-3), 400),
    "prompt + max_tokens beyond context": ("/v1/completions", completion(max_tokens=MAX_MODEL_LEN), 400),
    "negative temperature": ("/v1/completions", completion(temperature=-0.1), 400),
    "top_p 0": ("/v1/completions", completion(top_p=0), 400),
    "top_p above 1": ("/v1/chat/completions", chat(top_p=1.5), 400),
    "prompt longer than context (ids)": ("/v1/completions", completion(prompt=[5] * (MAX_MODEL_LEN + 1)), 400),
    "prompt longer than context (text)": ("/v1/chat/completions", chat("word " * 200), 400),
    "max_tokens a string": ("/v1/completions", completion(max_tokens="5"), 400),
    "max_tokens a boolean": ("/v1/completions", completion(max_tokens=True), 400),
    "max_tokens not whole": ("/v1/completions", completion(max_tokens=2.5), 400),
    "truncate_prompt_tokens above the context": (
        "/v1/completions", completion(truncate_prompt_tokens=MAX_MODEL_LEN + 1), 400),
    "a user message without content": ("/v1/chat/completions",
                                       {"model": MODEL, "messages": [{"role": "user"}]}, 400),
    "a system message of null content": ("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "system", "content": None}, {"role": "user", "content": "x"}]}, 400),
    "temperature a string": ("/v1/chat/completions", chat(temperature="hot"), 400),
    "stream a string": ("/v1/completions", completion(stream="yes"), 400),
    "messages a string": ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400),
    "message without role": ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "x"}]}, 400),
    "message with an unknown role": ("/v1/chat/completions",
                                     {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400),
    "prompt a number": ("/v1/completions", completion(prompt=5), 400),
    "stop a number list": ("/v1/completions", completion(stop=[1]), 400),
    "token id outside the vocabulary": ("/v1/completions", completion(prompt=[10**9]), 400),
    "a stop token id outside the vocabulary": ("/v1/completions",
                                               completion(stop_token_ids=[-1]), 400),
    "allowed_token_ids empty": ("/v1/chat/completions", chat(allowed_token_ids=[]), 400),
    "allowed_token_ids too many": ("/v1/completions", completion(allowed_token_ids=[5] * 1025),
                                   400),
    "stop_token_ids too many": ("/v1/completions", completion(stop_token_ids=[5] * 1025), 400),
    "bad_words too many": ("/v1/completions", completion(bad_words=["a"] * 1025), 400),
    "stop strings too many": ("/v1/completions", completion(stop=["a"] * 65), 400),
    "a stop string too long": ("/v1/completions", completion(stop="a" * 1025), 400),
    "beam search": ("/v1/completions", completion(use_beam_search=True), 400),
    "a chat template of the request's": ("/v1/chat/completions", chat(chat_template="{{ 1 }}"),
                                         400),
    "audio output": ("/v1/chat/completions", chat(modalities=["text", "audio"]), 400),
    "empty prompt": ("/v1/completions", completion(prompt=""), 400),
    "missing prompt": ("/v1/completions", {"model": MODEL}, 400),
    "missing messages": ("/v1/chat/completions", {"model": MODEL}, 400),
    "missing model": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, 400),
    "n=0": ("/v1/completions", completion(n=0), 400),
    "best_of below n": ("/v1/completions", completion(n=3, best_of=2), 400),
    "best_of above n": ("/v1/completions", completion(best_of=2), 400),
    "choices past the bound": ("/v1/completions", completion(prompt=["a", "b"], n=65), 400),
    "an empty prompt in a batch": ("/v1/completions", completion(prompt=[[1, 2], []]), 400),
    "a bad token id in a batch": ("/v1/completions", completion(prompt=["fine", [10**9]]), 400),
    "logprobs above 20": ("/v1/completions", completion(logprobs=50), 400),
    "top_logprobs without logprobs": ("/v1/chat/completions", chat(top_logprobs=2), 400),
    "stream_options without stream": ("/v1/completions", completion(stream_options={"include_usage": True}), 400),
    "oversized body": ("/v1/completions", completion(prompt="x" * (128 * 1024)), 413),
    "unknown route": ("/v1/embeddings", completion(), 404),
    "responses: missing input": ("/v1/responses", {"model": MODEL}, 400),
    "responses: empty input": ("/v1/responses", {"model": MODEL, "input": []}, 400),
    "responses: a function call output without its output": ("/v1/responses", {
        "model": MODEL, "input": [{"type": "function_call_output", "call_id": "c"}]}, 400),
    "responses: a function call output answering no call": ("/v1/responses", {
        "model": MODEL, "input": [{"type": "function_call_output", "call_id": "c",
                                   "output": "18 C"}]}, 400),
    "responses: a reasoning item": ("/v1/responses", {"model": MODEL, "input": [
        {"type": "reasoning", "summary": []}]}, 400),
    "responses: an image part": ("/v1/responses", {"model": MODEL, "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400),
    "responses: chat's messages": ("/v1/responses", {"model": MODEL, "input": "x",
                                                     "messages": []}, 400),
    "responses: max_output_tokens 0": ("/v1/responses", {"model": MODEL, "input": "x",
                                                         "max_output_tokens": 0}, 400),
    "responses: a stored response": ("/v1/responses", {"model": MODEL, "input": "x",
                                                       "previous_response_id": "resp_1"}, 400),
    "responses: a hosted tool": ("/v1/responses", {"model": MODEL, "input": "x",
                                                   "tools": [{"type": "web_search"}]}, 400),
    "responses: tool_choice required without tools": ("/v1/responses", {
        "model": MODEL, "input": "x", "tool_choice": "required"}, 400),
    "responses: an include not served": ("/v1/responses", {
        "model": MODEL, "input": "x", "include": ["reasoning.encrypted_content"]}, 400),
    "responses: top_logprobs above 20": ("/v1/responses", {
        "model": MODEL, "input": "x", "top_logprobs": 21}, 400),
    "responses: a schema format without a schema": ("/v1/responses", {
        "model": MODEL, "input": "x", "text": {"format": {"type": "json_schema"}}}, 400),
    "responses: unknown truncation": ("/v1/responses", {"model": MODEL, "input": "x",
                                                        "truncation": "middle"}, 400),
}


BAD_SCHEMA = {"type": "objecx"}


@pytest.mark.parametrize("path,fields,param,named", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": BAD_SCHEMA}}}, "response_format", "response_format's schema"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x",
                                           "schema": BAD_SCHEMA}}}, "text.format",
     "text.format's schema"),
    ("/v1/chat/completions", {"guided_json": BAD_SCHEMA}, "guided_json", "guided_json"),
    ("/v1/chat/completions", {"guided_regex": "[a-"}, "guided_regex", "guided_regex"),
    ("/v1/chat/completions", {"structured_outputs": {"json": BAD_SCHEMA}}, "structured_outputs",
     "structured_outputs.json"),
])
async def test_a_constraint_that_is_no_grammar_is_refused_naming_its_field(
        h: Harness, path: str, fields: dict, param: str, named: str) -> None:
    """Named as the request sent it: a response_format's schema was called
    structured_outputs.json, a field the client never sent."""
    body = chat() if path == "/v1/chat/completions" else {"model": MODEL, "input": "x"}
    status, error = await h.post(path, body | fields)
    assert status == 400 and error["error"]["param"] == param, error
    assert error["error"]["message"].startswith(f"{named} is not valid: "), error


@pytest.mark.parametrize("path,fields,param,says", [
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x"}}},
     "text.format.schema", "'text.format.schema' must be a JSON schema"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x", "strict": "yes",
                                           "schema": {"type": "object"}}}},
     "text.format", "text.format.strict must be a boolean"),
    ("/v1/chat/completions", {"guided_choice": "yes"}, "guided_choice",
     "guided_choice must be a non-empty list"),
    ("/v1/chat/completions", {"guided_json": 5}, "guided_json",
     "guided_json must be a JSON schema"),
    ("/v1/chat/completions", {"guided_json": {"type": "object"}, "guided_regex": "[a-z]+"},
     "guided_regex", "give one constraint on the output, not guided_json and guided_regex"),
    ("/v1/chat/completions", {"guided_json": {"type": "object"}, "guided_whitespace_pattern": 5},
     "guided_whitespace_pattern", "'guided_whitespace_pattern' must be a string"),
])
async def test_a_malformed_constraint_is_refused_naming_the_field_sent(
        h: Harness, path: str, fields: dict, param: str, says: str) -> None:
    """A Responses schema format's errors name its own fields (chat's json_schema is no
    field of /v1/responses), and vLLM's guided_* fields their own, not structured_outputs."""
    body = chat() if path == "/v1/chat/completions" else {"model": MODEL, "input": "x"}
    status, error = await h.post(path, body | fields)
    assert status == 400 and error["error"]["param"] == param, error
    assert error["error"]["message"].startswith(says), error
    assert ".json_schema" not in error["error"]["message"] and \
        "structured_outputs" not in error["error"]["message"], error


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
async def test_bad_requests_get_openai_errors_and_the_service_keeps_serving(h: Harness, case: str) -> None:
    path, body, expected = BAD_REQUESTS[case]
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    before = len(h.fake.received)
    async with h.session.post(h.url + path, data=data,
                              headers={"Content-Type": "application/json",
                                       "X-Request-Id": "client-7"}) as r:
        assert r.status == expected, await r.text()
        assert r.headers.get("X-Request-Id") == "client-7"      # sent back on a refusal too
        error = (await r.json())["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert len(h.fake.received) == before          # nothing was enqueued
    status, ok = await h.post("/v1/completions", completion(max_tokens=2))
    assert status == 200 and ok["choices"][0]["text"] == reply_text(h.tok, 2)


# ---- pieces without Redis: text output, event order, logging ---------------------------------

@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    from shared.model_source import resolve_model
    from shared.tokenizer import load_tokenizer
    return load_tokenizer(resolve_model(None))


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab .ST\né😀", max_size=30),
       stops=st.lists(st.text(alphabet="ab .ST\né", min_size=1, max_size=4), max_size=2))
async def test_streamed_text_is_the_text_cut_at_the_first_stop_string(tokenizer: Tokenizer, text: str,
                                                                stops: list[str]) -> None:
    ids = tokenizer.encode(text)
    assume(tokenizer.decode(ids) == text)
    # generation stops after the first token whose text completes a stop string (as vLLM
    # does), cut where the earliest stop string present then starts: with text 'SéS' and
    # stops ['é', 'SéS'], 'é' completes first and 'S' is the output
    expected, hits = text, []
    for k in range(1, len(ids) + 1):
        seen = tokenizer.decode(ids[:k])
        hits = [i for s in stops if (i := seen.find(s)) >= 0]
        if hits:
            expected = seen[:min(hits)]
            break
    out = TextOutput(IncrementalDetokenizer(tokenizer, [1]), tuple(stops))
    pieces = []
    for token_id in ids:
        out.add(token_id)
        pieces.append(out.take())
        if out.stopped:
            break
    out.finish()
    pieces.append(out.take(final=True))
    assert "".join(pieces) == expected
    assert out.stopped == bool(hits)


async def test_missing_tokens_after_the_finish_event_end_the_stream_after_a_grace() -> None:
    stream = RequestStream("r", finish_grace_s=0.05)
    for item in (TokenEvent("r", 0, 10), TokenEvent("r", 2, 12), TokenEvent("r", 0, 10),
                 FinishEvent("r", "length", 1, 4)):
        stream.push(item)
    tokens, finish = await stream.next()
    assert [t.index for t in tokens] == [0] and finish is None     # 1 is missing: wait for it
    tokens, finish = await stream.next()                            # it never comes
    assert [t.index for t in tokens] == [2] and finish.num_output_tokens == 4


async def test_the_cached_tokens_first_reported_stand_after_a_takeover() -> None:
    """A scheduler that took a request over after a restart admits it again against its own
    prefix cache: the usage keeps what the cache held when the request was first scheduled."""
    router = TokenRouter(None, "channel")
    stream = router.open("r")
    router.route(encode(TokenBatch([TokenEvent("r", 0, 10)], cached={"r": 32})))
    router.route(encode(TokenBatch([TokenEvent("r", 1, 11)], cached={"r": 0})))   # the new one
    router.route(encode(FinishEvent("r", "length", 40, 2, num_cached_tokens=16)))
    await stream.next()
    assert stream.num_cached_tokens == 32


async def test_tokens_past_the_schedulers_count_are_not_output() -> None:
    stream = RequestStream("r")
    for item in (TokenEvent("r", 1, 11), FinishEvent("r", "abort", 1, 2), TokenEvent("r", 0, 10),
                 TokenEvent("r", 2, 12)):
        stream.push(item)
    tokens, finish = await stream.next()
    assert [t.index for t in tokens] == [0, 1] and finish.finish_reason == "abort"


async def test_a_body_that_never_arrives_holds_no_place_and_times_out(h: Harness,
                                                                      monkeypatch) -> None:
    """Headers and a few bytes of a body, then nothing (slowloris): no place in the bounded
    queue while it waits, and a 408 once the body is overdue."""
    import gateway.handlers
    monkeypatch.setattr(gateway.handlers, "BODY_TIMEOUT_S", 1.0)
    host, port = h.url.removeprefix("http://").rsplit(":", 1)
    conns = [await asyncio.open_connection(host, int(port)) for _ in range(3)]
    for _, writer in conns:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                     b"Content-Type: application/json\r\n\r\n{\"mo")
        await writer.drain()
    await asyncio.sleep(0.3)
    assert h.state.num_waiting == 0
    status, ok = await h.post("/v1/completions", completion(max_tokens=2))
    assert status == 200
    for reader, writer in conns:
        head = await asyncio.wait_for(reader.read(4096), 5.0)
        assert head.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in head
        writer.close()


async def test_a_full_queue_is_a_429_before_the_body_arrives(h: Harness, monkeypatch) -> None:
    """The queue full (one place, a request that waits in it): a new request's 429 comes at
    once, not after its body (here never sent: it was a 408 once the body was overdue)."""
    monkeypatch.setattr(h.state, "config", dataclasses.replace(h.config, max_waiting_requests=1))

    async def waits() -> None:
        async with h.session.post(h.url + "/v1/completions", json=completion(
                prompt="[queued] waits", max_tokens=2, stream=True)) as r:
            await r.read()
    waiting = asyncio.create_task(waits())
    while h.state.num_waiting == 0:
        await asyncio.sleep(0.05)
    host, port = h.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                     b"Content-Type: application/json\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10.0)
        assert head.startswith(b"HTTP/1.1 429") and b"Retry-After: 1\r\n" in head, head
    finally:
        writer.close()
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)


async def test_a_burst_of_connections_waits_to_be_accepted_rather_than_dropped(
        h: Harness) -> None:
    """More connections at once than aiohttp's listen backlog (128) while the gateway accepts
    none (its event loop held here, as a burst holds it): the kernel completes and keeps
    them all. Past a backlog of 128 it dropped their handshakes, and in a burst of 1,000
    clients sending MBs of body some saw their connection reset instead of the answer."""
    burst = 300
    if int(open("/proc/sys/net/core/somaxconn").read()) < burst:
        pytest.skip("net.core.somaxconn caps every listen backlog below the burst")
    host, port = h.url.removeprefix("http://").rsplit(":", 1)
    conns = []
    try:
        for _ in range(burst):      # blocking, the event loop held: nothing is accepted
            conns.append(socket.create_connection((host, int(port)), timeout=1.0))
    except TimeoutError:
        pass
    finally:
        for sock in conns:
            sock.close()
    assert len(conns) == burst
    status, _ = await h.post("/v1/completions", completion(max_tokens=2))
    assert status == 200


async def test_a_text_too_long_for_any_tokenization_is_refused_before_it_is_tokenized(
        h: Harness, monkeypatch) -> None:
    """More characters than the context's tokens can hold: a 400 without tokenizing (which
    took seconds and gigabytes for megabytes of text); with truncate_prompt_tokens, its end."""
    calls = []
    encode = h.tok.encode
    monkeypatch.setattr(h.tok, "encode", lambda text, **kw: calls.append(len(text)) or
                        encode(text, **kw))
    long = "ab " * (MAX_MODEL_LEN * h.tok.most_chars_per_token // 3 + 1)
    for body in (completion(prompt=long), chat(long)):
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        status, error = await h.post(path, body)
        assert status == 400 and error["error"]["code"] == "context_length_exceeded", error
    assert calls == []
    longer = long * 3                  # past twice what fits: only its end is tokenized
    status, ok = await h.post("/v1/completions", completion(prompt=longer, max_tokens=2,
                                                            truncate_prompt_tokens=8))
    assert status == 200 and calls and calls[-1] < len(longer)
    assert list(h.fake.received.values())[-1].prompt_token_ids == encode(longer)[-8:]


async def test_token_ids_past_the_context_are_refused_before_they_are_checked(
        h: Harness) -> None:
    """A body carries ~1.4 million ids, and checking each held the event loop, every stream
    stalled, before the context's limit refused them: a prompt of more ids than the context
    holds is refused before any is looked at (the "x" past its end is never read), and with
    truncate_prompt_tokens only its end is looked at."""
    too_long = [5] * MAX_MODEL_LEN + ["x"]
    for prompt in (too_long, [[5, 6], too_long]):
        status, error = await h.post("/v1/completions", completion(prompt=prompt))
        assert status == 400 and error["error"]["code"] == "context_length_exceeded", error
        assert f"the prompt has {MAX_MODEL_LEN + 1} tokens" in error["error"]["message"]
    status, ok = await h.post("/v1/completions", completion(
        prompt=["x"] + [5] * MAX_MODEL_LEN + [6, 7], max_tokens=2, truncate_prompt_tokens=3))
    assert status == 200, ok
    assert h.fake.received[ok["id"]].prompt_token_ids == [5, 6, 7]


async def test_a_burst_of_redis_commands_waits_for_connections_rather_than_failing(
        h: Harness) -> None:
    """More commands in flight than the gateway's pool has connections (a burst of requests
    and aborts): they wait their turn, none fails with "Too many connections"."""
    from gateway.app import REDIS_CONNECTIONS
    waits = [h.state.redis.blpop([f"{PREFIX}nothing-{i}"], timeout=0.3)
             for i in range(REDIS_CONNECTIONS * 2 + 30)]
    assert await asyncio.gather(*waits) == [None] * len(waits)


async def test_the_token_gap_histogram_counts_every_token_past_the_first() -> None:
    """vLLM's count (tokens less requests), also where the first token's companions arrive
    with it (a slow event loop finds several batches at once): one gap of 0 each."""
    from types import SimpleNamespace

    from gateway.generation import Generation
    from gateway.metrics import GatewayMetrics
    metrics = GatewayMetrics()
    gen = SimpleNamespace(_last_token_at=None, _arrival=0.0, _metrics=metrics)
    for arrived in (3, 1, 2):                  # 6 tokens of one request
        Generation._observe_latency(gen, arrived)
    count = metrics.registry.get_sample_value("pacer:inter_token_latency_seconds_count")
    assert count == 5
    assert metrics.registry.get_sample_value("pacer:time_to_first_token_seconds_count") == 1


async def test_whole_numbers_written_as_floats_are_read_as_integers() -> None:
    """4.0 where an integer is asked (a client that computed it): read as 4, as vLLM's
    pydantic models read it; 2.5 stays a 400 (BAD_REQUESTS)."""
    from gateway.openai_schema import parse_chat, parse_completion
    request = parse_completion({"model": MODEL, "prompt": "x", "max_tokens": 4.0, "n": 2.0,
                                "top_k": 5.0, "seed": 7.0})
    assert (request.max_tokens, request.n, request.top_k, request.seed) == (4, 2, 5, 7)
    assert all(type(v) is int for v in (request.max_tokens, request.n, request.top_k))
    chat_request = parse_chat({"model": MODEL, "max_tokens": 3.0, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                                           "tool_calls": []}]})
    assert chat_request.max_tokens == 3


async def test_long_token_id_lists_are_not_held_to_the_sampling_fields_bound() -> None:
    """The bound on allowed_token_ids and stop_token_ids is theirs alone: a token-id prompt
    and /detokenize take as many as the context holds."""
    from gateway.openai_schema import parse_completion, parse_detokenize
    ids = [5] * 3000
    assert parse_completion({"model": MODEL, "prompt": ids}).prompts == (ids,)
    assert parse_detokenize({"tokens": ids}, 3000) == (None, ids)


async def test_a_tool_named_twice_is_refused_and_many_tools_are_read_in_one_pass() -> None:
    """Each tool's name was looked for among all before it: the 60,000 tools a 4 MB body
    holds took ~30 s, all of it on the event loop (here a thread is given 10 s for a pass
    that takes some milliseconds)."""
    from gateway.openai_schema import APIError, parse_chat
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(60_000)]
    body = chat(tools=tools + [tools[7]], tool_choice="none")
    parse = asyncio.to_thread(parse_chat, body)
    with pytest.raises(APIError, match="tools name the function 'f7' twice") as refused:
        await asyncio.wait_for(parse, 10)
    assert refused.value.param == "tools"


async def test_detokenize_takes_no_more_ids_than_the_context_holds(h: Harness) -> None:
    """A body's worth of ids (1.4 million in 4 MB) held the event loop, and every stream,
    for ~2 s while they were checked and decoded: more than the model's context holds is a
    400 saying so, refused before any id is looked at."""
    status, answer = await h.post("/detokenize", {"tokens": [5] * MAX_MODEL_LEN})
    assert status == 200 and answer["prompt"] == h.tok.decode([5] * MAX_MODEL_LEN,
                                                              skip_special_tokens=False)
    status, answer = await h.post("/detokenize", {"tokens": [5] * MAX_MODEL_LEN + ["x"]})
    assert status == 400, answer
    assert answer["error"]["param"] == "tokens"
    assert answer["error"]["message"] == (f"'tokens' holds {MAX_MODEL_LEN + 1} token ids, more "
                                          f"than the model's context ({MAX_MODEL_LEN} tokens)")


async def test_a_queue_of_one_admits_one_request_and_refuses_a_second() -> None:
    from types import SimpleNamespace

    from gateway.handlers import _admit, _admit_choices
    from gateway.metrics import GatewayMetrics
    from gateway.openai_schema import APIError
    state = SimpleNamespace(draining=False, num_waiting=0, metrics=GatewayMetrics(),
                            upstream=SimpleNamespace(other_versions=[]),
                            config=SimpleNamespace(max_waiting_requests=1))
    slot = _admit(state)
    assert state.num_waiting == 1 and _admit_choices(state, 0) == []
    with pytest.raises(APIError) as e:
        _admit(state)
    assert e.value.status == 429
    with pytest.raises(APIError) as e:
        _admit_choices(state, 1)                  # two choices never fit a queue of one
    assert e.value.status == 400 and e.value.param == "n"
    slot.release()
    assert state.num_waiting == 0


async def test_a_recomputed_prompts_logprobs_are_kept_once() -> None:
    """A preempted prompt computed again sends some positions twice: the first stays."""
    stream = RequestStream("r")
    for item in (PromptLogprobsEvent("r", PromptLogprobs(1, [-1.0, -2.0], [1, 5])),
                 PromptLogprobsEvent("r", PromptLogprobs(1, [-9.0, -9.0, -3.0], [9, 9, 2],
                                                         [[(4, -0.5)]] * 3)),
                 TokenEvent("r", 0, 10)):
        stream.push(item)
    tokens, _ = await stream.next()
    assert [t.index for t in tokens] == [0]
    assert stream.prompt_logprobs == {1: (-1.0, 1, None), 2: (-2.0, 5, None),
                                      3: (-3.0, 2, [(4, -0.5)])}


def _log_a_few_lines() -> None:
    """Configure the gateway's logging, log through structlog and the stdlib, and undo it."""
    import logging

    import structlog

    from shared.logging import configure_logging
    root_handlers, root_level = logging.getLogger().handlers[:], logging.getLogger().level
    configure_logging("gateway", "info")
    try:
        with structlog.contextvars.bound_contextvars(request_id="cmpl-1"):
            structlog.get_logger("t").info("hello", tokens=3)
        structlog.get_logger("t").debug("not shown")
        logging.getLogger("aiohttp.server").warning("from the stdlib")
    finally:   # the logger holds the test's stream: leave no trace for later tests
        structlog.reset_defaults()
        logging.getLogger().handlers[:] = root_handlers
        logging.getLogger().setLevel(root_level)


async def test_logs_are_json_lines_with_the_bound_request_id(capsys: pytest.CaptureFixture) -> None:
    _log_a_few_lines()
    lines = [json.loads(line) for line in capsys.readouterr().err.strip().splitlines()]
    assert [(r["event"], r["service"]) for r in lines] == [("hello", "gateway"),
                                                          ("from the stdlib", "gateway")]
    assert (lines[0]["request_id"], lines[0]["tokens"]) == ("cmpl-1", 3)


async def test_each_log_record_is_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """The services share `pacer up`'s stderr: a record written as two (print's text, then
    its newline) let another process's record in between, two JSON objects on one line."""
    import io

    class Pipe(io.StringIO):
        writes: list[str] = []

        def write(self, text: str) -> int:
            self.writes.append(text)
            return super().write(text)

    pipe = Pipe()
    monkeypatch.setattr("sys.stderr", pipe)
    _log_a_few_lines()
    assert len(pipe.writes) == 2 and all(w.endswith("}\n") and w.count("\n") == 1
                                         for w in pipe.writes), pipe.writes


async def test_logs_at_a_terminal_are_readable_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    _log_a_few_lines()
    plain = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in terminal.getvalue().splitlines()]
    assert len(plain) == 2 and not any(line.startswith("{") for line in plain)
    assert "gateway: hello" in plain[0] and "request_id=cmpl-1" in plain[0] and "tokens=3" in plain[0]
    assert "gateway: from the stdlib" in plain[1]


async def test_a_request_whose_submit_failed_is_aborted_upstream() -> None:
    """The XADD may have reached Redis though its reply did not (a connection cut after the
    command went, or the client's connection closed mid-submit): the client gets its error,
    and an abort follows, so that the request does not run to max_tokens for nobody."""
    from gateway.generation import Generation
    from gateway.metrics import GatewayMetrics
    from redis.exceptions import ConnectionError as RedisConnectionError
    from shared.model_source import resolve_model
    from shared.tokenizer import load_tokenizer

    class Upstream:
        aborted: list = []

        async def submit(self, *args, **kwargs):
            raise RedisConnectionError("connection lost after the command was written")

        def ended(self, request_id):
            pass

        def prefilled(self, request_id, computed_on):
            pass

        def abort_soon(self, request_id, reason):
            self.aborted.append((request_id, reason))

    upstream = Upstream()
    gen = Generation(request_id="r", prompt_token_ids=[1, 2, 3],
                     sampling=SamplingParams(max_tokens=4), stop=(),
                     tokenizer=load_tokenizer(resolve_model(None)), upstream=upstream,
                     router=TokenRouter(None, "channel"), metrics=GatewayMetrics(), arrival=0.0)
    with pytest.raises(RedisConnectionError):
        async with gen:
            await gen.start()
    assert upstream.aborted == [("r", "not submitted")]
