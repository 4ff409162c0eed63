"""Hostile input through the HTTP API: a model whose chat template reaches for Python
internals, oversized headers and bodies, and a check that nothing read from Redis is ever
unpickled or evaluated. The gateway runs in-process over a real redis-server; these requests
never need a scheduler (they are refused before anything is enqueued).
"""
from __future__ import annotations

import asyncio
import gzip
import json
import re
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from gateway import handlers
from gateway.app import serve
from gateway.config import GatewayConfig
from shared.errors import InvalidRequestError
from shared.json_file import MAX_JSON_DEPTH, parse_user_json
from tests.helpers_tiny_model import write_tiny_llama
from tests.redis_fixture import redis_server  # noqa: F401  (the fixture)

ASYNC = pytest.mark.asyncio(loop_scope="module")

ROOT = Path(__file__).resolve().parents[1]
MAX_BODY = 64 * 1024


def hostile_template(marker: Path) -> str:
    # renders the messages like a normal template, then tries to run a shell command through
    # a jinja global's Python internals
    return ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
            "{{ cycler.__init__.__globals__.os.popen('touch " + str(marker) + "').read() }}")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(tmp_path_factory, redis_server: str):  # noqa: F811
    model = Path(write_tiny_llama(tmp_path_factory.mktemp("hostile-model")))
    marker = model / "pwned"
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = hostile_template(marker)
    config_path.write_text(json.dumps(config))
    gw = GatewayConfig(port=0, redis_url=redis_server, model=str(model), key_prefix="hostile:",
                       served_model_name="m", max_body_bytes=MAX_BODY)
    async with serve(gw) as url, aiohttp.ClientSession() as session:
        yield url, session, marker


@ASYNC
async def test_a_template_reaching_for_python_internals_is_refused(gateway) -> None:
    url, session, marker = gateway
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with session.post(f"{url}/v1/chat/completions", json=body) as r:
        answer = await r.json()
    assert r.status == 400, answer
    assert answer["error"]["type"] == "invalid_request_error"
    assert "not allowed" in answer["error"]["message"]
    assert not marker.exists()


@ASYNC
async def test_oversized_headers_and_bodies_are_refused(gateway) -> None:
    url, session, _ = gateway
    async with session.get(f"{url}/v1/models", headers={"X-Big": "a" * 20_000}) as r:
        assert r.status in (400, 431)
    body = {"model": "m", "prompt": "x" * (2 * MAX_BODY)}
    async with session.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 413
        assert (await r.json())["error"]["type"] == "invalid_request_error"
    async with session.get(f"{url}/openapi.json") as r:      # still serving
        spec = await r.json()
    assert r.status == 200 and "/v1/chat/completions" in spec["paths"]


@ASYNC
async def test_a_declared_body_too_large_is_refused_before_it_arrives(gateway) -> None:
    """Content-Length over the limit with no body behind it: a 413 at once, not a 408 after
    the body's 30 s."""
    url, _, _ = gateway
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 200000000\r\n\r\n")
        status = await asyncio.wait_for(reader.readline(), 5.0)
        assert status.startswith(b"HTTP/1.1 413"), status
    finally:
        writer.close()


@ASYNC
async def test_a_body_still_arriving_after_an_early_refusal_is_read_to_its_end(gateway) -> None:
    """A request refused before its body is read (a 429 for a full queue, a 400 for a bad
    header) is answered at once, while a client on a slow link may still be sending its
    body, to read the answer after. The server reads that body to its end (and drops it) as
    long as it would wait for an accepted request's (BODY_TIMEOUT_S): with aiohttp's default
    of 10 s it closed the connection mid-body, and the client's next write failed (EPIPE)."""
    url, _, _ = gateway
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    chunks, pause_s = 24, 0.5           # the body over 12 s: past aiohttp's default, well
    assert chunks * pause_s < handlers.BODY_TIMEOUT_S     # within a body's own time
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nX-Request-Id: " + b"a" * 200 +
                     b"\r\nContent-Length: %d\r\n\r\n" % chunks)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        assert head.startswith(b"HTTP/1.1 400"), head
        length = int(re.search(rb"Content-Length: (\d+)", head)[1])
        assert b"X-Request-Id" in await reader.readexactly(length)
        for _ in range(chunks):
            await asyncio.sleep(pause_s)
            writer.write(b" ")
            await writer.drain()
        # the body's end ends that request: the connection serves the next one
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 5.0)
        assert status.startswith(b"HTTP/1.1 200"), status
    finally:
        writer.close()


