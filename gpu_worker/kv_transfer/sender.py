"""One iteration's KV sends (IterationPlan.kv_sends), layer by layer.

The runner builds a LayerSender before the forward (a send whose peer has another layout, or
whose blocks do not pair up, is refused there: that request's transfer fails, as one that
times out does, and the iteration goes on), the model calls `after_layer(l)` once layer l's K/V are in
the pool, and the runner calls `finish()` before it returns the iteration's result: layer l's
writes leave while layers l+1.. compute (layer streaming, docs/architecture.md#kv-transfer).

Runs of consecutive source blocks going to consecutive destination blocks travel as one
segment: per layer, a request's write is 2 x (number of runs) segments, one write.
"""
from __future__ import annotations

import time

import structlog
import torch

from gpu_worker.kv_cache import block_digests, block_offset
from gpu_worker.kv_transfer.connector import KVConnector
from shared.kv_layout import KVLayoutError, check_peer_layout
from shared.plan import KVSend

log = structlog.get_logger("worker.kv")


def coalesce(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, count) runs of blocks consecutive on both sides."""
    if len(src) != len(dst):
        raise KVLayoutError(f"a KV send pairs {len(src)} source blocks with {len(dst)} "
                            "destination blocks")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class _Send:
    def __init__(self, send: KVSend, own: dict, rank: int):
        if rank >= len(send.peers):
            raise KVLayoutError(f"KV send of {send.request_id} to {send.peer}: the peer "
                                f"published {len(send.peers)} ranks, this is rank {rank}")
        self.request_id, self.peer = send.request_id, send.peers[rank]
        check_peer_layout(own, self.peer)
        for ids, n, side in ((send.src_block_ids, own["num_blocks"], "source"),
                             (send.dst_block_ids, self.peer["num_blocks"], "destination")):
            if any(not 0 <= b < n for b in ids):
                raise KVLayoutError(f"KV send of {send.request_id}: a {side} block outside "
                                    f"the pool's {n}")
        self.src_block_ids = send.src_block_ids
        self.runs = coalesce(send.src_block_ids, send.dst_block_ids)
        self.handles: list = []
        self.done_at: list[float] = []    # when handles[i] was seen complete (in order)
        self.nbytes = 0


class LayerSender:
    def __init__(self, connector: KVConnector, sends: list[KVSend], rank: int,
                 timeout_s: float, pool: torch.Tensor):
        own = connector.descriptor()
        self.connector, self.timeout_s, self.pool = connector, timeout_s, pool
        self.sends: list[_Send] = []
        self.refused: list[str] = []        # their requests' transfers fail, nothing else
        for send in sends:
            try:
                self.sends.append(_Send(send, own, rank))
            except KVLayoutError as e:
                log.error("KV send refused; its request goes on without it",
                          request_id=send.request_id, error=str(e))
                self.refused.append(send.request_id)
        # until finish(), these requests' writes may land in these peers (the worker heartbeat)
        connector.writing(self, {s.request_id: s.peer["session"] for s in self.sends})
        self.num_layers, self.num_blocks = own["num_layers"], own["num_blocks"]
        self.block_bytes = own["block_bytes"]
        self._next_layer = 0
        self._first_submit: float | None = None

    def after_layer(self, layer: int) -> None:
        """Layer `layer`'s K/V are in the pool: start their writes (and earlier layers', if
        any were skipped)."""
        if self.pool.is_cuda:        # the layer's kernels must have written the pool
            torch.cuda.current_stream(self.pool.device).synchronize()
        while self._next_layer <= layer:
            self._submit(self._next_layer)
            self._next_layer += 1
        self._poll()

    def finish(self) -> tuple[list[str], dict[str, list[int]], dict]:
        """Send what is left, wait for every write (at most timeout_s); the requests whose
        sends failed or timed out, the digests of the blocks the others sent (the decode
        side checks them, docs/design.md#kv-integrity), and this iteration's figures."""
        start = time.perf_counter()     # what follows is exposed: the iteration waits
        if self._next_layer < self.num_layers:
            self.after_layer(self.num_layers - 1)
        failed = list(self.refused)
        for s in self.sends:
            left = self.timeout_s - (time.perf_counter() - start)
            if not all(self.connector.wait(s.handles, max(left, 0.0), tag=s.request_id,
                                           peer=s.peer["session"])):
                failed.append(s.request_id)
        self.connector.writing(self, None)     # what is left of them is `unsettled` now
        end = time.perf_counter()
        self._poll(end)
        last = end if failed else max((t for s in self.sends for t in s.done_at), default=end)
        digests = {s.request_id: block_digests(self.pool, s.src_block_ids)
                   for s in self.sends if s.request_id not in failed}
        return failed, digests, {"bytes": sum(s.nbytes for s in self.sends),
                        "send_ms": round((last - self._first_submit) * 1e3, 3),
                        "exposed_ms": round((end - start) * 1e3, 3),
                        "requests": len(self.sends)}

    def _submit(self, layer: int) -> None:
        if self._first_submit is None:
            self._first_submit = time.perf_counter()
        n, bb = self.num_blocks, self.block_bytes
        for s in self.sends:
            if not s.runs:          # nothing to send: no write
                continue
            peer_n = s.peer["num_blocks"]
            segments = [(block_offset(layer, kv, src, n, bb), block_offset(layer, kv, dst, peer_n, bb),
                         count * bb) for src, dst, count in s.runs for kv in (0, 1)]
            s.handles.append(self.connector.write(s.peer, segments))
            s.nbytes += sum(length for _, _, length in segments)

    def _poll(self, now: float | None = None) -> None:
        """Note when each write was first seen complete (for send_ms)."""
        for s in self.sends:
            for i in range(len(s.done_at), len(s.handles)):
                if self.connector.poll(s.handles[i]) is None:
                    break
                s.done_at.append(now or time.perf_counter())
