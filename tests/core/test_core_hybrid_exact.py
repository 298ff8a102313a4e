"""Exact expectations for the hybrid KV cache manager (docs/sliding-window.md).

Every number here follows from the rules of ``prefixserve/core/hybrid_kv_cache_manager.py``
and the pool's documented order: a fresh pool hands out its blocks in id order (block 0 is the
null block whenever some group has a window), a freed block joins the tail of the free list and
the head is taken first. Blocks of 4 tokens; a window of W tokens lets the token at position p
read positions ``p - W + 1 .. p``, so a window group frees a block once all its tokens lie
before that, and a hit of L blocks needs the window blocks before position ``4 * L``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import pytest

from prefixserve.core import CacheRequest, KVCacheManager
from prefixserve.core.block_pool import KVCacheBlock
from prefixserve.core.hashing import hash_value_of
from prefixserve.core.hybrid_kv_cache_manager import HybridKVCacheManager
from prefixserve.core.kv_events import BlockRemoved, BlockStored, KVEventPublisher
from prefixserve.core.retention import DEFAULT_PRIORITY, PinBudgetError, Retention

pytestmark = pytest.mark.fast

BS = 4


def tokens(n: int, offset: int = 0) -> list[int]:
    return list(range(offset, offset + n))


def req(rid: str, token_ids: list[int], **kwargs: object) -> CacheRequest:
    return CacheRequest(rid, token_ids=token_ids, **kwargs)  # type: ignore[arg-type]


def ids(blocks: Sequence[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def group_key(block_hash: Hashable, group: int) -> Hashable:
    """The key group ``group`` caches a block of the chain under (rule 1)."""
    return block_hash if group == 0 else ((hash_value_of(block_hash), group), block_hash)


def admit_blocks(manager: KVCacheManager, request: CacheRequest) -> list[KVCacheBlock]:
    """Looks the request up and allocates the rest of its prompt in one step; returns the new
    blocks (``core_helpers.admit`` returns the cached token count)."""
    hits, num_hit = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit, hits)
    assert new is not None, "pool too small for the test"
    request.num_computed_tokens = request.num_tokens
    return new


def grow(request: CacheRequest, n: int) -> None:
    """Appends ``n`` next tokens to the request (as decode would)."""
    for _ in range(n):
        list.append(request.token_ids, request.num_tokens)  # type: ignore[arg-type]


def evict(manager: HybridKVCacheManager, block_ids: set[int]) -> None:
    """Another user of the pool takes exactly the free blocks ``block_ids`` (which evicts their
    hashes) and gives them back, through the pool's public calls."""
    pool = manager.block_pool
    keep = [b for b in pool.free_blocks_in_eviction_order() if b.block_id not in block_ids]
    pool.touch(keep)
    taken = pool.get_new_blocks(len(block_ids))
    assert {b.block_id for b in taken} == block_ids
    pool.free_blocks(taken)
    pool.free_blocks(keep)


# ----------------------------------------------------------------- construction
def test_no_groups_is_refused_with_its_message() -> None:
    """Catches a changed or empty message for a hybrid cache without groups."""
    with pytest.raises(ValueError) as info:
        HybridKVCacheManager(8, BS, ())
    assert str(info.value) == "a hybrid KV cache needs at least one group"


def test_a_window_below_one_token_is_refused_with_its_message() -> None:
    """Catches an empty message for a window of no tokens."""
    for window in (0, -3):
        with pytest.raises(ValueError) as info:
            HybridKVCacheManager(8, BS, (None, window))
        assert str(info.value) == f"sliding windows must be positive, got {window}"


def test_a_one_token_window_is_accepted_and_frees_every_earlier_block() -> None:
    """Catches a lower bound of 2 on windows: a window of 1 token is valid (each token reads
    only itself), so at position 9 blocks 0 and 1 (tokens 0..7) are out of it."""
    manager = HybridKVCacheManager(8, BS, (None, 1))
    assert manager.sliding_window == 1
    request = req("a", tokens(9))
    assert ids(admit_blocks(manager, request)) == [1, 2, 3, 4, 5, 6]
    assert manager.remove_skipped_blocks(request) is True
    assert manager.get_group_block_ids(request) == [[1, 2, 3], [0, 0, 6]]
    assert manager.num_free_blocks == 7 - 6 + 2


