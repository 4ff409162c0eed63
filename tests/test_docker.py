"""The compose clusters end to end: build the image, bring Redis, gateway, scheduler
and worker up as containers on loopback and stream completions through them; then the P/D
cluster (docker-compose.pd.yml: a prefill and a decode instance, the K/V moved by the Mooncake
transfer engine) as a project of its own, whose long prompt must be handed over with its K/V
and come out as the colocated cluster's.

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
from scheduler_svc.cli import DISAGG_MIN_PROMPT_TOKENS
from shared.cpu import cpu_flags
from tests.served_fixture import wait_for

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILES = ["docker-compose.yml", "docker-compose.hostnet.yml"]
PD_COMPOSE_FILES = [*COMPOSE_FILES, "docker-compose.pd.yml"]
BUILD_TIMEOUT_S = 1200      # cold: debootstrap + wheel download + docker build on 2 cores
HEALTH_TIMEOUT_S = 600      # containers start, load the model, workers heartbeat
COMPLETION_TIMEOUT_S = 300
# longer than the prefill side's --disagg-min-prompt-tokens (checked below): P/D hands it over
# with its K/V instead of prefilling it on the decode instance
LONG_PROMPT = ("The history of the city of Paris spans more than two thousand years. It began as "
               "a small settlement of a Celtic tribe on an island in the river Seine, and later "
               "grew into the capital of France. Write a short summary of this history:")
LONG_MAX_TOKENS = 16


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

    def __init__(self, files: list[str], name: str) -> None:
        self.files = files
        self.gateway_port = _free_port()
        self.base = f"http://127.0.0.1:{self.gateway_port}"
        self.env = dict(os.environ,
                        PACER_IMAGE=os.environ.get("PACER_IMAGE", "pacer:latest"),
                        PACER_GATEWAY_PORT=str(self.gateway_port),
                        PACER_REDIS_PORT=str(_free_port()))
        self.project = f"pacer-test-{name}-{os.getpid()}"

    def run(self, *args: str, timeout: float = 300, check: bool = True) -> str:
        cmd = ["docker-compose", "-p", self.project]
        for f in self.files:
            cmd += ["-f", str(REPO / f)]
        proc = subprocess.run(cmd + list(args), cwd=REPO, env=self.env, capture_output=True,
                              text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd + list(args))} failed:\n{proc.stdout}\n{proc.stderr}")
        return proc.stdout

    def exited_services(self) -> list[str]:
        """Services whose container has stopped, or exited and waits to be started again
        (restart: unless-stopped): waiting longer will not help."""
        return [line for status in ("stopped", "restarting")
                for line in self.run("ps", "--services", "--filter", f"status={status}",
                                     check=False).splitlines() if line.strip()]

    def logs(self) -> str:
        return self.run("logs", "--no-color", "--tail", "60", check=False)

    @contextmanager
    def cluster(self, config: pytest.Config) -> Iterator[None]:
        """Up until /health is 200; the containers' logs join any failure inside; always down."""
        try:
            with phase(f"{self.project}: docker-compose up", config):
                self.run("up", "-d", timeout=300)
            with phase(f"{self.project}: wait for gateway /health", config):
                _wait_healthy(self)
            try:
                yield
            except Exception:
                say(config, f"\n[test_docker] {self.project} failed; its containers' logs:\n"
                            f"{self.logs()}")
                raise
        finally:
            with phase(f"{self.project}: docker-compose down", config):
                self.run("down", "--volumes", "--remove-orphans", "--timeout", "20",
                         timeout=300, check=False)


def say(config: pytest.Config, text: str) -> None:
    """Print past pytest's capture: phase times belong in CI logs."""
    with config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        print(text, flush=True)


@contextmanager
def phase(name: str, config: pytest.Config) -> Iterator[None]:
    start = time.monotonic()
    try:
        yield
    finally:
        say(config, f"\n[test_docker] {name}: {time.monotonic() - start:.1f} s")


def _get(url: str, timeout: float = 10) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _wait_healthy(compose: Compose) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    last = "no answer yet"
    while time.monotonic() < deadline:
        try:
            status, body = _get(f"{compose.base}/health", timeout=5)
            if status == 200:
                return
            last = f"HTTP {status}: {body[:200]!r}"
        except OSError as e:
            last = repr(e)
        exited = compose.exited_services()
        if exited:
            pytest.fail(f"containers exited before /health was 200: {exited}\n{compose.logs()}")
        time.sleep(0.5)
    pytest.fail(f"/health not 200 after {HEALTH_TIMEOUT_S} s (last: {last})\n{compose.logs()}")


