"""`pacer worker --rank R`: one tensor-parallel rank of a model replica."""
from __future__ import annotations

import argparse

from shared.engine_args import EngineArgs
from shared.service_args import ROLES, add_instance_args, add_service_args, check_role


def register(sub) -> None:
    p = sub.add_parser("worker", help="run one worker rank against a Redis")
    EngineArgs.add_cli_args(p)
    add_service_args(p)
    p.add_argument("--rank", type=int, default=0, help="this process's TP rank, 0..tp-1")
    add_instance_args(p)
    p.add_argument("--role", choices=ROLES, default=None,
                   help="the role of this rank's instance, as its scheduler has it: announced "
                        "in the heartbeat (the scheduler refuses a worker of another role); "
                        "prefill and decode need --kv-connector (default: not stated)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU: torch threads of this rank (default: the cores, shared out "
                        "among the ranks)")
    p.add_argument("--cpus", default=None,
                   help="CPU: the cores this rank's forward thread runs on, e.g. 0-1 (default: "
                        "any; `pacer up` gives each engine instance its own where they fit)")
    p.add_argument("--tp-host", default="127.0.0.1",
                   help="rank 0: the address the other ranks reach it at (torch.distributed)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # imported when the command runs: the worker service loads torch, which `pacer` must not
    # load just to build its parser
    from gpu_worker.service import serve_worker
    from shared.engine_layout import engine_layout
    from shared.errors import PacerError
    from shared.keys import Keys
    from shared.lifecycle import run_redis_service
    from shared.logging import configure_logging

    # `pacer up` runs a worker per rank and instance into one log: each line says which
    configure_logging("worker", args.log_level, rank=args.rank, instance=args.instance)
    engine_args = EngineArgs.from_cli(args)
    if not 0 <= args.rank < engine_args.tp:
        raise PacerError(f"--rank must be in [0, {engine_args.tp}), got {args.rank}")
    if args.role is not None:
        check_role(args.role, args.instance)
    if args.role in ("prefill", "decode") and engine_args.kv_connector == "none":
        raise PacerError(f"--role {args.role}: the K/V of a P/D instance move between "
                         "instances; give --kv-connector mooncake")
    layout = engine_layout(engine_args)
    if args.cpus:
        from shared.cpu import parse_cpu_list, set_forward_cpus
        try:
            set_forward_cpus(parse_cpu_list(args.cpus))
        except ValueError as e:
            raise PacerError(f"--cpus: {e}") from None
        import structlog
        structlog.get_logger("worker").info("forward thread pinned", cpus=args.cpus)
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    if engine_args.tp > 1:
        # a rank of a group leaves without the interpreter's finalization, where threads of
        # its process group could abort it (-6) after its error: `pacer up` reads the code
        from gpu_worker.tp.liveness import leave_process
        args.end_process = leave_process
    return run_redis_service(args.redis_url, lambda redis, stop: serve_worker(
        redis, Keys(args.key_prefix).for_instance(args.instance), layout, args.rank, stop,
        tp_host=args.tp_host, role=args.role))
