"""Fabrics between a prefill instance and a decode instance, and the link that carries a
request's KV cache over one (docs/design.md#pd-disaggregation-pricing-the-hop).

A fabric is one number here: the bandwidth a transfer gets, in GB/s (10**9 bytes per second).
The built-in ones are the round figures of the usual worked example of P/D disaggregation, not
measurements: NVLink inside a node, an NVLink-network / NVSwitch fabric across a cluster,
InfiniBand HDR between nodes, and PCIe Gen5 when the bytes are staged through host memory.
Real links vary (one HDR port is 200 Gb/s, 25 GB/s a direction); `--fabric 25` names any other.

`KVLink` is one sender's link as the simulator uses it: pieces of KV leave in the order they
are handed in, each no earlier than it is ready, one at a time at the fabric's bandwidth.

Stdlib only: the cost model and the simulator import it.
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.errors import PacerError


@dataclass(frozen=True)
class Fabric:
    name: str
    gb_per_s: float          # the bandwidth one transfer gets, 10**9 B/s
    what: str = ""

    @property
    def bytes_per_ms(self) -> float:
        return self.gb_per_s * 1e6

    def transfer_ms(self, nbytes: float) -> float:
        """Milliseconds to move `nbytes` over this fabric, alone on it."""
        return nbytes / self.bytes_per_ms


FABRICS: dict[str, Fabric] = {f.name: f for f in (
    Fabric("nvlink", 900.0, "NVLink, within a node"),
    Fabric("nvswitch", 400.0, "NVLink network / NVSwitch fabric, within a cluster"),
    Fabric("ib-hdr", 50.0, "InfiniBand HDR, between nodes"),
    Fabric("pcie5", 64.0, "PCIe Gen5, staged through host memory"),
)}


# The bandwidths a fabric given as a number may have: a megabyte a second to a petabyte a
# second. Past them lies a typo: 0 or below was "unknown fabric", 1e-300 a ZeroDivisionError
# traceback in the simulator and a transfer of 1e303 ms in `pacer cost`.
FABRIC_GB_PER_S = (1e-3, 1e6)
FABRIC_RANGE_TEXT = "from {:g} to {:g} GB/s".format(*FABRIC_GB_PER_S).replace("e+0", "e")


def load_fabric(spec: str, flag: str = "--fabric") -> Fabric:
    """A built-in name (see FABRICS) or a bandwidth in GB/s; anything else a PacerError that
    names `flag`."""
    key = str(spec).strip().lower()
    if key in FABRICS:
        return FABRICS[key]
    try:
        gb_per_s = float(key.removesuffix("gb/s"))
    except ValueError:
        raise PacerError(f"{flag} {spec!r}: unknown fabric: use one of {', '.join(FABRICS)} "
                         "or a bandwidth in GB/s, e.g. 25") from None
    low, high = FABRIC_GB_PER_S
    if not low <= gb_per_s <= high:         # NaN fails it too
        raise PacerError(f"{flag} {spec!r}: a fabric's bandwidth must be {FABRIC_RANGE_TEXT}")
    return Fabric(f"{gb_per_s:g} GB/s", gb_per_s, "given as a bandwidth")


class KVLink:
    """One sender's link: a FIFO of KV pieces, sent one after another at the fabric's rate.

    `send(ready_s, nbytes)` queues a piece that cannot leave before `ready_s` and returns when
    its last byte arrives (seconds, on the caller's clock). Pieces must be handed in the order
    they are to be sent; a piece ready early still waits for the ones before it."""

    def __init__(self, fabric: Fabric, links: int = 1) -> None:
        """`links`: an instance of that many TP ranks, each of which holds its heads' share of
        every piece and sends it over a link of its own (each GPU its own NIC), side by side:
        a piece takes 1/links of its time alone on one link."""
        self.fabric, self.links = fabric, links
        self.free_at_s = 0.0          # when the last piece handed in will have arrived
        self.bytes_sent = 0.0

    def send(self, ready_s: float, nbytes: float) -> float:
        start = self.free_at_s if self.free_at_s > ready_s else ready_s
        self.free_at_s = start + self.fabric.transfer_ms(nbytes / self.links) / 1e3
        self.bytes_sent += nbytes
        return self.free_at_s

    def send_layers(self, start_s: float, end_s: float, num_layers: int,
                    chunk_bytes: list[float]) -> list[float]:
        """Layer streaming through one forward running from `start_s` to `end_s`: layer i's
        K/V of every chunk are ready when layer i is done, i/num_layers of the way through,
        and leave layer by layer. Returns when each chunk's last layer has arrived."""
        done = [start_s] * len(chunk_bytes)
        step = (end_s - start_s) / num_layers
        for layer in range(1, num_layers + 1):
            ready = start_s + layer * step
            for index, nbytes in enumerate(chunk_bytes):
                done[index] = self.send(ready, nbytes / num_layers)
        return done
