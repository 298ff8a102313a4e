"""Each rule of docs/prefix-cache.md sections 1-4 and 6 as its own test, on prefixserve.core
alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from core_helpers import admit, decode, finish, run_once

from prefixserve.core import (
    HASH_ALGOS,
    NONE_HASH,
    BlockPool,
    CacheRequest,
    KVCacheManager,
    MultiModalInput,
    PrefixCachingMetrics,
    SlidingWindowKVCacheManager,
    make_kv_cache_manager,
)
from prefixserve.core.hashing import get_hash_function, hash_block_chain, hash_block_tokens

pytestmark = pytest.mark.fast

ALGOS = pytest.mark.parametrize("algo", HASH_ALGOS)


def req(rid: str, tokens: list[int], **kw) -> CacheRequest:
    return CacheRequest(rid, list(tokens), **kw)


# ---------------------------------------------------------------- section 1: worked examples


@ALGOS
def test_worked_example_four_requests_save_60_percent(algo: str) -> None:
    manager = KVCacheManager(64, 4, hash_algo=algo)
    prefix = list(range(100, 116))
    computed = 0
    total = 0
    for i in range(4):
        r = req(f"r{i}", prefix + [200 + 4 * i + j for j in range(4)])
        cached = run_once(manager, r)
        computed += r.num_tokens - cached
        total += r.num_tokens
    assert (computed, total) == (32, 80)
    assert (total - computed) / total == pytest.approx(0.60)


def test_ten_shared_tokens_at_block_size_4_hit_8() -> None:
    manager = KVCacheManager(32, 4)
    shared = list(range(10))
    run_once(manager, req("a", shared + [50, 51, 52, 53]))
    assert run_once(manager, req("b", shared + [60, 61, 62, 63])) == 8


def test_repeated_64_token_prompt_hits_48_and_65_token_hits_64() -> None:
    manager = KVCacheManager(64, 16)
    prompt64 = list(range(1000, 1064))
    run_once(manager, req("a", prompt64))
    assert run_once(manager, req("b", prompt64)) == 48  # last block recomputed for logits
    prompt65 = prompt64 + [7]
    run_once(manager, req("c", prompt65))
    assert run_once(manager, req("d", prompt65)) == 64


def test_partial_blocks_are_never_cached() -> None:
    manager = KVCacheManager(32, 4)
    r = req("a", list(range(7)))
    admit(manager, r)
    assert len(manager.block_pool.cached_block_hash_to_block) == 1
    assert [b.block_hash is not None for b in manager.req_to_blocks["a"]] == [True, False]


# ---------------------------------------------------------------- section 2: hash chain


def test_same_tokens_different_history_hash_differently() -> None:
    function, root = get_hash_function("builtin")
    a = hash_block_chain(function, root, [1, 2, 3, 4, 9, 9, 9, 9], 4, 0, 2)
    b = hash_block_chain(function, root, [5, 6, 7, 8, 9, 9, 9, 9], 4, 0, 2)
    assert a[1][1] == b[1][1]  # same tokens in block 1
    assert a[1] != b[1] and a[1][0] != b[1][0]


@ALGOS
def test_block_hash_carries_value_tokens_and_extras(algo: str) -> None:
    function, root = get_hash_function(algo)
    value, tokens, extras = hash_block_tokens(function, root, [1, 2, 3], ("salt", "x"))
    assert tokens == (1, 2, 3) and extras == ("salt", "x")
    assert value == function(root, (1, 2, 3), ("salt", "x"))


def test_a_hash_value_collision_alone_gives_no_false_hit() -> None:
    pool = BlockPool(4)
    [block] = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [(12345, (1, 2), None)], 0, 1)
    assert pool.get_cached_block((12345, (1, 2), None)) is block
    assert pool.get_cached_block((12345, (3, 4), None)) is None  # same value, other tokens
    assert pool.get_cached_block((12345, (1, 2), ("lora", 1))) is None  # other extras


def _chains_in_subprocess(env_seed: str | None) -> dict[str, str]:
    """Block 1's hash (chained from ``NONE_HASH``) under every algorithm, computed in a fresh
    interpreter with ``PYTHONHASHSEED`` set to ``env_seed`` (unset for None)."""
    code = (
        "from prefixserve.core.hashing import get_hash_function, hash_block_chain\n"
        f"for algo in {list(HASH_ALGOS)!r}:\n"
        "    f, r = get_hash_function(algo)\n"
        "    print(algo, repr(hash_block_chain(f, r, list(range(32)), 16, 0, 2)[1][0]))"
    )
    env = dict(os.environ)
    env.pop("PYTHONHASHSEED", None)
    if env_seed is not None:
        env["PYTHONHASHSEED"] = env_seed
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout
    return dict(line.split(" ", 1) for line in out.splitlines())


@pytest.fixture(scope="module")
def chains_by_seed() -> dict[str | None, list[dict[str, str]]]:
    """Five fresh interpreters, shared by the three algorithms' tests: two with
    ``PYTHONHASHSEED=42``, one with 43, two with it unset."""
    return {seed: [_chains_in_subprocess(seed) for _ in range(runs)]
            for seed, runs in (("42", 2), ("43", 1), (None, 2))}


@ALGOS
def test_none_hash_is_shared_under_pythonhashseed_and_random_without(
        algo: str, chains_by_seed: dict[str | None, list[dict[str, str]]]) -> None:
    chains = {seed: [run[algo] for run in runs] for seed, runs in chains_by_seed.items()}
    assert chains["42"][0] == chains["42"][1]
    assert chains["42"][0] != chains["43"][0]
    assert chains[None][0] != chains[None][1]
    assert len(NONE_HASH) == 32


def test_unknown_hash_algo_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        KVCacheManager(8, 4, hash_algo="md5")


@ALGOS
def test_salt_isolates_every_block(algo: str) -> None:
    manager = KVCacheManager(64, 4, hash_algo=algo)
    prompt = list(range(21))
    run_once(manager, req("a", prompt, cache_salt="tenant-1"))
    assert run_once(manager, req("b", prompt, cache_salt="tenant-2")) == 0
    assert run_once(manager, req("c", prompt)) == 0
    assert run_once(manager, req("d", prompt, cache_salt="tenant-1")) == 20


def test_salt_enters_block_zero_only() -> None:
    manager = KVCacheManager(64, 4)
    r = req("a", list(range(12)), cache_salt="s")
    hashes = manager.block_hashes(r)
    assert [h[2] for h in hashes] == [(("salt", "s"),), None, None]


@ALGOS
def test_lora_ids_isolate(algo: str) -> None:
    manager = KVCacheManager(64, 4, hash_algo=algo)
    prompt = list(range(13))
    run_once(manager, req("a", prompt, lora_id=1))
    assert run_once(manager, req("b", prompt, lora_id=2)) == 0
    assert run_once(manager, req("c", prompt)) == 0
    assert run_once(manager, req("d", prompt, lora_id=1)) == 12


@ALGOS
def test_multimodal_hash_isolates_only_the_blocks_it_overlaps(algo: str) -> None:
    manager = KVCacheManager(64, 4, hash_algo=algo)
    prompt = list(range(17))  # 4 full blocks; the image sits on tokens 5..8 (blocks 1 and 2)
    run_once(manager, req("a", prompt, mm_inputs=[MultiModalInput(5, 4, "img-A")]))
    other = req("b", prompt, mm_inputs=[MultiModalInput(5, 4, "img-B")])
    hashes = manager.block_hashes(other)
    assert [h[2] for h in hashes] == [None, (("mm", "img-B"),), (("mm", "img-B"),), None]
    assert run_once(manager, other) == 4  # block 0 is shared, block 1 differs: stop there
    assert run_once(manager, req("c", prompt, mm_inputs=[MultiModalInput(5, 4, "img-A")])) == 16


def test_chain_is_kept_across_preemption_and_dropped_on_finish() -> None:
    manager = KVCacheManager(64, 4)
    r = req("a", list(range(10)))
    admit(manager, r)
    chain = list(manager.req_to_block_hashes["a"])
    manager.free(r)  # preemption
    assert manager.req_to_block_hashes["a"] == chain
    manager.free_block_hashes(r)
    assert "a" not in manager.req_to_block_hashes


def test_decode_hashes_only_the_block_that_just_became_full() -> None:
    manager = KVCacheManager(64, 4)
    r = req("a", list(range(6)))
    admit(manager, r)
    lengths = []
    first_hashes = list(manager.req_to_block_hashes["a"])
    for token in range(100, 110):
        decode(manager, r, [token])
        lengths.append(len(manager.req_to_block_hashes["a"]))
    # 7, 8 tokens -> 2 blocks full at 8; 12 -> 3; 16 -> 4
    assert lengths == [1, 2, 2, 2, 2, 3, 3, 3, 3, 4]
    assert manager.req_to_block_hashes["a"][:1] == first_hashes  # never recomputed
    assert manager.num_cached_block["a"] == 4


def test_precomputed_block_hashes_are_used_as_given() -> None:
    manager = KVCacheManager(64, 4)
    a = CacheRequest("a", range(10), block_hashes=["x", "y"])
    run_once(manager, a)
    b = CacheRequest("b", range(14), block_hashes=["x", "y", "z"])
    assert run_once(manager, b) == 8
    c = CacheRequest("c", range(14), block_hashes=["x", "q", "z"])
    assert run_once(manager, c) == 4


# ---------------------------------------------------------------- sections 3-4: pool and manager


def test_get_computed_blocks_is_a_pure_query() -> None:
    manager = KVCacheManager(16, 4)
    run_once(manager, req("a", list(range(12))))
    before = [(b.ref_cnt, b.block_hash) for b in manager.block_pool.blocks]
    free_before = list(manager.block_pool.free_queue)
    blocks, tokens = manager.get_computed_blocks(req("b", list(range(12))))
    assert tokens == 8 and len(blocks) == 2
    assert [(b.ref_cnt, b.block_hash) for b in manager.block_pool.blocks] == before
    assert list(manager.block_pool.free_queue) == free_before


def test_lookup_stops_at_first_miss() -> None:
    manager = KVCacheManager(32, 4)
    run_once(manager, req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0]))
    # block 1 differs, block 2 is the same tokens but its history differs: no hit there
    r = req("b", [1, 2, 3, 4, 0, 0, 0, 0, 9, 10, 11, 12, 0])
    assert manager.get_computed_blocks(r)[1] == 4


def test_prompt_logprobs_requests_hit_nothing_and_count_nothing() -> None:
    manager = KVCacheManager(32, 4)
    run_once(manager, req("a", list(range(9))))
    manager.make_prefix_cache_stats()
    assert manager.get_computed_blocks(req("b", list(range(9)), wants_prompt_logprobs=True)) \
        == ([], 0)
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)


def test_caching_off_finds_nothing_and_caches_nothing() -> None:
    manager = KVCacheManager(32, 4, enable_caching=False)
    run_once(manager, req("a", list(range(9))))
    assert run_once(manager, req("b", list(range(9)))) == 0
    assert manager.block_pool.cached_block_hash_to_block == {}
    with pytest.raises(TypeError):  # an unset (None) setting is resolved before the core
        KVCacheManager(8, 4, enable_caching=None)


def test_allocate_slots_returns_none_and_changes_nothing_when_short() -> None:
    manager = KVCacheManager(6, 4)
    run_once(manager, req("a", list(range(9))))  # leaves 2 cached free blocks
    holder = req("h", [50, 51, 52, 53, 54])
    admit(manager, holder)  # holds 2 blocks: 4 free, 2 of them cached
    big = req("b", list(range(8)) + list(range(300, 320)))  # 7 blocks, 2 of them hits
    computed, num = manager.get_computed_blocks(big)
    assert num == 8
    snapshot = (
        [(b.ref_cnt, b.block_hash) for b in manager.block_pool.blocks],
        [b.block_id for b in manager.block_pool.free_queue],
        dict(manager.block_pool.cached_block_hash_to_block),
        {k: list(v) for k, v in manager.req_to_blocks.items()},
        dict(manager.num_cached_block),
    )
    assert manager.allocate_slots(big, big.num_tokens - num, computed) is None
    assert snapshot == (
        [(b.ref_cnt, b.block_hash) for b in manager.block_pool.blocks],
        [b.block_id for b in manager.block_pool.free_queue],
        dict(manager.block_pool.cached_block_hash_to_block),
        {k: list(v) for k, v in manager.req_to_blocks.items()},
        dict(manager.num_cached_block),
    )


def test_hits_on_free_blocks_leave_the_free_list() -> None:
    manager = KVCacheManager(8, 4)
    run_once(manager, req("a", list(range(9))))
    assert manager.num_free_blocks == 8
    r = req("b", list(range(9)))
    assert admit(manager, r) == 8
    held = manager.req_to_blocks["b"]
    assert [b.ref_cnt for b in held] == [1, 1, 1]
    assert manager.num_free_blocks == 5
    assert not set(map(id, held)) & set(map(id, manager.block_pool.free_queue))


def test_eviction_order_after_freeing_two_requests() -> None:
    """Tails go first: blocks of a request are freed tail first, requests in the order they
    finish; the first block freed is the first evicted."""
    manager = KVCacheManager(6, 4)
    a = req("a", list(range(12)))  # blocks a0 a1 a2
    b = req("b", list(range(100, 112)))  # blocks b0 b1 b2
    admit(manager, a)
    admit(manager, b)
    a_ids = manager.get_block_ids(a)
    b_ids = manager.get_block_ids(b)
    finish(manager, a)
    finish(manager, b)
    order = [blk.block_id for blk in manager.block_pool.free_queue]
    assert order == a_ids[::-1] + b_ids[::-1]
    # a new request of 2 blocks evicts a2 then a1: a0 still hits
    admit(manager, req("c", list(range(200, 208))))
    assert manager.get_computed_blocks(req("d", list(range(12)) + [1]))[1] == 4
    assert manager.get_computed_blocks(req("e", list(range(100, 112)) + [1]))[1] == 12


def test_lazy_eviction_a_freed_block_still_hits_until_reused() -> None:
    manager = KVCacheManager(3, 4)
    run_once(manager, req("a", list(range(9))))
    assert manager.num_free_blocks == 3
    assert run_once(manager, req("b", list(range(9)))) == 8
    run_once(manager, req("c", list(range(500, 509))))  # takes all three blocks
    assert run_once(manager, req("d", list(range(9)))) == 0


def test_duplicates_allowed_two_blocks_may_hold_one_hash() -> None:
    manager = KVCacheManager(16, 4)
    a, b = req("a", list(range(9))), req("b", list(range(9)))
    # both looked up before either allocated: both miss, both compute the same content
    hits_a = manager.get_computed_blocks(a)
    hits_b = manager.get_computed_blocks(b)
    manager.allocate_slots(a, 9, hits_a[0])
    manager.allocate_slots(b, 9, hits_b[0])
    first_hash = manager.req_to_block_hashes["a"][0]
    holders = manager.block_pool.cached_blocks(first_hash)
    assert len(holders) == 2
    assert {h.block_id for h in holders} == {manager.get_block_ids(a)[0],
                                              manager.get_block_ids(b)[0]}
    table_a = manager.get_block_ids(a)
    finish(manager, a)
    finish(manager, b)
    assert table_a != manager.get_block_ids(b)  # b's table was never rewritten
    assert run_once(manager, req("c", list(range(9)))) == 8


def test_preempt_then_resume_reuses_the_chain_including_generated_tokens() -> None:
    manager = KVCacheManager(16, 4)
    r = req("a", list(range(6)))
    admit(manager, r)
    decode(manager, r, [40, 41, 42, 43, 44, 45, 46])  # 13 tokens: 3 full blocks
    chain = list(manager.req_to_block_hashes["a"])
    manager.free(r)  # preempted: blocks freed, chain kept
    r.num_computed_tokens = 0
    blocks, num = manager.get_computed_blocks(r)
    assert num == 12
    assert manager.req_to_block_hashes["a"] == chain
    assert manager.allocate_slots(r, r.num_tokens - num, blocks) is not None
    finish(manager, r)
    assert manager.num_free_blocks == 16


def test_use_eagle_drops_the_last_hit_block() -> None:
    manager = KVCacheManager(16, 4, use_eagle=True)
    run_once(manager, req("a", list(range(13))))
    assert manager.get_computed_blocks(req("b", list(range(13))))[1] == 8


def test_reset_when_idle_empties_the_cache() -> None:
    manager = KVCacheManager(8, 4)
    run_once(manager, req("a", list(range(9))))
    assert manager.reset_prefix_cache() is True
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in manager.block_pool.blocks)
    assert run_once(manager, req("b", list(range(9)))) == 0


def test_reset_under_traffic_drops_every_hash_so_an_identical_request_gets_no_hit() -> None:
    manager = KVCacheManager(8, 4)
    admit(manager, req("a", list(range(9))))  # holds 3 blocks, 2 of them cached
    assert manager.reset_prefix_cache() is True
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in manager.block_pool.blocks)
    assert manager.get_computed_blocks(req("b", list(range(9))))[1] == 0


def test_blocks_held_across_a_reset_come_back_uncached_and_their_eviction_keeps_the_map() -> None:
    manager = KVCacheManager(3, 4)
    a = req("a", list(range(9)))
    admit(manager, a)
    manager.reset_prefix_cache()
    decode(manager, a, [50, 51, 52])  # fills block 2: cached; blocks 0 and 1 stay uncached
    held = manager.req_to_blocks["a"]
    assert [b.block_hash is not None for b in held] == [False, False, True]
    finish(manager, a)
    assert manager.num_free_blocks == 3
    pool = manager.block_pool
    assert len(pool.cached_block_hash_to_block) == 1  # only the block filled after the reset
    run_once(manager, req("c", list(range(500, 509))))  # evicts all three blocks
    assert manager.num_free_blocks == 3
    assert len(pool.cached_block_hash_to_block) == 2  # c's two full blocks, nothing stale
    assert run_once(manager, req("e", list(range(500, 509)))) == 8
    assert run_once(manager, req("d", list(range(9)))) == 0


def test_blocks_a_running_request_fills_after_a_reset_are_cached_and_found() -> None:
    manager = KVCacheManager(16, 4)
    a = req("a", list(range(9)))
    admit(manager, a)
    manager.reset_prefix_cache()
    decode(manager, a, [50, 51, 52, 53])  # 13 tokens: block 2 became full after the reset
    tokens = list(a.token_ids[:12])
    # block 0 is a miss now, so the lookup stops there (first-miss rule) ...
    assert manager.get_computed_blocks(req("x", tokens + [7]))[1] == 0
    # ... until a request computes the head again; then a's post-reset block 2 is found
    run_once(manager, req("b", tokens[:8] + [99]))
    blocks, num = manager.get_computed_blocks(req("c", tokens + [7]))
    assert num == 12
    assert blocks[2] is manager.req_to_blocks["a"][2]
    finish(manager, a)
    assert manager.num_free_blocks == 16


def test_sliding_window_and_null_block_survive_a_reset_under_traffic() -> None:
    manager = SlidingWindowKVCacheManager(32, 4, sliding_window=4)
    r = req("a", list(range(9)))
    admit(manager, r)
    decode(manager, r, [1, 2, 3])
    manager.reset_prefix_cache()
    decode(manager, r, list(range(10)))  # blocks slide out (freed uncached) and new ones fill
    null = manager.block_pool.null_block
    assert null is not None and null.is_null and null.block_hash is None
    assert manager.req_to_blocks["a"][0] is null
    finish(manager, r)
    assert manager.num_free_blocks == 31
    assert run_once(manager, req("b", list(range(600, 621)))) == 0
    assert manager.num_free_blocks == 31


def test_usage_and_free_count() -> None:
    manager = KVCacheManager(10, 4)
    r = req("a", list(range(9)))
    admit(manager, r)
    assert manager.num_free_blocks == 7
    assert manager.usage == pytest.approx(0.3)
    finish(manager, r)
    assert manager.usage == 0.0


# ---------------------------------------------------------------- sliding window


def test_sliding_window_hit_uses_null_blocks_outside_the_window() -> None:
    manager = make_kv_cache_manager(32, 4, sliding_window=8)
    assert isinstance(manager, SlidingWindowKVCacheManager)
    assert type(make_kv_cache_manager(32, 4)) is KVCacheManager
    with pytest.raises(TypeError):  # the full-attention constructor takes no window
        KVCacheManager(32, 4, sliding_window=8)  # type: ignore[call-arg]
    prompt = list(range(21))
    run_once(manager, req("a", prompt))
    blocks, num = manager.get_computed_blocks(req("b", prompt))
    assert num == 20
    null = manager.block_pool.null_block
    # while "a" ran, blocks that slid out of its window were freed: only the last ones hit
    assert [b is null for b in blocks][-2:] == [False, False]
    assert blocks[0] is null


def test_sliding_window_frees_blocks_that_slide_out_while_running() -> None:
    manager = SlidingWindowKVCacheManager(32, 4, sliding_window=4)
    r = req("a", list(range(4)))
    admit(manager, r)
    used = []
    for token in range(20):
        decode(manager, r, [token])
        used.append(32 - 1 - manager.num_free_blocks)
    assert max(used) <= 3  # window of 4 tokens never needs more than 3 blocks of 4 held
    null = manager.block_pool.null_block
    assert manager.req_to_blocks["a"][0] is null
    finish(manager, r)
    assert manager.num_free_blocks == 31


# Exact hits with gaps in the window and the exact release steps: test_core_sliding_window.py.


# ---------------------------------------------------------------- section 6: stats


def test_stats_count_queries_and_hits_in_blocks_and_tokens() -> None:
    manager = KVCacheManager(32, 4)
    run_once(manager, req("a", list(range(10))))
    run_once(manager, req("b", list(range(10))))
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 4, 2)
    assert (stats.query_tokens, stats.hit_tokens) == (20, 8)
    assert manager.make_prefix_cache_stats().requests == 0  # a new period started


def test_rolling_hit_rate_window_and_reset() -> None:
    metrics = PrefixCachingMetrics(max_recent_requests=1000)
    manager = KVCacheManager(64, 4)
    for i in range(600):  # cold: every request misses
        run_once(manager, req(f"m{i}", [i, i, i, i, 1]))
        metrics.observe(manager.make_prefix_cache_stats())
    assert metrics.hit_rate == 0.0
    for i in range(600):  # warm: one block queried, one hit
        run_once(manager, req(f"h{i}", [7, 7, 7, 7, 1]))
        metrics.observe(manager.make_prefix_cache_stats())
    assert metrics.window_requests == 1000
    assert metrics.hit_rate == pytest.approx(599 / 1000)  # the first "h" request missed
    assert metrics.requests == 1200 and metrics.queries == 1200 and metrics.hits == 599
    assert manager.reset_prefix_cache()
    metrics.observe(manager.make_prefix_cache_stats())
    assert metrics.window_requests == 0 and metrics.hit_rate == 0.0
    assert metrics.hits == 599  # counters are never reset


def test_core_imports_without_torch_or_numpy() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\nsys.modules['numpy'] = None\n"
        "import prefixserve.core\n"
        "m = prefixserve.core.KVCacheManager(4, 4)\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr
