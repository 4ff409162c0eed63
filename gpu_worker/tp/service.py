"""Served tensor parallelism: the ranks of one worker group meet through Redis, then talk
only over torch.distributed.

Rank 0 picks a free port, writes `{addr, port, pid, time}` to the rendezvous key, hosts the
group, withdraws the key once the group formed and serves plans through a TPExecutor (it
broadcasts each plan to the followers, all ranks run it, all must sample the same tokens).
Ranks > 0 read the rendezvous, join, and follow until rank 0 shuts the group down; a rank
that dies takes the group down within seconds (the watchdog, `liveness.py`) and `pacer up`
restarts the whole group.
"""
from __future__ import annotations

import asyncio
import dataclasses

import redis.asyncio as aioredis
import structlog
import torch

from gpu_worker.model_runner import build_runner
from gpu_worker.tp.executor import TPExecutor
from gpu_worker.tp.follower import run_follower
from gpu_worker.tp.group import (backend_for, destroy, device_for_rank, init_tp_group,
                                 on_device, threads_per_rank)
from gpu_worker.tp.rendezvous import (listening, publish_rendezvous, read_rendezvous,
                                     withdraw_rendezvous)
from shared.engine_layout import EngineLayout
from shared.errors import PacerError
from shared.keys import Keys

log = structlog.get_logger("worker")

FOLLOWER_JOIN_TIMEOUT_S = 60.0


def _rank_layout(layout: EngineLayout, rank: int) -> EngineLayout:
    """The layout with this rank's device (cuda:k+rank on GPU; CPU stays CPU)."""
    device = device_for_rank(layout.args.device, rank)
    return dataclasses.replace(layout, args=dataclasses.replace(layout.args, device=device))


def _share_cores(layout: EngineLayout) -> None:
    threads = threads_per_rank(layout.args.device, layout.args.tp)
    if threads:         # never more than `--threads` asked for
        torch.set_num_threads(min(threads, torch.get_num_threads()))


async def start_rank0(redis: aioredis.Redis, keys: Keys, layout: EngineLayout,
                      host: str, stop: asyncio.Event) -> TPExecutor:
    """Publish the rendezvous, host the group, load rank 0's shard, wait for the followers.
    Told to stop while the followers have not all come (one may never: `pacer up` killed
    starts no new one), it stops waiting: GroupNotFormed."""
    tp, device = layout.args.tp, layout.args.device
    addr, port, published = await publish_rendezvous(redis, keys, host)
    log.info("tp group rendezvous published", addr=addr, port=port, tp=tp)
    group = await asyncio.to_thread(init_tp_group, 0, tp, addr, port, backend_for(device),
                                    device=device_for_rank(device, 0), stopped=stop.is_set)
    try:
        await withdraw_rendezvous(redis, keys, published)
        _share_cores(layout)
        mine = _rank_layout(layout, 0)
        runner = await asyncio.to_thread(on_device, mine.args.device, build_runner, mine,
                                         group, True)
        return await asyncio.to_thread(TPExecutor, runner, group, stopped=stop.is_set)
    except BaseException:
        destroy(group)
        raise


async def serve_follower(redis: aioredis.Redis, keys: Keys, layout: EngineLayout, rank: int,
                         stop: asyncio.Event, on_runner=lambda runner: None) -> int:
    """Join the group rank 0 announced and follow it until it ends, however long after rank 0
    it starts. `on_runner` is called with the runner once it is built (its KV descriptor goes
    into the heartbeat)."""
    refused: set[str] = set()           # rendezvous of groups found gone
    while not stop.is_set():
        found = await read_rendezvous(redis, keys, stop, refused)
        if found is None:
            return 0
        addr, port, written = found
        if not await listening(addr, port, stop):
            log.warning("tp rendezvous of a group that is gone; waiting for a newer one",
                        addr=addr, port=port)
            refused.add(written)
            continue
        try:
            group = await asyncio.to_thread(
                init_tp_group, rank, layout.args.tp, addr, port, backend_for(layout.args.device),
                join_timeout_s=FOLLOWER_JOIN_TIMEOUT_S,
                device=device_for_rank(layout.args.device, rank), stopped=stop.is_set)
            break
        except (PacerError, RuntimeError) as e:      # a rendezvous of a group that is gone
            if stop.is_set():
                return 0                             # told to stop while joining
            log.warning("tp group join failed; waiting for a newer rendezvous", addr=addr,
                        port=port, error=str(e).splitlines()[0])
            refused.add(written)
    else:
        return 0
    _share_cores(layout)
    mine = _rank_layout(layout, rank)
    runner = await asyncio.to_thread(on_device, mine.args.device, build_runner, mine, group,
                                     False)
    runner.grammars.warm()
    on_runner(runner)
    log.info("tp follower ready", rank=rank)
    await asyncio.to_thread(run_follower, runner, group)     # binds its device itself
    log.info("tp group ended by rank 0", rank=rank)
    return 0
