"""Rank 0's side of a tensor-parallel group: send each plan to the followers, run it here,
check that every rank sampled the same tokens. A rank that dies (or hangs mid-step) fails the
execute in flight, or the next one, with a PacerError naming it or the collective's error."""
from __future__ import annotations

import atexit
import time
from typing import Callable

import torch

from gpu_worker.model_runner import ModelRunner
from gpu_worker.parallel import CollectiveError
from gpu_worker.tp.broadcast import (AgreementCheck, broadcast_bytes, gather_kv,
                                     share_sampling_seed)
from gpu_worker.tp.group import JOIN_TIMEOUT_S, ProcessTPGroup, destroy, wait_until
from gpu_worker.tp.liveness import FOLLOWER_GRACE_S
from gpu_worker.tp.store_keys import DONE, DOWN_SEEN, READY, SHUTDOWN
from shared.errors import PacerError
from shared.plan import IterationPlan, StepResult
from shared.protocol import PlanMsg, encode


class TPExecutor:
    """Rank 0's executor, with ModelRunner's interface: `execute(plan) -> StepResult`,
    `requests`, `shutdown()`. Sends each plan to the followers, then runs it here.

    `followers` (in-process mode, `spawn.Followers`): the processes rank 0 spawned, polled
    while waiting and stopped when the group fails. `stopped` (served): the worker was told
    to stop, checked while waiting for the followers to load."""

    def __init__(self, runner: ModelRunner, group: ProcessTPGroup, followers=None,
                 ready_timeout_s: float = JOIN_TIMEOUT_S,
                 stopped: Callable[[], bool] = lambda: False):
        self.runner, self.group, self.followers = runner, group, followers
        self.control_seconds = 0.0          # plan broadcast + token check, for the bench
        self.restore_threads: int | None = None  # torch threads to give back at shutdown
        self._closed = False
        self._failed: str | None = None
        share_sampling_seed(runner, group)
        self._agreement = AgreementCheck(group)
        wait_until(lambda: group.store.add(READY, 0) >= group.size - 1, ready_timeout_s,
                   followers.check if followers else None,
                   "the tensor-parallel followers to load the model", lambda: group.down,
                   stopped)

    @property
    def tp(self) -> ProcessTPGroup:
        return self.group

    @property
    def requests(self):
        return self.runner.requests

    def execute(self, plan: IterationPlan, wire: bytes | None = None) -> StepResult:
        """Run `plan` on every rank. `wire`: the plan already encoded as a PlanMsg (as it
        came from Redis), forwarded to the followers as it is instead of encoded again."""
        self._raise_if_down()
        try:
            start = time.perf_counter()
            broadcast_bytes(wire if wire is not None else encode(PlanMsg(plan)), self.group)
            mid = time.perf_counter()
            result = self.runner.execute(plan)
            if plan.kv_sends or plan.kv_checks:
                result = gather_kv(result, self.group)
            end = time.perf_counter()
            self._agreement.after(result)
            self.control_seconds += (mid - start) + (time.perf_counter() - end)
            return result
        except CollectiveError as e:       # gloo/NCCL errors: a peer died or timed out
            self._failed = self.group.liveness.why_collective_failed(e)
            self._take_down()
            raise PacerError(self._failed) from e
        except BaseException as e:
            # this rank's own failure (out of memory in its forward, say): the followers are
            # mid-iteration, waiting for rank 0, so the group cannot continue; they are told why
            self._failed = self.group.liveness.failed_here(e)
            self._take_down(told=True)
            if isinstance(e, RuntimeError):
                raise PacerError(self._failed) from e
            raise

    def _raise_if_down(self) -> None:
        if self._closed:
            raise PacerError("the tensor-parallel executor was shut down")
        why = self._failed or self.group.down
        if why:
            self._take_down()
            raise PacerError(why)

    def _take_down(self, told: bool = False) -> None:
        """Stop the spawned followers. `told`: rank 0 left the group's verdict in its store;
        served, where rank 0 cannot see its followers exit, it waits (briefly) until their
        watchdogs have read it, before its store goes with this process."""
        if self.followers:
            self.followers.stop(grace_s=FOLLOWER_GRACE_S)
        elif told:
            try:
                wait_until(lambda: self.group.store.add(DOWN_SEEN, 0) >= self.group.size - 1,
                           FOLLOWER_GRACE_S, None, "the followers to read why the group is down")
            except (PacerError, RuntimeError):
                pass                  # a follower that is gone too: the others still hear it

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Tell the followers to leave, wait for them, and close the group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        group = self.group
        try:
            if not (group.down or self._failed):
                group.store.set(SHUTDOWN, "1")
                group.liveness.stop()
                broadcast_bytes(b"", group)
                wait_until(lambda: group.store.add(DONE, 0) >= group.size - 1, timeout_s,
                           self.followers.check if self.followers else None,
                           "the tensor-parallel followers to leave")
        except (PacerError, RuntimeError):
            pass                               # a follower already gone: nothing to tell it
        finally:
            if self.followers:
                self.followers.reap(timeout_s)
            destroy(group)
            if self.restore_threads:
                torch.set_num_threads(self.restore_threads)
