"""Prefix-cache statistics: per-step deltas, cumulative counters and a rolling hit rate."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class PrefixCacheStats:
    """What the cache saw since the last ``make_prefix_cache_stats`` call.

    ``queries``/``hits`` count blocks (full blocks of each looked-up request / blocks found);
    ``query_tokens``/``hit_tokens`` count tokens (request lengths / tokens served from the
    cache). ``reset`` says the prefix cache was reset during the step. ``retained_hits`` counts
    hit blocks by priority level for the levels other than the default (empty until some
    request or pin used retention)."""

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    retained_hits: dict[int, int] = field(default_factory=dict)


class PrefixCachingMetrics:
    """Cumulative counters (never reset) plus a hit rate over the most recent requests.

    The rolling window is a FIFO of per-step stats: each observed step is appended, and the oldest
    steps are dropped once the requests they hold exceed ``max_recent_requests``. A cache reset
    clears the window (old hits no longer predict anything) but never the counters."""

    __slots__ = ("_window", "_window_hits", "_window_queries", "_window_requests",
                 "hit_tokens", "hits", "max_recent_requests", "queries", "query_tokens",
                 "requests", "retained_hits")

    def __init__(self, max_recent_requests: int = 1000) -> None:
        self.max_recent_requests = max_recent_requests
        self.requests = 0
        self.queries = 0
        self.hits = 0
        self.query_tokens = 0
        self.hit_tokens = 0
        self.retained_hits: dict[int, int] = {}
        self._window: deque[tuple[int, int, int]] = deque()
        self._window_requests = 0
        self._window_queries = 0
        self._window_hits = 0

    def observe(self, stats: PrefixCacheStats) -> None:
        if stats.reset:
            self._window.clear()
            self._window_requests = self._window_queries = self._window_hits = 0
        self.requests += stats.requests
        self.queries += stats.queries
        self.hits += stats.hits
        self.query_tokens += stats.query_tokens
        self.hit_tokens += stats.hit_tokens
        for priority, hits in stats.retained_hits.items():
            self.retained_hits[priority] = self.retained_hits.get(priority, 0) + hits
        if stats.requests == 0:
            return
        self._window.append((stats.requests, stats.queries, stats.hits))
        self._window_requests += stats.requests
        self._window_queries += stats.queries
        self._window_hits += stats.hits
        while self._window_requests > self.max_recent_requests and len(self._window) > 1:
            requests, queries, hits = self._window.popleft()
            self._window_requests -= requests
            self._window_queries -= queries
            self._window_hits -= hits

    @property
    def hit_rate(self) -> float:
        """Blocks hit / blocks queried over the recent window (0.0 when nothing was queried)."""
        return self._window_hits / self._window_queries if self._window_queries else 0.0

    @property
    def window_requests(self) -> int:
        return self._window_requests
