"""Paged KV block accounting from plain ints: allocation covers slots, failure changes nothing,
freeing returns every block, and check_integrity catches broken books."""
import pytest

from scheduler_svc.core import BlockManager, Request
from scheduler_svc.core.block_manager import ROOT_HASH, block_hash, block_hashes
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


def test_blocks_set_aside_go_to_no_request_until_released():
    # a P/D reservation given up while a prefill worker may still write into its blocks
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = make_request("a"), make_request("a")     # the same id, recomputed in other blocks
    assert bm.allocate(a, 10) == [0, 1, 2]
    bm.set_aside(a)
    assert a.block_table == [] and bm.num_free_blocks == 1 and bm.num_aside_blocks == 3
    bm.check_integrity()
    assert bm.allocate(b, 5) is None                   # needs 2 blocks; only 3 is free
    assert bm.allocate(b, 4) == [3]
    bm.free(b)
    bm.check_integrity()
    assert bm.num_aside_blocks == 3
    assert bm.release_aside("a") == 3 and bm.release_aside("a") == 0
    assert bm.num_free_blocks == 4 and bm.num_aside_blocks == 0
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
    bm._free_plain.append(a.block_table[0])
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
    bm._free_plain.popleft()                                 # neither free nor held by anyone
    with pytest.raises(AssertionError):
        bm.check_integrity()


# ---- prefix caching ----------------------------------------------------------------------

def computed(bm: BlockManager, request: Request, num_tokens: int) -> None:
    """Allocate and mark computed (what Scheduler.update does), registering full blocks."""
    assert bm.allocate(request, num_tokens - request.num_computed_tokens) is not None
    request.num_computed_tokens = num_tokens
    bm.cache_computed_blocks(request)


def tokens_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(), arrival_index=0)


def test_block_hash_is_a_chain_and_stable():
    a = block_hashes(list(range(12)), 4)
    assert len(a) == 3 and len(set(a)) == 3
    assert block_hashes(list(range(8)) + [99, 9, 10, 11], 4)[:2] == a[:2]
    assert block_hashes([99] + list(range(1, 12)), 4)[1] != a[1]    # parent differs
    # a fixed value: the hash must not depend on the process (router, restarts)
    assert block_hashes([1, 2, 3, 4], 4)[0] == block_hash(ROOT_HASH, [1, 2, 3, 4])
    assert block_hash(ROOT_HASH, [1, 2, 3, 4]).hex()[:16] == "790643a7d3f41db4"
    assert block_hash(ROOT_HASH, [1, 2]) != block_hash(ROOT_HASH, [2, 1])


def test_a_second_request_takes_the_computed_full_blocks_of_a_shared_prefix():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = tokens_request("a", list(range(10)))
    computed(bm, a, 10)                                  # blocks 0, 1 full; 2 partial
    assert bm.num_cached_blocks == 2
    b = tokens_request("b", list(range(9)) + [50, 51])   # shares 9 tokens: two full blocks
    hit = bm.find_cached_prefix(b)
    assert hit == a.block_table[:2]
    b.num_computed_tokens = 8
    new = bm.allocate(b, 3, hit)
    assert new[:2] == hit and len(b.block_table) == 3 and b.block_table[2] not in a.block_table
    assert bm._ref_counts[hit[0]] == 2 and b.num_cached_blocks == 2
    bm.check_integrity()
    c = tokens_request("c", [7] + list(range(1, 10)))    # first block differs: no hit at all
    assert bm.find_cached_prefix(c) == []


def test_the_last_token_is_never_a_hit_even_on_a_block_boundary():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = tokens_request("a", list(range(8)))
    computed(bm, a, 8)
    assert bm.num_cached_blocks == 2
    same = tokens_request("same", list(range(8)))         # 8 = 2 blocks exactly
    assert bm.find_cached_prefix(same) == a.block_table[:1]   # the last block is recomputed
    one_more = tokens_request("more", list(range(9)))
    assert bm.find_cached_prefix(one_more) == a.block_table[:2]


