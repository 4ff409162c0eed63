"""A background task a service cannot serve without (heartbeat, leases, the gateway's token
listener) that ends by a bug takes its process down with a logged traceback, so that the
supervisor restarts it; cancelled at a clean stop, it does not. Real processes: the exit is
`os._exit`."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from shared.lifecycle import EXIT_TASK_ENDED
from tests.served_fixture import ROOT

SCRIPT = textwrap.dedent("""
    import asyncio, sys
    from shared.lifecycle import essential_task
    from shared.logging import configure_logging

    async def listener(fail):
        await asyncio.sleep(0.2)
        if fail == "raise":
            raise RuntimeError("a bug in the loop")
        if fail == "return":
            return
        await asyncio.sleep(60)

    async def main(fail):
        task = essential_task(listener(fail), "token-router")
        await asyncio.sleep(1.0)            # the service's own work
        task.cancel()                       # a clean stop
        await asyncio.gather(task, return_exceptions=True)
        print("stopped cleanly", flush=True)

    configure_logging("test")
    asyncio.run(main(sys.argv[1]))
""")


def _run(fail: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, fail], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def _records(stderr: str) -> list[dict]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


def test_an_essential_task_that_raises_ends_its_process_with_the_traceback_logged():
    done = _run("raise")
    assert done.returncode == EXIT_TASK_ENDED, done.stderr
    assert "stopped cleanly" not in done.stdout        # it did not go on without the task
    [record] = [r for r in _records(done.stderr) if r.get("task") == "token-router"]
    assert record["level"] == "critical"
    assert "RuntimeError('a bug in the loop')" in record["error"]
    assert "Traceback" in record["exception"] and "in listener" in record["exception"]


def test_an_essential_task_that_returns_ends_its_process_too():
    done = _run("return")
    assert done.returncode == EXIT_TASK_ENDED, done.stderr
    assert any(r.get("error") == "returned" for r in _records(done.stderr))


def test_a_cancelled_essential_task_lets_the_process_stop_cleanly():
    done = _run("wait")
    assert done.returncode == 0, done.stderr
    assert "stopped cleanly" in done.stdout
    assert not [r for r in _records(done.stderr) if r.get("level") == "critical"]
