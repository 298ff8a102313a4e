"""``prefixserve serve --replicas N``: start (or join) a Ray cluster and deploy the replicas.

The application is two deployments: ``PrefixserveIngress`` (one replica, Ray Serve's HTTP proxy
on an internal port of 127.0.0.1 in front of it) and ``PrefixserveEngine`` (N replicas of
``EngineReplica``, with ``PrefixCacheRequestRouter`` as its request router). Every process of
the application gets the same ``PYTHONHASHSEED`` (the caller's, or a random one drawn here), so
the hash root ``NONE_HASH`` is the same in the router and the replicas and stays secret to the
deployment. The hash algorithm defaults to ``sha256`` here (``builtin`` values are not meant to
leave a process).

Ray Serve replaces a replica whose health check fails or whose process dies (a new replica id;
the router forgets the old one and its cache state). ``--max-replicas M`` turns on Ray Serve
autoscaling between ``--min-replicas`` (default N) and M replicas on ongoing requests per replica
(``--target-ongoing-requests``; more of Ray's settings with ``--autoscaling-config``).

``--host``/``--port`` is served by the front (``front.py``, uvicorn in a thread of this process),
which forwards every request to the proxy and hides the ingress's death from clients: a request
not answered yet is sent again (until ``--ingress-retry-timeout``), a cut stream ends with an
error event.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
from typing import Any

from prefixserve.engine.config import EngineConfig, parse_memory
from prefixserve.router.policy import default_balance_abs
from prefixserve.serve_ray.front import Front, FrontServer, bind, free_local_port

logger = logging.getLogger("prefixserve.serve_ray")

APP_NAME = "prefixserve"
ROUTER_CLASS = "prefixserve.serve_ray.request_router.PrefixCacheRequestRouter"
ONGOING_PER_SEQUENCE_SLOT = 4
"""A replica accepts this many requests per sequence slot (``--max-num-seqs``) by default:
those beyond the slots wait in the replica's own queue, beside the blocks their prefix is cached
in, rather than in Ray's router, which would send them to whichever replica frees a slot first
(16 clients on 4 replicas of 4 slots: 57-74% of requests reached the replica first chosen for
them and 53-54% of prompt tokens came from the cache, against 100% and 69-75% with 16;
``benchmarks/replica_routing.py``)."""
ROUTING_STATS_PERIOD_S = 0.5
"""How often each replica reports its KV events to the routers (Ray Serve's routing stats)."""
INGRESS_HEALTH_CHECK_PERIOD_S = 1.0
"""How often Ray Serve checks the ingress. It notices a dead replica at its next health check
(Ray's default period is 10 s), so this bounds how long requests wait, beyond the new
ingress's start, after one dies; a check is one call on an idle actor."""


def app_args(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the deployments rebuild their configs from (plain, picklable values)."""
    values = {k: v for k, v in vars(args).items() if k != "func"}
    if values.get("prefix_caching_hash_algo") in (None, "builtin"):
        values["prefix_caching_hash_algo"] = "sha256"
    return values


def autoscaling_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """Ray Serve's ``autoscaling_config`` of the engine deployment (None without
    ``--max-replicas``): ``--autoscaling-config`` overlaid with the replica flags, starting
    with ``--replicas``. Ray validates it (an unknown or invalid field fails the start)."""
    if args.max_replicas is None:
        return None
    config = dict(getattr(args, "autoscaling_config", None) or {})
    minimum = args.replicas if args.min_replicas is None else args.min_replicas
    config.update(min_replicas=minimum, initial_replicas=args.replicas,
                  max_replicas=args.max_replicas,
                  target_ongoing_requests=args.target_ongoing_requests)
    return config


def router_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The request router's settings (``PrefixCacheRequestRouter.initialize_state``)."""
    balance_abs = args.balance_abs_threshold
    if balance_abs is None:
        balance_abs = default_balance_abs(args.max_num_seqs or EngineConfig.max_num_seqs)
    return {"policy": args.routing, "balance_abs": balance_abs,
            "balance_rel": args.balance_rel_threshold}


def build_app(args: argparse.Namespace) -> Any:
    """The Ray Serve application (bound deployments) for ``args``."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from prefixserve.serve_ray.ingress import Ingress
    from prefixserve.serve_ray.replica import EngineReplica

    values = app_args(args)
    env = {"PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED") or str(int.from_bytes(
        os.urandom(4), "little"))}
    if args.num_threads:
        env["OMP_NUM_THREADS"] = str(args.num_threads)
    actor = {"num_cpus": args.ray_replica_cpus, "runtime_env": {"env_vars": env}}
    engine_options: dict[str, Any] = {
        "name": "PrefixserveEngine", "ray_actor_options": actor,
        "max_ongoing_requests": args.max_ongoing_requests
        or ONGOING_PER_SEQUENCE_SLOT * (args.max_num_seqs or EngineConfig.max_num_seqs),
        "health_check_period_s": 5.0, "health_check_timeout_s": 60.0,
        "request_router_config": RequestRouterConfig(
            # by import path: the ingress then shares the module (and its router registry)
            request_router_class=ROUTER_CLASS,  # type: ignore[arg-type]
            request_router_kwargs=router_kwargs(args),
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,  # type: ignore[arg-type]
            request_routing_stats_timeout_s=10.0)}  # type: ignore[arg-type]
    autoscaling = autoscaling_config(args)
    if autoscaling is not None:
        engine_options["autoscaling_config"] = autoscaling
    else:
        engine_options["num_replicas"] = args.replicas
    deployment: Any = serve.deployment
    engine = deployment(EngineReplica, **engine_options).bind(values)
    ingress = deployment(Ingress, **ingress_options(env))
    return ingress.bind(engine, values)


def ingress_options(env: dict[str, str]) -> dict[str, Any]:
    """The ingress deployment's options (one replica; no CPU reserved: it only routes)."""
    return {"name": "PrefixserveIngress", "max_ongoing_requests": 1000,
            "health_check_period_s": INGRESS_HEALTH_CHECK_PERIOD_S,
            "ray_actor_options": {"num_cpus": 0, "runtime_env": {"env_vars": env}}}


def serve_timeouts(args: argparse.Namespace) -> dict[str, str]:
    """Ray Serve's proxy timeouts, read by its controller from the environment. Ray's own (5 s
    to start, 10 s per health check) are shorter than a proxy takes on a loaded machine; the
    controller then kills the proxy while ``serve.start`` waits for it."""
    seconds = str(args.ray_start_timeout)
    return {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": seconds,
            "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": seconds}


def start(args: argparse.Namespace, sock: socket.socket) -> FrontServer:
    """Starts or joins Ray, starts Serve's HTTP proxy on an internal port, deploys the
    application and serves the front on ``sock`` (``--host``/``--port``, bound); returns the
    front once every replica is up."""
    import ray
    from ray import serve

    app = build_app(args)  # an invalid autoscaling config fails here, before Ray starts
    if args.ray_address:
        ray.init(address=args.ray_address, namespace=APP_NAME, log_to_driver=False,
                 runtime_env={"env_vars": serve_timeouts(args)})
    else:
        _start_local_ray(args)
    upstream = _start_proxy()
    serve.run(app, name=APP_NAME, route_prefix="/")
    front = FrontServer(Front(upstream, args.ingress_retry_timeout), sock, args.log_level,
                        access_log=not args.disable_access_log,
                        shutdown_timeout=args.shutdown_timeout,
                        max_body_size=parse_memory(args.max_request_body_size),
                        read_timeout=args.request_read_timeout)
    front.start()
    return front


def _start_proxy() -> str:
    """``serve.start`` with the proxy on a free port of 127.0.0.1; a proxy that died or was
    late while starting (the controller replaces it) is waited for once more. Returns the
    proxy's base URL (a Serve instance already running keeps its own port)."""
    from ray import serve
    from ray.exceptions import RayActorError
    from ray.serve.context import _get_global_client

    for attempt in (1, 2):
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": free_local_port()})
            client = _get_global_client()
            assert client is not None  # serve.start connected it
            config = client.http_config
            host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "", None) else config.host
            return f"http://{host}:{config.port}"
        except (RayActorError, TimeoutError) as exc:
            if attempt == 2:
                raise
            logger.warning("Ray Serve's proxy did not start (%s); waiting for it once more",
                           str(exc).splitlines()[0])
    raise AssertionError("unreachable")


