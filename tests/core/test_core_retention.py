"""Retention priorities, TTLs and pins in the prefix cache (docs/explicit-caching.md), one test
per rule, on ``prefixserve.core`` alone with a simulated clock."""

from __future__ import annotations

import pytest
from core_helpers import admit, finish, run_once

from prefixserve.core import (
    DEFAULT_PRIORITY,
    PIN_PRIORITY,
    CacheRequest,
    KVCacheManager,
    PinBudgetError,
    Retention,
    RetentionRange,
)

pytestmark = pytest.mark.fast


def req(rid: str, tokens: list[int]) -> CacheRequest:
    return CacheRequest(rid, tokens)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def keep(priority: int = 80, duration: float | None = 60.0) -> Retention:
    return Retention.whole_prompt(priority, duration)


def flood(manager: KVCacheManager, n: int, length: int, base: int = 10_000) -> None:
    """``n`` unique prompts of ``length`` tokens, each run to completion."""
    for i in range(n):
        run_once(manager, req(f"flood{base + i}", [base + i * length + t for t in range(length)]))


SYSTEM = list(range(40))  # 10 blocks of 4


def hit_tokens(manager: KVCacheManager, tokens: list[int]) -> int:
    probe = req("probe", tokens + [7])
    hits = manager.get_computed_blocks(probe)[1]
    manager.free_block_hashes(probe)
    return hits


@pytest.mark.parametrize("protected", [False, True])
def test_flood_evicts_unprotected_prompt_but_not_a_retained_one(protected: bool) -> None:
    """Same flood both ways: LRU alone loses the system prompt; a retention keeps all of it."""
    clock = FakeClock()
    manager = KVCacheManager(24, 4, clock=clock)
    system = CacheRequest("sys", SYSTEM + [99], retention=keep() if protected else None)
    run_once(manager, system)
    flood(manager, 30, 9)
    assert hit_tokens(manager, SYSTEM) == (40 if protected else 0)


@pytest.mark.parametrize("protected", [False, True])
def test_flood_and_ttl_on_a_2000_token_system_prompt(protected: bool) -> None:
    """The issue's check at its size: 2,000 tokens in blocks of 16, unique 300-token prompts;
    LRU loses the prompt, a 5-minute retention keeps all of it, and after the TTL it goes."""
    clock = FakeClock()
    manager = KVCacheManager(256, 16, clock=clock)
    system = list(range(100_000, 102_000))
    retention = keep(80, 300.0) if protected else None
    run_once(manager, CacheRequest("sys", system + [1], retention=retention))
    flood(manager, 20, 300)
    assert hit_tokens(manager, system) == (2000 if protected else 0)
    clock.now += 301.0
    flood(manager, 20, 300, base=40_000)
    assert hit_tokens(manager, system) == 0


def test_expired_retention_is_evictable_again() -> None:
    clock = FakeClock()
    manager = KVCacheManager(24, 4, clock=clock)
    run_once(manager, CacheRequest("sys", SYSTEM + [99], retention=keep(duration=60.0)))
    flood(manager, 10, 9)
    clock.now += 59.0
    flood(manager, 10, 9, base=20_000)
    assert hit_tokens(manager, SYSTEM) == 40  # not yet expired
    clock.now += 2.0
    flood(manager, 10, 9, base=30_000)
    assert hit_tokens(manager, SYSTEM) == 0
    assert manager.block_pool.expired_retentions == 10


def test_ttl_counts_from_release_and_a_hit_refreshes_it() -> None:
    clock = FakeClock()
    manager = KVCacheManager(24, 4, clock=clock)
    run_once(manager, CacheRequest("a", SYSTEM + [99], retention=keep(duration=60.0)))
    clock.now += 50.0
    assert run_once(manager, req("b", SYSTEM + [5])) == 40  # a plain hit: still retained
    clock.now += 50.0  # 100 s after the first use, 50 after the hit
    flood(manager, 30, 9)
    assert hit_tokens(manager, SYSTEM) == 40


def test_expired_block_hit_before_expire_runs_falls_back() -> None:
    clock = FakeClock()
    manager = KVCacheManager(24, 4, clock=clock)
    run_once(manager, CacheRequest("a", SYSTEM + [99], retention=keep(duration=10.0)))
    clock.now += 11.0
    r = req("b", SYSTEM + [5])
    admit(manager, r)  # the hit comes before any eviction ran expire()
    assert all(b.priority == DEFAULT_PRIORITY for b in manager.req_to_blocks["b"])
    finish(manager, r)
    flood(manager, 30, 9)
    assert hit_tokens(manager, SYSTEM) == 0


