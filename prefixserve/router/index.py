"""What a router knows of each replica's prefix cache, built from that replica's KV events.

Per replica, ``ReplicaCache`` holds the set of hash values the replica's pool has in its map (the
events mirror that set exactly, see ``prefixserve.core.kv_events``), the blocks held per LoRA
adapter, and where in the replica's event stream it stands: its ``epoch`` and the sequence number
of the last batch applied.

Rules (docs/replicas.md item 3, tested in tests/router/test_kv_events.py):

* A batch whose ``seq`` is not ``last + 1`` is a **gap**: the replica is marked stale and the batch
  is kept, not applied. A stale replica counts as holding nothing until ``resync`` loads a
  snapshot; the kept batches after the snapshot's ``seq`` are then applied, older ones dropped.
* A batch or snapshot with a different ``epoch`` means the replica restarted: what was known of it
  is cleared first (its cache is gone), never merged with the new state.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from prefixserve.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVSnapshot,
)

PENDING = 1024
"""Batches kept per replica while it waits for a snapshot."""


class ReplicaCache:
    """The cached hash values of one replica and its position in the replica's event stream."""

    __slots__ = ("blocks", "epoch", "lora_blocks", "lora_of", "pending", "seq", "stale")

    def __init__(self) -> None:
        self.blocks: set[Hashable] = set()
        self.lora_of: dict[Hashable, Any] = {}
        self.lora_blocks: dict[Any, int] = {}
        self.epoch: str | None = None
        self.seq = 0
        self.stale = False
        self.pending: list[KVEventBatch] = []

    def clear(self) -> None:
        self.blocks.clear()
        self.lora_of.clear()
        self.lora_blocks.clear()

    def _store(self, event: BlockStored) -> None:
        self.blocks.update(event.block_hashes)
        if event.lora_id is not None:
            lora = event.lora_id
            for value in event.block_hashes:
                if value not in self.lora_of:
                    self.lora_of[value] = lora
                    self.lora_blocks[lora] = self.lora_blocks.get(lora, 0) + 1

    def _remove(self, event: BlockRemoved) -> None:
        self.blocks.difference_update(event.block_hashes)
        if self.lora_of:
            for value in event.block_hashes:
                lora = self.lora_of.pop(value, None)
                if lora is not None:
                    left = self.lora_blocks[lora] - 1
                    if left:
                        self.lora_blocks[lora] = left
                    else:
                        del self.lora_blocks[lora]

    def apply_events(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._store(event)
            elif isinstance(event, BlockRemoved):
                self._remove(event)
            elif isinstance(event, AllBlocksCleared):
                self.clear()
        self.seq = batch.seq

    def matched_blocks(self, hash_values: Sequence[Hashable]) -> int:
        """How many leading blocks of the chain this replica holds (0 while stale)."""
        if self.stale:
            return 0
        blocks = self.blocks
        n = 0
        for value in hash_values:
            if value not in blocks:
                break
            n += 1
        return n


class CacheIndex:
    """``ReplicaCache`` per replica id; fed with ``apply`` (batches) and ``resync`` (snapshots)."""

    def __init__(self, replica_ids: Iterable[str] = ()) -> None:
        self.replicas: dict[str, ReplicaCache] = {}
        self.gaps = 0
        self.restarts = 0
        for replica_id in replica_ids:
            self.add_replica(replica_id)

    def add_replica(self, replica_id: str) -> ReplicaCache:
        cache = self.replicas.get(replica_id)
        if cache is None:
            cache = self.replicas[replica_id] = ReplicaCache()
        return cache

    def remove_replica(self, replica_id: str) -> None:
        self.replicas.pop(replica_id, None)

    def _check_epoch(self, cache: ReplicaCache, epoch: str) -> None:
        """A new epoch is a restarted replica: it starts empty at sequence number 0."""
        if cache.epoch != epoch:
            if cache.epoch is not None:
                self.restarts += 1
            cache.clear()
            cache.pending.clear()
            cache.epoch = epoch
            cache.seq = 0
            cache.stale = False

    def apply(self, batch: KVEventBatch) -> bool:
        """Applies one batch; False when the replica's state is unknown until ``resync`` (a gap
        was found now or earlier). Batches arriving meanwhile are kept (at most ``PENDING``) and
        those after the snapshot are applied by ``resync``."""
        cache = self.add_replica(batch.replica_id)
        self._check_epoch(cache, batch.epoch)
        if cache.stale:
            if len(cache.pending) < PENDING:
                cache.pending.append(batch)
            return False
        if batch.seq <= cache.seq:
            return True  # already applied
        if batch.seq != cache.seq + 1:
            self.gaps += 1
            cache.stale = True
            cache.clear()
            cache.pending.append(batch)
            return False
        cache.apply_events(batch)
        return True

    def needs_resync(self, replica_id: str) -> bool:
        cache = self.replicas.get(replica_id)
        return cache is not None and cache.stale

    def resync(self, snapshot: KVSnapshot) -> bool:
        """Replaces what is known of the replica with ``snapshot``, then applies the kept batches
        that follow it. False when they leave a gap again (resync from a newer snapshot)."""
        cache = self.add_replica(snapshot.replica_id)
        self._check_epoch(cache, snapshot.epoch)
        cache.clear()
        cache.blocks.update(snapshot.block_hashes)
        cache.seq = snapshot.seq
        cache.stale = False
        pending = sorted((b for b in cache.pending if b.epoch == snapshot.epoch),
                         key=lambda b: b.seq)
        cache.pending.clear()
        return all(self.apply(batch) for batch in pending)

    def matched_blocks(self, hash_values: Sequence[Hashable]) -> dict[str, int]:
        """Leading blocks of the chain held, per replica."""
        return {rid: cache.matched_blocks(hash_values) for rid, cache in self.replicas.items()}

    def lora_blocks(self, replica_id: str, lora_id: Any) -> int:
        cache = self.replicas.get(replica_id)
        return 0 if cache is None else cache.lora_blocks.get(lora_id, 0)

    def cached_blocks(self, replica_id: str) -> int:
        cache = self.replicas.get(replica_id)
        return 0 if cache is None else len(cache.blocks)
