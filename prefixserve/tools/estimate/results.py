"""The figures ``prefixserve estimate`` produces: the replay settings, one ``CacheResult`` per
cache and the whole ``Estimate``. ``estimate`` computes them and ``report`` shows them;
both take the types from here, so the report never imports the estimator (which imports the
report, when it runs, to print)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from prefixserve.tools.trace_formats import Workload


@dataclass(frozen=True)
class ReplaySettings:
    """``warmup_requests``: requests replayed before the figures start counting;
    ``window``: requests in the rolling hit rate; ``concurrency``: resident requests;
    ``group_windows``: the KV cache groups of a model with sliding windows (replayed through
    the hybrid manager, :mod:`prefixserve.tools.estimate.hybrid`), None for full attention.
    Explicit caching (docs/explicit-caching.md): ``pin_top`` pins the prefixes up to the K most
    reused blocks when first computed (within ``max_pinned_fraction`` of the pool); ``ttl``
    gives every request without a retention of its own a whole-prompt retention of
    ``ttl_priority`` for ``ttl`` seconds (trace time; one second a request without times).
    ``tier_capacity``: blocks of a second cache tier below each pool (None: no tier)."""

    concurrency: int = 1
    warmup_requests: int = 0
    window: int = 1000
    group_windows: tuple[int | None, ...] | None = None
    pin_top: int = 0
    ttl: float | None = None
    ttl_priority: int = 80
    max_pinned_fraction: float = 0.5
    tier_capacity: int | None = None


@dataclass
class CacheResult:
    """The figures of one cache (``capacity_blocks`` None: the infinite cache).

    Counts cover the measured requests (after the warm-up); ``replayed_blocks`` and ``seconds``
    cover the whole replay; ``rolling`` holds ``(requests replayed, rolling block hit rate)``."""

    capacity_blocks: int | None
    requests: int = 0
    requests_with_hit: int = 0
    requests_too_large: int = 0
    query_blocks: int = 0
    hit_blocks: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    replayed_blocks: int = 0
    seconds: float = 0.0
    distinct_blocks: int | None = None
    rolling: list[tuple[int, float]] = field(default_factory=list)
    tier_hit_blocks: int = 0
    tier_hit_tokens: int = 0
    """Blocks and tokens found in the second tier past the pool's hit (``--tier-capacity``);
    not part of ``hit_blocks`` / ``hit_tokens``, which count the pool's own."""

    @property
    def infinite(self) -> bool:
        return self.capacity_blocks is None

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.query_blocks if self.query_blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def speedup_bound(self) -> float:
        """1/(1-h) with h the token hit rate: the most prefill can speed up
        (docs/prefix-cache.md section 5)."""
        miss = 1.0 - self.token_hit_rate
        return 1.0 / miss if miss > 0 else math.inf

    @property
    def tier_token_hit_rate(self) -> float:
        """Tokens from the second tier / prompt tokens."""
        return self.tier_hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def hit_request_share(self) -> float:
        return self.requests_with_hit / self.requests if self.requests else 0.0


@dataclass
class Estimate:
    """Everything the report shows: the workload, the settings and one result per cache
    (finite pools in ascending size, the infinite cache last)."""

    workload: Workload
    settings: ReplaySettings
    warmup_fraction: float
    results: list[CacheResult]
    read_seconds: float
    replay_seconds: float
    jobs: int
    peak_rss_mib: float
    worker_peak_rss_mib: float
    kv_bytes_per_token: int | None = None
    lora: list[Any] | None = None
    """Per-LoRA figures (``lora.LoRAFigures``) when the log names LoRA ids."""

    @property
    def infinite(self) -> CacheResult:
        return self.results[-1]

    @property
    def finite(self) -> list[CacheResult]:
        return self.results[:-1]

    @property
    def replayed_blocks(self) -> int:
        """Block lookups of all replays together."""
        return sum(r.replayed_blocks for r in self.results)
