"""Random sequences of requests with retentions (priorities, TTLs), clock ticks, hits, finishes,
resets and pins, checked against a naive reference model after every step.

The reference keeps no lists per level and no heap: it records, for every block, its priority,
duration, release time and release order, and picks each victim as the minimum of a sort key
derived from the rules of docs/explicit-caching.md at the current time:

1. the effective level: the block's priority while its expiry lies ahead; after it, the
   default priority;
2. within a level, the time the block joined it: its release, or for an expired block its
   expiry (as if released then); at equal times an expired block first, then release order.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixserve.core import DEFAULT_PRIORITY, CacheRequest, KVCacheManager, Retention
from prefixserve.core.retention import RetentionRange

BS = 2
NUM_BLOCKS = 10
INF = float("inf")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def wanted(retention: Retention | None, num_prompt: int, index: int) -> tuple[int, float]:
    """What a request asks for block ``index``: every range that reaches the block's end or
    beyond protects it; the highest priority wins, then the longest duration."""
    if retention is None:
        return DEFAULT_PRIORITY, 0.0
    end = (index + 1) * BS
    asks = [(r.priority, INF if r.duration is None else r.duration) for r in retention.ranges
            if (num_prompt if r.end is None else min(r.end, num_prompt)) >= end]
    return max(asks) if asks else (DEFAULT_PRIORITY, 0.0)


class Reference:
    def __init__(self) -> None:
        self.key: dict[int, tuple | None] = dict.fromkeys(range(NUM_BLOCKS))
        self.ref = dict.fromkeys(range(NUM_BLOCKS), 0)
        self.prio = dict.fromkeys(range(NUM_BLOCKS), DEFAULT_PRIORITY)
        self.dur = dict.fromkeys(range(NUM_BLOCKS), 0.0)
        self.released_at = dict.fromkeys(range(NUM_BLOCKS), -INF)
        self.order = {b: b - NUM_BLOCKS for b in range(NUM_BLOCKS)}  # initial free order
        self.counter = 0
        self.tables: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}
        self.pinned: dict[str, list[int]] = {}
        self.holders: dict[tuple, list[int]] = {}  # blocks holding a prefix, first cached first

    def expired(self, b: int, now: float) -> bool:
        return (self.prio[b] != DEFAULT_PRIORITY and self.key[b] is not None
                and self.released_at[b] + self.dur[b] <= now)

    def sort_key(self, b: int, now: float) -> tuple:
        if self.key[b] is None or self.prio[b] == DEFAULT_PRIORITY:
            return (DEFAULT_PRIORITY, self.released_at[b], 1, self.order[b])
        if self.expired(b, now):
            return (DEFAULT_PRIORITY, self.released_at[b] + self.dur[b], 0, self.order[b])
        return (self.prio[b], 0.0, 1, self.order[b])

    def eviction_order(self, now: float) -> list[int]:
        free = [b for b in range(NUM_BLOCKS) if self.ref[b] == 0]
        return sorted(free, key=lambda b: self.sort_key(b, now))

    def lookup(self, tokens: list[int]) -> list[int]:
        hits = []
        for i in range((len(tokens) - 1) // BS):
            holders = self.holders.get(tuple(tokens[:(i + 1) * BS]))
            if not holders:
                break
            hits.append(holders[0])
        return hits

    def hit(self, b: int, now: float) -> None:
        if self.ref[b] == 0 and self.expired(b, now):
            self.prio[b], self.dur[b] = DEFAULT_PRIORITY, 0.0
        self.ref[b] += 1

    def retain(self, b: int, ask: tuple[int, float], fresh: bool) -> None:
        p, d = ask if fresh else (max(ask[0], self.prio[b]), max(ask[1], self.dur[b]))
        self.prio[b], self.dur[b] = p, (0.0 if p == DEFAULT_PRIORITY else d)

    def allocate(self, rid: str, tokens: list[int], hits: list[int], retention: Retention | None,
                 now: float) -> bool:
        need = -(-len(tokens) // BS) - len(hits)
        if need > sum(1 for b in range(NUM_BLOCKS) if self.ref[b] == 0 and b not in hits):
            return False
        for b in hits:
            self.hit(b, now)
        victims = [b for b in self.eviction_order(now)][:need]
        table = self.tables[rid] = list(hits)
        for b in victims:
            if self.key[b] is not None:
                self.holders[self.key[b]].remove(b)
            self.key[b] = None
            self.prio[b], self.dur[b] = DEFAULT_PRIORITY, 0.0
            self.ref[b] = 1
            table.append(b)
        num_full = len(tokens) // BS
        for i, b in enumerate(table[:num_full]):
            if i >= len(hits):
                self.key[b] = tuple(tokens[:(i + 1) * BS])
                self.holders.setdefault(self.key[b], []).append(b)
            if retention is not None or self.prio[b] < DEFAULT_PRIORITY:
                self.retain(b, wanted(retention, len(tokens), i), fresh=i >= len(hits))
        return True

    def release(self, blocks: list[int], now: float) -> None:
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.key[b] is None:
                    self.prio[b], self.dur[b] = DEFAULT_PRIORITY, 0.0
                self.released_at[b] = now
                self.counter += 1
                self.order[b] = self.counter


PRIORITIES = st.sampled_from([10, 35, 60, 90])
DURATIONS = st.sampled_from([None, 1.0, 3.0])


class RetentionMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.clock = Clock()
        self.manager = KVCacheManager(NUM_BLOCKS, BS, clock=self.clock)
        self.ref = Reference()
        self.running: dict[str, CacheRequest] = {}
        self.counter = 0

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=8),
          ranges=st.lists(st.tuples(st.integers(1, 8), PRIORITIES, DURATIONS), max_size=2))
    def add_request(self, tokens: list[int], ranges: list[tuple[int, int, float | None]]) -> None:
        self.counter += 1
        retention = (Retention(tuple(RetentionRange(0, end, p, d) for end, p, d in ranges))
                     if ranges else None)
        request = CacheRequest(f"r{self.counter}", tokens, retention=retention)
        computed, num = self.manager.get_computed_blocks(request)
        ref_hits = self.ref.lookup(tokens)
        assert num == len(ref_hits) * BS
        ok = self.manager.allocate_slots(request, len(tokens) - num, computed) is not None
        assert ok == self.ref.allocate(request.request_id, tokens, ref_hits[:len(computed)],
                                       retention, self.clock.now)
        if ok:
            request.num_computed_tokens = len(tokens)
            self.running[request.request_id] = request
        else:
            self.manager.free_block_hashes(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        request = self.running.pop(rid)
        self.manager.free(request)
        self.manager.free_block_hashes(request)
        self.ref.release(self.ref.tables.pop(rid), self.clock.now)

    @rule(dt=st.sampled_from([0.5, 1.0, 2.5]))
    def tick(self, dt: float) -> None:
        self.clock.now += dt

    @rule(tokens=st.lists(st.integers(0, 2), min_size=2, max_size=6))
    def pin(self, tokens: list[int]) -> None:
        probe = CacheRequest("pin-probe", tokens)
        hashes = list(self.manager.block_hashes(probe))
        self.manager.free_block_hashes(probe)
        ref_hits = self.ref.lookup(tokens + [0])
        self.counter += 1
        pin_id = f"p{self.counter}"
        if not hashes or len(ref_hits) < len(hashes) or len(self.ref.pinned) >= 2:
            return
        blocks = self.manager.pin(pin_id, hashes)
        assert [b.block_id for b in blocks] == ref_hits
        for b in ref_hits:
            self.ref.hit(b, self.clock.now)
            self.ref.prio[b], self.ref.dur[b] = 101, INF
        self.ref.pinned[pin_id] = ref_hits

    @precondition(lambda self: self.ref.pinned)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        pin_id = data.draw(st.sampled_from(sorted(self.ref.pinned)))
        assert self.manager.unpin(pin_id)
        blocks = self.ref.pinned.pop(pin_id)
        pinned_elsewhere = {b for other in self.ref.pinned.values() for b in other}
        for b in blocks:
            if b not in pinned_elsewhere:
                self.ref.prio[b], self.ref.dur[b] = DEFAULT_PRIORITY, 0.0
        self.ref.release(blocks, self.clock.now)

    @invariant()
    def eviction_order_matches_reference(self) -> None:
        pool = self.manager.block_pool
        pool.expire()
        got = [b.block_id for b in pool.free_blocks_in_eviction_order()]
        assert got == self.ref.eviction_order(self.clock.now)
        assert pool.get_num_free_blocks() == len(got)
        for b in pool.blocks:
            assert b.ref_cnt == self.ref.ref[b.block_id]
            assert (b.block_hash is None) == (self.ref.key[b.block_id] is None)


TestRetentionMachine = RetentionMachine.TestCase
TestRetentionMachine.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)
