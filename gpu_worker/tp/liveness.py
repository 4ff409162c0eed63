"""The watchdog of one rank: a rank that dies ends the group within seconds.

Every rank bumps its heartbeat counter in the rendezvous store; a counter that stops moving
for DEAD_AFTER_S, or a store that stops answering (it lives in rank 0: an error, or no answer
for DEAD_AFTER_S when rank 0 is stopped), means that rank is dead. The first rank to see a
death writes why to the store, so every other rank stops with the same message. Rank 0 also
polls the processes it spawned; spawned followers also watch their parent (`extra_check`).
A check that raises something unexpected is a verdict too (the watchdog of that rank failed),
rather than a watchdog thread that ends silently and leaves its peers to blame a live rank.

A collective that fails (a peer dropped the connection, or a step's collective ran past the
group's timeout) is reported at once, with the watchdog's verdict if it has one within a
heartbeat or two and the collective's own error otherwise (`why_collective_failed`).
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Callable, NoReturn

import torch.distributed as dist

from gpu_worker.tp.store_keys import DOWN, DOWN_SEEN, SHUTDOWN, heartbeat_counter
from shared.errors import PacerError

HEARTBEAT_S = 0.5
# a rank whose heartbeat stalls this long is dead; generous, because a false alarm takes the
# group down and the quick signals (process exit, closed sockets, a closed store) come first
DEAD_AFTER_S = 10.0
# how long a rank whose collective failed waits for the watchdog to name the dead rank (a
# spawned process's exit, another rank's verdict in the store: both seen within a heartbeat)
# before it reports the collective's own error
NAME_THE_DEAD_S = 2 * HEARTBEAT_S + 0.5
# what gloo says when the peer at the other end of a connection is gone
CONNECTION_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
                   "Connection refused")
# how long surviving followers get to see a death and say so themselves before rank 0 kills them
FOLLOWER_GRACE_S = 2 * HEARTBEAT_S + 1


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def call_within(fn: Callable[[], object], timeout_s: float, what: str):
    """fn() on a daemon thread, or TimeoutError naming `what` if it has not returned within
    `timeout_s`: a TCPStore client call to a server that is stopped (SIGSTOP) waits for ever,
    whatever the store's own timeout."""
    outcome: dict = {}

    def call() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as e:
            outcome["error"] = e
    thread = threading.Thread(target=call, name="tp-store-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{what} gave no answer for {timeout_s:.1f} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def record_only(why: str) -> None:
    """Rank 0's default: Liveness.dead holds the reason; the next execute raises it."""


def leave_process(code: int) -> NoReturn:
    """End a rank's process now with `code`, once what it had to do is done, without the
    interpreter's finalization: torch's threads of a process group (gloo's workers letting go
    of a finished or failed collective's tensors, NCCL's watchdog) may still call into Python
    then, and a thread that asks for the GIL while the interpreter finalizes is ended inside
    C++ code that cannot unwind ("terminate called without an active exception": SIGABRT,
    -6, instead of `code`). What was printed is flushed first."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass              # a reader gone, a stream closed: nothing more to say there
    os._exit(code)


def exit_process(rank: int) -> Callable[[str], None]:
    """A follower's default: its main thread may sit in a collective only the dead rank
    could finish, so it prints why and leaves."""
    def leave(why: str) -> None:
        print(f"pacer: tp rank {rank}: {why}; the tensor-parallel group is down, exiting",
              file=sys.stderr, flush=True)
        leave_process(1)
    return leave


class Liveness:
    """Uses its own store connection: the main thread's may be busy in a store call."""

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

    def why_collective_failed(self, e: BaseException) -> str:
        """Why this rank's collective failed, for the error it raises: the watchdog's verdict
        if it names the dead rank within NAME_THE_DEAD_S, else the collective's own error
        (a peer that dropped the connection is named where only one peer could have)."""
        deadline = time.monotonic() + NAME_THE_DEAD_S
        while self.dead is None and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)
        if self.dead:
            return self.dead
        if any(lost in str(e) for lost in CONNECTION_LOST):
            peers = [r for r in range(self.size) if r != self.rank]
            who = f"tp rank {peers[0]}" if len(peers) == 1 else "a peer rank"
            return f"{who} dropped the connection: {first_line(e)}"
        return f"a tensor-parallel collective failed on rank {self.rank}: {first_line(e)}"

    def failed_here(self, e: BaseException) -> str:
        """This rank's own step failed (out of memory in its forward, a plan it refused), not
        a collective: stop watching and leave the reason in the store as the group's verdict,
        so the other ranks name it instead of a dropped connection. A verdict reached before
        (a peer that died first) stands."""
        self.stop()
        if self.dead is None:
            self.dead = (f"tp rank {self.rank}: {e}" if isinstance(e, PacerError) else
                         f"tp rank {self.rank} failed mid-iteration: {type(e).__name__}: "
                         f"{first_line(e)}")
            self._tell_others(self.dead, self.rank)
        return self.dead

    def _run(self) -> None:
        seen = {r: (-1, time.monotonic()) for r in range(self.size) if r != self.rank}
        while not self._stop.wait(HEARTBEAT_S):
            try:
                why, culprit = self._check(seen)
            except Exception as e:
                # a check that breaks must not end this thread quietly: the rank would stop
                # beating with `dead` unset, and its peers would blame it 10 s later
                why, culprit = (f"the watchdog of tp rank {self.rank} failed: "
                                f"{type(e).__name__}: {first_line(e)}"), self.rank
            if why and not self._stop.is_set():
                self.dead = why
                self._tell_others(why, culprit)     # a verdict already there stays
                self._on_dead(why)
                return

    def _tell_others(self, why: str, culprit: int | None) -> None:
        verdict = json.dumps({"why": why, "rank": culprit, "by": self.rank})
        try:
            call_within(lambda: self._store.compare_set(DOWN, "", verdict), 2 * HEARTBEAT_S,
                        "the rendezvous store")
        except (RuntimeError, OSError):
            pass                   # the store is gone with rank 0: the others see that too

    def _heard(self, raw: bytes) -> str:
        """Another rank's verdict as this rank tells it: a verdict about this very rank
        says who found it unresponsive, instead of naming itself as another would."""
        verdict = json.loads(raw)
        if verdict["rank"] == self.rank:
            return (f"tp rank {verdict['by']} found this rank unresponsive and took the group "
                    f"down ({verdict['why']})")
        return verdict["why"]

    def _check(self, seen: dict[int, tuple[int, float]]) -> tuple[str | None, int | None]:
        """Why the group is dead and the rank at fault (None: not known, or another rank's
        verdict), or (None, None)."""
        why = self._extra_check() if self._extra_check else None
        if why:
            # a rank whose own step failed leaves its reason in the store before it exits:
            # name that, not the exit it was seen by (rank 0 polls its followers' processes)
            return self._verdict_left() or why, None
        try:
            return call_within(lambda: self._check_store(seen), DEAD_AFTER_S,
                               "its rendezvous store")
        except TimeoutError as e:
            return f"tp rank 0 stopped answering ({first_line(e)})", 0
        except (RuntimeError, OSError) as e:
            return f"tp rank 0 is gone (its rendezvous store stopped answering: {first_line(e)})", 0

    def _verdict_left(self) -> str | None:
        """The group's verdict in the store, if one is there and the store answers."""
        try:
            return call_within(self._verdict_in_store, 2 * HEARTBEAT_S, "the rendezvous store")
        except (RuntimeError, OSError, ValueError, KeyError):
            return None

    def _verdict_in_store(self) -> str | None:
        return self._heard(self._store.get(DOWN)) if self._store.check([DOWN]) else None

    def _check_store(self, seen: dict[int, tuple[int, float]]) -> tuple[str | None, int | None]:
        if self._store.check([SHUTDOWN]):
            return None, None      # rank 0 is shutting the group down on purpose
        verdict = self._verdict_in_store()
        if verdict:
            self._store.add(DOWN_SEEN, 1)     # the failed rank may wait for this to leave
            return verdict, None
        self._store.add(heartbeat_counter(self.rank), 1)
        now = time.monotonic()
        for r, (count, since) in seen.items():
            current = self._store.add(heartbeat_counter(r), 0)
            if current != count:
                seen[r] = (current, now)
            elif now - since > DEAD_AFTER_S:
                return f"tp rank {r} stopped responding (no heartbeat for {now - since:.1f} s)", r
        return None, None
