"""How a two-rank group (real processes, gloo, a stand-in runner without a model) fails: a
follower that dies mid-step fails rank 0's step at once with the connection's error, a
follower that hangs mid-step fails it at the collective timeout instead of freezing it, a
stopped rank 0 is seen by its follower's watchdog, rank 0's shutdown is not held up by a follower
that died or stopped while idle, and a rank told that the others found it
unresponsive says so about itself. A watchdog check that breaks is a verdict, not a watchdog
that ends in silence; a follower killed by a signal without a name is named by its number."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import redis

import torch.distributed as dist

from gpu_worker.tp.group import find_free_port
from gpu_worker.tp.liveness import Liveness
from gpu_worker.tp.spawn import Followers
from gpu_worker.tp.store_keys import DOWN
from shared.keys import Keys
from shared.plan import IterationPlan
from shared.protocol import PlanMsg, to_fields
from tests.helpers_tiny_model import write_tiny_llama
from tests.redis_fixture import redis_server  # noqa: F401  (a fixture)
from tests.served_fixture import process_state

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 3          # the group's collective timeout in these tests (30 s when served)
DEADLINE_S = 90        # a hang would last for ever

RANK = textwrap.dedent("""
    import json, os, signal, sys, time
    from types import SimpleNamespace
    from gpu_worker.tp.broadcast import AgreementCheck, broadcast_bytes, share_sampling_seed
    from gpu_worker.tp.executor import TPExecutor
    from gpu_worker.tp.group import init_tp_group
    from gpu_worker.tp.store_keys import READY
    from shared.errors import PacerError
    from shared.plan import IterationPlan, StepResult
    from shared.protocol import decode

    rank, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    from gpu_worker.tp import liveness
    liveness.DEAD_AFTER_S = 3.0                  # (10 s served) the silence that means dead
    runner = SimpleNamespace(rc=SimpleNamespace(seed=1),
                             execute=lambda plan: StepResult(plan.step, {}))
    group = init_tp_group(rank, 2, "127.0.0.1", port, "gloo", timeout_s=%d)
    if rank == 0:
        executor = TPExecutor(runner, group)
        print("ready", flush=True)
        if mode == "idle":
            time.sleep(600)
        if mode in ("gone", "stopped"):  # a step; once rank 1 is so, idle: shut down
            executor.execute(IterationPlan(1, [], [], {}))
            sys.stdin.readline()
            executor.shutdown(timeout_s=3600)
            print(json.dumps({"error": None}), flush=True)
            sys.exit(0)
        try:
            executor.execute(IterationPlan(1, [], [], {}))
            print(json.dumps({"error": None}), flush=True)
        except PacerError as e:
            print(json.dumps({"error": str(e)}), flush=True)
        executor.shutdown(timeout_s=3600)        # as the worker does next: ends too
    else:
        share_sampling_seed(runner, group)
        check = AgreementCheck(group)
        group.store.add(READY, 1)
        if mode in ("gone", "stopped"):
            check.after(runner.execute(decode(broadcast_bytes(None, group)).plan))
            os.kill(os.getpid(), signal.SIGKILL if mode == "gone" else signal.SIGSTOP)
        if mode != "idle":
            broadcast_bytes(None, group)         # the plan; then, instead of the check:
            if mode == "die":
                os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)                          # hangs (the watchdog thread runs on)
""" % TIMEOUT_S)


def start_group(mode: str) -> list[subprocess.Popen]:
    port = find_free_port()
    return [subprocess.Popen([sys.executable, "-c", RANK, str(rank), str(port), mode], cwd=REPO,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
            for rank in (0, 1)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
        p.communicate()


def rank0_error(procs: list[subprocess.Popen]) -> str:
    rank0 = procs[0]
    assert rank0.stdout.readline().strip() == "ready"
    out, err = rank0.communicate(timeout=DEADLINE_S)
    return json.loads(out)["error"] or err


@pytest.mark.parametrize("mode,said", [
    # named from the collective's own error at once, not from heartbeats that stop 10 s later
    ("die", "tp rank 1 dropped the connection: "),
    # failed at the collective timeout, not a step frozen for ever with /health still 200
    ("hang", "a tensor-parallel collective failed on rank 0: "),
])
def test_a_follower_that_dies_or_hangs_mid_step_fails_rank_0s_step(mode, said):
    procs = start_group(mode)
    try:
        error = rank0_error(procs)
    finally:
        stop(procs)
    assert error.startswith(said), error


def test_a_stopped_rank_0_is_seen_by_its_followers_watchdog():
    procs = start_group("idle")
    try:
        assert procs[0].stdout.readline().strip() == "ready"
        time.sleep(1)                   # rank 1's watchdog beats
        procs[0].send_signal(signal.SIGSTOP)
        _, err = procs[1].communicate(timeout=DEADLINE_S)
    finally:
        stop(procs)
    assert procs[1].returncode == 1
    assert "pacer: tp rank 1: tp rank 0 stopped answering (its rendezvous store gave no answer " \
        "for 3.0 s)" in err, err


@pytest.mark.parametrize("mode", ["gone", "stopped"])
def test_rank_0_shuts_down_beside_a_follower_that_cannot_answer(mode):
    """A follower killed or stopped while idle, before rank 0's watchdog noticed: the wait for
    it to leave ends (a closed connection at once, a stopped peer at the collective timeout)
    instead of lasting the shutdown's whole timeout."""
    procs = start_group(mode)
    try:
        assert procs[0].stdout.readline().strip() == "ready"
        while process_state(procs[1].pid) not in ("Z", "T"):
            time.sleep(0.05)
        out, err = procs[0].communicate("\n", timeout=DEADLINE_S)   # not its 3600 s timeout
    finally:
        stop(procs)
    assert procs[0].returncode == 0 and json.loads(out) == {"error": None}, err


