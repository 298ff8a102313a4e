"""The small print of the core's API that the rule tests leave implicit: argument passing,
refusals, counters, no-op cases and edge shapes (each test here killed mutants that survived
``make mutation``; see benchmarks/RESULTS.md)."""

from __future__ import annotations

import pytest
from core_helpers import admit, decode, finish

from prefixserve.core import (
    BlockPool,
    CacheRequest,
    FreeBlockQueue,
    KVCacheBlock,
    KVCacheManager,
    PrefixCacheStats,
    PrefixCachingMetrics,
    SlidingWindowKVCacheManager,
    make_kv_cache_manager,
)

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("window", [None, 4])
def test_make_kv_cache_manager_passes_every_setting(window: int | None) -> None:
    manager = make_kv_cache_manager(8, 4, False, "xxhash", sliding_window=window,
                                    use_eagle=True, log_stats=False)
    assert (manager.num_blocks, manager.block_size, manager.enable_caching) == (8, 4, False)
    assert (manager.hash_algo, manager.use_eagle, manager.log_stats) == ("xxhash", True, False)
    assert manager.sliding_window == window
    default = make_kv_cache_manager(8, 4, sliding_window=window)
    assert (default.enable_caching, default.hash_algo, default.use_eagle, default.log_stats) == (
        True, "builtin", False, True)
    direct = SlidingWindowKVCacheManager(8, 4, False, "sha256", sliding_window=3, use_eagle=True,
                                         log_stats=False)
    assert (direct.hash_algo, direct.use_eagle, direct.log_stats) == ("sha256", True, False)
    assert SlidingWindowKVCacheManager(8, 4, sliding_window=3).log_stats is True


def test_bad_settings_and_calls_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="needs a sliding_window"):
        SlidingWindowKVCacheManager(8, 4, sliding_window=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sliding_window must be positive, got 0"):
        SlidingWindowKVCacheManager(8, 4, sliding_window=0)
    with pytest.raises(ValueError, match="block_size must be positive, got 0"):
        KVCacheManager(8, 0)
    manager = KVCacheManager(8, 4)
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"num_new_tokens must be positive, got {bad}"):
            manager.allocate_slots(CacheRequest("r", [1, 2]), bad)
    with pytest.raises(ValueError, match="num_blocks must be at least 2"):
        BlockPool(1, reserve_null_block=True)


def test_record_lookup_follows_the_rules_of_the_counting_lookup() -> None:
    manager = KVCacheManager(8, 4)
    request = CacheRequest("r", list(range(9)))
    manager.record_lookup(request, 1)
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits, stats.query_tokens, stats.hit_tokens) == (
        1, 2, 1, 9, 4)
    for quiet in (KVCacheManager(8, 4, log_stats=False), KVCacheManager(8, 4, False)):
        quiet.record_lookup(request, 1)
        assert quiet.make_prefix_cache_stats() == PrefixCacheStats()
    manager.record_lookup(CacheRequest("p", list(range(9)), wants_prompt_logprobs=True), 0)
    assert manager.make_prefix_cache_stats() == PrefixCacheStats()
    manager.get_computed_blocks(request, record_stats=False)
    assert manager.make_prefix_cache_stats() == PrefixCacheStats()


def test_free_forgets_the_request_and_is_a_no_op_for_an_unknown_one() -> None:
    manager = KVCacheManager(8, 4)
    manager.free(CacheRequest("nobody", [1]))
    request = CacheRequest("r", list(range(9)))
    admit(manager, request)
    assert manager.num_cached_block["r"] == 2
    manager.free(request)
    assert "r" not in manager.num_cached_block and "r" not in manager.req_to_blocks
    assert "r" in manager.req_to_block_hashes  # the chain stays until free_block_hashes
    manager.free_block_hashes(request)
    assert "r" not in manager.req_to_block_hashes


