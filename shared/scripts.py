"""Lua scripts sent to Redis by their digest (EVALSHA), the text only where the server's script
cache lacks it (a new or restarted Redis, SCRIPT FLUSH, a failover to a replica).

    _SWAP = Script("... lua ...")
    held = await _SWAP.run(redis, [key], value)          # a round trip of its own
    _SWAP.queue(pipe, [key], value)                      # in a pipeline: run it with `execute`
    first, swapped, *rest = await execute(pipe)

The text with every call was most of the bytes a per-iteration pipeline packed and sent (the
worker's result script is ~1.5 KB), and Redis hashed it again each time.

A script the server lacks answers NOSCRIPT and has run nothing. Alone, it is sent again as
EVAL (which runs it once and caches it). In a pipeline (or MULTI/EXEC) the NOSCRIPT is one
of the replies and the other commands ran: `execute` sends each script that got one again,
as EVAL, in the order queued, in one more round trip, and puts its reply in its place; no
command runs twice. Those scripts then run after the rest of their pipeline (and outside its
transaction), so a pipeline must not read after a script what that script writes.

redis-py's own `register_script` objects check a pipeline's scripts with SCRIPT EXISTS
(a round trip more at every execute, and a flush after that check still fails the pipeline
half run); a direct call loads with SCRIPT LOAD and then sends EVALSHA again (two more).
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

from redis.exceptions import NoScriptError

# digest -> text of every Script: what `execute` sends again for a NOSCRIPT
_TEXT_OF: dict[str, str] = {}


class Script:
    """A Lua script, sent by its SHA1 digest (`run`, `queue` + `execute`)."""

    __slots__ = ("text", "sha")

    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()
        _TEXT_OF[self.sha] = text

    async def run(self, redis, keys: Sequence, *args):
        """The script's reply, in a round trip of its own (two where the server lacks it)."""
        try:
            return await redis.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:       # nothing ran: EVAL runs it and caches it there
            return await redis.eval(self.text, len(keys), *keys, *args)

    def queue(self, pipe, keys: Sequence, *args) -> None:
        """Queue the script on `pipe`; run the pipeline with `execute`."""
        pipe.evalsha(self.sha, len(keys), *keys, *args)


async def execute(pipe, raise_on_error: bool = True) -> list:
    """`pipe.execute()` for a pipeline that holds scripts (`Script.queue`): each that found
    the server without it is sent again, once, as EVAL, and its reply put in its place. With
    `raise_on_error`, the first error reply then raises, as `pipe.execute()` does."""
    stack = list(pipe.command_stack)
    replies = await pipe.execute(raise_on_error=False)
    missed = [i for i, reply in enumerate(replies)
              if isinstance(reply, NoScriptError) and stack[i][0][0] == "EVALSHA"
              and stack[i][0][1] in _TEXT_OF]
    if missed:
        for i in missed:
            _, sha, *args = stack[i][0]
            pipe.eval(_TEXT_OF[sha], *args)
        for i, reply in zip(missed, await pipe.execute(raise_on_error=False)):
            replies[i] = reply
    if raise_on_error:
        pipe.raise_first_error(stack, replies)
    return replies
