"""The compose files without Docker: each documented stack of them is merged and interpolated
as docker-compose does, and every service's command is run by a real `sh` with the service's
environment, a stand-in `pacer` on PATH printing the argv it gets; that argv is then read by
pacer's own parser. What each service receives is checked against what `pacer up` hands its
own services (tests/test_docker.py runs the containers themselves)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gateway.cli import config_from_args
from services.cli import build_parser
from services.up import _service_argvs
from shared.engine_args import EngineArgs

REPO = Path(__file__).resolve().parents[1]
BASE = "docker-compose.yml"
# every stack the docs name (the base file first, as compose reads them)
STACKS = {
    "plain": [BASE, "docker-compose.override.yml"],
    "hostnet": [BASE, "docker-compose.hostnet.yml"],
    "tp2": [BASE, "docker-compose.tp2.yml", "docker-compose.hostnet.yml"],
    "pd": [BASE, "docker-compose.hostnet.yml", "docker-compose.pd.yml"],
}
_VAR = re.compile(r"\$(?:\$|\{(\w+)(?:(:?[-?])([^}]*))?\}|(\w+))")


def _interpolate(value, env: dict[str, str]):
    """docker-compose's variable substitution in the files: ${X}, ${X:-d}, ${X-d}, ${X:?e},
    $X; $$ is a literal $ (the command's own variables, expanded by its shell)."""
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg, got = m.group(2), m.group(3), env.get(m.group(1) or m.group(4))
        unset = got is None or (op is not None and op.startswith(":") and got == "")
        if op and op.endswith("?") and unset:
            raise AssertionError(f"compose refuses to start: {name}: {arg}")
        if op and op.endswith("-") and unset:
            return arg
        return got or ""
    return _VAR.sub(one, value)


def _merge(base: dict, over: dict) -> dict:
    """An override file over the files before it: mappings merge, anything else is replaced."""
    out = dict(base)
    for key, value in over.items():
        out[key] = (_merge(out[key], value) if isinstance(value, dict)
                    and isinstance(out.get(key), dict) else value)
    return out


def _stack(files: list[str], env: dict[str, str]) -> dict[str, dict]:
    services: dict[str, dict] = {}
    for name in files:
        with open(REPO / name) as f:
            doc = _interpolate(yaml.safe_load(f), env)
        services = _merge(services, doc["services"])
    return services


def _argvs(files: list[str], env: dict[str, str], tmp_path: Path) -> dict[str, list[str]]:
    """Every pacer service's argv, as its container's shell hands it to `pacer`."""
    stub = tmp_path / "bin" / "pacer"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text(f"#!/bin/sh\nexec {sys.executable} -c "
                    "'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\"\n")
    stub.chmod(0o755)
    argvs = {}
    for name, service in _stack(files, env).items():
        command = service.get("command", [])
        if "pacer " not in " ".join(command):
            continue                                    # redis
        environment = {k: "" if v is None else str(v)
                       for k, v in service.get("environment", {}).items()}
        proc = subprocess.run(command, env={"PATH": f"{stub.parent}:/usr/bin:/bin", **environment},
                              capture_output=True, text=True, timeout=30, check=True)
        argvs[name] = json.loads(proc.stdout)
    return argvs


def _gateway_of_up(*flags: str):
    """The gateway config `pacer up` gives its own gateway for these flags."""
    args = build_parser().parse_args(["up", *flags])
    argv = dict(_service_argvs(args, EngineArgs.from_cli(args)).argvs)["gateway"]
    return config_from_args(build_parser().parse_args(argv[argv.index("services.cli") + 1:]))


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_engine_args_reach_every_service(stack: str, tmp_path: Path) -> None:
    """PACER_ENGINE_ARGS's --max-model-len reaches the gateway as well as the scheduler and
    workers: a prompt too long for it is the gateway's 400, as under `pacer up`, not a
    failure the scheduler reports once the request is queued (and /v1/models says so)."""
    engine_args = "--max-model-len 64 --kv-cache-memory 256MiB --no-prefix-caching"
    env = {"PACER_ENGINE_ARGS": engine_args, "PACER_MODEL": "/models/m.gguf"}
    argvs = _argvs(STACKS[stack], env, tmp_path)
    assert {"gateway", "scheduler", "worker"} <= set(argvs), argvs
    up = _gateway_of_up("--model", "/models/m.gguf", *engine_args.split())
    for name, argv in argvs.items():
        args = build_parser().parse_args(argv)
        assert args.command == name.split("-")[-1].rstrip("1"), argv
        if args.command == "gateway":
            config = config_from_args(args)
            assert (config.model, config.max_model_len) == (up.model, up.max_model_len) \
                == ("/models/m.gguf", 64), argv
        else:
            assert (args.model, args.max_model_len, args.kv_cache_memory,
                    args.enable_prefix_caching) == ("/models/m.gguf", 64, "256MiB", False), argv


def test_gateway_refuses_what_the_engine_would(tmp_path: Path) -> None:
    """A PACER_ENGINE_ARGS the scheduler and workers refuse, the gateway refuses too, naming
    it, rather than serving with limits nobody applies; none at all is no flag."""
    argv = _argvs(STACKS["hostnet"], {"PACER_ENGINE_ARGS": "--max-model-len x"}, tmp_path)["gateway"]
    proc = subprocess.run([sys.executable, "-m", "services.cli", *argv], capture_output=True,
                          text=True, timeout=30, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == ("pacer gateway: error: argument --engine-args: "
                                            "argument --max-model-len: invalid int value: 'x'")
    for engine_args in ("", "--no-prefix-caching"):
        argv = _argvs(STACKS["plain"], {"PACER_ENGINE_ARGS": engine_args}, tmp_path)["gateway"]
        config = config_from_args(build_parser().parse_args(argv))
        assert (config.model, config.max_model_len) == (None, None), argv


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_a_service_that_dies_is_started_again(stack: str) -> None:
    """As `pacer up` restarts a child that died (docs/failure-modes.md), compose restarts
    a container whose process ended by itself (a crash, exit 70 of an essential task, the
    kernel's OOM killer); one stopped by `docker-compose stop` or `down` stays stopped."""
    env = {"PACER_MODEL": "/models/m.gguf"}
    for name, service in _stack(STACKS[stack], env).items():
        assert service.get("restart") == "unless-stopped", (stack, name, service.get("restart"))


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_a_model_file_reaches_every_service(stack: str, tmp_path: Path) -> None:
    """PACER_MODEL may name a .gguf file or an HF directory (docker-compose.yml's header):
    every service that loads the model, at any TP degree, sees PACER_MODEL_DIR at /models."""
    env = {"PACER_MODEL": "/models/m.gguf", "PACER_MODEL_DIR": str(tmp_path)}
    for name, service in _stack(STACKS[stack], env).items():
        if name != "redis":
            assert f"{tmp_path}:/models:ro" in service.get("volumes", []), (stack, name)


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_the_api_key_reaches_the_gateway_off_its_command_line(stack: str, tmp_path: Path,
                                                              monkeypatch) -> None:
    """PACER_API_KEY reaches the gateway's environment, where `pacer gateway` reads it as
    --api-key's default (never on its command line, which `ps` shows every user); unset, the
    gateway serves without a key."""
    for key in ("k3y", None):
        env = {"PACER_MODEL": "/models/m.gguf", **({"PACER_API_KEY": key} if key else {})}
        gateway = _stack(STACKS[stack], env)["gateway"]
        given = str(gateway.get("environment", {}).get("PACER_API_KEY") or "")
        assert given == (key or "")
        argv = _argvs(STACKS[stack], env, tmp_path)["gateway"]
        assert not [a for a in argv if key and key in a]
        monkeypatch.setenv("PACER_API_KEY", given)      # the container's environment
        assert config_from_args(build_parser().parse_args(argv)).api_key == key


def _seconds(text: str) -> float:
    return float(re.fullmatch(r"(\d+(?:\.\d+)?)s", text).group(1))


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_the_stack_stops_in_pacer_ups_order_each_after_its_drain(stack: str) -> None:
    """`docker-compose stop` stops a service only after the services that depend on it: so the
    gateways stop before the schedulers and the schedulers before the workers, as `pacer up`
    stops its children (workers that left first cut the running requests off while the
    gateway and scheduler still drained). Each gets longer than its own drain before Docker
    kills it (its default grace is 10 s, no longer than the gateway's --shutdown-timeout)."""
    from gateway.config import DEFAULT_SHUTDOWN_TIMEOUT_S

    services = _stack(STACKS[stack], {"PACER_MODEL": "/models/m.gguf"})

    def kind(name: str) -> str:
        return next(k for k in ("gateway", "scheduler", "worker", "redis") if k in name)

    def after(name: str) -> set[str]:
        """What `name` stops before: everything it depends on, transitively."""
        out, todo = set(), list(services[name].get("depends_on", {}))
        if (mode := services[name].get("network_mode", "")).startswith("service:"):
            todo.append(mode.split(":", 1)[1])
        while todo:
            dep = todo.pop()
            if dep not in out:
                out.add(dep)
                todo.extend(services[dep].get("depends_on", {}))
        return out

    for name in services:
        if kind(name) == "gateway":
            assert {s for s in services if kind(s) == "scheduler"} <= after(name), name
        if kind(name) == "scheduler":
            assert any(kind(s) == "worker" for s in after(name)), name
    scheduler_drain = build_parser().parse_args(["scheduler"]).drain_timeout
    for name, service in services.items():
        grace = _seconds(service.get("stop_grace_period", "10s"))
        if kind(name) == "gateway":
            assert grace > DEFAULT_SHUTDOWN_TIMEOUT_S, name
        if kind(name) == "scheduler":
            assert grace > scheduler_drain, name