def test_a_model_without_windows_reserves_no_null_block_and_allocates_from_block_zero() -> None:
    """Catches a smallest window taken of no windows, a slide-out that insists on a null block
    when nothing slides, and a single group's one new block not handed out."""
    both_full = HybridKVCacheManager(4, BS, (None, None))
    assert both_full.sliding_window is None and both_full.null_block is None
    assert both_full.num_free_blocks == 4
    request = req("a", tokens(3))
    assert ids(admit_blocks(both_full, request)) == [0, 1]
    assert both_full.get_group_block_ids(request) == [[0], [1]]

    single = HybridKVCacheManager(3, BS, (None,))
    request = req("b", tokens(3))
    assert ids(admit_blocks(single, request)) == [0]
    assert single.get_group_block_ids(request) == [[0]]
    assert single.num_free_blocks == 2


def test_pin_budget_is_the_given_fraction_of_the_pool_less_the_given_reserve() -> None:
    """Catches ``max_pinned_fraction`` or ``reserved_blocks`` not passed on, and a default
    reserve other than 0: with fraction 1 and no reserve all 4 blocks of the pool may be pinned,
    with a reserve of 1 only 3."""
    manager = HybridKVCacheManager(4, BS, (None,), max_pinned_fraction=1.0)
    request = req("a", tokens(16))
    admit_blocks(manager, request)
    chain = list(manager.block_hashes(request))
    assert ids(manager.pin("p", chain)) == [0, 1, 2, 3]
    assert manager.num_pinned_blocks == 4

    reserved = HybridKVCacheManager(4, BS, (None,), max_pinned_fraction=1.0, reserved_blocks=1)
    request = req("a", tokens(16))
    admit_blocks(reserved, request)
    with pytest.raises(PinBudgetError) as info:
        reserved.pin("p", list(reserved.block_hashes(request)))
    assert str(info.value) == ("pinning 4 more blocks would pin 4 of 4 blocks; the pin budget "
                               "is 3 (--max-pinned-fraction)")
    assert reserved.num_pinned_blocks == 0


def test_the_given_clock_drives_expiry() -> None:
    """Catches the manager's pool running on the wall clock instead of the one given: a block
    kept 5 seconds after its release at t=0 is still retained at t=4 and falls back at t=6."""
    now = [0.0]
    manager = HybridKVCacheManager(8, BS, (None, 8), clock=lambda: now[0])
    request = req("a", tokens(5))
    admit_blocks(manager, request)
    block = manager.block_pool.blocks[1]  # group 0's block 0: full, cached, held
    manager.block_pool.retain(block, 60, 5.0)
    manager.free(request)
    now[0] = 4.0
    assert manager.block_pool.expire() == 0 and block.priority == 60
    now[0] = 6.0
    assert manager.block_pool.expire() == 1 and block.priority == DEFAULT_PRIORITY


def test_the_chain_is_the_single_group_chain_of_the_given_root_and_algorithm() -> None:
    """Catches ``hash_root`` or ``hash_algo`` not passed on: rule 1 says the chain is computed
    as for one group, so it equals a full-attention manager's of the same settings."""
    root = 12345
    hybrid = HybridKVCacheManager(8, BS, (None, 8), hash_root=root)
    plain = KVCacheManager(8, BS, hash_root=root)
    other = KVCacheManager(8, BS)
    chain = list(hybrid.block_hashes(req("a", tokens(8))))
    assert chain == list(plain.block_hashes(req("a", tokens(8))))
    assert chain != list(other.block_hashes(req("a", tokens(8))))

    hybrid = HybridKVCacheManager(8, BS, (None, 8), True, "sha256")
    plain = KVCacheManager(8, BS, True, "sha256")
    chain = list(hybrid.block_hashes(req("a", tokens(8))))
    assert chain == list(plain.block_hashes(req("a", tokens(8))))
    value = hash_value_of(chain[0])
    assert isinstance(value, bytes) and len(value) == 32


def test_log_stats_off_counts_nothing() -> None:
    """Catches ``log_stats`` not passed on, or the stats recorded when either flag is set."""
    manager = HybridKVCacheManager(16, BS, (None, 8), log_stats=False)
    admit_blocks(manager, req("a", tokens(9)))
    assert manager.get_computed_blocks(req("b", tokens(9)))[1] == 8
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits, stats.query_tokens) == (0, 0, 0, 0)


def test_a_window_of_six_needs_the_two_blocks_before_the_hit_end() -> None:
    """Catches the window's block count taken as ceil((W - 2) / bs): with W = 6 a hit of L
    blocks reads tokens 4L-5 .. 4L, i.e. blocks L-2 and L-1, not only L-1. Block 2 evicted:
    L=4 needs block 2, L=3 blocks 1 and 2, L=2 blocks 0 and 1, so the hit is 8 tokens."""
    manager = HybridKVCacheManager(8, BS, (6,))
    first = req("a", tokens(17))
    admit_blocks(manager, first)
    assert manager.get_group_block_ids(first) == [[1, 2, 3, 4, 5]]
    manager.free(first)
    evict(manager, {3})
    hits, num_hit = manager.get_computed_blocks(req("b", tokens(17)))
    assert (ids(hits), num_hit) == ([1, 2], 8)


