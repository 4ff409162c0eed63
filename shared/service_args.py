"""Flags every Redis-side service takes (`pacer scheduler`, `pacer worker`, `pacer gateway`)
and `pacer inspect`."""
from __future__ import annotations

import argparse
import logging
import os
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from redis.exceptions import ResponseError

from shared.errors import PacerError
from shared.keys import DEFAULT_PREFIX
from shared.redis_retry import PERMANENT

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
# the Redis password where the URL gives none: an environment variable is not on the command
# line, where `ps` shows a URL's password to every user of the machine
PASSWORD_ENV = "PACER_REDIS_PASSWORD"
LOG_LEVEL_HELP = "debug, info, warning or error"


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0, or argparse's one-line error naming the flag."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_seconds(text: str) -> float:
    """An argparse type: a number of seconds > 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_seconds(text: str) -> float:
    """An argparse type: a number of seconds >= 0 (0: the thing it bounds is off)."""
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def log_level(text: str) -> str:
    """An argparse type: a level the logging module knows (any case), checked at parse time;
    a service met an unknown one only when it set up its log, as a traceback."""
    if not isinstance(logging.getLevelName(text.upper()), int):
        raise argparse.ArgumentTypeError(f"{LOG_LEVEL_HELP}, got {text!r}")
    return text


def add_log_level_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", type=log_level, default="info", help=LOG_LEVEL_HELP)


def add_redis_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=DEFAULT_REDIS_URL,
                   help=f"the Redis the services meet at (default {DEFAULT_REDIS_URL})")
    p.add_argument("--key-prefix", default=DEFAULT_PREFIX,
                   help=f"namespace of every Redis key (default {DEFAULT_PREFIX})")


def shown_url(redis_url: str) -> str:
    """A Redis URL fit for a log or an error: its password, if it has one, masked (in the
    URL's user part, or redis-py's `?password=`)."""
    url = urlsplit(redis_url)
    if url.password:
        url = url._replace(netloc=url.netloc.replace(f":{url.password}@", ":***@"))
    query = [(k, "***" if k == "password" else v) for k, v in parse_qsl(url.query, True)]
    return url._replace(query=urlencode(query, safe="*")).geturl() if url.query else url.geturl()


def _has_password(redis_url: str) -> bool:
    url = urlsplit(redis_url)
    return bool(url.password) or "password" in dict(parse_qsl(url.query, True))


def redis_password() -> str | None:
    """The password of $PACER_REDIS_PASSWORD, for every Redis client a service makes (as
    `password=`; one the URL gives wins)."""
    return os.environ.get(PASSWORD_ENV) or None


def password_to_environment(redis_url: str) -> str:
    """The URL without its password, which goes to $PACER_REDIS_PASSWORD instead (of this
    process, and so of the children it starts): `pacer up` hands the URL to its services on
    their command lines, which `ps` shows every user of the machine."""
    url = urlsplit(redis_url)
    query = parse_qsl(url.query, True)
    password = unquote(url.password) if url.password else dict(query).get("password")
    if not password:
        return redis_url
    os.environ[PASSWORD_ENV] = password
    netloc = url.netloc
    if url.password:
        host = netloc.rsplit("@", 1)[1]
        netloc = f"{url.username}@{host}" if url.username else host
    query = [(key, value) for key, value in query if key != "password"]
    return url._replace(netloc=netloc, query=urlencode(query)).geturl()


def refused_credentials(redis_url: str, error: Exception) -> PacerError:
    """A Redis that refuses the URL's password or user: that does not pass with time, so the
    service stops at once, saying so (and where to give a password if none was given)."""
    hint = "" if _has_password(redis_url) or redis_password() else \
        f" (give its password in ${PASSWORD_ENV}, or in the URL: redis://:PASSWORD@HOST:PORT/DB)"
    return PacerError(f"--redis-url {shown_url(redis_url)}: Redis refused the credentials"
                      f"{hint}: {error}")


def refused_for_good(redis_url: str, error: BaseException) -> PacerError | None:
    """The one-line error of a Redis that will refuse this URL however long one waits (its
    credentials refused, a database index it lacks: `.../99`); None for a failure that may
    pass (not reachable yet, loading, ...)."""
    if isinstance(error, PERMANENT):
        return refused_credentials(redis_url, error)
    if isinstance(error, ResponseError) and "DB index" in str(error):
        return PacerError(f"--redis-url {shown_url(redis_url)}: {error} (the server has fewer "
                          f"databases: see its `databases` setting)")
    return None


def add_service_args(p: argparse.ArgumentParser) -> None:
    add_redis_args(p)
    add_log_level_arg(p)


# what an engine instance does (docs/design.md#pd-disaggregation)
ROLES = ("colocated", "prefill", "decode")


def check_role(role: str, instance: str) -> None:
    """A PacerError unless `role` is one of ROLES and a P/D role names its instance."""
    if role not in ROLES:
        raise PacerError(f"--role must be colocated, prefill or decode, got {role!r}")
    if role != "colocated" and not instance:
        raise PacerError(f"--role {role} needs --instance ID")


def add_instance_args(p: argparse.ArgumentParser) -> None:
    """The engine instance a scheduler or worker belongs to (docs/design.md#pd-disaggregation):
    its plans, results, stats and worker heartbeats live under `pacer:inst:{id}:`."""
    p.add_argument("--instance", default="",
                   help="engine instance id (P/D: one per prefill or decode instance; "
                        "default: the colocated engine)")