def test_blocks_are_registered_only_when_full_and_computed():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = tokens_request("a", list(range(10)))
    assert bm.allocate(a, 10) is not None                 # scheduled, not computed yet
    bm.cache_computed_blocks(a)
    assert bm.num_cached_blocks == 0
    a.num_computed_tokens = 6                             # one chunk done
    bm.cache_computed_blocks(a)
    assert bm.num_cached_blocks == 1
    assert bm.find_cached_prefix(tokens_request("b", list(range(10)))) == a.block_table[:1]


def test_freed_blocks_keep_their_hash_and_are_evicted_least_recently_used():
    bm = BlockManager(num_blocks=3, block_size=2)
    a, b = tokens_request("a", [1, 2, 3, 4, 5]), tokens_request("b", [9, 8, 7, 6, 5])
    computed(bm, a, 5)                    # 3 blocks, 2 cached
    bm.free(a)
    computed(bm, b, 4)                    # 2 blocks: the one plain block, then evicts the LRU
    assert bm.num_free_blocks == 1 and bm.num_cached_blocks == 3
    # a's blocks were freed tail first, so its tail cached block was the LRU and went first
    assert bm.find_cached_prefix(tokens_request("a2", [1, 2, 3, 4, 5])) == [0]
    bm.free(b)
    assert bm.num_free_blocks == 3
    bm.check_integrity()
    # a hit on a free cached block takes it off the free list; it is not also handed out
    a3 = tokens_request("a3", [1, 2, 3, 4, 5])
    hit = bm.find_cached_prefix(a3)
    a3.num_computed_tokens = 2
    assert bm.allocate(a3, 3, hit) is not None and a3.block_table[0] == 0
    assert len(set(a3.block_table)) == 3
    bm.check_integrity()


def test_a_hit_that_does_not_fit_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = tokens_request("a", [1, 2, 3])
    computed(bm, a, 3)
    bm.free(a)                              # 1 cached block + 2 plain, all free
    b = tokens_request("b", [1, 2, 3, 4, 5, 6, 7])
    hit = bm.find_cached_prefix(b)
    assert hit == [a_block := hit[0]]
    b.num_computed_tokens = 2
    assert bm.allocate(b, 5, hit) is None   # 4 blocks needed, the hit + 2 free others
    assert bm.num_free_blocks == 3 and b.block_table == [] and bm._ref_counts[a_block] == 0
    bm.check_integrity()


def test_reset_forgets_every_block_and_caching_off_never_hits():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = tokens_request("a", [1, 2, 3, 4, 5])
    computed(bm, a, 5)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 4
    assert bm.find_cached_prefix(tokens_request("b", [1, 2, 3, 4, 5])) == []
    bm.check_integrity()
    off = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    computed(off, a, 5)
    assert off.num_cached_blocks == 0
    assert off.find_cached_prefix(tokens_request("b", [1, 2, 3, 4, 5])) == []


def test_integrity_catches_a_write_into_a_cached_block():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = tokens_request("a", [1, 2, 3, 4, 5])
    computed(bm, a, 5)
    a.num_computed_tokens = 1                # as if block 0 were still to be written
    with pytest.raises(AssertionError, match="write into cached block"):
        bm.check_integrity()


def test_no_prefix_caching_flag_reaches_the_scheduler_and_pacer_up_passes_it_on():
    import argparse

    from services.up import engine_flags
    from shared.engine_args import EngineArgs
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    assert EngineArgs.from_cli(p.parse_args([])).enable_prefix_caching
    off = EngineArgs.from_cli(p.parse_args(["--no-prefix-caching"]))
    assert not off.enable_prefix_caching
    assert "--no-prefix-caching" in engine_flags(off)
    assert "--no-prefix-caching" not in engine_flags(EngineArgs(dtype="float32"))
    assert not EngineArgs.from_cli(p.parse_args(engine_flags(off))).enable_prefix_caching