def test_lowest_priority_first_then_lru_within_a_priority() -> None:
    manager = KVCacheManager(12, 4)
    run_once(manager, CacheRequest("hi", [1, 2, 3, 4, 9], retention=keep(90, None)))
    run_once(manager, CacheRequest("mid1", [5, 6, 7, 8, 9], retention=keep(50, None)))
    run_once(manager, CacheRequest("plain", [11, 12, 13, 14, 9]))
    run_once(manager, CacheRequest("mid2", [15, 16, 17, 18, 9], retention=keep(50, None)))
    run_once(manager, CacheRequest("low", [19, 20, 21, 22, 9], retention=keep(10, None)))
    pool = manager.block_pool
    order = [b.block_hash[1] if b.block_hash else None  # type: ignore[index]
             for b in pool.free_blocks_in_eviction_order()]
    cached_order = [tokens for tokens in order if tokens is not None]
    assert cached_order == [(19, 20, 21, 22), (11, 12, 13, 14), (5, 6, 7, 8),
                            (15, 16, 17, 18), (1, 2, 3, 4)]
    # one new block: the lowest level goes first, even before an uncached default block
    admit(manager, req("new", [30, 31, 32]))
    assert hit_tokens(manager, [19, 20, 21, 22]) == 0
    assert hit_tokens(manager, [11, 12, 13, 14]) == 4
    assert manager.block_pool.evictions_by_priority == {10: 1}


def test_chain_aware_inside_a_level_tail_before_head() -> None:
    manager = KVCacheManager(8, 4)
    run_once(manager, CacheRequest("a", list(range(12)) + [99], retention=keep(80, None)))
    retained = list(manager.block_pool.retained_queues[80])
    heads = [b.block_hash[1][0] for b in retained]  # type: ignore[index]
    assert heads == [8, 4, 0]  # the tail is the first to go


def test_range_retention_protects_the_prefix_up_to_its_end_only() -> None:
    """A range keeps every block ending at or before its end (chain-aware), nothing after."""
    manager = KVCacheManager(16, 4)
    retention = Retention((RetentionRange(4, 10, 70, None),))
    run_once(manager, CacheRequest("a", list(range(16)) + [99], retention=retention))
    priorities = {b.block_hash[1][0]: b.priority  # type: ignore[index]
                  for b in manager.block_pool.blocks if b.block_hash is not None}
    assert priorities == {0: 70, 4: 70, 8: DEFAULT_PRIORITY, 12: DEFAULT_PRIORITY}


def test_shared_block_keeps_highest_priority_and_longest_duration() -> None:
    clock = FakeClock()
    manager = KVCacheManager(24, 4, clock=clock)
    a = CacheRequest("a", SYSTEM + [1], retention=keep(80, 10.0))
    b = CacheRequest("b", SYSTEM + [2], retention=keep(60, 100.0))
    c = CacheRequest("c", SYSTEM + [3], retention=keep(80, 30.0))
    for r in (a, b, c):
        admit(manager, r)
    for r in (a, b, c):
        finish(manager, r)
    block = manager.block_pool.cached_blocks(manager.block_hashes(req("x", SYSTEM))[0])[0]
    assert (block.priority, block.duration) == (80, 100.0)  # the latest expiry asked for
    clock.now += 99.0
    flood(manager, 30, 9)
    assert hit_tokens(manager, SYSTEM) == 40
    clock.now += 2.0
    flood(manager, 30, 9, base=50_000)
    assert hit_tokens(manager, SYSTEM) == 0


def test_low_priority_is_evicted_first_and_a_plain_hit_lifts_it() -> None:
    manager = KVCacheManager(6, 4)
    run_once(manager, CacheRequest("low", [1, 2, 3, 4, 9], retention=keep(5, None)))
    admit(manager, req("plain", [5, 6, 7]))  # one block: the low-priority one goes
    assert hit_tokens(manager, [1, 2, 3, 4]) == 0
    manager2 = KVCacheManager(6, 4)
    run_once(manager2, CacheRequest("low", [1, 2, 3, 4, 9], retention=keep(5, None)))
    assert run_once(manager2, req("lift", [1, 2, 3, 4, 8])) == 4
    assert manager2.block_pool.num_free_by_priority().get(5) is None


def test_pin_holds_blocks_until_unpinned_and_never_expires() -> None:
    clock = FakeClock()
    manager = KVCacheManager(24, 4, clock=clock)
    run_once(manager, req("a", SYSTEM + [1]))
    blocks = manager.pin("p", manager.block_hashes(req("x", SYSTEM)))
    assert len(blocks) == 10 and manager.num_pinned_blocks == 10
    assert all(b.priority == PIN_PRIORITY and b.ref_cnt == 1 for b in blocks)
    assert manager.num_free_blocks == 14
    clock.now += 10**6
    flood(manager, 30, 9)
    assert hit_tokens(manager, SYSTEM) == 40
    assert manager.unpin("p") and not manager.unpin("p")
    assert manager.num_free_blocks == 24 and manager.num_pinned_blocks == 0
    flood(manager, 30, 9, base=40_000)
    assert hit_tokens(manager, SYSTEM) == 0