@ASYNC
async def test_the_bodies_being_read_at_once_are_bounded(gateway, monkeypatch) -> None:
    """Each connection may hold a body of almost --max-body-bytes (200 held 1.5 GB): past
    what the bodies being read may hold between them, a request is refused (429), and a
    request is answered again once they are gone."""
    monkeypatch.setattr(handlers, "BODIES_READ_AT_ONCE", 2, raising=False)
    url, session, _ = gateway
    host, port = url.removeprefix("http://").split(":")
    held = [await asyncio.open_connection(host, int(port)) for _ in range(2)]
    for _, writer in held:          # most of a body each, its last bytes never sent
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % MAX_BODY
                     + b'{"prompt": "' + b"x" * (MAX_BODY - 1024))
        await writer.drain()
    body = {"model": "m", "prompt": "x" * 4096, "max_tokens": 2}

    async def status() -> tuple[int, dict, str | None]:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            return r.status, await r.json(), r.headers.get("Retry-After")
    try:
        for _ in range(100):        # until the server has read what the two sent
            code, answer, retry_after = await status()
            if code == 429:
                break
            await asyncio.sleep(0.05)
        assert code == 429 and retry_after == "1", answer
        assert answer["error"]["type"] == "rate_limit_error"
        assert "bytes of request bodies are being read" in answer["error"]["message"]
    finally:
        for _, writer in held:
            writer.close()
    for _ in range(100):            # their bytes are given back once they are gone
        if (code := (await status())[0]) != 429:
            break
        await asyncio.sleep(0.05)
    assert code != 429


@ASYNC
async def test_a_body_not_in_its_content_encoding_is_a_400(gateway) -> None:
    """`Content-Encoding: gzip` over bytes that are not gzip: the client's mistake, a 400 in
    OpenAI's shape saying so (it was a 500 "internal server error"); real gzip is read."""
    url, session, _ = gateway
    raw = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2}).encode()
    # (the server closes the connection after a body it could not read)
    async with session.post(f"{url}/tokenize", data=raw, headers={
            "Content-Type": "application/json", "Content-Encoding": "gzip",
            "Connection": "close"}) as r:
        answer = await r.json()
    assert r.status == 400, answer
    assert answer["error"]["type"] == "invalid_request_error"
    assert "could not be read" in answer["error"]["message"]
    assert "content-encoding: gzip" in answer["error"]["message"]
    async with session.post(f"{url}/tokenize", data=gzip.compress(raw), headers={
            "Content-Type": "application/json", "Content-Encoding": "gzip"}) as r:
        assert r.status == 200 and (await r.json())["count"] >= 1


@ASYNC
@pytest.mark.parametrize("depth", [129, 5_000, 20_000])
async def test_bodies_nested_too_deep_are_refused_saying_so(gateway, depth: int) -> None:
    # past ~1,000 levels Python's JSON parser raises RecursionError, which once answered 500
    url, session, _ = gateway
    raw = ('{"model": "m", "prompt": "hi", "max_tokens": 2, "metadata": '
           + "[" * depth + "]" * depth + "}")
    async with session.post(f"{url}/v1/completions", data=raw,
                            headers={"Content-Type": "application/json"}) as r:
        answer = await r.json()
    assert r.status == 400, answer
    assert answer["error"]["type"] == "invalid_request_error"
    assert "more than 128 deep" in answer["error"]["message"]


@ASYNC
@pytest.mark.parametrize("threaded", [False, True], ids=["on-the-loop", "on-a-thread"])
@pytest.mark.parametrize("where", ["prompt", "stop", "key"])
async def test_a_lone_surrogate_is_refused_not_a_server_error(gateway, where: str,
                                                              threaded: bool,
                                                              monkeypatch) -> None:
    # JSON's \\u escapes can write half a UTF-16 pair; the tokenizer raised on it (a 500).
    # A big body is parsed on a thread: the same answer either way
    from gateway import handlers
    monkeypatch.setattr(handlers, "THREADED_PARSE_BYTES", 0 if threaded else 1 << 30)
    url, session, _ = gateway
    fields = {"prompt": '"prompt": "a\\ud800b"', "stop": '"prompt": "hi", "stop": ["\\udc00"]',
              "key": '"prompt": "hi", "logit_bias": {"\\ud83d": 1}'}[where]
    raw = '{"model": "m", "max_tokens": 2, ' + fields + "}"
    async with session.post(f"{url}/v1/completions", data=raw,
                            headers={"Content-Type": "application/json"}) as r:
        answer = await r.json()
    assert r.status == 400, answer
    assert "lone UTF-16 surrogate" in answer["error"]["message"]


def test_a_body_at_the_depth_limit_passes_and_one_deeper_does_not() -> None:
    at_limit: list = []
    for _ in range(MAX_JSON_DEPTH - 2):
        at_limit = [at_limit]
    parse_user_json(json.dumps({"a": at_limit}))     # an object, then MAX_JSON_DEPTH - 1 arrays
    assert parse_user_json('{"text": "a pair of surrogates \\ud83d\\ude00 is fine"}')
    with pytest.raises(InvalidRequestError, match="more than"):
        parse_user_json(json.dumps({"a": [at_limit]}))


def test_nothing_read_from_redis_is_unpickled_or_evaluated() -> None:
    # a bare eval( or exec( call (a method such as torch's module.eval() is not one)
    forbidden = re.compile(r"\bpickle\b|\bmarshal\b|(?<![.\w])(eval|exec)\(|yaml\.load\(|\bdill\b")
    offenders = []
    for package in ("gateway", "scheduler_svc", "gpu_worker", "services", "shared"):
        for path in (ROOT / package).rglob("*.py"):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if forbidden.search(code) and "never pickle" not in line:
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []
