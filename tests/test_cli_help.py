"""`pacer --help` and each command's `--help` say what a user gets: its own defaults, and no
note meant for whoever adds a subcommand."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

from services.cli import build_parser
from shared.exit_reason import EXIT_REASON_ENV, read_exit_reason


def _help(*command: str) -> str:
    parser = build_parser()
    for name in command:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return " ".join(parser.format_help().split())


def test_the_token_gap_target_shows_each_commands_own_default():
    # generate's default is off, the serving commands' auto; the help once read
    # "auto (default off: 1.5x the predicted decodes ...)" for generate
    for command, default in (("generate", "off"), ("up", "auto"), ("scheduler", "auto")):
        text = _help(command)
        start = text.index("--target-tbt-ms TARGET_TBT_MS", text.index("options:"))
        flag = text[start:text.index("--target-ttft-ms TARGET_TTFT_MS", start)]
        assert flag.rstrip().endswith(f"(default: {default})"), (command, flag)
        assert flag.count("default") == 1, (command, flag)


def test_both_commands_that_take_a_fabric_state_its_range():
    """`pacer cost --fabric` said only "a bandwidth in GB/s"; `pacer simulate`'s gave the
    range its check holds to, which both now read from one place."""
    from shared.fabric import FABRIC_RANGE_TEXT
    assert FABRIC_RANGE_TEXT == "from 0.001 to 1e6 GB/s"
    for command in ("cost", "simulate"):
        text = _help(command)
        start = text.index("--fabric FABRIC", text.index("options:"))
        assert FABRIC_RANGE_TEXT in text[start:text.index(" --", start + 1)], (command, text)


def test_the_top_level_help_is_a_whole_sentence_for_the_user():
    text = _help()
    assert "one command line for every entry point." in text, text
    assert "Each subcommand lives in its own module" not in text, text


def test_a_usage_error_is_kept_as_the_exit_reason(tmp_path):
    """`pacer up` names a dead service's last error from the file it gives it; a flag the
    service refuses ended it before any of that ran (its reason file stayed empty)."""
    reason = tmp_path / "reason"
    env = {**os.environ, EXIT_REASON_ENV: str(reason)}
    done = subprocess.run([sys.executable, "-m", "services.cli", "worker", "--rank", "two"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    kept = read_exit_reason(str(reason))
    assert kept is not None and kept.startswith("pacer worker: argument --rank"), kept
    assert "'two'" in kept, kept
