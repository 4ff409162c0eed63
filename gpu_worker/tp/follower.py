"""Ranks > 0 of a tensor-parallel group: receive each plan from rank 0, run it, check the
sampled tokens agree, until rank 0 shuts the group down (an empty broadcast)."""
from __future__ import annotations

from gpu_worker.model_runner import ModelRunner
from gpu_worker.parallel import CollectiveError
from gpu_worker.tp.broadcast import (AgreementCheck, broadcast_bytes, gather_kv,
                                     share_sampling_seed)
from gpu_worker.tp.group import ProcessTPGroup, bind_device, destroy
from gpu_worker.tp.store_keys import DONE, READY
from shared.cpu import pin_forward_thread
from shared.errors import PacerError
from shared.protocol import PlanMsg, decode


def run_follower(runner: ModelRunner, group: ProcessTPGroup) -> None:
    """Receive plans from rank 0 and run them until rank 0 shuts the group down."""
    bind_device(runner.rc.device)            # this thread runs the forwards
    pin_forward_thread()
    share_sampling_seed(runner, group)
    agreement = AgreementCheck(group)
    group.store.add(READY, 1)
    while True:
        try:
            data = broadcast_bytes(None, group)
            if not data:
                break
            msg = decode(data)
            if not isinstance(msg, PlanMsg):
                raise PacerError(f"tp rank {group.rank}: expected a plan, got {msg.KIND}")
            result = runner.execute(msg.plan)
            if msg.plan.kv_sends or msg.plan.kv_checks:
                gather_kv(result, group)
            agreement.after(result)
        except CollectiveError as e:       # a peer died or timed out
            raise PacerError(group.liveness.why_collective_failed(e)) from e
        except BaseException as e:
            # this rank's own failure (out of memory in its forward, say): the others wait
            # for it in a collective, so the group is down; they are told why
            why = group.liveness.failed_here(e)
            if isinstance(e, RuntimeError):
                raise PacerError(why) from e
            raise
    group.liveness.stop()
    group.store.add(DONE, 1)
    destroy(group)
