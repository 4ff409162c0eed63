"""`pacer inspect`: what the Redis streams and the stats hash hold, decoded for a person.

    pacer inspect plans --count 3        the newest plans, newest first
    pacer inspect results                step results (the token each request drew)
    pacer inspect requests               queued requests, and each consumer's pending count
    pacer inspect aborts
    pacer inspect stats                  the scheduler's and rank 0's counters (the last ones
                                         written, and said so, when no scheduler beats)
    pacer inspect stats --instance d0    an engine instance's (P/D, --replicas): its own keys
    pacer inspect handoff --instance d0  a decode instance's inbox (reserve, hand-off, cancel)
    pacer inspect reservations --instance p0   what prefill instance p0 was sent

Each entry prints as its id and readable fields on one line, then the decoded message as
indented `key: value` lines; `--json` prints one JSON object per entry instead (for pipes).
Long token lists are cut to their first few ids.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

import redis

from shared.errors import PacerError
from shared.keys import SCAN_COUNT, Keys
from shared.protocol import STREAM_FIELD, ProtocolError, decode, scheduler_instances
from shared.redis_retry import redis_trouble
from shared.service_args import add_redis_args, redis_password, refused_for_good, shown_url

STREAMS = ("plans", "results", "requests", "aborts")
INSTANCE_STREAMS = ("handoff", "reservations")      # P/D: an instance's alone
INSTANCES_HINT = ("P/D and --replicas keep each engine instance's keys under "
                  "{prefix}inst:ID: (give --instance ID)")
LIST_SHOWN = 8          # ids of a longer list print as the first ones and a count


def register(sub) -> None:
    p = sub.add_parser("inspect", help="decode the Redis streams and stats for a person")
    p.add_argument("what", choices=[*STREAMS, *INSTANCE_STREAMS, "stats"])
    p.add_argument("--instance", default="",
                   help="an engine instance's keys (P/D: p0, d0, ...; --replicas: r0, ...)")
    p.add_argument("--count", type=int, default=5, help="newest entries to show (streams)")
    p.add_argument("--json", action="store_true", help="one JSON object per entry")
    add_redis_args(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.count < 1:
        raise PacerError(f"--count must be >= 1, got {args.count}")
    try:
        client = redis.Redis.from_url(args.redis_url, password=redis_password(),
                                      socket_timeout=5)
    except ValueError as e:
        raise PacerError(f"--redis-url {shown_url(args.redis_url)!r}: {e}") from None
    if args.what in INSTANCE_STREAMS and not args.instance:
        raise PacerError(f"{args.what} is an engine instance's stream: give --instance ID")
    keys = Keys(args.key_prefix).for_instance(args.instance)
    hint = "" if args.instance else "; " + INSTANCES_HINT.format(prefix=args.key_prefix)
    try:
        live = live_instances(client, keys)
        if not args.instance and (others := sorted(live - {""})):
            hint = (f"; the schedulers beating now are engine instances' "
                    f"({', '.join(others)}): give --instance ID")
        if args.instance and args.instance not in live and next(client.scan_iter(
                match=f"{args.key_prefix}inst:{args.instance}:*", count=SCAN_COUNT), None) is None:
            raise _unknown_instance(args, live)
        if args.instance and client.exists(keys.instance_requests):
            keys = keys.owning_requests()        # a replica reads a request stream of its own
        if args.what == "stats":
            show_stats(client.hgetall(keys.stats), args.json, hint, live=args.instance in live)
        else:
            stream = getattr(keys, args.what)
            entries = client.xrevrange(stream, count=args.count)
            if not entries and not args.json:
                print(f"no entries in {stream} (check --key-prefix and --redis-url{hint})")
            for entry_id, fields in entries:
                show_entry(entry_id, fields, args.json)
            if args.what == "requests" and not args.json:
                show_pending(client, keys, hint)
    except redis.RedisError as e:
        raise _redis_error(args, e) from None
    finally:
        client.close()
    return 0


def _unknown_instance(args: argparse.Namespace, live: set[str]) -> PacerError:
    """--instance ID that no scheduler beats as and that has no keys: said, rather than the
    shared streams shown as if they were its own."""
    others = sorted(live - {""})
    now = (f"the engine instances beating now: {', '.join(others)}" if others
           else "only the colocated engine's scheduler beats now (no --instance)" if live
           else "no engine instance's scheduler beats now")
    return PacerError(f"no engine instance {args.instance!r} is known at "
                      f"{shown_url(args.redis_url)} (no scheduler of it beats and nothing is "
                      f"stored under {args.key_prefix}inst:{args.instance}:); {now}")


def _redis_error(args: argparse.Namespace, error: redis.RedisError) -> PacerError:
    """One line naming why Redis could not answer: a person runs inspect to find out what is
    wrong, often against a Redis that is not the one they meant."""
    url = shown_url(args.redis_url)
    if (refused := refused_for_good(args.redis_url, error)) is not None:
        return refused                   # credentials, or a database the server lacks
    if isinstance(error, redis.ConnectionError):
        return PacerError(f"cannot reach Redis at {url}: {error}")
    if isinstance(error, redis.exceptions.InvalidResponse):
        return PacerError(f"what answers at {url} is not Redis ({error})")
    if str(error).startswith("WRONGTYPE"):
        return PacerError(f"Redis at {url} holds a key under {args.key_prefix} that pacer did "
                          f"not write ({error}): another application's keys? (give another "
                          "--key-prefix or --redis-url)")
    return PacerError(f"Redis at {url}: {redis_trouble(error)}")


def entry_view(entry_id: bytes, fields: dict) -> dict[str, Any]:
    """A stream entry as plain data: id, the readable fields, the decoded message."""
    view: dict[str, Any] = {"id": _text(entry_id)}
    view.update({_text(k): _text(v) for k, v in fields.items() if _text(k) != STREAM_FIELD})
    data = fields.get(STREAM_FIELD.encode(), fields.get(STREAM_FIELD))
    try:
        msg = decode(data) if data is not None else None
    except ProtocolError as e:
        view["error"] = str(e)
        return view
    if msg is not None:
        view["kind"] = msg.KIND
        view["message"] = _shorten(dataclasses.asdict(msg))
    return view


def show_entry(entry_id: bytes, fields: dict, as_json: bool) -> None:
    view = entry_view(entry_id, fields)
    if as_json:
        print(json.dumps(view))
        return
    head = {k: v for k, v in view.items() if k != "message"}
    print("  ".join(f"{k}={v}" for k, v in head.items()))
    for line in _outline(view.get("message", {}), "    "):
        print(line)


def _number(text: str) -> float | int | str:
    try:
        value = float(text)
    except ValueError:
        return text
    return int(value) if value.is_integer() and "." not in text and "e" not in text else value


def live_instances(client: redis.Redis, keys: Keys) -> set[str]:
    """The engine instances ("" for the colocated engine) whose scheduler beats now."""
    beats = list(client.scan_iter(match=keys.hb_scheduler_pattern, count=SCAN_COUNT))
    return scheduler_instances(client.mget(beats) if beats else [])


def show_stats(raw: dict, as_json: bool, hint: str = "", live: bool = True) -> None:
    """`live`: whether the instance's scheduler beats; if not, the hash is the last snapshot
    of one that stopped (a gauge such as num_requests_running says what ran then), and a
    line says so: on stderr with --json, whose output stays the numbers alone."""
    stats = {_text(k): _text(v) for k, v in sorted(raw.items())}
    if stats and not live:
        written = _number(stats.get("updated_at", ""))
        ago = "" if isinstance(written, str) else f", {time.time() - written:.0f} s ago"
        print(f"no scheduler of this engine beats now: these are the last numbers one wrote"
              f"{ago}, not what runs now", file=sys.stderr if as_json else sys.stdout)
    if as_json:                         # every field is a number (scheduler_svc/stats.py)
        print(json.dumps({k: _number(v) for k, v in stats.items()}))
        return
    if not stats:
        print(f"no stats yet (no scheduler of this engine has run against this Redis and "
              f"prefix{hint})")
    width = max((len(k) for k in stats), default=0)
    for k, v in stats.items():
        print(f"{k:<{width}}  {v}")


def show_pending(client: redis.Redis, keys: Keys, hint: str = "") -> None:
    """Entries read by a scheduler but not acknowledged yet (running or waiting there)."""
    try:
        pending = client.xpending(keys.requests, keys.requests_group)
    except redis.ResponseError:
        print(f"no consumer group on {keys.requests} yet (no scheduler has read it{hint})")
        return
    consumers = ", ".join(f"{_text(c['name'])}: {c['pending']}" for c in pending["consumers"])
    print(f"pending in group {keys.requests_group}: {pending['pending']}"
          + (f" ({consumers})" if consumers else ""))


def _outline(value: dict, pad: str) -> list[str]:
    """A nested map as indented `key: value` lines; lists of plain values stay on one line."""
    lines = []
    for key, item in value.items():
        if isinstance(item, dict) and item:
            lines += [f"{pad}{key}:", *_outline(item, pad + "  ")]
        elif isinstance(item, list) and any(isinstance(v, dict) for v in item):
            lines.append(f"{pad}{key}:")
            for v in item:
                inner = _outline(v, pad + "    ")
                lines += [f"{pad}  - {inner[0].lstrip()}", *inner[1:]]
        else:
            lines.append(f"{pad}{key}: {json.dumps(item)}")
    return lines


def _shorten(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _shorten(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if len(value) > LIST_SHOWN and all(isinstance(v, int) for v in value):
            return [*value[:LIST_SHOWN], f"... {len(value)} in all"]
        return [_shorten(v) for v in value]
    if isinstance(value, bytes):        # a message inside a message (P/D's hand-off)
        try:
            inner = decode(value)
        except ProtocolError:
            return f"<{len(value)} bytes>"
        return {"kind": inner.KIND, **_shorten(dataclasses.asdict(inner))}
    return value


def _text(value: Any) -> Any:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
