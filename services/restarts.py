"""What `pacer up` does when one of its children dies: restart it (a worker rank: the whole
worker group, since the ranks of a TP group only work together), first deleting the dead
process's heartbeat key so the scheduler and /health notice at once rather than after its TTL.

A service that keeps dying (MAX_RESTARTS within RESTART_WINDOW_S) is given up on: `pacer up`
then stops everything and exits non-zero, instead of looping forever on a broken setup.
"""
from __future__ import annotations

import sys
import time
from collections import deque

import redis
import structlog

from services.supervisor import Child, Supervisor, describe_exit, stop_children, wait_quietly

log = structlog.get_logger("restarts")

MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0


class Restarter:
    def __init__(self, sup: Supervisor, redis_url: str, heartbeat_keys: dict[str, str],
                 groups: dict[str, str]) -> None:
        """`heartbeat_keys`: child name -> its heartbeat key; `groups`: child name -> the
        group it restarts with (the ranks of one TP group)."""
        self.sup, self.redis_url = sup, redis_url
        self.heartbeat_keys, self.groups = heartbeat_keys, groups
        self._recent: dict[str, deque[float]] = {}

    def handle(self, child: Child, stopping) -> bool:
        """Restart `child` (and its group); False if it died too often to try again."""
        service = self.groups.get(child.name, child.name)
        recent = self._recent.setdefault(service, deque())
        now = time.monotonic()
        while recent and now - recent[0] > RESTART_WINDOW_S:
            recent.popleft()
        if len(recent) >= MAX_RESTARTS:
            print(f"pacer up: {service} died {len(recent) + 1} times within "
                  f"{RESTART_WINDOW_S:.0f} s; giving up", file=sys.stderr, flush=True)
            return False
        # back off a little more for each recent death: a crash loop must not spin
        wait_quietly(0.5 * len(recent), stopping)
        recent.append(time.monotonic())
        group = self._group(child)
        self._forget_heartbeats(group)
        stop_children(group, 5.0)            # a surviving rank waits for a peer that is gone
        for member in group:
            self.sup.restart(member)
        print(f"pacer up: {child.name} exited ({describe_exit(child.returncode)}); restarted "
              f"{', '.join(m.name for m in group)}", file=sys.stderr, flush=True)
        return True

    def _group(self, child: Child) -> list[Child]:
        group = self.groups.get(child.name)
        if group is None:
            return [child]
        return [c for c in self.sup.children if self.groups.get(c.name) == group]

    def _forget_heartbeats(self, group: list[Child]) -> None:
        keys = [self.heartbeat_keys[c.name] for c in group if c.name in self.heartbeat_keys]
        if not keys:
            return
        client = redis.Redis.from_url(self.redis_url, socket_timeout=1.0,
                                      socket_connect_timeout=1.0)
        try:
            client.delete(*keys)
        except (redis.RedisError, OSError) as e:
            log.warning("heartbeat keys not deleted", keys=keys, error=str(e))
        finally:
            client.close()
