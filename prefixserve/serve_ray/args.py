"""The ``prefixserve serve`` flags for many replicas on Ray Serve. Only argparse is imported here:
``prefixserve serve`` without ``--replicas``/``--ray-address`` runs the single server and never
imports Ray."""

from __future__ import annotations

import argparse

from prefixserve.server import cli_args as serve_args

ROUTINGS = ("round-robin", "least-loaded", "prefix-aware", "session")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """``prefixserve serve`` with the replica flags added."""
    parser = serve_args.add_parser(subparsers)
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
    group.add_argument("--routing-override", action="store_true",
                       help="also serve the API under /routing/<policy>/ routed by that policy "
                       "(to compare policies on one deployment; off by default)")
    group.add_argument("--max-replicas", type=int, metavar="M",
                       help="autoscale between --replicas and M replicas on ongoing requests")
    group.add_argument("--target-ongoing-requests", type=float, default=2.0, metavar="N",
                       help="ongoing requests per replica autoscaling aims at (default 2)")
    group.add_argument("--max-ongoing-requests", type=int, metavar="N",
                       help="requests a replica accepts at once; the rest wait in Ray's router, "
                       "which sends them to a live replica if one crashes (default: "
                       "--max-num-seqs, so nothing waits inside a replica)")
    group.add_argument("--ray-replica-cpus", type=float, default=1.0, metavar="N",
                       help="Ray CPUs reserved per engine replica (default 1)")
    group.add_argument("--ray-num-cpus", type=int, metavar="N",
                       help="CPUs of a Ray cluster started here (default replicas + 1)")
    group.add_argument("--ray-object-store-memory", type=int, default=100 * 2**20,
                       metavar="BYTES",
                       help="object store of a Ray cluster started here (default 100 MiB)")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.replicas < 1:
        print("prefixserve serve: error: --replicas must be at least 1", flush=True)
        return 2
    if args.replicas == 1 and not args.ray_address and not args.max_replicas:
        return serve_args.run(args)
    from prefixserve.serve_ray.launch import run_ray_server

    return run_ray_server(args)
