"""A lost gateway, a graceful drain, and a Redis with a password, against a real `pacer up`
whose Redis was started by the test with `--requirepass` (so `pacer up` uses it, not its own).

Tests run in file order; the last one stops `pacer up` with SIGTERM.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import aiohttp
import pytest
import redis

from tests.redis_fixture import free_port
from tests.served_fixture import API_KEY, ROOT, Served, start_served, wait_healthy
from tests.sse_client import StreamResult, post_json, stream_completion
from tests.test_overload import wait_idle

pytestmark = pytest.mark.slow

PASSWORD = "s3cret-pass"
SHUTDOWN_TIMEOUT_S = 6.0
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def password_redis():
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--requirepass", PASSWORD],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready_with_auth(port, proc)
        yield f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()


def _wait_ready_with_auth(port: int, proc: subprocess.Popen, password: str = PASSWORD) -> None:
    end = time.monotonic() + 10
    while time.monotonic() < end:
        try:
            redis.Redis(port=port, password=password).ping()
            return
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("password redis-server did not start")


@pytest.fixture(scope="module")
def served(tmp_path_factory, password_redis):
    system = start_served(str(tmp_path_factory.mktemp("lifecycle") / "pacer-up.log"),
                          "--redis-url", password_redis,
                          "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S))
    system.redis_url = password_redis
    try:
        yield system
    finally:
        system.stop()


def long_body(max_tokens: int = 1500) -> dict:
    return {"model": "smollm2-135m", "prompt": "Write a long poem about the sea.",
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def test_a_redis_with_a_password_serves_requests(served: Served):
    port = int(served.redis_url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port).ping()          # the server really demands the password

    async def go():
        async with aiohttp.ClientSession() as session:
            return await post_json(session, served.base_url, "/v1/completions",
                                   long_body(max_tokens=8))
    status, body, _ = asyncio.run(go())
    assert status == 200 and body["usage"]["completion_tokens"] == 8, body
    # `pacer up` says it uses a Redis it found (a system one would look the same), password masked
    with open(served.log_path) as f:
        log = f.read()
    assert "already listening there, NOT started by pacer up" in log
    assert PASSWORD not in log
    # its services have the password in their environment, not on their command lines
    # (which `ps` shows every user)
    services = [argv for argv in _command_lines() if "services.cli" in argv
                and argv[argv.index("services.cli") + 1] in ("gateway", "scheduler", "worker")]
    assert services and not [argv for argv in services if any(PASSWORD in a for a in argv)]


def test_the_api_key_reaches_the_gateway_off_its_command_line(served: Served):
    """`pacer up --api-key K` hands K to its gateway in the environment: it was on the
    gateway's command line, which `ps` shows every user of the machine. The key is still
    required, and taken."""
    port = served.base_url.rsplit(":", 1)[1]                # this `pacer up`'s gateway
    gateways = [argv for argv in _command_lines() if "services.cli" in argv
                and argv[argv.index("services.cli") + 1] == "gateway"
                and "--port" in argv and argv[argv.index("--port") + 1] == port]
    assert gateways and not [argv for argv in gateways if any(API_KEY in a for a in argv)]

    async def go():
        async with aiohttp.ClientSession() as session:
            async with session.get(served.base_url + "/v1/models") as r:
                keyless = r.status
            return keyless, await post_json(session, served.base_url, "/v1/completions",
                                             long_body(max_tokens=2))
    keyless, (status, body, _) = asyncio.run(go())
    assert keyless == 401 and status == 200, (keyless, status, body)


def test_the_redis_pacer_up_starts_keeps_the_urls_password(tmp_path):
    """With nothing listening at the URL, `pacer up` starts a Redis, and the URL's password
    is that server's (it moves to the services' environment first: read from there)."""
    port = free_port()
    system = start_served(str(tmp_path / "pacer-up.log"),
                          "--redis-url", f"redis://:{PASSWORD}@127.0.0.1:{port}/0")
    try:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        assert redis.Redis(port=port, password=PASSWORD).ping()
    finally:
        system.stop()


def test_the_redis_pacer_up_starts_reads_its_password_off_its_command_line():
    """The password of the redis-server `pacer up` starts is not in its argv (any user of the
    machine reads command lines) but on its stdin, quoted for redis.conf: spaces, quotes,
    backslashes and non-ASCII come through exactly, after a restart too."""
    from services.supervisor import Supervisor
    from services.up import start_redis

    port = free_port()
    password = 'p w"\\x41\'ü#'
    sup = Supervisor()
    try:
        child = start_redis(sup, "127.0.0.1", port, password)
        assert not [a for a in child.argv if password in a or "requirepass" in a]
        assert redis.Redis(port=port, password=password).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, password="p w").ping()
        child.proc.kill()
        child.proc.wait()
        sup.restart(child)
        _wait_ready_with_auth(port, sup.children[0].proc, password)
    finally:
        sup.stop_all()


def _command_lines() -> list[list[str]]:
    lines = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                lines.append(f.read().decode(errors="replace").split("\0"))
    return lines


@contextlib.contextmanager
def second_gateway(served: Served, tmp_path) -> Iterator[Served]:
    """Another gateway on the same Redis, its own process (to kill or stop), healthy."""
    port = free_port()
    log = open(tmp_path / "gateway.log", "wb")
    gateway = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "gateway", "--port", str(port),
         "--redis-url", served.redis_url, "--api-key", API_KEY],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        other = Served(f"http://127.0.0.1:{port}", served.redis_url, gateway,
                       str(tmp_path / "gateway.log"))
        wait_healthy(other, 60.0)
        yield other
    finally:
        if gateway.poll() is None:
            os.kill(gateway.pid, signal.SIGCONT)       # a stopped one must run to die
            gateway.kill()
        gateway.wait()
        log.close()


def test_credentials_the_redis_refuses_stop_every_service_at_once(password_redis: str):
    """A refused password does not pass with time: `pacer up` and each service alone stop
    with one line naming the URL (its password masked), instead of retrying for ever."""
    port = str(free_port())
    wrong = "wrong-pass"
    for password, argv in ((None, ["up", "--port", port]), (wrong, ["up", "--port", port]),
                           (wrong, ["gateway", "--port", port]), (wrong, ["scheduler"]),
                           (wrong, ["worker", "--rank", "0"])):
        url = password_redis.replace(f":{PASSWORD}@", f":{password}@" if password else "")
        proc = subprocess.run([sys.executable, "-m", "services.cli", *argv, "--redis-url", url],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0 and "Redis refused the credentials" in out, (argv, out[-2000:])
        assert "Traceback" not in out and "retrying" not in out, (argv, out[-2000:])
        assert password is None or password not in out, (argv, out[-2000:])


def test_a_database_index_the_redis_lacks_stops_every_service_at_once(password_redis: str):
    """`--redis-url .../99` on a Redis of 16 databases does not pass with time either: each
    service alone stops with one line naming it (they retried forever)."""
    url = password_redis.rsplit("/", 1)[0] + "/99"
    for argv in (["gateway", "--port", str(free_port())], ["scheduler"], ["worker", "--rank", "0"]):
        proc = subprocess.run([sys.executable, "-m", "services.cli", *argv, "--redis-url", url],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0 and "DB index is out of range" in out, (argv, out[-2000:])
        assert "Traceback" not in out and "retrying" not in out, (argv, out[-2000:])


def test_a_key_of_another_type_under_the_prefix_stops_the_scheduler_with_one_line(
        password_redis: str):
    """Another application's string where the scheduler keeps its stats hash (or a stream):
    it failed at start-up with a WRONGTYPE traceback in its log. One line names the key, its
    type and the way out; keys of the right type, or none, pass."""
    admin = redis.Redis.from_url(password_redis)
    admin.set("foreign:stats", "not ours")
    admin.hset("foreign:restarts", "x", 1)              # not the scheduler's: left alone
    try:
        proc = subprocess.run([sys.executable, "-m", "services.cli", "scheduler", "--redis-url",
                               password_redis, "--key-prefix", "foreign:"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    finally:
        admin.delete("foreign:stats", "foreign:restarts")
        admin.close()
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "foreign:stats holds a string, not a hash: another " \
        "application uses the key prefix 'foreign:'" in out, out[-2000:]
    assert "Traceback" not in out and "WRONGTYPE" not in out, out[-2000:]


def test_the_password_may_come_from_the_environment(password_redis: str):
    """$PACER_REDIS_PASSWORD serves a URL without one (kept off the command line, which `ps`
    shows every user): the scheduler connects and waits for its workers."""
    url = password_redis.replace(f":{PASSWORD}@", "")
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "scheduler", "--redis-url",
                             url, "--key-prefix", "env-password:", "--scheduler-id", "env"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PACER_REDIS_PASSWORD": PASSWORD})
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "waiting for workers" in line or "refused" in line:
                break
        proc.send_signal(signal.SIGTERM)
        out = "".join(lines) + proc.communicate(timeout=30)[0]
    finally:
        proc.kill()
    assert "waiting for workers" in out and "refused" not in out, out[-2000:]
    assert PASSWORD not in out, out[-2000:]


@pytest.mark.parametrize("service", [["scheduler"], ["worker", "--rank", "0"]])
def test_sigterm_while_redis_is_away_stops_a_service_cleanly(service: list[str]):
    url = f"redis://127.0.0.1:{free_port()}/0"      # nothing listens there
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", *service, "--redis-url", url],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        lines = []
        for line in proc.stdout:            # wait until it is retrying the connection
            lines.append(line)
            if "redis unavailable; retrying" in line:
                break
        proc.send_signal(signal.SIGTERM)
        out = "".join(lines) + proc.communicate(timeout=30)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0 and "stopped before redis answered" in out, out[-2000:]
    assert "Traceback" not in out, out[-2000:]


@pytest.mark.parametrize("service, names", [
    (["scheduler", "--instance", "d1"], {"instance": "d1"}),
    (["worker", "--tp", "3", "--rank", "2", "--instance", "d1"], {"rank": 2, "instance": "d1"})])
def test_a_service_names_its_instance_and_rank_on_every_log_line(service: list[str],
                                                                   names: dict):
    """With TP, replicas or P/D, `pacer up` runs several schedulers and workers into one log:
    each line says which one wrote it (a rank's error could not be told from another's)."""
    url = f"redis://127.0.0.1:{free_port()}/0"      # nothing listens there: it logs, retrying
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", *service, "--redis-url", url],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        for line in proc.stdout:
            if "redis unavailable; retrying" in line:
                break
        proc.send_signal(signal.SIGTERM)
        lines = [line, *proc.communicate(timeout=30)[0].splitlines()]
    finally:
        proc.kill()
    records = [json.loads(text) for text in lines if text.startswith("{")]
    assert records and all(r.items() >= names.items() for r in records), lines


def test_a_killed_gateway_has_its_requests_aborted_and_blocks_freed(served: Served, tmp_path):
    with second_gateway(served, tmp_path) as other:
        killed_at = asyncio.run(_stream_then_kill(other))
        wait_idle(served, timeout_s=30.0)
        print(f"\ngateway kill -9: its request was aborted and its KV blocks freed "
              f"{time.monotonic() - killed_at:.2f} s later")


def test_a_paused_gateway_tells_its_clients_their_requests_were_dropped(served: Served, tmp_path):
    """A gateway stopped (SIGSTOP) past its heartbeat's life looks dead to the scheduler, which
    drops its requests; once it runs again its client gets an error event saying so, not a
    stream that merely ends."""
    with second_gateway(served, tmp_path) as other:
        result = asyncio.run(_stream_with_a_pause(other, served))
        assert result.error is not None and "no heartbeat" in result.error["message"], result
        assert result.done and result.text           # the tokens before it, then [DONE]
        wait_idle(served, timeout_s=30.0)


async def _stream_with_a_pause(s: Served, scheduler_side: Served) -> StreamResult:
    paused = asyncio.Event()

    def on_chunk(result: StreamResult) -> None:
        if len(result.chunk_times) == 3 and not paused.is_set():
            os.kill(s.proc.pid, signal.SIGSTOP)
            paused.set()

    async def resume_once_dropped() -> None:
        await paused.wait()
        # the scheduler gives up on the gateway once its heartbeat key has expired twice over
        await asyncio.to_thread(wait_idle, scheduler_side, 30.0)
        os.kill(s.proc.pid, signal.SIGCONT)

    async with aiohttp.ClientSession() as session:
        resumer = asyncio.create_task(resume_once_dropped())
        result = await stream_completion(session, s.base_url, long_body(), DEADLINE_S, on_chunk)
        await resumer
    return result


async def _stream_then_kill(s: Served) -> float:
    killed = asyncio.Event()

    def on_chunk(result: StreamResult) -> None:
        if len(result.chunk_times) == 3 and not killed.is_set():
            os.kill(s.proc.pid, signal.SIGKILL)
            killed.set()

    async with aiohttp.ClientSession() as session:
        try:
            await stream_completion(session, s.base_url, long_body(), DEADLINE_S, on_chunk)
        except aiohttp.ClientError:
            pass                           # the server went away mid-stream, as intended
    assert killed.is_set()
    return time.monotonic()


def test_sigterm_drains_running_requests_then_exits_zero(served: Served):
    async def scenario():
        async with aiohttp.ClientSession() as session:
            short = asyncio.create_task(stream_completion(
                session, served.base_url, long_body(max_tokens=8), DEADLINE_S))
            long = asyncio.create_task(stream_completion(
                session, served.base_url, long_body(), DEADLINE_S))
            whole = asyncio.create_task(post_json(session, served.base_url, "/v1/completions",
                                                  long_body()))
            await asyncio.sleep(0.5)       # all three admitted, two streaming
            served.proc.send_signal(signal.SIGTERM)
            status = await _until_draining(session, served.base_url)
            refused = await post_json(session, served.base_url, "/v1/completions",
                                      long_body(max_tokens=4))
            return status, refused, await short, await long, await whole

    started = time.monotonic()
    health, (status, body, headers), short, long, whole = asyncio.run(scenario())
    # an answer not streamed, cut at the shutdown timeout: a 503 to retry, not a 500
    assert whole[0] == 503 and "shut down" in whole[1]["error"]["message"], whole[:2]
    assert whole[2].get("Retry-After") == "1", whole[2]
    assert health == 503
    assert status == 503 and "shutting down" in body["error"]["message"], body
    assert headers.get("Retry-After") == "1", headers     # retried once one is back
    assert short.error is None and short.finish_reason == "length", short
    assert long.error is not None and long.done, long      # cut at the shutdown timeout
    assert long.text
    assert served.proc.wait(60) == 0, served.log_tail()
    print(f"\nSIGTERM: new requests got 503, a short stream finished, a long one ended "
          f"with an error event; pacer up exited 0 after {time.monotonic() - started:.2f} s")


async def _until_draining(session: aiohttp.ClientSession, base_url: str) -> int:
    for _ in range(200):
        async with session.get(f"{base_url}/health") as r:
            if r.status == 503 and (await r.json()).get("status") == "draining":
                return r.status
        await asyncio.sleep(0.02)
    raise AssertionError("/health never said draining")


def _running(pid: int) -> bool:
    """A process that has not ended (a zombie, ended but not yet reaped, has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_when_no_one_reads_pacer_ups_output_it_still_leaves_nothing_running(tmp_path, how):
    """`pacer up 2>&1 | tee up.log`, then the tee (or the ssh session it ran in) ends, then
    `pacer up` is stopped or killed: no service is left running. A write to the gone reader
    raised: in pacer up's stop (which then stopped no child), and in each service's signal
    handler (which then never drained: the gateway kept its port for good)."""
    from tests.helpers_tiny_model import write_tiny_llama
    read, write = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--port", str(free_port()),
         "--redis-url", f"redis://127.0.0.1:{free_port()}/0", "--model",
         write_tiny_llama(tmp_path / "tiny"), "--dtype", "float32", "--kv-cache-memory", "64MiB"],
        cwd=ROOT, stdout=write, stderr=write)
    os.close(write)
    pids, said = [], []
    try:
        with os.fdopen(read, "rb") as out:          # closed (the reader gone) once serving
            for line in out:
                said.append(line)
                if line.startswith(b"{") and json.loads(line).get("event") == "started":
                    pids.append(json.loads(line)["pid"])
                if line.startswith(b"pacer up: serving"):
                    break
        assert proc.poll() is None and pids, b"".join(said[-20:]).decode(errors="replace")
        proc.send_signal(how)
        proc.wait(timeout=DEADLINE_S)
        end = time.monotonic() + DEADLINE_S
        while any(_running(pid) for pid in pids) and time.monotonic() < end:
            time.sleep(0.2)
        assert not [pid for pid in pids if _running(pid)]
    finally:
        proc.kill()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_second_sigterm_ends_the_open_streams_with_their_error_event_at_once(tmp_path):
    """Ctrl-C twice: the operator will not wait out --shutdown-timeout. `pacer up` passed
    the second signal on to nobody (the services run in sessions of their own), so the
    streams ran to their end; and a gateway signalled twice cut its streams off mid-chunk,
    without an error event or [DONE], after waiting for them for 10 s more."""
    system = start_served(str(tmp_path / "pacer-up.log"), "--shutdown-timeout", "3600")

    async def scenario() -> StreamResult:
        async with aiohttp.ClientSession() as session:
            streaming = asyncio.Event()
            # the context's worth of tokens: without the second signal passed on, the stream
            # ran to them (finish_reason "length"), whatever the machine's pace
            stream = asyncio.create_task(stream_completion(
                session, system.base_url, long_body(max_tokens=2000), DEADLINE_S,
                lambda r: len(r.chunk_times) >= 2 and streaming.set()))
            await asyncio.wait_for(streaming.wait(), DEADLINE_S)
            system.proc.send_signal(signal.SIGTERM)
            await _until_draining(session, system.base_url)
            system.proc.send_signal(signal.SIGTERM)
            return await stream

    try:
        result = asyncio.run(scenario())
        assert result.error is not None and "shut down" in result.error["message"], result
        assert result.done and result.text and result.finish_reason is None, result
        assert system.proc.wait(DEADLINE_S) == 0, system.log_tail()
    finally:
        system.stop()


