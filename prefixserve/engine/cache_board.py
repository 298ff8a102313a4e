"""What the prefix cache did for recent requests: the console's cache view and its what-if.

``CacheBoard.finished(request, chain)`` is called for every sequence the engine releases
(finished or aborted) that was admitted, with the request's block-hash chain. It keeps, in
bounded memory and without any token or text:

* **a request log**: for the last ``log_size`` sequences, arrival time, prompt and output
  lengths and the hash values of the prompt's full blocks as 63-bit ints: exactly a
  ``mooncake`` trace of ``block_size``-token blocks (``request_log``), which ``prefixserve
  estimate`` replays (the console's what-if runs it on this log);
* **counts per namespace** (cache salt and adapter: a tenant's key, a client's ``cache_salt``,
  a LoRA adapter each keep blocks of their own): sequences, prompt tokens, prompt tokens from
  the cache;
* **the hottest prefixes**: a prefix is the longest run of cached blocks a sequence started
  from, named by the hash value of its last block (chained hashes: equal value, equal prefix);
  for each, its length, hits, last use, namespace and where its last hit came from (the KV pool
  or a tier). At most ``max_prefixes`` are kept, the least recently used dropped first.

``view(pool, running)`` (on the engine's thread) adds the pool's blocks by state and each
namespace's cached blocks; a block counts for the namespace of the last released or running
sequence whose chain held it (a chain's hash values include the salt and the adapter, so one
hash value belongs to one namespace). Labels of hash values the pool no longer caches are
dropped whenever they outnumber twice the pool's blocks, so the board stays bounded whether or
not anyone looks at it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from prefixserve.core.block_pool import BlockPool
from prefixserve.core.hashing import hash_value_of
from prefixserve.engine.request import Request

Namespace = tuple[str | None, str | None]
"""``(cache_salt, adapter)``; ``(None, None)`` is the shared namespace of the base model."""

DEFAULT_LOG_SIZE = 10_000
DEFAULT_MAX_PREFIXES = 1_000
_ID_MASK = (1 << 63) - 1


def trace_id(value: Any) -> int:
    """A block hash value as a non-negative 63-bit int (a trace's ``hash_ids`` entry): the
    first 8 bytes of a digest, an int hash masked."""
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(value[:8], "big") & _ID_MASK
    if isinstance(value, int):
        return value & _ID_MASK
    return hash(value) & _ID_MASK


@dataclass(slots=True)
class NamespaceCounts:
    sequences: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prompt_blocks: int = 0
    """Full blocks of the prompts (the blocks looked up)."""
    cached_blocks: int = 0
    """Of those, the blocks found in the cache."""
    blocks: int = 0
    """Cached blocks now (filled in by ``view``)."""


@dataclass(slots=True)
class HotPrefix:
    hash_id: int
    num_tokens: int
    namespace: Namespace
    hits: int = 0
    last_use: float = 0.0
    source: str = "pool"
    """Where the last hit's blocks came from: ``pool`` or a tier's name."""
    in_pool: bool = False
    """Whether the prefix's last block is cached in the pool now (filled in by ``view``)."""
    value: Hashable = None
    """The last block's hash value, as the pool's map is keyed."""


@dataclass(slots=True)
class LoggedRequest:
    arrival: float
    prompt_tokens: int
    output_tokens: int
    hash_ids: list[int]
    namespace: Namespace


@dataclass
class BoardView:
    """A snapshot for the console: blocks by state, namespaces, prefixes (hottest first)."""

    block_size: int
    total_blocks: int
    running_blocks: int
    cached_blocks: int
    empty_blocks: int
    pinned_blocks: int
    namespaces: dict[Namespace, NamespaceCounts] = field(default_factory=dict)
    prefixes: list[HotPrefix] = field(default_factory=list)
    logged_requests: int = 0


class CacheBoard:
    """The request log, namespace counts and hot prefixes (module docstring). Not
    thread-safe: the engine's thread calls every method."""

    def __init__(self, block_size: int, log_size: int = DEFAULT_LOG_SIZE,
                 max_prefixes: int = DEFAULT_MAX_PREFIXES, pool: BlockPool | None = None
                 ) -> None:
        if log_size < 0 or max_prefixes < 0:
            raise ValueError("log_size and max_prefixes must be at least 0")
        self.block_size = block_size
        self.pool = pool
        """The pool whose cached hash values bound the namespace labels (None: only ``view``
        prunes them)."""
        self.max_prefixes = max_prefixes
        self.log: deque[LoggedRequest] = deque(maxlen=log_size)
        self.namespaces: dict[Namespace, NamespaceCounts] = {}
        self.prefixes: OrderedDict[int, HotPrefix] = OrderedDict()
        self._owner: dict[Hashable, Namespace] = {}

    def finished(self, request: Request, chain: Sequence[Any] | None, now: float) -> None:
        """Notes a released sequence (one that was never admitted is ignored)."""
        cached = request.num_cached_tokens
        if cached < 0:
            return
        namespace = namespace_of(request)
        counts = self.namespaces.get(namespace)
        if counts is None:
            counts = self.namespaces[namespace] = NamespaceCounts()
        counts.sequences += 1
        counts.prompt_tokens += request.num_prompt_tokens
        counts.cached_tokens += cached
        counts.prompt_blocks += request.num_prompt_tokens // self.block_size
        counts.cached_blocks += cached // self.block_size
        values = [hash_value_of(h) for h in chain or ()]
        self._label(values, namespace)
        prompt_blocks = values[:request.num_prompt_tokens // self.block_size]
        if self.log.maxlen:
            self.log.append(LoggedRequest(request.metrics.arrival_time, request.num_prompt_tokens,
                                          len(request.output_token_ids),
                                          [trace_id(v) for v in prompt_blocks], namespace))
        hit_blocks = min(cached // self.block_size, len(prompt_blocks))
        if hit_blocks and self.max_prefixes:
            self._hit(prompt_blocks[hit_blocks - 1], hit_blocks * self.block_size,
                      namespace, now, _source(request))

    def _label(self, values: Sequence[Hashable], namespace: Namespace) -> None:
        owner = self._owner
        for value in values:
            owner[value] = namespace
        if self.pool is not None:
            self._prune(self.pool)

    def _prune(self, pool: BlockPool) -> None:
        """Drops the labels of hash values no longer cached once they outnumber twice the
        pool's blocks (a pass over the labels each time their number doubles)."""
        if len(self._owner) > 2 * len(pool.blocks):
            cached = pool.cached_block_hash_to_block
            self._owner = {v: ns for v, ns in self._owner.items() if v in cached}

    def _hit(self, value: Hashable, num_tokens: int, namespace: Namespace, now: float,
             source: str) -> None:
        hash_id = trace_id(value)
        prefix = self.prefixes.pop(hash_id, None)
        if prefix is None:
            prefix = HotPrefix(hash_id, num_tokens, namespace, value=value)
        prefix.hits += 1
        prefix.last_use = now
        prefix.source = source
        self.prefixes[hash_id] = prefix
        while len(self.prefixes) > self.max_prefixes:
            self.prefixes.popitem(last=False)

    def view(self, pool: BlockPool, running: Sequence[tuple[Request, Sequence[Any]]],
             num_pinned: int, top: int = 20) -> BoardView:
        """The snapshot: ``running`` pairs each running sequence with its chain."""
        for request, chain in running:
            self._label([hash_value_of(h) for h in chain], namespace_of(request))
        in_use = cached = empty = 0
        for block in pool.blocks:
            if block.is_null:
                continue
            if block.ref_cnt > 0:
                in_use += 1
            elif block.block_hash is not None:
                cached += 1
            else:
                empty += 1
        view = BoardView(self.block_size, in_use + cached + empty, in_use, cached, empty,
                         num_pinned, logged_requests=len(self.log))
        self._count_blocks(pool, view)
        cached_values = pool.cached_block_hash_to_block
        hottest = sorted(self.prefixes.values(), key=lambda p: (-p.hits, -p.last_use))[:top]
        for prefix in hottest:
            view.prefixes.append(replace(prefix, in_pool=prefix.value in cached_values))
        return view

    def _count_blocks(self, pool: BlockPool, view: BoardView) -> None:
        """Each namespace's cached blocks."""
        cached_values = pool.cached_block_hash_to_block
        counts = {ns: replace(c, blocks=0) for ns, c in self.namespaces.items()}
        owner = self._owner
        for value in cached_values:
            namespace = owner.get(value)
            if namespace is not None:
                counts.setdefault(namespace, NamespaceCounts()).blocks += 1
        self._prune(pool)
        view.namespaces = counts

    def request_log(self) -> list[dict[str, Any]]:
        """The log as mooncake trace records of ``block_size``-token blocks, oldest arrival
        first (``timestamp`` in ms)."""
        return [{"timestamp": round(entry.arrival * 1000, 3),
                 "input_length": entry.prompt_tokens, "output_length": entry.output_tokens,
                 "hash_ids": entry.hash_ids, "block_size": self.block_size}
                for entry in sorted(self.log, key=lambda e: e.arrival)]


def namespace_of(request: Request) -> Namespace:
    """The namespace a request's blocks are cached in."""
    return (request.cache_salt, None if request.lora_id is None else str(request.lora_id))


def _source(request: Request) -> str:
    """Where most of a sequence's cached tokens came from: ``pool`` or a tier's name."""
    by_tier = request.num_cached_tokens_by_tier
    if not by_tier:
        return "pool"
    return max(by_tier.items(), key=lambda item: item[1])[0]
