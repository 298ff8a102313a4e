"""``prefixserve estimate --replicas N``: the hit rate of N replicas under a routing policy.

Each replica is a ``_PoolReplay`` of the given capacity (the engine's own ``KVCacheManager``);
requests are replayed in file order and each goes to the replica a policy picks:

* ``round-robin``: replicas in turn (``prefixserve.router.Router``, policy ``round-robin``);
* ``prefix-aware``: the router of the Ray deployment (``Router``, policy ``prefix-aware``), fed
  with the replicas' own KV events (``prefixserve.core.kv_events``: each simulated pool publishes
  what it stores and evicts, and the router's ``CacheIndex`` applies the batches), so the
  simulation exercises the same events and rule as a deployment;
* ``pooled``: one pool of N times the capacity, the upper bound of any routing: a cache shared by
  all replicas (Mooncake's pooled KV store).

Load models for the router's balance rule (its thresholds are the router's, ``balance_abs`` and
``balance_rel``):

* a window (``in_flight``, the default): the last ``in_flight`` routed requests are taken to be
  the ones in flight, so a replica's load is how many of them it got, and requests leave their
  replica's pool in arrival order;
* closed-loop clients (``ClosedLoop``): ``clients`` clients each send the next request in file
  order when their last one finishes, as ``prefixserve bench --max-concurrency`` does. A
  request's work is its prompt tokens its replica's cache did not hold plus ``decode_cost``
  per output token, and a replica shares its time equally among its unfinished requests
  (processor sharing). A replica that computes new prefixes thus finishes later and holds more
  of the clients, its load passes the threshold, and requests leave their cached prefix for an
  idle replica: what a served deployment does and a window does not see. Loads are the
  unfinished requests; a request leaves its pool when it finishes.
"""

from __future__ import annotations

import argparse
import sys
from collections import deque
from dataclasses import dataclass, field, replace

from prefixserve.core.hashing import hash_value_of
from prefixserve.core.kv_events import KVEventPublisher
from prefixserve.router import Router, RouteRequest
from prefixserve.router.policy import DEFAULT_BALANCE_ABS, DEFAULT_BALANCE_REL
from prefixserve.tools.estimate.replay import _PoolReplay, replay_pool
from prefixserve.tools.estimate.results import CacheResult, ReplaySettings
from prefixserve.tools.trace_formats import Workload

REPLICA_ROUTINGS = ("round-robin", "prefix-aware", "pooled")

DEFAULT_DECODE_COST = 4.0
"""Work of one output token in prompt tokens for ``ClosedLoop``: about what a CPU replica of
the default model (float32, one thread) spends per sequence on a decode step of four sequences,
against one prompt token's share of a prefill."""


@dataclass(frozen=True)
class ClosedLoop:
    """The closed-loop load model (module docstring): ``clients`` clients, ``decode_cost``
    prompt tokens of work per output token."""

    clients: int
    decode_cost: float = DEFAULT_DECODE_COST


@dataclass
class ReplicaResult:
    """The figures of one policy: the replicas' results summed (``total``), per replica the
    requests it served (``shares``), and the requests by the router's reason for its choice
    (``reasons``: ``prefix``, ``imbalanced`` for one the balance rule moved off its cached
    prefix, ...)."""

    routing: str
    replicas: int
    capacity_blocks: int
    total: CacheResult
    shares: list[int]
    reasons: dict[str, int] = field(default_factory=dict)


def _sum_results(capacity: int, parts: list[CacheResult]) -> CacheResult:
    total = CacheResult(capacity)
    for part in parts:
        total.requests += part.requests
        total.requests_with_hit += part.requests_with_hit
        total.requests_too_large += part.requests_too_large
        total.query_blocks += part.query_blocks
        total.hit_blocks += part.hit_blocks
        total.query_tokens += part.query_tokens
        total.hit_tokens += part.hit_tokens
        total.replayed_blocks += part.replayed_blocks
        total.seconds += part.seconds
    return total


