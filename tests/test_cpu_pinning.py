"""Cores for the forward threads (docs/design.md#cores-for-the-forward-threads): the CPU list
format, how `pacer up` shares the cores out among engine instances, and the pin itself (a real
thread's mask, read back from the kernel). The served P/D test checks the pins of running
workers."""
from __future__ import annotations

import argparse
import os
import threading

import pytest

from shared import cpu
from shared.cpu import format_cpu_list, parse_cpu_list, place_instances


def test_cpu_lists_read_and_written_as_the_kernel_writes_them():
    assert parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cpu_list("5, 1") == [1, 5]
    assert parse_cpu_list("2-2,2") == [2]
    assert format_cpu_list([3, 1]) == "1,3"
    for bad in ("", "a", "3-1", "-1", "1-", ","):
        with pytest.raises(ValueError, match="not a CPU list"):
            parse_cpu_list(bad)


def test_instances_get_disjoint_cores_only_where_they_fit():
    assert place_instances([1, 1], [0, 1]) == [[0], [1]]
    assert place_instances([2, 1, 1], [0, 1, 2, 3, 4]) == [[0, 1], [2], [3]]
    assert place_instances([2, 2], [4, 5, 6, 7]) == [[4, 5], [6, 7]]
    assert place_instances([1, 1, 1], [0, 1]) is None      # stacked: left to the kernel
    assert place_instances([2], [0, 1]) is None             # one has every core anyway


def _worker_cpus(monkeypatch, cores: set[int], *argv: str) -> dict[str, str | None]:
    from services import up
    from shared.engine_args import EngineArgs
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cores)
    parser = argparse.ArgumentParser()
    up.register(parser.add_subparsers())
    args = parser.parse_args(["up", *argv])
    found = {}
    for name, a in up._service_argvs(args, EngineArgs.from_cli(args)).argvs:
        if "worker" in name:
            found[name] = a[a.index("--cpus") + 1] if "--cpus" in a else None
    return found


def test_pacer_up_gives_pd_ranks_cores_of_their_own(monkeypatch):
    got = _worker_cpus(monkeypatch, {0, 1}, "--prefill-workers", "1", "--decode-workers", "1")
    assert got == {"p0 worker rank 0": "0", "d0 worker rank 0": "1"}
    got = _worker_cpus(monkeypatch, {0, 1, 2, 3}, "--prefill-workers", "1",
                       "--decode-workers", "1", "--prefill-tp", "2", "--decode-tp", "2")
    # the ranks of one instance share its cores (they meet at every layer)
    assert got == {"p0 worker rank 0": "0,1", "p0 worker rank 1": "0,1",
                   "d0 worker rank 0": "2,3", "d0 worker rank 1": "2,3"}
    # asked for more threads than there are cores: nothing pinned
    got = _worker_cpus(monkeypatch, {0, 1}, "--prefill-workers", "1", "--decode-workers", "1",
                       "--prefill-threads", "2", "--decode-threads", "2")
    assert set(got.values()) == {None}
    got = _worker_cpus(monkeypatch, {0, 1}, "--prefill-workers", "1", "--decode-workers", "1",
                       "--no-pin-cpus")
    assert set(got.values()) == {None}


def test_pacer_up_leaves_one_instance_unpinned_and_pins_replicas(monkeypatch):
    assert _worker_cpus(monkeypatch, {0, 1, 2, 3}) == {"worker rank 0": None}
    assert _worker_cpus(monkeypatch, {0, 1, 2, 3}, "--tp", "2") == \
        {"worker rank 0": None, "worker rank 1": None}
    assert _worker_cpus(monkeypatch, {0, 1}, "--replicas", "2") == \
        {"r0 worker rank 0": "0", "r1 worker rank 0": "1"}


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux affinity calls")
def test_the_forward_thread_alone_is_pinned(monkeypatch):
    mine = os.sched_getaffinity(0)
    core = min(mine)
    monkeypatch.setattr(cpu, "_forward_cpus", None)
    cpu.set_forward_cpus([core])
    seen = {}

    def forward():
        cpu.pin_forward_thread()
        seen["thread"] = os.sched_getaffinity(threading.get_native_id())

    t = threading.Thread(target=forward)
    t.start()
    t.join()
    assert seen["thread"] == {core}
    assert os.sched_getaffinity(0) == mine                  # the caller's mask untouched
    with pytest.raises(ValueError, match="not available"):
        cpu.set_forward_cpus([max(mine) + 1000])
