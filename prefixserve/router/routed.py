"""What a router remembers of its own decisions until the replicas' reports catch up.

A replica reports the blocks it stores (KV events) a few times a second while idle, but a busy
replica's report can lag its requests by seconds, and a request queued at a replica computes its
prefix only when it starts. So a prefix a router has sent to a replica counts as cached there
(as SGLang's router inserts a routed prompt into its tree at once) until that replica has reported
what it holds after the request finished: from then on the cache index, fed by that report, is the
truth (the blocks stored, or already evicted). A request that never finishes in the router's
view (cancelled before it was sent) is forgotten ``limit_s`` after it was routed.

Two clocks: ``now`` is the router's monotonic clock (routing, the limit); ``at`` is wall time,
compared between the router (a request finished) and a replica (when a report's events were
read), so on several hosts a clock skew shifts when a memory ends by that much.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence

ROUTED_LIMIT_S = 60.0
"""Seconds a routed prefix is remembered at most (its request never finished)."""

MAX_PREFIXES = 200_000
"""Block hash values remembered before the memory starts afresh."""

MAX_FINISHED = 100_000
"""Finished requests remembered (the oldest are forgotten first)."""


class RoutedPrefixes:
    """The prefixes a router sent where, each remembered until its replica's report confirms
    or denies it (see the module docstring)."""

    __slots__ = ("_by_hash", "_finished", "_reported", "limit_s")

    def __init__(self, limit_s: float = ROUTED_LIMIT_S) -> None:
        self.limit_s = limit_s
        self._by_hash: dict[Hashable, tuple[str, float, str]] = {}
        """Block hash value -> (replica, when routed, request id) of its latest routing."""
        self._finished: dict[str, float] = {}
        """Request id -> wall time it finished."""
        self._reported: dict[str, float] = {}
        """Replica -> wall time its latest report absorbed read its events."""

    def routed(self, hash_values: Sequence[Hashable], replica: str, request_id: str,
               now: float) -> None:
        """A request whose prompt has the chain ``hash_values`` was sent to ``replica``."""
        if len(self._by_hash) + len(hash_values) > MAX_PREFIXES:
            self._by_hash.clear()
        entry = (replica, now, request_id)
        for value in hash_values:
            self._by_hash[value] = entry

    def finished(self, request_id: str, at: float) -> None:
        """Request ``request_id`` ended (answered, failed or cancelled) at wall time ``at``."""
        self._finished[request_id] = at
        while len(self._finished) > MAX_FINISHED:
            del self._finished[next(iter(self._finished))]

    def reported(self, replica: str, at: float) -> None:
        """The index has applied a report of ``replica`` whose events were read at ``at``."""
        self._reported[replica] = max(at, self._reported.get(replica, at))

    def reported_at(self, replica: str) -> float | None:
        """Wall time at which ``replica``'s latest applied report read its events (None before
        its first): a prefix whose request finished earlier is the index's alone."""
        return self._reported.get(replica)

    def forget(self, replica: str) -> None:
        """``replica`` is gone: what it reported goes (entries naming it are never matched, as
        routing only offers live replicas)."""
        self._reported.pop(replica, None)

    def matched(self, hash_values: Sequence[Hashable], replicas: Collection[str],
                now: float) -> dict[str, int]:
        """The deepest remembered prefix of ``hash_values`` on one of ``replicas``: {replica:
        leading blocks}, or {}."""
        for depth in range(len(hash_values), 0, -1):
            entry = self._by_hash.get(hash_values[depth - 1])
            if entry is not None and entry[0] in replicas and self._remembered(entry, now):
                return {entry[0]: depth}
        return {}

    def _remembered(self, entry: tuple[str, float, str], now: float) -> bool:
        replica, routed_at, request_id = entry
        if now - routed_at >= self.limit_s:
            return False
        done = self._finished.get(request_id)
        return done is None or self._reported.get(replica, float("-inf")) < done