# ----------------------------------------------------------------- keys per group
def test_every_group_registers_under_its_own_key_for_every_request() -> None:
    """Catches group 0 not registering under the plain chain hash, the group keys of one
    request reused for another, and a request's cached-block count kept under a shared key
    (the second request's blocks would then go unregistered)."""
    manager = HybridKVCacheManager(32, BS, (None, 8, 8))
    first, second = req("a", tokens(13)), req("b", tokens(9, offset=100))
    admit_blocks(manager, first)
    admit_blocks(manager, second)
    pool = manager.block_pool
    for request, num_full in ((first, 3), (second, 2)):
        chain = manager.block_hashes(request)
        tables = manager.get_group_block_ids(request)
        for g in range(3):
            for i in range(num_full):
                block = pool.get_cached_block(group_key(chain[i], g))
                assert block is not None and block.block_id == tables[g][i], (request, g, i)
        assert pool.get_cached_block(((hash_value_of(chain[0]), 0), chain[0])) is None


def test_a_reused_request_id_gets_the_keys_of_its_new_tokens() -> None:
    """Catches the group keys of a finished request kept under its id: a later request with the
    same id but other tokens must register its window blocks under its own keys."""
    manager = HybridKVCacheManager(32, BS, (None, 8))
    first = req("a", tokens(9))
    admit_blocks(manager, first)
    manager.free(first)
    manager.free_block_hashes(first)
    second = req("a", tokens(9, offset=100))
    admit_blocks(manager, second)
    chain = manager.block_hashes(second)
    window_table = manager.get_group_block_ids(second)[1]
    for i in range(2):
        block = manager.block_pool.get_cached_block(group_key(chain[i], 1))
        assert block is not None and block.block_id == window_table[i]
    assert manager.get_computed_blocks(req("c", tokens(9, offset=100)))[1] == 8


# ----------------------------------------------------------------- lookup
def test_caching_off_looks_nothing_up_counts_nothing_and_frees_cleanly() -> None:
    """Catches a lookup (and a counted request) with caching off, a miss of 1 token, and a free
    that expects a cached-block count that caching off never sets."""
    manager = HybridKVCacheManager(16, BS, (None, 8), enable_caching=False)
    request = req("a", tokens(9))
    assert manager.get_computed_blocks(request) == ([], 0)
    assert manager.allocate_slots(request, 9) is not None
    manager.free(request)
    assert manager.num_free_blocks == 15
    assert manager.get_computed_blocks(req("b", tokens(9))) == ([], 0)
    assert manager.make_prefix_cache_stats().requests == 0


def test_prompt_logprob_requests_get_no_hit_and_are_not_counted() -> None:
    """Catches a prompt-logprob request served from the cache (it needs its whole prompt
    computed), or answered with a hit of 1 token."""
    manager = HybridKVCacheManager(16, BS, (None, 8))
    admit_blocks(manager, req("a", tokens(9)))
    manager.make_prefix_cache_stats()
    wants = req("b", tokens(9), wants_prompt_logprobs=True)
    assert manager.get_computed_blocks(wants) == ([], 0)
    assert manager.make_prefix_cache_stats().requests == 0


def test_one_token_past_whole_blocks_hits_them_all() -> None:
    """Catches a lookup limit of (n - 2) // bs: 9 tokens leave token 8 to compute, so both full
    blocks are hits."""
    manager = HybridKVCacheManager(16, BS, (None, 8))
    admit_blocks(manager, req("a", tokens(9)))
    hits, num_hit = manager.get_computed_blocks(req("b", tokens(9)))
    assert (ids(hits), num_hit) == ([1, 2, 4, 5], 8)


def test_an_earlier_window_group_is_checked_again_after_a_later_group_shortens_the_hit() -> None:
    """Catches the lookup stopping after one pass: the window group (window 4, so a hit of L
    blocks needs block L-1) has blocks 0 and 3, the full group blocks 0 and 1. L=4 suits the
    window group only, L=2 the full group only; the hit is L=1."""
    manager = HybridKVCacheManager(16, BS, (4, None))
    first = req("a", tokens(16))
    admit_blocks(manager, first)
    assert manager.get_group_block_ids(first) == [[1, 2, 3, 4], [5, 6, 7, 8]]
    manager.free(first)
    evict(manager, {2, 3, 7, 8})
    hits, num_hit = manager.get_computed_blocks(req("b", tokens(17)))
    assert (ids(hits), num_hit) == ([1, 5], 4)


