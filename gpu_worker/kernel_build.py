"""Build the CPU kernels (csrc/) once per x86 ISA level, ahead of time.

`make setup` (and `pip install` of a wheel, through setup.py) runs this; a serving or test
process never compiles. The compute kernels (no torch header) are compiled once per level; the
torch glue (bindings.cpp and decoder.cpp, the heavy files) once, for baseline x86-64. Each level's library
links the glue with that level's kernels, in a folder keyed by the torch build:

    gpu_worker/_kernels/torch-2.13.0+cpu-py311-cxx11abi1/pacer_cpu_avx512.so

so two checkouts (or two venvs with different torch builds) never share, or rebuild, each
other's kernels. `cpu_kernels.py` picks the best level the CPU supports at run time.

A build holds an `flock` on the folder's `.lock` file: the kernel releases it when the build
process dies, however it dies, so a killed build never blocks the next one. Objects and the
library are written under temporary names and renamed into place, so a half-finished build is
never loaded. A level is rebuilt only when its sources, flags, compiler or torch change.

    python -m gpu_worker.kernel_build [--levels avx2,avx512] [--out DIR] [--force]
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass


_HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(_HERE, "csrc")
GLUE = ("bindings.cpp", "decoder.cpp")     # torch-facing checks and bindings: compiled once
MODULE_SOURCE = "module.cpp"        # the level's module definition: once per level, tiny
KERNELS = ("paged_decode.cpp", "paged_prefill.cpp", "fused_ops.cpp", "dequant.cpp",
           "int4_vnni.cpp", "sampling.cpp")   # per level
HEADERS = ("kernels.h", "vec.h")


@dataclass(frozen=True)
class IsaLevel:
    name: str
    march: tuple[str, ...]          # the compiler's target flags
    needs: frozenset[str]           # /proc/cpuinfo flags a CPU must show to run it


_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}

# Lowest first. `generic` runs on any x86-64; the compiler targets the microarchitecture
# levels x86-64-v3 (AVX2 + FMA) and x86-64-v4 (AVX-512), never the build machine (no
# -march=native), so a build copied to another CPU stays correct.
LEVELS: tuple[IsaLevel, ...] = (
    IsaLevel("generic", ("-march=x86-64", "-mtune=generic"), frozenset()),
    IsaLevel("avx2", ("-march=x86-64-v3", "-mtune=generic"), _V3),
    IsaLevel("avx512", ("-march=x86-64-v4", "-mtune=generic"), _V4),
)
_BASELINE = LEVELS[0]
LEVEL_NAMES = tuple(level.name for level in LEVELS)
# hidden symbols: each level's library binds its own copies of inline functions
_COMMON_FLAGS = ("-O3", "-fPIC", "-std=c++20", "-fvisibility=hidden", "-fvisibility-inlines-hidden")
_KERNEL_FLAGS = ("-ffast-math", "-fopenmp")
# kernels whose float math must be done as written (their tests compare against a reference
# op by op, or a row's bits must not depend on the code path that computed it; -ffast-math
# would reorder, turn divisions into reciprocals and drop NaN tests)
EXACT_MATH = frozenset({"int4_vnni.cpp", "paged_prefill.cpp", "sampling.cpp"})


def level(name: str) -> IsaLevel:
    for candidate in LEVELS:
        if candidate.name == name:
            return candidate
    raise ValueError(f"unknown ISA level {name!r}; one of {', '.join(LEVEL_NAMES)}")


def supported_levels(flags: frozenset[str]) -> list[str]:
    return [lvl.name for lvl in LEVELS if lvl.needs <= flags]


def torch_key() -> str:
    """Names the torch build a kernel links against: a library built for one is not loaded by
    another."""
    import torch   # deferred: only a build, or a loader that found a kernel folder, needs it
    abi = int(torch.compiled_with_cxx11_abi())
    return f"torch-{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}-cxx11abi{abi}"


def default_dir() -> str:
    """Where kernels live: PACER_KERNEL_DIR, else beside this package, keyed by torch build."""
    return os.environ.get("PACER_KERNEL_DIR") or os.path.join(_HERE, "_kernels", torch_key())


def module_name(level_name: str) -> str:
    return f"pacer_cpu_{level_name}"


def library_path(out_dir: str, level_name: str) -> str:
    return os.path.join(out_dir, module_name(level_name) + ".so")


def _compiler() -> str:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or "g++"


def _glue_flags(module: str = "") -> list[str]:
    import torch
    from torch.utils.cpp_extension import include_paths
    abi = int(torch.compiled_with_cxx11_abi())
    includes = [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    name = [f"-DTORCH_EXTENSION_NAME={module}"] if module else []
    return [*_COMMON_FLAGS, *_BASELINE.march, *includes, "-DTORCH_API_INCLUDE_EXTENSION_H",
            *name, f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]


def _kernel_flags(lvl: IsaLevel, src: str = "") -> list[str]:
    exact = ["-fno-fast-math"] if src in EXACT_MATH else []
    return [*_COMMON_FLAGS, *_KERNEL_FLAGS, *exact, *lvl.march]


def _link_flags() -> list[str]:
    from torch.utils.cpp_extension import library_paths
    return ["-shared", "-fopenmp", *[f"-L{p}" for p in library_paths()],
            "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]


def _stamp(lvl: IsaLevel) -> str:
    """Changes whenever the library would: sources, headers, flags, compiler, torch."""
    h = hashlib.sha256()
    for name in (*GLUE, MODULE_SOURCE, *KERNELS, *HEADERS):
        with open(os.path.join(CSRC, name), "rb") as f:
            h.update(name.encode() + f.read())
    for src in KERNELS:
        h.update(" ".join(_kernel_flags(lvl, src)).encode())
    h.update(" ".join(_glue_flags() + _link_flags()).encode())
    try:
        h.update(subprocess.run([_compiler(), "--version"], capture_output=True, check=False).stdout)
    except OSError:
        pass
    h.update(torch_key().encode())
    return h.hexdigest()


def _read_manifest(out_dir: str) -> dict:
    try:
        with open(os.path.join(out_dir, "manifest.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _write_manifest(out_dir: str, manifest: dict) -> None:
    tmp = os.path.join(out_dir, f"manifest.json.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(out_dir, "manifest.json"))


class BuildLock:
    """An exclusive flock on DIR/.lock; the kernel drops it when the holder dies."""

    def __init__(self, out_dir: str, say=print):
        self.path = os.path.join(out_dir, ".lock")
        self.say = say
        self.fd = -1

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.say(f"another build holds {self.path}; waiting for it")
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        os.ftruncate(self.fd, 0)
        os.write(self.fd, str(os.getpid()).encode())
        return self

    def __exit__(self, *exc):
        os.close(self.fd)     # closing the descriptor releases the lock


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed:\n{done.stderr[-3000:]}")


def _compile(src: str, obj: str, flags: list[str]) -> None:
    tmp = f"{obj}.{os.getpid()}.tmp"
    _run([_compiler(), *flags, "-c", os.path.join(CSRC, src), "-o", tmp])
    os.replace(tmp, obj)


def _build(levels: list[IsaLevel], out_dir: str, jobs: int, say) -> None:
    """Compile the glue once and each level's kernels, all in parallel, then link per level."""
    work = os.path.join(out_dir, f"build-{os.getpid()}")
    os.makedirs(work, exist_ok=True)
    try:
        glue = [os.path.join(work, src.replace(".cpp", ".o")) for src in GLUE]
        jobs_list = [(src, obj, _glue_flags()) for src, obj in zip(GLUE, glue)]
        objects = {lvl.name: list(glue) for lvl in levels}
        for lvl in levels:
            module_obj = os.path.join(work, f"{lvl.name}-module.o")
            jobs_list.append((MODULE_SOURCE, module_obj, _glue_flags(module_name(lvl.name))))
            objects[lvl.name].append(module_obj)
            for src in KERNELS:
                obj = os.path.join(work, f"{lvl.name}-{src.replace('.cpp', '.o')}")
                jobs_list.append((src, obj, _kernel_flags(lvl, src)))
                objects[lvl.name].append(obj)
        say(f"kernels: compiling {len(jobs_list)} files for {', '.join(l.name for l in levels)} "
            f"({jobs} at a time) ...")
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(lambda job: _compile(*job), jobs_list))
        for lvl in levels:
            tmp_lib = os.path.join(work, f"{lvl.name}.so")
            _run([_compiler(), *objects[lvl.name], *_link_flags(), "-o", tmp_lib])
            os.replace(tmp_lib, library_path(out_dir, lvl.name))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def build(levels: list[str] | None = None, out_dir: str | None = None, force: bool = False,
          jobs: int | None = None, say=print) -> list[str]:
    """Build the given levels (default: all) into out_dir; returns the levels (re)built."""
    out_dir = out_dir or default_dir()
    os.makedirs(out_dir, exist_ok=True)
    wanted = [level(name) for name in (levels or LEVEL_NAMES)]
    jobs = jobs or max(1, os.cpu_count() or 1)
    with BuildLock(out_dir, say):
        for leftover in os.listdir(out_dir):      # a killed build's objects (we hold the lock)
            if leftover.startswith("build-"):
                shutil.rmtree(os.path.join(out_dir, leftover), ignore_errors=True)
        manifest = _read_manifest(out_dir)
        stamps = {lvl.name: _stamp(lvl) for lvl in wanted}
        stale = [lvl for lvl in wanted
                 if force or manifest.get(lvl.name) != stamps[lvl.name]
                 or not os.path.exists(library_path(out_dir, lvl.name))]
        for lvl in wanted:
            if lvl not in stale:
                say(f"kernels {lvl.name}: up to date")
        if stale:
            started = time.monotonic()
            _build(stale, out_dir, jobs, say)
            manifest.update({lvl.name: stamps[lvl.name] for lvl in stale})
            _write_manifest(out_dir, manifest)
            say(f"kernels: built {', '.join(l.name for l in stale)} in "
                f"{time.monotonic() - started:.0f} s")
    say(f"kernels in {out_dir}")
    return [lvl.name for lvl in stale]


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("build-kernels", help="compile the CPU kernels for each ISA level",
                              description=__doc__.split("\n")[0])
    add_arguments(p)
    return p


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--levels", default=",".join(LEVEL_NAMES),
                    help=f"comma-separated ISA levels to build (default: all of {','.join(LEVEL_NAMES)})")
    ap.add_argument("--out", default=None, help="output folder (default: beside the package, "
                    "keyed by the torch build; or $PACER_KERNEL_DIR)")
    ap.add_argument("--force", action="store_true", help="rebuild even when up to date")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: CPU count)")


def run(args: argparse.Namespace) -> int:
    levels = [name.strip() for name in args.levels.split(",") if name.strip()]
    try:
        build(levels, args.out, args.force, args.jobs, say=lambda m: print(m, flush=True))
    except (RuntimeError, OSError, ValueError) as e:
        print(f"kernel build failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m gpu_worker.kernel_build",
                                     description=__doc__.split("\n")[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