def _stream_completion(base: str, model: str, prompt: str = "The capital of France is",
                       max_tokens: int = 8) -> tuple[list[dict], list[str]]:
    """POST a greedy streaming completion; returns the JSON chunks and every raw data payload."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "stream": True}).encode()
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


def _model(base: str) -> str:
    status, body = _get(f"{base}/v1/models")
    assert status == 200, body
    return json.loads(body)["data"][0]["id"]


def _streamed_text(base: str, model: str, prompt: str, max_tokens: int) -> str:
    """A streamed completion's text, after checking the stream's shape."""
    chunks, payloads = _stream_completion(base, model, prompt, max_tokens)
    assert payloads and payloads[-1] == "[DONE]", payloads[-3:]
    assert chunks, "no SSE chunk before [DONE]"
    assert all(c["object"] == "text_completion" for c in chunks), chunks[0]
    text = "".join(c["choices"][0].get("text") or "" for c in chunks)
    assert text.strip(), f"streamed no text: {chunks}"
    finish = [c["choices"][0].get("finish_reason") for c in chunks]
    assert finish[-1] in ("length", "stop"), finish
    return text


def _metrics(base: str) -> dict[str, float]:
    """Every sample of /metrics, by its name with labels (`name{instance="p0"}`)."""
    status, body = _get(f"{base}/metrics")
    assert status == 200, body
    return {name: float(value) for name, value in
            (line.rsplit(" ", 1) for line in body.decode().splitlines()
             if line and not line.startswith("#"))}


@pytest.fixture(scope="module")
def image(docker_available: None, pytestconfig: pytest.Config) -> str:
    """The image, built once for both clusters, with the host's best CPU kernels in it."""
    name = os.environ.get("PACER_IMAGE", "pacer:latest")
    env = dict(os.environ, PACER_IMAGE=name)
    with phase("build images (docker/build.sh)", pytestconfig):
        proc = subprocess.run([str(REPO / "docker" / "build.sh")], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        assert proc.returncode == 0, f"docker/build.sh failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    # build.sh's own step timings
    say(pytestconfig, "\n" + "\n".join(l for l in proc.stdout.splitlines()
                                        if l.startswith("[build.sh]")))
    with phase("the image's CPU kernels", pytestconfig):   # compiled on the host, loaded in the image
        level = subprocess.run(
            ["docker", "run", "--rm", "--network", "none", name, "python", "-c",
             "from gpu_worker.cpu_kernels import cpu_kernels; k = cpu_kernels(); "
             "print('LEVEL', k.level if k else None)"],
            capture_output=True, text=True, timeout=300)
        want = supported_levels(cpu_flags())[-1]
        assert f"LEVEL {want}" in level.stdout, level.stdout + level.stderr
    return name


@pytest.fixture(scope="module")
def colocated_text() -> dict[str, str]:
    """LONG_PROMPT's greedy text from the colocated cluster, once its test has run."""
    return {}


def test_compose_cluster_streams_a_completion(image: str, colocated_text: dict[str, str],
                                              pytestconfig: pytest.Config) -> None:
    compose = Compose(COMPOSE_FILES, "colocated")
    with compose.cluster(pytestconfig), phase("stream two completions", pytestconfig):
        model = _model(compose.base)
        _streamed_text(compose.base, model, "The capital of France is", 8)
        colocated_text["long"] = _streamed_text(compose.base, model, LONG_PROMPT,
                                                LONG_MAX_TOKENS)


def test_pd_compose_cluster_hands_off_kv(image: str, colocated_text: dict[str, str],
                                         pytestconfig: pytest.Config) -> None:
    """docker-compose.pd.yml: the long prompt is prefilled on p0, handed to d0 with its K/V
    (the Mooncake transfer engine, TCP over loopback) and decoded there."""
    compose = Compose(PD_COMPOSE_FILES, "pd")
    with compose.cluster(pytestconfig), phase("stream the long prompt through P/D", pytestconfig):
        text = _streamed_text(compose.base, _model(compose.base), LONG_PROMPT, LONG_MAX_TOKENS)
        handed = 'pacer:handoffs_with_kv_total{instance="p0"}'
        # the schedulers' stats reach /metrics within their next report
        try:
            metrics = wait_for(lambda: (m := _metrics(compose.base)).get(handed) == 1 and m,
                               30, f"{handed} == 1")
        except AssertionError as e:
            pd = {k: v for k, v in _metrics(compose.base).items() if "instance=" in k}
            raise AssertionError(f"{e}; the instances' metrics: {pd}") from None
        assert metrics["pacer:prompt_tokens_total"] > DISAGG_MIN_PROMPT_TOKENS, metrics
        assert metrics['pacer:kv_transfer_bytes_total{instance="p0"}'] > 0, metrics
        assert metrics['pacer:kv_transfer_failures_total{instance="p0"}'] == 0, metrics
        assert metrics['pacer:handoffs_recomputed_total{instance="d0"}'] == 0, metrics
        # greedy: the same text as the colocated cluster's (when its test ran in this session)
        if "long" in colocated_text:
            assert text == colocated_text["long"], (text, colocated_text["long"])
