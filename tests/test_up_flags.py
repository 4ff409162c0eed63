"""`pacer up` refuses a bad flag of any service before it starts anything (Redis, workers that
load the model), with the flag named."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_bad_gateway_flag_is_refused_before_redis_or_a_worker_starts():
    redis_port = _free_port()
    proc = subprocess.run([sys.executable, "-m", "services.cli", "up", "--port", "99999",
                           "--redis-url", f"redis://127.0.0.1:{redis_port}/0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--port must be in [0, 65535], got 99999" in proc.stderr, proc.stderr
    # nothing was started: no redis-server on the port, no worker's log lines
    assert "redis-server" not in proc.stdout + proc.stderr
    assert "worker" not in proc.stderr.lower(), proc.stderr
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", redis_port)) != 0
