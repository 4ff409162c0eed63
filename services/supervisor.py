"""Child processes of `pacer up`: started, watched, and stopped in order.

Each child runs in its own session, so a Ctrl-C at the terminal reaches only `pacer up`, which
then stops the children one by one (gateway first, Redis last) instead of all at once. On Linux
a child also gets SIGTERM if `pacer up` itself dies without cleaning up. Given a folder for
them, each child gets a file of its own in $PACER_EXIT_REASON_FILE, emptied at each start,
where it keeps its last error line (shared/exit_reason.py): named when it dies.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace

import structlog

from shared.exit_reason import EXIT_REASON_ENV, read_exit_reason

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
    stdin_data: bytes | None = None     # written to its stdin at each start (a secret kept off argv)
    reason_file: str | None = None      # where it keeps its last error line (None: nowhere)
    cwd: str | None = None              # the folder it runs in (None: ours), at each start

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def last_error(self) -> str:
        """For a line naming its death: its own last error line, or where to look."""
        reason = read_exit_reason(self.reason_file) if self.reason_file else None
        return f"its last error: {reason}" if reason else "its log above says why"


def _popen(argv: list[str], cwd: str | None, stdout, stdin_data: bytes | None,
           reason_file: str | None) -> subprocess.Popen:
    env = None
    if reason_file is not None:
        try:
            os.remove(reason_file)          # an earlier process's: not this one's reason
        except FileNotFoundError:
            pass
        env = {**os.environ, EXIT_REASON_ENV: reason_file}
    proc = subprocess.Popen(argv, cwd=cwd, stdout=stdout, start_new_session=True, env=env,
                            stdin=None if stdin_data is None else subprocess.PIPE,
                            preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    if stdin_data is not None:
        try:
            proc.stdin.write(stdin_data)
            proc.stdin.close()
        except BrokenPipeError:
            pass            # it exited at once; its exit code says why
    return proc


def pacer_argv(*args: str) -> list[str]:
    """argv that runs `pacer <args>` with this interpreter, installed script or not."""
    return [sys.executable, "-m", "services.cli", *args]


class Supervisor:
    def __init__(self, reasons_dir: str | None = None) -> None:
        """`reasons_dir`: a folder for the children's last error lines (None: none kept)."""
        self.children: list[Child] = []
        self.reasons_dir = reasons_dir

    def start(self, name: str, argv: list[str], cwd: str | None = None,
              stdout=None, stdin_data: bytes | None = None) -> Child:
        """`stdout` None: the child shares ours. `stdin_data`: what it reads on its stdin (a
        password kept off its command line, which every user of the machine can read), again
        at each restart; None: no stdin."""
        reason_file = None
        if self.reasons_dir is not None:
            reason_file = os.path.join(self.reasons_dir, f"{len(self.children)}.reason")
        proc = _popen(argv, cwd, stdout, stdin_data, reason_file)
        child = Child(name, argv, proc, stdout=stdout, stdin_data=stdin_data,
                      reason_file=reason_file, cwd=cwd)
        self.children.append(child)
        log.info("started", child=name, pid=proc.pid)
        return child

    def restart(self, child: Child) -> Child:
        """A new process for a child that exited, in its place in the stop order, started as
        it was (its folder, output, stdin and reason file)."""
        fresh = replace(child, reported=False, proc=_popen(
            child.argv, child.cwd, child.stdout, child.stdin_data, child.reason_file))
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
                 default_timeout_s: float = 10.0, groups: dict[str, str] | None = None) -> None:
        """SIGTERM each child in reverse start order, waiting for each; SIGKILL stragglers.
        Children of one group (`groups`: child name -> group, e.g. a TP group's ranks) are
        signalled together and then waited for: a follower rank leaves only when its rank 0
        ends the group, so waiting for it first would always run out its timeout."""
        group_of = groups or {}
        batches: list[list[Child]] = []
        for child in reversed(self.children):
            group = group_of.get(child.name)
            if batches and group is not None and group == group_of.get(batches[-1][0].name):
                batches[-1].append(child)
            else:
                batches.append([child])
        for batch in batches:
            timeout = max((timeouts or {}).get(c.name, default_timeout_s) for c in batch)
            stop_children(batch, timeout)


def stop_children(children: list[Child], timeout_s: float) -> list[int | None]:
    """SIGTERM every child, then wait for each until one shared deadline; SIGKILL those
    still running at it. Their exit codes, in order. A stopped child (SIGSTOP) takes a
    signal only once it runs again: it is sent SIGCONT after the SIGTERM, to drain and exit
    as the others do, rather than be killed at the deadline."""
    for child in children:
        if child.returncode is None:
            try:
                child.proc.send_signal(signal.SIGTERM)
                child.proc.send_signal(signal.SIGCONT)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout_s
    codes = []
    for child in children:
        try:
            codes.append(child.proc.wait(max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            log.warning("did not stop in time; killing", child=child.name, pid=child.pid,
                        timeout_s=timeout_s)
            child.proc.kill()
            codes.append(child.proc.wait())
    return codes


def wait_quietly(seconds: float, stopping) -> None:
    """Sleep up to `seconds`, waking early once `stopping()` is true."""
    end = time.monotonic() + seconds
    while not stopping() and time.monotonic() < end:
        time.sleep(min(0.05, max(0.0, end - time.monotonic())))

