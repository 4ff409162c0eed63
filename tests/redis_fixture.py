"""A real redis-server for tests: started on a free port, no persistence, killed afterwards.

Use it from a test module with `from tests.redis_fixture import redis_server` (or
`pytest_plugins`); the fixture yields the server's URL, e.g. `redis://127.0.0.1:40123/0`.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(port: int, proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}: "
                               f"{proc.stdout.read().decode(errors='replace')}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {port} did not answer PING in {timeout_s} s")


def start_redis(port: int | None = None, persist_dir: str | None = None,
                *args: str) -> tuple[subprocess.Popen, str]:
    """A new server on `port` (a free one by default); (its process, its URL). With
    `persist_dir`, it keeps every write in an append-only file there (fsync'd each time: a
    kill -9 loses nothing) and loads it at start; `args`: more of its flags."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed")
    port = port or free_port()
    persistence = ["--appendonly", "no"] if persist_dir is None else \
        ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(persist_dir)]
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", *persistence, *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_ready(port, proc)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, f"redis://127.0.0.1:{port}/0"


def stop_redis(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=10)
    proc.stdout.close()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[str]:
    """A fresh redis-server per test module; yields its URL."""
    proc, url = start_redis()
    try:
        yield url
    finally:
        stop_redis(proc)


def lose_a_reply(monkeypatch: pytest.MonkeyPatch, command: str) -> list:
    """Make the first async pipeline in which `command` ("EVALSHA", ...) ran on the server
    then lose its reply (a ConnectionError, as when the connection breaks before the reply
    came). "EVALSHA" stands for a script (shared/scripts.py): sent by its digest, or by its
    text where the server lacked it (its NOSCRIPT ran nothing). Returns the list the lost
    replies go into (one at most)."""
    from redis.asyncio.client import Pipeline
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import NoScriptError

    lost: list = []
    execute = Pipeline.execute
    commands = {command, "EVAL"} if command == "EVALSHA" else {command}

    async def losing(pipe, raise_on_error: bool = True):
        held = [args[0] in commands for args, _ in pipe.command_stack]
        replies = await execute(pipe, raise_on_error)
        if not lost and any(holds and not isinstance(reply, NoScriptError)
                            for holds, reply in zip(held, replies)):
            lost.append(replies)
            raise RedisConnectionError("the reply was lost")
        return replies
    monkeypatch.setattr(Pipeline, "execute", losing)
    return lost
