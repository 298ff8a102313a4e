"""KV events and the router's cache index (docs/replicas.md): the events mirror the
pool's map, gaps are detected and healed from a snapshot, restarts clear a replica's state, and the
router hashes prompts to the very values the replicas publish."""

from __future__ import annotations

import hashlib
import json
import random
import struct

import pytest
from core_helpers import admit, finish, run_once

from prefixserve.core import CacheRequest, KVCacheManager
from prefixserve.core.hashing import hash_value_of
from prefixserve.core.hybrid_kv_cache_manager import HybridKVCacheManager
from prefixserve.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    KVSnapshot,
)
from prefixserve.router import CacheIndex, PromptHasher, Router, RouteRequest

pytestmark = pytest.mark.fast

BS = 4


def _manager(num_blocks: int = 16, algo: str = "sha256") -> tuple[KVCacheManager,
                                                                  KVEventPublisher]:
    manager = KVCacheManager(num_blocks, BS, hash_algo=algo)
    publisher = KVEventPublisher("r0", BS)
    manager.block_pool.event_sink = publisher
    return manager, publisher


def _map_keys(manager: KVCacheManager) -> set[object]:
    return set(manager.block_pool.cached_block_hash_to_block)


def test_events_mirror_the_map_under_random_traffic() -> None:
    """Stored, evicted (only once no block holds the value), duplicates, resets: the set built
    from the events equals the pool's map keys after every batch. (Planted: reporting every
    evicted block's value even while a duplicate still holds it breaks this.)"""
    rng = random.Random(7)
    manager, publisher = _manager(12)
    index = CacheIndex()
    prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]
    running: list[CacheRequest] = []
    for step in range(300):
        if running and (len(running) > 2 or rng.random() < 0.5):
            finish(manager, running.pop(rng.randrange(len(running))))
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(9))]
            request = CacheRequest(f"q{step}", tokens)
            if manager.block_pool.get_num_free_blocks() > 4:
                admit(manager, request)
                running.append(request)
        if step % 97 == 96:
            manager.reset_prefix_cache()
        batch = publisher.flush()
        if batch is not None:
            assert index.apply(batch)
        assert index.replicas["r0"].blocks == _map_keys(manager)
    assert index.gaps == 0


def test_a_value_held_by_two_blocks_is_removed_only_with_the_last() -> None:
    """Two requests that missed on the same content both register it (no de-duplication): the
    value leaves the consumer's set only when its last block is evicted. (Planted: reporting
    every evicted block's value makes the router forget a block still cached; this fails.)"""
    manager, publisher = _manager(num_blocks=6)
    index = CacheIndex()
    tokens = list(range(9))
    first, second = CacheRequest("a", tokens), CacheRequest("b", list(tokens))
    manager.get_computed_blocks(second)  # looked up before the first registered its blocks
    admit(manager, first)
    assert manager.allocate_slots(second, len(tokens)) is not None  # computes it again
    second_hashes = list(manager.block_hashes(second))
    finish(manager, first)
    finish(manager, second)
    index.apply(publisher.flush())  # type: ignore[arg-type]
    run_once(manager, CacheRequest("c", list(range(50, 62))))  # evicts the first's 3 blocks
    index.apply(publisher.flush())  # type: ignore[arg-type]
    assert len(manager.block_pool.cached_blocks(second_hashes[0])) == 1
    assert index.replicas["r0"].blocks == _map_keys(manager)
    assert {hash_value_of(h) for h in second_hashes} <= _map_keys(manager)


def test_stored_event_carries_chain_tokens_and_lora_but_no_salt() -> None:
    manager, publisher = _manager()
    run_once(manager, CacheRequest("a", list(range(9)), cache_salt="secret", lora_id="ad1"))
    batch = publisher.flush()
    assert batch is not None and batch.seq == 1
    (stored,) = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.parent_block_hash is None and stored.num_tokens == 8 and stored.lora_id == "ad1"
    assert len(stored.block_hashes) == 2
    assert "secret" not in json.dumps(batch.to_wire())
    assert KVEventBatch.from_wire(json.loads(json.dumps(batch.to_wire()))) == batch


def test_eviction_and_reset_events() -> None:
    manager, publisher = _manager(num_blocks=3)
    run_once(manager, CacheRequest("a", list(range(9))))  # 2 full blocks cached
    publisher.flush()
    run_once(manager, CacheRequest("b", list(range(100, 109))))  # evicts them
    kinds = [type(e) for e in publisher.flush().events]  # type: ignore[union-attr]
    assert BlockRemoved in kinds and BlockStored in kinds
    manager.reset_prefix_cache()
    assert publisher.flush().events == (AllBlocksCleared(),)  # type: ignore[union-attr]


def test_consumer_that_drops_a_batch_detects_the_gap_and_resyncs() -> None:
    """(Planted: applying a batch whose seq skips one leaves the consumer wrong; this fails.)"""
    manager, publisher = _manager(num_blocks=6)
    index = CacheIndex()
    delivered = 0
    for i in range(12):
        run_once(manager, CacheRequest(f"r{i}", [i % 4] * 4 + list(range(i, i + 5))))
        batch = publisher.flush()
        assert batch is not None
        if i == 5:
            continue  # dropped on the way
        ok = index.apply(batch)
        delivered += 1
        if not ok:
            assert index.needs_resync("r0")
            # while stale, the replica counts as holding nothing
            assert index.matched_blocks([next(iter(_map_keys(manager)))])["r0"] == 0
            snapshot = publisher.snapshot(_map_keys(manager))
            wire = json.loads(json.dumps(snapshot.to_wire()))
            assert index.resync(KVSnapshot.from_wire(wire))
        assert index.replicas["r0"].blocks == _map_keys(manager)
    assert index.gaps == 1


def test_resync_applies_batches_kept_after_the_snapshot() -> None:
    manager, publisher = _manager()
    index = CacheIndex()
    run_once(manager, CacheRequest("a", list(range(9))))
    index.apply(publisher.flush())  # type: ignore[arg-type]
    run_once(manager, CacheRequest("b", list(range(20, 29))))
    publisher.flush()  # lost
    snapshot = publisher.snapshot(_map_keys(manager))
    run_once(manager, CacheRequest("c", list(range(40, 49))))
    assert not index.apply(publisher.flush())  # type: ignore[arg-type]
    assert index.resync(snapshot)
    assert index.replicas["r0"].blocks == _map_keys(manager)


def test_replica_restart_clears_its_state_in_the_router() -> None:
    """A new epoch (a restarted replica, empty cache) replaces the old state; nothing stale is
    kept. (Planted: ignoring the epoch keeps the dead replica's blocks; this fails.)"""
    manager, publisher = _manager()
    index = CacheIndex()
    run_once(manager, CacheRequest("a", list(range(9))))
    index.apply(publisher.flush())  # type: ignore[arg-type]
    assert index.cached_blocks("r0") == 2
    restarted, publisher2 = _manager()
    assert publisher2.epoch != publisher.epoch
    run_once(restarted, CacheRequest("b", list(range(50, 55))))
    assert index.apply(publisher2.flush())  # type: ignore[arg-type]
    assert index.replicas["r0"].blocks == _map_keys(restarted)
    assert index.restarts == 1


def test_history_serves_a_consumer_that_fell_behind() -> None:
    manager, publisher = _manager()
    publisher.history = 2
    for i in range(4):
        run_once(manager, CacheRequest(f"r{i}", list(range(10 * i, 10 * i + 5))))
        publisher.flush()
    assert [b.seq for b in publisher.batches_after(2) or []] == [3, 4]
    assert publisher.batches_after(1) is None  # batch 2 is gone: take a snapshot
    assert publisher.batches_after(4) == []


