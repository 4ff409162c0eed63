"""P/D disaggregation's KV transfer (docs/architecture.md#kv-transfer): a prefill rank writes
the K/V of a request's blocks into the blocks a decode rank reserved, layer by layer, through a
KV connector (`connector.py`; Mooncake's in `mooncake.py`); `sender.py` turns an iteration's
KVSends into per-layer writes."""
from __future__ import annotations

from gpu_worker.kv_transfer.connector import FAULT_ENV, KVConnector
from gpu_worker.kv_transfer.sender import LayerSender, coalesce
from shared.errors import PacerError

CONNECTORS = ("none", "mooncake")


def make_connector(name: str, host: str = "127.0.0.1", protocol: str = "tcp",
                   device_name: str = "", tp: int = 1, rank: int = 0) -> KVConnector | None:
    """The connector `--kv-connector` names, started (None for "none"). Mooncake is imported
    only here, only when asked for."""
    if name == "none":
        return None
    if name == "mooncake":
        from gpu_worker.kv_transfer.mooncake import MooncakeConnector
        return MooncakeConnector(host, protocol, device_name, tp, rank)
    raise PacerError(f"--kv-connector must be one of {', '.join(CONNECTORS)}, got {name!r}")


__all__ = ["CONNECTORS", "FAULT_ENV", "KVConnector", "LayerSender", "coalesce", "make_connector"]
