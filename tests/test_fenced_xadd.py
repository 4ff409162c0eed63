"""Lua scripts go to Redis by their digest (shared/scripts.py), their text only where the
server lacks them: a process's fenced XADD (`Claim.xadd`: a scheduler's plans, one an
iteration), and any script alone or in a pipeline, over a real redis-server."""
from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from shared.errors import PacerError
from shared.lifecycle import Claim
from shared.scripts import Script, execute
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
            # the claim alone (`claimed` would beat too, by a script of its own): held by
            # no one, so the fenced XADD adds
            claim = Claim(r, PREFIX + "claim", "this incarnation", PacerError)
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


# INCRBY KEYS[1] by ARGV[1]; another script APPENDs: each run shows in the value it leaves
_ADD = Script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
_APPEND = Script("return redis.call('APPEND', KEYS[1], ARGV[1])")
_FAIL = Script("return redis.error_reply('refused by the script')")


@pytest.mark.parametrize("transaction", [False, True])
def test_a_script_the_server_lost_runs_once_alone_and_in_a_pipeline(redis_server, transaction):
    """After SCRIPT FLUSH (as after a restart of Redis) a script sent by its digest finds the
    server without it (NOSCRIPT: nothing ran). Alone it goes again as its text; in a pipeline
    (or MULTI/EXEC) the other commands ran, and each script that failed goes again, once, its
    reply in its place: every write lands, none twice."""
    count, text = PREFIX + f"count-{transaction}", PREFIX + f"text-{transaction}"

    async def main():
        r = aioredis.Redis.from_url(redis_server)
        try:
            await r.script_flush()
            await r.config_resetstat()
            alone = await _ADD.run(r, (count,), 5)
            await r.script_flush()
            pipe = r.pipeline(transaction=transaction)
            pipe.set(text, "a")
            _ADD.queue(pipe, (count,), 2)
            _APPEND.queue(pipe, (text,), "b")
            pipe.incr(count)
            replies = await execute(pipe)
            stats = await r.info("commandstats")
            values = await r.mget(count, text)
            # a script's error reply raises, as pipe.execute() would
            pipe = r.pipeline(transaction=transaction)
            _FAIL.queue(pipe, ())
            with pytest.raises(ResponseError, match="refused by the script"):
                await execute(pipe)
        finally:
            await r.delete(count, text)
            await r.aclose()
        return alone, replies, values, stats

    alone, replies, values, stats = asyncio.run(main())
    assert alone == 5
    # the INCR ran before the rerun ADD (the ADD's NOSCRIPT ran nothing): 5 + 1, then + 2
    assert replies == [True, 8, 2, 6]
    assert values == [b"8", b"ab"]
    # by digest: the lone run and the pipeline's two failed; each went once as text
    assert (stats["cmdstat_evalsha"]["calls"], stats["cmdstat_evalsha"]["failed_calls"],
            stats["cmdstat_eval"]["calls"]) == (3, 3, 3), stats