def test_eagle_miss_is_no_hit() -> None:
    """Catches eagle dropping a block from an empty hit (a hit of -1 blocks)."""
    manager = HybridKVCacheManager(16, BS, (None, 8), use_eagle=True)
    assert manager.get_computed_blocks(req("a", tokens(9))) == ([], 0)
    assert manager.make_prefix_cache_stats().hits == 0


def test_eagle_turns_a_one_block_hit_into_none() -> None:
    """Catches eagle sparing a hit of one block."""
    manager = HybridKVCacheManager(16, BS, (None, 8), use_eagle=True)
    admit_blocks(manager, req("a", tokens(5)))
    assert manager.get_computed_blocks(req("b", tokens(5))) == ([], 0)


def test_eagle_drops_exactly_one_block() -> None:
    """Catches eagle cutting the hit to one block instead of dropping one: 4 blocks hit, 3
    remain; token 12 reads 5..12, so the window group serves blocks 1 and 2."""
    manager = HybridKVCacheManager(16, BS, (None, 8), use_eagle=True)
    first = req("a", tokens(17))
    admit_blocks(manager, first)
    assert manager.get_group_block_ids(first) == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    hits, num_hit = manager.get_computed_blocks(req("b", tokens(17)))
    assert (ids(hits), num_hit) == ([1, 2, 3, 0, 7, 8], 12)


def test_record_stats_false_defers_counting_to_record_lookup() -> None:
    """Catches a lookup counted although ``record_stats=False``, and ``record_lookup`` counting
    every group's blocks (or failing on a count) instead of the chain's."""
    manager = HybridKVCacheManager(16, BS, (None, 8))
    admit_blocks(manager, req("a", tokens(9)))
    manager.make_prefix_cache_stats()
    later = req("b", tokens(9))
    hits, num_hit = manager.get_computed_blocks(later, record_stats=False)
    assert (len(hits), num_hit) == (4, 8)
    assert manager.make_prefix_cache_stats().requests == 0
    for hit in (hits, 2):
        manager.record_lookup(later, hit)
        stats = manager.make_prefix_cache_stats()
        assert (stats.requests, stats.queries, stats.hits, stats.query_tokens,
                stats.hit_tokens) == (1, 2, 2, 9, 8)


# ----------------------------------------------------------------- allocation
def test_no_new_tokens_is_refused_with_its_message() -> None:
    """Catches an allocation of 0 tokens accepted, or refused without the message."""
    manager = HybridKVCacheManager(16, BS, (None, 8))
    for n in (0, -1):
        with pytest.raises(ValueError) as info:
            manager.allocate_slots(req("a", tokens(4)), n)
        assert str(info.value) == f"num_new_tokens must be positive, got {n}"
    assert manager.num_free_blocks == 15


def test_hit_on_a_hybrid_model_reserves_only_the_missing_blocks() -> None:
    """Catches a hit's blocks miscounted (subtracted from the computed tokens, added to the
    blocks to allocate, counted twice or with held and null blocks as evictable), the hits
    split wrongly between the groups, and the hits registered (and reported) again, the null
    block among them. Pool of 8 usable blocks, all held by the 4 cached blocks of each group
    once free: 2 of those are outside the window, so exactly one new block per group fits."""
    manager = HybridKVCacheManager(9, BS, (8, None))
    first = req("a", tokens(16))
    admit_blocks(manager, first)
    assert manager.get_group_block_ids(first) == [[1, 2, 3, 4], [5, 6, 7, 8]]
    manager.free(first)
    publisher = KVEventPublisher("r", BS)
    manager.block_pool.event_sink = publisher
    second = req("b", tokens(20))
    hits, num_hit = manager.get_computed_blocks(second)
    # token 16 reads 9..16: the window group needs blocks 2 and 3 only
    assert (ids(hits), num_hit) == ([0, 0, 3, 4, 5, 6, 7, 8], 16)
    new = manager.allocate_slots(second, 4, hits)
    assert new is not None
    # free list after the release (tails first: 4 8 3 7 2 6 1 5) less the hits: 2 then 1
    assert ids(new) == [2, 1]
    assert manager.get_group_block_ids(second) == [[0, 0, 3, 4, 2], [5, 6, 7, 8, 1]]
    assert manager.num_free_blocks == 0
    assert manager.null_block.block_hash is None
    chain = [hash_value_of(h) for h in manager.block_hashes(second)]
    batch = publisher.flush()
    assert batch is not None
    assert batch.events == (
        BlockRemoved((chain[1], chain[0])),
        BlockStored((chain[4],), chain[3], 4, None),
        BlockStored(((chain[4], 1),), (chain[3], 1), 4, None),
    )


