"""The lookup's semantics, separated where the hash chain alone would hide a difference.

With computed hashes a miss at block k makes every later block a miss too (the chain carries
the history), so "stop at the first miss" and "skip the miss" look the same. Precomputed hashes
and forced collisions of the hash value break that link, and tell the rules apart.
"""

from __future__ import annotations

import pytest
from core_helpers import run_once

from prefixserve.core import BlockPool, CacheRequest, KVCacheManager, MultiModalInput

pytestmark = pytest.mark.fast


def _cache(manager: KVCacheManager, hashes: list, tag: str) -> list:
    """Caches one free block per hash, in order; returns the blocks."""
    pool = manager.block_pool
    blocks = pool.get_new_blocks(len(hashes))
    pool.cache_full_blocks(blocks, hashes, 0, len(hashes))
    pool.free_blocks(blocks)
    return blocks


def test_lookup_stops_at_the_first_miss_and_does_not_skip_it() -> None:
    manager = KVCacheManager(16, 4)
    x, _, z = _cache(manager, ["x", "y", "z"], "a")
    blocks, num = manager.get_computed_blocks(
        CacheRequest("b", range(13), block_hashes=["x", "q", "z"]))
    assert (blocks, num) == ([x], 4)
    assert z.block_hash == "z"  # z was findable: the lookup stopped before it
    blocks, num = manager.get_computed_blocks(
        CacheRequest("c", range(13), block_hashes=["q", "y", "z"]))
    assert (blocks, num) == ([], 0)


def test_a_hash_value_collision_is_a_miss_that_ends_the_lookup() -> None:
    """Two tuples with the same hash value and different tokens: the map finds the key, the
    whole block hash differs, the lookup ends there (later blocks are never examined)."""
    manager = KVCacheManager(16, 2)
    a = [(1, (1, 1), None), (2, (2, 2), None), (3, (3, 3), None)]
    cached = _cache(manager, a, "a")
    collided = [(1, (1, 1), None), (2, (9, 9), None), (3, (3, 3), None)]
    blocks, num = manager.get_computed_blocks(CacheRequest("b", range(7), block_hashes=collided))
    assert (blocks, num) == ([cached[0]], 2)
    extras = [(1, (1, 1), None), (2, (2, 2), ("lora", 1)), (3, (3, 3), None)]
    blocks, num = manager.get_computed_blocks(CacheRequest("c", range(7), block_hashes=extras))
    assert (blocks, num) == ([cached[0]], 2)


def test_a_collision_among_several_blocks_under_one_key_finds_the_right_one() -> None:
    """Three blocks under one hash value (a dict entry): the lookup returns the block whose whole
    block hash matches, a miss when none does, and the map keeps the others on eviction."""
    manager = KVCacheManager(16, 2)
    pool: BlockPool = manager.block_pool
    hashes = [(7, (1, 1), None), (7, (2, 2), None), (7, (3, 3), None)]
    b1, b2, b3 = _cache(manager, hashes, "a")
    assert type(pool.cached_block_hash_to_block[7]) is dict
    for block_hash, block in zip(hashes, (b1, b2, b3), strict=True):
        found, num = manager.get_computed_blocks(
            CacheRequest("q", range(3), block_hashes=[block_hash]))
        assert (found, num) == ([block], 2)
    assert manager.get_computed_blocks(
        CacheRequest("q", range(3), block_hashes=[(7, (4, 4), None)])) == ([], 0)
    pool.get_new_blocks(pool.get_num_free_blocks() - 3)  # leaves the three at the free head
    [evicted] = pool.get_new_blocks(1)
    assert evicted is b1 and b1.block_hash is None
    assert pool.cached_blocks(hashes[0]) == [] and pool.cached_blocks(hashes[1]) == [b2]
    assert pool.get_cached_block(hashes[2]) is b3


def test_the_last_block_rule_applies_to_precomputed_hashes() -> None:
    """12 tokens in 3 full blocks: only 2 are looked up, so that one token is computed."""
    manager = KVCacheManager(16, 4)
    blocks = _cache(manager, ["x", "y", "z"], "a")
    assert manager.get_computed_blocks(
        CacheRequest("b", range(12), block_hashes=["x", "y", "z"])) == (blocks[:2], 8)
    assert manager.get_computed_blocks(
        CacheRequest("c", range(13), block_hashes=["x", "y", "z"])) == (blocks, 12)


def test_fewer_precomputed_hashes_than_full_blocks_bound_the_hit() -> None:
    manager = KVCacheManager(16, 4)
    blocks = _cache(manager, ["x", "y"], "a")
    assert manager.get_computed_blocks(
        CacheRequest("b", range(30), block_hashes=["x"])) == (blocks[:1], 4)


def test_a_multimodal_input_ending_on_a_block_boundary() -> None:
    """An image over tokens [4, 8) at block size 4 tags block 1 only. Another image there:
    block 0 still hits, block 1 and everything after it misses. The same image: a full hit,
    also of block 2, which the image does not touch."""
    manager = KVCacheManager(32, 4)
    tokens = list(range(100, 113))  # 13 tokens: 3 full blocks looked up
    run_once(manager, CacheRequest("a", tokens, mm_inputs=[MultiModalInput(4, 4, "cat")]))
    assert run_once(manager, CacheRequest(
        "b", tokens, mm_inputs=[MultiModalInput(4, 4, "dog")])) == 4
    assert run_once(manager, CacheRequest(
        "c", tokens, mm_inputs=[MultiModalInput(4, 4, "cat")])) == 12
    # the image starting on a boundary leaves the block before it untagged and shared
    run_once(manager, CacheRequest("d", tokens, mm_inputs=[MultiModalInput(8, 4, "cat")]))
    assert run_once(manager, CacheRequest(
        "e", tokens, mm_inputs=[MultiModalInput(8, 4, "dog")])) == 8
    # the image ending on the boundary leaves the block after it untagged: a request whose
    # image sits in block 1 only shares blocks 0-1 with "c" and tags nothing in block 2
    computed, num = manager.get_computed_blocks(CacheRequest(
        "f", tokens, mm_inputs=[MultiModalInput(4, 4, "cat")]))
    assert num == 12 and computed[2].block_hash[2] is None


def test_stats_count_every_lookup_exactly() -> None:
    """queries = full blocks of the request (all of them, also the one not looked up),
    hits = blocks returned, tokens alike; eagle counts the dropped block as not hit."""
    manager = KVCacheManager(32, 4, use_eagle=True)
    run_once(manager, CacheRequest("a", list(range(13))))
    manager.make_prefix_cache_stats()
    manager.get_computed_blocks(CacheRequest("b", list(range(12))))
    manager.get_computed_blocks(CacheRequest("c", list(range(13))))
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 6, 1 + 2)
    assert (stats.query_tokens, stats.hit_tokens) == (25, 12)
