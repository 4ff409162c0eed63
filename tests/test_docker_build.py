"""docker/build.sh's choices, without Docker or the network: the script is sourced by a real
bash and its functions run with a stand-in for the host python's pip that logs each call and
has torch's CPU build only where the test says (tests/test_docker.py runs the whole build)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _download_torch(tmp_path: Path, has_torch: str, **env: str) -> tuple[int, list[str], str]:
    """Run build.sh's torch download with a pip that finds the CPU build only with
    `--index-url has_torch` ("configured": with no --index-url, as pip's own sources)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    calls = tmp_path / "calls"
    stub = tmp_path / "python"
    stub.write_text("#!/bin/sh\n"
                    f"printf '%s\\n' \"$*\" >> {calls}\n"
                    f"case \" $* \" in *' --index-url {has_torch} '*) exit 0;; esac\n"
                    f"case \" $* \" in *' --index-url '*) exit 1;; esac\n"
                    f"[ {has_torch} = configured ]\n")
    stub.chmod(0o755)
    proc = subprocess.run(["bash", "-c", f"source {REPO / 'docker' / 'build.sh'} && download_torch"],
                          env={"PATH": os.environ["PATH"], "PYTHON": str(stub),
                               "PACER_CACHE_DIR": str(tmp_path / "cache"), **env},
                          capture_output=True, text=True, timeout=60)
    return proc.returncode, calls.read_text().splitlines() if calls.exists() else [], proc.stdout


def test_torch_comes_from_pytorchs_cpu_index_when_pip_has_none(tmp_path: Path) -> None:
    """A clean machine: PyPI has no `torch==...+cpu`, so the build falls back to PyTorch's CPU
    index (as docker/README.md says) instead of failing in the wheelhouse step."""
    rc, calls, out = _download_torch(tmp_path, TORCH_CPU_INDEX)
    assert rc == 0, (calls, out)
    assert len(calls) == 2 and "--index-url" not in calls[0], calls
    assert f"--index-url {TORCH_CPU_INDEX} torch==2.13.0+cpu" in calls[1], calls
    assert f"not in pip's configured sources: trying {TORCH_CPU_INDEX}" in out


def test_torch_from_pips_sources_or_the_index_given(tmp_path: Path) -> None:
    rc, calls, _ = _download_torch(tmp_path / "a", "configured")
    assert rc == 0 and len(calls) == 1 and "--index-url" not in calls[0], calls
    index = "https://mirror.example/torch-cpu"
    rc, calls, _ = _download_torch(tmp_path / "b", index, PACER_TORCH_INDEX=index)
    assert rc == 0 and len(calls) == 1 and f"--index-url {index} " in calls[0], calls
    # the index given and nothing else: a torch it lacks is an error, not another torch
    rc, calls, _ = _download_torch(tmp_path / "c", TORCH_CPU_INDEX, PACER_TORCH_INDEX=index)
    assert rc != 0 and len(calls) == 1, calls
