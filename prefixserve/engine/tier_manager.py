"""The engine's side of the cache tiers: finding a request's blocks below the pool, loading them
into pool blocks, and writing blocks out, with the tier I/O in two threads of its own.

The engine thread calls, around each step (docs/tiers.md):

* ``admit(request)`` instead of ``Scheduler.add_request``: when the pool does not hold the whole
  prompt, the rest of the chain goes to the **loader thread**, which asks the tiers
  (``TierChain.fetch``) and reads the records; meanwhile the request waits outside the
  scheduler, so other requests' steps never wait for it.
* ``apply_loads()`` at the start of a step: for each finished fetch, takes fresh pool blocks,
  copies the payloads into their KV, registers them under their chain hashes and frees them
  (cached, at the LRU tail), then queues the request: its lookup now hits them like any pool
  block. Which tier each loaded block came from is kept on the request
  (``Request.tier_origin``) to split its cached tokens by tier.
* ``before_execute()`` after scheduling: in write-back mode, copies out the blocks that the step's
  allocations evicted from the pool, before the step overwrites them.
* ``after_execute(scheduled)``: the blocks that became full and computed in this step are
  copied out (write-through) or marked for write-back; only for sequences whose prompt has at
  least ``min_prefix_tokens`` tokens.

Copies out of the KV tensor happen in the engine thread (the block may be reused right after);
encoding and writing happen in the **writer thread**, whose queue is bounded in bytes: when it
is full, blocks are dropped (counted), never waited for.

Per-block state (``_state``, one byte per pool block, for its current content): ``_NONE`` (not
known to the tiers), ``_DIRTY`` (to be written when evicted) or ``_IN_TIER`` (written, or loaded
from a tier).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from prefixserve.core import KVCacheManager
from prefixserve.core.hashing import hash_value_of
from prefixserve.core.tiers import (
    FetchedRun,
    KVTier,
    TierChain,
    TierStats,
    encode_record,
    tier_key,
)
from prefixserve.engine.config import EngineConfig, parse_memory
from prefixserve.engine.request import Request, RequestStatus
from prefixserve.model.cache_paths import cache_root
from prefixserve.model.kv_transfer import (
    block_payload_size,
    gather_blocks,
    payload_of,
    scatter_blocks,
)

logger = logging.getLogger("prefixserve.tiers")

_NONE, _DIRTY, _IN_TIER = 0, 1, 2
_WAIT_S = 0.05
"""Longest wait of a step that has nothing to run but fetches in flight."""
RECORD_FORMAT = 1


def model_identity(model_path: str, dtype: torch.dtype, weights: str, block_size: int,
                   kv_shape: Sequence[int], hash_algo: str,
                   kv_cache_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """What must be equal for two processes to use each other's blocks: the model files'
    SHA-256, the activations' dtype (K/V computed in another differ), the KV cache's dtype
    (None: the activations'), the weight mode, the block size, the KV layout per block and
    the chain's hash algorithm (and the PYTHONHASHSEED the builtin hash depends on)."""
    return {
        "model_sha256": _files_digest(model_path),
        "dtype": str(dtype).removeprefix("torch."),
        "kv_cache_dtype": str(kv_cache_dtype or dtype).removeprefix("torch."),
        "weights": weights,
        "block_size": block_size,
        "kv_layout": [int(kv_shape[0]), int(kv_shape[1]), int(kv_shape[3]), int(kv_shape[4])],
        "hash_algo": hash_algo,
        "hash_seed": os.environ.get("PYTHONHASHSEED") if hash_algo == "builtin" else None,
        "record_format": RECORD_FORMAT,
    }


def namespace_of(identity: dict[str, Any]) -> bytes:
    """16 bytes naming a model identity (the prefix of every tier key)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).digest()[:16]


def chain_root(namespace: bytes) -> bytes:
    """The parent of block 0 for the byte hashes (sha256, xxhash) when tiers are on: stable
    across processes (unlike the per-process ``NONE_HASH``) and different per model."""
    return hashlib.sha256(b"prefixserve tier chain root\x00" + namespace).digest()


def _files_digest(path: str) -> str:
    """SHA-256 over a model file, or over the files of a model directory (names and each
    file's SHA-256, from :func:`file_digest`)."""
    digest = hashlib.sha256()
    paths = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, name) for name in os.listdir(path)
        if os.path.isfile(os.path.join(path, name)))
    for file_path in paths:
        digest.update(os.path.basename(file_path).encode() + b"\x00")
        digest.update(bytes.fromhex(file_digest(file_path)))
    return digest.hexdigest()


