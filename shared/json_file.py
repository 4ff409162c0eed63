"""Reading a JSON object that a user named on the command line, with a PacerError that says
which file and why."""
from __future__ import annotations

import json
from typing import Any

from shared.errors import PacerError


def read_json_object(path: str, what: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise PacerError(f"cannot read {what} {path}: {e}") from e
    if not isinstance(data, dict):
        raise PacerError(f"{what} {path} is not a JSON object")
    return data
