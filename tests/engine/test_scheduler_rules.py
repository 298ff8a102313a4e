"""The scheduler's rules, one test each, with the exact schedule every step must produce: the real
``Scheduler`` over the real ``KVCacheManager`` and a simulated model (one output token per
request whose prefill is done, as ``LLMEngine`` does)."""

from __future__ import annotations

import time

import pytest
from scheduler_helpers import add, make, step

from prefixserve.core import KVCacheManager, SlidingWindowKVCacheManager
from prefixserve.engine.request import Request, RequestStatus
from prefixserve.engine.scheduler import Scheduler
from prefixserve.sampling_params import SamplingParams

pytestmark = pytest.mark.fast


def test_chunked_prefill_splits_a_prompt_over_steps_within_the_budget() -> None:
    scheduler = make(64, 4, budget=16)
    add(scheduler, "a", list(range(50)))
    assert [step(scheduler) for _ in range(5)] == [
        [("a", 16)], [("a", 16)], [("a", 16)], [("a", 2)], [("a", 1)]]


def test_running_requests_consume_the_budget_before_waiting_ones_start() -> None:
    scheduler = make(64, 4, budget=16)
    add(scheduler, "a", list(range(40)))
    add(scheduler, "b", list(range(100, 130)))
    assert step(scheduler) == [("a", 16)]  # nothing left for b
    assert step(scheduler) == [("a", 16)]
    assert step(scheduler) == [("a", 8), ("b", 8)]  # b starts with what a leaves
    assert step(scheduler) == [("a", 1), ("b", 15)]  # a decodes first, b takes the rest
    assert step(scheduler) == [("a", 1), ("b", 7)]
    assert step(scheduler) == [("a", 1), ("b", 1)]


def test_without_chunked_prefill_a_waiting_prompt_waits_for_a_whole_step() -> None:
    scheduler = make(64, 4, budget=16, chunked=False)
    add(scheduler, "a", list(range(10)))
    add(scheduler, "b", list(range(100, 110)))
    assert step(scheduler) == [("a", 10)]  # b (10) does not fit the 6 left and is not split
    assert step(scheduler) == [("a", 1), ("b", 10)]


def test_max_num_seqs_bounds_the_running_requests() -> None:
    scheduler = make(64, 4, budget=64, max_num_seqs=2)
    for rid in "abc":
        add(scheduler, rid, [ord(rid)] * 5)
    assert step(scheduler) == [("a", 5), ("b", 5)]
    assert step(scheduler) == [("a", 1), ("b", 1)]
    scheduler.finish_request(scheduler.running[0])
    assert step(scheduler) == [("b", 1), ("c", 5)]


def _four_running(scheduler: Scheduler) -> dict[str, Request]:
    """a (4 tokens), b and c (2 tokens) and d (5 tokens), admitted in this order."""
    prompts = {"a": [1, 2, 3, 4], "b": [5, 6], "c": [7, 8], "d": [9, 10, 11, 12, 13]}
    requests = {rid: add(scheduler, rid, prompt) for rid, prompt in prompts.items()}
    assert step(scheduler) == [("a", 4), ("b", 2), ("c", 2), ("d", 5)]
    return requests


def test_the_newest_running_request_is_preempted() -> None:
    """In a pool of 5 blocks of 4, the four requests hold all 5 blocks after their prefill. a's
    output needs a 2nd block, so the most recently started request, d, is preempted (not b or
    c), freed and put back at the head of the queue with its chain; no waiting request is
    admitted in that step."""
    scheduler = make(5, 4, budget=64)
    requests = _four_running(scheduler)
    manager = scheduler.kv_cache_manager
    chain = list(manager.req_to_block_hashes["d"])
    assert step(scheduler) == [("a", 1), ("b", 1), ("c", 1)]
    d = requests["d"]
    assert d.status is RequestStatus.PREEMPTED and d.num_preemptions == 1
    assert d.num_computed_tokens == 0 and d.block_ids == [] and manager.get_block_ids(d) == []
    assert list(scheduler.waiting) == [d] and scheduler.running == [requests[r] for r in "abc"]
    assert manager.req_to_block_hashes["d"] == chain  # kept: resuming hits its own blocks
    assert scheduler.num_preemptions == 1
    assert [len(manager.get_block_ids(requests[r])) for r in "abc"] == [2, 1, 1]


