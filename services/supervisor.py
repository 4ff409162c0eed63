"""Child processes of `pacer up`: started, watched, and stopped in order.

Each child runs in its own session, so a Ctrl-C at the terminal reaches only `pacer up`, which
then stops the children one by one (gateway first, Redis last) instead of all at once. On Linux
a child also gets SIGTERM if `pacer up` itself dies without cleaning up.
"""
from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import structlog

log = structlog.get_logger("supervisor")

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """preexec_fn: ask the kernel to SIGTERM this child when its parent exits."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass     # not Linux: children outlive a killed parent, as any daemon would


@dataclass
class Child:
    name: str                           # for people: "scheduler", "worker rank 0", ...
    argv: list[str]
    proc: subprocess.Popen
    reported: bool = field(default=False)
    stdout: object = None               # what the process writes to (None: ours)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()


def pacer_argv(*args: str) -> list[str]:
    """argv that runs `pacer <args>` with this interpreter, installed script or not."""
    return [sys.executable, "-m", "services.cli", *args]


class Supervisor:
    def __init__(self) -> None:
        self.children: list[Child] = []

    def start(self, name: str, argv: list[str], cwd: str | None = None,
              stdout=None) -> Child:
        """`stdout` None: the child shares ours."""
        proc = subprocess.Popen(argv, cwd=cwd, stdout=stdout, start_new_session=True,
                                preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        child = Child(name, argv, proc, stdout=stdout)
        self.children.append(child)
        log.info("started", child=name, pid=proc.pid)
        return child

    def restart(self, child: Child) -> Child:
        """A new process for a child that exited, in its place in the stop order."""
        fresh = Child(child.name, child.argv, subprocess.Popen(
            child.argv, stdout=child.stdout, start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None))
        self.children[self.children.index(child)] = fresh
        log.info("restarted", child=child.name, pid=fresh.pid)
        return fresh

    def newly_exited(self) -> list[Child]:
        """Children that exited since the last call (each reported once)."""
        exited = [c for c in self.children if not c.reported and c.returncode is not None]
        for child in exited:
            child.reported = True
        return exited

    def stop_all(self, timeouts: dict[str, float] | None = None,
                 default_timeout_s: float = 10.0) -> None:
        """SIGTERM each child in reverse start order, waiting for each; SIGKILL stragglers."""
        for child in reversed(self.children):
            timeout = (timeouts or {}).get(child.name, default_timeout_s)
            stop_child(child, timeout)


def stop_child(child: Child, timeout_s: float) -> int | None:
    if child.returncode is not None:
        return child.returncode
    try:
        child.proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        return child.returncode
    try:
        return child.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        log.warning("did not stop in time; killing", child=child.name, pid=child.pid,
                    timeout_s=timeout_s)
        child.proc.kill()
        return child.proc.wait()


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def wait_quietly(seconds: float, stopping) -> None:
    """Sleep up to `seconds`, waking early once `stopping()` is true."""
    end = time.monotonic() + seconds
    while not stopping() and time.monotonic() < end:
        time.sleep(min(0.05, max(0.0, end - time.monotonic())))

