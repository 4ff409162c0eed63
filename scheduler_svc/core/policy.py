"""Scheduling policy, kept apart from the loop: who waits where, who is preempted.

First come, first served. A preempted request goes back to the front of the waiting queue so
it resumes before anyone who arrived after it; the victim is the most recently admitted
running request, so the oldest running request is never preempted while another runs and is
therefore always making progress.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from scheduler_svc.core.request import Request


class FcfsPolicy:
    def enqueue(self, waiting: deque[Request], request: Request) -> None:
        waiting.append(request)

    def requeue_preempted(self, waiting: deque[Request], request: Request) -> None:
        waiting.appendleft(request)

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        """Choose among running requests not yet scheduled this iteration (admission order)."""
        return candidates[-1]
