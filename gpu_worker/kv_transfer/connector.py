"""The KV connector interface: what moves K/V blocks from this rank's pool into a peer's.

    conn.register(pool, model)               # the pool tensor, once (one registration)
    conn.descriptor() -> dict                # published in the worker heartbeat (shared/kv_layout.py)
    h = conn.write(peer_descriptor, [(src_offset, dst_offset, length), ...])   # asynchronous
    conn.wait([h, ...], timeout_s) -> [ok, ...]
    conn.close()

Offsets are bytes into the two pools (this rank's, the peer's). An implementation provides
`register`, `descriptor`, `_submit`, `_poll` and `close`; the Mooncake transfer engine's is
`mooncake.py`, and NIXL or torch.distributed could stand in behind the same five calls.

A write still in flight at its deadline is given up on, not forgotten: the connector polls it
until it settles, and `unsettled()` names the requests (the `tag` given to `wait`) whose
writes may still land, with those an iteration is writing now. A worker publishes them in its heartbeat, and the decode side keeps the
blocks they target from every other request until they are gone (docs/failure-modes.md).

A worker fences its connector by its rank's claim (`fence`): a write is refused, failing at
once as a write that could not be submitted, once no heartbeat has found the claim the
process's own for the claim's TTL (`Claim.may_have_lapsed`, one clock read per write). A
process stopped (SIGSTOP) or cut off from Redis that long may have been replaced: its
successor's decode peers may have given the blocks it wrote into to other requests.

Test hooks (docs/failure-modes.md): PACER_KV_FAULT=hang makes every write a send that never
completes, so the timeout path runs; PACER_KV_FAULT=drop makes every write report success
without moving a byte (a transport that lies), so the decode side's check must catch it;
PACER_KV_FAULT=late makes every write start PACER_KV_LATE_S (3) seconds after it was asked
for, at the first poll past then: given up on at a shorter deadline, it lands later.
"""
from __future__ import annotations

import os
import threading
import time
from abc import ABC, abstractmethod

import structlog

from gpu_worker.kv_cache import block_bytes
from shared.hosts import this_host
from shared.lifecycle import Claim

log = structlog.get_logger("worker.kv")

FAULT_ENV = "PACER_KV_FAULT"
LATE_ENV = "PACER_KV_LATE_S"
_HANG = object()          # the handle of a write the fault hook swallowed: never completes
_DROP = object()          # ... or reports done
_LATE = object()          # ... or starts late
_REFUSED = object()       # the handle of a write refused (`fence`): failed
FAULTS = {"": None, "hang": _HANG, "drop": _DROP, "late": _LATE}


class _LateWrite:
    """PACER_KV_FAULT=late: a write submitted for real only once `due` has passed."""
    def __init__(self, peer: dict, segments: list, due: float) -> None:
        self.peer, self.segments, self.due = peer, segments, due
        self.handle = None


