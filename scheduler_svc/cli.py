"""`pacer scheduler`: one model replica's scheduler, serving the request stream of one Redis."""
from __future__ import annotations

import argparse
import socket

from shared.engine_args import EngineArgs
from shared.keys import DEFAULT_PREFIX


def register(sub) -> None:
    p = sub.add_parser("scheduler", help="run the scheduler service against a Redis")
    EngineArgs.add_cli_args(p)
    add_service_args(p)
    p.add_argument("--scheduler-id", default=None,
                   help="consumer name in the request group; keep it across restarts so the "
                        "scheduler takes back its unfinished requests (default: the host name)")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="pull new requests only while fewer wait (default: --max-num-seqs)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds to finish running requests after SIGTERM")
    p.set_defaults(run=run)


def add_service_args(p: argparse.ArgumentParser) -> None:
    """Flags every Redis-side service takes (shared with `pacer worker`)."""
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--key-prefix", default=DEFAULT_PREFIX, help="namespace of every Redis key")
    p.add_argument("--log-level", default="info")


def run(args: argparse.Namespace) -> int:
    from scheduler_svc.service import SchedulerServiceConfig, serve
    from services.engine import build_scheduler, engine_layout
    from services.lifecycle import connect_redis, run_service
    from shared.keys import Keys
    from shared.logging import configure_logging

    configure_logging("scheduler", args.log_level)
    engine_args = EngineArgs.from_cli(args)
    layout = engine_layout(engine_args)
    config = SchedulerServiceConfig(
        scheduler_id=args.scheduler_id or socket.gethostname(), tp=engine_args.tp,
        max_waiting=args.max_waiting or engine_args.max_num_seqs,
        drain_timeout_s=args.drain_timeout)

    async def main(stop) -> int:
        redis = await connect_redis(args.redis_url, stop)
        try:
            return await serve(redis, Keys(args.key_prefix), build_scheduler(layout), config,
                               stop)
        finally:
            await redis.aclose()

    return run_service(main)
