"""Cache tiers below the block pool: the interface, the block record and the chain of tiers.

A tier keeps KV blocks outside the pool (on disk, in Redis) under a **key** made of the model's
namespace and the block's chain hash value (``tier_key``). Since the chain hash folds in the
whole history, the salt and the LoRA id, a key names exactly one prefix of one model, and a
block found under it can be loaded in place of computing it.

Rules (docs/tiers.md):

* A tier stores **records** (``encode_record``): a header with the block's token ids and a
  checksum over tokens and payload. ``decode_record`` returns None for anything torn, truncated,
  corrupted or holding other tokens, so a bad record is a miss, never KV.
* ``TierChain.fetch`` walks the keys in chain order, block by block, taking each block from the
  first tier (in chain order) that holds a valid record of it, and stops at the first block no
  tier gives: a block is useless when an earlier one is missing.
* A tier that raises (down, timed out, broken) is **marked down** for ``retry_after`` seconds:
  while down, its lookups are misses and its writes are dropped (both counted); the first call
  after that time probes it again. A tier never makes a request fail.
* A tier whose write raises ``TierFull`` (a full disk, a Redis out of memory) or its subclass
  ``TierReadOnly`` (a disk folder made read-only) is not down: it is marked **full** (not
  writable) for ``retry_after`` seconds, during which its writes are dropped (counted) and its
  lookups go on, since what it holds is still good; the first write after that time tries
  again.

Pure Python: keys, records and bookkeeping only; what a payload holds (KV tensor bytes) is the
engine's business.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import xxhash

T = TypeVar("T")

logger = logging.getLogger("prefixserve.tiers")

RECORD_MAGIC = b"PSKV1\x00"
"""First bytes of every record (format version 1)."""

_HEADER = struct.Struct("<6sQII")
"""magic, xxh3_64 checksum of everything after the header, token count, payload length."""


def tier_key(namespace: bytes, hash_value: Hashable) -> bytes:
    """The tier key of a block: ``namespace`` followed by its hash value as bytes (a digest as
    it is, a builtin-hash int as 8 signed little-endian bytes)."""
    if isinstance(hash_value, bytes):
        return namespace + hash_value
    if isinstance(hash_value, int):
        return namespace + (hash_value & (2**64 - 1)).to_bytes(8, "little")
    raise TypeError(f"cannot make a tier key of a {type(hash_value).__name__} hash value")


def encode_record(token_ids: Sequence[int], payload: bytes | memoryview) -> bytes:
    """One block's record: header, token ids (native int64) and payload; the checksum covers
    tokens and payload."""
    tokens = array("q", token_ids).tobytes()
    body = tokens + payload
    return _HEADER.pack(RECORD_MAGIC, xxhash.xxh3_64_intdigest(body), len(token_ids),
                        len(payload)) + body


def decode_record(record: bytes | None, token_ids: Sequence[int], payload_size: int
                  ) -> memoryview | None:
    """The payload of ``record`` if it is whole, its checksum holds, it is a record of
    ``token_ids`` and its payload has ``payload_size`` bytes; None otherwise."""
    if record is None or len(record) < _HEADER.size:
        return None
    magic, checksum, num_tokens, size = _HEADER.unpack_from(record)
    tokens_size = 8 * num_tokens
    if (magic != RECORD_MAGIC or size != payload_size or num_tokens != len(token_ids)
            or len(record) != _HEADER.size + tokens_size + size):
        return None
    view = memoryview(record)[_HEADER.size:]
    if xxhash.xxh3_64_intdigest(view) != checksum:
        return None
    if view[:tokens_size].cast("q").tolist() != list(token_ids):
        return None
    return view[tokens_size:]


class TierFull(Exception):
    """Raised by ``KVTier.store_many`` when the tier has no room left (not a broken tier);
    ``stored`` of the records (the first ones) were stored before."""

    reason = "full"

    def __init__(self, message: str, stored: int = 0) -> None:
        super().__init__(message)
        self.stored = stored


class TierReadOnly(TierFull):
    """Raised by ``KVTier.store_many`` when the tier may not be written (a read-only file
    system or folder) but can still be read: handled as ``TierFull``."""

    reason = "read-only"


class KVTier(ABC):
    """A store of block records by key. Batch calls are the primitive; the single-key ones are
    built on them. Implementations may raise on any failure (the chain marks the tier down);
    ``store_many`` may skip records (a budget too small) and raises ``TierFull`` when there is
    no room left; ``load_many`` may return None for any key (gone meanwhile)."""

    name: str = "tier"

    @abstractmethod
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is held (a hint: the record may still be gone or bad at load)."""

    @abstractmethod
    def load_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The record of each key, or None."""

    @abstractmethod
    def store_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """Stores ``(key, record)`` pairs (overwriting is allowed)."""

    @abstractmethod
    def evict_many(self, keys: Sequence[bytes]) -> None:
        """Forgets the keys (absent ones are ignored)."""

    def contains(self, key: bytes) -> bool:
        return self.contains_many([key])[0]

    def load(self, key: bytes) -> bytes | None:
        return self.load_many([key])[0]

    def store(self, key: bytes, record: bytes) -> None:
        self.store_many([(key, record)])

    def evict(self, key: bytes) -> None:
        self.evict_many([key])

    def close(self) -> None:  # noqa: B027 (optional: most tiers hold nothing to release)
        """Releases connections and files (the default holds none)."""


@dataclass
class TierStats:
    """Counters of one tier since start (blocks unless named tokens), whether it is up, and
    whether it takes writes (not while down or full)."""

    name: str
    up: bool = True
    writable: bool = True
    hit_blocks: int = 0
    hit_tokens: int = 0
    miss_blocks: int = 0
    stored_blocks: int = 0
    dropped_writes: int = 0
    corrupt_blocks: int = 0
    errors: int = 0
    down_events: int = 0
    full_events: int = 0


class TierHandle:
    """A tier with its health and counters, as the chain uses it. Thread-safe: the loader and
    the writer threads call the same handle."""

    def __init__(self, tier: KVTier, retry_after: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tier = tier
        self.stats = TierStats(tier.name)
        self.retry_after = retry_after
        self._clock = clock
        self._down_until = 0.0
        self._full_until = 0.0
        self._full = False
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.tier.name

    def is_up(self) -> bool:
        """False while marked down; True again (a probe) once ``retry_after`` has passed."""
        return self.stats.up or self._clock() >= self._down_until

    def call(self, function: Callable[[], T], fallback: T) -> T:
        """``function()``, or ``fallback`` when the tier is down or ``function`` raises (which
        marks the tier down for ``retry_after`` seconds)."""
        if not self.is_up():
            return fallback
        try:
            result = function()
        except Exception as exc:  # any failure of a tier is a miss, never a failed request
            self._mark_down(exc)
            return fallback
        self._mark_up()
        return result

    def store(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Writes ``items`` and returns how many were stored: none when the tier is down or
        full, or fails (down); those before the first that found no room (full, for
        ``retry_after`` seconds)."""
        if not self.is_up() or (self._full and self._clock() < self._full_until):
            return 0
        try:
            self.tier.store_many(items)
        except TierFull as exc:
            self._mark_full(exc)
            return exc.stored
        except Exception as exc:  # any failure of a tier is a dropped write, never an error
            self._mark_down(exc)
            return 0
        self._mark_up()
        if self._full:
            with self._lock:
                self._full = False
                self.stats.writable = self.stats.up
            logger.warning("KV tier %s takes writes again", self.name)
        return len(items)

    def _mark_up(self) -> None:
        if not self.stats.up:
            with self._lock:
                self.stats.up = True
                self.stats.writable = not self._full
            logger.warning("KV tier %s is up again", self.name)

    def _mark_full(self, exc: Exception) -> None:
        with self._lock:
            self.stats.errors += 1
            self._full_until = self._clock() + self.retry_after
            if not self._full:
                self._full = True
                self.stats.writable = False
                self.stats.full_events += 1
                logger.warning(
                    "KV tier %s is %s (%s); its writes stop for %.0f s, its lookups go on",
                    self.name, getattr(exc, "reason", "full"), exc, self.retry_after)

    def _mark_down(self, exc: Exception) -> None:
        with self._lock:
            self.stats.errors += 1
            self._down_until = self._clock() + self.retry_after
            if self.stats.up:
                self.stats.up = False
                self.stats.writable = False
                self.stats.down_events += 1
                logger.warning(
                    "KV tier %s is down (%s: %s); retrying in %.0f s", self.name,
                    type(exc).__name__, exc, self.retry_after)

    def count(self, field: str, n: int) -> None:
        with self._lock:
            setattr(self.stats, field, getattr(self.stats, field) + n)