def replay_replicas(workload: Workload, capacity: int, settings: ReplaySettings, routing: str,
                    replicas: int, load: int | ClosedLoop | None = None,
                    router: Router | None = None,
                    balance: tuple[int, float] = (DEFAULT_BALANCE_ABS, DEFAULT_BALANCE_REL),
                    ) -> ReplicaResult:
    """Replays ``workload`` over ``replicas`` pools of ``capacity`` blocks routed by ``routing``
    (a ``Router`` of that policy and the load-balance thresholds ``balance``, unless one is
    given) under the load model ``load``: a window of that many requests (default 8 per
    replica) or ``ClosedLoop`` clients."""
    parse_routings(routing)
    if replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {replicas}")
    if routing == "pooled":
        result = replay_pool(workload, capacity * replicas, settings)
        return ReplicaResult(routing, replicas, capacity, result, [result.requests])
    if isinstance(load, ClosedLoop):  # requests leave when they finish, not by a resident cap
        settings = replace(settings, concurrency=load.clients + 1)
    ids = [f"replica-{i}" for i in range(replicas)]
    pools = [_PoolReplay(workload, capacity, settings) for _ in ids]
    if router is None:
        router = Router(routing, balance_abs=balance[0], balance_rel=balance[1])
    step = _RoutedStep(workload, pools, ids, router)
    if isinstance(load, ClosedLoop):
        _replay_closed_loop(step, load)
    else:
        _replay_window(step, load if load is not None else 8 * replicas)
    for pool in pools:
        while pool.resident:
            pool._leave()
    total = _sum_results(capacity, [pool.result for pool in pools])
    return ReplicaResult(routing, replicas, capacity, total, step.served, step.reasons)


class _RoutedStep:
    """Routes a request by the given loads, replays its arrival in the chosen pool and feeds
    that pool's KV events to the router's index."""

    def __init__(self, workload: Workload, pools: list[_PoolReplay], ids: list[str],
                 router: Router) -> None:
        self.workload, self.pools, self.ids, self.router = workload, pools, ids, router
        self.publishers = [KVEventPublisher(rid, workload.block_size) for rid in ids]
        for pool, publisher in zip(pools, self.publishers, strict=True):
            pool.manager.block_pool.event_sink = publisher
        self.served = [0] * len(ids)
        self.reasons: dict[str, int] = {}

    def arrive(self, index: int, loads: list[int]) -> tuple[int, int]:
        """Request ``index`` routed and arrived: the position of its replica, and the prompt
        tokens it found cached there."""
        request = self.workload.requests[index]
        route = RouteRequest([hash_value_of(k) for k in self.workload.block_keys(request)])
        decision = self.router.route(route, dict(zip(self.ids, loads, strict=True)))
        self.reasons[decision.reason] = self.reasons.get(decision.reason, 0) + 1
        where = self.ids.index(decision.replica_id)
        cached = self.pools[where]._arrive(index, request)
        self.served[where] += 1
        self.flush(where)
        return where, cached

    def flush(self, where: int) -> None:
        batch = self.publishers[where].flush()
        if batch is not None:
            self.router.index.apply(batch)


def _replay_window(step: _RoutedStep, window: int) -> None:
    """The window load model: the last ``window`` routed requests are in flight."""
    recent: deque[int] = deque()
    loads = [0] * len(step.ids)
    for index in range(len(step.workload.requests)):
        where, _ = step.arrive(index, loads)
        recent.append(where)
        loads[where] += 1
        if len(recent) > window:
            loads[recent.popleft()] -= 1


def _replay_closed_loop(step: _RoutedStep, loop: ClosedLoop) -> None:
    """The closed-loop load model: an event per finishing request, each replica's unfinished
    requests sharing its time equally (``remaining``: work left per request index)."""
    requests = step.workload.requests
    remaining: list[dict[int, float]] = [{} for _ in step.ids]
    sent = 0

    def send() -> None:
        nonlocal sent
        index, sent = sent, sent + 1
        where, cached = step.arrive(index, [len(r) for r in remaining])
        request = requests[index]
        work = (request.num_prompt_tokens - cached
                + loop.decode_cost * request.num_output_tokens)
        remaining[where][index] = max(work, 1e-9)

    while sent < min(loop.clients, len(requests)):
        send()
    while any(remaining):
        # the next request to finish: least work left times the requests sharing its replica
        elapsed, where, index = min((min(r.values()) * len(r), w, min(r, key=r.__getitem__))
                                    for w, r in enumerate(remaining) if r)
        elapsed = max(elapsed, 0.0)  # a request left at -1e-12 by rounding finishes now
        for held in remaining:
            for key in held:
                held[key] -= elapsed / len(held)
        del remaining[where][index]
        step.pools[where].finish(index)
        step.flush(where)
        if sent < len(requests):
            send()


# ----------------------------------------------------------------------------- the command


def parse_routings(text: str) -> list[str]:
    """``round-robin,prefix-aware`` -> the routings, each checked."""
    routings = [item.strip() for item in text.split(",") if item.strip()]
    for routing in routings:
        if routing not in REPLICA_ROUTINGS:
            raise ValueError(f"unknown routing {routing!r}; choose from "
                             f"{', '.join(REPLICA_ROUTINGS)}")
    if not routings:
        raise ValueError("--routing names no policy")
    return routings


