"""Every bench/ script still imports and parses its arguments (`--help`, as a user runs it),
and every `python bench/X.py ...` command that README.md, docs/*.md or a script's own usage
lines quote names only flags that script accepts: the benchmarks' figures are cited with
their command lines, and a renamed API or flag broke them without any test failing."""
from __future__ import annotations

import ast
import functools
import glob
import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers_tiny_model import write_tiny_llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "bench", "*.py"))
                 if os.path.basename(p) not in ("__init__.py", "common.py"))
COMMAND = re.compile(r"bench/(\w+)\.py")
FLAG = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")


def run_bench(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join("bench", f"{script}.py"), *args],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                          capture_output=True, text=True, timeout=timeout)


# every script's --help in one interpreter (torch imported once, not 28 times: ~3 s each),
# each run as `python bench/X.py --help` runs it
_ALL_HELP = r"""
import contextlib, io, json, os, runpy, sys
out = {}
for script in sys.argv[1:]:
    path = os.path.join("bench", script + ".py")
    stdout, stderr = io.StringIO(), io.StringIO()
    sys.argv, sys.path[0] = [path, "--help"], os.path.abspath("bench")
    code = 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            code = e.code
        except BaseException as e:
            code, _ = 1, stderr.write(repr(e))
    out[script] = [code, stdout.getvalue(), stderr.getvalue()]
print(json.dumps(out))
"""


@functools.cache
def all_help() -> dict[str, list]:
    proc = subprocess.run([sys.executable, "-c", _ALL_HELP, *SCRIPTS], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def help_text(script: str) -> str:
    code, stdout, stderr = all_help()[script]
    assert code in (0, None), f"bench/{script}.py --help: {stderr[-3000:]}"
    assert stdout.startswith("usage:"), stdout[:500]
    return stdout


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script):
    help_text(script)


def _commands(text: str) -> list[tuple[str, str]]:
    """(script, the text up to the next bench/ script) for each bench/X.py named in `text`,
    shell comments left out."""
    text = re.sub(r"\s#.*", "", text)
    found = list(COMMAND.finditer(text))
    return [(m.group(1), text[m.end():found[i + 1].start() if i + 1 < len(found) else None])
            for i, m in enumerate(found)]


def quoted_commands() -> list[tuple[str, str, str]]:
    """(where, script, its arguments) for each bench command in the docs' code (inline spans
    and fenced blocks) and in the scripts' own usage lines (`python bench/X.py ...` and the
    indented lines after it)."""
    out = []
    for doc in ["README.md", *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
        with open(os.path.join(ROOT, doc)) as f:
            text = f.read()
        spans = re.findall(r"```[^\n]*\n(.*?)```", text, re.S)
        text = re.sub(r"```.*?```", "", text, flags=re.S)
        spans += re.findall(r"`([^`]+)`", text)
        out += [(os.path.basename(doc), script, args)
                for span in spans for script, args in _commands(span.replace("\\\n", " "))]
    for script in SCRIPTS:
        with open(os.path.join(ROOT, "bench", f"{script}.py")) as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
        usage = re.findall(r"^ *python bench/\w+\.py.*(?:\n {6,}\S.*)*", doc, re.M)
        out += [(f"bench/{script}.py", named, args)
                for line in usage for named, args in _commands(line)]
    return out


def test_quoted_commands_name_flags_the_scripts_accept():
    commands = quoted_commands()
    assert len(commands) > 100, len(commands)       # the docs' tables and sections were read
    wrong = [f"{where}: bench/{script}.py {flag}" for where, script, args in commands
             if script in SCRIPTS for flag in FLAG.findall(args)
             if flag not in FLAG.findall(help_text(script))]
    assert not wrong, "flags the scripts no longer accept:\n" + "\n".join(wrong)


# The smallest run of a bench that once broke at run time (an API renamed under it), and a
# refusal; the benches that start a served cluster or load the default model are left to the
# --help check above (each such run took 12-23 s of the suite's 15 minutes).
def test_sampling_bench_runs(tmp_path):
    proc = run_bench("sampling", "--model", write_tiny_llama(tmp_path / "tiny"), "--rows", "2",
                     "--repeats", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "greedy, JSON schema" in proc.stdout, proc.stdout


def test_interference_refuses_long_prompts_shorter_than_their_spread():
    proc = run_bench("interference", "--long-len", "32")
    assert proc.returncode == 2
    assert "--long-len must be > 100" in proc.stderr.splitlines()[-1], proc.stderr
