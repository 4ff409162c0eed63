"""The block digests P/D checks received K/V with (docs/design.md#kv-integrity): the same
blocks give the same digest, and a write that did not land — a whole block, one layer's K, a
1 KiB span, only a block's last bytes — or that landed in another block, changes it."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.kv_cache import block_digests
from shared.kv_layout import DIGEST_STRIDE_BYTES

BLOCKS = [3, 4, 9]


@pytest.fixture(params=[torch.float32, torch.bfloat16])
def pool(request):
    g = torch.Generator().manual_seed(0)
    # [L=4, K|V, N=12 blocks, block 16, 2 KV heads, hd 64]: 8 KiB a float32 block
    return torch.randn((4, 2, 12, 16, 2, 64), generator=g).to(request.param)


def lose(pool: torch.Tensor, layer: int, kv: int, block: int, start: int, nbytes: int):
    """A copy of the pool with `nbytes` of one (layer, K|V, block) from byte `start` zeroed."""
    out = pool.clone()
    raw = out[layer, kv, block].view(-1).view(torch.uint8)
    raw[start:start + nbytes] = 0
    return out


def test_equal_blocks_give_equal_digests_and_each_block_its_own(pool):
    copy = pool.clone()
    assert block_digests(copy, BLOCKS) == block_digests(pool, BLOCKS)
    assert len(set(block_digests(pool, BLOCKS))) == len(BLOCKS)


@pytest.mark.parametrize("what,layer,kv,start,nbytes", [
    ("a whole block of one layer's K", 0, 0, 0, None),
    ("one layer's V, a 1 KiB span mid-block", 2, 1, 3 * 1024 + 100, DIGEST_STRIDE_BYTES),
    ("only the block's last 4 bytes", 3, 0, -4, 4),
])
def test_a_write_that_did_not_land_changes_the_digest(pool, what, layer, kv, start, nbytes):
    size = pool[0, 0, 0].numel() * pool.element_size()
    start = start % size
    lost = lose(pool, layer, kv, BLOCKS[1], start, nbytes or size)
    before, after = block_digests(pool, BLOCKS), block_digests(lost, BLOCKS)
    assert after[1] != before[1], what
    assert after[0] == before[0] and after[2] == before[2]


def test_a_block_written_elsewhere_changes_both_digests(pool):
    moved = pool.clone()
    moved[:, :, BLOCKS[2]] = pool[:, :, BLOCKS[0]]       # block 9's write went to block 3's place
    moved[:, :, BLOCKS[0]] = 0
    before, after = block_digests(pool, BLOCKS), block_digests(moved, BLOCKS)
    assert after[0] != before[0] and after[2] != before[2]


@pytest.mark.parametrize("what", ["layers in reverse order", "one layer's K and V swapped",
                                  "two layers' K swapped"])
def test_a_block_whose_layers_or_k_and_v_landed_in_each_others_place_changes_it(pool, what):
    """The offsets of a transfer are per (layer, K|V): a write that lands in another layer's
    place, or in V's for K's, leaves the same words in the block; the digest weighs each
    place on its own, so it sees the move."""
    moved, b = pool.clone(), BLOCKS[1]
    if what == "layers in reverse order":
        moved[:, :, b] = pool[:, :, b].flip(0)
    elif what == "one layer's K and V swapped":
        moved[0, 0, b], moved[0, 1, b] = pool[0, 1, b], pool[0, 0, b]
    else:
        moved[1, 0, b], moved[2, 0, b] = pool[2, 0, b], pool[1, 0, b]
    before, after = block_digests(pool, BLOCKS), block_digests(moved, BLOCKS)
    assert after[1] != before[1], what
    assert after[0] == before[0] and after[2] == before[2]
