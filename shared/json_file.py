"""JSON that a user gives: an object in a file named on the command line (a PacerError that
says which file and why), and a request body or a line of a prompts file (`parse_user_json`:
an InvalidRequestError that says why); and a file a command is to write (`check_output_path`)."""
from __future__ import annotations

import json
import os
import stat
from typing import Any

from shared.errors import InvalidRequestError, PacerError

# arrays and objects within each other: a JSON schema goes some tens deep; Python's parser and
# every recursive walk after it stop near a thousand with a RecursionError
MAX_JSON_DEPTH = 128


def json_type(value: Any) -> str:
    """What JSON calls a Python value's type (for errors about a client's JSON)."""
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}.get(type(value), type(value).__name__)


def read_json_object(path: str, what: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8-sig") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise PacerError(f"cannot read {what} {path}: {e}") from e
    if not isinstance(data, dict):
        raise PacerError(f"{what} {path} is not a JSON object")
    return data


def check_output_path(path: str, flag: str) -> None:
    """A file a command will write after a long run: refused before the run, not after it,
    where its folder is missing, it names a folder, or it cannot be opened for writing (a
    read-only file, a read-only file system, a name too long, a trailing slash). The file is
    opened without truncating it; one that was not there is removed again."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder):
        raise PacerError(f"{flag} {path}: " + ("is a folder" if os.path.isdir(path) else
                                               f"no folder {folder} to write it in"))
    if not os.access(folder, os.W_OK):
        raise PacerError(f"{flag} {path}: the folder {folder} is not writable")
    existed = os.path.exists(path)
    if existed and not stat.S_ISREG(os.stat(path).st_mode):
        return          # a device or a pipe (/dev/stdout, a FIFO): opening it may wait
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666))
    except OSError as e:
        raise PacerError(f"{flag} {path}: cannot be written ({e.strerror})") from None
    if not existed:
        os.remove(os.path.realpath(path))      # through a link: the file it made


def parse_user_json(text: str | bytes) -> Any:
    """The value `text` holds. Raises InvalidRequestError for text that is not JSON, nests
    arrays and objects more than MAX_JSON_DEPTH deep, or holds a string with a lone UTF-16
    surrogate (JSON's \\u escapes can write one; it is no text, and the tokenizer and every
    encoder after it refuse it). Its message has no subject: "is not valid JSON: ...", for
    the caller to say what was read."""
    too_deep = f"nests arrays and objects more than {MAX_JSON_DEPTH} deep"
    try:
        value = json.loads(text)
    except RecursionError:
        raise InvalidRequestError(too_deep) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"is not valid JSON: {e}") from None
    todo = [(value, 1)]                          # walked without recursion
    while todo:
        item, depth = todo.pop()
        if type(item) is str:
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidRequestError(f"has a string with a lone UTF-16 surrogate "
                                          f"({item[e.start]!a}): not text") from None
        elif type(item) in (dict, list):
            if depth > MAX_JSON_DEPTH:
                raise InvalidRequestError(too_deep)
            if type(item) is dict:
                todo.extend((key, depth) for key in item)
                item = item.values()
            # a list of numbers (token ids: up to ~10^6 in a body) has nothing to look at, and
            # is told so at C speed
            if not _SCALARS.issuperset(map(type, item)):
                todo.extend((child, depth + 1) for child in item)
    return value


_SCALARS = frozenset({int, float, bool, type(None)})
