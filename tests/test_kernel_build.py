"""The CPU kernels are built ahead of time, once per ISA level, and picked by the CPU's flags:
level selection, forcing a level, the build lock that dies with its process, and a serving
process that never compiles."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from gpu_worker import cpu_kernels as ck
from gpu_worker import kernel_build as kb
from shared.cpu import auto_dtype, cpu_flags
from shared.errors import PacerError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AVX2_ONLY = frozenset("fpu sse sse2 avx avx2 fma f16c bmi1 bmi2 movbe".split())
AVX512 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


def test_levels_follow_the_cpu_flags():
    assert kb.supported_levels(frozenset({"sse2"})) == ["generic"]
    assert kb.supported_levels(AVX2_ONLY) == ["generic", "avx2"]
    assert kb.supported_levels(AVX512) == ["generic", "avx2", "avx512"]
    assert kb.supported_levels(AVX2_ONLY - {"fma"}) == ["generic"]   # x86-64-v3 needs FMA too
    assert cpu_flags(os.devnull) == frozenset()


def test_the_best_level_runs_here_and_a_level_can_be_forced(monkeypatch):
    monkeypatch.delenv("PACER_CPU_ISA", raising=False)
    assert ck.best_level(AVX2_ONLY) == "avx2"
    assert ck.best_level(AVX512) == "avx512"
    here = kb.supported_levels(cpu_flags())
    assert ck.best_level() == here[-1]
    monkeypatch.setenv("PACER_CPU_ISA", "generic")
    assert ck.best_level(AVX512) == "generic"
    monkeypatch.setenv("PACER_CPU_ISA", "avx512")
    with pytest.raises(PacerError, match="runs only generic, avx2"):
        ck.best_level(AVX2_ONLY)                  # never a level whose instructions would trap
    monkeypatch.setenv("PACER_CPU_ISA", "sse9")
    with pytest.raises(PacerError, match="one of generic"):
        ck.best_level(AVX512)


def test_a_process_held_below_avx512_picks_the_dtype_of_such_a_cpu(monkeypatch):
    """Held to AVX2 (or generic) on a CPU with native bf16, `--dtype auto` picks float32 as an
    AVX2-only CPU does, where bf16 GEMMs widen in software: held runs measure what such a CPU
    would serve (they served bf16, 0.13x float32's throughput, docs/benchmarks.md#dtype-auto)."""
    bf16_cpu = AVX512 | {"avx512_bf16"}
    assert auto_dtype("cpu", AVX512) == "float32"
    assert kb.LEVEL_NAMES[-1] == "avx512"      # every level before it is held below it
    for held, want in [("", "bfloat16"), *[(level, "float32") for level in kb.LEVEL_NAMES[:-1]],
                       ("avx512", "bfloat16")]:
        monkeypatch.setenv("PACER_CPU_ISA", held)
        assert auto_dtype("cpu", bf16_cpu) == want, held
        assert auto_dtype("cuda", bf16_cpu) == "bfloat16"
    if not {"avx512_bf16", "amx_bf16"} & cpu_flags():
        pytest.skip("this CPU has no native bf16 to hold back (CPU flag avx512_bf16 or amx_bf16)")
    # a whole process held: the engine's default args and the GEMMs' own rule agree
    out = subprocess.run(
        [sys.executable, "-c", "from shared.engine_args import EngineArgs; "
         "from gpu_worker.quant import linear; "
         "print(EngineArgs().resolved().dtype, linear._bf16_gemm_native())"],
        cwd=ROOT, env={**os.environ, "PACER_CPU_ISA": "avx2"}, capture_output=True, text=True,
        timeout=120)
    assert out.stdout.strip().splitlines()[-1:] == ["float32 False"], out.stderr[-2000:]


@pytest.mark.parametrize("kernel_dir", ["found", "given"])
def test_the_forced_level_is_the_one_a_process_loads(kernel_dir):
    """Each level the CPU runs loads when forced, in a fresh process that has not imported
    torch, the kernels' folder found or given by PACER_KERNEL_DIR (given, nothing imported
    torch, whose libraries the kernels link: they failed to load)."""
    here = kb.supported_levels(cpu_flags())
    env = {k: v for k, v in os.environ.items() if k != "PACER_KERNEL_DIR"}
    if kernel_dir == "given":
        env["PACER_KERNEL_DIR"] = kb.default_dir()
    for level in here:
        out = subprocess.run(
            [sys.executable, "-c", "from gpu_worker.cpu_kernels import cpu_kernels; "
             "print(cpu_kernels().level)"],
            cwd=ROOT, env={**env, "PACER_CPU_ISA": level}, capture_output=True, text=True,
            timeout=120)
        assert out.stdout.strip().splitlines()[-1] == level, out.stderr[-2000:]


def test_missing_kernels_fall_back_to_torch_without_compiling(tmp_path, monkeypatch):
    monkeypatch.setenv("PACER_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(ck, "_loaded", {})
    started = time.monotonic()
    assert ck.cpu_kernels() is None
    assert time.monotonic() - started < 5
    assert os.listdir(tmp_path) == []             # nothing built, no lock taken


def test_a_kernel_dir_that_is_no_folder_is_named_in_the_warning(tmp_path, monkeypatch, capsys):
    """PACER_KERNEL_DIR pointing nowhere (a typo, a removed folder) falls back to torch ops as
    missing kernels do, and the warning names the variable: it said the kernels were not built
    for this CPU and to run `make setup`, which builds them elsewhere."""
    monkeypatch.setenv("PACER_KERNEL_DIR", str(tmp_path / "nowhere"))
    monkeypatch.setattr(ck, "_loaded", {})
    assert ck.cpu_kernels() is None
    said = capsys.readouterr()
    assert "PACER_KERNEL_DIR names no folder" in said.out + said.err
    assert not os.path.exists(tmp_path / "nowhere")


def test_kernels_live_in_this_checkout_keyed_by_the_torch_build(monkeypatch):
    """Two checkouts (or venvs) never share a kernel folder, so they never rebuild each other's;
    `make setup` built this one, so asking again compiles nothing."""
    monkeypatch.delenv("PACER_KERNEL_DIR", raising=False)
    import torch
    out = kb.default_dir()
    assert out.startswith(os.path.join(ROOT, "gpu_worker", "_kernels") + os.sep)
    assert torch.__version__ in os.path.basename(out)
    said = []
    started = time.monotonic()
    assert kb.build(out_dir=out, say=said.append) == []
    assert time.monotonic() - started < 30, said
    assert all("up to date" in line for line in said[:-1])


def _start_build(out_dir: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gpu_worker.kernel_build", "--levels", "generic",
                             "--out", out_dir, "--jobs", "1"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_line(proc: subprocess.Popen, needle: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return line
    raise AssertionError(f"no {needle!r} within {timeout} s; saw: {''.join(seen)}")


def test_a_killed_build_never_blocks_the_next_one(tmp_path):
    first = _start_build(str(tmp_path))
    second = None
    try:
        _wait_for_line(first, "compiling", 60)       # first holds the lock, compiling
        second = _start_build(str(tmp_path))
        _wait_for_line(second, "another build holds", 60)   # a live build is waited for
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        _wait_for_line(second, "compiling", 30)      # the dead one's lock went with it
        assert not [f for f in os.listdir(tmp_path) if f.endswith(".so")]   # nothing half-built
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
