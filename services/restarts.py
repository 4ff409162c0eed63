"""What `pacer up` does when one of its children dies: restart it (a worker rank: the whole
worker group, since the ranks of a TP group only work together), first deleting the group's
heartbeat keys so the scheduler and /health notice at once rather than after their TTL, and
again once the survivors are stopped (they beat until then).

A service that keeps dying (MAX_RESTARTS within RESTART_WINDOW_S), or that dies before it
comes up again (its first heartbeat) MAX_FAILED_STARTS restarts in a row, is given up on:
`pacer up` then stops everything and exits non-zero naming it, instead of looping forever on a
broken setup. The second rule holds whatever the pace: a worker whose model takes longer to
load than RESTART_WINDOW_S / MAX_RESTARTS never died that often within the window. A restart
that hangs before it comes up (its model on a mount that stopped answering, a device it waits
for) is killed once `--startup-timeout` has passed without its first heartbeat, as the first
start is given up on, and counts as such a death.

A service that stops without dying (SIGSTOP, a deadlock, a process the kernel never runs
again) would hold its requests forever: `Watchdog` finds a child whose heartbeat it has seen
and that has written none for `--watchdog-s` while its process lives, and kills it, so that
it is restarted as a death is (docs/failure-modes.md#a-service-that-hangs).
"""
from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable

import redis
import structlog

from scheduler_svc.workers import incarnation
from services.supervisor import Child, Supervisor, stop_children, wait_quietly
from shared.errors import PacerError
from shared.lifecycle import describe_exit
from shared.service_args import redis_password

log = structlog.get_logger("restarts")

MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
MAX_FAILED_STARTS = 3       # restarts in a row that died before their first heartbeat
COUNT_RETRY_S = 1.0         # how often restarts not yet counted in Redis are tried again
CHECK_STARTED_S = 1.0       # how often restarted processes are looked for among the heartbeats


HeartbeatKeys = dict[str, "str | Callable[[int], str]"]


def heartbeat_key(heartbeat_keys: HeartbeatKeys, child: Child) -> str | None:
    """`child`'s heartbeat key: child name -> the key, or the key of the process of a pid (a
    gateway's names its process: `--gateway-id ...{pid}`); None for a child without one."""
    key = heartbeat_keys.get(child.name)
    return key(child.pid) if callable(key) else key


