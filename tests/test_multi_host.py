"""The services run on separate machines, as the README promises: nothing may depend on their
clocks agreeing or on their starting together."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import redis

from shared.keys import Keys
from tests.helpers_tiny_model import write_tiny_llama
from tests.redis_fixture import free_port, redis_server  # noqa: F401  (a fixture)
from tests.served_fixture import API_KEY, Served, completion, wait_for

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEADLINE_S = 90          # a follower that never joins would wait for ever


# `python -m services.cli ...` in a process that has imported the worker's modules (seconds of
# CPU) and runs it once a line comes on its stdin: a worker started later, less its imports
_IMPORTED_THEN_RUN = ("import runpy, sys, gpu_worker.service, gpu_worker.tp.service; "
                      "sys.stdin.readline(); "
                      "runpy.run_module('services.cli', run_name='__main__', alter_sys=True)")


def _worker(rank: int, model: str, redis_url: str, keys: Keys,
            on_a_line: bool = False) -> subprocess.Popen:
    """`pacer worker --rank ...`; `on_a_line`: it runs once a line is written to its stdin."""
    start = [sys.executable, "-c", _IMPORTED_THEN_RUN] if on_a_line else \
        [sys.executable, "-m", "services.cli"]
    return subprocess.Popen([*start, "worker", "--rank", str(rank),
                             "--tp", "2", "--model", model, "--dtype", "float32",
                             "--max-model-len", "256", "--redis-url", redis_url,
                             "--key-prefix", keys.prefix], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.PIPE if on_a_line else None)


def test_a_tp_follower_started_well_after_rank_0_joins_its_group(redis_server, tmp_path):
    """`pacer worker --rank 1` started on its machine a while after `--rank 0` on another
    (rank 0 waits minutes for its followers) joins the group rank 0 announced: it took a
    rendezvous older than 10 s by its own clock for an earlier group's and waited for ever
    (so did one whose clock ran 10 s ahead of rank 0's)."""
    model = write_tiny_llama(tmp_path / "tiny")
    keys = Keys("tp-late:")
    procs = [_worker(0, model, redis_server, keys), _worker(1, model, redis_server, keys,
                                                         on_a_line=True)]
    client = redis.Redis.from_url(redis_server)
    try:
        for line in procs[0].stdout:
            if "tp group rendezvous published" in line:
                break
        time.sleep(12)                        # rank 1's machine starts it later
        procs[1].stdin.write("run\n")
        procs[1].stdin.flush()
        deadline = time.monotonic() + DEADLINE_S
        while not client.exists(keys.hb_worker(0)):   # rank 0 beats once its group formed
            assert time.monotonic() < deadline, "the follower never joined rank 0's group"
            assert all(p.poll() is None for p in procs)
            time.sleep(0.2)
    finally:
        client.close()
        for p in procs:
            p.send_signal(signal.SIGTERM)
        outs = [p.communicate(timeout=60)[0] for p in procs]
    assert "tp follower ready" in outs[1], outs[1][-2000:]


def test_a_tp_follower_told_to_reach_another_machines_rank_0_at_loopback_says_so(
        redis_server, tmp_path):
    """Rank 0 started on another machine without `--tp-host` announces 127.0.0.1, an address
    a follower on this machine reaches only itself at: the follower ends with an error that
    names the flag, instead of waiting for ever, 'a group that is gone', for a newer one."""
    model = write_tiny_llama(tmp_path / "tiny")
    keys = Keys("tp-loopback:")
    client = redis.Redis.from_url(redis_server)
    client.set(keys.tp_rendezvous, json.dumps({"addr": "127.0.0.1", "port": 1, "pid": 4242,
                                               "time": time.time(), "host": "other-machine"}))
    client.close()
    proc = _worker(1, model, redis_server, keys)
    try:
        out = proc.communicate(timeout=DEADLINE_S)[0]
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 1, out[-2000:]
    last = out.strip().splitlines()[-1]
    assert "other-machine" in last and "--tp-host" in last, out[-2000:]


# the scheduler's machine's clock runs this far ahead of the gateway's; a request's timeout is
# shorter than that, and long enough for a few tokens of the tiny model on a busy machine
CLOCK_AHEAD_S = 60.0
TIMEOUT_S = 40.0
# the gateway's --max-model-len, and the shorter one its scheduler and worker were started with
GATEWAY_LEN, SCHEDULER_LEN = 256, 128
# `python -m services.cli ...` in a process whose time.time() reads CLOCK_AHEAD_S ahead (as
# libfaketime would make it, which this machine lacks): the wall clock every service reads
_SHIFTED = ("import runpy, sys, time; real, ahead = time.time, float(sys.argv.pop(1)); "
            "time.time = lambda: real() + ahead; "
            "runpy.run_module('services.cli', run_name='__main__', alter_sys=True)")


def _healthy(gateway: Served, procs: dict[str, subprocess.Popen]) -> bool:
    for name, p in procs.items():
        if p.poll() is not None:
            raise RuntimeError(f"the {name} exited with {p.returncode}")
    try:
        return gateway.get("/health")[0] == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def by_hand(redis_server, tmp_path_factory):
    """A worker, a scheduler and a gateway started apart, with flags that differ as they may
    on separate machines: the scheduler's clock CLOCK_AHEAD_S ahead of the gateway's, the
    scheduler and worker with a shorter --max-model-len (SCHEDULER_LEN) than the gateway's.
    Yields the gateway and a function giving every log's tail."""
    tmp_path = tmp_path_factory.mktemp("by-hand")
    model = write_tiny_llama(tmp_path / "tiny")
    common = ["--model", model, "--redis-url", redis_server, "--key-prefix", "skew:"]
    flags = [*common, "--max-model-len", str(SCHEDULER_LEN), "--dtype", "float32",
             "--num-kv-blocks", "64"]
    port = free_port()
    logs = {name: open(tmp_path / f"{name}.log", "wb") for name in ("worker", "scheduler",
                                                                     "gateway")}
    procs = {
        "worker": [sys.executable, "-m", "services.cli", "worker", "--rank", "0", *flags],
        "scheduler": [sys.executable, "-c", _SHIFTED, str(CLOCK_AHEAD_S), "scheduler", *flags],
        "gateway": [sys.executable, "-m", "services.cli", "gateway", *common, "--port", str(port),
                    "--max-model-len", str(GATEWAY_LEN), "--served-model-name", "tiny",
                    "--api-key", API_KEY]}
    procs = {name: subprocess.Popen(argv, cwd=REPO, stdout=logs[name], stderr=subprocess.STDOUT)
             for name, argv in procs.items()}
    for log in logs.values():
        log.close()

    def tails() -> str:
        return "\n".join(f"--- {name} ---\n{(tmp_path / f'{name}.log').read_text()[-3000:]}"
                         for name in procs)
    gateway = Served(f"http://127.0.0.1:{port}", redis_server, procs["gateway"],
                     str(tmp_path / "gateway.log"))
    try:
        try:
            wait_for(lambda: _healthy(gateway, procs), 180.0, "/health 200")
        except (RuntimeError, AssertionError) as e:
            raise AssertionError(f"{e}\n{tails()}")
        yield gateway, tails
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_a_request_timeout_holds_with_the_schedulers_clock_ahead_of_the_gateways(by_hand):
    """The gateway stamped a request's deadline with its machine's clock and the scheduler
    compared it with its own: with the scheduler's CLOCK_AHEAD_S ahead, a request whose
    `timeout` is shorter ended at once, "the request reached its deadline (20.0 s ago)" (a
    408). Both read Redis's clock now, and the request completes."""
    gateway, tails = by_hand
    try:
        choice = completion(gateway.base_url, "tiny", [5, 6, 7, 8], 4, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as e:
        raise AssertionError(f"{e}: {e.read()!r}\n{tails()}")
    assert choice["finish_reason"] == "length", choice


def _post(gateway: Served, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"{gateway.base_url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {API_KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _served_length(gateway: Served) -> int:
    """The context /v1/models states a request can have."""
    listing = urllib.request.Request(f"{gateway.base_url}/v1/models",
                                     headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(listing, timeout=30) as r:
        return json.loads(r.read())["data"][0]["max_model_len"]


def test_a_request_longer_than_the_schedulers_context_is_refused_not_cut_short(by_hand):
    """A scheduler started with a shorter --max-model-len than the gateway's cut a request
    the gateway accepted (prompt + max_tokens within the gateway's length) short with
    "length", without a word. The gateway reads the schedulers' lengths from their
    heartbeats and refuses it with a 400 naming both lengths; a chat without max_tokens
    takes the rest of the scheduler's context, as it took the rest of the gateway's."""
    gateway, tails = by_hand
    prompt = list(range(20, 20 + SCHEDULER_LEN - 8))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "ignore_eos": True}
    # the gateway reads the scheduler heartbeats once a second, from its start
    status, answer = wait_for(lambda: (r := _post(gateway, "/v1/completions", body))[0] != 200
                              and r, 30.0, "a refusal")
    assert status == 400, f"{answer}\n{tails()}"
    message = answer["error"]["message"]
    assert f"{SCHEDULER_LEN} tokens" in message and f"gateway's {GATEWAY_LEN}" in message \
        and "--max-model-len" in message and "\n" not in message, message
    body["max_tokens"] = 8                 # fits: served to its end
    status, answer = _post(gateway, "/v1/completions", body)
    assert status == 200 and answer["usage"]["completion_tokens"] == 8, answer
    # /v1/models states the context a request can have: the schedulers' (clients size
    # their requests by it)
    assert _served_length(gateway) == SCHEDULER_LEN
    # ...and so does the API's schema (a generated client's bounds)
    spec = urllib.request.Request(f"{gateway.base_url}/openapi.json",
                                  headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(spec, timeout=30) as r:
        schemas = json.loads(r.read())["components"]["schemas"]
    assert schemas["CompletionRequest"]["properties"]["max_tokens"]["maximum"] \
        == SCHEDULER_LEN - 1, schemas["CompletionRequest"]["properties"]["max_tokens"]
    status, answer = _post(gateway, "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "hello"}],
        "ignore_eos": True})
    assert status == 200, f"{answer}\n{tails()}"
    assert answer["usage"]["total_tokens"] == SCHEDULER_LEN, answer


def test_a_request_the_gateway_accepted_before_it_read_a_shorter_schedulers_length_is_refused(
        by_hand):
    """Until the gateway reads a scheduler's heartbeat (it just started, or the scheduler
    restarted with a shorter --max-model-len, or Redis did) it checks a request against its
    own --max-model-len, and the scheduler cut one longer than its own context short with
    "length" without a word. The scheduler refuses it with an error naming its length (the
    gateway's 400); a chat's default max_tokens (the rest of the gateway's context) answers
    in the rest of the scheduler's."""
    from shared.protocol import FinishEvent, RequestMsg, decode, to_fields
    from shared.sampling import SamplingParams

    gateway, tails = by_hand
    keys, channel = Keys("skew:"), "skew:tokens:by-hand"
    prompt = list(range(20, 20 + SCHEDULER_LEN - 8))
    sent = {"asked": SamplingParams(max_tokens=40, ignore_eos=True),
            "default": SamplingParams(max_tokens=GATEWAY_LEN - len(prompt), ignore_eos=True,
                                      max_tokens_default=True)}
    client = redis.Redis.from_url(gateway.redis_url)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(channel)
    finished: dict[str, FinishEvent] = {}
    try:
        for rid, sampling in sent.items():       # as the gateway writes them
            client.xadd(keys.requests, to_fields(RequestMsg(rid, prompt, sampling, channel,
                                                            "by-hand", time.time())))
        deadline = time.monotonic() + 60
        while len(finished) < len(sent):
            assert time.monotonic() < deadline, f"{finished}\n{tails()}"
            message = pubsub.get_message(timeout=1.0)
            if message is not None and isinstance(msg := decode(message["data"]), FinishEvent):
                finished[msg.request_id] = msg
    finally:
        pubsub.close()
        client.close()
    asked, default = finished["asked"], finished["default"]
    assert (asked.finish_reason, asked.error_type) == ("error", "invalid_request_error"), asked
    assert f"--max-model-len {SCHEDULER_LEN}" in asked.error and "160 tokens" in asked.error \
        and "\n" not in asked.error, asked.error
    assert (default.finish_reason, default.num_output_tokens) == ("length", 8), default


def test_truncate_prompt_tokens_minus_one_fits_the_schedulers_shorter_context(by_hand):
    """`truncate_prompt_tokens: -1` (the Responses API's `truncation: "auto"`) kept as much of
    the prompt as the gateway's --max-model-len holds beside the answer, and the request was
    then refused as longer than the schedulers' context: it keeps what theirs holds."""
    gateway, tails = by_hand
    wait_for(lambda: _served_length(gateway) == SCHEDULER_LEN, 30.0, "the schedulers' length")
    body = {"model": "tiny", "prompt": list(range(20, 220)), "max_tokens": 8,
            "truncate_prompt_tokens": -1, "ignore_eos": True}
    status, answer = _post(gateway, "/v1/completions", body)
    assert status == 200, f"{answer}\n{tails()}"
    assert answer["usage"]["prompt_tokens"] == SCHEDULER_LEN - 8, answer
    assert answer["choices"][0]["finish_reason"] == "length", answer
