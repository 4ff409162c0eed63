"""A replica publishes its prefix cache for the gateway's router
(docs/design.md#cache-aware-routing): the core's index changes (`BlockManager.take_events`)
become commands on the instance's `cached_blocks` set, queued into the intake pipeline so
they cost no round trip of their own. `redis-cli SCARD pacer:inst:r0:cached_blocks` is the
number of blocks replica r0 holds cached.

The set is a hint for routing, never trusted for K/V: a stale member costs a request a
miss, not a wrong token (the scheduler itself only ever trusts its own index)."""
from __future__ import annotations


def queue_block_events(pipe, key: str, events: list[tuple[str, bytes]]) -> None:
    """SADD / SREM runs of consecutive stored / removed hashes, in order; a "cleared" event
    DELs the set (the core's index emptied)."""
    run_kind, run = "", []

    def flush() -> None:
        if run:
            (pipe.sadd if run_kind == "stored" else pipe.srem)(key, *run)
            run.clear()

    for kind, h in events:
        if kind == "cleared":
            flush()
            pipe.delete(key)
            continue
        if kind != run_kind:
            flush()
            run_kind = kind
        run.append(h)
    flush()