def file_digest(path: str) -> str:
    """The SHA-256 of a file's bytes, read once per file version: kept in
    ``$PREFIXSERVE_CACHE_DIR/digests`` (default ``~/.cache/prefixserve/digests``) under a name
    made of the file's real path, device, inode, size and modification time, so that a start
    with tiers does not read a multi-GB model file again; a file changed in any of these is
    read again. Where the cache cannot be written the digest is computed every time."""
    st = os.stat(path)
    stamp = "\x00".join(map(str, (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size,
                                  st.st_mtime_ns)))
    entry = os.path.join(cache_root(), "digests", hashlib.sha256(stamp.encode()).hexdigest()[:32])
    try:
        with open(entry, encoding="ascii") as f:
            cached = f.read().strip()
        if len(cached) == 64:
            return cached
    except (OSError, UnicodeDecodeError):
        pass
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    value = digest.hexdigest()
    try:
        os.makedirs(os.path.dirname(entry), exist_ok=True)
        tmp = f"{entry}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="ascii") as f:
            f.write(value)
        os.replace(tmp, entry)
    except OSError:
        pass
    return value


@dataclass
class _Fetch:
    request: Request
    start: int
    keys: list[bytes]
    tokens: list[Sequence[int]]
    runs: list[FetchedRun] | None = None


@dataclass
class _Write:
    blocks: torch.Tensor | None
    keys: list[bytes]
    tokens: list[Sequence[int]]
    records: list[tuple[bytes, bytes]] | None = None
    tiers: list[int] | None = None
    nbytes: int = 0


