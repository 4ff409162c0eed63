"""`pacer scheduler`: one model replica's scheduler, serving the request stream of one Redis."""
from __future__ import annotations

import argparse
import socket

from shared.engine_args import EngineArgs
from shared.service_args import (ROLES, add_instance_args, add_service_args, non_negative_int,
                                 non_negative_seconds, positive_int)


# measured with `bench/disaggregation.py --threshold` (docs/benchmarks.md#pd-disaggregation-served):
# the longest prompt whose prefill, riding with 8 decodes, costs them at most 1.5x their gap
DISAGG_MIN_PROMPT_TOKENS = 32


def default_scheduler_id(instance: str | None) -> str:
    """The scheduler's consumer name, the same across its restarts so that it takes back its
    own unfinished requests at once: the host name, and the instance's id beside it (two
    instances' schedulers on one host must not share a name, or a heartbeat)."""
    host = socket.gethostname()
    return f"{host}-{instance}" if instance else host


def register(sub) -> None:
    p = sub.add_parser("scheduler", help="run the scheduler service against a Redis")
    EngineArgs.add_cli_args(p)
    add_service_args(p)
    p.add_argument("--scheduler-id", default=None,
                   help="consumer name in the request group; keep it across restarts so the "
                        "scheduler takes back its unfinished requests (default: the host name, with -ID for --instance ID)")
    p.add_argument("--max-waiting", type=positive_int, default=None,
                   help="pull new requests only while fewer wait (default: --max-num-seqs; a P/D "
                        "prefill instance counts those waiting for a decode instance's blocks)")
    p.add_argument("--drain-timeout", type=non_negative_seconds, default=30.0,
                   help="seconds to finish running requests after SIGTERM")
    add_instance_args(p)
    p.add_argument("--role", choices=ROLES, default="colocated",
                   help="P/D: prefill instances take new requests and hand them to decode "
                        "instances with their K/V (docs/design.md#pd-disaggregation)")
    p.add_argument("--disagg-min-prompt-tokens", type=non_negative_int,
                   default=DISAGG_MIN_PROMPT_TOKENS,
                   help="prefill role: shorter prompts are prefilled on the decode instance")
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="debugging: plan each iteration only after the last one's result is "
                        "in, instead of while it runs (docs/design.md#overlap)")
    p.add_argument("--own-request-stream", action="store_true",
                   help="a data-parallel replica (pacer up --replicas): read the instance's own "
                        "request stream pacer:inst:{id}:requests, fed by the gateway's router, "
                        "and publish the block hashes it caches (docs/design.md#cache-aware-"
                        "routing)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # the service's modules are imported when the command runs, not when `pacer` builds its
    # parser (every subcommand's module is imported for that)
    from scheduler_svc.build import build_scheduler
    from scheduler_svc.service import SchedulerServiceConfig, serve
    from shared.engine_layout import engine_layout
    from shared.keys import Keys
    from shared.lifecycle import run_redis_service
    from shared.logging import configure_logging
    from shared.model_source import model_identity

    configure_logging("scheduler", args.log_level, instance=args.instance)
    engine_args = EngineArgs.from_cli(args)
    layout = engine_layout(engine_args)
    layout.check_pool_holds_context()       # pacer up checked it too; alone, here
    config = SchedulerServiceConfig(
        scheduler_id=args.scheduler_id or default_scheduler_id(args.instance), tp=engine_args.tp,
        max_waiting=args.max_waiting or engine_args.max_num_seqs,
        drain_timeout_s=args.drain_timeout, role=args.role, instance=args.instance,
        disagg_min_prompt_tokens=args.disagg_min_prompt_tokens, overlap=args.overlap,
        **model_identity(layout.source, layout.args.load_format == "dummy"))
    keys = Keys(args.key_prefix).for_instance(args.instance)
    if args.own_request_stream:
        if not args.instance or args.role != "colocated":
            raise SystemExit("--own-request-stream needs --instance ID and --role colocated")
        keys = keys.owning_requests()
    return run_redis_service(args.redis_url, lambda redis, stop: serve(
        redis, keys, build_scheduler(layout, args.role), config, stop))
