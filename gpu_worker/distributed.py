"""Tensor parallelism across processes: one process per rank, rank 0 drives
(docs/design.md#tensor-parallelism).

In-process mode (`pacer generate --tp N`, the engine, the tests): rank 0 is the caller's
process and spawns ranks 1..N-1 itself.

    executor = launch_tp_executor(model_config, source, runner_config, tp=3)
    result = executor.execute(plan)        # the same plan runs on every rank
    executor.shutdown()

Served mode: every rank is its own `pacer worker --rank R --tp N` process; rank 0 publishes
the rendezvous address (Redis) and the others meet it there.

    group = init_tp_group(rank, size, master_addr, master_port, backend_for(device))
    runner = ModelRunner(cfg, source, rc, tp=group)
    rank 0:   executor = TPExecutor(runner, group)      # then execute(plan) per plan
    rank > 0: run_follower(runner, group)               # returns at rank 0's shutdown()

Plans travel from rank 0 as msgpack bytes (shared/protocol.py's PlanMsg, never pickle) in
two broadcasts on a gloo "control" group: the length, then a uint8 tensor; length 0 means
shut down. Forward collectives use the default group (gloo on CPU, NCCL on CUDA): per
forward 2 all-reduces per layer (o_proj, down_proj), 1 all-reduce (vocab-parallel
embedding) and 1 all-gather (LM head). After each iteration the ranks all-gather an 8-byte
digest of the tokens they sampled, so a divergence stops the group instead of corrupting
output silently.

Failure: the default group has a short collective timeout; a watchdog thread per rank
heartbeats through the rendezvous store and watches the others (rank 0 also polls the
processes it spawned; spawned followers also watch their parent). A rank that dies ends the
group within seconds: rank 0 raises PacerError naming the dead rank, followers exit with a
message naming it.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from gpu_worker.parallel import TPGroup
from shared.errors import PacerError
from shared.model_config import ModelConfig, check_tp_fits
from shared.model_source import ModelSource
from shared.plan import IterationPlan, StepResult
from shared.protocol import PlanMsg, decode, encode

DEFAULT_TIMEOUT_S = 30.0       # one forward collective; a live rank never waits this long
JOIN_TIMEOUT_S = 300.0         # served ranks may start minutes apart
IDLE_TIMEOUT = timedelta(days=3650)   # followers wait for the next plan as long as rank 0 idles
HEARTBEAT_S = 0.5
# a rank whose heartbeat stalls this long is dead; generous, because a false alarm takes the
# group down and the quick signals (process exit, closed sockets, a closed store) come first
DEAD_AFTER_S = 10.0

_JOINED, _READY, _DONE, _SEED, _SHUTDOWN, _DOWN = (
    f"pacer/{k}" for k in ("joined", "ready", "done", "seed", "shutdown", "down"))


def _hb_key(rank: int) -> str:
    return f"pacer/hb/{rank}"


# ---- start-up checks and addresses -------------------------------------------------------

def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def device_for_rank(device: str, rank: int) -> str:
    """One accelerator per rank: "cuda" or "cuda:k" -> cuda:(k + rank); CPU stays CPU."""
    if not device.startswith("cuda"):
        return device
    base = int(device.split(":")[1]) if ":" in device else 0
    return f"cuda:{base + rank}"


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free now (bind to port 0), never a hard-coded one."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ---- the group ---------------------------------------------------------------------------

@dataclass
class ProcessTPGroup(TPGroup):
    """A TPGroup whose collectives are real (torch.distributed), plus what rank 0 and the
    followers need around them: the control group for plans, the store, the watchdog."""
    control: object = None
    store: object = None
    liveness: "Liveness | None" = None

    @property
    def down(self) -> str | None:
        """Why the group is dead (a rank died), or None."""
        return self.liveness.dead if self.liveness else None


def init_tp_group(rank: int, size: int, master_addr: str, master_port: int, backend: str,
                  *, timeout_s: float = DEFAULT_TIMEOUT_S, join_timeout_s: float = JOIN_TIMEOUT_S,
                  extra_check: Callable[[], str | None] | None = None,
                  on_dead: Callable[[str], None] | None = None,
                  device: str | None = None) -> ProcessTPGroup:
    """Join (rank 0: host) the group at master_addr:master_port and start the watchdog.

    `extra_check` returns why a peer is dead (rank 0: its spawned processes; a spawned
    follower: its parent), checked while joining and then by the watchdog. `on_dead` runs on
    the watchdog thread when a peer dies; by default rank 0 records it (the next execute
    raises) and a follower prints it and exits the process, since its main thread may sit
    in a collective that only the dead rank could finish. `device` (NCCL only): this rank's
    GPU, default cuda:rank."""
    if dist.is_initialized():
        raise PacerError("this process already belongs to a torch.distributed group "
                         "(one tensor-parallel group per process)")
    if backend == "nccl":
        torch.cuda.set_device(device or device_for_rank("cuda", rank))
    group = ProcessTPGroup(rank=rank, size=size)
    try:
        group.store = store = dist.TCPStore(
            master_addr, master_port, size, is_master=rank == 0,
            timeout=timedelta(seconds=join_timeout_s), wait_for_workers=False)
        store.add(_JOINED, 1)
        _wait_until(lambda: store.add(_JOINED, 0) >= size, join_timeout_s, extra_check,
                    f"all {size} tensor-parallel ranks to join at {master_addr}:{master_port}")
        dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))
        group.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        group.liveness = Liveness(master_addr, master_port, rank, size, extra_check,
                                  on_dead or (_record_only if rank == 0 else _exit_process(rank)))
        group.liveness.start()
    except BaseException:
        _destroy(group)
        raise
    return group


def _wait_until(done: Callable[[], bool], timeout_s: float,
                extra_check: Callable[[], str | None] | None, what: str,
                down: Callable[[], str | None] = lambda: None) -> None:
    """Poll instead of blocking, so a peer that dies meanwhile is named at once."""
    deadline = time.monotonic() + timeout_s
    while not done():
        why = (extra_check() if extra_check else None) or down()
        if why:
            raise PacerError(f"{why} while waiting for {what}")
        if time.monotonic() > deadline:
            raise PacerError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.05)


def _destroy(group: ProcessTPGroup) -> None:
    if group.liveness:
        group.liveness.stop()
    if dist.is_initialized():
        dist.destroy_process_group()
    group.store = None            # rank 0: closes the rendezvous store's server


# ---- liveness ----------------------------------------------------------------------------

def _record_only(why: str) -> None:
    """Rank 0's default: Liveness.dead holds the reason; the next execute raises it."""


