"""The services run on separate machines, as the README promises: nothing may depend on their
clocks agreeing or on their starting together."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import redis

from shared.keys import Keys
from tests.helpers_tiny_model import write_tiny_llama
from tests.redis_fixture import redis_server  # noqa: F401  (a fixture)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEADLINE_S = 90          # a follower that never joins would wait for ever


def _worker(rank: int, model: str, redis_url: str, keys: Keys) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.cli", "worker", "--rank", str(rank),
                             "--tp", "2", "--model", model, "--dtype", "float32",
                             "--max-model-len", "256", "--redis-url", redis_url,
                             "--key-prefix", keys.prefix], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_a_tp_follower_started_well_after_rank_0_joins_its_group(redis_server, tmp_path):
    """`pacer worker --rank 1` started on its machine a while after `--rank 0` on another
    (rank 0 waits minutes for its followers) joins the group rank 0 announced: it took a
    rendezvous older than 10 s by its own clock for an earlier group's and waited for ever
    (so did one whose clock ran 10 s ahead of rank 0's)."""
    model = write_tiny_llama(tmp_path / "tiny")
    keys = Keys("tp-late:")
    procs = [_worker(0, model, redis_server, keys)]
    client = redis.Redis.from_url(redis_server)
    try:
        for line in procs[0].stdout:
            if "tp group rendezvous published" in line:
                break
        time.sleep(12)                        # rank 1's machine starts it later
        procs.append(_worker(1, model, redis_server, keys))
        deadline = time.monotonic() + DEADLINE_S
        while not client.exists(keys.hb_worker(0)):   # rank 0 beats once its group formed
            assert time.monotonic() < deadline, "the follower never joined rank 0's group"
            assert all(p.poll() is None for p in procs)
            time.sleep(0.2)
    finally:
        client.close()
        for p in procs:
            p.send_signal(signal.SIGTERM)
        outs = [p.communicate(timeout=60)[0] for p in procs]
    assert "tp follower ready" in outs[1], outs[1][-2000:]


def test_a_tp_follower_told_to_reach_another_machines_rank_0_at_loopback_says_so(
        redis_server, tmp_path):
    """Rank 0 started on another machine without `--tp-host` announces 127.0.0.1, an address
    a follower on this machine reaches only itself at: the follower ends with an error that
    names the flag, instead of waiting for ever, 'a group that is gone', for a newer one."""
    model = write_tiny_llama(tmp_path / "tiny")
    keys = Keys("tp-loopback:")
    client = redis.Redis.from_url(redis_server)
    client.set(keys.tp_rendezvous, json.dumps({"addr": "127.0.0.1", "port": 1, "pid": 4242,
                                               "time": time.time(), "host": "other-machine"}))
    client.close()
    proc = _worker(1, model, redis_server, keys)
    try:
        out = proc.communicate(timeout=DEADLINE_S)[0]
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 1, out[-2000:]
    last = out.strip().splitlines()[-1]
    assert "other-machine" in last and "--tp-host" in last, out[-2000:]
