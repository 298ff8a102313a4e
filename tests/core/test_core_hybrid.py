"""The hybrid KV cache manager (docs/sliding-window.md) on ``prefixserve.core`` alone.

Groups as Gemma 3 270M has them at block size 4: one full group, then window groups (window 8,
so a hit needs the 2 blocks before its end).
"""

from __future__ import annotations

import pytest

from prefixserve.core import CacheRequest
from prefixserve.core.hybrid_kv_cache_manager import HybridKVCacheManager

pytestmark = pytest.mark.fast

BS = 4
WINDOWS = (None, 8, 8)


def request(rid: str, tokens: list[int], salt: str | None = None) -> CacheRequest:
    return CacheRequest(rid, token_ids=tokens, cache_salt=salt)


def run(manager: HybridKVCacheManager, req: CacheRequest, chunk: int | None = None) -> int:
    """Schedules ``req`` as the scheduler does (lookup, then chunks of ``chunk``) until its
    prompt is computed; returns the tokens it hit."""
    hits, num_cached = manager.get_computed_blocks(req)
    req.num_computed_tokens = 0
    todo = req.num_tokens - num_cached
    step = chunk or todo
    assert manager.allocate_slots(req, min(step, todo), hits) is not None
    req.num_computed_tokens = num_cached + min(step, todo)
    while req.num_computed_tokens < req.num_tokens:
        n = min(step, req.num_tokens - req.num_computed_tokens)
        assert manager.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
    return num_cached


def finish(manager: HybridKVCacheManager, req: CacheRequest) -> None:
    manager.free(req)
    manager.free_block_hashes(req)


def test_hit_is_served_by_every_group_and_blocks_are_distinct() -> None:
    manager = HybridKVCacheManager(64, BS, WINDOWS)
    prefix = list(range(100, 124))  # 6 blocks
    first = request("a", [*prefix, 1, 2, 3])
    run(manager, first)
    tables = manager.get_group_block_ids(first)
    ids = [b for t in tables for b in t if b != 0]
    assert len(ids) == len(set(ids)), "groups share no block"
    finish(manager, first)
    second = request("b", [*prefix, 7, 8, 9])
    hits, num = manager.get_computed_blocks(second)
    assert num == 24
    per_group = [hits[g * 6:(g + 1) * 6] for g in range(3)]
    assert all(not b.is_null for b in per_group[0])  # full: every block
    for group in per_group[1:]:
        assert [b.is_null for b in group] == [True] * 4 + [False] * 2  # window: the last two
    for g, group in enumerate(per_group):  # each group hits its own blocks
        assert [b.block_id for b in group if not b.is_null] == tables[g][6 - len(
            [b for b in group if not b.is_null]):6]


def test_window_groups_release_blocks_sliding_out() -> None:
    manager = HybridKVCacheManager(64, BS, WINDOWS)
    req = request("a", list(range(40)))
    run(manager, req, chunk=4)
    full, win1, _ = manager.get_group_block_ids(req)
    assert len(full) == len(win1) == 10 and 0 not in full
    # the next token (position 40) needs positions 33..40: blocks 8 and 9
    assert win1[:7] == [0] * 7 and 0 not in win1[8:]
    held = 64 - 1 - manager.num_free_blocks
    assert held == 10 + 2 * 3
    finish(manager, req)
    assert manager.num_free_blocks == 63


def test_hit_shrinks_to_what_every_group_serves() -> None:
    manager = HybridKVCacheManager(64, BS, WINDOWS)
    prefix = list(range(100, 124))
    run(manager, request("a", [*prefix, 1]))
    finish(manager, request("a", []))
    # evict group 2's last block of the prefix (as reuse would: out of the map, uncached)
    probe = request("probe", [*prefix, 1])
    key = manager._keys(probe, 2, manager.block_hashes(probe))[5]
    block = manager.block_pool.get_cached_block(key)
    assert block is not None
    manager.block_pool.touch([block])
    manager.block_pool.cached_block_hash_to_block.pop(block.hash_value)
    block.block_hash = None
    manager.block_pool.free_blocks([block])
    hits, num = manager.get_computed_blocks(request("c", [*prefix, 5]))
    # group 2 serves 5 blocks (its blocks 3 and 4), so every group serves 5
    assert num == 20 and len(hits) == 15


def test_eagle_drops_a_block_and_keeps_the_window_covered() -> None:
    """The hybrid form of the core eagle bug: with use_eagle the window lookup must cover one
    block more, since the last hit block is dropped afterwards."""
    manager = HybridKVCacheManager(10, 16, (16,), use_eagle=True)
    tokens = list(range(37))
    run(manager, request("a", tokens))
    finish(manager, request("a", []))
    hits, num = manager.get_computed_blocks(request("b", tokens))
    # a hit of 16 tokens needs block 0 (token 16 attends to 1..16); dropping block 1 of a
    # 2-block hit leaves block 0, which is cached
    assert num == 16 and not hits[0].is_null


def test_salts_separate_every_group() -> None:
    manager = HybridKVCacheManager(64, BS, WINDOWS)
    tokens = list(range(30))
    run(manager, request("a", tokens, salt="x"))
    assert manager.get_computed_blocks(request("b", tokens, salt="y"))[1] == 0
    assert manager.get_computed_blocks(request("c", tokens, salt="x"))[1] == 28


def test_short_pool_changes_nothing_and_preemption_resumes_from_own_chain() -> None:
    manager = HybridKVCacheManager(10, BS, WINDOWS)
    big = request("big", list(range(20)))
    assert manager.allocate_slots(big, 20) is None  # 15 blocks > 9 usable
    assert manager.num_free_blocks == 9 and not manager.get_group_block_ids(big)[0]
    req = request("a", list(range(8)))
    run(manager, req)
    manager.free(req)  # preempted: the chain stays
    req.num_computed_tokens = 0
    hits, num = manager.get_computed_blocks(req)
    assert num == 4 and len(hits) == 3


def test_reset_and_stats() -> None:
    manager = HybridKVCacheManager(64, BS, WINDOWS)
    tokens = list(range(30))
    run(manager, request("a", tokens))
    manager.make_prefix_cache_stats()
    assert manager.get_computed_blocks(request("b", tokens))[1] == 28
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits, stats.hit_tokens) == (1, 7, 7, 28)
    assert manager.reset_prefix_cache()
    assert manager.get_computed_blocks(request("c", tokens))[1] == 0