@pytest.mark.parametrize("culprit,said", [
    (1, "tp rank 0 found this rank unresponsive and took the group down (tp rank 1 stopped "
        "responding (no heartbeat for 10.2 s))"),
    (2, "tp rank 2 stopped responding (no heartbeat for 10.2 s)"),
])
def test_a_rank_tells_another_ranks_verdict_from_its_own_point_of_view(culprit, said):
    reader = Liveness.__new__(Liveness)
    reader.rank = 1
    verdict = {"why": f"tp rank {culprit} stopped responding (no heartbeat for 10.2 s)",
               "rank": culprit, "by": 0}
    assert reader._heard(json.dumps(verdict).encode()) == said


def _broken_check():
    raise ValueError("'40' is not a valid Signals")


@pytest.mark.parametrize("extra_check,verdict,said", [
    # a check of its own that raises (as rank 0's poll of its followers once did)
    (_broken_check, None, "ValueError: '40' is not a valid Signals"),
    # another rank's verdict that cannot be read
    (None, b"not json", "JSONDecodeError: Expecting value: line 1 column 1 (char 0)"),
])
def test_a_watchdog_check_that_breaks_is_a_verdict_not_a_silent_end(extra_check, verdict, said):
    port = find_free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    if verdict is not None:
        store.set(DOWN, verdict)
    told, watchdog = _watch_once(port, extra_check)
    assert told == [f"the watchdog of tp rank 0 failed: {said}"], told
    assert watchdog.dead == told[0]


def _watch_once(port: int, extra_check) -> tuple[list[str], Liveness]:
    """Rank 0's watchdog of a group of 2 over the store at `port`, until its first verdict."""
    told: list[str] = []
    watchdog = Liveness("127.0.0.1", port, 0, 2, extra_check, on_dead=told.append)
    watchdog.start()
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not told and watchdog._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        watchdog.stop()
    return told, watchdog


def test_a_follower_that_exited_after_its_own_step_failed_is_named_by_its_reason():
    """A follower whose own step failed leaves its reason in the store, then exits; rank 0's
    watchdog sees the exit of its process first (pacer generate --tp said "tp rank 1 (pid N)
    exited (exit code 1)") and must name the reason, as every rank does; with no reason left
    the exit is named."""
    import json
    for left, said in ((json.dumps({"why": "tp rank 1 failed mid-iteration: OutOfMemoryError: x",
                                    "rank": 1, "by": 1}), "OutOfMemoryError: x"),
                       (None, "exited (exit code 1)")):
        port = find_free_port()
        store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        if left is not None:
            store.set(DOWN, left)
        told, _ = _watch_once(port, lambda: "tp rank 1 (pid 7) exited (exit code 1)")
        assert len(told) == 1 and told[0].endswith(said), told


def test_a_follower_killed_by_a_signal_without_a_name_is_named_by_its_number():
    follower = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    number = signal.SIGRTMIN + 6                # a real-time signal: signal.Signals lacks it
    try:
        os.kill(follower.pid, number)
        follower.wait(timeout=DEADLINE_S)
        said = Followers({1: follower}).check()
    finally:
        follower.kill()
        follower.wait()
    assert said == f"tp rank 1 (pid {follower.pid}) exited (killed by signal {int(number)})"