def test_a_request_preempts_itself_when_it_is_the_only_one_left() -> None:
    scheduler = make(3, 4, budget=64)
    a = add(scheduler, "a", list(range(8)))
    b = add(scheduler, "b", list(range(100, 104)))
    assert step(scheduler) == [("a", 8), ("b", 4)]
    # a needs a 4th block and preempts b; b then finds no block and preempts itself
    assert step(scheduler) == [("a", 1)]
    assert b.status is RequestStatus.PREEMPTED and a.status is RequestStatus.RUNNING
    assert scheduler.running == [a]


def test_a_resumed_request_hits_its_own_blocks_and_keeps_its_first_cached_count() -> None:
    scheduler = make(5, 4, budget=64)
    requests = _four_running(scheduler)
    step(scheduler)  # d preempted with 6 tokens: its block 0 stays cached in the free list
    d = requests["d"]
    assert d.num_cached_tokens == 0
    scheduler.finish_request(requests["a"])
    scheduler.finish_request(requests["b"])
    assert step(scheduler) == [("c", 1), ("d", 2)]  # resumed: block 0 hit, 2 tokens computed
    assert d.num_computed_tokens == 6 and d.num_cached_tokens == 0
    assert d.status is RequestStatus.RUNNING and scheduler.waiting == type(scheduler.waiting)()


def test_a_finished_requests_chain_is_dropped_and_its_id_may_be_reused() -> None:
    scheduler = make(32, 4, budget=64)
    manager = scheduler.kv_cache_manager
    first = add(scheduler, "r", list(range(13)))
    step(scheduler)
    scheduler.finish_request(first)
    assert "r" not in manager.req_to_block_hashes
    assert manager.num_free_blocks == 32 and first.status is RequestStatus.FINISHED
    # the same id with other tokens must not inherit the old chain (it would hit the old blocks)
    again = add(scheduler, "r", list(range(500, 513)))
    step(scheduler)
    assert again.num_cached_tokens == 0
    # and the same id with the same tokens hits them for real
    scheduler.finish_request(again)
    third = add(scheduler, "r", list(range(13)))
    step(scheduler)
    assert third.num_cached_tokens == 12


def test_a_waiting_request_that_did_not_fit_is_counted_once_in_the_stats() -> None:
    """b (8 tokens, 2 blocks) waits three steps for a block while a runs; the stats count one
    lookup for a and one for b, made when b was admitted."""
    scheduler = make(4, 4, budget=64)
    manager = scheduler.kv_cache_manager
    a = add(scheduler, "a", list(range(10)))
    add(scheduler, "b", list(range(100, 108)))
    assert step(scheduler) == [("a", 10)]
    assert step(scheduler) == [("a", 1)]
    assert step(scheduler) == [("a", 1)]  # a holds 3 blocks of 4: b needs 2, 1 is free
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.query_tokens) == (1, 2, 10)
    scheduler.finish_request(a)
    assert step(scheduler) == [("b", 8)]
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits, stats.query_tokens) == (1, 2, 0, 8)


def test_block_ids_follow_the_managers_table() -> None:
    scheduler = make(16, 4, budget=6)
    a = add(scheduler, "a", list(range(10)))
    for _ in range(6):
        step(scheduler)
        assert a.block_ids == scheduler.kv_cache_manager.get_block_ids(a)
    scheduler.finish_request(a)
    assert a.block_ids == [] and scheduler.kv_cache_manager.num_free_blocks == 16


def test_running_requests_the_budget_does_not_reach_stay_running() -> None:
    """Three decoding requests and a budget of 2 tokens: the third is not scheduled but stays
    running, in its place, with its blocks (the budget is lowered after admission to get there;
    the engine's budget never changes, but decodes outnumbering it is the same situation)."""
    scheduler = make(16, 4, budget=8)
    requests = [add(scheduler, rid, [i]) for i, rid in enumerate("abc")]
    assert step(scheduler) == [("a", 1), ("b", 1), ("c", 1)]
    scheduler.max_num_batched_tokens = 2
    assert step(scheduler) == [("a", 1), ("b", 1)]
    assert scheduler.running == requests
    assert requests[2].status is RequestStatus.RUNNING and requests[2].block_ids
    scheduler.finish_request(requests[0])
    assert step(scheduler) == [("b", 1), ("c", 1)]


def test_a_long_prefill_leaves_the_threshold_to_a_short_request_that_waits() -> None:
    """An 8,000-token prompt in chunks of a 2,048-token budget, threshold 512. Alone it takes
    the whole budget; once a 4-token request waits, the long prefill computes 512 and the short
    prompt runs whole in the same step; with nothing waiting, the long one has the whole
    budget again, and the short one's decode is never held back. Kills a scheduler that
    gives a running prefill the whole budget while a request waits (the short one then waited
    for all four chunks) and one that caps the prefill when nothing waits."""
    scheduler = make(600, 16, budget=2048, threshold=512)
    add(scheduler, "long", [i % 50 for i in range(8000)])
    assert step(scheduler) == [("long", 2048)]
    add(scheduler, "short", [1, 2, 3, 4])
    assert step(scheduler) == [("long", 512), ("short", 4)]
    assert step(scheduler) == [("long", 2047), ("short", 1)]
    assert step(scheduler) == [("long", 2047), ("short", 1)]
    add(scheduler, "third", [5, 6, 7, 8])
    assert step(scheduler) == [("long", 512), ("short", 1), ("third", 4)]


def test_with_every_slot_taken_a_running_prefill_keeps_the_whole_budget() -> None:
    """With every sequence slot taken, a waiting request cannot start: the running prefill
    keeps the whole budget (no tokens set aside that nobody may use)."""
    scheduler = make(600, 16, budget=2048, max_num_seqs=1, threshold=512)
    add(scheduler, "long", [i % 50 for i in range(8000)])
    add(scheduler, "short", [1, 2, 3, 4])
    assert step(scheduler) == [("long", 2048)]
    assert step(scheduler) == [("long", 2048)]


def _running(scheduler: Scheduler, rid: str, prompt_len: int, computed: int) -> Request:
    """A running request of ``prompt_len`` tokens with ``computed`` of them in its blocks; with
    all of them computed it decodes (one sampled token to compute)."""
    request = Request(request_id=rid, token_ids=list(range(prompt_len)),
                      prompt_token_ids=list(range(prompt_len)),
                      params=SamplingParams(max_tokens=100))
    blocks = scheduler.kv_cache_manager.allocate_slots(request, computed)
    assert blocks is not None
    request.block_ids = [b.block_id for b in blocks]
    request.num_computed_tokens = computed
    if computed == prompt_len:
        request.append_output_token(1)
    request.status = RequestStatus.RUNNING
    scheduler.running.append(request)
    return request


def test_prefill_chunks_leave_the_decodes_after_them_and_the_reserve_their_tokens() -> None:
    """Budget 4, threshold 2, one request waiting: the oldest prefill gets one token (it always
    computes, though the three decodes and the reserve leave it none), the second prefill none,
    each decode its one; the reserve is then what the decodes left (nothing)."""
    scheduler = make(64, 4, budget=4, max_num_seqs=8, threshold=2)
    for rid in ("p1", "p2"):
        _running(scheduler, rid, 30, 4)
    for rid in ("d1", "d2", "d3"):
        _running(scheduler, rid, 3, 3)
    add(scheduler, "w", [1, 2])
    assert step(scheduler) == [("p1", 1), ("d1", 1), ("d2", 1), ("d3", 1)]


def test_a_decode_before_a_prefill_is_not_counted_against_it() -> None:
    """Budget 4, no threshold: a decode, a prefill, a decode. The prefill leaves one token to
    the decode after it, not two (the one before it has its token already)."""
    scheduler = make(64, 4, budget=4, max_num_seqs=8)
    _running(scheduler, "d1", 3, 3)
    _running(scheduler, "p", 30, 4)
    _running(scheduler, "d2", 3, 3)
    assert step(scheduler) == [("d1", 1), ("p", 2), ("d2", 1)]


def test_a_two_token_prefill_chunk_leaves_room_for_the_decodes_too() -> None:
    scheduler = make(64, 4, budget=4, max_num_seqs=8)
    _running(scheduler, "p", 6, 4)
    for rid in ("d1", "d2", "d3"):
        _running(scheduler, rid, 3, 3)
    assert step(scheduler) == [("p", 1), ("d1", 1), ("d2", 1), ("d3", 1)]


def test_the_long_prefill_threshold_is_off_by_default_and_checked() -> None:
    scheduler = Scheduler(KVCacheManager(600, 16), 8, 64)
    add(scheduler, "long", [i % 50 for i in range(500)])
    assert step(scheduler) == [("long", 64)]
    add(scheduler, "short", [1, 2, 3, 4])
    assert step(scheduler) == [("long", 64)]
    manager = KVCacheManager(16, 4)
    for bad in (-1, 16, 17):
        with pytest.raises(ValueError, match=r"^long_prefill_token_threshold must be in "
                           rf"\[0, max_num_batched_tokens\), got {bad}$"):
            Scheduler(manager, 4, 16, True, bad)


def test_a_threshold_of_one_applies_and_a_budget_lowered_to_the_threshold_turns_it_off() -> None:
    scheduler = make(600, 16, budget=16, threshold=1)
    add(scheduler, "long", [i % 50 for i in range(500)])
    assert step(scheduler) == [("long", 16)]
    add(scheduler, "short", [1, 2, 3, 4])
    assert step(scheduler) == [("long", 1), ("short", 4)]
    scheduler = make(600, 16, budget=16, threshold=4)
    add(scheduler, "long", [i % 50 for i in range(500)])
    step(scheduler)
    add(scheduler, "short", [1, 2, 3, 4])
    scheduler.max_num_batched_tokens = 4
    assert step(scheduler) == [("long", 4)]


def test_defaults_status_and_timestamps() -> None:
    manager = KVCacheManager(16, 4)
    scheduler = Scheduler(manager, 4, 16)
    assert scheduler.enable_chunked_prefill is True
    request = add(scheduler, "a", list(range(5)))
    assert request.status is RequestStatus.WAITING and list(scheduler.waiting) == [request]
    before = time.time()
    step(scheduler)
    assert before <= request.metrics.first_scheduled_time <= time.time()


def test_preemption_counters_count_every_victim() -> None:
    """Two victims in one step: the pool is full, a's block preempts d, then c, with nobody
    left after it, preempts itself."""
    scheduler = make(4, 4, budget=64)
    prompts = {"a": [1, 2, 3, 4], "b": [5, 6], "c": [7, 8, 9, 10], "d": [11, 12, 13, 14]}
    requests = {rid: add(scheduler, rid, prompt) for rid, prompt in prompts.items()}
    step(scheduler)  # 4 blocks used, none free; a, c and d each need a 2nd block now
    out = scheduler.schedule()
    assert out.num_preempted == 2 and scheduler.num_preemptions == 2
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"]
    assert requests["c"].num_preemptions == requests["d"].num_preemptions == 1
    assert list(scheduler.waiting) == [requests["c"], requests["d"]]


def test_a_running_request_with_nothing_to_compute_stays_and_the_next_one_runs() -> None:
    """The engine appends a sampled token after each step; until it does, a running request has
    nothing to compute: it is skipped (no allocation of 0 tokens) and the requests after it are
    still scheduled."""
    scheduler = make(16, 4, budget=64)
    a = add(scheduler, "a", [1, 2])
    out = scheduler.schedule()
    a.num_computed_tokens += out.scheduled[0].num_new_tokens  # no token appended
    b = add(scheduler, "b", [3, 4])
    step(scheduler)
    assert scheduler.running == [a, b]
    out = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("b", 1)]
    assert scheduler.running == [a, b]


