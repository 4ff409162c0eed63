"""`pacer up` refuses a bad flag of any service before it starts anything (Redis, workers that
load the model), with the flag named."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.redis_fixture import redis_server  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_bad_gateway_flag_is_refused_before_redis_or_a_worker_starts():
    redis_port = _free_port()
    proc = subprocess.run([sys.executable, "-m", "services.cli", "up", "--port", "99999",
                           "--redis-url", f"redis://127.0.0.1:{redis_port}/0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--port must be in [0, 65535], got 99999" in proc.stderr, proc.stderr
    # nothing was started: no redis-server on the port, no worker's log lines
    assert "redis-server" not in proc.stdout + proc.stderr
    assert "worker" not in proc.stderr.lower(), proc.stderr
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", redis_port)) != 0


def _up(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "up", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_start_up_mistakes_get_one_line_not_a_hang_or_a_traceback():
    port, redis_port = _free_port(), _free_port()
    local = f"redis://127.0.0.1:{redis_port}"
    redis_ports = []

    def flags(*given: str, redis_url: str | None = None) -> list[str]:
        # each case its own ports: the cases run side by side
        if redis_url is None:
            redis_ports.append(_free_port())
            redis_url = f"redis://127.0.0.1:{redis_ports[-1]}/0"
        return ["--port", str(_free_port()), *given, "--redis-url", redis_url]

    pd = ("--prefill-workers", "1", "--decode-workers", "1")
    cases = [
        (["--port", "0", "--redis-url", f"{local}/0"], "--port 0"),
        (flags(redis_url=f"{local}/99"), "DB index is out of range"),
        (flags(redis_url="redis://127.0.0.1:70000/0"), "Port out of range"),
        (flags(redis_url="http://127.0.0.1:1/0"), "Redis URL must specify"),
        (flags(redis_url="redis://:pw@10.255.255.1:6379/0"),
         "no Redis answers at redis://10.255.255.1"),   # (its password moved aside)
        (flags("--host", "256.1.1.1"), "cannot listen on --host 256.1.1.1"),
        (flags("--num-kv-blocks", "0"), "--num-kv-blocks must be >= 1"),
        (flags("--replicas", "0"), "--replicas must be >= 1"),
        (flags("--api-key", ""), "--api-key (or $PACER_API_KEY, its default) is empty"),
        (flags("--device", "nonsense"), "--device must be cpu or cuda[:N]"),
        (flags(*pd, "--prefill-threads", "0"), "--prefill-threads must be"),
        (flags(*pd, "--decode-threads", "-1"), "--decode-threads must be >= 1, got -1"),
        (flags(*pd, "--prefill-tp", "0"), "--prefill-tp must be >= 1, got 0"),
        (flags("--decode-threads", "2"), "--decode-threads is for P/D"),
        # an instance's own TP degree: the heads must split so, and its pool hold the context
        (flags(*pd, "--prefill-tp", "2", "--decode-tp", "2"),
         "tp=2 does not divide the model's 9 query heads"),
        (flags(*pd, "--tp", "3", "--prefill-tp", "1", "--decode-tp", "1", "--dtype", "float32",
               "--quantization", "none", "--kv-cache-memory", "64MiB", "--max-model-len", "2048"),
         "fewer than the context of 2048"),
        (flags("--max-model-len", "100000"),
         "--max-model-len must be in [2, 8192] (the model's context), got 100000"),
        (flags("--served-model-name", " "), "--served-model-name is empty"),
        (flags("--startup-timeout", "0"), "--startup-timeout: must be > 0"),
        (flags("--stalled-client-timeout", "0"), "--stalled-client-timeout must be > 0"),
        (flags("--kv-timeout-s", "-1"), "--kv-timeout-s must be > 0"),
        (flags(*pd, "--disagg-min-prompt-tokens", "-1"),
         "--disagg-min-prompt-tokens: must be >= 0"),
        (flags("--kv-cache-memory", "64TiB"), "more than this machine's"),
        (flags("--num-kv-blocks", "96"),
         "the KV pool holds 1536 tokens (96 blocks of 16), fewer than the context of 8192: "
         "give --max-model-len 1536 or less, or more --num-kv-blocks"),
        (flags("--num-kv-blocks", "1000000000"), "more than this machine's"),
    ]
    with ThreadPoolExecutor(max_workers=3) as pool:
        procs = list(pool.map(lambda case: _up(*case[0]), cases))
    for (flags, needle), proc in zip(cases, procs):
        assert proc.returncode != 0 and needle in proc.stderr, (flags, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr and "pw@" not in proc.stderr, proc.stderr[-2000:]
    for p in redis_ports:                           # no case left a Redis behind
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", p)) != 0, p
    import torch
    if not torch.cuda.is_available():     # a CPU build, or no GPU: refused before the workers
        proc = _up("--port", str(port), "--device", "cuda", "--kv-cache-memory", "1GiB",
                   "--redis-url", f"{local}/0")
        assert proc.returncode != 0 and "--device cuda" in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and "worker" not in proc.stderr.lower(), \
            proc.stderr[-2000:]
    with socket.socket() as other:                  # not a Redis on the Redis port
        other.bind(("127.0.0.1", redis_port))
        other.listen()
        proc = _up("--port", str(port), "--redis-url", f"{local}/0")
    assert proc.returncode != 0 and "that does not answer PING as Redis does" in proc.stderr, \
        proc.stderr[-2000:]
    with socket.socket() as taken:                  # the gateway's port already in use
        taken.bind(("127.0.0.1", port))
        taken.listen()
        proc = _up("--port", str(port), "--redis-url", f"{local}/0")
    assert proc.returncode != 0 and f"cannot listen on 127.0.0.1:{port}" in proc.stderr, \
        proc.stderr[-2000:]
    with socket.socket() as s:                       # the Redis pacer up started is stopped
        assert s.connect_ex(("127.0.0.1", redis_port)) != 0


def test_a_scheduler_started_alone_refuses_a_pool_shorter_than_the_context():
    """As `pacer up` does (above), for the docker-compose and multi-machine case: at start,
    not as every chat request without max_tokens is refused."""
    proc = subprocess.run([sys.executable, "-m", "services.cli", "scheduler", "--num-kv-blocks",
                           "96", "--redis-url", f"redis://127.0.0.1:{_free_port()}/0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "the KV pool holds 1536 tokens (96 blocks of 16), fewer " \
        "than the context of 8192: give --max-model-len 1536 or less" in proc.stderr, \
        proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("flag, value, said", [
    ("--max-waiting", "-3", "must be >= 1, got -3"),
    ("--drain-timeout", "nan", "must be a number >= 0, got nan"),
])
def test_a_scheduler_refuses_a_bound_that_would_never_pull_or_never_end(flag, value, said):
    """A negative --max-waiting pulled no request ever (the gateway's requests waited for
    nobody); a NaN --drain-timeout never ran out. Both are refused with one line, before
    Redis is even tried."""
    proc = subprocess.run([sys.executable, "-m", "services.cli", "scheduler", flag, value,
                           "--redis-url", f"redis://127.0.0.1:{_free_port()}/0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"argument {flag}: {said}" in proc.stderr, proc.stderr


def test_the_url_pacer_up_prints_is_one_a_client_can_use():
    from services.up import gateway_url
    assert gateway_url("127.0.0.1", 8000) == "http://127.0.0.1:8000"
    assert gateway_url("0.0.0.0", 8000) == gateway_url("::", 8000) == "http://127.0.0.1:8000"
    assert gateway_url("::1", 8000) == "http://[::1]:8000"
    assert gateway_url("localhost", 8000) == "http://localhost:8000"


@pytest.mark.parametrize("extra", [(), ("--replicas", "2")])
def test_a_pd_only_threshold_without_pd_is_refused_not_ignored(extra):
    """--disagg-min-prompt-tokens reaches only P/D's schedulers: colocated or with replicas it
    was dropped without a word, as --prefill-threads and the like are not."""
    redis_port = _free_port()
    proc = _up("--port", str(_free_port()), "--redis-url", f"redis://127.0.0.1:{redis_port}/0",
               "--disagg-min-prompt-tokens", "0", *extra)
    assert proc.returncode != 0 and "--disagg-min-prompt-tokens is for P/D: give " \
        "--prefill-workers N --decode-workers N" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    with socket.socket() as s:                      # refused before a Redis was started
        assert s.connect_ex(("127.0.0.1", redis_port)) != 0


@pytest.mark.parametrize("scheme", ["rediss", "unix"])
def test_a_url_pacer_up_starts_no_server_for_is_refused_when_nothing_answers(scheme, tmp_path):
    """pacer up starts a Redis only for a local redis:// URL; for rediss:// or a unix socket
    with nothing there it started the services anyway, and they retried until the start-up
    timeout (600 s by default). Now one line, as for a redis:// URL on another host."""
    url = (f"rediss://127.0.0.1:{_free_port()}/0" if scheme == "rediss"
           else f"unix://{tmp_path}/none.sock")
    proc = _up("--port", str(_free_port()), "--redis-url", url, "--startup-timeout", "20")
    assert proc.returncode != 0 and "no Redis answers at" in proc.stderr \
        and "pacer up starts one only for a redis:// URL" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "worker" not in proc.stderr.lower(), \
        proc.stderr[-2000:]


