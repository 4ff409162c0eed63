"""`pacer up`: Redis, the scheduler, one worker per TP rank and the gateway on this machine.

    pacer up [--model M] [--tp N] [--host H] [--port 8000] [--redis-url URL] [engine flags]

Starts a `redis-server` when none answers at the URL (a `redis://` URL on this machine; the
password, if the URL or $PACER_REDIS_PASSWORD gives one, becomes the server's), then each
service as its own process,
waits until the gateway's /health is 200, and prints the URL. Ctrl-C or SIGTERM drains: the
gateway answers 503 to new requests and gives running ones `--shutdown-timeout` seconds to
finish (then ends them with an error event), then the rest stops in order (scheduler,
workers, Redis) and `pacer up` exits 0; a second Ctrl-C or SIGTERM stops every service at
once (the open requests end with their error event now). A child that dies during start-up
stops everything with a non-zero exit naming it; one that dies later is restarted
(`services/restarts.py`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, fields, replace
from urllib.parse import urlsplit

import structlog

from gateway.cli import POLICY_FLAGS, add_request_policy_args, api_key_to_environment
from gateway.config import POLICIES
from scheduler_svc.cli import DISAGG_MIN_PROMPT_TOKENS, default_scheduler_id
from services.restarts import HeartbeatKeys, Restarter, Watchdog
from services.supervisor import Child, Supervisor, pacer_argv, wait_quietly
from shared import gpu_memory
from shared.config import parse_size
from shared.cpu import format_cpu_list, place_instances
from shared.engine_args import EngineArgs
from shared.engine_layout import EngineLayout
from shared.errors import PacerError
from shared.keys import DEFAULT_PREFIX, Keys
from shared.lifecycle import describe_exit
from shared.logging import configure_logging, output_gone
from shared.service_args import (add_log_level_arg, non_negative_int, non_negative_seconds,
                                 password_to_environment, positive_seconds, redis_password,
                                 refused_for_good, shown_url)

log = structlog.get_logger("up")

PROGRESS_EVERY_S = 5.0
STOP_MARGIN_S = 5.0          # past the shutdown timeout, before a child is killed
REDIS_CHILD = "redis"        # the name of the redis-server pacer up starts, among its children


def register(sub) -> None:
    p = sub.add_parser("up", help="start Redis, the scheduler, the workers and the gateway")
    EngineArgs.add_cli_args(p)
    p.add_argument("--host", default="127.0.0.1", help="gateway address")
    p.add_argument("--port", type=int, default=8000, help="gateway port")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0",
                   help="a Redis to use; started here when none answers on a local address")
    p.add_argument("--key-prefix", default=DEFAULT_PREFIX, help="namespace of every Redis key")
    p.add_argument("--startup-timeout", type=positive_seconds, default=600.0,
                   help="seconds to wait for /health to turn 200; a service "
                        "restarted later that writes no heartbeat for this long is killed "
                        "(and restarted again, up to 3 times in a row)")
    add_request_policy_args(p)
    add_log_level_arg(p)
    p.add_argument("--watchdog-s", type=non_negative_seconds, default=30.0,
                   help="kill (and so restart) a service that has written no "
                        "heartbeat for this long while its process lives: stopped or hung "
                        "(0: never; docs/failure-modes.md#a-service-that-hangs)")
    p.add_argument("--pin-cpus", action=argparse.BooleanOptionalAction, default=True,
                   help="CPU, several engine instances (P/D, replicas): each instance's forward "
                        "threads on cores of their own, where they fit "
                        "(docs/design.md#cores-for-the-forward-threads; default: on)")
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="debugging: schedulers plan each iteration only after the last one's "
                        "result is in (docs/design.md#overlap)")
    g = p.add_argument_group("P/D disaggregation (docs/design.md#pd-disaggregation)")
    g.add_argument("--prefill-workers", type=int, default=0,
                   help="prefill instances (with --decode-workers; default: colocated)")
    g.add_argument("--decode-workers", type=int, default=0, help="decode instances")
    g.add_argument("--prefill-tp", type=int, default=None, help="TP degree of each prefill "
                   "instance (default: --tp)")
    g.add_argument("--decode-tp", type=int, default=None, help="TP degree of each decode "
                   "instance (default: --tp)")
    g.add_argument("--disagg-min-prompt-tokens", type=non_negative_int, default=None,
                   help="shorter prompts are prefilled on the decode instance itself "
                        f"(default: {DISAGG_MIN_PROMPT_TOKENS})")
    g.add_argument("--prefill-kv-cache-memory", default=None,
                   help="KV pool memory per rank of each prefill instance, e.g. 512MiB: it holds "
                        "the prompts being prefilled and their prefix cache (default: "
                        "--kv-cache-memory; given, it replaces --num-kv-blocks there)")
    g.add_argument("--decode-kv-cache-memory", default=None,
                   help="KV pool memory per rank of each decode instance, e.g. 8GiB: it holds "
                        "every running request (default: --kv-cache-memory; given, it replaces "
                        "--num-kv-blocks there)")
    g.add_argument("--prefill-threads", type=int, default=None,
                   help="CPU: torch threads of each prefill worker (default: shared out)")
    g.add_argument("--decode-threads", type=int, default=None,
                   help="CPU: torch threads of each decode worker (default: shared out)")
    g = p.add_argument_group("data-parallel replicas (docs/design.md#cache-aware-routing)")
    g.add_argument("--replicas", type=int, default=None,
                   help="engine instances r0..rN-1 (a scheduler and --tp workers each) behind "
                        "the one gateway, each reading its own request stream")
    g.add_argument("--router", default=None, choices=POLICIES,
                   help="how the gateway picks a replica, or a prefill instance of several "
                        "(default: prefix, the one holding the prompt's prefix unless "
                        "overloaded)")
    p.set_defaults(run=run)


# what the instances of P/D take (each >= 1; None: the default)
PD_FLAGS = ("prefill_tp", "decode_tp", "prefill_threads", "decode_threads")
# each pool's own KV memory (a size; None: --kv-cache-memory)
PD_KV_FLAGS = ("prefill_kv_cache_memory", "decode_kv_cache_memory")
# every flag only P/D reads: refused without it rather than ignored without a word
PD_ONLY_FLAGS = (*PD_FLAGS, *PD_KV_FLAGS, "disagg_min_prompt_tokens")


@dataclass(frozen=True)
class Instance:
    """One engine instance `pacer up` starts: its id ("" colocated), role and TP degree."""
    id: str
    role: str
    tp: int
    threads: int | None = None
    kv_cache_memory: str | None = None      # its own (P/D's per-pool flag); None: the engine's

    def name(self, service: str) -> str:
        return f"{self.id} {service}" if self.id else service

    def engine(self, engine: EngineArgs) -> EngineArgs:
        """The engine flags this instance runs with: its TP degree and KV memory."""
        if self.kv_cache_memory is None:
            return replace(engine, tp=self.tp)
        return replace(engine, tp=self.tp, kv_cache_memory=self.kv_cache_memory,
                       num_kv_blocks=None)


def instances_of(args: argparse.Namespace, engine: EngineArgs) -> list[Instance]:
    p, d = args.prefill_workers, args.decode_workers
    replicas = getattr(args, "replicas", None)
    if replicas and (p or d):
        raise PacerError("--replicas with --prefill-workers/--decode-workers is not supported "
                         "(with P/D, the router chooses among the prefill instances)")
    if replicas is not None and replicas < 1:
        raise PacerError(f"--replicas must be >= 1, got {replicas}")
    for name in PD_ONLY_FLAGS:
        value = getattr(args, name, None)
        flag = "--" + name.replace("_", "-")
        if name in PD_FLAGS and value is not None and value < 1:
            raise PacerError(f"{flag} must be >= 1, got {value}")
        if name in PD_KV_FLAGS and value is not None:
            try:
                size = parse_size(value)
            except PacerError as e:
                raise PacerError(f"{flag}: {e}") from None
            if size <= 0:
                raise PacerError(f"{flag} must be more than 0 bytes, got {value!r}")
        if value is not None and not (p or d):     # else ignored, unknown to whoever gave it
            raise PacerError(f"{flag} is for P/D: give --prefill-workers N --decode-workers N")
    if getattr(args, "router", None) and not replicas and p < 2:
        raise PacerError("--router needs --replicas N or --prefill-workers N (N > 1)")
    if replicas:
        threads = shared_out(engine, replicas * engine.tp)
        return [Instance(f"r{i}", "colocated", engine.tp, threads) for i in range(replicas)]
    if not p and not d:
        return [Instance("", "colocated", engine.tp)]
    if p < 1 or d < 1:
        raise PacerError(f"P/D needs at least one of each: --prefill-workers {p} "
                         f"--decode-workers {d}")
    ptp, dtp = args.prefill_tp or engine.tp, args.decode_tp or engine.tp
    if ptp != dtp:
        raise PacerError(f"--prefill-tp {ptp} and --decode-tp {dtp} differ: a prefill rank "
                         "sends its K/V heads to the decode rank of the same index, so both "
                         "sides need the same TP degree")
    threads = shared_out(engine, p * ptp + d * dtp)
    kv = {role: getattr(args, f"{role}_kv_cache_memory", None) for role in ("prefill", "decode")}
    return ([Instance(f"p{i}", "prefill", ptp, args.prefill_threads or threads,
                      kv["prefill"]) for i in range(p)]
            + [Instance(f"d{i}", "decode", dtp, args.decode_threads or threads, kv["decode"])
               for i in range(d)])


def shared_out(engine: EngineArgs, ranks: int) -> int | None:
    """On CPU, the torch threads of each of `ranks` worker ranks that share this machine's
    cores (instead of each spinning on all of them); elsewhere None."""
    if engine.device != "cpu":
        return None
    return max(1, len(os.sched_getaffinity(0)) // ranks)


def rank_cpus(instances: list[Instance]) -> list[list[int]] | None:
    """Each worker rank's cores (instances in order, ranks in order; the ranks of one
    instance share its cores: they meet at every layer, and one that a service holds up must
    be free to move), or None: one instance, not on CPU (no thread counts), or more threads
    than cores."""
    if len(instances) < 2 or any(i.threads is None for i in instances):
        return None
    placed = place_instances([i.tp * i.threads for i in instances],
                             sorted(os.sched_getaffinity(0)))
    if placed is None:
        return None
    return [cores for inst, cores in zip(instances, placed) for _ in range(inst.tp)]


def engine_flags(args: EngineArgs) -> list[str]:
    """EngineArgs back into the flags `EngineArgs.add_cli_args` reads."""
    flags: list[str] = []
    for f in fields(EngineArgs):
        value = getattr(args, f.name)
        if f.name == "enable_chunked_prefill":
            flags += [] if value else ["--no-chunked-prefill"]
        elif f.name == "enable_prefix_caching":
            flags += [] if value else ["--no-prefix-caching"]
        elif f.name == "cuda_graphs":
            flags += [] if value else ["--no-cuda-graphs"]
        elif value is not None:
            flags += [f"--{f.name.replace('_', '-')}", str(value)]
    return flags


# ---- Redis -------------------------------------------------------------------------------

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0")


def _checked_redis_url(redis_url: str):
    """The URL split, or one clear line for one the services could never use."""
    import redis
    try:
        url = urlsplit(redis_url)
        url.port                                  # raises for a port out of range
        redis.Redis.from_url(redis_url)           # its scheme and options; connects to nothing
    except ValueError as e:
        raise PacerError(f"--redis-url {shown_url(redis_url)!r}: {e}") from None
    return url


def _check_redis_db(redis_url: str, must_answer: bool = False) -> None:
    """A Redis that answers but refuses the URL's database (a server has 16 unless set
    otherwise) or its credentials: one clear line now, not services retrying it forever. With
    `must_answer` (a URL pacer up starts no server for, so none is on its way), no answer at
    all is such a line too, as for a plain URL on another host."""
    import redis
    client = redis.Redis.from_url(redis_url, password=redis_password(), socket_timeout=2,
                                  socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as e:
        if (error := refused_for_good(redis_url, e)) is not None:
            raise error from None
        if must_answer and isinstance(e, (redis.ConnectionError, redis.TimeoutError)) \
                and not isinstance(e, redis.BusyLoadingError):
            raise PacerError(f"no Redis answers at {shown_url(redis_url)} ({e}; pacer up "
                             f"starts one only for a redis:// URL on a local address)") from None
        # else there, loading its data: the services wait
    finally:
        client.close()


def _mark_pools_untold(redis_url: str, keys: Keys, instances: list[Instance]) -> None:
    """In the Redis pacer up has just started, still empty and before any service of its own:
    each decode instance's first scheduler takes its mark and starts without waiting for late
    K/V writes of a predecessor's reservations, since it has none and no prefill worker was
    told where its pool is (docs/failure-modes.md). A restarted scheduler, or one in a Redis
    restarted since, finds no mark and waits."""
    import redis
    marks = {keys.for_instance(i.id).pool_untold: 1 for i in instances if i.role == "decode"}
    if not marks:
        return
    client = redis.Redis.from_url(redis_url, password=redis_password(), socket_timeout=2,
                                  socket_connect_timeout=2)
    try:
        if client.dbsize() == 0:        # not empty: it loaded a dump file, keep to the wait
            client.mset(marks)
    except redis.RedisError as e:       # the schedulers wait as after a restart
        log.warning("could not mark the decode pools new; their schedulers wait for late "
                    "K/V writes at start", error=str(e))
    finally:
        client.close()


def _check_listen_address(host: str, port: int) -> None:
    """Where the gateway is to listen: a fixed port (pacer up waits on it) that is free now."""
    import socket
    if port == 0:
        raise PacerError("--port 0 (any free port) is for `pacer gateway` alone: pacer up waits "
                         "for /health on the port it gives, so give one")
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise PacerError(f"cannot listen on --host {host}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as the gateway binds
        try:
            s.bind(address)
        except OSError as e:
            raise PacerError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def redis_answers(host: str, port: int, timeout_s: float = 0.5) -> bool:
    return _listener(host, port, timeout_s) == "redis"


def _listener(host: str, port: int, timeout_s: float = 0.5) -> str | None:
    """What listens at host:port: "redis" (it answers PING in Redis's protocol: PONG, or an
    error such as NOAUTH or LOADING), "other" (it takes the connection, but answers otherwise
    or not in time), or None."""
    import socket
    try:
        s = socket.create_connection((host, port), timeout=timeout_s)
    except OSError:
        return None
    with s:
        try:
            s.sendall(b"PING\r\n")
            reply = s.recv(64)
        except OSError:
            return "other"
    # a password-protected Redis answers -NOAUTH, one loading its data -LOADING: it is
    # there, just not ours to start
    return "redis" if reply.startswith((b"+", b"-")) else "other"


def start_redis(sup: Supervisor, host: str, port: int, password: str | None = None) -> Child:
    exe = shutil.which("redis-server")
    if exe is None:
        raise PacerError(f"no Redis answers at {host}:{port} and redis-server is not installed: "
                         "apt-get install redis-server (or pass --redis-url of a running Redis)")
    argv = [exe, "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no",
            "--loglevel", "warning"]
    config = None
    if password:    # read from its stdin ("-"): on its command line any user could read it
        argv.insert(1, "-")
        config = f"requirepass {redis_config_quoted(password)}\n".encode()
    child = sup.start(REDIS_CHILD, argv, stdout=sys.stderr,      # our stdout carries only the URL
                      stdin_data=config)
    end = time.monotonic() + 10.0
    while time.monotonic() < end:
        if child.returncode is not None:
            raise PacerError(f"redis-server on port {port} exited at start "
                             f"({describe_exit(child.returncode)})")
        if redis_answers(host, port):
            return child
        time.sleep(0.05)
    raise PacerError(f"redis-server on port {port} did not answer within 10 s")


def redis_config_quoted(value: str) -> str:
    """`value` as one argument of a redis.conf line: double-quoted, every byte but letters and
    digits as \\xHH (Redis reads them back exactly; spaces, quotes and backslashes included)."""
    return '"' + "".join(chr(b) if chr(b).isalnum() and b < 128 else f"\\x{b:02x}"
                         for b in value.encode()) + '"'


def describe_redis(redis_url: str, started: bool) -> str:
    """Which Redis `pacer up` uses, for its log and banner (a password in the URL is masked).
    A Redis found listening may be another one: on Debian, installing redis-server starts a
    system one on 6379."""
    url, shown = urlsplit(redis_url), shown_url(redis_url)
    if started:
        return f"Redis {shown}: a redis-server started by pacer up (stopped with it, keeps nothing)"
    if url.scheme != "redis":
        return f"Redis {shown}: used as given (pacer up starts a server only for a redis:// URL)"
    return (f"Redis {shown}: one already listening there, NOT started by pacer up (a system "
            "redis-server, say); it keeps running after pacer up stops; use --redis-url to choose another")


# ---- the services ------------------------------------------------------------------------

@dataclass
class Services:
    """The children `pacer up` starts, in start order, and what a restart needs of them."""
    argvs: list[tuple[str, list[str]]]
    heartbeat_keys: HeartbeatKeys
    groups: dict[str, str]              # child name -> the group it restarts with


def _service_argvs(args: argparse.Namespace, engine: EngineArgs) -> Services:
    common = ["--redis-url", args.redis_url, "--key-prefix", args.key_prefix,
              "--log-level", args.log_level]
    keys = Keys(args.key_prefix)
    instances = instances_of(args, engine)
    # an id of each gateway process's own (its restart is another gateway to the schedulers,
    # which end a gone one's requests), whose heartbeat pacer up can read
    gateway_id = f"up-{uuid.uuid4().hex[:8]}-{{pid}}"
    gateway = ["gateway", "--host", args.host, "--port", str(args.port), "--tp", str(engine.tp),
               "--gateway-id", gateway_id, *common]
    replicas = instances[0].role == "colocated" and bool(instances[0].id)
    prefills = [i.id for i in instances if i.role == "prefill"]
    if instances[0].id:
        gateway += ["--instances", ",".join(f"{i.id}:{i.tp}" for i in instances)]
    if replicas or len(prefills) > 1:
        gateway += ["--router", args.router or "prefix"]
    if len(prefills) > 1:
        gateway += ["--route-prefill", ",".join(prefills)]
    for name in ("model", "max_model_len", *POLICY_FLAGS):
        value = getattr(args, name)
        if value is not None:
            gateway += [f"--{name.replace('_', '-')}", str(value)]
    workers, schedulers, heartbeats, groups = [], [], {}, {}
    cpus = iter(rank_cpus(instances) or []) if args.pin_cpus else iter(())
    for inst in instances:
        ikeys = keys.for_instance(inst.id)
        flags = engine_flags(replace(inst.engine(engine), kv_connector="mooncake")
                             if inst.role != "colocated" else inst.engine(engine))
        where = ["--instance", inst.id] if inst.id else []
        for r in range(inst.tp):
            name = inst.name(f"worker rank {r}")
            argv = pacer_argv("worker", "--rank", str(r), *flags, *where, *common)
            if inst.id and not replicas:
                argv += ["--role", inst.role]
            if inst.threads:
                argv += ["--threads", str(inst.threads)]
            mine = next(cpus, None)
            if mine:
                argv += ["--cpus", format_cpu_list(mine)]
            workers.append((name, argv))
            heartbeats[name] = ikeys.hb_worker(r)
            groups[name] = inst.name("worker group")
        name, sid = inst.name("scheduler"), default_scheduler_id(inst.id)
        argv = pacer_argv("scheduler", *flags, *common, *where, "--scheduler-id", sid,
                          "--drain-timeout", str(args.shutdown_timeout))
        if not args.overlap:
            argv += ["--no-overlap"]
        if replicas:
            argv += ["--own-request-stream"]
        elif inst.id:
            argv += ["--role", inst.role]
            if args.disagg_min_prompt_tokens is not None:
                argv += ["--disagg-min-prompt-tokens", str(args.disagg_min_prompt_tokens)]
        schedulers.append((name, argv))
        heartbeats[name] = keys.hb_scheduler(sid)
    # stopped in reverse: the gateway first, the schedulers drain while workers still run
    heartbeats["gateway"] = lambda pid: keys.hb_gateway(gateway_id.replace("{pid}", str(pid)))
    return Services([*workers, *schedulers, ("gateway", pacer_argv(*gateway))], heartbeats,
                    groups)


def _check_memory(layout: EngineLayout, instances: list[Instance]) -> None:
    """A KV pool that holds one request of the whole context, in each instance; a CUDA device
    this torch can use; on CPU, KV pools that fit in the machine's memory (each worker rank
    allocates its own, of its instance's KV memory, or `--num-kv-blocks` blocks of its
    1/tp of the heads)."""
    from shared.engine_layout import engine_layout
    engine = layout.args
    layouts = {}                                  # each instance's engine, sized once
    for inst in instances:
        args = inst.engine(engine)
        if args not in layouts:
            layouts[args] = layout if args == engine else engine_layout(args)
            try:
                layouts[args].check_pool_holds_context()
            except PacerError as e:
                if args == engine:
                    raise
                own = (f"--{inst.role}-kv-cache-memory {inst.kv_cache_memory}"
                       if inst.kv_cache_memory else f"--{inst.role}-tp {inst.tp}")
                raise PacerError(f"the {inst.role} instances ({own}): {e}") from None
    if engine.device.startswith("cuda"):
        gpu_memory.check_cuda_device(engine.device, engine.tp)
        return
    sized = [(inst, layouts[inst.engine(engine)]) for inst in instances]
    if any(lay.args.kv_cache_memory is None and not lay.args.num_kv_blocks for _, lay in sized):
        return
    total = sum(inst.tp * (lay.num_kv_blocks * lay.kv_block_bytes if lay.args.num_kv_blocks
                           else parse_size(lay.args.kv_cache_memory)) for inst, lay in sized)
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if total > physical:
        pools = sorted({f"--{inst.role}-kv-cache-memory {inst.kv_cache_memory}"
                        if inst.kv_cache_memory else
                        f"{lay.kv_pool_flag} {lay.args.num_kv_blocks or lay.args.kv_cache_memory}"
                        for inst, lay in sized})
        ranks = sum(inst.tp for inst, _ in sized)
        raise PacerError(f"{', '.join(pools)} for {ranks} worker rank(s) come to "
                         f"{total / 2**30:.1f} GiB, more than this machine's "
                         f"{physical / 2**30:.1f} GiB of memory")


def _check_gateway_flags(services: Services) -> None:
    """Read the gateway's argv as the gateway will (a bad --port or --max-waiting-requests raises
    PacerError here, before Redis and the workers start, not after the model loads)."""
    from gateway.cli import config_from_args
    from services.cli import build_parser
    argv = dict(services.argvs)["gateway"]
    config_from_args(build_parser().parse_args(argv[argv.index("services.cli") + 1:]))


def gateway_url(host: str, port: int) -> str:
    """Where this machine reaches the gateway listening on `host`, as the banner prints it for
    a person to paste: an IPv6 address in brackets (`http://::1:8000` is no URL)."""
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _health(base_url: str) -> tuple[int | None, dict]:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2.0) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {}
    except (OSError, ValueError):
        return None, {}


class _Signals:
    """SIGINT/SIGTERM set a flag; the main loop notices within 50 ms. Each signal after the
    first (Ctrl-C again: the operator will not wait) is passed on to every service still
    running: one already stopping takes it as its second signal and stops now (the gateway
    ends its open streams with their error event at once, not after --shutdown-timeout),
    one not told yet starts to stop now rather than in turn. Redis still stops last."""

    def __init__(self, sup: Supervisor) -> None:
        self.received: int | None = None
        self._sup = sup
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        if self.received is not None:
            self._stop_now()
        self.received = signum

    def _stop_now(self) -> None:
        try:
            print("pacer up: signalled again; stopping every service now (open requests end "
                  "with an error event)", file=sys.stderr, flush=True)
        except BrokenPipeError:
            output_gone()
        for child in self._sup.children:
            if child.name != REDIS_CHILD and child.returncode is None:
                try:
                    child.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def __call__(self) -> bool:
        return self.received is not None


def _wait_healthy(sup: Supervisor, base_url: str, timeout_s: float, stopping: _Signals) -> None:
    start = time.monotonic()
    said = 0.0
    while not stopping():
        for child in sup.newly_exited():
            raise PacerError(f"{child.name} exited during start-up "
                             f"({describe_exit(child.returncode)}); {child.last_error()}")
        status, body = _health(base_url)
        if status == 200:
            return
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise PacerError(f"{base_url}/health not 200 after {timeout_s:.0f} s: {body}")
        if waited - said >= PROGRESS_EVERY_S:
            missing = ", ".join(body.get("missing", [])) or "the gateway"
            print(f"pacer up: waiting for {missing} ({waited:.0f} s; the workers load the "
                  "model)", file=sys.stderr, flush=True)
            said = waited
        wait_quietly(0.25, stopping)


def _watch(sup: Supervisor, stopping: _Signals, restarter: Restarter,
           watchdog: Watchdog) -> int:
    """Until a signal (0) or a child that keeps dying (PacerError, naming it); a death is
    restarted, and a child silent too long is killed (then restarted as a death is)."""
    while not stopping():
        for child in sup.newly_exited():
            restarter.handle(child, stopping)
        restarter.count_again()
        restarter.check_started()
        for child in watchdog.hung(sup.children):
            print(f"pacer up: {child.name} (pid {child.pid}) wrote no heartbeat for "
                  f"{watchdog.after_s:g} s while its process lived (stopped or hung); "
                  "killing it", file=sys.stderr, flush=True)
            child.proc.kill()
        wait_quietly(0.1, stopping)
    return 0


def run(args: argparse.Namespace) -> int:
    from shared.engine_layout import engine_layout

    configure_logging("up", args.log_level)
    args.redis_url = password_to_environment(args.redis_url)
    api_key_to_environment(args)
    engine = EngineArgs.from_cli(args)
    # refuse bad flags here, before anything starts (the instances' layout is checked as
    # the services' command lines are made)
    layout = engine_layout(engine)
    # each instance's own engine (--prefill-tp, --decode-kv-cache-memory, ...): the model's
    # heads split so, and a KV pool that holds the context, as its scheduler checks
    _check_memory(layout, instances_of(args, engine))
    services = _service_argvs(args, engine)
    _check_gateway_flags(services)
    _check_listen_address(args.host, args.port)
    url = _checked_redis_url(args.redis_url)
    host, port = url.hostname or "127.0.0.1", url.port or 6379
    reasons = tempfile.TemporaryDirectory(prefix="pacer-up-")   # the children's last errors
    sup = Supervisor(reasons.name)
    stopping = _Signals(sup)
    try:
        # only a plain redis:// URL can be a server of ours; rediss:// and unix sockets are used
        listener = _listener(host, port) if url.scheme == "redis" else "redis"
        if listener == "other" and host in LOCAL_HOSTS:     # where it would start its own
            raise PacerError(f"something listens at {host}:{port} that does not answer PING as "
                             f"Redis does (not Redis, or a Redis too busy to answer in time): "
                             f"give --redis-url of a Redis, or free the port")
        started = listener != "redis"
        if started and host not in LOCAL_HOSTS:
            raise PacerError(f"no Redis answers at {shown_url(args.redis_url)} (pacer up "
                             f"starts one only on a local address: {', '.join(LOCAL_HOSTS)})")
        if started:
            start_redis(sup, host, port, redis_password())   # the URL's, or the variable's
        _check_redis_db(args.redis_url, must_answer=url.scheme != "redis")
        if started:
            _mark_pools_untold(args.redis_url, Keys(args.key_prefix),
                               instances_of(args, engine))
        redis_note = describe_redis(args.redis_url, started)
        log.info("redis", redis=redis_note, started_here=started)
        restarter = Restarter(sup, args.redis_url, services.heartbeat_keys, services.groups,
                              Keys(args.key_prefix).restarts, args.startup_timeout)
        restarter.count_again()         # none yet: an earlier run's counts are not this one's
        for name, argv in services.argvs:
            sup.start(name, argv)
        base_url = gateway_url(args.host, args.port)
        _wait_healthy(sup, base_url, args.startup_timeout, stopping)
        if stopping():
            return 0
        # the name clients send as "model" (as /v1/models lists it)
        name = args.served_model_name or layout.source.name
        banner = (f"pacer up: serving {name} at {base_url}/v1 "
                  f"(Ctrl-C to stop)\npacer up: {redis_note}")
        # among the services' logs at a terminal, set the line apart
        print(f"\n{banner}\n" if sys.stdout.isatty() else banner, flush=True)
        watchdog = Watchdog(args.redis_url, services.heartbeat_keys, args.watchdog_s)
        try:
            return _watch(sup, stopping, restarter, watchdog)
        finally:
            watchdog.close()
    finally:
        _stop(sup, args.shutdown_timeout, services.groups)
        reasons.cleanup()


def _stop(sup: Supervisor, shutdown_timeout_s: float, groups: dict[str, str]) -> None:
    if any(c.returncode is None for c in sup.children):
        try:
            print("pacer up: stopping", file=sys.stderr, flush=True)
        except BrokenPipeError:
            output_gone()       # no one reads us any more: the children must stop all the same
    # the gateway drains first and ends what is left, so the scheduler then stops quickly
    limit = shutdown_timeout_s + STOP_MARGIN_S
    sup.stop_all(timeouts={c.name: limit for c in sup.children
                           if c.name == "gateway" or c.name.endswith("scheduler")},
                 groups=groups)