def test_finishing_a_waiting_or_already_finished_request() -> None:
    scheduler = make(16, 4, budget=4)
    a = add(scheduler, "a", list(range(8)))
    b = add(scheduler, "b", list(range(100, 104)))
    step(scheduler)  # a takes the whole budget; b waits
    scheduler.finish_request(b)  # an abort while waiting
    assert list(scheduler.waiting) == [] and b.status is RequestStatus.FINISHED
    scheduler.finish_request(b)  # twice: nothing happens
    scheduler.finish_request(a)
    assert scheduler.running == [] and scheduler.kv_cache_manager.num_free_blocks == 16


def test_a_hit_puts_the_cached_blocks_at_the_head_of_the_table() -> None:
    scheduler = make(32, 4, budget=64)
    first = add(scheduler, "a", list(range(13)))
    step(scheduler)
    head = first.block_ids[:3]
    scheduler.finish_request(first)
    second = add(scheduler, "b", list(range(13)))
    step(scheduler)
    assert second.num_cached_tokens == 12 and second.block_ids[:3] == head


def test_block_ids_follow_a_sliding_window_table() -> None:
    manager = SlidingWindowKVCacheManager(16, 4, sliding_window=4)
    scheduler = Scheduler(manager, 4, 6)
    a = add(scheduler, "a", list(range(10)))
    null = manager.null_block.block_id
    for _ in range(8):
        step(scheduler)
        assert a.block_ids == manager.get_block_ids(a)
    assert a.block_ids[0] == null


def test_a_decoding_request_computes_its_drafts_within_the_budget_and_caches_none() -> None:
    """Drafts ride with a decoding request's one token, trimmed to the budget left; a request
    in prefill ignores them. Slots are allocated for them, but a block they fill is not cached:
    the cache registers blocks the request's own tokens fill."""
    scheduler = make(16, 4, budget=5)
    a = add(scheduler, "a", list(range(6)))
    b = add(scheduler, "b", list(range(100, 107)))
    b.draft_token_ids = [7, 7, 7]  # in prefill: not computed
    assert step(scheduler) == [("a", 5)]
    out = scheduler.schedule()
    assert [(i.request.request_id, i.num_new_tokens, i.draft_token_ids)
            for i in out.scheduled] == [("a", 1, []), ("b", 4, [])]
    a.num_computed_tokens += 1
    a.append_output_token(1)
    b.num_computed_tokens += 4
    # a decodes (7 tokens, 6 computed: one to compute) with four drafts; the budget of 5
    # leaves room for all four: slots up to position 10, three blocks, only one of them full
    a.draft_token_ids = [9, 9, 9, 9]
    out = scheduler.schedule()
    first = out.scheduled[0]
    assert (first.request, first.num_new_tokens, first.draft_token_ids) == (a, 1, [9, 9, 9, 9])
    assert out.num_tokens == 5 and len(out.scheduled) == 1  # nothing left for b
    manager = scheduler.kv_cache_manager
    assert len(a.block_ids) == 3 == len(manager.get_block_ids(a))
    assert manager.num_cached_block["a"] == a.num_tokens // 4 == 1
    # with three tokens of budget, two drafts fit
    a.draft_token_ids = [9, 9, 9, 9]
    scheduler.max_num_batched_tokens = 3
    out = scheduler.schedule()
    assert [(i.num_new_tokens, i.draft_token_ids) for i in out.scheduled] == [(1, [9, 9])]
    assert out.num_tokens == 3
    # b, still in prefill, holds drafts (it never should): its prompt's rest goes alone
    a.draft_token_ids = []
    scheduler.max_num_batched_tokens = 8
    out = scheduler.schedule()
    assert [(i.request.request_id, i.num_new_tokens, i.draft_token_ids)
            for i in out.scheduled] == [("a", 1, []), ("b", 3, [])]


