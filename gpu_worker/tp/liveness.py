"""The watchdog of one rank: a rank that dies ends the group within seconds.

Every rank bumps its heartbeat counter in the rendezvous store; a counter that stops moving
for DEAD_AFTER_S, or a store that stops answering (it lives in rank 0), means that rank is
dead. The first rank to see a death writes why to the store, so every other rank stops with
the same message. Rank 0 also polls the processes it spawned; spawned followers also watch
their parent (`extra_check`).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from gpu_worker.tp.store_keys import DOWN, SHUTDOWN, heartbeat_counter

HEARTBEAT_S = 0.5
# a rank whose heartbeat stalls this long is dead; generous, because a false alarm takes the
# group down and the quick signals (process exit, closed sockets, a closed store) come first
DEAD_AFTER_S = 10.0
# how long a rank whose collective failed waits for the watchdog to name the dead rank
NAME_THE_DEAD_S = DEAD_AFTER_S + 2 * HEARTBEAT_S
# how long surviving followers get to see a death and say so themselves before rank 0 kills them
FOLLOWER_GRACE_S = 2 * HEARTBEAT_S + 1


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def record_only(why: str) -> None:
    """Rank 0's default: Liveness.dead holds the reason; the next execute raises it."""


def exit_process(rank: int) -> Callable[[str], None]:
    """A follower's default: its main thread may sit in a collective only the dead rank
    could finish, so it prints why and leaves."""
    def leave(why: str) -> None:
        print(f"pacer: tp rank {rank}: {why}; the tensor-parallel group is down, exiting",
              file=sys.stderr, flush=True)
        os._exit(1)
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
            self._store.compare_set(DOWN, "", why)
        except (RuntimeError, OSError):
            pass                   # the store is gone with rank 0: the others see that too

    def _check(self, seen: dict[int, tuple[int, float]]) -> str | None:
        why = self._extra_check() if self._extra_check else None
        if why:
            return why
        try:
            if self._store.check([SHUTDOWN]):
                return None        # rank 0 is shutting the group down on purpose
            if self._store.check([DOWN]):
                return self._store.get(DOWN).decode()
            self._store.add(heartbeat_counter(self.rank), 1)
            now = time.monotonic()
            for r, (count, since) in seen.items():
                current = self._store.add(heartbeat_counter(r), 0)
                if current != count:
                    seen[r] = (current, now)
                elif now - since > DEAD_AFTER_S:
                    return f"tp rank {r} stopped responding (no heartbeat for {now - since:.1f} s)"
        except (RuntimeError, OSError) as e:
            return f"tp rank 0 is gone (its rendezvous store stopped answering: {first_line(e)})"
        return None