def test_free_hits_count_against_the_free_blocks() -> None:
    """Catches free hit blocks not subtracted from the free blocks (or held or null blocks
    subtracted instead): 8 free blocks, 6 of them are the hits, 4 new ones are needed, so the
    allocation fails and changes nothing."""
    manager = HybridKVCacheManager(9, BS, (8, None))
    admit_blocks(manager, req("a", tokens(16)))
    manager.free(req("a", []))
    second = req("b", tokens(24))
    hits, num_hit = manager.get_computed_blocks(second)
    assert (ids(hits), num_hit) == ([0, 0, 3, 4, 5, 6, 7, 8], 16)
    assert manager.allocate_slots(second, 8, hits) is None
    assert manager.num_free_blocks == 8
    assert manager.get_group_block_ids(second) == [[], []]
    assert ids(manager.get_computed_blocks(req("c", tokens(24)))[0]) == [0, 0, 3, 4, 5, 6, 7, 8]


def test_blocks_sliding_out_of_a_window_make_room_exactly() -> None:
    """Catches the window group's releasable blocks not counted as room (lost to a later group,
    subtracted, or counted only when shared): the pool is full, token 16 reads 9..16, so the
    window group's blocks 0 and 1 make room for one new block per group."""
    manager = HybridKVCacheManager(9, BS, (8, None))
    request = req("a", tokens(16))
    admit_blocks(manager, request)
    assert manager.num_free_blocks == 0
    grow(request, 4)
    new = manager.allocate_slots(request, 4)
    assert new is not None
    # released newest first (2 then 1), so the window group gets 2 and the full group 1
    assert ids(new) == [2, 1]
    assert manager.get_group_block_ids(request) == [[0, 0, 3, 4, 2], [5, 6, 7, 8, 1]]


def test_one_block_short_after_sliding_out_returns_none_and_changes_nothing() -> None:
    """Catches releasable blocks counted once too often: 1 free block plus 2 releasable ones
    are one short of the 4 needed, so nothing slides out and None comes back."""
    manager = HybridKVCacheManager(10, BS, (8, None))
    request = req("a", tokens(16))
    admit_blocks(manager, request)
    assert manager.num_free_blocks == 1
    grow(request, 8)
    assert manager.allocate_slots(request, 8) is None
    assert manager.get_group_block_ids(request) == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert manager.num_free_blocks == 1


def test_a_window_block_another_request_holds_is_not_room() -> None:
    """Catches a shared (or null) block before the window counted as releasable: the block
    that slides out of b's window is still a's, so releasing it frees nothing."""
    manager = HybridKVCacheManager(14, BS, (8, None))
    first = req("a", tokens(17))
    admit_blocks(manager, first)
    assert manager.get_group_block_ids(first) == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    second = req("b", tokens(20))
    admit_blocks(manager, second)
    assert manager.get_group_block_ids(second) == [[0, 0, 3, 4, 11], [6, 7, 8, 9, 12]]
    assert manager.num_free_blocks == 1
    grow(second, 4)
    # token 20 reads 13..20: block 2 (id 3, a's too) slides out of b's window
    assert manager.allocate_slots(second, 4) is None
    assert manager.get_group_block_ids(second) == [[0, 0, 3, 4, 11], [6, 7, 8, 9, 12]]
    assert manager.num_free_blocks == 1


def test_an_allocation_inside_the_last_block_takes_no_block() -> None:
    """Catches a new block per group taken when the tokens fit in the blocks held."""
    manager = HybridKVCacheManager(16, BS, (None, 8))
    request = req("a", tokens(5))
    admit_blocks(manager, request)
    grow(request, 1)
    assert manager.allocate_slots(request, 1) == []
    assert manager.get_group_block_ids(request) == [[1, 2], [3, 4]]
    assert manager.num_free_blocks == 15 - 4


def test_an_allocation_that_takes_no_block_leaves_expiry_lazy() -> None:
    """Catches the pool's eviction path called for zero blocks, which runs expiry: expiry runs
    before an eviction or a release, and an allocation inside the last block is neither."""
    now = [0.0]
    manager = HybridKVCacheManager(16, BS, (None, 8), clock=lambda: now[0])
    running = req("a", tokens(5))
    admit_blocks(manager, running)
    other = req("b", tokens(4, offset=100))
    assert ids(admit_blocks(manager, other)) == [5, 6]
    manager.block_pool.retain(manager.block_pool.blocks[5], 60, 5.0)
    manager.free(other)
    now[0] = 10.0
    grow(running, 1)
    assert manager.allocate_slots(running, 1) == []
    assert manager.block_pool.num_free_by_priority() == {DEFAULT_PRIORITY: 10, 60: 1}
    assert manager.block_pool.expire() == 1