def test_a_unix_socket_redis_that_answers_passes_the_check(tmp_path):
    from services.up import _check_redis_db
    sock = tmp_path / "redis.sock"
    server = subprocess.Popen(["redis-server", "--port", "0", "--unixsocket", str(sock),
                               "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        for _ in range(100):
            if sock.exists():
                break
            time.sleep(0.05)
        _check_redis_db(f"unix://{sock}", must_answer=True)     # raises nothing
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.mark.parametrize("command", ["up", "gateway", "scheduler", "worker"])
def test_an_unknown_log_level_is_one_line_not_a_traceback(command):
    """`--log-level verbose` was a ValueError traceback from the log's set-up."""
    proc = subprocess.run([sys.executable, "-m", "services.cli", command, "--log-level",
                           "verbose", "--redis-url", f"redis://127.0.0.1:{_free_port()}/0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "argument --log-level: debug, info, warning or error, " \
        "got 'verbose'" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("instances, said", [
    ("r0:0,r1:1", "--instances: r0:0: the TP degree must be >= 1"),
    ("r0:1,r1:1,r0:1", "--instances: r0 is named twice"),
    (":1,r1:1", "--instances: ':1' has no ID"),
])
def test_a_gateway_refuses_instances_it_would_route_or_check_wrong(instances, said):
    """`pacer gateway --instances`, as one runs it beside engine instances of its own: a TP
    of 0 took the instance's workers off /health (ok while r0's worker was stopped), and a
    name given twice was routed to as two replicas; both were accepted without a word."""
    proc = subprocess.run([sys.executable, "-m", "services.cli", "gateway", "--instances",
                           instances, "--router", "prefix", "--port", str(_free_port()),
                           "--redis-url", f"redis://127.0.0.1:{_free_port()}/0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and said in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_a_blank_api_key_in_the_environment_is_refused_naming_it(monkeypatch):
    """$PACER_API_KEY is --api-key's default: one of blanks is refused as an empty key, and
    the error names the variable (the flag was never given)."""
    from gateway.cli import config_from_args
    from services.cli import build_parser
    from shared.errors import PacerError
    monkeypatch.setenv("PACER_API_KEY", "  ")
    with pytest.raises(PacerError, match=r"\$PACER_API_KEY"):
        config_from_args(build_parser().parse_args(["gateway"]))


def test_pd_pools_take_their_own_kv_memory(tmp_path):
    """A prefill pool holds only the prompts being prefilled (and their prefix cache), a
    decode pool every running request: `--prefill-kv-cache-memory` and
    `--decode-kv-cache-memory` size each apart, its scheduler and workers alike (replacing
    `--num-kv-blocks` there), where `--kv-cache-memory` gave both the larger size. Each pool
    must hold the context, all of them the machine's memory, and a bad size is named."""
    from services.cli import build_parser
    from services.up import _check_memory, _service_argvs, instances_of
    from shared.engine_args import EngineArgs
    from shared.engine_layout import engine_layout
    from shared.errors import PacerError
    from tests.helpers_tiny_model import write_tiny_llama
    model = write_tiny_llama(tmp_path / "tiny")

    def up(*flags: str) -> dict[str, list[str]]:
        """Each service's KV pool flags, once `pacer up` took the flags."""
        args = build_parser().parse_args(["up", "--model", model, "--dtype", "float32",
                                          "--max-model-len", "512", *flags])
        engine = EngineArgs.from_cli(args)
        _check_memory(engine_layout(engine), instances_of(args, engine))
        return {name: [a for i, a in enumerate(argv) if argv[i - 1] in (
                    "--kv-cache-memory", "--num-kv-blocks")]
                for name, argv in _service_argvs(args, engine).argvs if name != "gateway"}

    pd = ("--prefill-workers", "1", "--decode-workers", "1")
    assert up(*pd, "--num-kv-blocks", "64", "--decode-kv-cache-memory", "8MiB") == {
        "p0 worker rank 0": ["64", "2GiB"], "p0 scheduler": ["64", "2GiB"],   # 64 blocks
        "d0 worker rank 0": ["8MiB"], "d0 scheduler": ["8MiB"]}
    assert up(*pd, "--prefill-kv-cache-memory", "1MiB")["p0 scheduler"] == ["1MiB"]
    for flags, said in [
            (("--decode-kv-cache-memory", "1GiB"), "--decode-kv-cache-memory is for P/D"),
            ((*pd, "--prefill-kv-cache-memory", "lots"),
             "--prefill-kv-cache-memory: cannot read memory size 'lots'"),
            ((*pd, "--decode-kv-cache-memory", "0"), "--decode-kv-cache-memory must be more"),
            (("--kv-cache-memory", "-1GiB"), "--kv-cache-memory: cannot read memory size "
                                              "'-1GiB'"),
            ((*pd, "--decode-kv-cache-memory", "-1GiB"),
             "--decode-kv-cache-memory: cannot read memory size '-1GiB'"),
            (("--block-size", "100000000000000000000"),
             "--block-size must be from 1 to 65,536 tokens, got a 21-digit number"),
            ((*pd, "--decode-kv-cache-memory", "64KiB"),     # 4 blocks of 16 tokens
             "the decode instances (--decode-kv-cache-memory 64KiB): the KV pool holds 64 "
             "tokens"),
            ((*pd, "--decode-kv-cache-memory", "64TiB"),
             "--decode-kv-cache-memory 64TiB, --kv-cache-memory 2GiB for 2 worker rank(s)")]:
        with pytest.raises(PacerError) as e:
            up(*flags)
        assert said in str(e.value), (flags, str(e.value))


def test_pacer_up_marks_only_the_decode_pools_of_a_redis_still_empty(redis_server):
    """In the Redis it has just started, `pacer up` marks each decode instance's pool as told
    to no prefill worker (its first scheduler takes the mark and starts without waiting for
    late K/V writes); a Redis that holds anything (a dump file loaded) gets no mark, and its
    decode schedulers wait as after a restart."""
    import redis

    from services.up import Instance, _mark_pools_untold
    from shared.keys import Keys
    keys = Keys("test-up:")
    instances = [Instance("p0", "prefill", 1), Instance("d0", "decode", 1),
                 Instance("d1", "decode", 1)]
    r = redis.Redis.from_url(redis_server)
    try:
        _mark_pools_untold(redis_server, keys, instances)
        assert sorted(k.decode() for k in r.keys("test-up:*")) == [
            "test-up:inst:d0:pool_untold", "test-up:inst:d1:pool_untold"]
        r.delete(keys.for_instance("d0").pool_untold)
        _mark_pools_untold(redis_server, keys, instances)      # not empty: d1's mark is there
        assert r.exists(keys.for_instance("d0").pool_untold) == 0
    finally:
        r.close()