def test_preemption_drops_the_drafts() -> None:
    scheduler = make(5, 4, budget=64)
    requests = _four_running(scheduler)
    requests["d"].draft_token_ids = [1, 2]
    step(scheduler)
    assert requests["d"].status is RequestStatus.PREEMPTED
    assert requests["d"].draft_token_ids == []


PREFIX = list(range(1000, 1048))  # 12 blocks of 4


def test_a_request_waits_for_the_prefix_blocks_a_sibling_is_computing_and_then_hits_them(
        ) -> None:
    """A request on the 48-token prefix that a running request computes in chunks (budget 20):
    held while its next blocks are still to compute, so the running prefill keeps the whole
    budget (no reserve for a request that cannot start), then admitted with all 48 tokens as
    hits. With waiting off it starts at once and computes 20 of the prefix's tokens again."""
    scheduler = make(64, 4, budget=20, threshold=8, wait=8)
    add(scheduler, "a", PREFIX + [1, 2, 3, 4])
    b = add(scheduler, "b", PREFIX + [5, 6, 7, 8])
    assert [step(scheduler) for _ in range(3)] == [
        [("a", 20)], [("a", 20)], [("a", 12), ("b", 4)]]
    assert b.num_cached_tokens == 48
    off = make(64, 4, budget=20, threshold=8, wait=0)
    add(off, "a", PREFIX + [1, 2, 3, 4])
    b = add(off, "b", PREFIX + [5, 6, 7, 8])
    assert [step(off) for _ in range(2)] == [[("a", 20)], [("a", 8), ("b", 12)]]
    assert b.num_cached_tokens == 28


def test_the_requests_behind_a_held_one_go_on() -> None:
    """A held request keeps its place and the one behind it starts; while that one could
    start, the running prefill leaves it the reserve."""
    scheduler = make(64, 4, budget=20, threshold=8, wait=8)
    add(scheduler, "a", PREFIX + [1, 2, 3, 4])
    b = add(scheduler, "b", PREFIX + [5, 6, 7, 8])
    add(scheduler, "c", list(range(500, 510)))
    assert [step(scheduler) for _ in range(4)] == [
        [("a", 20)], [("a", 8), ("c", 10)], [("a", 19), ("c", 1)],
        [("a", 5), ("c", 1), ("b", 4)]]
    assert b.num_cached_tokens == 48


def test_only_a_shared_run_of_the_wait_threshold_holds_a_request() -> None:
    """Only the next ``wait`` tokens count (rounded up to whole blocks): a sibling computing
    one more block of a shared prefix (4 tokens) holds a request under a threshold of 4 (the
    prefill then takes the whole budget, and the request starts with the hit in the same
    step, once that block is the prefill's), not under one of 8."""
    for wait, first_steps in ((8, [[("a", 20)], [("a", 8), ("b", 12)]]),
                              (4, [[("a", 20)], [("a", 16), ("b", 4)], [("a", 1), ("b", 8)]])):
        scheduler = make(64, 4, budget=20, threshold=8, wait=wait)
        add(scheduler, "a", PREFIX[:24] + [1] * 12)
        b = add(scheduler, "b", PREFIX[:24] + [2] * 12)
        assert [step(scheduler) for _ in range(len(first_steps))] == first_steps
        assert b.num_cached_tokens == 24