def test_router_hashes_prompts_to_the_published_values() -> None:
    """The router's PromptHasher, salt and adapter included, gives the values the manager
    published, so routing by prefix needs no model. (Planted: hashing without the salt routes
    a salted prompt to another namespace; this fails.)"""
    manager, publisher = _manager(algo="xxhash")
    tokens = list(range(13))
    run_once(manager, CacheRequest("a", tokens, cache_salt="t1", lora_id=3))
    (stored,) = publisher.flush().events  # type: ignore[union-attr]
    hasher = PromptHasher(BS, "xxhash")
    assert tuple(hasher.hash_values(tokens, "t1", 3)) == stored.block_hashes  # type: ignore[union-attr]
    assert hasher.hash_values(tokens)[0] not in stored.block_hashes  # type: ignore[union-attr]


def _documented_encode(value: object) -> bytes:
    """``encode`` as docs/KV_EVENTS.md gives it (the kinds a served request uses)."""
    if value is None:
        return b"N"
    if isinstance(value, str):
        raw = value.encode()
        return b"s" + struct.pack("<I", len(raw)) + raw
    assert isinstance(value, tuple)
    return b"t" + struct.pack("<I", len(value)) + b"".join(_documented_encode(v) for v in value)


def _documented_chain(seed: str, tokens: list[int], block_size: int, salt: str | None,
                      lora: str | None) -> list[bytes]:
    """A prompt's values computed from docs/KV_EVENTS.md alone (hashlib and struct only)."""
    parent = hashlib.sha256(seed.encode()).digest()
    values = []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size:(i + 1) * block_size]
        keys = ((("lora", lora),) if lora else ()) + ((("salt", salt),) if salt and i == 0
                                                       else ())
        data = (parent + struct.pack("<I", block_size) + struct.pack(f"<{len(block)}q", *block)
                + _documented_encode(keys or None))
        parent = hashlib.sha256(data).digest()
        values.append(parent)
    return values


def test_the_documented_hashing_gives_the_published_values() -> None:
    """An outside router that follows docs/KV_EVENTS.md gets the router's (hence the replicas')
    values, with and without adapter and salt (planted: a wrong order of the extra keys or a
    u64 token count in the doc's recipe fails this)."""
    tokens = [(i * 7919) % 49000 for i in range(37)]
    hasher = PromptHasher(16, "sha256", seed="1234")
    for salt, lora in ((None, None), ("tenant", None), (None, "lora-ab12"), ("t", "lora-ab12")):
        assert _documented_chain("1234", tokens, 16, salt, lora) == \
            hasher.hash_values(tokens, salt, lora)


def _two_replicas() -> tuple[Router, dict[str, KVCacheManager], PromptHasher]:
    router = Router("prefix-aware")
    managers = {}
    for rid in ("a", "b"):
        manager = KVCacheManager(32, BS, hash_algo="sha256")
        manager.block_pool.event_sink = KVEventPublisher(rid, BS)
        managers[rid] = manager
    return router, managers, PromptHasher(BS, "sha256")


def _serve(router: Router, managers: dict[str, KVCacheManager], rid: str,
           request: CacheRequest) -> None:
    run_once(managers[rid], request)
    sink = managers[rid].block_pool.event_sink
    assert sink is not None
    batch = sink.flush()
    if batch is not None:
        router.index.apply(batch)