class KVConnector(ABC):
    def __init__(self) -> None:
        fault = os.environ.get(FAULT_ENV, "")
        if fault not in FAULTS:
            raise ValueError(f"{FAULT_ENV} must be 'hang', 'drop', 'late' or unset, "
                             f"got {fault!r}")
        self._fault = FAULTS[fault]
        self._late_s = float(os.environ.get(LATE_ENV, "3"))
        # writes given up at their deadline, by (tag, the peer's session): their handles,
        # polled until they settle (the forward thread at each write, the heartbeat at each
        # beat); and the writes an iteration runs while it runs, by its key: request -> the
        # peer's session
        self._abandoned: dict[tuple[str, str], list] = {}
        self._writing: dict[object, dict[str, str]] = {}
        self._abandoned_lock = threading.Lock()
        # one thread at a time checks a handle: the engine frees a batch once it reported it
        # (Mooncake's check releases the GIL), so two threads checking one would free it twice
        self._poll_lock = threading.Lock()
        self._claim: Claim | None = None
        self._refusing = False      # the last write was refused (logged once a run of them)

    @abstractmethod
    def register(self, pool, model: dict | None = None) -> None:
        """Make the pool tensor (contiguous) readable and writable by peers; `model`: the
        name, weights fingerprint and weights' precision of the model whose K/V it holds
        ({"model", "weights", "weights_dtype", "quantization"}), for the descriptor (a peer of
        another model, or of the same one in another precision, must not take its blocks)."""

    @abstractmethod
    def descriptor(self) -> dict:
        """What a peer needs to write into the registered pool (shared/kv_layout.py)."""

    def fence(self, claim: Claim) -> None:
        """Write only while `claim`, this process's, cannot have lapsed (`write`)."""
        self._claim = claim

    def write(self, peer: dict, segments: list[tuple[int, int, int]]):
        """Start copying each (src_offset, dst_offset, length) from the own pool into the
        peer's; returns a handle for `poll`/`wait`. Fenced (`fence`), a write while the
        claim may have lapsed is not started, and its handle reads failed."""
        if self._abandoned:
            self.unsettled()            # their handles are freed as they settle
        if self._claim is not None and self._claim.may_have_lapsed:
            if not self._refusing:
                log.warning("K/V writes refused: no heartbeat found this process's claim its "
                            f"own for {self._claim.ttl_s:g} s (stopped, or cut off from "
                            "Redis), and another process may hold it now",
                            claim=self._claim.key)
            self._refusing = True
            return _REFUSED
        self._refusing = False
        if self._fault is _LATE:
            return _LateWrite(peer, segments, time.monotonic() + self._late_s)
        if self._fault is not None:
            return self._fault
        return self._submit(peer, segments)

    def poll(self, handle) -> bool | None:
        """True: done; False: failed; None: still in flight. Never blocks for long (another
        thread's check of a handle at most)."""
        with self._poll_lock:
            return self._poll_one(handle)

    def _poll_one(self, handle) -> bool | None:
        if handle is _HANG:
            return None
        if handle is _DROP:
            return True
        if handle is _REFUSED:
            return False
        if isinstance(handle, _LateWrite):
            if handle.handle is None:
                if time.monotonic() < handle.due:
                    return None
                handle.handle = self._submit(handle.peer, handle.segments)
            return self._poll(handle.handle)
        return self._poll(handle)

    def unsettled(self) -> dict[str, list[str]]:
        """tag -> the sessions of the peers of the writes that may still land: an iteration's
        running, or given up at their deadline and not settled (polled now). A running one is
        named too: the decode side may let go of its blocks before the iteration ends (its
        request aborted, Redis lost)."""
        with self._abandoned_lock:
            for key, handles in list(self._abandoned.items()):
                handles[:] = [h for h in handles if self.poll(h) is None]
                if not handles:
                    del self._abandoned[key]
            pairs = set(self._abandoned).union(
                *(writes.items() for writes in self._writing.values()))
            out: dict[str, list[str]] = {}
            for tag, peer in sorted(pairs):
                out.setdefault(tag, []).append(peer)
            return out

    def writing(self, key: object, writes: dict[str, str] | None) -> None:
        """The writes an iteration (`key`) runs from now, request -> the peer's session, or
        (None) no more."""
        with self._abandoned_lock:
            if writes:
                self._writing[key] = dict(writes)
            else:
                self._writing.pop(key, None)

    def peers_written(self) -> list[str]:
        """The sessions of the peers a write may still land in: running, or given up on and
        not settled when `unsettled` last polled."""
        with self._abandoned_lock:
            return sorted({peer for _, peer in self._abandoned}.union(
                *(writes.values() for writes in self._writing.values())))

    def wait(self, handles: list, timeout_s: float, tag: str = "",
             peer: str = "") -> list[bool]:
        """Wait until every write finished or `timeout_s` passed; ok flags in order (a write
        still in flight at the deadline is not ok, and is kept under `tag`, to the session
        `peer`, until it settles: `unsettled`)."""
        deadline = time.perf_counter() + timeout_s
        done: list[bool | None] = [None] * len(handles)
        pause = 20e-6
        while True:
            for i, h in enumerate(handles):
                if done[i] is None:
                    done[i] = self.poll(h)
            if all(d is not None for d in done) or time.perf_counter() >= deadline:
                late = [h for h, d in zip(handles, done) if d is None]
                if late:
                    with self._abandoned_lock:
                        self._abandoned.setdefault((tag, peer), []).extend(late)
                return [bool(d) for d in done]
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    @abstractmethod
    def _submit(self, peer: dict, segments: list[tuple[int, int, int]]): ...

    @abstractmethod
    def _poll(self, handle) -> bool | None: ...

    @abstractmethod
    def close(self) -> None:
        """Unregister the pool and stop the engine (idempotent)."""


def pool_descriptor(engine: str, session: str, pool, tp: int, rank: int,
                    model: dict | None = None) -> dict:
    """The descriptor of a registered pool [L, 2, N, block_size, KVH, hd] holding `model`'s
    K/V (`register`), on this machine (a peer on another refuses a loopback session)."""
    return {"engine": engine, "session": session, "host": this_host(), "base": pool.data_ptr(),
            "num_layers": pool.shape[0], "num_blocks": pool.shape[2],
            "block_bytes": block_bytes(pool), "dtype": str(pool.dtype).removeprefix("torch."),
            "tp": tp, "rank": rank, **(model or {})}