def test_held_requests_keep_their_order_and_are_not_counted_in_the_stats() -> None:
    """Two held requests in a row, a third that may start behind them: it starts (the running
    prefill leaves it the reserve); the held ones' lookups count in the stats only once each,
    when they are admitted."""
    scheduler = make(64, 4, budget=20, threshold=8, wait=8)
    manager = scheduler.kv_cache_manager
    add(scheduler, "a", PREFIX + [1, 2, 3, 4])
    assert step(scheduler) == [("a", 20)]
    manager.make_prefix_cache_stats()
    b = add(scheduler, "b", PREFIX + [5, 6, 7, 8])
    c = add(scheduler, "c", PREFIX + [9, 10, 11, 12])
    add(scheduler, "d", list(range(500, 510)))
    assert step(scheduler) == [("a", 8), ("d", 10)]
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    stats = manager.make_prefix_cache_stats()
    assert (stats.query_tokens, stats.hit_tokens) == (10, 0)  # d alone
    assert step(scheduler) == [("a", 19), ("d", 1)]  # b, c held: a takes the budget
    assert manager.make_prefix_cache_stats().query_tokens == 0
    assert step(scheduler) == [("a", 5), ("d", 1), ("b", 4), ("c", 4)]
    stats = manager.make_prefix_cache_stats()
    assert (stats.query_tokens, stats.hit_tokens) == (104, 96)
    assert b.num_cached_tokens == c.num_cached_tokens == 48


def test_a_request_is_held_only_for_whole_blocks_of_its_prompt() -> None:
    """The threshold counts the prompt's full blocks only: a request with 8 tokens left that
    a sibling is computing (the prompt's two last blocks) is held; one whose last block is
    partial (2 tokens: a block and a half left) is not, and its partial block is never hashed
    as if full (once its outputs fill it, a request with those tokens hits it)."""
    scheduler = make(64, 4, budget=40, threshold=8, wait=8)
    add(scheduler, "a", PREFIX + list(range(2000, 2020)))
    assert step(scheduler) == [("a", 40)]
    b = add(scheduler, "b", PREFIX)  # blocks 10 and 11 left: both being computed by a
    assert step(scheduler) == [("a", 28), ("b", 4)]  # b held: a took the whole budget
    assert b.num_cached_tokens == 44  # the last block is computed again (the cache's rule)
    scheduler = make(64, 4, budget=44, threshold=8, wait=8)
    add(scheduler, "a", PREFIX + list(range(2000, 2020)))
    assert step(scheduler) == [("a", 44)]
    b = add(scheduler, "b", PREFIX + [9, 9])  # one block and 2 tokens left: not held
    assert step(scheduler) == [("a", 8), ("b", 2)]
    assert [step(scheduler) for _ in range(2)] == [[("a", 16), ("b", 1)], [("a", 1), ("b", 1)]]
    c = add(scheduler, "c", PREFIX + [9, 9, 1, 1, 7])  # b's tokens: prompt and two outputs
    step(scheduler)
    assert c.num_cached_tokens == 52


def test_waiting_for_a_sibling_is_off_by_default_and_checked() -> None:
    """A ``Scheduler`` made without it does not hold requests (the engine turns it on:
    ``EngineConfig.shared_prefix_wait_tokens``); a negative threshold is refused."""
    scheduler = Scheduler(KVCacheManager(64, 4), 8, 20, True, 8)
    assert scheduler.shared_prefix_wait_tokens == 0
    add(scheduler, "a", PREFIX + [1, 2, 3, 4])
    assert step(scheduler) == [("a", 20)]
    add(scheduler, "b", PREFIX + [5, 6, 7, 8])
    assert step(scheduler) == [("a", 8), ("b", 12)]
    with pytest.raises(ValueError, match=r"^shared_prefix_wait_tokens must be at least 0 "
                       r"\(0: off\), got -1$"):
        Scheduler(KVCacheManager(64, 4), 8, 20, True, 8, -1)


def test_a_request_that_takes_no_hits_is_never_held() -> None:
    """A request that asks for prompt logprobs takes no hits (it computes its whole prompt):
    its wait is judged from its first block, which a running sibling has always computed or
    allocated already, so it is never held."""
    scheduler = make(64, 4, budget=20, threshold=8, wait=8)
    add(scheduler, "a", PREFIX + [1, 2, 3, 4])
    assert step(scheduler) == [("a", 20)]
    b = add(scheduler, "b", PREFIX + [5, 6, 7, 8])
    b.wants_prompt_logprobs = True
    assert step(scheduler) == [("a", 8), ("b", 12)]
