"""The clock on which times that cross processes are stamped and compared: Redis's.

The services may run on separate machines whose clocks differ. A request's arrival time and
deadline are stamped by the gateway and compared by a scheduler (its deadline, a P/D prefill
instance's TTFT goal), so both read the one clock they share: Redis's `TIME`. Each process
keeps its offset to it, measured with every heartbeat (`measured`, or `sync` alone), and reads
`now()`: this machine's time.time() plus that offset, off by at most half of the round trip it
was measured over, whatever the machines' clocks say. Times one process stamps and reads
itself stay on its own clock (time.monotonic()).

    await clock.sync(redis)          # at start; then with each heartbeat:
    before = time.time(); reply = await redis.time(); clock.measured(before, reply, time.time())
    deadline = clock.now() + timeout_s
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import redis.asyncio as aioredis

# a measurement over a longer round trip (a Redis stalled for a moment) may be off by half of
# it: the offset measured before is kept, unless there is none yet
LONGEST_ROUND_TRIP_S = 0.5

_offset = 0.0           # Redis's clock minus this machine's, seconds
_measured = False


def now() -> float:
    """Seconds since the epoch on Redis's clock (this machine's until the first measurement)."""
    return time.time() + _offset


def measured(before: float, reply, after: float) -> None:
    """Take the offset from a `TIME` reply, (seconds, microseconds), sent at time.time()
    `before` and answered at `after`: Redis read its clock in between, at the middle as
    nearly as can be known."""
    global _offset, _measured
    if after - before > LONGEST_ROUND_TRIP_S and _measured:
        return
    seconds, micros = reply
    _offset = int(seconds) + int(micros) / 1e6 - (before + after) / 2
    _measured = True


async def sync(redis: aioredis.Redis) -> None:
    """Measure the offset to Redis's clock now (one `TIME`)."""
    before = time.time()
    reply = await redis.time()
    measured(before, reply, time.time())
