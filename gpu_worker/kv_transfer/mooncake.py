"""The KV connector over the Mooncake transfer engine (`mooncake-transfer-engine-non-cuda` on
CPU over TCP; the CUDA build with `--kv-protocol rdma` on GPU clusters, untested here).

Peers find each other without a metadata server (P2PHANDSHAKE): a rank's session is
`host:rpc_port` of its engine, published in its heartbeat with the pool's address. A write is
one `batch_transfer_async_write` of all its segments; `transfer_check_status` reports it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from gpu_worker.kv_transfer.connector import KVConnector, pool_descriptor
from shared.errors import PacerError

INSTALL_HINT = ("pip install mooncake-transfer-engine-non-cuda (CPU, TCP; the CUDA build is "
                "mooncake-transfer-engine) and apt-get install libibverbs1 libnuma1 libcurl4")


@dataclass
class _Write:
    batch_id: int
    result: bool | None = None      # memoized: the engine frees a batch once it reported it


class MooncakeConnector(KVConnector):
    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "",
                 tp: int = 1, rank: int = 0) -> None:
        super().__init__()
        # the engine logs through glog, which reads its level when the library loads: keep
        # its per-connection INFO lines out of the service's log unless asked for
        os.environ.setdefault("GLOG_minloglevel", "1")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise PacerError(f"--kv-connector mooncake needs the Mooncake transfer engine "
                             f"({e}): {INSTALL_HINT}") from e
        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise PacerError(f"the Mooncake transfer engine did not start on {host} over "
                             f"{protocol} (rc {rc}); check --kv-host and --kv-protocol")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.tp, self.rank = tp, rank
        self._pool = None

    def register(self, pool) -> None:
        if not pool.is_contiguous():
            raise ValueError("the KV pool must be one contiguous tensor")
        nbytes = pool.numel() * pool.element_size()
        rc = self.engine.register_memory(pool.data_ptr(), nbytes)
        if rc != 0:
            raise PacerError(f"Mooncake could not register the KV pool ({nbytes} bytes, rc {rc})")
        self._pool = pool

    def descriptor(self) -> dict:
        return pool_descriptor("mooncake", self.session, self._pool, self.tp, self.rank)

    def _submit(self, peer: dict, segments: list[tuple[int, int, int]]) -> _Write:
        base, peer_base = self._pool.data_ptr(), peer["base"]
        batch = self.engine.batch_transfer_async_write(
            peer["session"], [base + s for s, _, _ in segments],
            [peer_base + d for _, d, _ in segments], [n for _, _, n in segments])
        # 0: the peer could not be reached (or the batch not submitted)
        return _Write(batch, None if batch else False)

    def _poll(self, handle: _Write) -> bool | None:
        if handle.result is None:
            status = self.engine.transfer_check_status(handle.batch_id)
            # 1 completed, 0 in flight, -1 failed, -2 the engine's own timeout
            handle.result = True if status == 1 else None if status == 0 else False
        return handle.result

    def close(self) -> None:
        if self._pool is not None:
            self.engine.unregister_memory(self._pool.data_ptr())
            self._pool = None
