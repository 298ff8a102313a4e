"""The Redis tier: block records as binary values with a TTL, shared by every server of a model.

Keys are ``prefixserve:kv:`` followed by the tier key (model namespace and chain hash value), so
servers of the same model and hash settings find each other's blocks, and other models (or other
users of the same Redis) never collide with them. Reads and writes are pipelined: one round trip
per batch (``EXISTS`` per key, ``MGET``, ``SET ... EX``). Every call has a socket timeout; a
failure raises at once (the client's own retries are off), and the chain marks the tier down.

The memory budget is Redis' own: ``max_memory`` (when given) is applied with ``CONFIG SET
maxmemory`` and ``maxmemory-policy allkeys-lru``, so Redis evicts the least recently used
blocks; a Redis that refuses ``CONFIG`` keeps its own settings (logged). A write refused for
lack of memory (``OOM``, under a ``noeviction`` policy) raises ``TierFull``: writes stop for a
while, lookups go on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from prefixserve.core.tiers import KVTier, TierFull

logger = logging.getLogger("prefixserve.tiers")

KEY_PREFIX = b"prefixserve:kv:"
_MAX_PIPELINE_BYTES = 64 << 20
"""Largest batch of values sent in one pipeline."""
_MGET_KEYS = 16
"""Keys read by one ``MGET`` (16 blocks of the default model: 5.6 MiB in bfloat16)."""


class RedisTier(KVTier):
    """Block records in the Redis at ``url``, each expiring ``ttl`` seconds after its write."""

    name = "redis"

    def __init__(self, url: str, ttl: float, timeout: float, max_memory: int | None = None
                 ) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        if ttl <= 0:
            raise ValueError(f"the Redis tier's TTL must be positive, got {ttl}")
        self.ttl = max(1, int(ttl))
        # No retries inside the client (its default retries ten times with backoff): a failed
        # call fails at once, and the chain marks the tier down and tries again later.
        self.client = redis.Redis.from_url(url, socket_timeout=timeout,
                                           socket_connect_timeout=timeout,
                                           retry=Retry(NoBackoff(), 0))
        if max_memory is not None:
            self._apply_budget(max_memory)

    def _apply_budget(self, max_memory: int) -> None:
        import redis

        try:
            self.client.config_set("maxmemory", str(max_memory))
            self.client.config_set("maxmemory-policy", "allkeys-lru")
        except redis.RedisError as exc:
            logger.warning("the Redis tier could not set its memory budget (%s); Redis keeps "
                           "its own maxmemory settings", exc)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(KEY_PREFIX + key)
        return [bool(n) for n in pipe.execute()]

    def load_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """``MGET`` in batches of ``_MGET_KEYS`` keys, so that no call waits for a whole long
        prefix at once (each call has the socket timeout)."""
        out: list[bytes | None] = []
        for i in range(0, len(keys), _MGET_KEYS):
            values = self.client.mget([KEY_PREFIX + key for key in keys[i:i + _MGET_KEYS]])
            out += [v if isinstance(v, bytes) else None for v in values]
        return out

    def store_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """``SET`` with the TTL, pipelined; a refusal for lack of memory raises ``TierFull``
        with the count of records stored before it, any other error raises as it is."""
        from redis.exceptions import OutOfMemoryError

        stored = 0
        for i, batch in enumerate(self._batches(items)):
            pipe = self.client.pipeline(transaction=False)
            for key, record in batch:
                pipe.set(KEY_PREFIX + key, record, ex=self.ttl)
            for reply in pipe.execute(raise_on_error=False):
                if isinstance(reply, OutOfMemoryError):
                    raise TierFull(f"Redis batch {i}: {reply}", stored)
                if isinstance(reply, Exception):
                    raise reply
                stored += 1

    @staticmethod
    def _batches(items: Sequence[tuple[bytes, bytes]]) -> list[Sequence[tuple[bytes, bytes]]]:
        """``items`` cut into runs of at most ``_MAX_PIPELINE_BYTES`` (a run holds at least
        one record)."""
        batches: list[Sequence[tuple[bytes, bytes]]] = []
        start = size = 0
        for end, (_, record) in enumerate(items, 1):
            size += len(record)
            if size >= _MAX_PIPELINE_BYTES:
                batches.append(items[start:end])
                start, size = end, 0
        if start < len(items):
            batches.append(items[start:])
        return batches

    def evict_many(self, keys: Sequence[bytes]) -> None:
        if keys:
            self.client.delete(*[KEY_PREFIX + key for key in keys])

    def close(self) -> None:
        self.client.close()