def test_with_caching_off_blocks_are_freed_in_table_order() -> None:
    manager = KVCacheManager(6, 4, enable_caching=False)
    request = CacheRequest("r", list(range(12)))
    admit(manager, request)
    table = manager.get_block_ids(request)
    finish(manager, request)
    assert [b.block_id for b in manager.block_pool.free_queue][-3:] == table


def test_allocating_fewer_tokens_than_the_table_holds_takes_no_block() -> None:
    """A table allocated ahead (a whole prompt at once) and a later step inside it: the step
    needs no block and the free count does not move."""
    manager = KVCacheManager(8, 4)
    request = CacheRequest("r", list(range(12)))
    assert manager.allocate_slots(request, 12) is not None
    free = manager.num_free_blocks
    request.num_computed_tokens = 1
    assert manager.allocate_slots(request, 1) == []
    assert manager.num_free_blocks == free == 5


def test_a_block_sliding_out_makes_room_for_the_next_one_in_a_full_pool() -> None:
    """Window 5 at block size 4, 2 usable blocks: at position 8 block 0 leaves the window and
    block 2 is needed; the pool is full, the block that leaves pays for the new one."""
    manager = SlidingWindowKVCacheManager(3, 4, sliding_window=5)
    request = CacheRequest("r", list(range(7)))
    admit(manager, request)
    assert manager.num_free_blocks == 0
    decode(manager, request, [7, 8])  # position 8: block 0 out and block 2 in, in one step
    assert [b.is_null for b in manager.req_to_blocks["r"]] == [True, False, False]
    finish(manager, request)
    assert manager.num_free_blocks == 2


def test_one_block_sliding_out_does_not_pay_for_two() -> None:
    """A chunk of 8 tokens needs 2 new blocks in a full pool while only block 0 slides out: no
    room, nothing changes."""
    manager = SlidingWindowKVCacheManager(4, 4, sliding_window=4)  # 3 usable
    request = CacheRequest("r", list(range(20)))
    request.num_computed_tokens = 0
    assert manager.allocate_slots(request, 9) is not None  # blocks 0-2: the pool is full
    request.num_computed_tokens = 9
    table = list(manager.req_to_blocks["r"])
    assert manager.allocate_slots(request, 8) is None  # blocks 3-4 needed, block 0-1 out
    assert manager.req_to_blocks["r"] == table


def test_pool_reports_and_lookups_on_single_and_shared_keys() -> None:
    pool = BlockPool(4)
    [block] = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [("k", (1,), None)], 0, 1)
    assert pool.cached_blocks(("k", (1,), None)) == [block]
    assert pool.cached_blocks(("k", (2,), None)) == [] and pool.cached_blocks("other") == []
    assert pool.get_usage() == pytest.approx(0.25)
    assert pool.reset_prefix_cache() is True
    with_null = BlockPool(5, reserve_null_block=True)
    assert with_null.get_num_free_blocks() == 4 and with_null.get_usage() == 0.0
    with_null.get_new_blocks(1)
    assert with_null.get_usage() == pytest.approx(0.25)


def test_precomputed_hashes_longer_than_one_character_are_map_keys_as_they_are() -> None:
    manager = KVCacheManager(8, 4)
    pool = manager.block_pool
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, ["ab", "ac"], 0, 2)
    pool.free_blocks(blocks)
    assert manager.get_computed_blocks(
        CacheRequest("r", range(9), block_hashes=["ab", "ac"])) == (blocks, 8)


def test_metrics_accumulate_tokens_and_keep_the_newest_period() -> None:
    metrics = PrefixCachingMetrics()
    assert metrics.max_recent_requests == 1000
    assert (metrics.query_tokens, metrics.hit_tokens) == (0, 0)
    metrics.observe(PrefixCacheStats(requests=1, queries=2, hits=1, query_tokens=9,
                                     hit_tokens=4))
    metrics.observe(PrefixCacheStats(requests=1, queries=2, hits=2, query_tokens=9,
                                     hit_tokens=8))
    assert (metrics.query_tokens, metrics.hit_tokens) == (18, 12)
    small = PrefixCachingMetrics(max_recent_requests=2)
    for hits in (0, 1, 2):  # periods of 2 requests each: only the newest stays in the window
        small.observe(PrefixCacheStats(requests=2, queries=4, hits=hits))
    assert small.window_requests == 2 and small.hit_rate == pytest.approx(2 / 4)
    big = PrefixCachingMetrics(max_recent_requests=1)
    big.observe(PrefixCacheStats(requests=5, queries=5, hits=5))
    assert big.window_requests == 5 and big.hit_rate == 1.0  # one period is always kept


def test_free_block_queue_keeps_order_through_every_operation() -> None:
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    assert [b.block_id for b in queue] == [0, 1, 2, 3] and len(queue) == 4
    assert queue.popleft() is blocks[0] and len(queue) == 3
    queue.remove(blocks[2])
    queue.append(blocks[0])
    assert [b.block_id for b in queue] == [1, 3, 0] and len(queue) == 3
    assert queue.tail.prev_free is blocks[0] and blocks[0].next_free is queue.tail
    assert queue.head.next_free is blocks[1] and blocks[1].prev_free is queue.head
    for _ in range(3):
        queue.popleft()
    assert len(queue) == 0 and list(queue) == []
    with pytest.raises(ValueError, match="no free block"):
        queue.popleft()
    empty = FreeBlockQueue([])
    assert empty.head.next_free is empty.tail and empty.tail.prev_free is empty.head


def test_a_new_block_and_a_new_pool_start_empty() -> None:
    block = KVCacheBlock(7)
    assert (block.block_id, block.ref_cnt, block.block_hash, block.hash_value) == (7, 0, None,
                                                                                  None)
    assert block.prev_free is block and block.next_free is block and block.is_null is False
    assert repr(block) == "KVCacheBlock(id=7, ref_cnt=0, cached=False)"
    pool = BlockPool(3)
    assert (pool.num_blocks, pool.null_block) == (3, None)
    assert [b.block_id for b in pool.free_queue] == [0, 1, 2]
    assert pool.cached_block_hash_to_block == {}
    with pytest.raises(ValueError, match="num_blocks must be at least 1, got 0"):
        BlockPool(0)
    with_null = BlockPool(3, reserve_null_block=True)
    assert with_null.null_block is with_null.blocks[0] and with_null.blocks[0].is_null
    assert [b.block_id for b in with_null.free_queue] == [1, 2]


def test_metrics_sum_retained_hits_per_level_across_steps_and_resets() -> None:
    """Bug: the per-level retained-hit counters overwritten, subtracted, or read from another
    level instead of added to (the ``prefix_cache_retained_hits`` metric would be wrong)."""
    metrics = PrefixCachingMetrics()
    assert metrics.retained_hits == {}
    metrics.observe(PrefixCacheStats(requests=1, queries=4, hits=3, retained_hits={80: 2, 20: 1}))
    metrics.observe(PrefixCacheStats(requests=1, queries=2, hits=2, retained_hits={80: 2}))
    metrics.observe(PrefixCacheStats(reset=True, retained_hits={20: 3}))  # counters survive
    assert metrics.retained_hits == {80: 4, 20: 4}


def test_an_explicit_prompt_length_is_kept_zero_included() -> None:
    """``num_prompt_tokens`` defaults to the token count only when left at -1. Bug: an explicit
    0 (every token generated, none from the prompt) replaced by the token count."""
    assert CacheRequest("a", [1, 2, 3]).num_prompt_tokens == 3
    assert CacheRequest("b", [1, 2, 3], num_prompt_tokens=0).num_prompt_tokens == 0
    assert CacheRequest("c", [1, 2, 3], num_prompt_tokens=2).num_prompt_tokens == 2
