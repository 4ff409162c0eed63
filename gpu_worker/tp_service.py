"""Served tensor parallelism: the ranks of one worker group meet through Redis, then talk
only over torch.distributed.

Rank 0 picks a free port, writes `{addr, port, time}` to the rendezvous key, hosts the group
and serves plans through a TPExecutor (it broadcasts each plan to the followers, all ranks
run it, all must sample the same tokens). Ranks > 0 read the newest rendezvous, join, and
follow until rank 0 shuts the group down; a rank that dies takes the group down within
seconds (the watchdog in `gpu_worker.distributed`) and `pacer up` restarts the whole group.
"""
from __future__ import annotations

import asyncio
import dataclasses
import socket
import time

import redis.asyncio as aioredis
import structlog
import torch

from gpu_worker.distributed import (TPExecutor, backend_for, device_for_rank, init_tp_group,
                                    run_follower, threads_per_rank)
from shared.errors import PacerError
from shared.keys import Keys

log = structlog.get_logger("worker")

# a rendezvous older than this when a follower starts was left by an earlier group
STALE_RENDEZVOUS_S = 10.0
FOLLOWER_JOIN_TIMEOUT_S = 60.0
# rank 0 listens right after it publishes: an address that refuses this long is a dead group
REFUSED_FOR_S = 5.0


def _rank_layout(layout, rank: int):
    """The layout with this rank's device (cuda:k+rank on GPU; CPU stays CPU)."""
    device = device_for_rank(layout.args.device, rank)
    return dataclasses.replace(layout, args=dataclasses.replace(layout.args, device=device))


def _share_cores(layout) -> None:
    threads = threads_per_rank(layout.args.device, layout.args.tp)
    if threads:
        torch.set_num_threads(threads)


async def start_rank0(redis: aioredis.Redis, keys: Keys, layout, host: str) -> TPExecutor:
    """Publish the rendezvous, host the group, load rank 0's shard, wait for the followers."""
    from gpu_worker.service import publish_rendezvous
    from services.engine import build_runner

    tp, device = layout.args.tp, layout.args.device
    addr, port = await publish_rendezvous(redis, keys, host)
    log.info("tp group rendezvous published", addr=addr, port=port, tp=tp)
    group = await asyncio.to_thread(init_tp_group, 0, tp, addr, port, backend_for(device),
                                    device=device_for_rank(device, 0))
    _share_cores(layout)
    runner = await asyncio.to_thread(build_runner, _rank_layout(layout, 0), group, True)
    return await asyncio.to_thread(TPExecutor, runner, group)


async def serve_follower(redis: aioredis.Redis, keys: Keys, layout, rank: int,
                         stop: asyncio.Event) -> int:
    """Join the newest group rank 0 announced and follow it until it ends."""
    from gpu_worker.service import read_rendezvous
    from services.engine import build_runner

    not_before = time.time() - STALE_RENDEZVOUS_S
    while not stop.is_set():
        found = await read_rendezvous(redis, keys, stop, not_before)
        if found is None:
            return 0
        addr, port, written = found
        if not await _listening(addr, port, stop):
            log.warning("tp rendezvous of a group that is gone; waiting for a newer one",
                        addr=addr, port=port)
            not_before = written + 1e-6
            continue
        try:
            group = await asyncio.to_thread(
                init_tp_group, rank, layout.args.tp, addr, port, backend_for(layout.args.device),
                join_timeout_s=FOLLOWER_JOIN_TIMEOUT_S,
                device=device_for_rank(layout.args.device, rank))
            break
        except (PacerError, RuntimeError) as e:      # a rendezvous of a group that is gone
            log.warning("tp group join failed; waiting for a newer rendezvous", addr=addr,
                        port=port, error=str(e).splitlines()[0])
            not_before = written + 1e-6
    else:
        return 0
    _share_cores(layout)
    runner = await asyncio.to_thread(build_runner, _rank_layout(layout, rank), group, False)
    log.info("tp follower ready", rank=rank)
    await asyncio.to_thread(run_follower, runner, group)
    log.info("tp group ended by rank 0", rank=rank)
    return 0


async def _listening(addr: str, port: int, stop: asyncio.Event) -> bool:
    """Whether rank 0's store accepts connections within REFUSED_FOR_S."""
    end = time.monotonic() + REFUSED_FOR_S
    while not stop.is_set() and time.monotonic() < end:
        try:
            await asyncio.to_thread(_connect, addr, port)
            return True
        except OSError:
            await asyncio.sleep(0.2)
    return False


def _connect(addr: str, port: int) -> None:
    socket.create_connection((addr, port), timeout=1.0).close()
