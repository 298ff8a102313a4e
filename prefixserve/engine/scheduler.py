"""Continuous batching with chunked prefill and recompute preemption over the prefix cache.

Each step the scheduler fills a token budget (``max_num_batched_tokens``):

1. Running requests first, in the order they started: a decoding request needs one token, a
   request still in prefill gets the rest of its prompt or as much of it as the budget allows
   (chunked prefill, so a long prompt never stalls the decodes running beside it); a decoding
   request that holds drafts (n-gram speculation) computes them too, as far as the budget goes.
   When the pool is short, the most recently started running request is preempted (its blocks
   freed and its drafts dropped, its hash chain kept so that resuming hits its own blocks) until
   the allocation fits.
   A prefill chunk leaves one token of the budget to each decoding request after it. While
   requests wait and a sequence slot is free, a prefill chunk of a running request is
   at most ``long_prefill_token_threshold`` tokens, and the running prefills leave that many
   tokens of the budget to the waiting requests (decodes are not held back): one long prompt
   no longer holds a short request back until its whole prefill is done. Nothing waiting, a
   prefill takes the whole budget.
2. Then waiting requests, oldest first, while there is budget, a free sequence slot and no
   preemption happened in this step: ``get_computed_blocks`` (a pure query), then
   ``allocate_slots`` with the hits; a request that does not fit stays at the head of the queue.
   The lookup is counted in the prefix-cache stats when the request is admitted, so a head
   looked up at several steps counts once (and a resumed request once more).
   A waiting request whose next ``shared_prefix_wait_tokens`` uncached prompt tokens are in
   blocks that a running prefill is still to compute waits for them (keeping its place; those
   behind it go on, and a running prefill leaves no reserve for it): once they are cached it
   hits them, instead of computing the same prefix beside its sibling. (Blocks are cached as
   they are allocated, so requests admitted in one step share a prefix anyway; a prompt
   computed in chunks is what the wait covers.)

Invariants:

* Every block a request holds is released exactly once, by ``finish_request`` or by
  preemption; when the engine is idle the pool's free count equals its size.
* Liveness: a request that passes ``check_admissible`` is scheduled within a bounded number of
  steps, and every step with unfinished requests schedules at least one token. The oldest
  running request always gets the budget's first tokens (at least one: the threshold is below
  the budget) and is never the preemption
  victim while another running request is left, so it finishes; the waiting head then fits
  once nothing runs, because (a) ``max_model_len`` is capped by the pool's capacity, so one
  request alone always fits the pool, and (b) without chunked prefill a new prompt is admitted
  only if it fits one step's budget, while a resumed request (prompt plus outputs, possibly
  more than one step) is always chunked.
* A request held for a sibling's blocks waits only while a running request has them still
  to compute: each step looks again, and a sibling that finishes its prefill (or is
  preempted, or finishes) releases it; the running requests finish as above.
* With an admission ``gate`` (LoRA adapters, ``engine/lora_registry.py``), a waiting request the
  gate holds back (its adapter has no slot yet) keeps its place and the requests behind it go
  on; it is admitted once the running requests that hold the slots finish, which they do as
  above.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prefixserve.core import KVCacheBlock, KVCacheManager
from prefixserve.core.hybrid_kv_cache_manager import HybridKVCacheManager
from prefixserve.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """``num_new_tokens`` of the request's own tokens to compute, then ``draft_token_ids`` (a
    decoding request's drafts, ``engine/ngram_proposer.py``), computed after them in the same
    step and kept only as far as the model agrees."""

    request: Request
    num_new_tokens: int
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens + len(s.draft_token_ids) for s in self.scheduled)


class AdmissionGate(Protocol):
    """Decides whether a waiting request may start now, and hears of each admission."""

    def may_admit(self, request: Request, running: list[Request]) -> bool: ...

    def admitted(self, request: Request, num_cached: int) -> None: ...


class Scheduler:
    """Decides which requests run in each step and how many tokens each computes."""

    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int,
                 max_num_batched_tokens: int, enable_chunked_prefill: bool = True,
                 long_prefill_token_threshold: int = 0,
                 shared_prefix_wait_tokens: int = 0) -> None:
        if not 0 <= long_prefill_token_threshold < max_num_batched_tokens:
            raise ValueError("long_prefill_token_threshold must be in [0, "
                             f"max_num_batched_tokens), got {long_prefill_token_threshold}")
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold
        if shared_prefix_wait_tokens < 0:
            raise ValueError("shared_prefix_wait_tokens must be at least 0 (0: off), got "
                             f"{shared_prefix_wait_tokens}")
        self.shared_prefix_wait_tokens = shared_prefix_wait_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.gate: AdmissionGate | None = None

    def check_admissible(self, num_prompt_tokens: int) -> str | None:
        """Why a prompt of ``num_prompt_tokens`` could never be scheduled, or None if it can.

        Without chunked prefill a new prompt is computed in one step, so it must fit the step
        budget (``max_num_batched_tokens``), or it would wait at the head of the queue forever.
        (The context limit is the engine's check: it knows ``max_model_len``.)"""
        if self.enable_chunked_prefill or num_prompt_tokens <= self.max_num_batched_tokens:
            return None
        return (f"the prompt has {num_prompt_tokens} tokens, but with chunked prefill off a "
                f"prompt must be computed in one step of at most {self.max_num_batched_tokens} "
                f"tokens (--max-num-batched-tokens); enable chunked prefill or raise the limit")

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.block_ids = []
        request.extra_block_ids = ()
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.draft_token_ids = []
        self.waiting.appendleft(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        pending = self._pending_blocks()
        budget = self._schedule_running(out, self.max_num_batched_tokens, pending)
        self._schedule_waiting(out, budget, pending)
        return out

    def _prefill_limits(self, pending: set[Hashable] | None) -> tuple[int, int]:
        """The most tokens one running prefill may take in this step, and the budget the
        running requests leave for the waiting ones: (no limit, 0) unless a request waits
        that may start (not one held for a sibling's blocks, ``pending``), a sequence slot is
        free and ``long_prefill_token_threshold`` is set (and still below the budget, which a
        caller may have lowered)."""
        threshold = self.long_prefill_token_threshold
        if (not 0 < threshold < self.max_num_batched_tokens  # (a budget lowered since)
                or len(self.running) >= self.max_num_seqs or not self._may_start(pending)):
            return self.max_num_batched_tokens, 0
        return threshold, threshold

    def _may_start(self, pending: set[Hashable] | None) -> bool:
        """Whether a waiting request is not held for a sibling's blocks (looked up in order
        up to the first such: one lookup unless the head is held)."""
        if pending is None:
            return bool(self.waiting)
        for request in self.waiting:
            _, num_cached = self.kv_cache_manager.get_computed_blocks(request,
                                                                      record_stats=False)
            if not self._waits_for(request, num_cached, pending):
                return True
        return False

    def _schedule_running(self, out: SchedulerOutput, budget: int,
                          pending: set[Hashable] | None) -> int:
        """Schedules the running requests in the order they started, preempting the newest
        when the pool is short; returns the budget left."""
        chunk_limit, reserve = self._prefill_limits(pending)
        scheduled_running: list[Request] = []
        queue = list(self.running)
        oldest = queue[0] if queue else None
        decodes = sum(r.num_tokens - r.num_computed_tokens == 1 for r in queue)
        while queue and budget > 0:
            request = queue.pop(0)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new == 1:
                decodes -= 1
            elif num_new > 1:  # a prefill chunk: leave a token to each decode after it
                room = budget - reserve - decodes  # and the reserve to the waiting requests
                floor = 1 if request is oldest else 0  # the oldest always computes
                num_new = min(num_new, chunk_limit, max(room, floor))
            if num_new <= 0:
                scheduled_running.append(request)
                continue
            drafts = self._drafts(request, num_new, budget)
            while (new_blocks := self.kv_cache_manager.allocate_slots(
                    request, num_new + len(drafts))) is None:
                victim = queue.pop() if queue else request
                self._preempt(victim)
                out.num_preempted += 1
                if victim is request:
                    break
            else:
                self._add_block_ids(request, new_blocks)
                scheduled_running.append(request)
                out.scheduled.append(ScheduledRequest(request, num_new, drafts))
                budget -= num_new + len(drafts)
        # Requests not reached for lack of budget stay running, unscheduled this step.
        self.running = scheduled_running + queue
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int,
                          pending: set[Hashable] | None) -> None:
        """Admits waiting requests, oldest first, while the budget, the sequence slots and
        the pool allow and no preemption happened in this step; those that wait for the blocks
        ``pending`` (the running prefills') keep their places. (A request admitted here
        computes its whole prompt in this step or takes the rest of the budget.)"""
        now = time.time()
        index = 0  # past the requests the gate or a sibling holds back
        while (index < len(self.waiting) and budget > 0 and not out.num_preempted
               and len(self.running) < self.max_num_seqs):
            request = self.waiting[index]
            if self.gate is not None and not self.gate.may_admit(request, self.running):
                index += 1
                continue
            # counted in the stats once, when admitted (a request that does not fit is looked
            # up again next step)
            computed, num_cached = self.kv_cache_manager.get_computed_blocks(
                request, record_stats=False)
            if pending is not None and self._waits_for(request, num_cached, pending):
                index += 1
                continue
            num_new = request.num_tokens - num_cached
            if num_new > budget:
                if not self._may_chunk(request):
                    break
                num_new = budget
            request.num_computed_tokens = 0
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new, computed)
            if new_blocks is None:
                break
            request.block_ids = []  # a new list: the runner copies a new table whole
            self._add_block_ids(request, [*computed, *new_blocks])
            del self.waiting[index]
            self.kv_cache_manager.record_lookup(request, computed)
            if self.gate is not None:
                self.gate.admitted(request, num_cached)
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = min(num_cached, request.num_prompt_tokens)
                request.metrics.first_scheduled_time = now
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new

    def _pending_blocks(self) -> set[Hashable] | None:
        """The hashes of the full prompt blocks that running requests are still to compute
        (None when waiting for siblings is off, or the cache is, or nothing waits)."""
        if (not self.shared_prefix_wait_tokens or not self.waiting
                or not self.kv_cache_manager.enable_caching):
            return None
        pending: set[Hashable] = set()
        for request in self.running:
            pending.update(self._uncomputed_prompt_blocks(request))
        return pending

    def _uncomputed_prompt_blocks(self, request: Request) -> Sequence[Hashable]:
        size = self.kv_cache_manager.block_size
        first, end = request.num_computed_tokens // size, request.num_prompt_tokens // size
        if first >= end:
            return ()
        return self.kv_cache_manager.block_hashes(request, end)[first:end]

    def _waits_for(self, request: Request, num_cached: int, pending: set[Hashable]) -> bool:
        """Whether the ``shared_prefix_wait_tokens`` after the request's ``num_cached`` hit
        tokens are all in blocks another request is computing (``pending``)."""
        size = self.kv_cache_manager.block_size
        first = num_cached // size
        need = -(-self.shared_prefix_wait_tokens // size)
        if (first + need) * size > request.num_prompt_tokens:
            return False
        hashes = self.kv_cache_manager.block_hashes(request, first + need)
        return all(h in pending for h in hashes[first:first + need])

    @staticmethod
    def _drafts(request: Request, num_new: int, budget: int) -> list[int]:
        """The drafts a running request computes in this step: those it holds when it decodes
        (one token of its own to compute), as many as the step's budget leaves room for. Slots
        are allocated for them, but the cache registers a block only once the request's own
        tokens fill it (``KVCacheManager`` caps the blocks it caches at ``num_tokens``), so a
        rejected draft never reaches the prefix cache."""
        drafts = request.draft_token_ids
        if not drafts or num_new != 1:
            return []
        return drafts[:budget - 1]

    def _add_block_ids(self, request: Request, blocks: list[KVCacheBlock]) -> None:
        """Appends the ids of the blocks just allocated to ``request.block_ids``, so that it
        stays equal to the manager's table without being rebuilt at every step. (A manager that
        rewrites a table in place, the sliding-window one, is copied whole instead, and the
        hybrid one's other groups go to ``request.extra_block_ids``.)"""
        manager = self.kv_cache_manager
        if isinstance(manager, HybridKVCacheManager):
            first, *others = manager.get_group_block_ids(request)
            request.block_ids, request.extra_block_ids = first, tuple(others)
        elif self.kv_cache_manager.sliding_window is not None:
            request.block_ids = self.kv_cache_manager.get_block_ids(request)
        elif blocks:
            request.block_ids.extend([block.block_id for block in blocks])

    def release_out_of_window(self, requests: list[Request]) -> None:
        """After a step: frees what slid out of the windows of the running ``requests``
        (``KVCacheManager.remove_skipped_blocks``) and refreshes their block ids, so that the
        next step's allocations (of requests scheduled before them too, and admissions) can
        use those blocks instead of preempting. Nothing to do without sliding windows."""
        manager = self.kv_cache_manager
        if manager.sliding_window is None:
            return
        for request in requests:
            if request.status is RequestStatus.RUNNING and manager.remove_skipped_blocks(request):
                self._add_block_ids(request, [])

    def _may_chunk(self, request: Request) -> bool:
        """Whether a waiting request may start with part of its tokens. Always with chunked
        prefill; without it only a resumed (preempted) request, which recomputes its prompt
        plus its outputs and might otherwise never fit one step (``check_admissible`` bounds
        the prompt alone)."""
        return self.enable_chunked_prefill or request.status is RequestStatus.PREEMPTED

    def finish_request(self, request: Request) -> None:
        """Releases a finished (or aborted) request's blocks, tail first, and its hash chain."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.block_ids = []
        request.extra_block_ids = ()
        self.kv_cache_manager.free(request)
        self.kv_cache_manager.free_block_hashes(request)
