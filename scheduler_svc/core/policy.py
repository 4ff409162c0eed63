"""Scheduling policy, kept apart from the loop: who waits where, who is preempted.

First come, first served, by arrival. The running requests are kept in the order they
arrived, and the victim is the last of them: the request that arrived most recently. A
preempted request goes back into the waiting queue ahead of everyone who arrived after it, and
when it is admitted again it takes its place among the running ones by its arrival too. So the
oldest request is never preempted while a younger one runs, and a request that was preempted
once is not the first in line to be preempted again for being the last re-admitted (it was:
the second-oldest of 16 requests over a pool of two went back and forth until the 14 younger
ones had finished, recomputing its answer each time).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from scheduler_svc.core.request import Request


class FcfsPolicy:
    def enqueue(self, waiting: deque[Request], request: Request) -> None:
        waiting.append(request)

    def requeue_preempted(self, waiting: deque[Request], request: Request) -> None:
        """Before the first waiting request that arrived after it (most often the front)."""
        index = next((i for i, queued in enumerate(waiting)
                      if queued.arrival_index > request.arrival_index), len(waiting))
        waiting.insert(index, request)

    def place_running(self, running: list[Request], request: Request) -> None:
        """A request admitted (or handed over) joins the running ones by its arrival: after
        those that arrived before it (most often the end)."""
        index = len(running)
        while index and running[index - 1].arrival_index > request.arrival_index:
            index -= 1
        running.insert(index, request)

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        """Choose among running requests not yet scheduled this iteration (arrival order)."""
        return candidates[-1]
