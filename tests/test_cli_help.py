"""`pacer --help` and each command's `--help` say what a user gets: its own defaults, and no
note meant for whoever adds a subcommand."""
from __future__ import annotations

import argparse

from services.cli import build_parser


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


def test_the_top_level_help_is_a_whole_sentence_for_the_user():
    text = _help()
    assert "one command line for every entry point." in text, text
    assert "Each subcommand lives in its own module" not in text, text
