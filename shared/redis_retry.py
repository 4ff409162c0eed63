"""The one way every service retries a Redis operation while Redis is away.

    result = await retry_redis(op, "send plan", log)

`op` runs until it gets through; after each transient failure (a dropped or refused
connection, a timeout, a server out of memory under maxmemory with noeviction: it answers
again once memory is freed) the caller's log gets a warning (`redis_failure` names which) and the next try waits RETRY_FIRST_S,
doubling to RETRY_MAX_S. What differs between callers is only when to stop trying:

- `give_up()`: checked after a failure; True re-raises it (a drain deadline that passed, a
  service told to stop)
- `before_retry()`: awaited before every try after a failure; raises to abandon (the server
  that answers now is not the one the operation was meant for: another run_id)
- `attempts`: at most this many tries (a client's request waits for one more, not forever)
- `permanent`: failures re-raised at once (connecting: a refused password stays refused;
  a service already running keeps retrying even those, as it does any other)
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import AuthenticationError, AuthorizationError, OutOfMemoryError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

T = TypeVar("T")

RETRY_FIRST_S = 0.1
RETRY_MAX_S = 2.0
# failures that say nothing about the operation, only that Redis could not take it now: not
# reachable, or out of memory (maxmemory, noeviction: every write is refused until it has room)
TRANSIENT: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeoutError, OSError,
                                              OutOfMemoryError)
# ... of which these are no passing state: a password or a user refused stays refused
PERMANENT: tuple[type[BaseException], ...] = (AuthenticationError, AuthorizationError)
OUT_OF_MEMORY = "Redis is out of memory (maxmemory)"
# a server that asks for a password only now (requirepass or an ACL set while pacer runs): the
# connections made before keep working, each new one is refused
CREDENTIALS_REFUSED = "Redis refuses this client's credentials (its password or ACL changed?)"


def redis_trouble(error: BaseException) -> str:
    """What a failure means, for an error a client gets: a Redis out of memory, one that
    refuses a command or the credentials answers, and one that stalls is reached:
    "unreachable" would send an operator looking in the wrong place."""
    if isinstance(error, OutOfMemoryError):
        return OUT_OF_MEMORY
    if isinstance(error, PERMANENT):
        return CREDENTIALS_REFUSED
    if isinstance(error, (RedisTimeoutError, TimeoutError)):
        return "Redis does not answer (stalled)"
    if isinstance(error, (RedisConnectionError, OSError)):
        return "Redis is unreachable"
    return f"Redis refused a command ({error})"


def redis_failure(error: BaseException) -> str:
    """The same, for the log line of a retry."""
    if isinstance(error, (OutOfMemoryError, *PERMANENT)):
        return f"{redis_trouble(error)}; retrying"
    return "redis unavailable; retrying"


async def retry_redis(op: Callable[[], Awaitable[T]], what: str, log, *,
                      give_up: Callable[[], bool] = lambda: False,
                      before_retry: Callable[[], Awaitable[None]] | None = None,
                      attempts: int | None = None,
                      errors: tuple[type[BaseException], ...] = TRANSIENT,
                      permanent: tuple[type[BaseException], ...] = ()) -> T:
    delay, tries = RETRY_FIRST_S, 0
    while True:
        try:
            if tries and before_retry is not None:
                await before_retry()
            tries += 1
            return await op()
        except permanent:
            raise
        except errors as e:
            if give_up() or (attempts is not None and tries >= attempts):
                raise
            log.warning(redis_failure(e), op=what, error=str(e), retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)
