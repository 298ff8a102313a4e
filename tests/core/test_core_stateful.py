"""Random sequences of allocate / decode / free / preempt / resume / reset, checked against a
reference model after every step.

The reference keeps no hashes at all: it keys a block by the salt and the *whole token prefix*
up to the block's end, keeps the free list as a plain Python list, and follows the rules of the
design literally (longest prefix, stop at first miss, last-block rule, tail-first freeing, LRU
reuse from the head, lazy eviction). The real manager must agree with it on every cached-token
count and on the exact free-list order.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixserve.core import CacheRequest, KVCacheManager

pytestmark = pytest.mark.fast

BLOCK_SIZE = 2
NUM_BLOCKS = 12


class ReferenceCache:
    """A deliberately naive model of the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.free: list[int] = list(range(num_blocks))
        self.key: dict[int, tuple | None] = dict.fromkeys(range(num_blocks))
        self.holders: dict[tuple, list[int]] = {}
        self.ref: dict[int, int] = dict.fromkeys(range(num_blocks), 0)
        self.tables: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}

    def prefix_key(self, salt: str | None, tokens: list[int], i: int) -> tuple:
        return (salt, tuple(tokens[: (i + 1) * self.bs]))

    def lookup(self, salt: str | None, tokens: list[int]) -> list[int]:
        hits = []
        for i in range((len(tokens) - 1) // self.bs):
            holders = self.holders.get(self.prefix_key(salt, tokens, i))
            if not holders:
                break
            hits.append(holders[0])
        return hits

    def allocate(self, rid: str, salt: str | None, tokens: list[int], computed: int,
                 hits: list[int], total: int) -> bool:
        table = self.tables.get(rid, [])
        need = -(-total // self.bs) - len(table) - len(hits)
        evictable = sum(1 for b in hits if self.ref[b] == 0)
        if need > len(self.free) - evictable:
            return False
        for b in hits:
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1
        table = self.tables.setdefault(rid, [])
        table.extend(hits)
        for _ in range(max(need, 0)):
            b = self.free.pop(0)
            if self.key[b] is not None:
                self.holders[self.key[b]].remove(b)
                self.key[b] = None
            self.ref[b] = 1
            table.append(b)
        num_cached = max(self.cached.get(rid, 0), len(table) - need if hits else 0)
        num_full = min(total, len(tokens)) // self.bs
        for i in range(num_cached, num_full):
            key = self.prefix_key(salt, tokens, i)
            self.key[table[i]] = key
            self.holders.setdefault(key, []).append(table[i])
        self.cached[rid] = max(num_cached, num_full)
        return True

    def free_request(self, rid: str) -> None:
        for b in reversed(self.tables.pop(rid, [])):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.append(b)
        self.cached.pop(rid, None)

    def reset(self) -> bool:
        """Drops every key, also of held blocks; a held block's request keeps its cached
        count, so that block is never keyed again (docs/prefix-cache.md section 3: reset under
        traffic)."""
        self.holders.clear()
        self.key = dict.fromkeys(self.key)
        return True


class PrefixCacheMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.ref = ReferenceCache(NUM_BLOCKS, BLOCK_SIZE)
        self.running: dict[str, CacheRequest] = {}
        self.preempted: dict[str, CacheRequest] = {}
        self.tables: dict[str, list[int]] = {}
        self.counter = 0

    def _admit(self, request: CacheRequest) -> bool:
        computed, num = self.manager.get_computed_blocks(request)
        ref_hits = self.ref.lookup(request.cache_salt, list(request.token_ids))
        assert num == len(ref_hits) * BLOCK_SIZE, "cached tokens differ from the reference"
        assert [b.block_id for b in computed] == ref_hits
        ok = self.manager.allocate_slots(request, request.num_tokens - num, computed) is not None
        ref_ok = self.ref.allocate(request.request_id, request.cache_salt,
                                   list(request.token_ids), num, ref_hits, request.num_tokens)
        assert ok == ref_ok
        if ok:
            request.num_computed_tokens = request.num_tokens
        return ok

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=12),
          salt=st.sampled_from([None, None, "s"]))
    def add_request(self, tokens: list[int], salt: str | None) -> None:
        self.counter += 1
        request = CacheRequest(f"r{self.counter}", tokens, cache_salt=salt)
        if self._admit(request):
            self.running[request.request_id] = request
        else:
            self.manager.free_block_hashes(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data: st.DataObject, token: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        request = self.running[rid]
        request.token_ids.append(token)
        ok = self.manager.allocate_slots(request, 1) is not None
        ref_ok = self.ref.allocate(rid, request.cache_salt, list(request.token_ids),
                                   request.num_computed_tokens, [], request.num_tokens)
        assert ok == ref_ok
        if ok:
            request.num_computed_tokens += 1
        else:
            request.token_ids.pop()

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        request = self.running.pop(rid)
        self.manager.free(request)
        self.manager.free_block_hashes(request)
        self.ref.free_request(rid)
        self.tables.pop(rid, None)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        request = self.running.pop(rid)
        self.manager.free(request)
        self.ref.free_request(rid)
        request.num_computed_tokens = 0
        self.preempted[rid] = request
        self.tables.pop(rid, None)

    @precondition(lambda self: self.preempted)
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.preempted)))
        request = self.preempted[rid]
        if self._admit(request):
            self.running[rid] = self.preempted.pop(rid)

    @rule()
    def reset(self) -> None:
        assert self.manager.reset_prefix_cache() == self.ref.reset()

    @invariant()
    def ref_counts_match_holders(self) -> None:
        holders: dict[int, int] = {}
        for blocks in self.manager.req_to_blocks.values():
            for block in blocks:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        for block in self.manager.block_pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0)

    @invariant()
    def free_list_is_exactly_the_unreferenced_blocks_in_reference_order(self) -> None:
        pool = self.manager.block_pool
        free = [b.block_id for b in pool.free_queue]
        assert free == self.ref.free
        assert sorted(free) == sorted(b.block_id for b in pool.blocks if b.ref_cnt == 0)
        used = sum(1 for b in pool.blocks if b.ref_cnt > 0)
        assert pool.get_num_free_blocks() + used == NUM_BLOCKS

    @invariant()
    def every_map_entry_points_at_a_block_with_that_hash(self) -> None:
        pool = self.manager.block_pool
        for key, entry in pool.cached_block_hash_to_block.items():
            blocks = [entry] if not isinstance(entry, dict) else list(entry.values())
            assert blocks
            for block in blocks:
                assert block.block_hash is not None and block.block_hash[0] == key
        cached = sum(1 for b in pool.blocks if b.block_hash is not None)
        assert cached == sum(len(v) for v in self.ref.holders.values())

    @invariant()
    def block_tables_are_append_only(self) -> None:
        for rid, blocks in self.manager.req_to_blocks.items():
            ids = [b.block_id for b in blocks]
            old = self.tables.get(rid, [])
            assert ids[: len(old)] == old
            self.tables[rid] = ids


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=75, stateful_step_count=40,
                                           deadline=None)