@dataclass
class FetchedRun:
    """Consecutive blocks taken from one tier: its index in the chain and their payloads."""

    tier: int
    payloads: list[memoryview]


class TierChain:
    """The tiers below the pool, in lookup order (disk before Redis, say)."""

    def __init__(self, tiers: Sequence[KVTier], retry_after: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.handles = [TierHandle(t, retry_after, clock) for t in tiers]

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.handles]

    def fetch(self, keys: Sequence[bytes], token_ids: Sequence[Sequence[int]],
              payload_size: int) -> list[FetchedRun]:
        """The longest run of blocks at the start of ``keys`` that the tiers give, as runs per
        tier (see the module's rules). ``token_ids[i]`` are block i's tokens."""
        runs: list[FetchedRun] = []
        i = 0
        while i < len(keys):
            run = self._fetch_run(keys, token_ids, payload_size, i)
            if run is None:
                break
            runs.append(run)
            i += len(run.payloads)
        return runs

    def _fetch_run(self, keys: Sequence[bytes], token_ids: Sequence[Sequence[int]],
                   payload_size: int, start: int) -> FetchedRun | None:
        """The longest run from ``start`` given by the first tier that has block ``start``."""
        rest = keys[start:]
        for index, handle in enumerate(self.handles):
            tier = handle.tier
            present: list[bool] = handle.call(partial(tier.contains_many, rest), [])
            length = next((j for j, p in enumerate(present) if not p), len(present))
            if length == 0:
                continue
            wanted = rest[:length]
            records: list[bytes | None] = handle.call(partial(tier.load_many, wanted), [])
            payloads = self._valid_prefix(handle, wanted, records, token_ids[start:], payload_size)
            if payloads:
                handle.count("hit_blocks", len(payloads))
                return FetchedRun(index, payloads)
        for handle in self.handles:
            handle.count("miss_blocks", 1)
        return None

    @staticmethod
    def _valid_prefix(handle: TierHandle, keys: Sequence[bytes], records: Sequence[bytes | None],
                      token_ids: Sequence[Sequence[int]], payload_size: int) -> list[memoryview]:
        """The payloads of the leading valid records; a present but bad record is counted as
        corrupt and evicted from its tier."""
        payloads: list[memoryview] = []
        for key, record, tokens in zip(keys, records, token_ids, strict=False):
            payload = decode_record(record, tokens, payload_size)
            if payload is None:
                if record is not None:
                    handle.count("corrupt_blocks", 1)
                    handle.call(partial(handle.tier.evict_many, [key]), None)
                break
            payloads.append(payload)
        return payloads

    def store(self, items: Sequence[tuple[bytes, bytes]], tiers: Sequence[int] | None = None
              ) -> None:
        """Writes records to the given tiers (default: all); a tier that is down, full or fails
        drops them (counted)."""
        for index in range(len(self.handles)) if tiers is None else tiers:
            handle = self.handles[index]
            stored = handle.store(items)
            handle.count("stored_blocks", stored)
            handle.count("dropped_writes", len(items) - stored)

    def count_dropped(self, n: int) -> None:
        """``n`` blocks that were never handed to the tiers (the write queue was full)."""
        for handle in self.handles:
            handle.count("dropped_writes", n)

    def snapshot(self) -> tuple[TierStats, ...]:
        """A copy of every tier's counters."""
        return tuple(TierStats(**vars(h.stats)) for h in self.handles)

    def close(self) -> None:
        for handle in self.handles:
            handle.call(handle.tier.close, None)