def test_prefix_aware_routes_to_the_longest_prefix_within_the_load_threshold() -> None:
    router, managers, hasher = _two_replicas()
    shared = list(range(16))
    _serve(router, managers, "b", CacheRequest("x", shared + [99]))
    route = RouteRequest(hasher.hash_values(shared + [7, 7, 7, 7, 7]))
    decision = router.route(route, {"a": 0, "b": 2})
    assert (decision.replica_id, decision.matched_blocks) == ("b", 4)
    # b's load exceeds a's by more than 4 requests and by more than 1.5x: the least loaded wins
    assert router.route(route, {"a": 3, "b": 8}).replica_id == "a"
    assert router.route(route, {"a": 3, "b": 7}).replica_id == "b"  # within 4
    # a salted prompt has no prefix anywhere: least loaded
    salted = RouteRequest(hasher.hash_values(shared, cache_salt="t"))
    assert router.route(salted, {"a": 1, "b": 0}).replica_id == "b"
    assert router.route(salted, {"a": 0, "b": 1}).replica_id == "a"


def test_lora_requests_prefer_replicas_holding_the_adapter() -> None:
    router, managers, hasher = _two_replicas()
    _serve(router, managers, "a", CacheRequest("x", list(range(8)), lora_id="ad"))
    new_prompt = RouteRequest(hasher.hash_values(list(range(50, 58)), lora_id="ad"),
                              lora_id="ad")
    assert router.route(new_prompt, {"a": 1, "b": 0}).replica_id == "a"
    plain = RouteRequest(hasher.hash_values(list(range(50, 58))))
    assert router.route(plain, {"a": 1, "b": 0}).replica_id == "b"


def test_round_robin_least_loaded_and_session_policies() -> None:
    loads = {"a": 0, "b": 0, "c": 0}
    rr = Router("round-robin")
    assert [rr.route(RouteRequest(), loads).replica_id for _ in range(4)] == ["a", "b", "c", "a"]
    ll = Router("least-loaded")
    assert ll.route(RouteRequest(), {"a": 2, "b": 1, "c": 3}).replica_id == "b"
    session = Router("session")
    first = session.route(RouteRequest(session_key="u1"), loads).replica_id
    assert all(session.route(RouteRequest(session_key="u1"), loads).replica_id == first
               for _ in range(5))
    # the sticky replica left: the session moves
    rest = {k: 0 for k in loads if k != first}
    assert session.route(RouteRequest(session_key="u1"), rest).replica_id != first


def test_a_hybrid_cache_publishes_every_group_in_a_wire_form_that_round_trips() -> None:
    """A model with a sliding-window group (Gemma 3's layout) caches each block once per group;
    group 1's values are published as ``[value, 1]``. Through JSON and back, the events and the
    snapshot rebuild the pool's map keys exactly, and group 1's stored event keeps the chain's
    adapter. (Planted: the group keys without a wire form made ``to_wire`` raise TypeError; the
    adapter read from the group key instead of its block hash published null.)"""
    manager = HybridKVCacheManager(24, BS, (None, 8), hash_algo="sha256")
    publisher = KVEventPublisher("r0", BS)
    manager.block_pool.event_sink = publisher
    index = CacheIndex()
    for step in range(6):
        request = CacheRequest(f"q{step}", list(range(step, step + 13)), lora_id="ad1")
        admit(manager, request)
        finish(manager, request)
        wire = json.loads(json.dumps(publisher.flush().to_wire()))  # type: ignore[union-attr]
        assert index.apply(KVEventBatch.from_wire(wire))
        assert index.replicas["r0"].blocks == _map_keys(manager)
    first = KVEventBatch.from_wire(json.loads(json.dumps(publisher.batches_after(0)[0].to_wire())))
    stored = [e for e in first.events if isinstance(e, BlockStored)]
    assert len(stored) == 2  # group 0, then group 1, each the prompt's 3 full blocks
    plain, grouped = stored
    assert grouped.block_hashes == tuple((value, 1) for value in plain.block_hashes)
    assert grouped.parent_block_hash is None and grouped.lora_id == plain.lora_id == "ad1"
    snapshot = publisher.snapshot(manager.block_pool.cached_block_hash_to_block)
    again = KVSnapshot.from_wire(json.loads(json.dumps(snapshot.to_wire())))
    assert again.block_hashes == frozenset(_map_keys(manager))
