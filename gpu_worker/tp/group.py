"""Joining a tensor-parallel group: the rendezvous store, the process group for the forward's
collectives, the gloo control group for plans, and the watchdog; the addresses and devices
each rank uses.

The default group and the control group have a short collective timeout (a live rank never
waits that long within a step, so a rank that hangs mid-step takes the group down); only a
follower's side of the idle group, on which it waits for the next plan's length, waits as
long as rank 0 idles between plans.
"""
from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from gpu_worker.parallel import TPGroup
from gpu_worker.tp.liveness import Liveness, exit_process, first_line, record_only
from gpu_worker.tp.store_keys import JOINED
from shared.errors import PacerError

DEFAULT_TIMEOUT_S = 30.0       # one forward collective; a live rank never waits this long
JOIN_TIMEOUT_S = 300.0         # served ranks may start minutes apart
IDLE_TIMEOUT = timedelta(days=3650)   # followers wait for the next plan as long as rank 0 idles
# NCCL reports errors asynchronously: without this a collective whose peer died or hung
# spins on the GPU, and the host waits in its next copy from the device for ever. With it,
# the NCCL watchdog aborts the communicators and ends the process once a collective has
# failed or run past the group's timeout (docs/failure-modes.md). Set unless already set.
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


# ---- addresses, devices, cores -----------------------------------------------------------

def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def device_for_rank(device: str, rank: int) -> str:
    """One accelerator per rank: "cuda" or "cuda:k" -> cuda:(k + rank); CPU stays CPU."""
    if not device.startswith("cuda"):
        return device
    base = int(device.split(":")[1]) if ":" in device else 0
    return f"cuda:{base + rank}"


def bind_device(device: str) -> None:
    """Make `device` this thread's current CUDA device (it is per thread: Triton launches,
    CUDA graphs, NCCL and tensors made with a bare "cuda" use it). Call at the start of every
    thread or function that loads, profiles or runs forwards; nothing to do off CUDA."""
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise PacerError(f"--device {device}: this torch ({torch.__version__}) sees no "
                             f"CUDA GPU")
        torch.cuda.set_device(device_for_rank(device, 0))      # a bare "cuda" is cuda:0


def on_device(device: str, fn: Callable, *args):
    """fn(*args) on this thread with `device` current: for asyncio.to_thread calls."""
    bind_device(device)
    return fn(*args)


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free now (bind to port 0), never a hard-coded one."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def threads_per_rank(device: str, tp: int) -> int | None:
    """On CPU the ranks share the cores: split them instead of oversubscribing."""
    if device != "cpu":
        return None
    return max(1, (os.cpu_count() or 1) // tp)


# ---- the group ---------------------------------------------------------------------------

class GroupNotFormed(PacerError):
    """The service was told to stop before its group formed: nothing to drain."""


@dataclass
class ProcessTPGroup(TPGroup):
    """A TPGroup whose collectives are real (torch.distributed), plus what rank 0 and the
    followers need around them: the control group for plans and checks, the idle group a
    follower waits on for the next plan, the store, the watchdog."""
    control: object = None
    idle: object = None
    store: object = None
    liveness: Liveness | None = None

    @property
    def down(self) -> str | None:
        """Why the group is dead (a rank died), or None."""
        return self.liveness.dead if self.liveness else None


def init_tp_group(rank: int, size: int, master_addr: str, master_port: int, backend: str,
                  *, timeout_s: float = DEFAULT_TIMEOUT_S, join_timeout_s: float = JOIN_TIMEOUT_S,
                  extra_check: Callable[[], str | None] | None = None,
                  on_dead: Callable[[str], None] | None = None,
                  device: str | None = None,
                  stopped: Callable[[], bool] = lambda: False) -> ProcessTPGroup:
    """Join (rank 0: host) the group at master_addr:master_port and start the watchdog.

    `extra_check` returns why a peer is dead (rank 0: its spawned processes; a spawned
    follower: its parent), checked while joining and then by the watchdog. `on_dead` runs on
    the watchdog thread when a peer dies; by default rank 0 records it (the next execute
    raises) and a follower prints it and exits the process, since its main thread may sit
    in a collective that only the dead rank could finish. `device` (NCCL only): this rank's
    GPU, default cuda:rank. `stopped`: the service was told to stop, checked while joining
    (a served rank's peers may never come)."""
    if dist.is_initialized():
        raise PacerError("this process already belongs to a torch.distributed group "
                         "(one tensor-parallel group per process)")
    if backend == "nccl":
        bind_device(device or device_for_rank("cuda", rank))
        for name, value in NCCL_ENV.items():
            os.environ.setdefault(name, value)
    on_dead = on_dead or (record_only if rank == 0 else exit_process(rank))
    if backend == "nccl":
        on_dead = _then_abort_nccl(on_dead)
    group = ProcessTPGroup(rank=rank, size=size)
    try:
        group.store = store = dist.TCPStore(
            master_addr, master_port, size, is_master=rank == 0,
            timeout=timedelta(seconds=join_timeout_s), wait_for_workers=False)
        store.add(JOINED, 1)
        wait_until(lambda: store.add(JOINED, 0) >= size, join_timeout_s, extra_check,
                   f"all {size} tensor-parallel ranks to join at {master_addr}:{master_port}",
                   stopped=stopped)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))
        group.control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        # a timeout is each process's own: rank 0's send waits for the followers to receive,
        # so on rank 0 this group is bounded too, and a follower that hangs idle ends the group
        group.idle = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT if rank else
                                    timedelta(seconds=timeout_s))
        group.liveness = Liveness(master_addr, master_port, rank, size, extra_check, on_dead)
        group.liveness.start()
    except BaseException:
        destroy(group)
        raise
    return group


def _then_abort_nccl(on_dead: Callable[[str], None]) -> Callable[[str], None]:
    """After `on_dead`, abort this rank's NCCL communicators: a forward waiting on a
    collective that a dead rank will never join fails now, not at the group's timeout."""
    def abort(why: str) -> None:
        on_dead(why)
        try:
            dist.group.WORLD._get_backend(torch.device("cuda")).abort()
        except (RuntimeError, AttributeError, ValueError) as e:
            print(f"pacer: could not abort the NCCL communicators: {first_line(e)}",
                  file=sys.stderr, flush=True)
    return abort


def wait_until(done: Callable[[], bool], timeout_s: float,
               extra_check: Callable[[], str | None] | None, what: str,
               down: Callable[[], str | None] = lambda: None,
               stopped: Callable[[], bool] = lambda: False) -> None:
    """Poll instead of blocking, so a peer that dies meanwhile is named at once, and a
    service told to stop (`stopped`) need not wait out the timeout (GroupNotFormed)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if stopped():
            raise GroupNotFormed(f"told to stop while waiting for {what}")
        why = (extra_check() if extra_check else None) or down()
        if why:
            raise PacerError(f"{why} while waiting for {what}")
        if time.monotonic() > deadline:
            raise PacerError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.05)


def destroy(group: ProcessTPGroup) -> None:
    if group.liveness:
        group.liveness.stop()
    if dist.is_initialized():
        dist.destroy_process_group()
    group.store = None            # rank 0: closes the rendezvous store's server
