"""A service's last error, one line, for whoever started it: `pacer up` gives each child the
path of a file in $PACER_EXIT_REASON_FILE, and names what the file holds when the child dies
(the message of its `pacer: error: ...` line, or the last line of the exception that ended
it), rather than pointing at its log, mixed above with every other service's lines.

A file, not a pipe of the child's stderr: a supervisor slow to read a pipe would block the
child writing its log."""
from __future__ import annotations

import os
import sys
import traceback

EXIT_REASON_ENV = "PACER_EXIT_REASON_FILE"
MAX_CHARS = 500


def note_exit_reason(line: str) -> None:
    """Keep `line` (the last one kept wins) where $PACER_EXIT_REASON_FILE says, if it says."""
    path = os.environ.get(EXIT_REASON_ENV)
    if not path:
        return
    text = " ".join(line.split())
    if len(text) > MAX_CHARS:
        text = text[:MAX_CHARS - 3] + "..."
    try:
        with open(path, "w") as f:
            f.write(text + "\n")
    except OSError:
        pass                # it only helps tell why; the service's exit is what matters


def report_error(error: BaseException) -> None:
    """A `PacerError` for the person who started the process: its `pacer: error: ...` line on
    stderr, and kept as the exit reason."""
    print(f"pacer: error: {error}", file=sys.stderr, flush=True)
    note_exit_reason(str(error))


def note_exception(error: BaseException) -> None:
    """The exception's last line, as a traceback ends: "ValueError: ..."."""
    note_exit_reason(traceback.format_exception_only(type(error), error)[-1])


def read_exit_reason(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None
