"""`pacer gateway`: the OpenAI-compatible HTTP server in front of the Redis request queue."""
from __future__ import annotations

import argparse
import os

from gateway.config import (DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING_REQUESTS,
                            DEFAULT_SHUTDOWN_TIMEOUT_S, DEFAULT_STALLED_CLIENT_TIMEOUT_S,
                            POLICIES, GatewayConfig, new_gateway_id)
from gateway.tool_parsers import PARSERS
from shared.engine_args import EngineArgs
from shared.service_args import add_service_args


def register(sub) -> None:
    p = sub.add_parser("gateway", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    add_service_args(p)
    p.add_argument("--model", default=None,
                   help="smollm2-135m (default), an HF directory, or a .gguf file")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's)")
    p.add_argument("--tp", type=int, default=1, help="worker ranks /health waits for")
    p.add_argument("--engine-args", default="", type=engine_flags,
                   help="the scheduler's and workers' engine flags as one string, split at "
                        "whitespace (docker-compose's PACER_ENGINE_ARGS): the gateway takes "
                        "--model and --max-model-len from them, over the flags above, as the "
                        "scheduler and workers do when they follow")
    p.add_argument("--instances", default="",
                   help="P/D: the engine instances /health waits for and /metrics reports, "
                        "as ID:TP,... (e.g. p0:1,d0:1); default: the colocated engine")
    p.add_argument("--router", default=None, choices=POLICIES,
                   help="data-parallel replicas: send each request to one of --instances, "
                        "each reading its own request stream (docs/design.md#cache-aware-"
                        "routing); default: the shared request stream")
    p.add_argument("--route-prefill", default="",
                   help="P/D: with --router, the prefill instances (ID,...) it chooses among; "
                        "requests go to the shared stream naming the one chosen")
    p.add_argument("--gateway-id", default=None, help="default: a random id; {pid} in it "
                   "becomes the process id (a supervisor then knows each process's heartbeat key)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body taken; a larger one is a 413 "
                        f"(default {DEFAULT_MAX_BODY_BYTES})")
    add_request_policy_args(p)
    p.set_defaults(run=run)


# the API key where --api-key gives none: the environment is not on the command line, where
# `ps` shows it to every user of the machine
API_KEY_ENV = "PACER_API_KEY"
# flags `pacer up` takes too and hands to the gateway it starts
POLICY_FLAGS = ("served_model_name", "api_key", "max_waiting_requests", "request_timeout",
                "shutdown_timeout", "stalled_client_timeout", "tool_call_parser")


def add_request_policy_args(p: argparse.ArgumentParser) -> None:
    """What the gateway lets in and how long it waits: one definition for `pacer gateway`
    and `pacer up`."""
    p.add_argument("--served-model-name", default=None,
                   help="the name clients send as `model` (default: the model's name)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help="require 'Authorization: Bearer <key>' on /v1/*, /tokenize and "
                        f"/detokenize (default: ${API_KEY_ENV}, which keeps it off the "
                        "command line)")
    p.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                   help="requests waiting for their first token beyond which new ones get 429")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="deadline in seconds for requests without a 'timeout' field")
    p.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   help="on SIGTERM, seconds running requests get to finish")
    p.add_argument("--stalled-client-timeout", type=float,
                   default=DEFAULT_STALLED_CLIENT_TIMEOUT_S,
                   help="seconds a client may read nothing while output waits for it (a "
                        "stream, or a whole answer); then its connection is reset and its "
                        "request aborted")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                   help="the model's tool-call format: serves tool_choice 'auto' (vLLM's "
                        "--enable-auto-tool-choice --tool-call-parser)")


def api_key_to_environment(args: argparse.Namespace) -> None:
    """`pacer up`: its --api-key goes to the gateway it starts in $PACER_API_KEY, not on the
    gateway's command line, which `ps` shows every user of the machine. An empty one stays
    on it, for the gateway's check to refuse."""
    if args.api_key is not None and args.api_key.strip():
        os.environ[API_KEY_ENV] = args.api_key
        args.api_key = None


def engine_flags(text: str) -> argparse.Namespace:
    """--engine-args, read as `pacer scheduler` and `pacer worker` read their engine flags."""
    p = argparse.ArgumentParser(prog="--engine-args", add_help=False, exit_on_error=False)
    EngineArgs.add_cli_args(p)
    try:
        flags, rest = p.parse_known_args(text.split())
    except argparse.ArgumentError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if rest:
        raise argparse.ArgumentTypeError(f"not an engine flag: {' '.join(rest)}")
    return flags


def parse_instances(text: str) -> tuple[tuple[str, int], ...]:
    """"p0:1,d0:2" -> (("p0", 1), ("d0", 2))."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, tp = item.partition(":")
        try:
            out.append((name, int(tp or 1)))
        except ValueError:
            raise SystemExit(f"--instances: {item!r} is not ID:TP") from None
    return tuple(out)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    engine = args.engine_args
    model = args.model if engine.model is None else engine.model
    max_model_len = args.max_model_len if engine.max_model_len is None else engine.max_model_len
    return GatewayConfig(host=args.host, port=args.port, redis_url=args.redis_url,
                         key_prefix=args.key_prefix, model=model,
                         served_model_name=args.served_model_name,
                         max_model_len=max_model_len, api_key=args.api_key, tp=args.tp,
                         instances=parse_instances(args.instances), router=args.router,
                         route_prefill=tuple(filter(None, args.route_prefill.split(","))),
                         gateway_id=(args.gateway_id or new_gateway_id()).replace(
                             "{pid}", str(os.getpid())),
                         max_body_bytes=args.max_body_bytes,
                         max_waiting_requests=args.max_waiting_requests,
                         request_timeout_s=args.request_timeout,
                         shutdown_timeout_s=args.shutdown_timeout,
                         stalled_client_timeout_s=args.stalled_client_timeout,
                         tool_call_parser=args.tool_call_parser)


def run(args: argparse.Namespace) -> int:
    from gateway.app import run_gateway
    from shared.logging import configure_logging

    configure_logging("gateway", args.log_level)
    return run_gateway(config_from_args(args))
