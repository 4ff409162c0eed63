"""Structured outputs: what a request's output must match, as vLLM's `structured_outputs`
names it, and its grammar for the worker's matcher (docs/design.md#structured-outputs).

A request carries its constraint as a (kind, text) pair of strings, so it travels in a plan
like any other sampling parameter:

- ("json", a JSON schema's text): OpenAI's `response_format` json_schema; json_object is the
  schema {"type": "object"};
- ("regex", a regular expression);
- ("choice", a JSON list of strings): the output is one of them;
- ("grammar", a Lark or GBNF grammar).

The grammars are llguidance's: compiled lazily on the worker, a token mask a step.
"""
from __future__ import annotations

import functools
import json
from typing import Any, Callable

from shared.errors import InvalidRequestError
from shared.json_file import json_type, parse_user_json

KINDS = ("json", "regex", "choice", "grammar")
# vLLM's options of structured_outputs, for a JSON schema: compact JSON (no whitespace between
# its tokens); whitespace of a given pattern; every object closed to the properties it names
JSON_OPTIONS = ("disable_any_whitespace", "whitespace_pattern", "disable_additional_properties")
ANY_JSON_OBJECT = '{"type": "object"}'
# what a field of one kind (guided_json, ...) holds, for its error
_SPEC_SHAPES = {"json": "a JSON schema (an object, or its JSON text)", "regex": "a string",
                "choice": "a non-empty list of non-empty strings", "grammar": "a string"}
MAX_SPEC_CHARS = 100_000
_LLGUIDANCE_FORMAT = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def structured_pair(value: Any, name: str | None = None) -> tuple[str, str] | None:
    """(kind, text) from vLLM's shape, {kind: spec} with one kind (a JSON schema or the
    choices as JSON values; {"json_object": true} for any object) and vLLM's options for JSON
    (JSON_OPTIONS), or from a (kind, text) pair; None for none. Raises InvalidRequestError on
    anything else; `name`: what the request calls the spec, for those errors (by default
    structured_outputs.KIND)."""
    if value is None:
        return None
    if isinstance(value, dict):
        options = {k: value[k] for k in JSON_OPTIONS if value.get(k) not in (None, False)}
        given = {k: v for k, v in value.items()
                 if k not in JSON_OPTIONS and v is not None and v is not False}
        unknown = sorted(set(given) - set(KINDS) - {"json_object"})
        if unknown:
            raise InvalidRequestError(f"structured_outputs does not take {unknown[0]!r} (it "
                                      f"takes one of {', '.join(KINDS)} or json_object, and "
                                      f"{', '.join(JSON_OPTIONS)})")
        if set(given) == {"json_object"}:
            given = {"json": ANY_JSON_OBJECT}
        if len(given) != 1:
            raise InvalidRequestError(
                f"structured_outputs takes exactly one of {', '.join(KINDS)} or json_object, "
                f"got {sorted(given) or 'none'}")
        kind, spec = next(iter(given.items()))
        if kind == "json":
            spec = json.dumps(_with_options(spec, options, name or "structured_outputs.json")) \
                if options or isinstance(spec, dict) else spec
        elif kind == "choice":
            if not isinstance(spec, list) or not spec or \
                    not all(isinstance(c, str) and c for c in spec):
                raise InvalidRequestError(f"{name or 'structured_outputs.choice'} must be a "
                                          "non-empty list of non-empty strings")
            spec = json.dumps(spec)
        value = (kind, spec)
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and value[0] in KINDS
            and isinstance(value[1], str)):
        if name and isinstance(value, tuple) and value[0] in KINDS:     # a field of one kind
            raise InvalidRequestError(f"{name} must be {_SPEC_SHAPES[value[0]]}, got a JSON "
                                      f"{json_type(value[1])}")
        raise InvalidRequestError(f"structured_outputs must be {{kind: spec}} with kind one of "
                                  f"{', '.join(KINDS)}, got {value!r:.200}")
    kind, text = value
    name = name or f"structured_outputs.{kind}"
    if not text or len(text) > MAX_SPEC_CHARS:
        raise InvalidRequestError(f"{name} must be 1-{MAX_SPEC_CHARS} characters")
    check_grammar(kind, text, name)
    return kind, text


def _with_options(schema: Any, options: dict, name: str) -> dict:
    """A JSON schema with vLLM's options written into it, as llguidance reads them; `name`:
    the schema's, for errors."""
    if isinstance(schema, str):
        try:
            schema = parse_user_json(schema)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"{name} {e}") from None
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{name} must be a JSON schema (an object)")
    if options.get("disable_additional_properties"):
        schema = closed_schema(schema)
    guidance = dict(schema.get("x-guidance") or {})
    if options.get("disable_any_whitespace"):
        guidance["whitespace_flexible"] = False
    if "whitespace_pattern" in options:       # "" too: no whitespace at all
        if not isinstance(options["whitespace_pattern"], str):
            raise InvalidRequestError("structured_outputs.whitespace_pattern must be a string")
        guidance["whitespace_pattern"] = options["whitespace_pattern"]
    return {**schema, "x-guidance": guidance} if guidance else schema


# where JSON Schema puts subschemas: {name: schema}, one schema, [schema, ...]
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
                  "propertyNames", "additionalItems", "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def _map_subschemas(schema: dict, fn: Callable[[Any], Any]) -> dict:
    """A copy of the schema with `fn` applied to each of its direct subschemas."""
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: fn(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = fn(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [fn(sub) for sub in out[key]]
    return out


def closed_schema(schema: Any) -> Any:
    """The schema with additionalProperties false on every object schema that leaves it
    open (vLLM's disable_additional_properties; OpenAI's `strict`), subschemas included
    wherever JSON Schema puts them."""
    if not isinstance(schema, dict):
        return schema
    out = _map_subschemas(schema, closed_schema)
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind)
    if ("properties" in out or is_object) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def rebased_schema(schema: Any, pointer: str) -> Any:
    """The schema as it reads when placed at `pointer` (a JSON pointer, e.g. "/$defs/f") in
    a larger one: each local `$ref` ("#", "#/$defs/X", ...) pointed where it pointed when the
    schema was a root of its own."""
    if not isinstance(schema, dict):
        return schema
    out = _map_subschemas(schema, lambda sub: rebased_schema(sub, pointer))
    ref = out.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = "#" + pointer + ref[1:]
    return out


@functools.lru_cache(maxsize=256)
def grammar(kind: str, text: str) -> str:
    """llguidance's grammar for a valid (kind, text)."""
    import llguidance
    if kind == "json":
        json.loads(text)              # llguidance takes bad JSON text and fails later
    return llguidance.grammar_from(_LLGUIDANCE_FORMAT[kind], text)


def check_grammar(kind: str, text: str, name: str) -> None:
    """Raises InvalidRequestError, saying why (`name`: what the request calls the text), if
    (kind, text) is no grammar llguidance can serve."""
    error = _grammar_error(kind, text)
    if error:
        raise InvalidRequestError(f"{name} is not valid: {error.strip():.500}")


@functools.lru_cache(maxsize=256)
def _grammar_error(kind: str, text: str) -> str | None:
    """Why llguidance cannot serve (kind, text), or None (checked once per constraint)."""
    from llguidance import LLMatcher
    try:
        return LLMatcher.validate_grammar(grammar(kind, text)) or None
    except (ValueError, TypeError) as e:      # json.JSONDecodeError is a ValueError
        return str(e)
