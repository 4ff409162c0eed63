"""The one retry loop every service runs Redis operations through, and how Redis URLs show in
logs and errors."""
from __future__ import annotations

import asyncio

import pytest
import structlog
from redis.exceptions import AuthenticationError, OutOfMemoryError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.redis_retry import PERMANENT, redis_failure, redis_trouble, retry_redis
from shared.service_args import refused_credentials, shown_url

log = structlog.get_logger("test")


def failing(times: int, error: Exception):
    calls = []

    async def op() -> str:
        calls.append(1)
        if len(calls) <= times:
            raise error
        return "ok"
    return op, calls


def test_a_refused_password_stops_a_connect_but_not_a_running_service(monkeypatch):
    monkeypatch.setattr("shared.redis_retry.RETRY_FIRST_S", 0.0)
    # connecting: a refused password stays refused, so it is raised at once
    op, calls = failing(2, AuthenticationError("WRONGPASS"))
    with pytest.raises(AuthenticationError):
        asyncio.run(retry_redis(op, "connect", log, permanent=PERMANENT))
    assert len(calls) == 1
    # a running service (a Redis restarted, its password set a moment later) keeps trying
    op, calls = failing(2, AuthenticationError("WRONGPASS"))
    assert asyncio.run(retry_redis(op, "listen", log)) == "ok" and len(calls) == 3


@pytest.mark.parametrize("url, shown", [
    ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
    ("redis://user:pw@h:1/0", "redis://user:***@h:1/0"),
    ("redis://h:1/0?password=secret&db=2", "redis://h:1/0?password=***&db=2"),
    ("redis://h:1/0", "redis://h:1/0"),
])
def test_a_redis_url_shows_without_its_password(url: str, shown: str):
    assert shown_url(url) == shown
    message = str(refused_credentials(url, AuthenticationError("refused")))
    assert shown in message and "pw" not in message and "secret" not in message
    assert ("give its password in $PACER_REDIS_PASSWORD" in message) == (url == "redis://h:1/0")


@pytest.mark.parametrize("error, said", [
    (OutOfMemoryError("OOM command not allowed"), "Redis is out of memory (maxmemory)"),
    (RedisTimeoutError("Timeout reading"), "Redis does not answer (stalled)"),
    (TimeoutError(), "Redis does not answer (stalled)"),
    (RedisConnectionError("Connection refused"), "Redis is unreachable"),
    (ConnectionResetError(), "Redis is unreachable"),
    (AuthenticationError("NOAUTH HELLO must be called with the client already authenticated"),
     "Redis refuses this client's credentials (its password or ACL changed?)"),
    (ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
     "Redis refused a command (WRONGTYPE Operation against a key holding the wrong kind of "
     "value)"),
])
def test_a_redis_failure_is_named_for_what_it_is(error: Exception, said: str):
    """A Redis that answers (out of memory, refusing a command) or one that stalls is not
    "unreachable": that would send an operator looking in the wrong place."""
    assert redis_trouble(error) == said
    if isinstance(error, (OutOfMemoryError, AuthenticationError)):   # a service's log says so
        assert redis_failure(error) == f"{said}; retrying"
