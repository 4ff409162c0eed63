"""Names the ranks of one tensor-parallel group share in its rendezvous store (torch's
TCPStore, hosted by rank 0)."""

JOINED, READY, DONE, SEED, CHECK_EVERY, SHUTDOWN, DOWN, DOWN_SEEN = (
    f"pacer/{k}" for k in ("joined", "ready", "done", "seed", "check_every", "shutdown", "down",
                           "down_seen"))


def heartbeat_counter(rank: int) -> str:
    """The counter rank `rank`'s watchdog bumps every HEARTBEAT_S."""
    return f"pacer/hb/{rank}"