def _exit_process(rank: int) -> Callable[[str], None]:
    def leave(why: str) -> None:
        print(f"pacer: tp rank {rank}: {why}; the tensor-parallel group is down, exiting",
              file=sys.stderr, flush=True)
        os._exit(1)
    return leave


class Liveness:
    """Every rank bumps its heartbeat counter in the rendezvous store; a counter that stops
    moving for DEAD_AFTER_S, or a store that stops answering (it lives in rank 0), means that
    rank is dead. The first rank to see a death writes why to the store, so every other rank
    stops with the same message. Uses its own store connection: the main thread's may be
    busy in a store call."""

    def __init__(self, addr: str, port: int, rank: int, size: int,
                 extra_check: Callable[[], str | None] | None, on_dead: Callable[[str], None]):
        self._store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=2),
                                    wait_for_workers=False)
        self.rank, self.size = rank, size
        self._extra_check, self._on_dead = extra_check, on_dead
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tp-watchdog-{rank}",
                                        daemon=True)
        self.dead: str | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * HEARTBEAT_S + 2)

    def wait_for_death(self, timeout_s: float) -> str | None:
        """After a collective failed: give the watchdog time to name who died."""
        deadline = time.monotonic() + timeout_s
        while self.dead is None and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)
        return self.dead

    def _run(self) -> None:
        seen = {r: (-1, time.monotonic()) for r in range(self.size) if r != self.rank}
        while not self._stop.wait(HEARTBEAT_S):
            why = self._check(seen)
            if why and not self._stop.is_set():
                self.dead = why
                self._tell_others(why)
                self._on_dead(why)
                return

    def _tell_others(self, why: str) -> None:
        try:
            self._store.compare_set(_DOWN, "", why)
        except (RuntimeError, OSError):
            pass                   # the store is gone with rank 0: the others see that too

    def _check(self, seen: dict[int, tuple[int, float]]) -> str | None:
        why = self._extra_check() if self._extra_check else None
        if why:
            return why
        try:
            if self._store.check([_SHUTDOWN]):
                return None        # rank 0 is shutting the group down on purpose
            if self._store.check([_DOWN]):
                return self._store.get(_DOWN).decode()
            self._store.add(_hb_key(self.rank), 1)
            now = time.monotonic()
            for r, (count, since) in seen.items():
                current = self._store.add(_hb_key(r), 0)
                if current != count:
                    seen[r] = (current, now)
                elif now - since > DEAD_AFTER_S:
                    return f"tp rank {r} stopped responding (no heartbeat for {now - since:.1f} s)"
        except (RuntimeError, OSError) as e:
            return f"tp rank 0 is gone (its rendezvous store stopped answering: {_first_line(e)})"
        return None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


