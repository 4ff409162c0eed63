"""A process's fenced XADD (`Claim.xadd`: a scheduler's plans, one an iteration) goes to Redis
by the script's digest, over a real redis-server."""
from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from shared.lifecycle import claimed
from tests.redis_fixture import redis_server  # noqa: F401  (a fixture)

PREFIX = "fenced-xadd:"


def test_a_fenced_xadd_sends_the_scripts_text_only_to_a_server_that_lacks_it(redis_server):
    """The script's whole text went with every plan (most of the bytes packed and sent, and
    hashed by Redis each time); now its digest does, and the text only where the server's
    script cache lacks it (a new or restarted Redis, SCRIPT FLUSH). What it adds is the
    same."""
    stream = PREFIX + "plans"

    async def main():
        r = aioredis.Redis.from_url(redis_server)
        try:
            async with claimed(r, PREFIX + "claim", "scheduler", "fenced", "scheduler id "
                               "'fenced'", "") as claim:
                await r.script_flush()
                await r.config_resetstat()
                ids = [await claim.xadd(stream, {"step": i, "m": b"plan %d" % i}, 100)
                       for i in range(3)]
                stats = await r.info("commandstats")
                entries = await r.xrange(stream)
        finally:
            await r.delete(stream)
            await r.aclose()
        return ids, stats, entries

    ids, stats, entries = asyncio.run(main())
    assert [(entry_id, fields) for entry_id, fields in entries] == [
        (entry_id, {b"step": b"%d" % i, b"m": b"plan %d" % i}) for i, entry_id in enumerate(ids)]
    # by digest each time; the first found the cache empty (NOSCRIPT) and the text followed
    by_digest = stats.get("cmdstat_evalsha", {})
    assert (by_digest.get("calls"), by_digest.get("failed_calls")) == (3, 1), stats
