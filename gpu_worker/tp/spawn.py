"""In-process mode: rank 0 is the caller's process (`pacer generate --tp N`, the engine, the
tests) and spawns ranks 1..N-1 itself (`python -m gpu_worker.tp.spawn`), watches them by exit
status and reaps them at shutdown; a spawned follower watches its parent."""
from __future__ import annotations

import argparse
import atexit
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace

import torch

from gpu_worker.model_runner import ModelRunner, RunnerConfig
from gpu_worker.tp.executor import TPExecutor
from gpu_worker.tp.follower import run_follower
from gpu_worker.tp.group import (DEFAULT_TIMEOUT_S, backend_for, destroy, device_for_rank,
                                 find_free_port, init_tp_group, threads_per_rank)
from gpu_worker.tp.liveness import FOLLOWER_GRACE_S, leave_process
from shared.errors import PacerError
from shared.lifecycle import describe_exit
from shared.model_config import ModelConfig, check_tp_fits, load_model_config
from shared.model_source import ModelSource, resolve_model


class Followers:
    """The follower processes rank 0 spawned: liveness by exit status, and clean-up."""

    def __init__(self, procs: dict[int, subprocess.Popen]):
        self.procs = procs

    def check(self) -> str | None:
        for rank, p in self.procs.items():
            code = p.poll()
            if code is not None:
                return f"tp rank {rank} (pid {p.pid}) exited ({describe_exit(code)})"
        return None

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()

    def stop(self, grace_s: float) -> None:
        """Give the survivors a moment to see the death and say so themselves, then kill."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs.values()):
            time.sleep(0.05)
        self.kill_all()

    def reap(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def launch_tp_executor(cfg: ModelConfig, source: ModelSource, rc, tp: int,
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> TPExecutor:
    """Check the cut, spawn ranks 1..tp-1 (`python -m gpu_worker.tp.spawn`), join them as
    rank 0 and load this rank's shard. `rc` is rank 0's RunnerConfig; followers get the same
    one on their own device."""
    check_tp_fits(cfg, tp)
    backend = backend_for(rc.device)
    addr = "127.0.0.1"
    port = find_free_port(addr)
    threads = threads_per_rank(rc.device, tp)
    followers = Followers({r: _spawn_follower(r, tp, addr, port, backend, timeout_s, source,
                                              rc, threads) for r in range(1, tp)})
    group = None
    threads_before = torch.get_num_threads()
    try:
        group = init_tp_group(0, tp, addr, port, backend, timeout_s=timeout_s,
                              extra_check=followers.check,
                              on_dead=lambda why: followers.stop(grace_s=FOLLOWER_GRACE_S),
                              device=device_for_rank(rc.device, 0))
        if threads:
            torch.set_num_threads(threads)
        runner = ModelRunner(cfg, source, replace(rc, device=device_for_rank(rc.device, 0)),
                             tp=group)
        executor = TPExecutor(runner, group, followers)
    except BaseException:
        followers.kill_all()
        followers.reap(5.0)
        if group is not None:
            destroy(group)
        torch.set_num_threads(threads_before)
        raise
    executor.restore_threads = threads_before if threads else None
    atexit.register(executor.shutdown)
    return executor


def _spawn_follower(rank: int, tp: int, addr: str, port: int, backend: str, timeout_s: float,
                    source: ModelSource, rc, threads: int | None) -> subprocess.Popen:
    spec = {"model": source.path, "runner": {**asdict(rc), "progress": False},
            "backend": backend, "timeout_s": timeout_s, "parent_pid": os.getpid()}
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "gpu_worker.tp.spawn", "--rank", str(rank), "--tp", str(tp),
           "--master-addr", addr, "--master-port", str(port), "--spec", json.dumps(spec)]
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)


def _follower_main(argv: list[str]) -> int:
    """A spawned follower: join, load this rank's shard, follow until shut down."""
    p = argparse.ArgumentParser(prog="python -m gpu_worker.tp.spawn")
    for flag in ("--rank", "--tp", "--master-port"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--spec", required=True, help="JSON: model path, RunnerConfig, backend")
    args = p.parse_args(argv)
    spec = json.loads(args.spec)
    parent = spec["parent_pid"]

    def parent_alive() -> str | None:
        # reparented: the engine process (rank 0) is gone
        return None if os.getppid() == parent else f"tp rank 0 (pid {parent}) is gone"

    try:
        source = resolve_model(spec["model"], weights=spec["runner"]["load_format"] != "dummy")
        cfg = load_model_config(source)
        device = device_for_rank(spec["runner"]["device"], args.rank)
        group = init_tp_group(args.rank, args.tp, args.master_addr, args.master_port,
                              spec["backend"], timeout_s=spec["timeout_s"],
                              extra_check=parent_alive, device=device)
        rc = RunnerConfig(**{**spec["runner"], "device": device})
        run_follower(ModelRunner(cfg, source, rc, tp=group), group)
    except PacerError as e:
        print(f"pacer: tp rank {args.rank}: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    leave_process(_follower_main(sys.argv[1:]))     # not through finalization: see there
