"""`pacer`: one command line for every entry point. Each subcommand lives in its own module
with `register(subparsers)` and `run(args) -> int`; heavy imports stay inside `run`."""
from __future__ import annotations

import argparse
import importlib
import sys

from shared.errors import PacerError
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pacer", description=__doc__.split("\n")[0])
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
            if sub.choices[cmd].get_default("run") is None:
                sub.choices[cmd].set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    default_omp_wait_policy()       # before any subcommand loads torch
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except PacerError as e:
        print(f"pacer: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
