"""Which worker processes the scheduler is planning for, and whether they are still there.

Each rank's heartbeat key (TTL `WORKER_HEARTBEAT_TTL_S`) carries its pid and start time. The
scheduler records them when the group is complete; a rank whose key expired, or whose key now
names another process (it was restarted), has lost the KV cache of every running request, so
the scheduler must recompute them all (`Scheduler.recompute_running`).

Rank 0's heartbeat also names the last plan it answered (the Redis run_id and the plan's entry
id in the plans stream, both written only after the result was sent): once that is at or
after the plan the scheduler waits for, the result is in the results stream, or lost.
"""
from __future__ import annotations

import structlog

from shared.lifecycle import stream_id_order
from shared.keys import Keys
from shared.protocol import ProtocolError, decode, heartbeat_of

log = structlog.get_logger("scheduler.workers")

Incarnation = tuple[int, float]          # (pid, started_at)


def incarnation(value: bytes | None) -> Incarnation | None:
    """Who wrote a heartbeat value; None for a missing or unreadable key."""
    msg = heartbeat_of(value)
    if msg is None:
        return None
    return int(msg.extra.get("pid", -1)), float(msg.extra.get("started_at", msg.time))


def role_disagreement(extra: dict, rank: int, role: str) -> str | None:
    """Why a worker (its heartbeat's `extra`) cannot serve a scheduler of `role`: it was started
    with another `--role`. None when it agrees or stated none."""
    theirs = extra.get("role")
    if theirs is None or theirs == role:
        return None
    return (f"worker rank {rank} of this instance was started with --role {theirs}, this "
            f"scheduler with --role {role}; start both with the same role")


def model_disagreement(extra: dict, rank: int, model: str, weights: str) -> str | None:
    """Why a worker (its heartbeat's `extra`) cannot serve a scheduler of the model `model`
    with the weights fingerprint `weights` (shared/model_source.py:model_identity): it loaded
    other weights, whose token ids and K/V mean something else. None when they agree, or
    either side stated none."""
    theirs = extra.get("weights")
    if not theirs or not weights or theirs == weights:
        return None
    return (f"worker rank {rank} of this instance serves {extra.get('model')!r} (weights "
            f"{theirs}), this scheduler {model!r} (weights {weights}); start both with the "
            f"same --model")


class WorkerWatch:
    def __init__(self, keys: Keys, tp: int) -> None:
        self.heartbeat_keys = [keys.hb_worker(rank) for rank in range(tp)]
        self._planned_for: list[Incarnation | None] = [None] * tp

    def record(self, values: list[bytes | None]) -> None:
        """The group as it is now (every key present): plans from here on are for it."""
        self._planned_for = [incarnation(v) for v in values]

    def answered(self, values: list[bytes | None], run_id: str | None,
                 plan_id: bytes | str) -> bool:
        """Whether rank 0 (the first of `values`, an MGET of `heartbeat_keys`) answered the
        plan with entry id `plan_id`, or a later one, in the Redis with `run_id`."""
        try:
            extra = decode(values[0]).extra if values and values[0] else {}
            return (extra.get("answered_run_id") == run_id
                    and stream_id_order(extra["answered_plan"]) >= stream_id_order(plan_id))
        except (ProtocolError, AttributeError, KeyError, ValueError):
            return False

    def restarted_in(self, values: list[bytes | None]) -> list[int]:
        """Ranks whose key now names another process than at `record` (a restart); an expired
        key is not one: an idle worker that missed a heartbeat still holds its KV cache."""
        return [rank for rank, (value, before) in enumerate(zip(values, self._planned_for))
                if value is not None and incarnation(value) != before]

    def lost_in(self, values: list[bytes | None]) -> list[int]:
        """Ranks that died or were restarted since `record` (MGET of `heartbeat_keys`)."""
        return [rank for rank, (value, before) in enumerate(zip(values, self._planned_for))
                if incarnation(value) != before]
