"""A stream's writes on the event loop the gateway runs (uvloop): untimed while the client
reads, timed and given up on once it stops (gateway/responses.py StallBoundResponse)."""
from __future__ import annotations

import asyncio
import errno
import socket
import sys
from types import SimpleNamespace

import pytest
from aiohttp import web

from gateway import responses
from gateway.state import STATE

uvloop = pytest.importorskip("uvloop")

SMALL = b"data: " + b"x" * 200 + b"\n\n"         # a token's event
BIG = b"data: " + b"x" * 4000 + b"\n\n"


def test_token_writes_pay_no_timer_under_uvloop_and_a_stalled_client_is_still_dropped(
        monkeypatch):
    """uvloop's transports put their low-water mark at 16 bytes: the writes were timed from
    the low mark on, so every token's write under uvloop paid for a timer (~0.1 ms of the
    gateway's event loop a token, with 32 streams a few percent of the forward's cores). Now
    a write is timed only where it may wait: the writers paused, or the buffer past its high
    mark after it. A client that stops reading is still reset after the stall timeout."""
    timed = []
    real_timeout = asyncio.timeout

    def counting_timeout(delay):
        if sys._getframe(1).f_globals.get("__name__") == responses.__name__:
            timed.append(delay)
        return real_timeout(delay)
    monkeypatch.setattr(asyncio, "timeout", counting_timeout)
    seen: dict[str, object] = {}

    async def handler(request: web.Request) -> web.StreamResponse:
        response = responses.SSEResponse({})
        await response.prepare(request)
        for _ in range(50):
            await response.write(SMALL)
        seen["timed_small"] = len(timed)
        try:
            for writes in range(5000):          # 20 MB at most: past every buffer
                await response.write(BIG)
        except ConnectionResetError as e:
            seen["reset"] = str(e)
        seen["timed_big"] = len(timed) - seen["timed_small"]
        return response

    async def main() -> None:
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        app = web.Application()
        app[STATE] = SimpleNamespace(config=SimpleNamespace(stalled_client_timeout_s=0.5))
        app.router.add_get("/", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)     # never read
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_connect(sock, ("127.0.0.1", port))
            await loop.sock_sendall(sock, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            for _ in range(400):
                if "timed_big" in seen:
                    break
                await asyncio.sleep(0.05)
            # the reset lands once the kernel takes it: the server's first RST can fall
            # outside the zero window this client holds, and the one that answers the
            # client's challenge ACK (rate-limited) may come later; read until it is there
            # (SO_ERROR is cleared by the read that returns it)
            error = 0
            for _ in range(200):
                error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if error:
                    break
                await asyncio.sleep(0.05)
            assert error == errno.ECONNRESET, errno.errorcode.get(error, error)
        finally:
            sock.close()
            await runner.cleanup()

    uvloop.run(main())
    assert seen.get("timed_small") == 0, seen
    assert "read nothing for 0.5 s" in str(seen.get("reset")), seen
    assert seen["timed_big"] >= 1, seen
