"""Routing policies: which replica serves a request (docs/replicas.md item 5).

A policy sees a ``RouteRequest`` (the prompt's chain of block hash values, computed as the
replicas compute them; a session key; a LoRA adapter id) and the replicas' current loads (requests
in flight, supplied by the caller) and returns a replica id. Policies keep no reference to the
replicas themselves, so the Ray deployment and the estimator's simulation use the same code.

* ``round-robin``: replicas in turn.
* ``least-loaded``: the smallest load; ties go to the replica after the last one chosen.
* ``prefix-aware``: the replica holding the longest cached prefix of the chain, unless its load
  exceeds the least loaded one's by more than ``balance_abs`` **and** by a factor of more than
  ``balance_rel`` (then the least loaded one): the load-balance rule of SGLang's cache-aware
  router. Without any cached prefix, a LoRA request goes to the least loaded replica among those
  holding blocks of its adapter (if any is within the threshold), any other to the least loaded
  replica, ties to the one with the fewest cached blocks (the most room), then in turn.
* ``session``: the replica a session key was sent to before (while that replica exists and is
  within the load threshold); a new key is placed by ``prefix-aware``; requests without a key too.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixserve.router.index import CacheIndex

ROUTING_POLICIES = ("round-robin", "least-loaded", "prefix-aware", "session")

DEFAULT_BALANCE_ABS = 4
"""Requests in flight by which the best-cached replica may exceed the least loaded one."""

DEFAULT_BALANCE_REL = 1.5
"""Factor by which the best-cached replica's load may exceed the least loaded one's."""

BALANCE_BATCHES = 2
"""``serve --replicas``: the balance rule moves a request off its cached prefix when that
replica holds at least this many full batches (``--max-num-seqs``) more than the least loaded
one (``default_balance_abs``)."""


def default_balance_abs(slots: int) -> int:
    """``serve``'s default ``balance_abs`` for replicas of ``slots`` sequence slots: at least
    ``BALANCE_BATCHES`` x ``slots`` more requests, 63 with the default 32 (SGLang's router: 64).
    Below it a request waits beside its cached prefix. With 4 replicas of 4 slots under 16
    clients, 4-9 requests a run left their prefix at 4 (2.1-2.9 req/s), 0-2 at 7 (2.8-3.3
    req/s). At 2 x slots without the -1, a replica started after another died (2 replicas of 8
    slots, 16 clients) never got the cached prefixes' requests, since the survivor's lead can
    reach 16 but not exceed it, and throughput never came back to 90% (``chaos.py``; at 15,
    in 8 s)."""
    return BALANCE_BATCHES * slots - 1


SESSION_LIMIT = 100_000
"""Session keys remembered (the oldest are forgotten first)."""


@dataclass(frozen=True, slots=True)
class RouteRequest:
    hash_values: Sequence[Hashable] = ()
    session_key: str | None = None
    lora_id: Any = None


@dataclass(frozen=True, slots=True)
class RouteDecision:
    replica_id: str
    matched_blocks: int = 0
    reason: str = ""


@dataclass
class Router:
    """Chooses replicas under one policy; ``index`` is fed with the replicas' KV events."""

    policy: str = "prefix-aware"
    index: CacheIndex = field(default_factory=CacheIndex)
    balance_abs: int = DEFAULT_BALANCE_ABS
    balance_rel: float = DEFAULT_BALANCE_REL
    _turn: int = 0
    _sessions: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; choose one of "
                             f"{', '.join(ROUTING_POLICIES)}")
        if self.balance_abs < 0 or self.balance_rel < 1.0:
            raise ValueError("balance_abs must be >= 0 and balance_rel >= 1")

    def route(self, request: RouteRequest, loads: Mapping[str, int],
              matched: Mapping[str, int] | None = None) -> RouteDecision:
        """The replica for ``request``; ``loads`` names every replica that may be chosen.
        ``matched`` (leading blocks held per replica) replaces the index's own figures when a
        caller knows more (the Ray router adds the prefixes it routed recently)."""
        if not loads:
            raise ValueError("no replica to route to")
        replicas = sorted(loads)
        if self.policy == "round-robin":
            return RouteDecision(self._next(replicas), 0, "round-robin")
        if self.policy == "least-loaded":
            return RouteDecision(self._least_loaded(replicas, loads), 0, "least-loaded")
        if matched is None:
            matched = self.index.matched_blocks(request.hash_values) if request.hash_values \
                else {}
        if self.policy == "session" and request.session_key is not None:
            return self._session(request, replicas, loads, matched)
        return self._prefix_aware(request, replicas, loads, matched)

    def _next(self, replicas: Sequence[str]) -> str:
        choice = replicas[self._turn % len(replicas)]
        self._turn += 1
        return choice

    def _least_loaded(self, replicas: Sequence[str], loads: Mapping[str, int],
                      prefer_room: bool = False) -> str:
        """Smallest load, then (``prefer_room``) fewest cached blocks, then in turn."""
        start = self._turn % len(replicas)
        self._turn += 1
        rotated = [*replicas[start:], *replicas[:start]]
        if prefer_room:
            return min(rotated, key=lambda r: (loads[r], self.index.cached_blocks(r)))
        return min(rotated, key=lambda r: loads[r])

    def balanced(self, load: int, least: int) -> bool:
        """Whether a replica of ``load`` may still take work when the least loaded has
        ``least`` (SGLang's rule: imbalanced only when both thresholds are exceeded)."""
        return load - least <= self.balance_abs or load <= least * self.balance_rel

    def _prefix_aware(self, request: RouteRequest, replicas: Sequence[str],
                      loads: Mapping[str, int], matched: Mapping[str, int]) -> RouteDecision:
        least = min(loads[r] for r in replicas)
        best = max(replicas, key=lambda r: (matched.get(r, 0), -loads[r]))
        depth = matched.get(best, 0)
        if depth and self.balanced(loads[best], least):
            return RouteDecision(best, depth, "prefix")
        if request.lora_id is not None:
            holders = [r for r in replicas if self.index.lora_blocks(r, request.lora_id)
                       and self.balanced(loads[r], least)]
            if holders:
                return RouteDecision(self._least_loaded(holders, loads), 0, "lora")
        choice = self._least_loaded(replicas, loads, prefer_room=True)
        return RouteDecision(choice, matched.get(choice, 0),
                             "imbalanced" if depth else "least-loaded")

    def _session(self, request: RouteRequest, replicas: Sequence[str],
                 loads: Mapping[str, int], matched: Mapping[str, int]) -> RouteDecision:
        key = request.session_key
        assert key is not None
        sticky = self._sessions.get(key)
        least = min(loads[r] for r in replicas)
        if sticky is not None and sticky in loads and self.balanced(loads[sticky], least):
            return RouteDecision(sticky, 0, "session")
        decision = self._prefix_aware(request, replicas, loads, matched)
        self._sessions.pop(key, None)
        self._sessions[key] = decision.replica_id
        if len(self._sessions) > SESSION_LIMIT:
            del self._sessions[next(iter(self._sessions))]
        return decision