def estimate_replicas(args: argparse.Namespace) -> tuple[Workload, list[ReplicaResult]]:
    """Reads the input and replays every (per-replica capacity, routing) pair."""
    from prefixserve.tools.estimate.replay import (
        _requested_capacities,
        default_capacities,
        replay_infinite,
    )
    from prefixserve.tools.trace_formats import ReadOptions, read_workload

    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    if args.in_flight is not None and args.in_flight < 1:
        raise ValueError(f"--in-flight must be at least 1, got {args.in_flight}")
    if args.clients is not None and (args.clients < 1 or args.in_flight is not None):
        raise ValueError("--clients must be at least 1 and replaces --in-flight, got "
                         f"--clients {args.clients}" + (f" and --in-flight {args.in_flight}"
                                                        if args.in_flight is not None else ""))
    if not args.decode_cost >= 0:
        raise ValueError(f"--decode-cost must be >= 0, got {args.decode_cost}")
    if args.balance_abs_threshold < 0 or not args.balance_rel_threshold >= 1.0:
        raise ValueError("--balance-abs-threshold must be >= 0 and --balance-rel-threshold "
                         f">= 1, got {args.balance_abs_threshold} and "
                         f"{args.balance_rel_threshold}")
    routings = parse_routings(args.routing)
    options = ReadOptions(format=args.format, block_size=args.block_size,
                          trace_block_size=args.trace_block_size, chain=args.chain,
                          tokenizer=args.tokenizer, skip_bad_lines=args.skip_bad_lines)
    workload = read_workload(args.input, options)
    settings = ReplaySettings(concurrency=args.concurrency,
                              warmup_requests=int(len(workload.requests) * args.warmup_fraction),
                              window=max(1, len(workload.requests) // 20))
    capacities = _requested_capacities(args, None)
    if not capacities:
        distinct = replay_infinite(workload, settings).distinct_blocks or 1
        capacities = sorted({max(1, c // args.replicas) for c in default_capacities(distinct)})
    balance = (args.balance_abs_threshold, args.balance_rel_threshold)
    load = (args.in_flight if args.clients is None
            else ClosedLoop(args.clients, args.decode_cost))
    results = [replay_replicas(workload, capacity, settings, routing, args.replicas, load,
                               balance=balance)
               for capacity in capacities for routing in routings]
    return workload, results


def print_replica_report(workload: Workload, results: list[ReplicaResult]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    replicas = results[0].replicas
    table = Table(title=f"{len(workload.requests):,} requests over {replicas} replicas "
                  f"(blocks of {workload.block_size} tokens)", box=box.SIMPLE_HEAVY)
    for name in ("blocks each", "routing", "token hits", "block hits", "of pooled",
                 "requests each (min-max)"):
        table.add_column(name, justify="left" if name == "routing" else "right",
                         no_wrap=name == "routing")
    pooled = {r.capacity_blocks: r.total.token_hit_rate for r in results if r.routing == "pooled"}
    for result in results:
        base = pooled.get(result.capacity_blocks)
        ratio = f"{result.total.token_hit_rate / base:.1%}" if base else "-"
        shares = ("-" if result.routing == "pooled"
                  else f"{min(result.shares)}-{max(result.shares)}")
        table.add_row(f"{result.capacity_blocks:,}", result.routing,
                      f"{result.total.token_hit_rate:.2%}", f"{result.total.block_hit_rate:.2%}",
                      ratio, shares)
    Console().print(table)


def run_replica_estimate(args: argparse.Namespace) -> int:
    """``prefixserve estimate --replicas N``: prints the table (and ``--json``); 0, or 2 with the
    reason when the input or an option is unusable."""
    import json

    from prefixserve.tools.trace_formats import TraceError

    try:
        workload, results = estimate_replicas(args)
    except (TraceError, ValueError, OSError) as exc:
        print(f"prefixserve estimate: error: {exc}", file=sys.stderr)
        return 2
    print_replica_report(workload, results)
    if args.json:
        rows = [{"routing": r.routing, "replicas": r.replicas,
                 "capacity_blocks_per_replica": r.capacity_blocks,
                 "token_hit_rate": r.total.token_hit_rate,
                 "block_hit_rate": r.total.block_hit_rate, "requests": r.total.requests,
                 "requests_per_replica": r.shares, "reasons": r.reasons} for r in results]
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"input": args.input, "results": rows}, out, indent=2)
    return 0