def test_pin_over_budget_is_refused_and_changes_nothing() -> None:
    manager = KVCacheManager(24, 4, max_pinned_fraction=0.25)  # 6 blocks
    run_once(manager, req("a", SYSTEM + [1]))
    hashes = manager.block_hashes(req("x", SYSTEM))
    with pytest.raises(PinBudgetError, match="pin budget is 6"):
        manager.pin("p", hashes)
    assert manager.num_pinned_blocks == 0 and manager.num_free_blocks == 24
    manager.pin("p", hashes[:6])
    manager.pin("q", hashes[:4])  # the same blocks again: no new block, within budget
    assert manager.num_pinned_blocks == 6
    with pytest.raises(KeyError):
        manager.pin("r", manager.block_hashes(req("y", list(range(500, 508)))))
    with pytest.raises(ValueError, match="in use"):
        manager.pin("p", hashes[:1])


def test_reserved_blocks_cap_the_pin_budget() -> None:
    assert KVCacheManager(100, 4, reserved_blocks=80).max_pinned_blocks == 20
    assert KVCacheManager(100, 4, reserved_blocks=10).max_pinned_blocks == 50


def test_reset_drops_pins_unless_kept() -> None:
    manager = KVCacheManager(24, 4)
    run_once(manager, req("a", SYSTEM + [1]))
    manager.pin("p", manager.block_hashes(req("x", SYSTEM)))
    manager.reset_prefix_cache(keep_pins=True)
    assert hit_tokens(manager, SYSTEM) == 40 and manager.num_pinned_blocks == 10
    manager.reset_prefix_cache()
    assert hit_tokens(manager, SYSTEM) == 0
    assert manager.num_pinned_blocks == 0 and manager.num_free_blocks == 24


def test_reset_moves_retained_free_blocks_to_default() -> None:
    manager = KVCacheManager(24, 4)
    run_once(manager, CacheRequest("a", SYSTEM + [1], retention=keep(90, None)))
    manager.reset_prefix_cache()
    pool = manager.block_pool
    assert pool.num_free_retained == 0 and len(pool.free_queue) == 24
    assert all(b.priority == DEFAULT_PRIORITY for b in pool.blocks)


def test_retained_hits_are_counted_by_level() -> None:
    manager = KVCacheManager(24, 4)
    run_once(manager, CacheRequest("a", SYSTEM + [1], retention=keep(90, None)))
    manager.make_prefix_cache_stats()
    run_once(manager, req("b", SYSTEM[:20] + [1]))
    assert manager.make_prefix_cache_stats().retained_hits == {90: 5}


def test_an_expired_block_joins_the_default_lru_as_if_released_at_its_expiry() -> None:
    clock = FakeClock()
    manager = KVCacheManager(16, 4, clock=clock)
    run_once(manager, CacheRequest("a", [1, 2, 3, 4, 9], retention=keep(80, 20.0)))
    run_once(manager, CacheRequest("b", [5, 6, 7, 8, 9], retention=keep(80, 10.0)))
    run_once(manager, req("plain", [11, 12, 13, 14, 9]))
    clock.now += 15.0
    manager.block_pool.expire()  # b expires first, a later: the order must not depend on this
    clock.now += 10.0
    run_once(manager, req("late", [21, 22, 23, 24, 9]))  # released after both expiries
    order = [b.block_hash[1][0] for b in manager.block_pool.free_blocks_in_eviction_order()
             if b.block_hash is not None]  # type: ignore[index]
    assert order == [11, 5, 1, 21]


def test_bad_retention_values_are_refused() -> None:
    with pytest.raises(ValueError, match="priority"):
        RetentionRange(priority=101)
    with pytest.raises(ValueError, match="duration"):
        RetentionRange(duration=0)
    with pytest.raises(ValueError, match="empty"):
        RetentionRange(5, 5)


def test_a_stale_expiry_never_demotes_a_block_retained_again_without_expiry() -> None:
    """Found by the stateful test: a block kept for 1 s, evicted and reused for a retention
    without expiry, must not fall back when the old expiry passes."""
    clock = FakeClock()
    manager = KVCacheManager(2, 2, clock=clock)
    run_once(manager, CacheRequest("a", [0, 0], retention=keep(10, 1.0)))
    run_once(manager, CacheRequest("b", [0, 0], retention=keep(10, None)))  # reuses its block
    clock.now += 5.0
    manager.block_pool.expire()
    assert manager.block_pool.num_free_by_priority() == {DEFAULT_PRIORITY: 1, 10: 1}
    assert manager.block_pool.expired_retentions == 0
