"""The name of a full KV block: a hash chained over its parent's hash and its token ids
(docs/design.md#prefix-caching). The scheduling core indexes its prefix cache by it; the
gateway's router computes the same names from a prompt to ask which engine instance holds
its prefix (docs/design.md#cache-aware-routing), and a P/D prefill scheduler to remember which
decode instance holds it; both keep a prefix on its holder unless that one is clearly
overloaded (`overloaded`). Pure: stdlib only."""
from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

# The parent hash of a request's first block. Versioned so that a change in how blocks are
# hashed can never match hashes another process published under the old rule.
ROOT_HASH = hashlib.sha256(b"pacer prefix cache v1").digest()

_BIG_ENDIAN = sys.byteorder == "big"

# a prefix stays on the instance holding it unless that one has more than OVERLOAD_FACTOR
# times the least loaded one's requests in flight, plus OVERLOAD_MARGIN
OVERLOAD_FACTOR = 2
OVERLOAD_MARGIN = 4


def overloaded(load: int, least: int) -> bool:
    """Whether an instance holding a prompt's prefix with `load` requests in flight is too
    busy to keep it, beside the least loaded candidate's `least`: one hot prefix must not pin
    all traffic on one instance while another idles."""
    return load > OVERLOAD_FACTOR * least + OVERLOAD_MARGIN


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of a full block: sha256 over the parent's hash and the token ids (little-endian
    int64), so it is the same in every process and on every machine, and colliding it on
    purpose is as hard as colliding sha256."""
    ids = array("q", token_ids)
    if _BIG_ENDIAN:
        ids.byteswap()
    return hashlib.sha256(parent + ids.tobytes()).digest()


def block_hashes(token_ids: Sequence[int], block_size: int, parent: bytes = ROOT_HASH
                 ) -> list[bytes]:
    """The chained hashes of every full block of `token_ids`."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


def cacheable_hashes(prompt_token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The hashes of the blocks a prompt could find cached: the full blocks lying entirely
    before its last token (whose row always runs, for its logits)."""
    return block_hashes(prompt_token_ids[:(len(prompt_token_ids) - 1) // block_size
                                          * block_size], block_size)
