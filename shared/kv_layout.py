"""The KV connector descriptor a worker rank publishes in its heartbeat (extra["kv"]), and the
check that a prefill rank's pool and a decode rank's pool have the same layout.

A descriptor (gpu_worker/kv_transfer builds it):

    {"engine": "mooncake", "session": "10.0.0.5:15123", "host": <the machine's name>,
     "base": <address of the pool>,
     "num_layers": L, "num_blocks": N, "block_bytes": <one block of K (or V) of one layer>,
     "dtype": "bfloat16", "tp": tp, "rank": r, "model": "smollm2-135m",
     "weights": <the model's weights fingerprint, shared/model_source.py>,
     "weights_dtype": "bfloat16", "quantization": "int8"}

Block (l, kv, b) of that pool starts at base + ((l·2 + kv)·N + b)·block_bytes. Two pools of
one shape may hold two models' K/V: the weights fingerprint must agree too (the model's name
is only for messages: the same files may be served under another), and so must the weights'
precision (--dtype, --quantization): the same files computed under other rounding give other
K/V, which the decode side's model would not have computed. Pure Python:
the scheduler can run the same check on two instances' heartbeats before pairing them.
"""
from __future__ import annotations

from shared.errors import PacerError
from shared.hosts import loopback_elsewhere

# the received-K/V check (docs/design.md#kv-integrity): one sampled 4-byte word per this many
# bytes of each (layer, K|V, block), plus its last word; each sample reads a cache line, so
# a digest reads ~64/1024 of the K/V it covers (what the simulator prices)
DIGEST_STRIDE_BYTES = 1024
DIGEST_READ_SHARE = 64 / DIGEST_STRIDE_BYTES

# what both sides of a transfer must agree on (num_blocks may differ: each side's own pool)
LAYOUT_FIELDS = ("engine", "num_layers", "block_bytes", "dtype", "tp", "weights_dtype",
                 "quantization")


class KVLayoutError(PacerError):
    """Two instances whose KV pools cannot exchange blocks."""


def check_peer_layout(own: dict, peer: dict) -> None:
    """Raise KVLayoutError unless `peer`'s pool can take blocks of `own`'s, rank r to rank r:
    `own`'s machine dials `peer`'s session (a loopback one of another machine, a worker
    started without --kv-host, it could not)."""
    check_addressing(peer)
    if why := loopback_elsewhere(peer["session"].rpartition(":")[0], peer.get("host"),
                                 own.get("host"), f"the peer's KV pool (rank {peer.get('rank')})",
                                 "--kv-host"):
        raise KVLayoutError(why)
    if own.get("tp") != peer.get("tp"):
        raise KVLayoutError(
            f"KV transfer between unequal tensor-parallel degrees: this instance has TP "
            f"{own.get('tp')}, the peer (session {peer.get('session')}) TP {peer.get('tp')}; "
            "run both pools with the same --tp (heads are not re-sliced)")
    if own.get("rank") != peer.get("rank"):
        raise KVLayoutError(f"KV transfer from rank {own.get('rank')} to the peer's rank "
                            f"{peer.get('rank')}: ranks map one to one")
    if why := other_model(own, peer):
        raise KVLayoutError(why)
    differ = [f"{k} {own.get(k)!r} vs {peer.get(k)!r}" for k in LAYOUT_FIELDS
              if own.get(k) != peer.get(k)]
    if differ:
        raise KVLayoutError(f"the peer's KV pool (session {peer.get('session')}) has another "
                            f"layout: {', '.join(differ)} (this instance vs the peer)")


def _is_count(value, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < high


def check_addressing(peer) -> None:
    """Raise KVLayoutError unless `peer` (a descriptor read from Redis) says where to write:
    a session "host:port", the pool's address and its number of blocks. A worker of another
    version, or anything else that wrote the heartbeat, may publish one that does not; the
    writes would fail inside the forward, and with them every request of the iteration."""
    if not isinstance(peer, dict):
        raise KVLayoutError(f"the peer's KV descriptor is not a mapping: {peer!r:.80}")
    session, base, blocks = peer.get("session"), peer.get("base"), peer.get("num_blocks")
    host, _, port = session.rpartition(":") if isinstance(session, str) else ("", "", "")
    bad = [f"{name} {value!r:.80}" for name, value, ok in (
        ("session", session, bool(host.strip()) and port.isdigit() and 0 < int(port) < 65536),
        ("base", base, _is_count(base, 0, 2 ** 64)),
        ("num_blocks", blocks, _is_count(blocks, 1, 2 ** 63))) if not ok]
    if bad:
        raise KVLayoutError(f"the peer's KV descriptor is malformed: {', '.join(bad)} (want a "
                            "session 'host:port', the pool's address and its block count)")


def other_model(own: dict, peer: dict) -> str:
    """Why `peer`'s pool holds another model's K/V than `own`'s ("" if the same weights):
    the K/V of one model mean nothing to another, whatever the shapes."""
    if own.get("weights") == peer.get("weights"):
        return ""
    return (f"the peer (session {peer.get('session')}) serves another model: "
            f"{peer.get('model')!r} with weights {peer.get('weights')!r}, this instance "
            f"{own.get('model')!r} with weights {own.get('weights')!r}; serve the same model "
            "on both")
