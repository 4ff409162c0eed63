"""The compose cluster end to end: build the image, bring Redis, gateway, scheduler
and worker up as containers on loopback, and stream one completion through them.

Skips only when Docker is unusable and PACER_REQUIRE_DOCKER is unset (CI sets it,
so a broken Docker fails there). `.ci/docker_setup.sh` makes Docker usable.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gpu_worker.kernel_build import supported_levels
from shared.cpu import cpu_flags

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILES = ["docker-compose.yml", "docker-compose.hostnet.yml"]
BUILD_TIMEOUT_S = 1200      # cold: debootstrap + wheel download + docker build on 2 cores
HEALTH_TIMEOUT_S = 600      # containers start, load the model, workers heartbeat
COMPLETION_TIMEOUT_S = 300


def _docker_usable() -> bool:
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def docker_available() -> None:
    if _docker_usable():
        return
    if os.environ.get("PACER_REQUIRE_DOCKER"):
        pytest.fail("`docker info` failed and PACER_REQUIRE_DOCKER is set")
    pytest.skip("`docker info` failed: no usable Docker daemon (run .ci/docker_setup.sh; "
                "set PACER_REQUIRE_DOCKER=1 to turn this skip into a failure)")


class Compose:
    """docker-compose for one throwaway project on free loopback ports."""

    def __init__(self) -> None:
        self.gateway_port = _free_port()
        self.env = dict(os.environ,
                        PACER_IMAGE=os.environ.get("PACER_IMAGE", "pacer:latest"),
                        PACER_GATEWAY_PORT=str(self.gateway_port),
                        PACER_REDIS_PORT=str(_free_port()))
        self.project = f"pacer-test-{os.getpid()}"

    def run(self, *args: str, timeout: float = 300, check: bool = True) -> str:
        cmd = ["docker-compose", "-p", self.project]
        for f in COMPOSE_FILES:
            cmd += ["-f", str(REPO / f)]
        proc = subprocess.run(cmd + list(args), cwd=REPO, env=self.env, capture_output=True,
                              text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd + list(args))} failed:\n{proc.stdout}\n{proc.stderr}")
        return proc.stdout

    def exited_services(self) -> list[str]:
        """Services whose container has stopped: waiting longer will not help."""
        out = self.run("ps", "--services", "--filter", "status=stopped", check=False)
        return [line for line in out.splitlines() if line.strip()]

    def logs(self) -> str:
        return self.run("logs", "--no-color", "--tail", "60", check=False)


@contextmanager
def phase(name: str, capsys: pytest.CaptureFixture[str]) -> Iterator[None]:
    start = time.monotonic()
    try:
        yield
    finally:
        with capsys.disabled():
            print(f"\n[test_docker] {name}: {time.monotonic() - start:.1f} s", flush=True)


def _get(url: str, timeout: float = 10) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _wait_healthy(compose: Compose, base: str) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    last = "no answer yet"
    while time.monotonic() < deadline:
        try:
            status, body = _get(f"{base}/health", timeout=5)
            if status == 200:
                return
            last = f"HTTP {status}: {body[:200]!r}"
        except OSError as e:
            last = repr(e)
        exited = compose.exited_services()
        if exited:
            pytest.fail(f"containers exited before /health was 200: {exited}\n{compose.logs()}")
        time.sleep(2)
    pytest.fail(f"/health not 200 after {HEALTH_TIMEOUT_S} s (last: {last})\n{compose.logs()}")


def _stream_completion(base: str, model: str) -> tuple[list[dict], list[str]]:
    """POST a streaming completion; returns the JSON chunks and every raw data payload."""
    body = json.dumps({"model": model, "prompt": "The capital of France is",
                       "max_tokens": 8, "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    chunks: list[dict] = []
    payloads: list[str] = []
    with urllib.request.urlopen(req, timeout=COMPLETION_TIMEOUT_S) as resp:
        assert resp.status == 200
        assert resp.headers.get("Content-Type", "").startswith("text/event-stream")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[len("data:"):].strip()
            payloads.append(payload)
            if payload == "[DONE]":
                break
            chunks.append(json.loads(payload))
    return chunks, payloads


def test_compose_cluster_streams_a_completion(docker_available: None,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    compose = Compose()
    base = f"http://127.0.0.1:{compose.gateway_port}"
    with phase("build images (docker/build.sh)", capsys):
        proc = subprocess.run([str(REPO / "docker" / "build.sh")], cwd=REPO, env=compose.env,
                              capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        assert proc.returncode == 0, f"docker/build.sh failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    with capsys.disabled():   # build.sh's own step timings, for CI logs
        print("\n" + "\n".join(l for l in proc.stdout.splitlines() if l.startswith("[build.sh]")))
    with phase("the image's CPU kernels", capsys):   # compiled on the host, loaded in the image
        level = subprocess.run(
            ["docker", "run", "--rm", "--network", "none", compose.env["PACER_IMAGE"], "python", "-c",
             "from gpu_worker.cpu_kernels import cpu_kernels; k = cpu_kernels(); "
             "print('LEVEL', k.level if k else None)"],
            capture_output=True, text=True, timeout=300)
        want = supported_levels(cpu_flags())[-1]
        assert f"LEVEL {want}" in level.stdout, level.stdout + level.stderr
    try:
        with phase("docker-compose up", capsys):
            compose.run("up", "-d", timeout=300)
        with phase("wait for gateway /health", capsys):
            _wait_healthy(compose, base)
        with phase("stream one completion", capsys):
            status, body = _get(f"{base}/v1/models")
            assert status == 200, body
            model = json.loads(body)["data"][0]["id"]
            chunks, payloads = _stream_completion(base, model)
        assert payloads and payloads[-1] == "[DONE]", payloads[-3:]
        assert chunks, "no SSE chunk before [DONE]"
        assert all(c["object"] == "text_completion" for c in chunks), chunks[0]
        text = "".join(c["choices"][0].get("text") or "" for c in chunks)
        assert text.strip(), f"streamed no text: {chunks}"
        finish = [c["choices"][0].get("finish_reason") for c in chunks]
        assert finish[-1] in ("length", "stop"), finish
    finally:
        with phase("docker-compose down", capsys):
            compose.run("down", "--volumes", "--remove-orphans", "--timeout", "20",
                        timeout=300, check=False)
