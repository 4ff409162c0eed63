"""Served mode: where the ranks of one worker group meet. Rank 0 picks a free port and writes
`{addr, port, pid, time}` to the rendezvous key (`Keys.tp_rendezvous`); ranks > 0 read the
newest one, check that its address still listens, and join."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import time

import redis.asyncio as aioredis

from gpu_worker.tp.group import find_free_port
from shared.keys import Keys

# rank 0 listens right after it publishes: an address that refuses this long is a dead group
REFUSED_FOR_S = 5.0


async def publish_rendezvous(redis: aioredis.Redis, keys: Keys, host: str) -> tuple[str, int]:
    """Rank 0: pick a free port on `host` and tell the other ranks (no hard-coded port)."""
    port = find_free_port(host)
    value = json.dumps({"addr": host, "port": port, "pid": os.getpid(), "time": time.time()})
    await redis.set(keys.tp_rendezvous, value)
    return host, port


async def read_rendezvous(redis: aioredis.Redis, keys: Keys, stop: asyncio.Event,
                          not_before: float) -> tuple[str, int, float] | None:
    """Ranks > 0: wait for an address rank 0 wrote at or after `not_before` (older ones are
    stale, left by an earlier group); (addr, port, time written), or None if stopped first."""
    while not stop.is_set():
        raw = await redis.get(keys.tp_rendezvous)
        if raw is not None:
            value = json.loads(raw)
            if value["time"] >= not_before:
                return value["addr"], int(value["port"]), float(value["time"])
        await asyncio.sleep(0.2)
    return None


async def listening(addr: str, port: int, stop: asyncio.Event) -> bool:
    """Whether rank 0's store accepts connections within REFUSED_FOR_S."""
    end = time.monotonic() + REFUSED_FOR_S
    while not stop.is_set() and time.monotonic() < end:
        try:
            await asyncio.to_thread(_connect, addr, port)
            return True
        except OSError:
            await asyncio.sleep(0.2)
    return False


def _connect(addr: str, port: int) -> None:
    socket.create_connection((addr, port), timeout=1.0).close()
