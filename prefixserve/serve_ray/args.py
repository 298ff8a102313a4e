"""The ``prefixserve serve`` flags for many replicas on Ray Serve, added to the server's own
parser (``server.cli_args``). Only argparse and the router's defaults are imported here:
``prefixserve serve`` without ``--replicas``/``--ray-address`` runs the single server and never
imports Ray."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from prefixserve.router.policy import BALANCE_BATCHES, DEFAULT_BALANCE_REL
from prefixserve.server import cli_args as serve_args

ROUTINGS = ("round-robin", "least-loaded", "prefix-aware", "session")


def add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    """Plugs the replica flags into the server's ``prefixserve serve`` parser (from
    ``server.cli_args``) and makes its command :func:`run`, which starts the single server
    unless replicas are asked for."""
    group = parser.add_argument_group(
        "replicas on Ray Serve (with --replicas N > 1 or --ray-address)")
    group.add_argument("--replicas", type=int, default=1, metavar="N",
                       help="engine replicas behind one router (default 1: the single server)")
    group.add_argument("--ray-address", metavar="ADDRESS",
                       help="join this Ray cluster ('auto': the local one) instead of starting "
                       "a private one")
    group.add_argument("--routing", choices=ROUTINGS, default="prefix-aware",
                       help="how requests are spread over the replicas (default prefix-aware: "
                       "the longest cached prefix unless that replica is overloaded)")
    group.add_argument("--balance-abs-threshold", type=_count, metavar="N",
                       help="prefix-aware routing passes over the replica holding a request's "
                       "prefix for the least loaded one only when it has more than N requests "
                       "in flight beyond that one and more than --balance-rel-threshold times "
                       f"as many (default {BALANCE_BATCHES} x --max-num-seqs - 1: it holds "
                       "at least two full batches more; 63 with the default 32 slots)")
    group.add_argument("--balance-rel-threshold", type=_factor, default=DEFAULT_BALANCE_REL,
                       metavar="F",
                       help="the factor of the rule above (default "
                       f"{DEFAULT_BALANCE_REL}; SGLang's router has the same two)")
    group.add_argument("--routing-override", action="store_true",
                       help="also serve the API under /routing/<policy>/ routed by that policy "
                       "(to compare policies on one deployment; off by default)")
    group.add_argument("--max-replicas", type=int, metavar="M",
                       help="autoscale up to M replicas on ongoing requests per replica (Ray "
                       "Serve autoscaling; --replicas is the number started with)")
    group.add_argument("--min-replicas", type=int, metavar="N",
                       help="with --max-replicas: the fewest replicas autoscaling keeps "
                       "(default --replicas; at least 1)")
    group.add_argument("--target-ongoing-requests", type=float, default=2.0, metavar="N",
                       help="ongoing requests per replica autoscaling aims at (default 2)")
    group.add_argument("--autoscaling-config", type=_json_object, metavar="JSON",
                       help="more Ray Serve autoscaling settings as a JSON object, e.g. "
                       "'{\"upscale_delay_s\": 10, \"downscale_delay_s\": 120}' (Ray's "
                       "defaults: 30 and 600 s); the flags above take precedence")
    group.add_argument("--max-ongoing-requests", type=int, metavar="N",
                       help="requests a replica accepts at once (default 4 x --max-num-seqs): "
                       "those past its sequence slots wait in its queue, beside their cached "
                       "prefix; a request a replica dies with before answering is sent to "
                       "another")
    group.add_argument("--ray-replica-cpus", type=float, default=1.0, metavar="N",
                       help="Ray CPUs reserved per engine replica (default 1)")
    group.add_argument("--ray-num-cpus", type=int, metavar="N",
                       help="CPUs of a Ray cluster started here (default replicas + 1)")
    group.add_argument("--ray-object-store-memory", type=int, default=100 * 2**20,
                       metavar="BYTES",
                       help="object store of a Ray cluster started here (default 100 MiB)")
    group.add_argument("--ray-start-timeout", type=_positive_seconds, default=120.0,
                       metavar="SECONDS",
                       help="how long Ray Serve's proxy may take to start and to answer a "
                       "health check before Ray replaces it; a loaded machine needs more than "
                       "Ray's own 5-10 s (default 120)")
    group.add_argument("--ingress-retry-timeout", type=_positive_seconds, default=30.0,
                       metavar="SECONDS",
                       help="how long the HTTP front keeps sending a request that Ray Serve "
                       "could not answer yet (its ingress died or is restarting) before it "
                       "answers 503 with Retry-After (default 30)")
    parser.set_defaults(func=run)


def _checked(parse: Callable[[str], Any], ok: Callable[[Any], bool],
             wanted: str) -> Callable[[str], Any]:
    """An argparse type: ``parse`` the text and refuse it unless ``ok``."""
    def check(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
        return value
    return check


_count = _checked(int, lambda v: v >= 0, "a whole number >= 0")
_factor = _checked(float, lambda v: v >= 1.0, "a number >= 1")
_positive_seconds = _checked(float, lambda v: v > 0, "a positive number of seconds")


def _json_object(text: str) -> dict[str, object]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def replica_range_error(args: argparse.Namespace) -> str | None:
    """What is wrong with --replicas/--min-replicas/--max-replicas (None when nothing)."""
    if args.replicas < 1:
        return "--replicas must be at least 1"
    if getattr(args, "kv_events_zmq", None) and (args.replicas > 1 or args.max_replicas
                                                 or args.ray_address):
        return ("--kv-events-zmq is for a single server; on Ray the replicas' events reach "
                "the router through Ray")
    if args.max_replicas is None:
        if args.min_replicas is not None or args.autoscaling_config:
            return "--min-replicas and --autoscaling-config need --max-replicas"
        return None
    low = args.replicas if args.min_replicas is None else args.min_replicas
    if not 1 <= low <= args.replicas <= args.max_replicas:
        return ("autoscaling needs 1 <= --min-replicas <= --replicas <= --max-replicas, got "
                f"{low}, {args.replicas}, {args.max_replicas}")
    return None


def run(args: argparse.Namespace) -> int:
    error = replica_range_error(args)
    if error:
        print(f"prefixserve serve: error: {error}", file=sys.stderr, flush=True)
        return 2
    if args.replicas == 1 and not args.ray_address and not args.max_replicas:
        return serve_args.run(args)
    from prefixserve.serve_ray.launch import run_ray_server

    return run_ray_server(args)
