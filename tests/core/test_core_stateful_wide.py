"""The manager against a reference built from first principles, over every configuration the core
offers: the three hash algorithms, block sizes 1-4, salts, LoRA ids, multimodal inputs,
``use_eagle``, and the sliding-window manager.

The reference keeps no hashes and no counters of the implementation. A block's identity is
everything its KV depends on: the whole token prefix up to its end, the salt, the LoRA id and the
content of every multimodal input that overlaps the prefix. Its rules, from docs/prefix-cache.md:

* a block is registered once, when it first becomes full; a hit block already is; a reset
  forgets every registration and a block held across it is never registered again;
* full attention hits the longest run of registered blocks from block 0; sliding-window attention
  hits the longest prefix whose window (the earlier positions the next token attends to) lies in
  registered blocks, with placeholders before it; never the last block of a prompt that fills it;
  ``use_eagle`` drops the last block of what that rule would hit with one block more required;
* a request's blocks are freed last block first; while a sliding-window request runs, blocks that
  no later token attends to are freed (newest first) and replaced by placeholders;
* new blocks come from the head of the free list, evicting their registration; a hit on a free
  block takes it out of the list; an allocation that does not fit changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixserve.core import (
    HASH_ALGOS,
    CacheRequest,
    KVCacheManager,
    MultiModalInput,
    make_kv_cache_manager,
)

pytestmark = pytest.mark.fast

NUM_BLOCKS = 8
NULL = -1  # the reference's placeholder


@dataclass
class RefRequest:
    table: list[int] = field(default_factory=list)
    registered: list[bool] = field(default_factory=list)  # per table entry: never register again


class Reference:
    def __init__(self, num_blocks: int, bs: int, window: int | None, eagle: bool) -> None:
        self.bs, self.window, self.eagle = bs, window, eagle
        first = 1 if window is not None else 0  # the sliding-window pool reserves block 0
        self.free: list[int] = list(range(first, num_blocks))
        self.identity: dict[int, tuple | None] = dict.fromkeys(range(num_blocks))
        self.ref: dict[int, int] = dict.fromkeys(range(num_blocks), 0)
        self.requests: dict[str, RefRequest] = {}
        self.order: list[tuple[int, tuple]] = []  # (block, identity) in registration order

    def block_identity(self, request: CacheRequest, i: int) -> tuple:
        """Salt, LoRA id, the images overlapping each of blocks 0..i, and the tokens up to the
        end of block i."""
        bs = self.bs
        images = tuple(
            tuple(mm.content_hash for mm in request.mm_inputs
                  if mm.offset < (j + 1) * bs and mm.offset + mm.length > j * bs)
            for j in range(i + 1))
        prefix = tuple(request.token_ids[: (i + 1) * bs])
        return (request.cache_salt, request.lora_id, images, prefix)

    def _holder(self, identity: tuple) -> int | None:
        """The block holding ``identity`` that the manager returns: of the blocks registered
        under it, the one registered first (the pool keeps them in insertion order)."""
        for block, held in self.order:
            if held == identity:
                return block
        return None

    def _window_blocks(self, hit: int) -> set[int]:
        """The blocks holding the earlier positions the token after a hit of ``hit`` blocks
        attends to."""
        if self.window is None:
            return set(range(hit))
        first = max(0, hit * self.bs - self.window + 1)
        return {p // self.bs for p in range(first, hit * self.bs)}

    def lookup(self, request: CacheRequest) -> list[int]:
        max_hit = (len(request.token_ids) - 1) // self.bs
        found = [self._holder(self.block_identity(request, i)) for i in range(max_hit)]
        # the longest h ending on a found block whose window (with eagle: the window of the hit
        # that remains once the last block is dropped) is found too
        valid = [h for h in range(1, max_hit + 1) if found[h - 1] is not None
                 and all(found[j] is not None for j in self._window_blocks(h - self.eagle))]
        if not valid:
            return []
        checked_to = max(valid)
        hit = checked_to - self.eagle
        # real blocks for the run the lookup checked (the window, the dropped block, at least
        # the last block; all of them from block 0 when the run reaches it), placeholders before
        if self.window is None:
            first_real = 0
        else:
            run = max(1, -(-(self.window - 1) // self.bs) + self.eagle)
            first_real = max(0, checked_to - run)
        return [found[i] if i >= first_real else NULL for i in range(hit)]  # type: ignore

    def _released(self, num_computed: int) -> int:
        if self.window is None:
            return 0
        first_needed = max(0, num_computed - self.window + 1)
        return first_needed // self.bs

    def allocate(self, rid: str, request: CacheRequest, computed_tokens: int, hits: list[int],
                 total: int) -> bool:
        state = self.requests.get(rid, RefRequest())
        release = [i for i in range(min(self._released(computed_tokens), len(state.table)))
                   if state.table[i] != NULL]
        gain = sum(1 for i in release if self.ref[state.table[i]] == 1)
        need = -(-total // self.bs) - len(state.table) - len(hits)
        evictable = sum(1 for b in hits if b != NULL and self.ref[b] == 0)
        if need > len(self.free) + gain - evictable:
            return False
        self.requests[rid] = state
        for i in reversed(release):
            self._unref(state.table[i])
            state.table[i] = NULL
        for b in hits:
            if b != NULL:
                if self.ref[b] == 0:
                    self.free.remove(b)
                self.ref[b] += 1
            state.table.append(b)
            state.registered.append(True)
        for _ in range(max(need, 0)):
            b = self.free.pop(0)
            self.identity[b] = None
            self.order = [(x, ident) for x, ident in self.order if x != b]
            self.ref[b] = 1
            state.table.append(b)
            state.registered.append(False)
        for i in range(min(total, len(request.token_ids)) // self.bs):
            if not state.registered[i]:
                state.registered[i] = True
                block = state.table[i]
                self.identity[block] = self.block_identity(request, i)
                self.order.append((block, self.identity[block]))
        return True

    def _unref(self, block: int) -> None:
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.free.append(block)

    def free_request(self, rid: str) -> None:
        state = self.requests.pop(rid, None)
        if state:
            for b in reversed(state.table):
                if b != NULL:
                    self._unref(b)

    def reset(self) -> None:
        self.identity = dict.fromkeys(self.identity)
        self.order = []


class WideMachine(RuleBasedStateMachine):
    @initialize(algo=st.sampled_from(HASH_ALGOS), bs=st.integers(1, 4),
                window=st.one_of(st.none(), st.integers(1, 9)), eagle=st.booleans())
    def setup(self, algo: str, bs: int, window: int | None, eagle: bool) -> None:
        self.bs = bs
        self.manager: KVCacheManager = make_kv_cache_manager(
            NUM_BLOCKS, bs, hash_algo=algo, sliding_window=window, use_eagle=eagle)
        self.ref = Reference(NUM_BLOCKS, bs, window, eagle)
        self.running: dict[str, CacheRequest] = {}
        self.preempted: dict[str, CacheRequest] = {}
        self.counter = 0

    def _ids(self, blocks: list) -> list[int]:
        return [NULL if b.is_null else b.block_id for b in blocks]

    def _admit(self, request: CacheRequest) -> bool:
        computed, num = self.manager.get_computed_blocks(request)
        ref_hits = self.ref.lookup(request)
        assert self._ids(computed) == ref_hits, "hit blocks differ from the reference"
        assert num == len(ref_hits) * self.bs
        ok = self.manager.allocate_slots(request, request.num_tokens - num, computed) is not None
        assert ok == self.ref.allocate(request.request_id, request, num, ref_hits,
                                       request.num_tokens)
        if ok:
            request.num_computed_tokens = request.num_tokens
        return ok

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=12),
          salt=st.sampled_from([None, None, "s"]), lora=st.sampled_from([None, None, 1, 2]),
          image=st.one_of(st.none(), st.tuples(st.integers(0, 8), st.integers(1, 4),
                                               st.sampled_from("xy"))))
    def add_request(self, tokens: list[int], salt: str | None, lora: int | None,
                    image: tuple[int, int, str] | None) -> None:
        self.counter += 1
        mm = [MultiModalInput(*image)] if image else []
        request = CacheRequest(f"r{self.counter}", tokens, cache_salt=salt, lora_id=lora,
                               mm_inputs=mm)
        if self._admit(request):
            self.running[request.request_id] = request
        else:
            self.manager.free_block_hashes(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 1))
    def decode(self, data: st.DataObject, token: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        request = self.running[rid]
        request.token_ids.append(token)
        ok = self.manager.allocate_slots(request, 1) is not None
        assert ok == self.ref.allocate(rid, request, request.num_computed_tokens, [],
                                       request.num_tokens)
        if ok:
            request.num_computed_tokens += 1
        else:
            request.token_ids.pop()

    @precondition(lambda self: self.running)
    @rule(data=st.data(), finished=st.booleans())
    def release(self, data: st.DataObject, finished: bool) -> None:
        """Finish (blocks and chain dropped) or preempt (blocks dropped, chain kept)."""
        rid = data.draw(st.sampled_from(sorted(self.running)))
        request = self.running.pop(rid)
        self.manager.free(request)
        self.ref.free_request(rid)
        if finished:
            self.manager.free_block_hashes(request)
        else:
            request.num_computed_tokens = 0
            self.preempted[rid] = request

    @precondition(lambda self: self.preempted)
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.preempted)))
        if self._admit(self.preempted[rid]):
            self.running[rid] = self.preempted.pop(rid)

    @rule()
    def reset(self) -> None:
        assert self.manager.reset_prefix_cache() is True
        self.ref.reset()

    @invariant()
    def pool_matches_the_reference(self) -> None:
        pool = self.manager.block_pool
        assert [b.block_id for b in pool.free_queue] == self.ref.free
        assert {b.block_id: b.ref_cnt for b in pool.blocks if not b.is_null} == {
            k: v for k, v in self.ref.ref.items() if not (pool.null_block and k == 0)}
        for rid, state in self.ref.requests.items():
            assert self._ids(self.manager.req_to_blocks.get(rid, [])) == state.table
        registered = {b.block_id for b in pool.blocks if b.block_hash is not None}
        assert registered == {b for b, ident in self.ref.identity.items() if ident is not None}


TestWideMachine = WideMachine.TestCase
TestWideMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
