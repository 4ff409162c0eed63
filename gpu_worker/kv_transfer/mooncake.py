"""The KV connector over the Mooncake transfer engine (`mooncake-transfer-engine-non-cuda` on
CPU over TCP; the CUDA build with `--kv-protocol rdma` on GPU clusters, untested here).

Peers find each other without a metadata server (P2PHANDSHAKE): a rank's session is
`host:rpc_port` of its engine, published in its heartbeat with the pool's address.

A write is one single-task batch per segment (`transfer_submit_write`), each checked with
`transfer_check_status`: that call reports a batch's first task only, so a batch of several
segments reads "completed" while the others are still on the wire (measured: a 64 MiB batch of
1 MiB segments reported done ~140 ms before its last byte landed). Over TCP, completed means
written into the peer's memory (the engine's acknowledged framing).
"""
from __future__ import annotations

import ipaddress
import os
import re
import socket
from dataclasses import dataclass
from importlib import metadata

import structlog

from gpu_worker.kv_transfer.connector import KVConnector, pool_descriptor
from shared.errors import PacerError

log = structlog.get_logger("worker.kv")

INSTALL_HINT = ("pip install mooncake-transfer-engine-non-cuda (CPU, TCP; the CUDA build is "
                "mooncake-transfer-engine) and apt-get install libibverbs1 libnuma1 libcurl4")
# Before 0.3.12 the engine's TCP transport wrote a frame's bytes wherever its header pointed,
# inside the registered pool or not (anything that reached its port could write into any of
# the process's memory), and "completed" meant handed to the kernel, not written at the peer
MIN_VERSION = (0, 3, 12)
DISTRIBUTIONS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")


# The engine's TCP transport queues at most this many 64 KiB slices per peer and fails the rest
# of a write outright ("TCP lane queue-full"); a prompt's K/V is hundreds of slices, several
# prompts' go in one iteration. The engine's own ceiling, instead of its default 1024.
QUEUED_SLICES_PER_PEER = "65535"


@dataclass
class _Write:
    batch_ids: list[int]            # one per segment; 0: that one was not submitted
    # how many of batch_ids (from the front) are settled, never asked about again: the engine
    # frees a batch once it reported it
    left: int = 0
    failed: bool = False            # one of those failed


def check_engine_version() -> None:
    """Refuse a Mooncake older than MIN_VERSION (one whose version is unknown is let be)."""
    for name in DISTRIBUTIONS:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        numbers = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
        if numbers and tuple(map(int, numbers.groups())) < MIN_VERSION:
            raise PacerError(f"--kv-connector mooncake needs {name} 0.3.12 or later (earlier "
                             f"ones write a peer's frame wherever it points), found {version}: "
                             f"pip install -U {name}")


def check_kv_host(host: str) -> None:
    """Refuse a --kv-host peers could not dial: the session they dial is this host, a colon and
    the engine's port, so a host with a port of its own, a space or a name that does not
    resolve made every transfer into this worker fail (each request recomputed) instead of an
    error at start."""
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    if not host or ":" in host or any(c.isspace() for c in host):
        raise PacerError(f"--kv-host must be a host name or an IP address without a port "
                         f"(the engine picks its own ports), got {host!r}")
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as e:
        raise PacerError(f"--kv-host {host!r} does not resolve to an address ({e})") from None


class MooncakeConnector(KVConnector):
    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "",
                 tp: int = 1, rank: int = 0) -> None:
        super().__init__()
        # the engine logs through glog, which reads its level when the library loads: keep
        # its per-connection INFO lines out of the service's log unless asked for
        os.environ.setdefault("GLOG_minloglevel", "1")
        os.environ.setdefault("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", QUEUED_SLICES_PER_PEER)
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise PacerError(f"--kv-connector mooncake needs the Mooncake transfer engine "
                             f"({e}): {INSTALL_HINT}") from e
        check_engine_version()
        check_kv_host(host)
        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise PacerError(f"the Mooncake transfer engine did not start on {host} over "
                             f"{protocol} (rc {rc}); check --kv-host and --kv-protocol")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        # the engine binds its handshake and data ports to every interface (it takes no
        # address to bind to), and writes or reads whatever a connection asks of the pool
        log.warning("the KV transfer engine listens on every interface whatever --kv-host, "
                    "and any peer that reaches it may read and write this KV pool: let only "
                    "the P/D hosts reach its ports", session=self.session)
        self.tp, self.rank = tp, rank
        self._pool = None

    def register(self, pool, model: dict | None = None) -> None:
        if not pool.is_contiguous():
            raise ValueError("the KV pool must be one contiguous tensor")
        nbytes = pool.numel() * pool.element_size()
        rc = self.engine.register_memory(pool.data_ptr(), nbytes)
        if rc != 0:
            raise PacerError(f"Mooncake could not register the KV pool ({nbytes} bytes, rc {rc})")
        self._pool, self._model = pool, model

    def descriptor(self) -> dict:
        return pool_descriptor("mooncake", self.session, self._pool, self.tp, self.rank,
                               self._model)

    def _submit(self, peer: dict, segments: list[tuple[int, int, int]]) -> _Write:
        # (writes given up at their deadline are polled until they settle, connector.py: the
        # engine frees a batch only once it reported it)
        base, peer_base, session = self._pool.data_ptr(), peer["base"], peer["session"]
        submit = self.engine.transfer_submit_write
        return _Write([submit(session, base + s, peer_base + d, n) for s, d, n in segments])

    def _poll(self, handle: _Write) -> bool | None:
        """Done when every segment is; failed once every segment settled and one failed (the
        others may still land: the decode side recomputes into those blocks only after)."""
        check = self.engine.transfer_check_status
        while handle.left < len(handle.batch_ids):
            # 1 completed, 0 in flight, -1 failed, -2 the engine's own timeout (with
            # MC_SLICE_TIMEOUT set; its pieces may still land: not settled); a batch id of 0:
            # not submitted (the peer could not be reached)
            batch = handle.batch_ids[handle.left]
            status = check(batch) if batch else -1
            if status in (0, -2):
                return None
            handle.left += 1
            handle.failed |= status != 1
        return not handle.failed

    def close(self) -> None:
        if self._pool is not None:
            self.engine.unregister_memory(self._pool.data_ptr())
            self._pool = None
