"""Every import points down: `shared` <- `scheduler_svc` / `gpu_worker` / `gateway` <- `services`.

The test reads every module of the five packages with `ast`, imports inside functions
included, and fails on an import of a higher floor or of a sibling on the same floor (the
three services never import each other). Importing `shared` has no side effect on the process."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOORS = {"shared": 0, "scheduler_svc": 1, "gpu_worker": 1, "gateway": 1, "services": 2}


def imported_packages(tree: ast.AST, module: str) -> list[tuple[int, str]]:
    """(line, top-level package) of every import in `tree`, however deep it is nested;
    relative imports resolve to `module`'s own package."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            top = module.split(".")[0] if node.level else (node.module or "").split(".")[0]
            found.append((node.lineno, top))
    return found


def upward(importer: str, imported: str) -> bool:
    """Whether package `importer` may not import package `imported` (outside packages pass)."""
    if imported not in FLOORS or imported == importer:
        return False
    return FLOORS[imported] >= FLOORS[importer]


def violations(source: str, module: str) -> list[str]:
    package = module.split(".")[0]
    return [f"{module}:{line} imports {imported}"
            for line, imported in imported_packages(ast.parse(source), module)
            if upward(package, imported)]


def modules() -> list[str]:
    """Every module of the five packages, as a dotted name relative to the repository."""
    found = []
    for package in FLOORS:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            found += [os.path.relpath(os.path.join(folder, name), ROOT)[:-3].replace(os.sep, ".")
                      for name in files if name.endswith(".py")]
    return sorted(found)


def test_the_classifier_flags_upward_and_sideways_imports():
    nested = "def f():\n    from services.engine import LLMEngine\n"
    assert violations(nested, "gpu_worker.service") == ["gpu_worker.service:2 imports services"]
    assert violations("import gateway.app\n", "scheduler_svc.x") == ["scheduler_svc.x:1 imports gateway"]
    assert violations("from scheduler_svc import core\n", "shared.x") != []
    assert violations("from . import y\n", "gpu_worker.x") == []
    assert violations("import shared.keys\nimport torch\n", "gateway.x") == []
    assert violations("from gateway.cli import register\n", "services.cli") == []


def test_every_module_is_walked():
    names = set(modules())
    assert {"shared.lifecycle", "services.cli", "gpu_worker.tp.spawn",
            "scheduler_svc.core.scheduler", "gateway.app"} <= names


@pytest.mark.parametrize("module", modules())
def test_imports_point_down(module: str):
    with open(os.path.join(ROOT, *module.split(".")) + ".py", encoding="utf-8") as f:
        assert violations(f.read(), module) == []


def test_importing_shared_leaves_the_environment_alone():
    # OpenMP's wait policy is set by the entry points (shared/openmp.py), not at import
    code = ("import os; before = dict(os.environ); import shared, shared.lifecycle, "
            "shared.engine_layout, shared.cost_model, shared.protocol; "
            "print(dict(os.environ) == before)")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "True"