# ---- plans over the control group --------------------------------------------------------

def broadcast_bytes(data: bytes | None, group: ProcessTPGroup) -> bytes:
    """Rank 0 passes the bytes, the others None; every rank returns them. Length first, then
    a uint8 tensor (plans are small: kilobytes)."""
    length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(length, 0, group=group.control)
    n = int(length.item())
    if n == 0:
        return b""
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if group.rank == 0
           else torch.empty(n, dtype=torch.uint8))
    dist.broadcast(buf, 0, group=group.control)
    return data if group.rank == 0 else buf.numpy().tobytes()


def _share_sampling_seed(runner, group: ProcessTPGroup) -> None:
    """Every rank draws unseeded samples from one generator seed, rank 0's (given or fresh),
    so all ranks sample the same tokens from the same gathered logits."""
    from gpu_worker.sampler import Sampler
    if group.rank == 0:
        seed = runner.rc.seed if runner.rc.seed is not None else secrets.randbits(62)
        group.store.set(_SEED, str(seed))
    else:
        seed = int(group.store.get(_SEED))
    runner.sampler = Sampler(runner.rc.device, seed)


def _check_agreement(result: StepResult, group: ProcessTPGroup, device: str) -> None:
    """All ranks must have sampled the same tokens; they append them to their own state."""
    body = json.dumps(sorted((rid, t.token_id) for rid, t in result.sampled.items()))
    digest = torch.tensor([zlib.crc32(body.encode())], dtype=torch.int64, device=device)
    parts = [torch.empty_like(digest) for _ in range(group.size)]
    dist.all_gather(parts, digest)
    values = [int(p.item()) for p in parts]
    if len(set(values)) > 1:
        odd = [r for r, v in enumerate(values) if v != values[0]]
        raise PacerError(f"tensor-parallel ranks {odd} sampled different tokens than rank 0 "
                         f"at step {result.step}")


# ---- rank 0 ------------------------------------------------------------------------------

class TPExecutor:
    """Rank 0's executor, with ModelRunner's interface: `execute(plan) -> StepResult`,
    `requests`, `shutdown()`. Sends each plan to the followers, then runs it here."""

    def __init__(self, runner, group: ProcessTPGroup, followers: "Followers | None" = None,
                 ready_timeout_s: float = JOIN_TIMEOUT_S):
        self.runner, self.group, self.followers = runner, group, followers
        self.control_seconds = 0.0          # plan broadcast + token check, for the bench
        self.restore_threads: int | None = None  # torch threads to give back at shutdown
        self._closed = False
        self._failed: str | None = None
        _share_sampling_seed(runner, group)
        _wait_until(lambda: group.store.add(_READY, 0) >= group.size - 1, ready_timeout_s,
                    followers.check if followers else None,
                    "the tensor-parallel followers to load the model", lambda: group.down)

    @property
    def tp(self) -> ProcessTPGroup:
        return self.group

    @property
    def requests(self):
        return self.runner.requests

    def execute(self, plan: IterationPlan) -> StepResult:
        self._raise_if_down()
        try:
            start = time.perf_counter()
            broadcast_bytes(encode(PlanMsg(plan)), self.group)
            mid = time.perf_counter()
            result = self.runner.execute(plan)
            end = time.perf_counter()
            _check_agreement(result, self.group, self.runner.rc.device)
            self.control_seconds += (mid - start) + (time.perf_counter() - end)
            return result
        except RuntimeError as e:          # gloo/NCCL errors: a peer died or timed out
            why = self.group.liveness.wait_for_death(DEAD_AFTER_S + 2 * HEARTBEAT_S)
            self._failed = why or f"tensor-parallel iteration failed on rank 0: {_first_line(e)}"
            self._take_down()
            raise PacerError(self._failed) from e
        except BaseException as e:
            # the followers are mid-iteration, waiting for rank 0: the group cannot continue
            self._failed = f"rank 0 failed mid-iteration: {type(e).__name__}: {_first_line(e)}"
            self._take_down()
            raise

    def _raise_if_down(self) -> None:
        if self._closed:
            raise PacerError("the tensor-parallel executor was shut down")
        why = self._failed or self.group.down
        if why:
            self._take_down()
            raise PacerError(why)

    def _take_down(self) -> None:
        if self.followers:
            self.followers.stop(grace_s=2 * HEARTBEAT_S + 1)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Tell the followers to leave, wait for them, and close the group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        group = self.group
        try:
            if not (group.down or self._failed):
                group.store.set(_SHUTDOWN, "1")
                group.liveness.stop()
                broadcast_bytes(b"", group)
                _wait_until(lambda: group.store.add(_DONE, 0) >= group.size - 1, timeout_s,
                            self.followers.check if self.followers else None,
                            "the tensor-parallel followers to leave")
        except (PacerError, RuntimeError):
            pass                               # a follower already gone: nothing to tell it
        finally:
            if self.followers:
                self.followers.reap(timeout_s)
            _destroy(group)
            if self.restore_threads:
                torch.set_num_threads(self.restore_threads)


