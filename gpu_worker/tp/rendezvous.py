"""Served mode: where the ranks of one worker group meet. Rank 0 picks a free port and writes
`{addr, port, pid, time, host}` to the rendezvous key (`Keys.tp_rendezvous`) and withdraws it once
its group formed; ranks > 0 read the one there, check that its address still listens, and join.

Nothing here compares clocks: the ranks may run on machines whose clocks differ, and may start
minutes apart. A rendezvous still there is of a group still forming, unless its rank 0 died
first, and then its address refuses."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import time

import redis.asyncio as aioredis

from gpu_worker.tp.group import find_free_port
from shared.errors import PacerError
from shared.hosts import loopback_elsewhere, this_host
from shared.keys import Keys
from shared.scripts import Script

# rank 0 listens right after it publishes: an address that refuses this long is a dead group
REFUSED_FOR_S = 5.0

# delete the rendezvous only if it is still the one this rank 0 wrote
_WITHDRAW = Script("if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end")


async def publish_rendezvous(redis: aioredis.Redis, keys: Keys, host: str
                             ) -> tuple[str, int, str]:
    """Rank 0: pick a free port on `host` and tell the other ranks (no hard-coded port);
    (addr, port, the value written, for `withdraw_rendezvous`)."""
    port = find_free_port(host)
    value = json.dumps({"addr": host, "port": port, "pid": os.getpid(), "time": time.time(),
                        "host": this_host()})
    await redis.set(keys.tp_rendezvous, value)
    return host, port, value


async def withdraw_rendezvous(redis: aioredis.Redis, keys: Keys, value: str) -> None:
    """Rank 0, its group formed: no later follower may take its rendezvous for an open one."""
    await _WITHDRAW.run(redis, (keys.tp_rendezvous,), value)


async def read_rendezvous(redis: aioredis.Redis, keys: Keys, stop: asyncio.Event,
                          refused: set[str]) -> tuple[str, int, str] | None:
    """Ranks > 0: wait for a rendezvous other than those in `refused` (of groups found gone);
    (addr, port, the value read), or None if stopped first."""
    while not stop.is_set():
        raw = await redis.get(keys.tp_rendezvous)
        if raw is not None:
            raw = raw.decode() if isinstance(raw, bytes) else raw
            if raw not in refused:
                value = json.loads(raw)
                _check_reachable(value)
                return value["addr"], int(value["port"]), raw
        await asyncio.sleep(0.2)
    return None


def _check_reachable(value: dict) -> None:
    """PacerError if rank 0 runs on another machine and announced a loopback address, which
    reaches only this one (it was started without --tp-host)."""
    if why := loopback_elsewhere(value["addr"], value.get("host"), this_host(), "tp rank 0",
                                 "--tp-host"):
        raise PacerError(why)


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
