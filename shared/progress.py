"""A request's progress record: the output tokens already streamed to its client, kept in
Redis so that a scheduler taking the request over resumes where the client is.

Worker rank 0 APPENDs each sampled token in the same pipeline that publishes it, before the
PUBLISH, so every token a client could have seen is recorded. The record is a string of
8-byte little-endian (index, token_id) pairs:

    index 0, token 504; index 1, token 3575  ->  00000000 f8010000 01000000 f70d0000

Indices make the record self-checking: a token appended twice (a step that a recompute ran
again) is kept once, and a record that expired and restarted mid-request is not mistaken for
the output's beginning. `decode_progress` returns the tokens at 0, 1, 2, ... up to the first
hole; anything after a hole is recomputed (greedy and seeded sampling give the same tokens).
"""
from __future__ import annotations

import struct

_PAIR = struct.Struct("<II")


def encode_progress(index: int, token_id: int) -> bytes:
    """One record entry: the token at output position `index`."""
    return _PAIR.pack(index, token_id)


def decode_progress(data: bytes | None) -> list[int]:
    """The output token ids at positions 0, 1, 2, ... up to the first missing position."""
    if not data:
        return []
    usable = len(data) - len(data) % _PAIR.size     # a torn last entry is ignored
    by_index: dict[int, int] = {}
    for index, token_id in _PAIR.iter_unpack(data[:usable]):
        by_index.setdefault(index, token_id)        # the first write wins, as at the gateway
    tokens: list[int] = []
    while len(tokens) in by_index:
        tokens.append(by_index[len(tokens)])
    return tokens