# ---- ranks > 0 ---------------------------------------------------------------------------

def run_follower(runner, group: ProcessTPGroup) -> None:
    """Receive plans from rank 0 and run them until rank 0 shuts the group down."""
    _share_sampling_seed(runner, group)
    group.store.add(_READY, 1)
    while True:
        try:
            data = broadcast_bytes(None, group)
            if not data:
                break
            msg = decode(data)
            if not isinstance(msg, PlanMsg):
                raise PacerError(f"tp rank {group.rank}: expected a plan, got {msg.KIND}")
            result = runner.execute(msg.plan)
            _check_agreement(result, group, runner.rc.device)
        except RuntimeError as e:
            why = group.liveness.wait_for_death(DEAD_AFTER_S + 2 * HEARTBEAT_S)
            raise PacerError(why or f"tensor-parallel iteration failed on rank {group.rank}: "
                                    f"{_first_line(e)}") from e
    group.liveness.stop()
    group.store.add(_DONE, 1)
    _destroy(group)


# ---- in-process mode: rank 0 spawns the followers ----------------------------------------

class Followers:
    """The follower processes rank 0 spawned: liveness by exit status, and clean-up."""

    def __init__(self, procs: dict[int, subprocess.Popen]):
        self.procs = procs

    def check(self) -> str | None:
        for rank, p in self.procs.items():
            code = p.poll()
            if code is not None:
                how = (f"was killed by {signal.Signals(-code).name}" if code < 0
                       else f"exited with code {code}")
                return f"tp rank {rank} (pid {p.pid}) {how}"
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
    """Check the cut, spawn ranks 1..tp-1 (`python -m gpu_worker.distributed`), join them as
    rank 0 and load this rank's shard. `rc` is rank 0's RunnerConfig; followers get the same
    one on their own device."""
    from gpu_worker.model_runner import ModelRunner

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
                              on_dead=lambda why: followers.stop(grace_s=2 * HEARTBEAT_S + 1),
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
            _destroy(group)
        torch.set_num_threads(threads_before)
        raise
    executor.restore_threads = threads_before if threads else None
    atexit.register(executor.shutdown)
    return executor


def threads_per_rank(device: str, tp: int) -> int | None:
    """On CPU the ranks share the cores: split them instead of oversubscribing."""
    if device != "cpu":
        return None
    return max(1, (os.cpu_count() or 1) // tp)


def _spawn_follower(rank: int, tp: int, addr: str, port: int, backend: str, timeout_s: float,
                    source: ModelSource, rc, threads: int | None) -> subprocess.Popen:
    spec = {"model": source.path, "runner": {**asdict(rc), "progress": False},
            "backend": backend, "timeout_s": timeout_s, "parent_pid": os.getpid()}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "gpu_worker.distributed", "--rank", str(rank), "--tp", str(tp),
           "--master-addr", addr, "--master-port", str(port), "--spec", json.dumps(spec)]
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)


def _follower_main(argv: list[str]) -> int:
    """A spawned follower: join, load this rank's shard, follow until shut down."""
    p = argparse.ArgumentParser(prog="python -m gpu_worker.distributed")
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
        from gpu_worker.model_runner import ModelRunner, RunnerConfig
        from shared.model_config import load_model_config
        from shared.model_source import resolve_model

        source = resolve_model(spec["model"])
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
    sys.exit(_follower_main(sys.argv[1:]))
