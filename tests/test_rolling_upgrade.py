"""A rolling upgrade with real processes: two gateways, one of this release and one of an "old"
release, share a Redis; the engine (worker rank 0 and its scheduler) is first the old
release's, then this one's. An old release is this code run with the protocol version one
lower (`pacer_of`: the process's `SCHEMA_VERSION` set before anything is encoded).

A gateway refuses a new request while a scheduler of another version beats, as it last read
the heartbeats (once a second); a request it accepted before (queued while no scheduler ran,
or in that second) is read by the scheduler of the other version, which cannot decode it.
It dropped the entry in silence, and the client waited until its timeout (forever without
one). Each request must be served or end with an error naming the version mismatch.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import aiohttp
import pytest
import redis

from shared.keys import Keys
from shared.protocol import SCHEMA_VERSION
from tests.helpers_tiny_model import write_tiny_llama
from tests.redis_fixture import free_port, start_redis, stop_redis
from tests.served_fixture import API_KEY, ROOT, wait_for
from tests.test_scheduler_takeover import Process

KEYS = Keys()
OLD = SCHEMA_VERSION - 1
ENGINE_FLAGS = ["--num-kv-blocks", "64", "--max-model-len", "256", "--dtype", "float32",
                "--quantization", "none"]
REQUEST_TIMEOUT_S = 120.0      # a safety net: a request that hangs is the failure looked for

# `pacer` with the protocol version set first: a real service process of another release
_PACER_OF = ("import sys, shared.protocol as p; p.SCHEMA_VERSION = int(sys.argv[1]); "
             "from services.cli import main; sys.exit(main(sys.argv[2:]))")


def pacer_of(version: int, *argv: str) -> list[str]:
    return [sys.executable, "-c", _PACER_OF, str(version), *argv]


@dataclass
class Cluster:
    redis_url: str
    model: str
    logs_dir: str
    procs: dict[str, Process] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)

    def start(self, name: str, version: int, *argv: str) -> None:
        log_path = os.path.join(self.logs_dir, f"{name}.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(pacer_of(version, *argv), cwd=ROOT, stdout=log,
                                    stderr=subprocess.STDOUT)
        self.procs[name] = Process(name, proc, log_path)

    def start_gateway(self, name: str, version: int) -> None:
        port = free_port()
        self.start(name, version, "gateway", "--port", str(port), "--redis-url",
                   self.redis_url, "--model", self.model, "--served-model-name", "tiny",
                   "--max-model-len", "256", "--gateway-id", name, "--api-key", API_KEY)
        self.urls[name] = f"http://127.0.0.1:{port}"

    def start_engine(self, name: str, version: int) -> None:
        """Worker rank 0 and a scheduler (`name`), both of `version`."""
        self.start(f"{name}-worker", version, "worker", "--rank", "0", "--model", self.model,
                   *ENGINE_FLAGS, "--redis-url", self.redis_url)
        self.start(name, version, "scheduler", "--model", self.model, *ENGINE_FLAGS,
                   "--redis-url", self.redis_url, "--scheduler-id", name)

    def logs(self) -> str:
        return "\n".join(p.log_tail() for p in self.procs.values())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    redis_proc, redis_url = start_redis()
    c = Cluster(redis_url, model, str(tmp_path_factory.mktemp("upgrade-logs")))
    try:
        yield c
    finally:
        for name in reversed(list(c.procs)):
            c.procs[name].stop()
        stop_redis(redis_proc)


async def complete(session: aiohttp.ClientSession, url: str, prompt: str) -> tuple[int, dict]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {API_KEY}"},
                            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as r:
        return r.status, await r.json()


def queued(r: redis.Redis, count: int) -> None:
    """Until the request stream holds `count` entries."""
    wait_for(lambda: r.exists(KEYS.requests) and r.xlen(KEYS.requests) >= count, 60.0,
             f"{count} requests queued")


def listening(url: str) -> bool:
    import urllib.error
    import urllib.request
    try:
        urllib.request.urlopen(f"{url}/health", timeout=2.0)
    except urllib.error.HTTPError:
        return True             # 503: no scheduler yet, but it answers
    except OSError:
        return False
    return True


def scheduler_gone(r: redis.Redis, name: str) -> bool:
    return not r.exists(KEYS.hb_scheduler(name))


def assert_served(status: int, body: dict) -> None:
    assert status == 200 and body["usage"]["completion_tokens"] == 4, body


def assert_version_error(status: int, body: dict, theirs: int, ours: int) -> None:
    """Ended with an error naming the other side's protocol version and this side's."""
    assert status == 500, body
    message = body["error"]["message"]
    assert f"protocol version {theirs}, this gateway version {ours}" in message \
        and "run the same pacer release" in message, message


def test_requests_read_by_a_scheduler_of_another_version_end_with_an_error(cluster: Cluster):
    """Queued while no scheduler ran, a request of each gateway; then the old engine comes
    up: the old gateway's request is served, the new gateway's ends with an error naming both
    versions (it hung). Then the old engine goes and the new one comes up: a request the old
    gateway queued meanwhile ends with that error in turn (the new scheduler dropped it in
    silence, and the old gateway's client hung), and the new gateway's is served."""
    c = cluster
    r = redis.Redis.from_url(c.redis_url)
    c.start_gateway("gw-new", SCHEMA_VERSION)
    c.start_gateway("gw-old", OLD)
    for name in ("gw-new", "gw-old"):
        wait_for(lambda name=name: listening(c.urls[name]), 120.0, f"{name} listening")

    async def phase_one():
        async with aiohttp.ClientSession() as session:
            new = asyncio.create_task(complete(session, c.urls["gw-new"], "a new one"))
            old = asyncio.create_task(complete(session, c.urls["gw-old"], "an old one"))
            await asyncio.to_thread(queued, r, 2)
            c.start_engine("old-scheduler", OLD)
            return await new, await old

    try:
        (new_status, new_body), (old_status, old_body) = asyncio.run(phase_one())
        assert_served(old_status, old_body)
        assert_version_error(new_status, new_body, OLD, SCHEMA_VERSION)

        c.procs["old-scheduler"].stop()
        c.procs["old-scheduler-worker"].stop()
        assert scheduler_gone(r, "old-scheduler")

        async def phase_two():
            async with aiohttp.ClientSession() as session:
                old = asyncio.create_task(complete(session, c.urls["gw-old"], "old again"))
                await asyncio.to_thread(queued, r, 3)
                c.start_engine("new-scheduler", SCHEMA_VERSION)
                old_answer = await old
                for _ in range(200):     # the new gateway reads the heartbeats every second
                    new_answer = await complete(session, c.urls["gw-new"], "new again")
                    if new_answer[0] != 503:
                        break
                    await asyncio.sleep(0.1)
                return old_answer, new_answer

        (old_status, old_body), (new_status, new_body) = asyncio.run(phase_two())
        assert_served(new_status, new_body)
        assert_version_error(old_status, old_body, SCHEMA_VERSION, OLD)
    except BaseException as e:
        raise AssertionError(f"{e!r}\n{c.logs()}") from e
    finally:
        r.close()