def test_group_zero_table_is_the_request_block_table() -> None:
    """Catches the request's block table (``req_to_blocks``) not being group 0's table."""
    manager = HybridKVCacheManager(16, BS, (None, 8))
    request = req("a", tokens(9))
    admit_blocks(manager, request)
    assert manager.get_block_ids(request) == [1, 2, 3]
    assert manager.get_group_block_ids(request) == [[1, 2, 3], [4, 5, 6]]


def test_chunks_register_only_their_new_blocks() -> None:
    """Catches every full block registered (and reported) again at each chunk."""
    manager = HybridKVCacheManager(32, BS, (None, 8))
    publisher = KVEventPublisher("r", BS)
    manager.block_pool.event_sink = publisher
    request = req("a", tokens(16))
    chain = [hash_value_of(h) for h in manager.block_hashes(request)]
    assert manager.allocate_slots(request, 8) is not None
    request.num_computed_tokens = 8
    assert manager.allocate_slots(request, 8) is not None
    batch = publisher.flush()
    assert batch is not None
    assert batch.events == (
        BlockStored((chain[0], chain[1]), None, 8, None),
        BlockStored(((chain[0], 1), (chain[1], 1)), None, 8, None),
        BlockStored((chain[2], chain[3]), chain[1], 8, None),
        BlockStored(((chain[2], 1), (chain[3], 1)), (chain[1], 1), 8, None),
    )


# ----------------------------------------------------------------- release
def test_remove_skipped_blocks_of_an_unknown_request_changes_nothing() -> None:
    """Catches True reported for a request that holds no table."""
    manager = HybridKVCacheManager(16, BS, (None, 8))
    assert manager.remove_skipped_blocks(req("a", tokens(40), num_computed_tokens=40)) is False


def test_free_of_a_request_never_allocated_is_a_no_op() -> None:
    """Catches a free that expects the request to hold tables, a table or a cached count."""
    manager = HybridKVCacheManager(16, BS, (None, 8))
    manager.free(req("a", tokens(9)))
    request = req("b", tokens(9))
    admit_blocks(manager, request)
    manager.free(request)
    manager.free(request)
    assert manager.num_free_blocks == 15


def test_free_forgets_the_tables() -> None:
    """Catches group 0's table kept after ``free``."""
    manager = HybridKVCacheManager(16, BS, (None, 8))
    request = req("a", tokens(9))
    admit_blocks(manager, request)
    manager.free(request)
    assert manager.get_block_ids(request) == []
    assert manager.get_group_block_ids(request) == [[], []]


def test_a_resumed_request_caches_the_blocks_it_recomputes() -> None:
    """Catches the cached-block count kept across a preemption: a resumed request that hit 2 of
    its 4 full blocks must register the 2 it computes again."""
    manager = HybridKVCacheManager(32, BS, (None, 8))
    request = req("a", tokens(17))
    admit_blocks(manager, request)
    assert manager.get_group_block_ids(request)[0] == [1, 2, 3, 4, 5]
    manager.free(request)  # preempted: the chain stays
    request.num_computed_tokens = 0
    evict(manager, {3})  # group 0's block 2
    assert manager.get_computed_blocks(request)[1] == 8
    admit_blocks(manager, request)
    hits, num_hit = manager.get_computed_blocks(req("c", tokens(17)))
    assert num_hit == 16
    assert hits[2] is manager.req_to_blocks["a"][2]


def test_free_releases_tails_of_every_group_before_heads() -> None:
    """Catches ``free`` releasing group after group from the head: position by position from
    the tail, so the LRU order is 4 8 3 7 2 6 1 5."""
    manager = HybridKVCacheManager(9, BS, (None, 8))
    request = req("a", tokens(16))
    admit_blocks(manager, request)
    assert manager.get_group_block_ids(request) == [[1, 2, 3, 4], [5, 6, 7, 8]]
    manager.free(request)
    order = ids(list(manager.block_pool.free_blocks_in_eviction_order()))
    assert order == [4, 8, 3, 7, 2, 6, 1, 5]


