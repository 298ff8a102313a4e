"""Exact expectations for the scheduler: the admission gate's calls and the queue positions it
skips, the hit blocks a new request holds, the preemption counters and what a preempted or
finished request keeps. The real ``Scheduler`` over the real managers, with a simulated model
(one output token per request whose prefill is done) and a recording gate that implements the
``AdmissionGate`` protocol."""

from __future__ import annotations

import pytest
from scheduler_helpers import add, make
from scheduler_helpers import step_counting_preemptions as step

from prefixserve.core.hybrid_kv_cache_manager import HybridKVCacheManager
from prefixserve.engine.request import Request, RequestStatus
from prefixserve.engine.scheduler import Scheduler

pytestmark = pytest.mark.fast


class RecordingGate:
    """Holds back the requests whose ids are in ``held`` and records every call. Fails after
    ``limit`` ``may_admit`` calls, so a scheduler that loops over a held request stops."""

    def __init__(self, held: set[str], limit: int = 100) -> None:
        self.held = held
        self.limit = limit
        self.asked: list[tuple[str, list[str]]] = []
        self.admissions: list[tuple[str, int]] = []

    def may_admit(self, request: Request, running: list[Request]) -> bool:
        assert len(self.asked) < self.limit, "the scheduler keeps asking"
        self.asked.append((request.request_id, [r.request_id for r in running]))
        return request.request_id not in self.held

    def admitted(self, request: Request, num_cached: int) -> None:
        self.admissions.append((request.request_id, num_cached))


# ---------------------------------------------------------------- the admission gate


def test_a_request_the_gate_holds_keeps_its_place_and_the_next_ones_start() -> None:
    """Catches a gate answer read the wrong way round, a held request that stops the queue, and
    a skip that jumps past the request right behind the held one."""
    scheduler = make(64, 4, budget=64)
    scheduler.gate = gate = RecordingGate({"a"})
    a, b, c = (add(scheduler, rid, [ord(rid)] * 5) for rid in "abc")
    assert step(scheduler) == ([("b", 5), ("c", 5)], 0)
    assert gate.asked == [("a", []), ("b", []), ("c", ["b"])]
    assert gate.admissions == [("b", 0), ("c", 0)]
    assert list(scheduler.waiting) == [a] and a.status is RequestStatus.WAITING
    assert scheduler.running == [b, c]
    gate.held.clear()  # its adapter got a slot
    assert step(scheduler) == ([("b", 1), ("c", 1), ("a", 5)], 0)
    assert gate.asked[3:] == [("a", ["b", "c"])]
    assert gate.admissions[2:] == [("a", 0)]


def test_two_held_requests_in_a_row_are_both_skipped() -> None:
    """Catches a skip that does not move on from the second held request (it would ask about it
    for ever) or moves backwards."""
    scheduler = make(64, 4, budget=64)
    scheduler.gate = gate = RecordingGate({"a", "b"})
    a, b, c, d = (add(scheduler, rid, [ord(rid)] * 3) for rid in "abcd")
    assert step(scheduler) == ([("c", 3), ("d", 3)], 0)
    assert gate.asked == [("a", []), ("b", []), ("c", []), ("d", ["c"])]
    assert list(scheduler.waiting) == [a, b] and scheduler.running == [c, d]


def test_the_gate_hears_each_admission_with_its_cached_tokens() -> None:
    """Catches an admission reported without the request or its prefix-cache hit."""
    scheduler = make(32, 4, budget=64)
    scheduler.gate = gate = RecordingGate(set())
    first = add(scheduler, "a", list(range(9)))
    step(scheduler)
    scheduler.finish_request(first)
    add(scheduler, "b", [*range(8), 50, 51])  # blocks 0 and 1 are a's
    assert step(scheduler) == ([("b", 2)], 0)
    assert gate.admissions == [("a", 0), ("b", 8)]


# ---------------------------------------------------------------- hits


def test_a_waiting_request_that_hits_holds_the_hit_blocks_in_the_managers_table() -> None:
    """Catches an admission that does not pass the hits to ``allocate_slots``: the request's
    block ids would name blocks the manager never gave it."""
    scheduler = make(16, 4, budget=64)
    manager = scheduler.kv_cache_manager
    first = add(scheduler, "a", list(range(9)))
    step(scheduler)
    head = first.block_ids[:2]
    scheduler.finish_request(first)
    second = add(scheduler, "b", [*range(8), 50, 51])
    out = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("b", 2)]
    assert second.num_computed_tokens == second.num_cached_tokens == 8
    assert len(second.block_ids) == 3 and second.block_ids[:2] == head
    assert manager.get_block_ids(second) == second.block_ids
    assert [manager.block_pool.blocks[i].ref_cnt for i in second.block_ids] == [1, 1, 1]
    assert manager.num_free_blocks == 13


# ---------------------------------------------------------------- preemption and release


def test_a_request_preempted_twice_counts_two_preemptions_and_holds_nothing() -> None:
    """Catches a per-request preemption count that is set instead of counted up, and a
    preempted request left with something other than no extra block ids."""
    scheduler = make(4, 4, budget=64)
    manager = scheduler.kv_cache_manager
    x, a, b = (add(scheduler, rid, prompt) for rid, prompt in
               (("x", [1, 2, 3, 4]), ("a", [5, 6, 7, 8]), ("b", [9, 10, 11, 12])))
    assert step(scheduler) == ([("x", 4), ("a", 4), ("b", 4)], 0)  # one block left
    # x takes the last block; a needs one more, so b (the newest) goes
    assert step(scheduler) == ([("x", 1), ("a", 1)], 1)
    assert (b.status, b.num_preemptions, b.block_ids, b.extra_block_ids) == (
        RequestStatus.PREEMPTED, 1, [], ())
    scheduler.finish_request(a)
    assert a.extra_block_ids == ()
    # b comes back (prompt plus its output, its block 0 was evicted by a): two blocks
    assert step(scheduler) == ([("x", 1), ("b", 5)], 0)
    assert step(scheduler) == ([("x", 1), ("b", 1)], 0)
    assert step(scheduler) == ([("x", 1), ("b", 1)], 0)
    # x's 9th token needs a third block: b, the newest, goes again
    assert step(scheduler) == ([("x", 1)], 1)
    assert (b.status, b.num_preemptions, b.num_computed_tokens, b.block_ids,
            b.extra_block_ids) == (RequestStatus.PREEMPTED, 2, 0, [], ())
    assert scheduler.num_preemptions == 2
    assert list(scheduler.waiting) == [b] and scheduler.running == [x]
    assert manager.num_free_blocks == 1


def test_a_finished_hybrid_request_holds_no_extra_block_ids() -> None:
    """Catches a finished request whose other groups' block ids are not emptied to ``()``."""
    manager = HybridKVCacheManager(16, 4, [None, None])
    scheduler = Scheduler(manager, 8, 64)
    a = add(scheduler, "a", list(range(6)))
    assert step(scheduler) == ([("a", 6)], 0)
    assert a.block_ids == manager.get_group_block_ids(a)[0]
    assert a.extra_block_ids == (manager.get_group_block_ids(a)[1],)
    assert len(a.block_ids) == len(a.extra_block_ids[0]) == 2
    scheduler.finish_request(a)
    assert (a.status, a.block_ids, a.extra_block_ids) == (RequestStatus.FINISHED, [], ())
    assert manager.num_free_blocks == 16
