"""Paged KV block accounting from plain ints: allocation covers slots, failure changes nothing,
freeing returns every block, and check_integrity catches broken books."""
import pytest

from scheduler_svc.core import BlockManager, Request
from shared.sampling import SamplingParams


def make_request(request_id: str = "r", num_prompt: int = 10) -> Request:
    return Request(request_id, list(range(num_prompt)), SamplingParams(), arrival_index=0)


def test_allocate_covers_computed_plus_new_slots():
    bm = BlockManager(num_blocks=8, block_size=4)
    req = make_request()
    assert bm.allocate(req, 10) == [0, 1, 2]          # 10 slots -> 3 blocks of 4
    assert req.block_table == [0, 1, 2]
    req.num_computed_tokens = 10
    assert bm.allocate(req, 2) == []                   # slots 10, 11 fit in block 2
    req.num_computed_tokens = 12
    assert bm.allocate(req, 1) == [3]                  # slot 12 opens a fourth block
    assert req.block_table == [0, 1, 2, 3]
    assert bm.num_free_blocks == 4 and bm.usage == 0.5
    bm.check_integrity()


def test_allocate_fails_without_changing_anything():
    bm = BlockManager(num_blocks=3, block_size=4)
    a, b = make_request("a"), make_request("b")
    assert bm.allocate(a, 8) == [0, 1]
    assert bm.allocate(b, 5) is None                   # needs 2, 1 free
    assert b.block_table == [] and bm.num_free_blocks == 1
    assert bm.allocate(b, 4) == [2]
    assert bm.num_free_blocks == 0 and bm.usage == 1.0
    bm.check_integrity()


def test_free_returns_every_block_and_is_idempotent():
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = make_request("a"), make_request("b")
    bm.allocate(a, 5)
    bm.allocate(b, 3)
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 4
    bm.free(a)
    assert bm.num_free_blocks == 4
    bm.check_integrity()
    bm.free(b)
    assert bm.num_free_blocks == 6 and bm.usage == 0.0
    bm.check_integrity()


def test_freed_blocks_are_reused():
    bm = BlockManager(num_blocks=2, block_size=4)
    a, b = make_request("a"), make_request("b")
    bm.allocate(a, 8)
    bm.free(a)
    assert sorted(bm.allocate(b, 8)) == [0, 1]
    bm.check_integrity()


def test_blocks_needed_rounds_up():
    bm = BlockManager(num_blocks=1, block_size=16)
    assert [bm.blocks_needed(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=16)


def test_integrity_catches_a_block_in_two_tables():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = make_request("a"), make_request("b")
    bm.allocate(a, 4)
    bm.allocate(b, 4)
    b.block_table.append(a.block_table[0])             # corrupt: share without a ref count
    with pytest.raises(AssertionError, match="tables of"):
        bm.check_integrity()


def test_integrity_catches_a_used_block_in_the_free_queue():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_request("a")
    bm.allocate(a, 4)
    bm._free.append(a.block_table[0])
    with pytest.raises(AssertionError, match="free"):
        bm.check_integrity()


def test_integrity_catches_a_wrong_ref_count():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_request("a")
    bm.allocate(a, 4)
    bm._ref_counts[a.block_table[0]] = 2
    with pytest.raises(AssertionError, match="ref count"):
        bm.check_integrity()


def test_integrity_catches_a_lost_block():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm._free.popleft()                                 # neither free nor held by anyone
    with pytest.raises(AssertionError):
        bm.check_integrity()