def _start_local_ray(args: argparse.Namespace) -> None:
    """A private local Ray cluster. Ray gives its node 30 s to register, which a loaded machine
    can exceed: one more try then (after stopping what the first one started)."""
    import ray

    cpus = args.ray_num_cpus or max(2, (args.max_replicas or args.replicas) + 1)
    timeouts = serve_timeouts(args)
    # The processes of a cluster started here inherit these. Ray runs its workers at nice 15
    # by default, so that any process of normal priority beside them (another job, a build)
    # takes nearly all of the CPU from the replicas, the proxy and Serve's controller: serving
    # is the work of this cluster, so its workers run at normal priority.
    os.environ.update(timeouts, RAY_worker_niceness="0")
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", ""), **timeouts}
    for attempt in (1, 2):
        try:
            ray.init(num_cpus=cpus, object_store_memory=args.ray_object_store_memory,
                     include_dashboard=False, namespace=APP_NAME, log_to_driver=False,
                     runtime_env={"env_vars": env})
            return
        except Exception as exc:
            if attempt == 2 or "timed out during startup" not in str(exc):
                raise
            logger.warning("Ray did not start in time; trying once more")
            ray.shutdown()


def _stop_on_signals(stop: threading.Event) -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())


def run_ray_server(args: argparse.Namespace) -> int:
    """Runs until SIGINT/SIGTERM, then stops the front (running requests get
    ``--shutdown-timeout`` seconds to finish), deletes the application (and stops a Ray it
    started) and returns 0."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.routing not in ("round-robin", "least-loaded", "prefix-aware", "session"):
        print(f"prefixserve serve: error: unknown --routing {args.routing!r}", file=sys.stderr)
        return 2
    stop = threading.Event()
    _stop_on_signals(stop)
    try:
        sock = bind(args.host, args.port)
    except OSError as exc:
        print(f"prefixserve serve: cannot listen on {args.host}:{args.port}: {exc}",
              file=sys.stderr)
        return 1
    try:
        front = start(args, sock)
    except Exception as exc:
        print(f"prefixserve serve: cannot start on Ray: {exc}", file=sys.stderr)
        sock.close()
        _shutdown(args)
        return 1
    # ray.init puts a SIGTERM handler of its own in place, which exits at once (status 15)
    # and cuts every running request: SIGTERM stops gracefully, as SIGINT does
    _stop_on_signals(stop)
    logger.info("serving %d replica(s) on http://%s:%d, routing %s", args.replicas, args.host,
                args.port, args.routing)
    stop.wait()
    front.stop()
    _shutdown(args)
    return 0


def _shutdown(args: argparse.Namespace) -> None:
    import ray
    from ray import serve

    if not ray.is_initialized():  # Ray never started: nothing to delete (and no reconnect)
        return
    try:
        serve.delete(APP_NAME)
        if not args.ray_address:
            serve.shutdown()
    finally:
        ray.shutdown()