# ----------------------------------------------------------------- blocks filled later
MANAGERS: dict[str, Callable[[], KVCacheManager]] = {
    "single group": lambda: KVCacheManager(32, BS),
    "hybrid, full + window of 8": lambda: HybridKVCacheManager(32, BS, (None, 8)),
    "hybrid, two full groups": lambda: HybridKVCacheManager(32, BS, (None, None)),
}


@pytest.mark.parametrize("make", MANAGERS.values(), ids=MANAGERS.keys())
def test_a_block_that_decode_fills_is_cached(make: Callable[[], KVCacheManager]) -> None:
    """9 prompt tokens (2 full blocks and 1 token), then decode to 13 tokens: the third block
    filled during decode, so a later request with those 13 tokens and one more hits all 3 full
    blocks (12 tokens). Catches a manager that counts the partly filled block as cached when
    the request is admitted, and so never registers it once it fills."""
    manager = make()
    first = req("first", tokens(9))
    admit_blocks(manager, first)
    for _ in range(4):  # each decode step allocates the slot of one more token
        grow(first, 1)
        assert manager.allocate_slots(first, 1) is not None
        first.num_computed_tokens += 1
    assert first.num_tokens == 13
    second = req("second", tokens(14))
    assert manager.get_computed_blocks(second)[1] == 12


@pytest.mark.parametrize("make", MANAGERS.values(), ids=MANAGERS.keys())
def test_chunks_not_aligned_to_blocks_cache_every_block_they_complete(
        make: Callable[[], KVCacheManager]) -> None:
    """A 12-token prompt prefilled in two chunks of 6: the first chunk fills block 0 and half of
    block 1, the second completes blocks 1 and 2, so a 13-token request with that prefix hits
    all 12 tokens. Catches the half-filled block counted as cached after the first chunk."""
    manager = make()
    first = req("first", tokens(12))
    for _ in range(2):
        assert manager.allocate_slots(first, 6) is not None
        first.num_computed_tokens += 6
    second = req("second", tokens(13))
    assert manager.get_computed_blocks(second)[1] == 12


# ----------------------------------------------------------------- retention and pins
def group_tables(manager: KVCacheManager, rid: str) -> list[list[KVCacheBlock]]:
    """Copies of the request's block table of every group (one table for a single group)."""
    if isinstance(manager, HybridKVCacheManager):
        return [list(table) for table in manager.group_blocks[rid]]
    return [list(manager.req_to_blocks[rid])]


def test_a_retained_prompt_keeps_its_cached_blocks_at_its_priority_in_every_group() -> None:
    """13 tokens with priority 80: the three full blocks of both groups are kept at 80 once
    freed, the partly filled fourth at the default. Catches retention applied to group 0 only,
    or not at all (the hybrid manager once ignored it)."""
    manager = HybridKVCacheManager(32, BS, (None, 8))
    request = req("sys", tokens(13), retention=Retention.whole_prompt(80))
    admit_blocks(manager, request)
    tables = [list(table) for table in manager.group_blocks["sys"]]
    manager.free(request)
    for table in tables:
        assert [block.priority for block in table] == [80, 80, 80, DEFAULT_PRIORITY]