class KVTierManager:
    """Tier lookups, loads and writes for one engine (see the module's docstring)."""

    def __init__(self, tiers: Sequence[KVTier], kv_cache_manager: KVCacheManager,
                 kv_cache: torch.Tensor, namespace: bytes, enqueue: Callable[[Request], None],
                 *, write_back: bool = False, min_prefix_tokens: int = 256,
                 retry_after: float = 10.0, write_queue_bytes: int = 512 << 20) -> None:
        if kv_cache_manager.sliding_window is not None:
            raise ValueError("the KV cache tiers support full-attention models only")
        self.chain = TierChain(tiers, retry_after)
        self.kvm = kv_cache_manager
        self.pool = kv_cache_manager.block_pool
        self.kv_cache = kv_cache
        self.block_size = kv_cache_manager.block_size
        self.namespace = namespace
        self.enqueue = enqueue
        self.write_back = write_back
        self.min_prefix_tokens = min_prefix_tokens
        self.payload_size = block_payload_size(kv_cache, self.block_size)
        self.write_queue_bytes = write_queue_bytes
        self._state = bytearray(kv_cache_manager.num_blocks)
        if write_back:
            self.pool.evicted = []
        self.pending: dict[str, Request] = {}
        self._jobs: queue.SimpleQueue[_Fetch | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[_Fetch] = queue.SimpleQueue()
        self._loaded = threading.Event()
        self._writes: queue.SimpleQueue[_Write | None] = queue.SimpleQueue()
        self._queued_bytes = 0
        self._queued_writes = 0
        self._lock = threading.Condition()
        self._closed = False
        self._loader = threading.Thread(target=self._load_loop, name="prefixserve-tier-loader",
                                        daemon=True)
        self._writer = threading.Thread(target=self._write_loop, name="prefixserve-tier-writer",
                                        daemon=True)
        self._loader.start()
        self._writer.start()
        logger.info("KV tiers: %s (%s, prefixes from %d tokens)",
                    ", ".join(self.chain.names), "write-back" if write_back else
                    "write-through", min_prefix_tokens)

    # ------------------------------------------------------------------ lookups and loads
    @property
    def has_pending(self) -> bool:
        """Whether requests wait for a fetch."""
        return bool(self.pending)

    def admit(self, request: Request) -> None:
        """Queues ``request`` now, or once the tiers were asked for the blocks the pool lacks."""
        if request.wants_prompt_logprobs or not self.kvm.enable_caching:
            self.enqueue(request)
            return
        hashes = self.kvm.block_hashes(request)
        end = min((request.num_tokens - 1) // self.block_size, len(hashes))
        start = self._pool_prefix(hashes, end)
        if start >= end:
            self.enqueue(request)
            return
        wanted = hashes[start:end]
        keys = [tier_key(self.namespace, hash_value_of(h)) for h in wanted]
        tokens = [_tokens_of(h) for h in wanted]
        self.pending[request.request_id] = request
        self._jobs.put(_Fetch(request, start, keys, tokens))

    def _pool_prefix(self, hashes: Sequence[Hashable], end: int) -> int:
        """How many leading blocks of the chain the pool holds now."""
        get = self.pool.get_cached_block
        for i in range(end):
            if get(hashes[i]) is None:
                return i
        return end

    def wait_for_loads(self) -> None:
        """Waits a little for a fetch to finish (a step with nothing else to run)."""
        if self._done.empty():
            self._loaded.wait(_WAIT_S)

    def apply_loads(self) -> None:
        """Puts the finished fetches' blocks into the pool and queues their requests."""
        self._loaded.clear()
        while True:
            try:
                fetch = self._done.get_nowait()
            except queue.Empty:
                return
            request = fetch.request
            self.pending.pop(request.request_id, None)
            if request.status is RequestStatus.FINISHED:  # aborted while it waited
                continue
            if fetch.runs:
                self._insert(request, fetch.start, fetch.runs)
            self.enqueue(request)

    def _insert(self, request: Request, start: int, runs: list[FetchedRun]) -> None:
        hashes = self.kvm.block_hashes(request)
        payloads = [p for run in runs for p in run.payloads]
        have = self._pool_prefix(hashes, start + len(payloads))
        if have < start:  # the pool lost blocks before these meanwhile: they would be unreachable
            return
        skip = have - start
        # The pool's part of the prefix is held meanwhile, so that taking blocks for the loads
        # cannot evict it (its blocks are often the least recently used ones).
        prefix = [self.pool.get_cached_block(h) for h in hashes[:have]]
        held = [b for b in prefix if b is not None]
        self.pool.touch(held)
        count = min(len(payloads) - skip, self.pool.get_num_free_blocks())
        blocks = self.pool.get_new_blocks(count) if count > 0 else []
        self.before_execute()  # write back what taking them evicted, before it is overwritten
        ids = [b.block_id for b in blocks]
        scatter_blocks(self.kv_cache, self.block_size, ids, payloads[skip:skip + count])
        self.pool.cache_full_blocks(blocks, hashes[have:have + count], 0, count)
        for block_id in ids:
            self._state[block_id] = _IN_TIER
        self.pool.free_blocks(reversed([*held, *blocks]))  # tail first, as the manager frees
        if count <= 0:
            return
        origin, first = [], start
        for run in runs:
            last = first + len(run.payloads)
            lo, hi = max(first, have), min(last, have + count)
            if hi > lo:
                origin.append((lo, hi, self.chain.handles[run.tier].name))
            first = last
        request.tier_origin = origin

    def _load_loop(self) -> None:
        while (fetch := self._jobs.get()) is not None:
            try:
                fetch.runs = self.chain.fetch(fetch.keys, fetch.tokens, self.payload_size)
                self._promote(fetch)
            except Exception:  # never lose the request: it runs without the tiers
                logger.exception("KV tier fetch failed")
                fetch.runs = None
            self._done.put(fetch)
            self._loaded.set()

    def _promote(self, fetch: _Fetch) -> None:
        """Blocks found in a lower tier are written to the tiers above it."""
        assert fetch.runs is not None
        first = 0
        for run in fetch.runs:
            if run.tier > 0:
                records = [(fetch.keys[first + j], encode_record(fetch.tokens[first + j], p))
                           for j, p in enumerate(run.payloads)]
                self._queue(_Write(None, [], [], records, list(range(run.tier)),
                                   sum(len(r) for _, r in records)))
            first += len(run.payloads)

    # ------------------------------------------------------------------ writes
    def before_execute(self) -> None:
        """Write-back: copies out the evicted blocks marked dirty (their KV is still intact)."""
        evicted = self.pool.evicted
        if not evicted:
            return
        ids: list[int] = []
        hashes: list[Hashable] = []
        for block_id, block_hash in evicted:
            if self._state[block_id] == _DIRTY:
                ids.append(block_id)
                hashes.append(block_hash)
            self._state[block_id] = _NONE
        evicted.clear()
        if ids:
            self._submit(ids, hashes)

    def after_execute(self, requests: Sequence[Request]) -> None:
        """Splits new hits by tier, and writes (or marks) the blocks the step filled."""
        ids: list[int] = []
        hashes: list[Hashable] = []
        for request in requests:
            if request.num_cached_tokens_by_tier is None and request.num_cached_tokens >= 0:
                self._attribute(request)
            full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
            if full > request.tier_blocks_seen:
                self._note_full_blocks(request, full, ids, hashes)
        if ids:
            self._submit(ids, hashes)

    def _note_full_blocks(self, request: Request, full: int, ids: list[int],
                          hashes: list[Hashable]) -> None:
        first, request.tier_blocks_seen = request.tier_blocks_seen, full
        hits = max(request.num_cached_tokens, 0) // self.block_size
        eligible = request.num_prompt_tokens >= self.min_prefix_tokens
        chain = self.kvm.block_hashes(request, full)
        state = self._state
        for i in range(first, min(full, len(chain), len(request.block_ids))):
            block_id = request.block_ids[i]
            if i >= hits:  # computed by this request: new content
                state[block_id] = _NONE
            if eligible and state[block_id] == _NONE:
                if self.write_back:
                    state[block_id] = _DIRTY
                else:
                    state[block_id] = _IN_TIER
                    ids.append(block_id)
                    hashes.append(chain[i])

    def _attribute(self, request: Request) -> None:
        hit_blocks = request.num_cached_tokens // self.block_size
        split = {"pool": 0, **{name: 0 for name in self.chain.names}}
        for lo, hi, name in request.tier_origin:
            tokens = max(0, min(hi, hit_blocks) - lo) * self.block_size
            split[name] += tokens
        for handle in self.chain.handles:
            if split[handle.name]:
                handle.count("hit_tokens", split[handle.name])
        split["pool"] = request.num_cached_tokens - sum(split.values())
        request.num_cached_tokens_by_tier = split

    def _submit(self, ids: list[int], hashes: list[Hashable]) -> None:
        blocks = gather_blocks(self.kv_cache, self.block_size, ids)
        keys = [tier_key(self.namespace, hash_value_of(h)) for h in hashes]
        self._queue(_Write(blocks, keys, [_tokens_of(h) for h in hashes],
                           nbytes=blocks.numel() * blocks.element_size()))

    def _queue(self, write: _Write) -> None:
        """Hands a write to the writer thread, or drops it when its queue is full."""
        with self._lock:
            if self._queued_bytes + write.nbytes > self.write_queue_bytes or self._closed:
                full = True
            else:
                full = False
                self._queued_bytes += write.nbytes
                self._queued_writes += 1
        if full:
            self.chain.count_dropped(len(write.keys) or len(write.records or ()))
            return
        self._writes.put(write)

    def _write_loop(self) -> None:
        while (write := self._writes.get()) is not None:
            try:
                records = write.records
                if records is None:
                    assert write.blocks is not None
                    records = [(key, encode_record(tokens, payload_of(write.blocks, j)))
                               for j, (key, tokens) in enumerate(zip(write.keys, write.tokens,
                                                                     strict=True))]
                self.chain.store(records, write.tiers)
            except Exception:
                logger.exception("KV tier write failed")
            finally:
                with self._lock:
                    self._queued_bytes -= write.nbytes
                    self._queued_writes -= 1
                    self._lock.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until the writes queued so far are done; returns whether they are. (A lookup
        does not see a block whose write is still queued: it is a miss, and computed.)"""
        with self._lock:
            return self._lock.wait_for(lambda: self._queued_writes == 0, timeout)

    # ------------------------------------------------------------------ the end
    def stats(self) -> tuple[TierStats, ...]:
        return self.chain.snapshot()

    def close(self, timeout: float = 60.0) -> None:
        """Writes back what is dirty, waits (up to ``timeout``) for the writes queued, and
        stops the threads. Later calls do nothing."""
        if self._closed:
            return
        if self.write_back:
            dirty = [b for b in self.pool.blocks
                     if b.block_hash is not None and self._state[b.block_id] == _DIRTY]
            for i in range(0, len(dirty), 64):
                part = dirty[i:i + 64]
                self._submit([b.block_id for b in part], [b.block_hash for b in part])
        with self._lock:
            self._closed = True
        self._jobs.put(None)
        self._writes.put(None)
        self._writer.join(timeout)
        self._loader.join(1.0)
        self.chain.close()


def _tokens_of(block_hash: Hashable) -> Sequence[int]:
    """The token ids of a computed block hash ``(value, tokens, extras)``."""
    assert type(block_hash) is tuple
    return block_hash[1]


def open_tiers(config: EngineConfig, namespace: bytes) -> list[KVTier]:
    """The configured tiers in lookup order: disk, then Redis."""
    tiers: list[KVTier] = []
    if config.kv_disk_dir:
        from prefixserve.tiers.disk import DiskTier

        tiers.append(DiskTier(config.kv_disk_dir, namespace.hex(),
                              parse_memory(config.kv_disk_size)))
    if config.kv_redis_url:
        from prefixserve.tiers.redis import RedisTier

        budget = config.kv_redis_max_memory
        tiers.append(RedisTier(config.kv_redis_url, config.kv_redis_ttl, config.kv_tier_timeout,
                               None if budget is None else parse_memory(budget)))
    return tiers


def tier_hash_root(config: EngineConfig, namespace: bytes) -> bytes | None:
    """The chain root with tiers: ``chain_root`` for the byte hashes; None (the builtin root,
    stable under a fixed PYTHONHASHSEED) for the builtin hash."""
    return None if config.hash_algo == "builtin" else chain_root(namespace)


def make_tier_manager(config: EngineConfig, namespace: bytes, kvm: KVCacheManager,
                      kv_cache: torch.Tensor, enqueue: Callable[[Request], None]
                      ) -> KVTierManager:
    """The tier manager of ``config``'s tiers."""
    return KVTierManager(open_tiers(config, namespace), kvm, kv_cache, namespace, enqueue,
                         write_back=config.kv_tier_write_policy == "back",
                         min_prefix_tokens=config.kv_tier_min_prefix_tokens,
                         retry_after=config.kv_tier_retry_after,
                         write_queue_bytes=parse_memory(config.kv_tier_write_queue))