OWN_FAILURE = textwrap.dedent("""
    import sys, torch
    from types import SimpleNamespace
    from gpu_worker.tp.executor import TPExecutor
    from gpu_worker.tp.follower import run_follower
    from gpu_worker.tp.group import init_tp_group
    from gpu_worker.tp.liveness import leave_process
    from shared.errors import PacerError
    from shared.plan import IterationPlan, StepResult

    rank, port, failing = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    group = init_tp_group(rank, 2, "127.0.0.1", port, "gloo", timeout_s=%d)

    def execute(plan):
        if rank == failing:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        group.all_reduce(torch.ones(4))       # the forward's all-reduce: waits for the other
        return StepResult(plan.step, {})

    runner = SimpleNamespace(rc=SimpleNamespace(seed=1, device="cpu"), execute=execute)
    try:
        if rank == 0:
            TPExecutor(runner, group).execute(IterationPlan(1, [], [], {}))
        else:
            run_follower(runner, group)
    except PacerError as e:
        print(e, file=sys.stderr, flush=True)
        leave_process(1)                      # as a worker rank leaves
""" % DEADLINE_S)


@pytest.mark.parametrize("failing", [0, 1])
def test_a_rank_whose_own_step_fails_is_named_by_every_rank(failing):
    """A rank that runs out of memory in its forward while the other waits in the all-reduce:
    both name that rank and its error, not a collective that failed or a dropped connection,
    and neither waits for the collective's timeout."""
    port = find_free_port()
    procs = [subprocess.Popen([sys.executable, "-c", OWN_FAILURE, str(rank), str(port),
                               str(failing)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        errs = [p.communicate(timeout=DEADLINE_S)[1] for p in procs]
    finally:
        stop(procs)
    said = (f"tp rank {failing} failed mid-iteration: OutOfMemoryError: CUDA out of memory. "
            f"Tried to allocate 2.00 GiB")
    for rank, err in enumerate(errs):
        # 1, not an exit aborted (-6) by a thread of torch's that asked for the GIL while
        # the interpreter finalized ("terminate called without an active exception")
        assert procs[rank].returncode == 1, err
        assert said in err.strip().splitlines()[-1], err


FAILING_WORKER = textwrap.dedent("""
    import sys, torch
    from gpu_worker.model_runner import ModelRunner
    from services.cli import main

    failing, argv = int(sys.argv[1]), sys.argv[2:]
    if int(argv[argv.index("--rank") + 1]) == failing:
        def execute(self, plan):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        ModelRunner.execute = execute
    sys.exit(main(argv))                      # as the `pacer` command does
""")


@pytest.mark.parametrize("failing", [0, 1])
def test_served_ranks_of_a_group_whose_rank_failed_its_step_exit_1(failing, redis_server,
                                                                   tmp_path):
    """`pacer worker --tp 2` ranks, one of which runs out of memory in its forward: each
    names the failure last and exits 1, the code `pacer up` reports as it restarts the group,
    never aborted (-6) by torch's threads as the interpreter finalizes."""
    model = write_tiny_llama(tmp_path / "tiny")
    keys = Keys("tp-oom:")
    procs = [subprocess.Popen([sys.executable, "-c", FAILING_WORKER, str(failing), "worker",
                               "--rank", str(rank), "--tp", "2", "--model", model, "--dtype",
                               "float32", "--max-model-len", "256", "--redis-url", redis_server,
                               "--key-prefix", keys.prefix], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    client = redis.Redis.from_url(redis_server)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not client.exists(keys.hb_worker(0)) and time.monotonic() < deadline:
            assert procs[0].poll() is None, procs[0].communicate()[0][-2000:]
            time.sleep(0.1)
        client.xadd(keys.plans, to_fields(PlanMsg(IterationPlan(1, [], [], {}))))
        outs = [p.communicate(timeout=DEADLINE_S)[0] for p in procs]
    finally:
        client.close()
        stop(procs)
    said = (f"tp rank {failing} failed mid-iteration: OutOfMemoryError: CUDA out of memory. "
            f"Tried to allocate 2.00 GiB")
    for proc, out in zip(procs, outs):
        assert proc.returncode == 1, out[-2000:]
        assert said in out.strip().splitlines()[-1], out[-2000:]


def test_a_served_rank_0_waiting_for_a_follower_that_never_comes_stops_on_sigterm(
        redis_server, tmp_path):
    """Rank 0 of `pacer up --tp 2` whose follower never joins (it died before it could; or
    `pacer up`, killed, starts no new one) leaves when told to stop, instead of after the
    join's 300 s timeout: a `pacer up` killed with -9 left it behind that long."""
    model = write_tiny_llama(tmp_path / "tiny")
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "worker", "--rank", "0",
                             "--tp", "2", "--model", model, "--dtype", "float32",
                             "--max-model-len", "256", "--redis-url", redis_server,
                             "--key-prefix", "tp-never:"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:              # waiting for rank 1 from here on
            lines.append(line)
            if "tp group rendezvous published" in line:
                break
        time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        out = "".join(lines) + proc.communicate(timeout=60)[0]     # not 300 s
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, out[-2000:]
    assert "stopped before the tensor-parallel group formed" in out, out[-2000:]
