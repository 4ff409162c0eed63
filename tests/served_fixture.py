"""The whole served system for tests: `pacer up` as a real process (its own redis-server,
scheduler, worker and gateway processes) on free ports, with the default model.

    from tests.served_fixture import served      # module-scoped fixture -> Served
    served.base_url, served.redis_url, served.metrics(), served.stop()
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.redis_fixture import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_KEY = "served-test-key"
STARTUP_TIMEOUT_S = 240.0
# small enough to allocate fast on a shared machine, large enough for 16 streams at once
KV_CACHE_MEMORY = "128MiB"
MAX_MODEL_LEN = 2048


@dataclass
class Served:
    base_url: str
    redis_url: str
    proc: subprocess.Popen
    log_path: str

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"{self.base_url}{path}", timeout=5.0) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def metrics(self) -> dict[str, float]:
        """The unlabelled samples of /metrics, by name."""
        status, body = self.get("/metrics")
        assert status == 200, body
        samples = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples

    def log_tail(self, chars: int = 4000) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()[-chars:]

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM `pacer up` (as Ctrl-C would) and return its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def process_state(pid: int) -> str:
    """A process's state letter in /proc: "R", "S", "T" (stopped), "Z" (ended, not reaped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def wait_for(predicate, timeout_s: float, what: str):
    """Poll until `predicate()` is truthy (a safety net, not a timing assertion)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout_s} s")


def completion(base_url: str, model: str, prompt: list[int], max_tokens: int,
               timeout_s: float = 60.0, **fields) -> dict:
    """The choice of one greedy, not streamed completion of token ids, with its logprobs
    (and any other `fields` of the request)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, **fields}
    req = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())["choices"][0]


def start_served(log_path: str, *extra_args: str) -> Served:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    port, redis_port = free_port(), free_port()
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    log = open(log_path, "wb")
    # the default model's context (8192) is more than KV_CACHE_MEMORY holds, which pacer up
    # refuses; these tests' prompts are far shorter
    context = [] if {"--model", "--max-model-len"} & set(extra_args) else \
        ["--max-model-len", str(MAX_MODEL_LEN)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--port", str(port),
         "--redis-url", redis_url, "--api-key", API_KEY, "--kv-cache-memory", KV_CACHE_MEMORY,
         *context, *extra_args],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    served = Served(f"http://127.0.0.1:{port}", redis_url, proc, log_path)
    try:
        wait_healthy(served)
    except BaseException:
        served.stop()
        raise
    return served


def wait_healthy(served: Served, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Until /health is 200; fails at once if `pacer up` exited."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if served.proc.poll() is not None:
            raise RuntimeError(f"pacer up exited with {served.proc.returncode}:\n"
                               f"{served.log_tail()}")
        try:
            status, _ = served.get("/health")
        except OSError:
            status = None
        if status == 200:
            return
        time.sleep(0.1)
    raise RuntimeError(f"/health not 200 after {timeout_s} s:\n{served.log_tail()}")


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    log_path = str(tmp_path_factory.mktemp("served") / "pacer-up.log")
    system = start_served(log_path, "--tool-call-parser", "hermes")   # tool_choice auto
    try:
        yield system
    finally:
        system.stop()


def read_json(body: bytes) -> dict:
    return json.loads(body)