# a chat template that takes ~2 s to render (on the gateway's thread, the event loop free):
# a request is admitted, its prompt not yet made, while the signal comes
SLOW_CHAT_TEMPLATE = ("{% set ns = namespace(x=0) %}{% for i in range(500) %}"
                      "{% for j in range(1000) %}{% set ns.x = ns.x + j %}{% endfor %}{% endfor %}")


def test_a_request_admitted_just_before_sigterm_is_drained_not_cut_off(tmp_path):
    """The drain waited only for requests whose stream was open: one admitted just before the
    signal, its prompt still being made, was not waited for; the gateway stopped at once and
    cut it off mid-stream, with neither an error event nor [DONE] (the scheduler served it to
    its end, for no one). Now it is waited for like the others: answered, ended with its
    error event at the shutdown timeout, or (not started by then) refused with a 503."""
    from tests.helpers_tiny_model import CHAT_TEMPLATE, write_tiny_llama
    model = write_tiny_llama(tmp_path / "tiny", max_position_embeddings=8192)
    config_path = os.path.join(model, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump({**config, "chat_template": SLOW_CHAT_TEMPLATE + CHAT_TEMPLATE}, f)
    system = start_served(str(tmp_path / "pacer-up.log"), "--model", model, "--dtype",
                          "float32", "--kv-cache-memory", "64MiB", "--shutdown-timeout", "2")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6000, "ignore_eos": True}

    async def refused_while_draining(session: aiohttp.ClientSession):
        await _until_draining(session, system.base_url)
        return await post_json(session, system.base_url, "/v1/completions",
                               {"model": "tiny", "prompt": "x", "max_tokens": 1})

    async def scenario():
        async with aiohttp.ClientSession() as session:
            admitted = asyncio.create_task(stream_completion(
                session, system.base_url, body, DEADLINE_S, path="/v1/chat/completions"))
            await asyncio.sleep(0.5)            # read and admitted; its template renders
            system.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(admitted, refused_while_draining(session),
                                        return_exceptions=True)

    try:
        result, refused = asyncio.run(scenario())
        assert isinstance(result, StreamResult), f"the admitted request was cut off: {result!r}"
        if result.status == 503:                # still being made at the shutdown timeout
            assert result.headers.get("Retry-After") == "1", result
            assert "shutting down" in result.body["error"]["message"], result
        else:
            assert result.status == 200 and result.done, result
            assert result.finish_reason == "length" or "shut down" in result.error["message"], \
                result
        assert not isinstance(refused, BaseException), f"no 503 while draining: {refused!r}"
        status, refusal, headers = refused
        assert status == 503 and headers.get("Retry-After") == "1", (status, headers, refusal)
        assert system.proc.wait(DEADLINE_S) == 0, system.log_tail()
    finally:
        system.stop()
