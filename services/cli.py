"""`pacer`: one command line for every entry point. Each subcommand lives in its own module
with `register(subparsers)` and `run(args) -> int`; heavy imports stay inside `run`."""
from __future__ import annotations

import argparse
import importlib
import re
import sys

from shared.errors import PacerError
from shared.exit_reason import note_exception, note_exit_reason, report_error
from shared.logging import output_gone
from shared.openmp import default_omp_wait_policy

COMMANDS = [
    "services.generate_cmd",
    "services.cost_cmd",
    "services.calibrate_cmd",
    "services.simulate_cmd",
    "gateway.cli",
    "scheduler_svc.cli",
    "gpu_worker.cli",
    "gpu_worker.kernel_build",
    "services.up",
    "services.bench_cmd",
    "services.inspect_cmd",
]


class _ShowsDefaults(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help where the default is a value worth showing
    and the help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or default is None or isinstance(default, bool)
                or default is argparse.SUPPRESS or default in ("", [], ())
                or "default" in text.lower()):
            return text
        return f"{text} (default: %(default)s)".lstrip()


def _showing_defaults(formatter: type) -> type:
    if issubclass(formatter, _ShowsDefaults):
        return formatter
    return type(f"{formatter.__name__}ShowingDefaults", (_ShowsDefaults, formatter), {})


class _Parser(argparse.ArgumentParser):
    """Keeps a usage error as the exit reason too (a service `pacer up` started with a flag
    it refuses exits 2 before anything else runs: its last error is argparse's line).

    A value that starts with '-' and then a digit (or inf, nan) is a value, not a flag:
    argparse takes only -1 and -.5 so, and `--kv-cache-memory -1GiB` or `--fabric -1e3`
    were "expected one argument", never reaching the check that names what is wrong. No
    flag of pacer's looks like a number."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"-(\.?\d|inf|nan)", re.IGNORECASE)

    def error(self, message: str):
        note_exit_reason(f"{self.prog}: {message}")
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    # the docstring's first sentence: the rest speaks to whoever adds a subcommand
    parser = _Parser(prog="pacer", description=__doc__.split(". ")[0] + ".")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        before = set(sub.choices)
        module.register(sub)
        for cmd in set(sub.choices) - before:
            sub.choices[cmd].formatter_class = _showing_defaults(sub.choices[cmd].formatter_class)
            if sub.choices[cmd].get_default("run") is None:
                sub.choices[cmd].set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    default_omp_wait_policy()       # before any subcommand loads torch
    args = build_parser().parse_args(argv)
    try:
        code = _run(args)
    except Exception as e:          # a bug: its traceback follows; `pacer up` names its end
        note_exception(e)
        raise
    # a command whose process must not end through the interpreter's finalization sets
    # `end_process` (a tensor-parallel worker rank: gpu_worker/cli.py); it exits with `code`
    end_process = getattr(args, "end_process", None)
    if end_process is not None:
        end_process(code)
    return code


def _run(args: argparse.Namespace) -> int:
    try:
        code = int(args.run(args) or 0)
        sys.stdout.flush()          # a closed pipe shows here, not at the interpreter's exit
        return code
    except PacerError as e:
        report_error(e)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (`pacer inspect ... | head`): stop quietly, as `cat` does;
        # the output points at /dev/null so that the interpreter's final flush raises nothing
        output_gone()
        return 141


if __name__ == "__main__":
    sys.exit(main())
