"""Sliding-window attention in the core: the exact blocks a hit needs and the exact step at which
a running request releases a block, for several window and block sizes.

Every expectation is derived here from positions, not from the manager's formulas: a token at
position ``p`` attends to positions ``p - window + 1 .. p``. A hit of ``h`` blocks is usable when
every position the next token (``h * block_size``) attends to, other than itself, lies in a cached
block; block ``j`` may be released once no token still to be computed attends to any of its
positions.
"""

from __future__ import annotations

import itertools

import pytest
from core_helpers import admit, decode, finish, run_once

from prefixserve.core import CacheRequest, KVCacheBlock, SlidingWindowKVCacheManager

pytestmark = pytest.mark.fast

# (window, block size): windows shorter than, equal to, and longer than a block; off-by-one
# windows around block multiples.
SHAPES = [(1, 4), (3, 4), (4, 4), (5, 4), (8, 4), (9, 4), (13, 4), (16, 16), (17, 16), (2, 1),
          (7, 2), (6, 3)]


def _attended(position: int, window: int) -> range:
    """The earlier positions the token at ``position`` attends to."""
    return range(max(0, position - window + 1), position)


def _usable(hit: int, cached: list[bool], bs: int, window: int) -> bool:
    """Whether a hit of ``hit`` blocks leaves every earlier position the next token needs in a
    cached block (a hit of 0 blocks is always usable)."""
    return all(cached[p // bs] for p in _attended(hit * bs, window))


def _expected_hit(cached: list[bool], max_hit: int, bs: int, window: int, eagle: bool) -> int:
    """The longest usable hit. With eagle the lookup drops the last block of the hit it found,
    so it may only return ``h - 1`` blocks when the hit of ``h`` blocks was itself all there:
    the window of the returned hit must be covered and its next block must be cached too."""
    if not eagle:
        return max(h for h in range(max_hit + 1)
                   if _usable(h, cached, bs, window) and (h == 0 or cached[h - 1]))
    best = 0
    for h in range(1, max_hit + 1):
        if cached[h - 1] and _usable(h - 1, cached, bs, window):
            best = h - 1
    return best


def _prime(manager: SlidingWindowKVCacheManager, hashes: list[str], cached: list[bool]) -> None:
    """Caches (then frees) one block for every ``hashes[i]`` with ``cached[i]``."""
    pool = manager.block_pool
    for block_hash, is_cached in zip(hashes, cached, strict=True):
        if is_cached:
            [block] = pool.get_new_blocks(1)
            pool.cache_full_blocks([block], [block_hash], 0, 1)
            pool.free_blocks([block])


def _check_hit(blocks: list[KVCacheBlock], num: int, manager: SlidingWindowKVCacheManager,
               hashes: list[str], expected: int) -> None:
    bs = manager.block_size
    assert num == expected * bs
    assert len(blocks) == expected
    for i, block in enumerate(blocks):
        needed = any(p // bs == i for p in _attended(expected * bs, manager.sliding_window))
        if needed:  # a needed block is the real cached block of that position
            assert block.block_hash == hashes[i], f"block {i} of the hit is not the cached one"
        else:  # an unneeded one is a placeholder or (at the very start) the real block
            assert block is manager.null_block or block.block_hash == hashes[i], \
                f"block {i} of the hit is some other block"


@pytest.mark.parametrize("eagle", [False, True])
@pytest.mark.parametrize(("window", "bs"), SHAPES)
def test_hit_is_the_longest_prefix_whose_window_is_cached(window: int, bs: int,
                                                           eagle: bool) -> None:
    """Every pattern of cached blocks over 6 blocks, and prompt lengths ending inside the last
    block and exactly on its end (where the last block is never looked up)."""
    num_blocks = 6
    for pattern in itertools.product([False, True], repeat=num_blocks):
        cached = list(pattern)
        hashes = [f"h{i}" for i in range(num_blocks)]
        for num_tokens in (num_blocks * bs + 1, num_blocks * bs):
            manager = SlidingWindowKVCacheManager(16, bs, sliding_window=window, use_eagle=eagle)
            _prime(manager, hashes, cached)
            request = CacheRequest("r", range(num_tokens), block_hashes=hashes)
            blocks, num = manager.get_computed_blocks(request)
            max_hit = (num_tokens - 1) // bs
            expected = _expected_hit(cached, max_hit, bs, window, eagle)
            _check_hit(blocks, num, manager, hashes, expected)


def test_use_eagle_needs_one_more_cached_block_before_dropping_one() -> None:
    """The minimal case: token 16 attends to positions 1..16, so a 16-token hit needs block 0.
    Dropping block 1 of the hit [null, block 1] would return a hit whose window is not cached."""
    manager = SlidingWindowKVCacheManager(10, 16, sliding_window=16, use_eagle=True)
    prompt = list(range(37))
    run_once(manager, CacheRequest("a", prompt))
    blocks, num = manager.get_computed_blocks(CacheRequest("b", prompt))
    assert num == 16
    assert not blocks[0].is_null and blocks[0].block_hash is not None


def test_a_gap_inside_the_window_moves_the_hit_before_the_gap() -> None:
    """Window 9 at block size 4: a hit of h blocks needs blocks h-2 and h-1. With block 3 of 5
    evicted, hits of 4 and 5 blocks have a gap in their window; the longest usable is 3 blocks
    (needs blocks 1 and 2), which is then computed from token 12."""
    manager = SlidingWindowKVCacheManager(32, 4, sliding_window=9)
    prompt = list(range(21))
    hashes = list(manager.block_hashes(CacheRequest("probe", prompt)))
    _prime(manager, hashes, [True, True, True, False, True])
    blocks, num = manager.get_computed_blocks(CacheRequest("b", prompt))
    assert num == 12
    null = manager.null_block
    assert blocks[0] is null and blocks[1].block_hash == hashes[1]
    assert blocks[2].block_hash == hashes[2]
    # with block 2 gone too, no window of 2 cached blocks is left before the end: the hit falls
    # back to the cached run at the very start (block 0 alone)
    manager = SlidingWindowKVCacheManager(32, 4, sliding_window=9)
    _prime(manager, hashes, [True, False, True, False, True])
    blocks, num = manager.get_computed_blocks(CacheRequest("c", prompt))
    assert num == 4 and blocks[0].block_hash == hashes[0]


def _released_blocks(position: int, window: int, bs: int) -> int:
    """How many leading blocks no token at ``position`` or later attends to."""
    first_needed = max(0, position - window + 1)
    return sum(1 for j in range(position // bs + 1) if (j + 1) * bs <= first_needed)


@pytest.mark.parametrize(("window", "bs"), SHAPES)
def test_a_block_is_released_exactly_when_the_window_leaves_it(window: int, bs: int) -> None:
    """Decodes one token at a time from a 1-token prompt; after each step the table holds the
    null block exactly where a block was released and real blocks everywhere else, and the free
    count says every released block went back."""
    total = 128
    manager = SlidingWindowKVCacheManager(total, bs, sliding_window=window)
    request = CacheRequest("a", [0])
    admit(manager, request)
    null = manager.null_block
    for position in range(1, 8 * bs + window + 2):
        decode(manager, request, [position % 7])
        table = manager.req_to_blocks["a"]
        released = _released_blocks(position, window, bs)
        assert len(table) == position // bs + 1
        assert [b is null for b in table] == [j < released for j in range(len(table))], \
            f"at position {position}"
        assert manager.num_free_blocks == total - 1 - (len(table) - released)
    finish(manager, request)
    assert manager.num_free_blocks == total - 1


@pytest.mark.parametrize(("window", "bs"), [(4, 4), (5, 4), (9, 4), (3, 2)])
def test_a_chunked_prefill_releases_blocks_the_next_chunk_does_not_attend_to(
        window: int, bs: int) -> None:
    """A prompt computed in chunks of 5 tokens: each allocation for a chunk starting at position
    p releases the blocks that no token from p on attends to."""
    manager = SlidingWindowKVCacheManager(64, bs, sliding_window=window)
    prompt = list(range(40))
    request = CacheRequest("a", prompt)
    null = manager.null_block
    for start in range(0, 40, 5):
        request.num_computed_tokens = start
        assert manager.allocate_slots(request, 5) is not None
        table = manager.req_to_blocks["a"]
        released = _released_blocks(start, window, bs)
        assert [b is null for b in table] == [j < released for j in range(len(table))]
    request.num_computed_tokens = 40
    finish(manager, request)
    assert manager.num_free_blocks == 63


def test_a_shared_block_leaves_the_table_but_stays_held_by_its_other_request() -> None:
    """Two requests share their first blocks from a hit; when one slides past them it drops its
    own references only: the blocks stay out of the free list while the other holds them, and
    the pool is short of the shared blocks until then."""
    manager = SlidingWindowKVCacheManager(16, 4, sliding_window=4)
    prompt = list(range(9))
    a = CacheRequest("a", list(prompt))
    admit(manager, a)
    b = CacheRequest("b", list(prompt))
    assert admit(manager, b) == 8
    shared = manager.req_to_blocks["b"][1]
    assert shared is manager.req_to_blocks["a"][1] and shared.ref_cnt == 2
    decode(manager, b, [1, 2, 3, 4, 5, 6, 7])  # b reaches position 15: blocks 0-2 leave it
    assert manager.req_to_blocks["b"][1] is manager.null_block
    assert shared.ref_cnt == 1 and manager.req_to_blocks["a"][1] is shared
    assert shared not in list(manager.block_pool.free_queue)
    finish(manager, a)
    finish(manager, b)
    assert manager.num_free_blocks == 15


def test_shared_blocks_sliding_out_make_no_room_for_a_new_one() -> None:
    """Only blocks the request alone holds come back to the free list when they slide out; a
    shared one stays held. Window 5 at block size 4: block 1 leaves the window at position 12,
    the step that needs b's 4th block. With the pool full and block 1 shared with a, that step
    cannot be satisfied: it returns None and changes nothing."""
    manager = SlidingWindowKVCacheManager(5, 4, sliding_window=5)  # 4 usable blocks
    prompt = list(range(9))
    admit(manager, CacheRequest("a", list(prompt)))  # a0 a1 a2
    b = CacheRequest("b", list(prompt))
    assert admit(manager, b) == 8  # [null, a1] hit, b2 new: the pool is full
    decode(manager, b, [1, 2, 3])  # positions 9-11 fit in b2
    assert manager.num_free_blocks == 0
    b.token_ids.append(4)
    table = list(manager.req_to_blocks["b"])
    assert [blk.ref_cnt for blk in table[1:]] == [2, 1] and table[0].is_null
    assert manager.allocate_slots(b, 1) is None
    assert manager.req_to_blocks["b"] == table and [blk.ref_cnt for blk in table[1:]] == [2, 1]


def test_a_block_shared_with_another_request_leaves_the_window_on_time() -> None:
    """Window 1 at block size 1: b hits a's block 0 and decodes; at position 1 block 0 leaves
    b's window although no block of b's own comes back to the pool: b drops its reference then,
    so when a finishes the block is free."""
    manager = SlidingWindowKVCacheManager(8, 1, sliding_window=1)
    a = CacheRequest("a", [1])
    admit(manager, a)
    b = CacheRequest("b", [1, 0])
    assert admit(manager, b) == 1
    shared = manager.req_to_blocks["a"][0]
    assert shared.ref_cnt == 2
    decode(manager, a, [5])
    assert manager.req_to_blocks["a"][0] is manager.null_block and shared.ref_cnt == 1
    finish(manager, b)
    assert shared.ref_cnt == 0 and manager.num_free_blocks == 7 - 1  # a's new block is held