def test_a_flood_evicts_an_unretained_prompt_before_the_retained_one_in_every_group() -> None:
    """``sys`` (retained) then ``other`` (not), both 13 tokens, both freed; a flood of 12 blocks
    takes the 7 never used and 5 more from the default list, oldest first: the partial blocks
    of ``sys`` and ``other`` and ``other``'s third block of group 0. ``sys`` still hits all 12
    tokens, ``other`` 8. Without retention in some group, ``sys``'s blocks of that group are
    in the default list ahead of ``other``'s and are taken instead."""
    manager = HybridKVCacheManager(24, BS, (None, 8))
    retained = req("sys", tokens(13), retention=Retention.whole_prompt(80))
    admit_blocks(manager, retained)
    other = req("other", tokens(13, offset=100))
    admit_blocks(manager, other)
    manager.free(retained)
    manager.free(other)
    never_used = 23 - 16
    flood = req("flood", tokens(4 * ((never_used + 5) // 2), offset=500))
    assert manager.allocate_slots(flood, flood.num_tokens) is not None
    assert manager.get_computed_blocks(req("again", tokens(13)))[1] == 12
    assert manager.get_computed_blocks(req("other-again", tokens(13, offset=100)))[1] == 8


def test_a_pinned_prefix_keeps_every_group_s_blocks_through_a_flood() -> None:
    """Pinning 12 tokens holds group 0's three blocks and the two group-1 blocks of the last
    window (5 blocks); a flood that takes every other block leaves the prefix a whole hit, and
    unpinning gives every block back. Catches a pin that holds group 0 only: the flood evicts
    the window's blocks and the prefix misses."""
    manager = HybridKVCacheManager(24, BS, (None, 8), max_pinned_fraction=1.0)
    first = req("sys", tokens(13))
    admit_blocks(manager, first)
    manager.free(first)
    probe = req("probe", tokens(12))
    pinned = manager.pin("p", list(manager.block_hashes(probe)))
    assert len(pinned) == 5
    free = manager.block_pool.get_num_free_blocks()
    assert free == 23 - 5
    flood = req("flood", tokens(4 * (free // 2), offset=500))
    assert manager.allocate_slots(flood, flood.num_tokens) is not None
    assert manager.get_computed_blocks(req("again", tokens(13)))[1] == 12
    manager.free(flood)
    assert manager.unpin("p")
    assert manager.block_pool.get_num_free_blocks() == 23


@pytest.mark.parametrize("make", MANAGERS.values(), ids=MANAGERS.keys())
def test_a_hit_keeps_the_higher_priority_another_request_gave_it(
        make: Callable[[], KVCacheManager]) -> None:
    """``high`` caches 8 tokens at priority 80; ``low`` (priority 20) hits them and computes one
    block more. Once both are freed, the hit blocks stay at 80 and only ``low``'s own block is
    at 20. Catches hit blocks treated as the request's fresh blocks (set to 20)."""
    manager = make()
    admit_blocks(manager, req("high", tokens(9), retention=Retention.whole_prompt(80)))
    low = req("low", tokens(13), retention=Retention.whole_prompt(20))
    admit_blocks(manager, low)
    tables = group_tables(manager, "low")
    manager.free(low)
    for table in tables:
        assert [block.priority for block in table[:3]] == [80, 80, 20]


@pytest.mark.parametrize("make", MANAGERS.values(), ids=MANAGERS.keys())
def test_a_later_chunk_leaves_the_retention_of_the_earlier_chunks_blocks(
        make: Callable[[], KVCacheManager]) -> None:
    """``slow`` (priority 20) prefills 12 tokens in chunks of 8 and 4; between them ``fast``
    (priority 80) hits the first chunk's 2 blocks and raises them to 80. The second chunk sets
    20 on its own new block only. Catches a chunk that re-applies the retention, as fresh, to
    every block from block 0 (the count of blocks already registered read as 0)."""
    manager = make()
    slow = req("slow", tokens(13), retention=Retention.whole_prompt(20))
    assert manager.allocate_slots(slow, 8) is not None
    slow.num_computed_tokens = 8
    admit_blocks(manager, req("fast", tokens(9), retention=Retention.whole_prompt(80)))
    assert manager.allocate_slots(slow, 4) is not None
    tables = group_tables(manager, "slow")
    for table in tables:
        assert [block.priority for block in table] == [80, 80, 20]


def test_pinning_a_prefix_whose_window_block_was_evicted_names_the_block() -> None:
    """After group 1's third block of a 12-token prefix is evicted, the window group serves only
    2 blocks of it: the pin is refused naming block 2, and nothing is pinned."""
    manager = HybridKVCacheManager(24, BS, (None, 8), max_pinned_fraction=1.0)
    first = req("sys", tokens(13))
    admit_blocks(manager, first)
    window_block = manager.group_blocks["sys"][1][2].block_id
    manager.free(first)
    evict(manager, {window_block})
    probe = req("probe", tokens(12))
    with pytest.raises(KeyError) as info:
        manager.pin("p", list(manager.block_hashes(probe)))
    assert info.value.args == ("block 2 of the prefix is not cached",)
    assert manager.pins == {} and manager.block_pool.get_num_free_blocks() == 23


@pytest.mark.parametrize("make", MANAGERS.values(), ids=MANAGERS.keys())
def test_a_block_that_a_later_chunk_completes_gets_the_prompts_retention(
        make: Callable[[], KVCacheManager]) -> None:
    """A 13-token prompt at priority 80 prefilled in chunks of 6, 6 and 1: block 1 is half
    filled by the first chunk and completed by the second. All three full blocks are kept at
    80. Catches the retention of a chunk applied only from the blocks it allocated, which left
    the block straddling each chunk boundary at the default (a hole in the retained prefix)."""
    manager = make()
    request = req("sys", tokens(13), retention=Retention.whole_prompt(80))
    for chunk in (6, 6, 1):
        assert manager.allocate_slots(request, chunk) is not None
        request.num_computed_tokens += chunk
        if chunk == 6:  # (the window group frees block 0 at the last chunk: kept from here)
            tables = group_tables(manager, "sys")
    manager.free(request)
    for table in tables:
        assert [block.priority for block in table] == [80, 80, 80]
