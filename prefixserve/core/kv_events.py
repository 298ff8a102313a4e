"""KV cache events: what a replica's prefix cache gained and lost, for routers outside it.

A ``BlockPool`` with an ``event_sink`` reports three kinds of change (docs/replicas.md):

* ``BlockStored``: full blocks were registered in the map, in chain order. ``block_hashes`` are
  their hash values (``hash_value_of``), ``parent_block_hash`` the hash value of the block before
  the first (None for block 0 of a chain), ``num_tokens`` the tokens they hold, ``lora_id`` the
  adapter their chain belongs to (None for the base model). The cache salt is never published:
  it is already folded into the hash values.
* ``BlockRemoved``: hash values that left the map (evicted). A value is reported only when no
  block holds it any more, so the set of hash values a consumer builds from the events is exactly
  the pool's set of map keys (the pool keeps no duplicates in that set; see docs/prefix-cache.md
  section 3.4).
* ``AllBlocksCleared``: the map was emptied (``reset_prefix_cache``).

``KVEventPublisher`` is the sink: it queues events and ``flush`` hands them over as one
``KVEventBatch`` stamped with the replica's ``epoch`` (a random id drawn when the publisher is
made, so a restarted replica is recognisable) and a sequence number that grows by one per batch.
``KVEventBatch.to_wire``/``from_wire`` give the JSON form consumers outside Python read.

Invariant (tests/router/test_kv_events.py): applying every batch, in sequence order, to an empty set
gives ``set(pool.cached_block_hash_to_block)``; ``snapshot`` gives that set directly, with the
sequence number of the last batch it includes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

HashValue = Hashable
"""A block's hash value: bytes for ``sha256``/``xxhash``, int for ``builtin``, or whatever a
precomputed block hash is (the estimator's trace ids)."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[HashValue, ...]
    parent_block_hash: HashValue | None
    num_tokens: int
    lora_id: Any = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[HashValue, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def _lora_of(block_hash: Hashable) -> Any:
    """The adapter id in a computed block hash's extra keys (``("lora", id)``), else None. A
    hybrid cache's group key ``((value, group), block_hash)`` has the block hash's."""
    if type(block_hash) is tuple and len(block_hash) == 2 and type(block_hash[0]) is tuple:
        block_hash = block_hash[1]
    if type(block_hash) is not tuple or len(block_hash) < 3 or block_hash[2] is None:
        return None
    for key in block_hash[2]:
        if type(key) is tuple and len(key) == 2 and key[0] == "lora":
            return key[1]
    return None


def _value_of(block_hash: Hashable) -> HashValue:
    return block_hash[0] if type(block_hash) is tuple else block_hash


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """The events of one flush. ``seq`` starts at 1 for the first batch of an ``epoch``."""

    replica_id: str
    epoch: str
    seq: int
    timestamp: float
    events: tuple[KVEvent, ...]

    def to_wire(self) -> dict[str, Any]:
        """The JSON-ready form (hash values as hex strings or ints; docs/replicas.md item 2)."""
        return {"replica": self.replica_id, "epoch": self.epoch, "seq": self.seq,
                "ts": self.timestamp, "events": [_event_to_wire(e) for e in self.events]}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> KVEventBatch:
        events = tuple(_event_from_wire(e) for e in data["events"])
        return cls(str(data["replica"]), str(data["epoch"]), int(data["seq"]),
                   float(data["ts"]), events)


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """Every hash value cached after batch ``seq`` of ``epoch`` (a consumer resyncs from it)."""

    replica_id: str
    epoch: str
    seq: int
    block_hashes: frozenset[HashValue]

    def to_wire(self) -> dict[str, Any]:
        return {"replica": self.replica_id, "epoch": self.epoch, "seq": self.seq,
                "blocks": [encode_hash(h) for h in self.block_hashes]}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> KVSnapshot:
        return cls(str(data["replica"]), str(data["epoch"]), int(data["seq"]),
                   frozenset(decode_hash(h) for h in data["blocks"]))


def encode_hash(value: HashValue) -> Any:
    """bytes -> hex string, int -> int (JSON numbers hold any int in Python's json); the
    ``(value, group)`` key a hybrid cache's group ``group > 0`` holds a block under ->
    ``[value, group]``."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, int):
        return value
    if type(value) is tuple and len(value) == 2 and type(value[1]) is int:
        return [encode_hash(value[0]), value[1]]
    raise TypeError(f"hash value of type {type(value).__name__} has no wire form")


def decode_hash(value: Any) -> HashValue:
    if isinstance(value, list):
        return (decode_hash(value[0]), int(value[1]))
    return bytes.fromhex(value) if isinstance(value, str) else int(value)


def _event_to_wire(event: KVEvent) -> list[Any]:
    if isinstance(event, BlockStored):
        return ["stored", [encode_hash(h) for h in event.block_hashes],
                None if event.parent_block_hash is None else encode_hash(event.parent_block_hash),
                event.num_tokens, event.lora_id]
    if isinstance(event, BlockRemoved):
        return ["removed", [encode_hash(h) for h in event.block_hashes]]
    return ["cleared"]


def _event_from_wire(data: list[Any]) -> KVEvent:
    kind = data[0]
    if kind == "stored":
        parent = None if data[2] is None else decode_hash(data[2])
        return BlockStored(tuple(decode_hash(h) for h in data[1]), parent, int(data[3]), data[4])
    if kind == "removed":
        return BlockRemoved(tuple(decode_hash(h) for h in data[1]))
    if kind == "cleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event kind {kind!r}")


class KVEventPublisher:
    """The pool's event sink: queues events, ``flush`` batches them with the next sequence number.

    Consecutive removals are merged into one ``BlockRemoved`` so a step that evicts many blocks
    sends one event. ``history`` batches are kept for ``batches_after`` (a consumer that missed a
    few catches up without a snapshot)."""

    __slots__ = ("_history", "_pending", "_removed", "block_size", "epoch", "history",
                 "replica_id", "seq")

    def __init__(self, replica_id: str, block_size: int, history: int = 256,
                 epoch: str | None = None) -> None:
        self.replica_id = replica_id
        self.block_size = block_size
        self.epoch = epoch if epoch is not None else f"{os.urandom(8).hex()}"
        self.seq = 0
        self.history = history
        self._pending: list[KVEvent] = []
        self._removed: list[HashValue] = []
        self._history: list[KVEventBatch] = []

    # ----------------------------------------------------------------- sink (called by the pool)
    def stored(self, block_hashes: Sequence[Hashable], start: int, end: int) -> None:
        """Blocks ``start..end-1`` of a chain were registered."""
        if start >= end:
            return
        self._take_removed()
        parent = _value_of(block_hashes[start - 1]) if start > 0 else None
        values = tuple(_value_of(h) for h in block_hashes[start:end])
        self._pending.append(BlockStored(values, parent, (end - start) * self.block_size,
                                         _lora_of(block_hashes[start])))

    def removed(self, hash_value: HashValue) -> None:
        """No block holds ``hash_value`` any more."""
        self._removed.append(hash_value)

    def cleared(self) -> None:
        self._removed.clear()
        self._pending.append(AllBlocksCleared())

    # ----------------------------------------------------------------- batching
    def _take_removed(self) -> None:
        if self._removed:
            self._pending.append(BlockRemoved(tuple(self._removed)))
            self._removed = []

    def flush(self) -> KVEventBatch | None:
        """The events queued since the last flush as one batch, or None when there are none."""
        self._take_removed()
        if not self._pending:
            return None
        self.seq += 1
        batch = KVEventBatch(self.replica_id, self.epoch, self.seq, time.time(),
                             tuple(self._pending))
        self._pending = []
        self._history.append(batch)
        if len(self._history) > self.history:
            del self._history[: len(self._history) - self.history]
        return batch

    def batches_after(self, seq: int) -> list[KVEventBatch] | None:
        """The kept batches after ``seq``, or None when some of them are no longer kept (the
        consumer must take a snapshot)."""
        if seq >= self.seq:
            return []
        kept = self._history
        if not kept or kept[0].seq > seq + 1:
            return None
        return kept[seq + 1 - kept[0].seq:]

    def snapshot(self, cached_hash_values: Sequence[HashValue] | Any) -> KVSnapshot:
        """The state after the last flushed batch; call it right after ``flush`` (pending events
        would be in the set but not yet in a batch)."""
        return KVSnapshot(self.replica_id, self.epoch, self.seq, frozenset(cached_hash_values))
