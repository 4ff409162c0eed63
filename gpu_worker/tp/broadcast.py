"""What rank 0 tells its followers outside the forward: each plan (msgpack bytes, shared/
protocol.py's PlanMsg, never pickle) on the gloo control group, the sampling seed through the
store; and the check, after each iteration, that every rank sampled the same tokens.

A plan goes as two broadcasts: the length, on the idle group (a follower waits there as long
as rank 0 idles), then a uint8 tensor, on the control group (bounded by the group's collective
timeout, as the checks are); length 0 means shut down.
The ranks all-gather an 8-byte running digest of the tokens they sampled (every iteration,
or every PACER_TP_CHECK_EVERY), so a divergence stops the group instead of corrupting output
silently. An iteration with KV sends
(P/D) also gathers every rank's failed sends, so rank 0 reports a request whose K/V any rank
failed to send.
"""
from __future__ import annotations

import dataclasses
import json
import os
import secrets
import zlib

import torch
import torch.distributed as dist

from gpu_worker.parallel import collective
from gpu_worker.sampler import Sampler
from gpu_worker.tp.group import ProcessTPGroup
from gpu_worker.tp.store_keys import CHECK_EVERY, SEED
from shared.errors import PacerError
from shared.plan import StepResult


def broadcast_bytes(data: bytes | None, group: ProcessTPGroup) -> bytes:
    """Rank 0 passes the bytes, the others None; every rank returns them. Length first, then
    a uint8 tensor (plans are small: kilobytes)."""
    length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    with collective():
        dist.broadcast(length, 0, group=group.idle)
    n = int(length.item())
    if n == 0:
        return b""
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if group.rank == 0
           else torch.empty(n, dtype=torch.uint8))
    with collective():
        dist.broadcast(buf, 0, group=group.control)
    return data if group.rank == 0 else buf.numpy().tobytes()


def share_sampling_seed(runner, group: ProcessTPGroup) -> None:
    """Every rank draws unseeded samples from one generator seed, rank 0's (given or fresh),
    so all ranks sample the same tokens from the same gathered logits."""
    if group.rank == 0:
        seed = runner.rc.seed if runner.rc.seed is not None else secrets.randbits(62)
        group.store.set(SEED, str(seed))
    else:
        seed = int(group.store.get(SEED))
    runner.sampler = Sampler(seed)


TP_CHECK_EVERY_ENV = "PACER_TP_CHECK_EVERY"


def check_every() -> int:
    """How many iterations one agreement check covers: PACER_TP_CHECK_EVERY, default 1."""
    raw = os.environ.get(TP_CHECK_EVERY_ENV, "1").strip()
    try:
        every = int(raw)
    except ValueError:
        every = 0
    if every < 1:
        raise PacerError(f"{TP_CHECK_EVERY_ENV} must be an integer >= 1, got {raw!r}")
    return every


class AgreementCheck:
    """All ranks must have sampled the same tokens (they append them to their own state).

    Each iteration's tokens are folded into a running CRC-32 on the host; every `every`
    iterations the ranks all-gather it on the gloo control group (host memory: no copy to or
    from the device, no NCCL launch, no sync with the GPU's stream) and read the gathered
    digests in one `.tolist()`. The digest is cumulative, so a check every N iterations still
    catches a divergence in any of them, at most N - 1 iterations late. Every rank runs the
    same plans in the same order, so their counters agree; N is rank 0's (its environment,
    or `every`), passed through the store, so the ranks' collectives always pair up."""

    def __init__(self, group: ProcessTPGroup, every: int | None = None):
        self.group = group
        if group.rank == 0:
            self.every = every if every is not None else check_every()
            group.store.set(CHECK_EVERY, str(self.every))
        else:
            self.every = int(group.store.get(CHECK_EVERY))
        self._digest = 0
        self._pending = 0
        self._since: int | None = None

    def after(self, result: StepResult) -> None:
        body = json.dumps(sorted((rid, t.token_id) for rid, t in result.sampled.items()))
        self._digest = zlib.crc32(body.encode(), self._digest)
        self._since = result.step if self._since is None else self._since
        self._pending += 1
        if self._pending < self.every:
            return
        since, self._pending, self._since = self._since, 0, None
        mine = torch.tensor([self._digest], dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in range(self.group.size)]
        with collective():
            dist.all_gather(parts, mine, group=self.group.control)
        values = torch.cat(parts).tolist()
        if len(set(values)) > 1:
            odd = [r for r, v in enumerate(values) if v != values[0]]
            when = (f"at step {result.step}" if since == result.step
                    else f"between steps {since} and {result.step}")
            raise PacerError(f"tensor-parallel ranks {odd} sampled different tokens than "
                             f"rank 0 {when}")


def gather_kv(result: StepResult, group: ProcessTPGroup) -> StepResult:
    """The P/D fields united on every rank: `kv_failed` (failed on any rank), `kv_digests`
    (rank r's digests at index r, for requests no rank failed) and `kv_verified` (verified on
    every rank); the other figures stay this rank's own. Call on every rank after an
    iteration whose plan had KV sends or checks."""
    parts = _all_gather_json([result.kv_failed, {rid: d[0] for rid, d in result.kv_digests.items()},
                              result.kv_verified], group)
    failed = {rid for part in parts for rid in part[0]}
    digests = {rid: [part[1][rid] for part in parts] for rid in parts[0][1]
               if rid not in failed and all(rid in part[1] for part in parts)}
    verified = set.intersection(*(set(part[2]) for part in parts))
    return dataclasses.replace(result, kv_failed=sorted(failed), kv_digests=digests,
                               kv_verified=[rid for rid in result.kv_verified if rid in verified])


def _all_gather_json(value, group: ProcessTPGroup) -> list:
    """Every rank's `value` (JSON-able), in rank order."""
    data = json.dumps(value).encode()
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.empty_like(size) for _ in range(group.size)]
    with collective():
        dist.all_gather(sizes, size, group=group.control)
    width = max(int(n.item()) for n in sizes)
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty(width, dtype=torch.uint8) for _ in range(group.size)]
    with collective():
        dist.all_gather(parts, mine, group=group.control)
    return [json.loads(part[:int(n.item())].numpy().tobytes()) for part, n in zip(parts, sizes)]
