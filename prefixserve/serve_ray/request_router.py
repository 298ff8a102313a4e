"""The Ray Serve request router of the engine deployment: prefixserve's ``Router`` inside Ray.

Ray Serve calls ``choose_replicas`` for each request sent through a handle of the engine
deployment, in the process that holds the handle (the ingress). The request carries its route in
the ``route`` keyword argument: the prompt's block hash values as hex (``PromptHasher``), the
session key, the LoRA adapter and, where the ingress allows it, a policy for this request only
(the others share the same index); a ``replica`` keyword pins a request to one replica (the
ingress uses it to scrape each replica's ``/metrics``).

The router's ``CacheIndex`` is fed from each replica's ``routing_stats`` (``EngineReplica.
record_routing_stats``): batches are applied in sequence order, a gap marks the replica stale
until a report brings a snapshot, and a new epoch (a restarted replica) clears it. Because the
stats arrive only every ``request_routing_stats_period_s`` (and a busy replica's reports lag its
requests by seconds), the router also remembers which replica it sent each prefix to, until
that replica's first report after the request finished (``prefixserve.router.routed``), as
SGLang's router inserts a routed prompt into its tree at once; a prefix is taken to be cached
where either says so.

Loads are the requests this router has in flight on each replica (counted from the moment it
chooses the replica, released on completion), the figure the balance rule compares; a replica
whose load has reached its ``max_ongoing_requests`` is not offered while another has room. Ray
reports a request routed (``on_request_routed``) only after its probe of the replica, so a
request chosen meanwhile counts already: otherwise a burst of new prompts all saw the same idle
replica and went there, and the next requests of those prompts found it overloaded.

``choose_replicas`` offers Ray Serve the chosen replica alone. Ray probes a candidate's queue
length before sending (0.1 s deadline) and, when the probe is late or the queue full, tries the
next rank at once; the second rank this router used to offer (the other replicas by load) thus
sent a request away from its cached prefix whenever the chosen engine was too busy to answer the
probe in time, which the ingress logged ("Failed to get queue length") in 19 of 26 test sessions
of the cluster tests. With one rank Ray asks the router again, after a backoff, and the router
decides again with the loads of that moment.

The index lives in the ingress process and is rebuilt from the replicas when that process is
replaced (Ray Serve restarts a dead ingress): a new router knows no replica's epoch, so the
first report that carries a snapshot (every ``SNAPSHOT_EVERY`` reports, about 4 s) fills the
replica's entry, and until then a replica with a gap in its batches is stale.

The index follows Ray Serve's replica set: ``update_replicas`` (every scale-up, scale-down or
replacement) adds new replicas empty and forgets gone ones, ``on_replica_actor_died`` forgets a
dead one at once; forgetting drops everything known of the replica, so no cache state of a
removed or crashed replica survives. ``state`` is the view ``GET /router/replicas`` shows, with
how many requests went to the replica first chosen for them and how many to another.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Hashable, Sequence
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from prefixserve.core.kv_events import KVEventBatch, KVSnapshot, decode_hash
from prefixserve.router import ROUTING_POLICIES, Router, RouteRequest
from prefixserve.router.routed import RoutedPrefixes

_ROUTERS: list[PrefixCacheRequestRouter] = []
"""The routers made in this process (Ray Serve makes them inside handles; the ingress asks them
which replicas run, to scrape each one's metrics). The one piece of module state here. A router
holds its handle's replicas, so the list lives as long as the process (one router per handle of
the engine deployment: a few)."""


CHOSEN_TTL_S = 10.0
"""Seconds a request chosen for a replica counts in its load before Ray reports it routed (a
request cancelled meanwhile stops counting then)."""

REMOVED_KEPT = 32
"""Ids of removed replicas a router lists in its state (the latest)."""


def known_replicas() -> list[str]:
    """Ids of the engine replicas the routers of this process know."""
    ids: set[str] = set()
    for router in _ROUTERS:
        ids.update(r.unique_id for r in router.curr_replicas)
    return sorted(ids)


def known_loras() -> dict[str, str]:
    """LoRA adapter name -> content id, as the replicas last reported them."""
    names: dict[str, str] = {}
    for router in _ROUTERS:
        for loras in router.loras.values():
            names.update(loras)
    return names


def routers_state() -> list[dict[str, Any]]:
    """What each router of this process knows (``GET /router/replicas``). It only reads: Ray
    Serve runs the routers on an event loop of their own thread, and the index changes there
    (replicas' stats are applied as requests are routed)."""
    return [router.state() for router in _ROUTERS]


class PrefixCacheRequestRouter(FIFOMixin, RequestRouter):
    """Routes by ``prefixserve.router.Router`` (policy from ``request_router_kwargs``)."""

    def initialize_state(self, policy: str = "prefix-aware", balance_abs: int = 4,
                         balance_rel: float = 1.5, **_: Any) -> None:
        self.router = Router(policy, balance_abs=balance_abs, balance_rel=balance_rel)
        self.by_policy = {name: Router(name, self.router.index, balance_abs, balance_rel)
                          for name in ROUTING_POLICIES if name != policy}
        self.by_policy[policy] = self.router
        self.in_flight: dict[str, int] = {}
        self.request_replica: dict[str, str] = {}
        self.chosen: dict[str, tuple[str, float]] = {}
        """Request id -> (replica, when) of requests chosen and not yet reported routed."""
        self.routed = RoutedPrefixes()
        self.seen_stats: dict[str, tuple[Any, Any]] = {}
        self.pids: dict[str, int] = {}
        self.loras: dict[str, dict[str, str]] = {}
        self.removed: list[str] = []
        self.first_choice: dict[str, str] = {}
        """The replica first chosen for each request not routed yet (by request id)."""
        self.choices = {"kept": 0, "changed": 0}
        """Requests routed to their first choice, and to another (chosen again after a backoff,
        the first having filled meanwhile)."""
        self.reasons: dict[str, int] = {}
        """Requests by the reason of their first choice (``RouteDecision.reason``: ``prefix``,
        ``imbalanced`` for one the balance rule moved off its cached prefix, ...)."""
        # Ray Serve pickles this class by value, with a copy of this module's globals: register
        # in the module itself, which the import system holds.
        importlib.import_module(__name__)._ROUTERS.append(self)

    # ----------------------------------------------------------------- membership
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Ray Serve's new replica set (scaled, replaced): new ones join the index empty (their
        events fill them), gone ones are forgotten with all their cache state."""
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for rid in live:
            self.router.index.add_replica(rid)
        for rid in [r for r in self.router.index.replicas if r not in live]:
            self._forget(rid)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """A replica whose process died: its cache died with it."""
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def _forget(self, rid: str) -> None:
        """Drops every trace of replica ``rid`` (index, stats, adapters; ``recent`` entries
        pointing at it are ignored, as routing only considers live replicas)."""
        if rid in self.router.index.replicas:
            self.removed = [*self.removed, rid][-REMOVED_KEPT:]
        self.router.index.remove_replica(rid)
        for table in (self.seen_stats, self.pids, self.loras, self.in_flight):
            table.pop(rid, None)
        self.routed.forget(rid)

    def state(self) -> dict[str, Any]:
        """The replicas as this router sees them: live ones (with what the index holds of each)
        and the latest removed ids."""
        index = self.router.index
        replicas = []
        for replica in sorted(self.curr_replicas, key=lambda r: r.unique_id):
            rid = replica.unique_id
            cache = index.replicas.get(rid)
            replicas.append({
                "id": rid, "pid": self.pids.get(rid), "in_flight": self.in_flight.get(rid, 0),
                "epoch": cache.epoch if cache else None, "seq": cache.seq if cache else 0,
                "stale": bool(cache and cache.stale),
                "cached_blocks": len(cache.blocks) if cache else 0,
                "reported_at": self.routed.reported_at(rid),
                "loras": sorted(self.loras.get(rid, {}))})
        return {"policy": self.router.policy, "replicas": replicas,
                "indexed": sorted(index.replicas), "removed": list(self.removed),
                "gaps": index.gaps, "restarts": index.restarts,
                "first_choice": dict(self.choices), "reasons": dict(self.reasons)}

    # ----------------------------------------------------------------- events
    def _absorb_stats(self, replica: RunningReplica) -> None:
        """Applies what the replica's latest routing stats add to the index."""
        stats = replica.routing_stats or {}
        if "epoch" not in stats:
            return
        rid = replica.replica_id.unique_id
        report = (stats["epoch"], stats.get("report"))
        if self.seen_stats.get(rid) == report:
            return
        self.seen_stats[rid] = report
        self.pids[rid] = stats.get("pid", 0)
        self.loras[rid] = dict(stats.get("loras") or {})
        index = self.router.index
        cache = index.add_replica(rid)
        if cache.epoch != stats["epoch"] and "snapshot" in stats:
            index.resync(KVSnapshot.from_wire(stats["snapshot"]))
        for wire in stats.get("batches", ()):
            index.apply(KVEventBatch.from_wire(wire))
        if index.needs_resync(rid) and "snapshot" in stats:
            index.resync(KVSnapshot.from_wire(stats["snapshot"]))
        if not index.needs_resync(rid) and "at" in stats:
            self.routed.reported(rid, stats["at"])

    def _matched(self, hashes: Sequence[Hashable], replicas: list[str]) -> dict[str, int]:
        """Leading blocks per replica, by events or by this router's own routing (the
        longer)."""
        matched = {r: m for r, m in self.router.index.matched_blocks(hashes).items()
                   if r in replicas}
        for rid, depth in self.routed.matched(hashes, replicas, time.monotonic()).items():
            matched[rid] = max(matched.get(rid, 0), depth)
        return matched

    # ----------------------------------------------------------------- routing
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        kwargs = pending_request.kwargs if pending_request is not None else {}
        pinned = kwargs.get("replica")
        if pinned is not None:
            return [[by_id[pinned]]] if pinned in by_id else []
        for replica in candidate_replicas:
            self._absorb_stats(replica)
        route = kwargs.get("route") or {}
        hashes = [decode_hash(h) for h in route.get("hashes", ())]
        request = RouteRequest(hashes, route.get("session"), route.get("lora"))
        request_id = pending_request.metadata.internal_request_id if pending_request else ""
        self.chosen.pop(request_id, None)  # this request chosen before: asked again
        loads = self._loads(by_id)
        # a replica this router has filled is left out while another has room
        room = {rid: load for rid, load in loads.items()
                if load < by_id[rid].max_ongoing_requests} or loads
        matched = self._matched(hashes, list(room)) if hashes else {}
        router = self.by_policy.get(route.get("policy") or "", self.router)
        decision = router.route(request, room, matched)
        chosen = decision.replica_id
        if hashes:
            self.routed.routed(hashes, chosen, request_id, time.monotonic())
        if pending_request is not None:  # retries of this one rank back off between attempts
            self.chosen[request_id] = (chosen, time.monotonic())
            pending_request.routing_context.should_backoff = True
            if len(self.first_choice) > 100_000:  # requests cancelled before routing
                self.first_choice.clear()
            if request_id not in self.first_choice:
                self.reasons[decision.reason] = self.reasons.get(decision.reason, 0) + 1
                self.first_choice[request_id] = chosen
        return [[by_id[chosen]]]

    def _loads(self, by_id: dict[str, RunningReplica]) -> dict[str, int]:
        """Requests in flight per replica, those chosen and not yet routed included."""
        loads = {rid: self.in_flight.get(rid, 0) for rid in by_id}
        now = time.monotonic()
        for request_id, (rid, at) in list(self.chosen.items()):
            if now - at >= CHOSEN_TTL_S:
                del self.chosen[request_id]
            elif rid in loads:
                loads[rid] += 1
        return loads

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        rid = replica_id.unique_id
        self.in_flight[rid] = self.in_flight.get(rid, 0) + 1
        request_id = pending_request.metadata.internal_request_id
        self.chosen.pop(request_id, None)
        self.request_replica[request_id] = rid
        first = self.first_choice.pop(request_id, None)
        if first is not None:
            self.choices["kept" if first == rid else "changed"] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.routed.finished(internal_request_id, time.time())
        rid = self.request_replica.pop(internal_request_id, replica_id.unique_id)
        left = self.in_flight.get(rid, 0) - 1
        if left > 0:
            self.in_flight[rid] = left
        else:
            self.in_flight.pop(rid, None)