class Restarter:
    def __init__(self, sup: Supervisor, redis_url: str, heartbeat_keys: HeartbeatKeys,
                 groups: dict[str, str], restarts_key: str | None = None,
                 startup_timeout_s: float | None = None) -> None:
        """`heartbeat_keys`: child name -> its heartbeat key; `groups`: child name -> the
        group it restarts with (the ranks of one TP group); `restarts_key`: a hash each
        restart is counted in, by service (the gateway's `pacer:service_restarts`);
        `startup_timeout_s`: how long a restarted process may take to write its first
        heartbeat before it is killed (None: as long as it takes)."""
        self.sup, self.redis_url = sup, redis_url
        self.heartbeat_keys, self.groups = heartbeat_keys, groups
        self.restarts_key, self.startup_timeout_s = restarts_key, startup_timeout_s
        self._recent: dict[str, deque[float]] = {}
        # this run's restarts, by service: the hash is written whole from them, so that a
        # Redis that restarted empty (pacer up's own, restarted here) gets them all again
        self._counts: dict[str, int] = {}
        # when a write failed (not in Redis yet); at first, this run's counts (none) are not:
        # the hash holds an earlier `pacer up`'s on this Redis, which the first write clears
        self._uncounted_since: float | None = None if restarts_key is None else float("-inf")
        # restarted processes not yet seen beating (pid -> heartbeat key, when it started),
        # those of them killed for taking too long, and by service how many restarts in a
        # row died before they came up
        self._starting: dict[int, tuple[str, float]] = {}
        self._timed_out: set[int] = set()
        self._failed_starts: dict[str, int] = {}
        self._checked_at = 0.0

    def handle(self, child: Child, stopping) -> None:
        """Restart `child` (and its group); PacerError, naming it, if it died too often to try
        again. A child already replaced (its group was restarted for a rank that died with it)
        is one death of the group, handled already: restarting again would kill the fresh
        processes."""
        if not any(c is child for c in self.sup.children):
            return
        group = self._group(child)
        self._note_started()                 # its last beat, if any, before it is deleted
        self._forget_heartbeats(group)       # at once: /health and the scheduler see it now
        service = self.groups.get(child.name, child.name)
        death = f"{child.name} exited ({describe_exit(child.returncode)})"
        if child.pid in self._timed_out:
            death = (f"{child.name} was killed (no heartbeat within "
                     f"{self.startup_timeout_s:g} s of its restart)")
        if child.pid in self._starting:
            self._failed_starts[service] = self._failed_starts.get(service, 0) + 1
        else:
            self._failed_starts.pop(service, None)
        for member in group:
            self._starting.pop(member.pid, None)
            self._timed_out.discard(member.pid)
        if self._failed_starts.get(service, 0) >= MAX_FAILED_STARTS:
            raise PacerError(f"{service} did not come up again: {death} before its first "
                             f"heartbeat, {MAX_FAILED_STARTS} restarts in a row; giving up "
                             f"({child.last_error()})")
        if child.returncode == 0:
            # a clean stop (SIGTERM, drained, exit 0: an operator restarting it), not a crash:
            # started again at once, and not counted toward giving up on a crash loop
            self._start_again(group, service, death, child, stopping)
            return
        recent = self._recent.setdefault(service, deque())
        now = time.monotonic()
        while recent and now - recent[0] > RESTART_WINDOW_S:
            recent.popleft()
        if len(recent) >= MAX_RESTARTS:
            raise PacerError(f"{service} died {len(recent) + 1} times within "
                             f"{RESTART_WINDOW_S:.0f} s, the last: {death}; giving up "
                             f"({child.last_error()})")
        # back off a little more for each recent death: a crash loop must not spin
        wait_quietly(0.5 * len(recent), stopping)
        if stopping():
            return                           # `pacer up` is stopping: nothing new starts
        recent.append(time.monotonic())
        self._start_again(group, service, death, child, stopping)

    def _start_again(self, group: list[Child], service: str, death: str, child: Child,
                     stopping) -> None:
        stop_children(group, 5.0)            # a surviving rank waits for a peer that is gone
        self._forget_heartbeats(group)       # what the survivors wrote until they stopped
        if stopping():
            return
        for member in group:
            fresh = self.sup.restart(member)
            key = heartbeat_key(self.heartbeat_keys, fresh)
            if key is not None:
                self._starting[fresh.pid] = (key, time.monotonic())
        print(f"pacer up: {death} ({child.last_error()}); restarted "
              f"{', '.join(m.name for m in group)}",
              file=sys.stderr, flush=True)
        if self.restarts_key is not None:
            self._counts[service] = self._counts.get(service, 0) + 1
            self._write_counts()

    def count_again(self) -> None:
        """Write the counts not in Redis yet: this run's first (none, in place of an earlier
        run's), or those a failed write left out (Redis was away: a Redis that pacer up has
        just restarted refuses connections for a moment), at most once per COUNT_RETRY_S;
        `pacer up` calls it before it starts its services, then its watch loop every turn."""
        if self._uncounted_since is not None and \
                time.monotonic() - self._uncounted_since >= COUNT_RETRY_S:
            self._write_counts()

    def check_started(self) -> None:
        """Note the restarted processes that have come up (written their heartbeat), and
        kill those that have not within `startup_timeout_s` (their death is then handled as
        one before they came up), at most once per CHECK_STARTED_S; `pacer up`'s watch loop
        calls it every turn."""
        if not self._starting or time.monotonic() - self._checked_at < CHECK_STARTED_S:
            return
        if not self._note_started() or self.startup_timeout_s is None:
            return          # Redis did not answer: no verdict without it
        now = time.monotonic()
        for child in self.sup.children:
            started = self._starting.get(child.pid)
            if started is None or child.pid in self._timed_out or child.returncode is not None \
                    or now - started[1] <= self.startup_timeout_s:
                continue
            print(f"pacer up: {child.name} (pid {child.pid}) wrote no heartbeat within "
                  f"{self.startup_timeout_s:g} s of its restart (--startup-timeout; hung "
                  "loading?); killing it", file=sys.stderr, flush=True)
            self._timed_out.add(child.pid)
            child.proc.kill()

    def _note_started(self) -> bool:
        """Forget the restarted processes whose heartbeat is in; whether Redis answered."""
        self._checked_at = time.monotonic()
        pids = list(self._starting)
        if not pids:
            return True
        values: list = []
        read = self._on_redis("heartbeats not read", lambda client: values.extend(
            client.mget([self._starting[pid][0] for pid in pids])), quiet=True)
        for pid, value in zip(pids, values):
            if (incarnation(value) or (None,))[0] == pid:
                del self._starting[pid]
        return read

    def _write_counts(self) -> None:
        counts = dict(self._counts)

        def write(client: redis.Redis) -> None:
            pipe = client.pipeline()         # MULTI: /metrics never reads it half written
            pipe.delete(self.restarts_key)
            if counts:
                pipe.hset(self.restarts_key, mapping=counts)
            pipe.execute()
        written = self._on_redis("restarts not counted yet; trying again", write,
                                 quiet=self._uncounted_since is not None)
        self._uncounted_since = None if written else time.monotonic()

    def _group(self, child: Child) -> list[Child]:
        group = self.groups.get(child.name)
        if group is None:
            return [child]
        return [c for c in self.sup.children if self.groups.get(c.name) == group]

    def _forget_heartbeats(self, group: list[Child]) -> None:
        keys = [k for c in group if (k := heartbeat_key(self.heartbeat_keys, c)) is not None]
        if keys:
            self._on_redis("heartbeat keys not deleted", lambda client: client.delete(*keys))

    def _on_redis(self, failed: str, op, quiet: bool = False) -> bool:
        """`op(client)` on a connection of its own, given a second at most: a Redis that is
        away (it may be the child that died) costs a warning (none if `quiet`: said once
        already), never the restart. Whether it got through."""
        client = redis.Redis.from_url(self.redis_url, password=redis_password(),
                                      socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            op(client)
            return True
        except (redis.RedisError, OSError) as e:
            if not quiet:
                log.warning(failed, error=str(e))
            return False
        finally:
            client.close()


class Watchdog:
    CHECK_EVERY_S = 1.0

    def __init__(self, redis_url: str, heartbeat_keys: HeartbeatKeys, after_s: float) -> None:
        """`heartbeat_keys`: child name -> its heartbeat key; `after_s`: how long a child
        whose heartbeat was seen may go without one (0: never killed)."""
        self.heartbeat_keys, self.after_s = heartbeat_keys, after_s
        self._client = redis.Redis.from_url(redis_url, password=redis_password(),
                                            socket_timeout=1.0, socket_connect_timeout=1.0)
        self._seen: dict[int, float] = {}      # pid -> when its heartbeat was last seen
        self._checked_at = time.monotonic()
        self._redis_away = False
        self._run_id: str | None = None        # the Redis server's, as last read

    def hung(self, children: list[Child]) -> list[Child]:
        """The running children silent for longer than `after_s` (checked once a second)."""
        now = time.monotonic()
        if self.after_s <= 0 or now - self._checked_at < self.CHECK_EVERY_S:
            return []
        self._checked_at = now
        watched = [c for c in children if c.name in self.heartbeat_keys and c.returncode is None]
        if not watched:
            return []
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.info("server")
            pipe.mget([heartbeat_key(self.heartbeat_keys, c) for c in watched])
            server, values = pipe.execute()
        except (redis.RedisError, OSError):
            self._redis_away = True
            return []           # no verdict without Redis: its services wait for it too
        pids = [(incarnation(v) or (None,))[0] for v in values]
        live = {c.pid for c in watched}
        self._seen = {pid: t for pid, t in self._seen.items() if pid in live}
        restarted = self._run_id is not None and server["run_id"] != self._run_id
        self._run_id = server["run_id"]
        if self._redis_away or restarted:
            # Redis was away, or restarted (another run_id: it lost every key): the services
            # reconnect and beat again; count from now. Keys gone from a Redis that ran on
            # (every service stalled, their keys expired) are no such sign.
            self._seen = dict.fromkeys(self._seen, now)
            self._redis_away = False
        hung = []
        for child, pid in zip(watched, pids):
            if pid == child.pid:
                self._seen[child.pid] = now
            elif child.pid in self._seen and now - self._seen[child.pid] > self.after_s:
                del self._seen[child.pid]
                hung.append(child)
        return hung

    def close(self) -> None:
        self._client.close()

