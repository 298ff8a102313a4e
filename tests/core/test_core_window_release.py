"""Blocks that slid out of a window are released right after the step that pushed them out
(``remove_skipped_blocks``), not only at the request's own next allocation: the exact release
step of the hybrid and sliding-window managers, that the released blocks stay hits, and the
scheduler case it exists for (a request scheduled earlier in the next step needs those blocks;
without the release it preempts the request that holds them). The engine's wiring is in
``tests/engine/test_engine_window_release.py``."""

from __future__ import annotations

import pytest

from prefixserve.core import CacheRequest, KVCacheManager, SlidingWindowKVCacheManager
from prefixserve.core.hybrid_kv_cache_manager import HybridKVCacheManager
from prefixserve.engine.request import Request
from prefixserve.engine.scheduler import Scheduler
from prefixserve.sampling_params import SamplingParams

pytestmark = pytest.mark.fast

BS = 16
WINDOW = 32


def request(rid: str, num_tokens: int, offset: int = 0) -> CacheRequest:
    return CacheRequest(rid, token_ids=list(range(offset, offset + num_tokens)),
                        cache_salt=None, lora_id=None)


def test_hybrid_window_group_releases_exactly_the_blocks_before_the_next_tokens_window() -> None:
    """Window 32, blocks of 16: the token at position p reads ``p - 31 .. p``, so after p
    tokens are computed the blocks wholly before ``p - 31`` go: 3 at p = 94 (position 63 is
    still read), 4 at p = 95. The full group keeps everything; a second call frees nothing."""
    manager = HybridKVCacheManager(40, BS, (None, WINDOW))
    req = request("a", 110)
    assert manager.allocate_slots(req, 110) is not None
    free = manager.block_pool.get_num_free_blocks()
    assert free == 39 - 2 * 7
    before = 0
    for computed, released in ((30, 0), (46, 0), (47, 1), (94, 3), (95, 4), (110, 4)):
        req.num_computed_tokens = computed
        assert manager.remove_skipped_blocks(req) == (released > before), computed
        before = released
        assert manager.block_pool.get_num_free_blocks() == free + released, computed
        full, window = manager.get_group_block_ids(req)
        assert 0 not in full and len(full) == len(window) == 7
        null = manager.null_block.block_id
        assert window[:released] == [null] * released
        assert null not in window[released:], computed
    assert manager.remove_skipped_blocks(req) is False
    manager.free(req)
    assert manager.block_pool.get_num_free_blocks() == 39


def test_sliding_window_manager_releases_the_same_blocks() -> None:
    manager = SlidingWindowKVCacheManager(20, BS, sliding_window=WINDOW)
    req = request("a", 100)
    assert manager.allocate_slots(req, 100) is not None
    assert manager.block_pool.get_num_free_blocks() == 19 - 7
    req.num_computed_tokens = 94
    assert manager.remove_skipped_blocks(req) is True
    assert manager.block_pool.get_num_free_blocks() == 19 - 7 + 3
    req.num_computed_tokens = 95
    assert manager.remove_skipped_blocks(req) is True
    assert manager.get_block_ids(req)[:5] == [manager.null_block.block_id] * 4 + [
        manager.get_block_ids(req)[4]]
    assert manager.block_pool.get_num_free_blocks() == 19 - 7 + 4
    assert manager.remove_skipped_blocks(req) is False


def test_full_attention_releases_nothing() -> None:
    manager = KVCacheManager(20, BS)
    req = request("a", 100)
    assert manager.allocate_slots(req, 100) is not None
    req.num_computed_tokens = 100
    assert manager.remove_skipped_blocks(req) is False
    assert manager.block_pool.get_num_free_blocks() == 20 - 7


def test_released_blocks_stay_hits() -> None:
    """A second request with the same tokens hits the whole prefix: the window group's blocks
    near the hit's end were released early but keep their hashes."""
    manager = HybridKVCacheManager(40, BS, (None, WINDOW))
    first = request("a", 100)
    assert manager.allocate_slots(first, 100) is not None
    first.num_computed_tokens = 100
    assert manager.remove_skipped_blocks(first)
    manager.free(first)
    second = request("b", 100)
    hits, num = manager.get_computed_blocks(second)
    assert num == 96 and len(hits) == 2 * 6
    assert not any(b.is_null for b in hits[6 + 6 - 2:])  # the window's 2 blocks before 96


def make_request(rid: str, num_tokens: int, offset: int) -> Request:
    ids = list(range(offset, offset + num_tokens))
    return Request(request_id=rid, token_ids=list(ids), prompt_token_ids=list(ids),
                   params=SamplingParams(max_tokens=10))


def run_step(scheduler: Scheduler, release: bool) -> int:
    """One step with a simulated model, as ``LLMEngine.step`` does; returns preemptions."""
    out = scheduler.schedule()
    for item in out.scheduled:
        item.request.num_computed_tokens += item.num_new_tokens
        if item.request.is_prefill_done:
            item.request.append_output_token(1)
    if release:
        scheduler.release_out_of_window([item.request for item in out.scheduled])
    return out.num_preempted


@pytest.mark.parametrize("release", [True, False])
def test_release_after_the_step_spares_a_preemption(release: bool) -> None:
    """B (16 tokens) runs first, A (160 tokens, 10 blocks per group) second; 22 usable blocks
    are all taken after the prefill step. In the next step B needs 2 blocks before A is
    reached: with the release A has already given back 8 window blocks, without it B must
    preempt A (the behaviour this test documents and the release removes)."""
    manager = HybridKVCacheManager(23, BS, (None, WINDOW))
    scheduler = Scheduler(manager, 8, 1000)
    b, a = make_request("b", 16, 0), make_request("a", 160, 1000)
    scheduler.add_request(b)
    scheduler.add_request(a)
    assert run_step(scheduler, release) == 0
    assert manager.block_pool.get_num_free_blocks() == (8 if release else 0)
    if release:  # the request's ids follow the table: the null block where it slid out
        assert a.extra_block_ids[0][:8] == [manager.null_block.block_id] * 8
    preempted = run_step(scheduler, release)
    assert preempted == (0 if release else 1)
    assert [r.request_id for r in scheduler.running] == (["b", "a"] if release else ["b"])
