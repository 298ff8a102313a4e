"""Exact expectations for the single-group managers and the block pool: construction checks, the
pin budget, the hash chain's bookkeeping, pins and retention, window release and eviction
counts. Each test pins one documented behaviour to the exact value the rule implies."""

from __future__ import annotations

import pytest
from core_helpers import admit, decode, finish, run_once

from prefixserve.core import BlockPool, CacheRequest, KVCacheManager, SlidingWindowKVCacheManager
from prefixserve.core.hashing import NONE_HASH, get_hash_function, hash_block_chain
from prefixserve.core.kv_events import BlockStored, KVEventPublisher
from prefixserve.core.retention import (
    DEFAULT_PRIORITY,
    NO_EXPIRY,
    PIN_PRIORITY,
    PinBudgetError,
    Retention,
)

pytestmark = pytest.mark.fast


class FakeClock:
    """A simulated clock for expiry: ``now`` is what the pool reads."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def req(rid: str, tokens: list[int], **kw: object) -> CacheRequest:
    return CacheRequest(rid, list(tokens), **kw)  # type: ignore[arg-type]


def cache_prefix(manager: KVCacheManager, rid: str, tokens: list[int]) -> list:
    """Runs ``tokens`` through the manager once (so its full blocks are cached and free) and
    returns the chain of its full blocks."""
    request = req(rid, tokens)
    chain = list(manager.block_hashes(request))
    run_once(manager, request)
    return chain


# ---------------------------------------------------------------- construction


def test_enable_caching_that_is_not_a_bool_is_a_type_error_naming_the_setting() -> None:
    """Catches a TypeError that no longer says which setting was wrong and where it is resolved."""
    with pytest.raises(TypeError) as excinfo:
        KVCacheManager(8, 4, None)  # type: ignore[arg-type]
    assert str(excinfo.value) == (
        "enable_caching must be a bool, got None (an unset setting is resolved by the caller, "
        "e.g. EngineConfig.prefix_caching)")


@pytest.mark.parametrize("window", [None, 4], ids=["full", "sliding-window"])
def test_with_caching_off_the_pool_map_stays_empty(window: int | None) -> None:
    """Caching off is the manager's decision alone (the pool has no flag): a prompt run twice
    fills no map entry and hits nothing the second time. Catches a manager that caches full
    blocks, or looks them up, with caching off."""
    manager = (KVCacheManager(8, 4, False) if window is None
               else SlidingWindowKVCacheManager(8, 4, False, sliding_window=window))
    tokens = list(range(13))
    cache_prefix(manager, "a", tokens)
    assert manager.block_pool.cached_block_hash_to_block == {}
    again = req("b", tokens)
    assert manager.get_computed_blocks(again)[1] == 0
    assert manager.block_pool.cached_block_hash_to_block == {}


def test_a_given_hash_root_is_the_parent_of_block_zero() -> None:
    """Catches a manager that ignores ``hash_root`` and chains block 0 from another root."""
    manager = KVCacheManager(8, 4, hash_root=12345)
    chain = manager.block_hashes(req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # builtin: the hash of (parent, tokens), block 0's parent being the root
    first = hash((12345, (1, 2, 3, 4)))
    assert list(chain) == [(first, (1, 2, 3, 4), None),
                           (hash((first, (5, 6, 7, 8))), (5, 6, 7, 8), None)]


def test_a_pin_fraction_of_one_lets_pins_hold_the_whole_pool() -> None:
    """Catches a bound that rejects 1.0 and a default reservation other than zero."""
    manager = KVCacheManager(4, 4, max_pinned_fraction=1.0)
    assert manager.max_pinned_blocks == 4
    chain = cache_prefix(manager, "a", list(range(16)))
    assert len(manager.pin("all", chain)) == 4
    assert (manager.num_pinned_blocks, manager.num_free_blocks) == (4, 0)


def test_a_pin_fraction_of_zero_is_accepted_and_allows_no_pin() -> None:
    """Catches a lower bound that rejects 0.0 and a budget floor of one block."""
    manager = KVCacheManager(8, 4, max_pinned_fraction=0.0)
    assert manager.max_pinned_blocks == 0
    chain = cache_prefix(manager, "a", list(range(5)))
    with pytest.raises(PinBudgetError) as excinfo:
        manager.pin("p", chain)
    assert str(excinfo.value) == ("pinning 1 more blocks would pin 1 of 8 blocks; the pin "
                                  "budget is 0 (--max-pinned-fraction)")
    assert manager.num_pinned_blocks == 0


def test_a_pin_fraction_above_one_is_rejected_with_its_value() -> None:
    """Catches an upper bound looser than 1 and an error that no longer names the value."""
    with pytest.raises(ValueError) as excinfo:
        KVCacheManager(8, 4, max_pinned_fraction=1.5)
    assert str(excinfo.value) == "max_pinned_fraction must be in [0, 1], got 1.5"


def test_the_sliding_window_pin_budget_leaves_out_the_null_block() -> None:
    """Catches a budget that counts the null block, or a window manager that drops its own
    ``max_pinned_fraction`` / ``reserved_blocks`` (or defaults the reservation to one)."""
    # 5 blocks, one of them the null block: 4 usable, all of them pinnable at fraction 1
    assert SlidingWindowKVCacheManager(5, 4, sliding_window=8,
                                       max_pinned_fraction=1.0).max_pinned_blocks == 4
    # 9 blocks: 8 usable, 3 of them reserved for a request
    assert SlidingWindowKVCacheManager(9, 4, sliding_window=8, max_pinned_fraction=1.0,
                                       reserved_blocks=3).max_pinned_blocks == 5
    assert SlidingWindowKVCacheManager(9, 4, sliding_window=8,
                                       max_pinned_fraction=0.25).max_pinned_blocks == 2


def test_a_window_manager_without_a_window_says_so_by_its_class_name() -> None:
    """Catches a changed error message for a missing sliding window."""
    with pytest.raises(ValueError) as excinfo:
        SlidingWindowKVCacheManager(8, 4, sliding_window=None)  # type: ignore[arg-type]
    assert str(excinfo.value) == "SlidingWindowKVCacheManager needs a sliding_window"


def test_a_window_manager_expires_retention_on_the_clock_it_was_given() -> None:
    """Catches a window manager that does not pass its ``clock`` to the pool."""
    clock = FakeClock()
    manager = SlidingWindowKVCacheManager(8, 4, sliding_window=8, clock=clock)
    request = req("a", list(range(9)), retention=Retention.whole_prompt(80, 10.0))
    admit(manager, request)
    finish(manager, request)
    # blocks 0 and 1 end by token 8 <= 9 and are kept at 80; the partial block 2 is not cached
    assert manager.block_pool.num_free_by_priority() == {DEFAULT_PRIORITY: 5, 80: 2}
    clock.now = 9.5
    assert manager.block_pool.expire() == 0
    clock.now = 10.0  # released at 0 for 10 s
    assert manager.block_pool.expire() == 2
    assert manager.block_pool.num_free_by_priority() == {DEFAULT_PRIORITY: 7}


# ---------------------------------------------------------------- the hash chain


def test_the_chain_is_one_list_extended_in_place_and_never_shortened() -> None:
    """Catches a chain recomputed on every call (a fresh list, cut to the blocks asked for)."""
    manager = KVCacheManager(8, 4)
    request = req("a", list(range(12)))
    chain = manager.block_hashes(request)
    assert len(chain) == 3
    assert manager.block_hashes(request, 1) is chain
    assert len(chain) == 3
    request.token_ids.extend([12, 13, 14, 15])  # type: ignore[attr-defined]
    assert manager.block_hashes(request) is chain
    assert len(chain) == 4
    assert manager.req_to_block_hashes == {"a": chain}


def test_a_request_shorter_than_one_block_has_an_empty_chain_at_any_block_size() -> None:
    """Catches a chain extension attempted when no block is full (it hashes a header the
    block size does not fit: a block size of 2**32 has no uint32 header)."""
    manager = KVCacheManager(2, 2**32, hash_algo="sha256")
    request = req("a", [1, 2, 3])
    assert list(manager.block_hashes(request)) == []
    assert manager.get_computed_blocks(request) == ([], 0)


def test_a_chain_of_no_blocks_is_empty_for_a_block_size_that_needs_all_32_header_bits() -> None:
    """Catches a block-size header packed as a signed int, which rejects sizes from 2**31 that
    the uint32 header of ``serialize_block`` holds."""
    sha256, _ = get_hash_function("sha256")
    assert hash_block_chain(sha256, NONE_HASH, [], 2**31, 0, 0) == []
    xxh, _ = get_hash_function("xxhash")
    assert hash_block_chain(xxh, NONE_HASH, [], 2**32 - 1, 0, 0) == []


def test_allocating_less_than_a_block_builds_no_chain() -> None:
    """Catches a chain created before any block is full."""
    manager = KVCacheManager(8, 4)
    request = req("a", [1, 2, 3])
    assert manager.allocate_slots(request, 3) is not None
    assert manager.req_to_block_hashes == {}
    request.num_computed_tokens = 3
    decode(manager, request, [4])  # block 0 is full now
    assert [len(c) for c in manager.req_to_block_hashes.values()] == [1]


def test_a_prefill_chunk_hashes_only_the_blocks_it_filled() -> None:
    """Catches a chunk that hashes the whole prompt ahead of the blocks it filled."""
    manager = KVCacheManager(8, 4)
    # a prompt-logprobs request is not looked up, so nothing hashes it before its first chunk
    request = req("a", list(range(12)), wants_prompt_logprobs=True)
    assert manager.get_computed_blocks(request) == ([], 0)
    assert manager.allocate_slots(request, 5) is not None
    assert len(manager.req_to_block_hashes["a"]) == 1
    assert len(manager.block_pool.cached_block_hash_to_block) == 1
    request.num_computed_tokens = 5
    assert manager.allocate_slots(request, 7) is not None
    assert len(manager.req_to_block_hashes["a"]) == 3
    assert len(manager.block_pool.cached_block_hash_to_block) == 3


# ---------------------------------------------------------------- caching and events


def test_a_hit_is_not_reported_stored_again() -> None:
    """Catches blocks cached from the wrong start after a hit (the hits stored once more)."""
    manager = KVCacheManager(16, 4)
    publisher = KVEventPublisher("r", 4)
    manager.block_pool.event_sink = publisher
    prefix = list(range(100, 108))
    run_once(manager, req("a", [*prefix, 1, 2, 3, 4]))
    publisher.flush()
    b = req("b", [*prefix, 5, 6, 7, 8, 9])
    chain = manager.block_hashes(b)
    assert admit(manager, b) == 8  # blocks 0 and 1 hit, block 2 is new and full
    batch = publisher.flush()
    assert batch is not None
    assert batch.events == (BlockStored((chain[2][0],), chain[1][0], 4, None),)


def test_a_step_that_needs_no_new_block_runs_no_expiry() -> None:
    """Catches a zero-block allocation sent to the pool, which expires retention out of turn
    (expiry runs before an eviction, a release or a hit count, not on a step that takes
    nothing)."""
    clock = FakeClock()
    manager = KVCacheManager(8, 4, clock=clock)
    a = req("a", [1, 2, 3, 4, 5], retention=Retention.whole_prompt(80, 10.0))
    admit(manager, a)
    finish(manager, a)
    b = req("b", [100, 101])
    admit(manager, b)
    assert manager.block_pool.num_free_by_priority() == {DEFAULT_PRIORITY: 6, 80: 1}
    clock.now = 20.0  # block 0 of a has expired, lazily
    decode(manager, b, [102])  # 3 tokens: still one block
    assert manager.block_pool.num_free_by_priority() == {DEFAULT_PRIORITY: 6, 80: 1}
    assert manager.block_pool.expired_retentions == 0


def test_record_lookup_takes_a_block_count_after_retention_was_seen() -> None:
    """Catches retained hits counted from a bare number (which has no blocks to look at)."""
    manager = KVCacheManager(16, 4)
    run_once(manager, req("a", list(range(9)), retention=Retention.whole_prompt(80)))
    manager.make_prefix_cache_stats()
    b = req("b", list(range(9)))
    manager.record_lookup(b, 2)
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits, stats.query_tokens, stats.hit_tokens,
            stats.retained_hits) == (1, 2, 2, 9, 8, {})


def test_retention_seen_is_false_until_a_pin_or_a_retained_request() -> None:
    """Catches a manager that starts out, or stays after a pin, without the right flag."""
    plain = KVCacheManager(16, 4)
    assert plain.retention_seen is False
    chain = cache_prefix(plain, "a", list(range(9)))
    assert plain.retention_seen is False
    plain.pin("p", chain)
    assert plain.retention_seen is True
    retained = KVCacheManager(16, 4)
    run_once(retained, req("a", list(range(9)), retention=Retention.whole_prompt(50)))
    assert retained.retention_seen is True


# ---------------------------------------------------------------- pins


def test_hits_on_a_pinned_prefix_are_counted_at_the_pin_level() -> None:
    """Catches a pin that does not switch on the counting of retained hits."""
    manager = KVCacheManager(16, 4)
    chain = cache_prefix(manager, "a", list(range(9)))
    manager.pin("p", chain)
    manager.make_prefix_cache_stats()
    computed, num_tokens = manager.get_computed_blocks(req("b", list(range(9))))
    assert (len(computed), num_tokens) == (2, 8)
    assert manager.make_prefix_cache_stats().retained_hits == {PIN_PRIORITY: 2}


def test_pinning_a_prefix_that_is_not_all_cached_names_the_first_missing_block() -> None:
    """Catches a KeyError that no longer says which block is missing."""
    manager = KVCacheManager(16, 4)
    cached = cache_prefix(manager, "a", list(range(5)))
    longer = list(manager.block_hashes(req("b", list(range(12)))))
    assert longer[0] == cached[0]
    with pytest.raises(KeyError) as excinfo:
        manager.pin("p", longer)
    assert excinfo.value.args == ("block 1 of the prefix is not cached",)
    assert (manager.num_pinned_blocks, manager.pins) == (0, {})


def test_a_pin_over_budget_reports_the_total_it_would_reach() -> None:
    """Catches a budget error whose total is not the pinned blocks plus the new ones."""
    manager = KVCacheManager(8, 4)  # budget: half of 8
    first = cache_prefix(manager, "a", list(range(9)))
    second = cache_prefix(manager, "b", list(range(100, 113)))
    manager.pin("first", first)
    with pytest.raises(PinBudgetError) as excinfo:
        manager.pin("second", second)
    assert str(excinfo.value) == ("pinning 3 more blocks would pin 5 of 8 blocks; the pin "
                                  "budget is 4 (--max-pinned-fraction)")
    assert manager.num_pinned_blocks == 2


def test_overlapping_pins_hold_a_shared_block_until_the_last_unpin() -> None:
    """Catches pin reference counts that are not counted up and down per pin, and an unpin
    that stops at the first block another pin still holds."""
    manager = KVCacheManager(16, 4, max_pinned_fraction=1.0)
    chain = cache_prefix(manager, "a", list(range(13)))
    blocks = manager.pin("long", chain)
    assert manager.pin("short", chain[:1]) == blocks[:1]
    assert manager.num_pinned_blocks == 3
    assert [b.ref_cnt for b in blocks] == [2, 1, 1]
    assert manager.unpin("long") is True
    assert manager.num_pinned_blocks == 1
    assert [(b.priority, b.ref_cnt) for b in blocks] == [
        (PIN_PRIORITY, 1), (DEFAULT_PRIORITY, 0), (DEFAULT_PRIORITY, 0)]
    assert manager.unpin("short") is True
    assert manager.num_pinned_blocks == 0
    assert [(b.priority, b.duration, b.ref_cnt) for b in blocks] == [(DEFAULT_PRIORITY, 0.0, 0)] * 3
    assert manager.unpin("short") is False
    assert manager.num_free_blocks == 16


def test_a_retained_request_hitting_a_pinned_prefix_leaves_it_pinned_without_expiry() -> None:
    """Catches a pin that leaves its blocks without the no-expiry duration."""
    manager = KVCacheManager(16, 4)
    chain = cache_prefix(manager, "a", list(range(9)))
    blocks = manager.pin("p", chain)
    assert [(b.priority, b.duration) for b in blocks] == [(PIN_PRIORITY, NO_EXPIRY)] * 2
    b = req("b", list(range(9)), retention=Retention.whole_prompt(50, 10.0))
    assert admit(manager, b) == 8
    finish(manager, b)
    assert [(b.priority, b.duration, b.ref_cnt) for b in blocks] == [
        (PIN_PRIORITY, NO_EXPIRY, 1)] * 2


def test_an_unpinned_block_keeps_no_duration_so_a_later_retention_sets_its_own() -> None:
    """Catches an unpin that leaves a duration on the block (a later, shorter retention would
    then keep it longer than asked, or fail to compare)."""
    clock = FakeClock()
    manager = KVCacheManager(16, 4, clock=clock)
    chain = cache_prefix(manager, "a", list(range(9)))
    blocks = manager.pin("p", chain)
    manager.unpin("p")
    assert [(b.priority, b.duration) for b in blocks] == [(DEFAULT_PRIORITY, 0.0)] * 2
    b = req("b", list(range(9)), retention=Retention.whole_prompt(50, 0.5))
    assert admit(manager, b) == 8
    finish(manager, b)  # released at 0, kept at 50 for 0.5 s
    assert [(b.priority, b.duration) for b in blocks] == [(50, 0.5)] * 2
    clock.now = 0.75
    assert manager.block_pool.expire() == 2


# ---------------------------------------------------------------- sliding window release


def test_remove_skipped_blocks_frees_exactly_what_left_the_window() -> None:
    """Catches a release that reports a change for a request without blocks or with nothing
    out of the window, and one that misses the first block leaving it."""
    manager = SlidingWindowKVCacheManager(8, 4, sliding_window=4)
    request = req("a", list(range(8)))
    assert manager.remove_skipped_blocks(request) is False  # no table yet
    assert manager.allocate_slots(request, 8) is not None
    ids = manager.get_block_ids(request)
    assert manager.num_free_blocks == 5
    # the window of token 4 is tokens 1..4: block 0 still holds tokens 1..3
    request.num_computed_tokens = 4
    assert manager.remove_skipped_blocks(request) is False
    assert manager.get_block_ids(request) == ids
    # the window of token 7 is tokens 4..7: block 0 (tokens 0..3) is out
    request.num_computed_tokens = 7
    assert manager.remove_skipped_blocks(request) is True
    assert manager.get_block_ids(request) == [manager.null_block.block_id, ids[1]]
    assert manager.num_free_blocks == 6
    assert manager.remove_skipped_blocks(request) is False  # already released
    manager.free(request)
    assert manager.remove_skipped_blocks(request) is False  # no table any more


# ---------------------------------------------------------------- the pool


def test_evictions_are_summed_per_priority_across_allocations() -> None:
    """Catches an eviction count that keeps only the last allocation's evictions."""
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [100, 101, 102], 0, 3)
    pool.free_blocks(blocks)  # free list: 3 (never used), then 0, 1, 2
    taken = pool.get_new_blocks(3)
    assert [b.block_id for b in taken] == [3, 0, 1]
    assert pool.evictions_by_priority == {DEFAULT_PRIORITY: 2}
    pool.free_blocks(taken)  # free list: 2, 3, 0, 1
    assert [b.block_id for b in pool.get_new_blocks(1)] == [2]
    assert pool.evictions_by_priority == {DEFAULT_PRIORITY: 3}


def test_an_unknown_hash_algorithm_is_refused_listing_the_three_choices() -> None:
    """The message names the bad value and the choices, comma-separated, as `serve
    --prefix-caching-hash-algo` shows it to the user. Catches a mangled list of choices."""
    with pytest.raises(ValueError) as info:
        KVCacheManager(8, 4, hash_algo="md5")
    assert str(info.value) == ("unknown prefix_caching_hash_algo 'md5'; "
                               "choose one of builtin, sha256, xxhash")
