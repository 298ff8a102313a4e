"""``prefixserve serve --replicas 2`` on a local Ray cluster (one cluster for the module): the
cache-aware router keeps a shared prefix's traffic together, round-robin splits it; ``/metrics``
merges the replicas with a ``replica`` label; LoRA traffic routes by the adapter's chain;
autoscaling adds a replica the router routes to and removes one it forgets; a replica killed
while requests wait fails none of the waiting ones and is forgotten by the router.

The single server's cached share on this traffic is the perfect cache's, which ``prefixserve
bench`` reports beside every run (``perfect_cache``): one request at a time, a server whose cache
holds the whole run serves exactly that (``test_bench.test_end_to_end_shared_prefix_and_multi_
turn`` asserts it), so the comparison needs no third server.

The cluster tests run in file order and share the cluster: the autoscaling and crash tests come
last (they change the replica set) and share one load generator.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from lora_helpers import default_config, write_peft_adapter
from server_helpers import HTTP, ServerProcess

from prefixserve.cli import main
from prefixserve.serve_ray.launch import ROUTING_STATS_PERIOD_S, build_app
from prefixserve.tools.bench.report import read_run

RAY_STARTUP_S = 600.0
"""A Ray cluster, its Serve controller and proxy and two model loads: 80-150 s measured on a
2-core machine shared with other work, 130-200 s at a load average of 15-20, over 360 s at 22."""

REPLICA_START_S = 300.0
"""Time for Ray to start one more replica (a worker process and a model load) on that machine."""

ADMIN = {"Authorization": "Bearer ray-admin"}
MAX_NUM_SEQS = 4
MAX_REPLICAS = 3
AUTOSCALING = {"upscale_delay_s": 0.5, "downscale_delay_s": 2.0, "metrics_interval_s": 0.5,
               "look_back_period_s": 1.0}
"""Ray's delays are 30 s up and 600 s down by default: tiny ones keep the test short."""

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed"),
]
slow = pytest.mark.slow


@contextmanager
def cpu_hogs(count: int = 2) -> Iterator[None]:
    """``count`` busy processes beside the block: a machine loaded by other work."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Serve started while two CPU-bound processes load the machine: its controller and proxy
    must get the time they need. The hogs run from the moment Ray's own processes are up
    (Ray's "Started a local Ray instance") until Serve has started, which is when the
    controller starts the proxy and checks that it is ready. Started sooner, they would only
    slow the imports and Ray's start, and take the cores from the other tests. (Planted,
    without ``serve_timeouts``: Ray's controller kills a proxy that is not ready in 5 s, which
    failed the start in some runs; in every run the first test's check of the controller's
    environment fails.)"""
    adapter = write_peft_adapter(tmp_path_factory.mktemp("ray-adapters") / "a", default_config(),
                                 seed=21)
    process = _launch_cluster(adapter, tmp_path_factory.mktemp("ray") / "server.log")
    _wait_for_log(process, ("Started a local Ray instance",), RAY_STARTUP_S)
    with cpu_hogs():
        _wait_for_log(process, ("Started Serve", "Connecting to existing Serve"), RAY_STARTUP_S)
    yield process.start(RAY_STARTUP_S)
    process.stop()


def _wait_for_log(process: ServerProcess, texts: tuple[str, ...], timeout: float) -> None:
    """Until the server's log shows one of ``texts`` (Serve's proxy is up)."""
    deadline = time.monotonic() + timeout
    while not any(text in process.log for text in texts):
        if process.process.poll() is not None or time.monotonic() > deadline:
            process.stop()
            raise RuntimeError(f"none of {texts} in the server's log:\n{process.log}")
        time.sleep(0.25)


def _launch_cluster(adapter: Path, log: Path) -> ServerProcess:
    return ServerProcess(["--replicas", "2", "--routing-override", "--dtype", "float32",
                          "--max-num-seqs", str(MAX_NUM_SEQS), "--num-threads", "1",
                          "--num-blocks", "512", "--max-model-len", "1024",
                          "--log-stats-interval", "0", "--served-model-name", "smol",
                          "--lora-modules", f"a={adapter}", "--max-lora-rank", "8",
                          "--admin-key", "ray-admin",
                          "--max-replicas", str(MAX_REPLICAS), "--autoscaling-config",
                          json.dumps(AUTOSCALING),
                          "--ray-num-cpus", "2", "--ray-replica-cpus", "0.5"],
                         log)


def _processes_titled(title: str) -> list[Path]:
    """``/proc/PID`` of the processes whose command line starts with ``title``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "cmdline").read_bytes().startswith(title.encode()):
                found.append(proc)
        except OSError:
            continue
    return found


@slow
def test_the_cluster_runs_at_normal_priority_with_the_start_timeout(cluster: ServerProcess
                                                                    ) -> None:
    """The fixture starts the cluster beside two CPU hogs. Ray runs its workers at nice 15, where
    the hogs take nearly all of the CPU (the start took over 8 minutes): Serve's controller and
    the replicas must run at nice 0. The controller reads the proxy's start and health
    timeouts from its environment: ``--ray-start-timeout`` (120 s), not Ray's 5 s, or a loaded
    machine's proxy is killed while ``serve.start`` waits for it. (Planted: the timeouts left
    out of the cluster's environment killed the proxy under the hogs and failed the start; left
    out, or the niceness left to Ray, each fails an assertion here.)"""
    controllers = _processes_titled("ray::ServeController")
    replicas = _processes_titled("ray::ServeReplica:prefixserve:PrefixserveEngine")
    assert controllers and replicas, "no Serve controller or replica process found"
    for proc in controllers + replicas:
        assert os.getpriority(os.PRIO_PROCESS, int(proc.name)) == 0, proc
    environ = (controllers[0] / "environ").read_bytes().split(b"\0")
    assert b"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S=120.0" in environ
    assert b"RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S=120.0" in environ


def _bench(url: str, out: Path, salt: str) -> dict:
    assert main(["bench", "--base-url", url, "--no-progress", "--json", str(out),
                 "--dataset", "shared-prefix", "--num-groups", "4", "--prompts-per-group", "4",
                 "--system-prompt-len", "64", "--question-len", "8", "--output-len", "2",
                 "--ordered", "--max-concurrency", "1", "--cache-salt", salt]) == 0
    return read_run(str(out))


@slow
def test_prefix_aware_keeps_the_single_servers_cached_share(cluster: ServerProcess,
                                                            tmp_path: Path) -> None:
    """Prefix-aware within 10 points of the single server; round-robin at least 15 less
    (ordered groups alternate between the replicas, so each computes every system prompt once).
    (Planted: routing prefix-aware requests in turn makes the first assertion fail: it then
    serves round-robin's share.) 10 points, not 5: next to the Gemma tests on the other xdist
    worker, one run had one group's system prompt computed twice (61.1% against 66.7%). The
    likely cause, Ray Serve trying the router's second rank when its queue probe of the first
    was late (the ingress logged late probes in 19 of 26 sessions), is gone since the router
    offers one rank (``test_the_router_offers_its_choice_alone_and_passes_over_replicas_it_
    filled``); the margin stays until runs show it unneeded."""
    aware = _bench(cluster.url + "/v1", tmp_path / "aware.json", "aware")
    rr = _bench(cluster.url + "/routing/round-robin/v1", tmp_path / "rr.json", "rr")
    for run in (aware, rr):
        assert (run["summary"]["completed"], run["summary"]["errors"]) == (16, 0)
    single = aware["perfect_cache"]["token_hit_rate"]
    assert rr["perfect_cache"]["token_hit_rate"] == pytest.approx(single)
    assert abs(aware["summary"]["cached_share"] - single) <= 0.10
    assert rr["summary"]["cached_share"] <= single - 0.15


@slow
def test_metrics_are_merged_with_a_replica_label(cluster: ServerProcess) -> None:
    text = HTTP.get(cluster.url + "/metrics", timeout=60).text
    lines = [line for line in text.splitlines()
             if line.startswith("prefixserve:kv_cache_num_blocks")]
    replicas = {line.split('replica="')[1].split('"')[0] for line in lines}
    assert len(replicas) == 2, text[:2000]
    assert text.count("# TYPE prefixserve:kv_cache_num_blocks ") == 1


@slow
def test_bad_requests_get_the_single_servers_errors(cluster: ServerProcess) -> None:
    response = HTTP.post(cluster.url + "/v1/completions", json={"prompt": "x", "max_tokens": -1},
                          timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"
    assert HTTP.get(cluster.url + "/routing/nope/v1/models", timeout=60).status_code == 404


# --------------------------------------------------------------------------- LoRA adapters
def _complete(url: str, model: str, prompt: list[int], max_tokens: int = 1) -> dict[str, Any]:
    response = HTTP.post(url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


@slow
def test_lora_traffic_routes_by_the_adapters_chain(cluster: ServerProcess) -> None:
    """A request for an adapter is hashed with the adapter's content id, as the replica hashes
    its blocks. Each prefix is cached by the adapter on one replica and by the base model on the
    other (round-robin places them); once the router's short memory of its own decisions has
    ended (each replica has reported since the requests finished), the events alone must send
    the adapter's next request to the adapter's replica.
    (Planted: the ingress hashing adapter prompts without the adapter id matches the base
    model's blocks instead, and the cache hits fail.)"""
    prefixes = [[200 + 97 * g + (i * 7919) % 20000 for i in range(48)] for g in range(2)]
    for prefix in prefixes:  # consecutive round-robin picks: the two replicas
        _complete(cluster.url + "/routing/round-robin", "a", [*prefix, 11, 12])
        _complete(cluster.url + "/routing/round-robin", "smol", [*prefix, 11, 12])
    finished = time.time()

    def reported() -> bool:  # a routed request (no whole block) applies the latest reports
        _complete(cluster.url + "/routing/round-robin", "smol", [7, 8, 9])
        return all((r["reported_at"] or 0) > finished for r in _live(cluster))

    _wait("a report of each replica since the requests finished", reported, 60, cluster)
    for prefix in prefixes:
        usage = _complete(cluster.url, "a", [*prefix, 13, 14])["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 48, usage


@slow
def test_lora_adapters_loaded_through_the_ingress_reach_every_replica(
        cluster: ServerProcess, tmp_path: Path) -> None:
    """Loading an adapter is sent to every replica, so requests for it succeed on each (sent
    in turn; planted: forwarding the load to one replica gets the other's requests a 404)."""
    path = write_peft_adapter(tmp_path / "b", default_config(), seed=22, rank=2)
    response = HTTP.post(cluster.url + "/v1/load_lora_adapter", headers=ADMIN, timeout=120,
                          json={"lora_name": "b", "lora_path": str(path)})
    assert response.status_code == 200, response.text
    for g in range(4):
        _complete(cluster.url + "/routing/round-robin", "b", [300 + 31 * g + i for i in range(8)])
    response = HTTP.post(cluster.url + "/v1/unload_lora_adapter", headers=ADMIN, timeout=120,
                          json={"lora_name": "b"})
    assert response.status_code == 200, response.text
    assert HTTP.get(cluster.url + "/router/replicas", timeout=60).status_code == 401


# --------------------------------------------------------------------------- the replica set
def _state(cluster: ServerProcess) -> dict[str, Any]:
    response = HTTP.get(cluster.url + "/router/replicas", headers=ADMIN, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _wait(what: str, check: Callable[[], bool], timeout: float, cluster: ServerProcess) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} in {timeout} s: {_state(cluster)}")
        time.sleep(0.2)


@dataclass
class Outcome:
    """One streamed completion as the client saw it."""

    sent: float
    started: float | None = None
    """When the response headers came: a replica had taken the request."""
    finished: float | None = None
    complete: bool = False
    error: str | None = None


class Load:
    """``workers`` threads each sending streamed completions one after another (distinct
    prompts, or with ``repeat`` one prompt per worker, cached after its first request;
    ``max_tokens`` past the end of text), recording each ``Outcome``."""

    def __init__(self, url: str, workers: int, max_tokens: int = 24,
                 repeat: bool = False) -> None:
        self.url = url
        self.max_tokens = max_tokens
        self.repeat = repeat
        self.outcomes: list[Outcome] = []
        self.peak: list[str] = []
        """The live replica ids at the most replicas (set by the autoscaling test)."""
        self.first: list[str] = []
        """The replica ids before the crash test killed one (set by it)."""
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._work, args=(w,), daemon=True)
                        for w in range(workers)]
        for thread in self.threads:
            thread.start()

    def _work(self, worker: int) -> None:
        with httpx.Client(timeout=600) as client:
            n = 0
            while not self.stopping.is_set():
                n += 0 if self.repeat else 1
                self._one(client, [400 + 13 * worker + 7 * n + i for i in range(24)])

    def _one(self, client: httpx.Client, prompt: list[int]) -> None:
        outcome = Outcome(sent=time.monotonic())
        with self.lock:
            self.outcomes.append(outcome)
        body = {"model": "smol", "prompt": prompt, "max_tokens": self.max_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True}
        try:
            with client.stream("POST", self.url + "/v1/completions", json=body) as response:
                outcome.started = time.monotonic()
                lines = [line for line in response.iter_lines() if line]
            outcome.complete = response.status_code == 200 and lines[-1] == "data: [DONE]" \
                and '"finish_reason":"length"' in lines[-2].replace(" ", "")
            if not outcome.complete:
                outcome.error = f"{response.status_code}: {lines[-3:]}"
        except Exception as exc:  # a broken stream: the replica died
            outcome.error = repr(exc)
        outcome.finished = time.monotonic()

    def running(self) -> tuple[int, int]:
        """(started and unfinished, waiting for a replica)."""
        with self.lock:
            current = [o for o in self.outcomes if o.finished is None]
        started = sum(o.started is not None for o in current)
        return started, len(current) - started

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(600)


@pytest.fixture(scope="module")
def load(cluster: ServerProcess) -> Iterator[Load]:
    """Streams for 3 full replicas and 4 more: with 2 replicas, 8 always wait in the ingress's
    router, which is also what makes Ray Serve scale up."""
    generator = Load(cluster.url, workers=MAX_REPLICAS * MAX_NUM_SEQS + 4)
    yield generator
    generator.stop()


def _live(cluster: ServerProcess) -> list[dict[str, Any]]:
    return _state(cluster)["replicas"]


@pytest.fixture(scope="module")
def adapter_replicas() -> list[str]:
    """The replica ids when adapter ``c`` was loaded at run time (filled by that test)."""
    return []


@slow
def test_an_adapter_loaded_at_run_time_reaches_the_replicas(cluster: ServerProcess,
                                                             adapter_replicas: list[str],
                                                             tmp_path: Path) -> None:
    """Adapter ``c``, loaded through the ingress before the crash and the scale-up, is on both
    replicas (their routing stats list it); the autoscaling test then finds it on the replicas
    Ray starts later, which the ingress loads it onto."""
    path = write_peft_adapter(tmp_path / "c", default_config(), seed=23, rank=2)
    response = HTTP.post(cluster.url + "/v1/load_lora_adapter", headers=ADMIN, timeout=120,
                          json={"lora_name": "c", "lora_path": str(path)})
    assert response.status_code == 200, response.text
    adapter_replicas.extend(r["id"] for r in _live(cluster))
    assert len(adapter_replicas) == 2
    _wait("adapter c on both replicas", lambda: _all_hold(cluster, "c"), 60, cluster)


def _all_hold(cluster: ServerProcess, adapter: str) -> bool:
    """Whether every live replica lists ``adapter`` (the router reads the replicas' stats as
    it routes, so one request goes through first)."""
    _complete(cluster.url, "smol", [7, 8, 9])
    return all(adapter in r["loras"] for r in _live(cluster))


@slow
def test_a_killed_replica_fails_no_waiting_request_and_is_forgotten(cluster: ServerProcess,
                                                                    load: Load) -> None:
    """With every slot of the 2 replicas busy and requests waiting, one replica's process is
    killed (SIGKILL): only streams it had started may fail, each with an error event (code
    ``replica_died``) and ``[DONE]``, never a cut connection; every request still waiting then
    completes on a live replica; the router drops the dead replica and its cache state.
    (Planted: a router whose ``_forget`` does nothing keeps the dead replica's index entry, and
    this fails; an ingress that passes the replica's failure on cuts the streams, and this
    fails.)"""
    live = _live(cluster)
    assert len(live) == 2 and all(r["pid"] for r in live)
    load.first = [r["id"] for r in live]
    _wait("2 full replicas and waiting requests",
          lambda: load.running()[0] == 2 * MAX_NUM_SEQS and load.running()[1] >= 4,
          REPLICA_START_S, cluster)
    victim = live[0]
    killed_at = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    _wait("dead replica forgotten", lambda: victim["id"] not in _state(cluster)["indexed"]
          and victim["id"] in _state(cluster)["removed"], 60, cluster)
    waiting = [o for o in load.outcomes if o.sent < killed_at
               and (o.started is None or o.started > killed_at)]
    assert len(waiting) >= 4
    _wait("waiting requests done", lambda: all(o.finished for o in waiting), REPLICA_START_S,
          cluster)
    assert all(o.complete for o in waiting), [o.error for o in waiting if not o.complete]
    failed = [o for o in load.outcomes if o.finished and not o.complete]
    assert len(failed) <= MAX_NUM_SEQS, [o.error for o in failed]
    assert all(o.started is not None and o.started < killed_at for o in failed)
    assert all('"code": "replica_died"' in (o.error or "") for o in failed), [
        o.error for o in failed]
    assert victim["id"] not in {r["id"] for r in _live(cluster)}


@slow
def test_ray_restarts_and_autoscaling_adds_replicas_the_router_routes_to(
        cluster: ServerProcess, load: Load, adapter_replicas: list[str]) -> None:
    """Under the same load Ray Serve replaces the dead replica and scales up to --max-replicas
    (3: more than --replicas, so autoscaling did it); the router learns each new replica (its
    KV events arrive) and routes to it: a router that ignored new replicas' events would leave
    their indexed blocks at 0 and the wait would fail (not planted; with the router's forgetting
    planted away this test failed too). The new replicas hold adapter ``c``, loaded at run time
    before they started. Then every request so far has completed but those the dead replica
    had taken."""
    # the replicas from before the crash: Ray may have started the dead one's replacement
    # before this test begins, and that one counts as new too
    first = set(load.first) or set(_state(cluster)["indexed"]) | set(_state(cluster)["removed"])

    def three_serving() -> bool:
        state = _state(cluster)
        new = [r for r in state["replicas"] if r["id"] not in first]
        return len(state["replicas"]) == MAX_REPLICAS and len(new) == 2 and all(
            r["id"] in state["indexed"] and r["cached_blocks"] > 0 for r in new)

    _wait("3 replicas serving, 2 of them new", three_serving, REPLICA_START_S, cluster)
    # adapter c was loaded at run time before the new replicas started: the ingress loads it
    # onto each before routing the next generation request (planted: no replay fails here)
    assert adapter_replicas and set(adapter_replicas) <= first
    _wait("adapter c on every replica, the new ones included", lambda: _all_hold(cluster, "c"),
          60, cluster)
    load.peak = [r["id"] for r in _live(cluster)]
    load.stop()
    assert sum(not o.complete for o in load.outcomes) <= MAX_NUM_SEQS


@slow
def test_idle_replicas_are_removed_and_forgotten(cluster: ServerProcess, load: Load) -> None:
    """Without load Ray Serve scales back to --replicas (2); the router forgets the removed
    replica: its index holds exactly the live replicas (a router that kept removed replicas
    would keep their ids in ``indexed``)."""
    load.stop()
    assert len(load.peak) == MAX_REPLICAS

    def back_to_two() -> bool:
        state = _state(cluster)
        live = sorted(r["id"] for r in state["replicas"])
        gone = set(load.peak) - set(live)
        return len(live) == 2 and state["indexed"] == live and gone <= set(state["removed"])

    _wait("scale-down to 2 replicas", back_to_two, 60, cluster)


@slow
def test_a_restarted_ingress_rebuilds_its_index_from_the_replicas_snapshots(
        cluster: ServerProcess, adapter_replicas: list[str]) -> None:
    """The router's index lives in the ingress process. Four prefixes are cached two on each
    replica (round-robin), then the ingress is killed (SIGKILL) while streams run through it
    (``_kill_the_ingress_under_streams``) and Ray Serve starts another:
    its new router, with no memory of where it sent anything, fills the index from the
    replicas' KV event snapshots (within ``SNAPSHOT_EVERY`` reports), and prefix-aware routing
    sends each prefix back to its replica (a hit of the whole prefix). The new ingress also
    reads back from the replicas the adapters loaded at run time through the one that died
    (``c`` among them), which it replays onto replicas that start later (the autoscaling test
    shows the replay).
    (Planted: a router that ignores the snapshots keeps both replicas stale, routes by load,
    and misses; an ingress that does not read the adapters back lists none.)"""
    from prefixserve.serve_ray.replica import STATS_BATCHES

    prefixes = [[400 + 113 * g + (i * 7919) % 20000 for i in range(48)] for g in range(4)]
    for prefix in prefixes:
        _complete(cluster.url + "/routing/round-robin", "smol", [*prefix, 11, 12])
    # more event batches since than a report repeats: only a snapshot holds the prefixes now
    def filler(n: int) -> None:
        _complete(cluster.url + "/routing/round-robin", "smol",
                  [900 + (37 * n + i * 104729) % 20000 for i in range(20)])

    # a batch is the events of one report (the replica flushes them as it reports, one report
    # per stats period): one request a replica each period adds one, and leaves the cores to
    # the other tests (a stream of requests made no more batches, at two cores' work)
    deadline = time.monotonic() + 300
    for n in itertools.count(0, 2):
        if (min(r["seq"] for r in _live(cluster)) > STATS_BATCHES + 8
                or time.monotonic() > deadline):
            break
        period_ends = time.monotonic() + ROUTING_STATS_PERIOD_S
        filler(n)  # consecutive round-robin picks: the two replicas
        filler(n + 1)
        time.sleep(max(0.0, period_ends - time.monotonic()))
    assert min(r["seq"] for r in _live(cluster)) > STATS_BATCHES + 8, _live(cluster)
    adapters = _state(cluster)["runtime_adapters"]
    assert adapter_replicas and "c" in adapters
    title = "ray::ServeReplica:prefixserve:PrefixserveIngress"
    [ingress] = _processes_titled(title)
    _kill_the_ingress_under_streams(cluster, int(ingress.name))

    def rebuilt() -> bool:
        try:  # a routed request: the router applies the replicas' latest stats as it routes
            _complete(cluster.url + "/routing/round-robin", "smol", [7, 8, 9])
            state = _state(cluster)
        except (AssertionError, httpx.HTTPError):
            return False  # the ingress is not back yet
        live = state.get("replicas", [])
        return len(live) == 2 and all(not r["stale"] and r["cached_blocks"] >= 6 for r in live)

    _wait("a new ingress with the replicas' blocks", rebuilt, 120, cluster)
    assert [p.name for p in _processes_titled(title)] != [ingress.name]
    assert _state(cluster)["runtime_adapters"] == adapters
    for prefix in prefixes:
        usage = _complete(cluster.url, "smol", [*prefix, 13, 14])["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 48, usage


def _kill_the_ingress_under_streams(cluster: ServerProcess, pid: int) -> None:
    """SIGKILL of the ingress while 3 streams run through it and a request that is not
    streamed waits in it for its whole answer (4 requests: 2 a replica, the autoscaling
    target). Ray Serve's proxy cuts the streams and answers the held request with a 500 of its
    own; the HTTP front (``front.py``) ends each cut stream with an error event
    (``ingress_died``) and sends the held request again until the new ingress answers it. So
    every stream completes or ends with that event, none is cut, the held request completes,
    and so does one sent right after the kill, while no ingress runs. (Planted: a front that
    lets a cut stream through fails here, with a ``RemoteProtocolError`` for each stream the
    kill cut; one that passes Ray's 500 on fails with that 500.)"""
    def complete(max_tokens: int) -> httpx.Response:
        return HTTP.post(cluster.url + "/v1/completions", timeout=120, json={
            "model": "smol", "prompt": [5, 6, 7], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True})

    load = Load(cluster.url, workers=3, max_tokens=64, repeat=True)
    try:
        _wait("3 streams started", lambda: load.running()[0] == 3, 120, cluster)
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(complete, 128)
            time.sleep(0.5)  # in the ingress, waiting for the replica's whole answer
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            answers = [complete(2), held.result()]
    finally:
        load.stop()
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    assert answers[1].json()["usage"]["completion_tokens"] == 128
    outcomes = load.outcomes
    bad = [o.error for o in outcomes if not o.complete
           and '"code": "ingress_died"' not in (o.error or "")]
    assert not bad, bad
    cut = [o for o in outcomes if o.started and o.started < killed_at
           and o.finished and o.finished > killed_at]
    assert any('"code": "ingress_died"' in (o.error or "") for o in cut), [
        (o.complete, o.error) for o in cut]
    assert any(o.sent > killed_at and o.complete for o in outcomes)


@slow
def test_sigterm_lets_a_running_stream_finish_and_exits_0(cluster: ServerProcess) -> None:
    """SIGTERM (what ``docker stop`` and systemd send) stops ``serve --replicas`` as it stops
    one server: the front takes no new connection, a stream that runs finishes (within
    ``--shutdown-timeout``), the application is deleted and the process exits 0. Last of the
    cluster's tests: it ends the cluster. (Planted: without our handler put back after
    ``ray.init``, Ray's own exits at once with status 15 and cuts the stream.)"""
    body = {"model": "smol", "prompt": [5, 6, 7], "max_tokens": 64, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.Client(timeout=120) as client, \
            client.stream("POST", cluster.url + "/v1/completions", json=body) as response:
        lines = (line for line in response.iter_lines() if line)
        assert next(lines).startswith("data: ")  # the stream runs
        cluster.process.send_signal(signal.SIGTERM)
        rest = list(lines)
    assert rest[-1] == "data: [DONE]", rest[-3:]
    assert '"finish_reason":"length"' in rest[-2].replace(" ", ""), rest[-3:]
    assert cluster.process.wait(120) == 0


# --------------------------------------------------------------------------- flags (fast)
def _args(*argv: str) -> argparse.Namespace:
    from prefixserve.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_autoscaling_flags_become_ray_serves_config() -> None:
    """The flags make a config Ray Serve accepts; --autoscaling-config adds Ray's settings."""
    from ray.serve.config import AutoscalingConfig

    from prefixserve.serve_ray.launch import autoscaling_config

    assert autoscaling_config(_args("--replicas", "2")) is None
    config = autoscaling_config(_args("--replicas", "2", "--min-replicas", "1",
                                      "--max-replicas", "4", "--target-ongoing-requests", "3",
                                      "--autoscaling-config", '{"upscale_delay_s": 5}'))
    assert config == {"upscale_delay_s": 5, "min_replicas": 1, "initial_replicas": 2,
                      "max_replicas": 4, "target_ongoing_requests": 3.0}
    AutoscalingConfig(**config)


@pytest.mark.parametrize("argv", [("--replicas", "0"),
                                  ("--replicas", "3", "--max-replicas", "2"),
                                  ("--replicas", "2", "--min-replicas", "3", "--max-replicas", "4"),
                                  ("--replicas", "2", "--min-replicas", "1"),
                                  ("--replicas", "2", "--kv-events-zmq", "tcp://*:5557")])
def test_bad_replica_ranges_are_refused(argv: tuple[str, ...],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", *argv]) == 2
    assert "replicas" in capsys.readouterr().err


def test_a_dead_ingress_is_noticed_sooner_than_rays_default_health_check() -> None:
    """Ray Serve notices a dead replica at its next health check (every 10 s by default), and
    requests wait that long for a new ingress. The ingress is checked every second (read from
    the application Ray is given: it has no public accessor). (Planted: without the option,
    Ray's 10 s.)"""
    ingress = build_app(_args("--replicas", "2"))._bound_deployment
    assert ingress.name == "PrefixserveIngress"
    assert ingress._deployment_config.health_check_period_s <= 1.0


def test_the_balance_flags_reach_the_request_router() -> None:
    from prefixserve.serve_ray import request_router
    from prefixserve.serve_ray.launch import router_kwargs

    kwargs = router_kwargs(_args("--replicas", "2", "--balance-abs-threshold", "9",
                                 "--balance-rel-threshold", "2.5"))
    router = request_router.PrefixCacheRequestRouter.__new__(
        request_router.PrefixCacheRequestRouter)
    router.initialize_state(**kwargs)
    request_router._ROUTERS.remove(router)
    assert (router.router.balance_abs, router.router.balance_rel) == (9, 2.5)
    # the default: a move needs two full batches of a replica's sequence slots more
    assert router_kwargs(_args("--replicas", "2"))["balance_abs"] == 63
    assert router_kwargs(_args("--replicas", "2", "--max-num-seqs", "4"))["balance_abs"] == 7


def test_the_default_threshold_moves_a_request_once_its_replica_leads_by_two_batches() -> None:
    """Serve's default rule, 2 replicas of 8 slots and 16 clients (the chaos benchmark's
    replica kill): the survivor holds every cached prefix and all 16 requests while its
    replacement is empty. A lead of two full batches (16) moves the next request to the empty
    replica; 15 keeps it beside its prefix. (Planted: the default without the -1, a lead that
    can reach 16 but never exceed it; the first assertion fails, as the benchmark's recovery
    did: never.)"""
    from prefixserve.router.policy import Router, RouteRequest, default_balance_abs

    router = Router("prefix-aware", balance_abs=default_balance_abs(8))
    request, matched = RouteRequest([1, 2, 3]), {"survivor": 3}
    assert router.route(request, {"survivor": 16, "new": 0}, matched).replica_id == "new"
    assert router.route(request, {"survivor": 15, "new": 0}, matched).replica_id == "survivor"


@pytest.mark.parametrize("argv", [("--balance-abs-threshold", "-1"),
                                  ("--balance-rel-threshold", "0.9"),
                                  ("--balance-rel-threshold", "x")])
def test_bad_balance_thresholds_are_refused(argv: tuple[str, ...],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _args("--replicas", "2", *argv)
    assert exit_info.value.code == 2
    assert argv[0] in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_a_bad_ingress_retry_timeout_is_refused(value: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert _args("--replicas", "2").ingress_retry_timeout == 30.0
    with pytest.raises(SystemExit) as exit_info:
        _args("--replicas", "2", "--ingress-retry-timeout", value)
    assert exit_info.value.code == 2
    assert "--ingress-retry-timeout" in capsys.readouterr().err


def test_the_ingress_hashes_adapter_requests_with_the_adapters_id() -> None:
    """The ingress's route of a request for an adapter is the chain a replica computes for it
    (``PromptHasher`` with the adapter's content id, which test_kv_events checks against the
    published values); the base model's requests get the plain chain. (Planted: hashing
    without the adapter id fails this.)"""
    from prefixserve.router import PromptHasher
    from prefixserve.serve_ray.ingress import Ingress
    from prefixserve.serve_ray.launch import app_args

    args = _args("--replicas", "2", "--served-model-name", "smol")
    ingress = Ingress(None, app_args(args))  # type: ignore[arg-type]
    prompt = list(range(100, 140))
    hasher = PromptHasher(16, "sha256")

    def route(model: str) -> dict[str, Any]:
        body = json.dumps({"model": model, "prompt": prompt, "cache_salt": "s"}).encode()
        return ingress.route_for("/v1/completions", body, {}, {"a": "lora-0123"})

    def chain(lora: str | None) -> list[str]:
        return [bytes(h).hex() for h in hasher.hash_values(prompt, "s", lora)]  # type: ignore[call-overload]

    assert route("a")["lora"] == "lora-0123"
    assert route("a")["hashes"] == chain("lora-0123")
    assert route("smol")["hashes"] == chain(None)
    assert route("smol")["lora"] is None


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/messages"])
def test_an_exception_in_the_ingress_is_an_api_error_the_front_passes_on(path: str) -> None:
    """An unexpected exception in the ingress (here: no engine handle, so the first call to it
    fails) is a 500 in the API's own shape, OpenAI's or Anthropic's, naming only the
    exception's type; the front passes it on at once instead of taking it for a dead ingress
    and sending it again until its deadline. (Planted: without the ingress's catch the
    exception escapes, and Ray Serve would answer its plain-text 500.)"""
    import asyncio

    from starlette.requests import Request

    from prefixserve.serve_ray.front import retry_reason
    from prefixserve.serve_ray.ingress import Ingress
    from prefixserve.serve_ray.launch import app_args

    ingress = Ingress(None, app_args(_args("--replicas", "2", "--served-model-name", "smol")))  # type: ignore[arg-type]
    body = json.dumps({"model": "smol", "prompt": "hi", "max_tokens": 1,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
             "query_string": b"", "headers": [(b"content-type", b"application/json")],
             "http_version": "1.1", "scheme": "http", "root_path": "",
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1)}
    response = asyncio.run(ingress(Request(scope, receive)))
    answer = json.loads(bytes(response.body))
    assert response.status_code == 500 and response.media_type == "application/json"
    error = answer["error"]
    if path == "/v1/messages":
        assert answer["type"] == "error" and error["type"] == "api_error"
    else:
        assert error["code"] == "internal_error" and error["type"] == "server_error"
    assert error["message"].startswith("internal server error: ") and "/" not in error["message"]
    assert retry_reason(500, bytes(response.body)) is None


def test_the_router_offers_its_choice_alone_and_passes_over_replicas_it_filled() -> None:
    """Ray Serve tries a router's next rank at once when its queue probe of the first is late
    (0.1 s) or finds it full, so other replicas offered as a second rank took a request away
    from its cached prefix whenever the chosen engine was busy (the ingress logged late probes
    in most cluster test sessions). The router offers its choice alone and asks Ray to back off
    between attempts; a replica whose in-flight count reached its ``max_ongoing_requests`` is
    passed over while another has room. (Planted: the old second rank fails the first check;
    no backoff the second; a full replica kept for its prefix the last.)"""
    import asyncio
    from types import SimpleNamespace

    from prefixserve.serve_ray import request_router

    router = request_router.PrefixCacheRequestRouter.__new__(
        request_router.PrefixCacheRequestRouter)
    router.initialize_state(policy="prefix-aware")
    try:
        replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid),
                                    max_ongoing_requests=4, routing_stats={})
                    for rid in ("r0", "r1")]
        route = {"hashes": [(bytes([i]) * 8).hex() for i in range(3)]}

        def pending_request(request_id: str) -> SimpleNamespace:
            return SimpleNamespace(kwargs={"route": route},
                                   routing_context=SimpleNamespace(should_backoff=False),
                                   metadata=SimpleNamespace(internal_request_id=request_id))

        def choose(pending: SimpleNamespace | None = None) -> tuple[list[list[str]], bool]:
            pending = pending or pending_request("any")
            ranks = asyncio.run(router.choose_replicas(replicas, pending))  # type: ignore[arg-type]
            return ([[r.replica_id.unique_id for r in rank] for rank in ranks],
                    pending.routing_context.should_backoff)

        ranks, backoff = choose()
        assert len(ranks) == 1 and len(ranks[0]) == 1, f"more offered than the choice: {ranks}"
        first = ranks[0]
        assert backoff, "retries of the one rank would not back off"
        assert choose()[0] == [first], "the prefix did not stay on its replica"
        late = pending_request("late")  # chosen once, then again after its replica filled
        assert choose(late)[0] == [first]
        router.in_flight[first[0]] = 4  # this router filled it
        other = "r1" if first[0] == "r0" else "r0"
        assert choose(late)[0] == [[other]], "a full replica was chosen while another had room"
        kept = pending_request("kept")
        choose(kept)
        for pending, rid in ((late, other), (kept, other)):
            router.on_request_routed(pending, SimpleNamespace(unique_id=rid), None)  # type: ignore[arg-type]
        assert router.choices == {"kept": 1, "changed": 1}
        # each request's first choice by its reason (a request chosen again is not counted):
        # "any" found no prefix, "late" its replica, "kept" the prefix where "late" went next
        assert router.reasons == {"least-loaded": 1, "prefix": 2}
        router._replicas = {}  # Ray's replica set, which state() lists
        assert router.state()["reasons"] == router.reasons
    finally:
        request_router._ROUTERS.remove(router)


def test_a_routed_prefix_stays_on_its_replica_until_that_replica_reports_after_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What sent a sixth of the routing benchmark's requests away from their prefix: a busy
    replica's reports lag its requests by seconds, and the router's memory of its own routing
    ended after 5 s, so the next request of a group found no replica holding it. The memory now
    lasts until the replica's first report read after the request finished; that report then
    decides. (Planted: the old 5 s memory fails the first check; a memory that ignores the
    reports fails the last.)"""
    import asyncio
    from types import SimpleNamespace

    from prefixserve.core.kv_events import KVSnapshot
    from prefixserve.serve_ray import request_router

    clock = [1_000.0]
    monkeypatch.setattr(request_router, "time", SimpleNamespace(monotonic=lambda: clock[0],
                                                                time=lambda: clock[0]))
    router = request_router.PrefixCacheRequestRouter.__new__(
        request_router.PrefixCacheRequestRouter)
    router.initialize_state(policy="prefix-aware")
    try:
        replicas = {rid: SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid),
                                         max_ongoing_requests=16, routing_stats={})
                    for rid in ("r0", "r1")}
        route = {"hashes": [(bytes([i]) * 8).hex() for i in range(3)]}

        def choose(request_id: str) -> str:
            pending = SimpleNamespace(kwargs={"route": route},
                                      routing_context=SimpleNamespace(should_backoff=False),
                                      metadata=SimpleNamespace(internal_request_id=request_id))
            ranks = asyncio.run(router.choose_replicas(list(replicas.values()), pending))  # type: ignore[arg-type]
            rid = ranks[0][0].replica_id.unique_id
            router.on_request_routed(pending, SimpleNamespace(unique_id=rid), None)  # type: ignore[arg-type]
            return str(rid)

        def report(rid: str, number: int) -> None:  # an empty cache, read at the clock's time
            snapshot = KVSnapshot(rid, "e", 0, frozenset()).to_wire()
            replicas[rid].routing_stats = {"epoch": "e", "seq": 0, "report": number,
                                           "at": clock[0], "batches": [], "snapshot": snapshot}

        first = choose("a")
        other = "r1" if first == "r0" else "r0"
        clock[0] += 30.0  # no report from the busy replica meanwhile
        assert choose("b") == first, "the next request of the prefix went elsewhere"
        router.on_request_completed(SimpleNamespace(unique_id=first), "a")  # type: ignore[arg-type]
        clock[0] += 1.0
        report(first, 1)  # read after "a" ended, "b" still running: "b" keeps it remembered
        assert choose("c") == first
        for request_id in ("b", "c"):
            router.on_request_completed(SimpleNamespace(unique_id=first), request_id)  # type: ignore[arg-type]
        router.in_flight[first] = 1  # busier, but within the balance rule
        clock[0] += 1.0
        report(first, 2)  # its cache as read after all three ended: the prefix is gone
        report(other, 1)
        assert choose("d") == other, "the memory outlived the replica's report"
    finally:
        request_router._ROUTERS.remove(router)


def test_a_burst_of_new_prompts_is_spread_before_ray_reports_them_routed() -> None:
    """Ray reports a request routed only after probing its replica, so loads counted from
    then on let a burst of new prompts all go to the same idle replica (the one with the most
    room), which then had too many groups to keep their next requests (the routing benchmark:
    three of eight system prompts on one of four replicas). A chosen request counts at once.
    (Planted: counting from ``on_request_routed`` sends both here to r0.)"""
    import asyncio
    from types import SimpleNamespace

    from prefixserve.core.kv_events import KVSnapshot
    from prefixserve.serve_ray import request_router

    router = request_router.PrefixCacheRequestRouter.__new__(
        request_router.PrefixCacheRequestRouter)
    router.initialize_state(policy="prefix-aware")
    try:
        snapshot = KVSnapshot("r1", "e", 0, frozenset({bytes([200 + i]) * 8 for i in range(5)}))
        replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid),
                                    max_ongoing_requests=16, routing_stats=stats)
                    for rid, stats in (("r0", {}), ("r1", {
                        "epoch": "e", "seq": 0, "report": 0, "at": 0.0, "batches": [],
                        "snapshot": snapshot.to_wire()}))]

        def choose(request_id: str, first: int) -> str:
            route = {"hashes": [(bytes([first + i]) * 8).hex() for i in range(3)]}
            pending = SimpleNamespace(kwargs={"route": route},
                                      routing_context=SimpleNamespace(should_backoff=False),
                                      metadata=SimpleNamespace(internal_request_id=request_id))
            ranks = asyncio.run(router.choose_replicas(replicas, pending))  # type: ignore[arg-type]
            return str(ranks[0][0].replica_id.unique_id)

        assert choose("a", 0) == "r0"  # equal loads: the replica with more room
        assert choose("b", 10) == "r1", "two new prompts went to one replica at once"
    finally:
        request_router._ROUTERS.remove(router)


def test_the_ingress_replays_run_time_adapter_requests_onto_new_replicas_only(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The latest load or unload of each name goes to every replica the ingress has not sent
    them to, once; an unload a new replica answers 404 (it never had the adapter) is nothing to
    report, a refused load is logged. (The cluster test covers a load end to end; this one the
    unload and the bookkeeping. Planted: replaying to every replica each time, or reporting
    the 404 of an unload, fails it.)"""
    import asyncio

    from starlette.responses import Response

    from prefixserve.serve_ray import ingress as ingress_module

    replicas = ["r0", "r1"]
    load, unload = ingress_module.LORA_ADMIN_PATHS
    monkeypatch.setattr(ingress_module.router_module, "known_replicas", lambda: list(replicas))
    sent: list[tuple[str, str, str]] = []

    async def on_replica(forwarded: dict[str, Any], rid: str) -> Response:
        name = json.loads(forwarded["body"])["lora_name"]
        sent.append((rid, forwarded["path"], name))
        if forwarded["path"] == unload:
            return Response(b"{}", status_code=404)  # no new replica has x
        return Response(b"gone", status_code=400) if rid == "r3" else Response(b"{}")

    ingress = ingress_module.Ingress.__new__(ingress_module.Ingress)
    ingress.adapters, ingress.replicas_with_adapters = {}, {"r0", "r1"}
    ingress.adapters_restored = True  # this ingress took the loads itself
    ingress.adapter_lock = asyncio.Lock()
    ingress._on_replica = on_replica  # type: ignore[method-assign]
    for path, name in ((load, "x"), (load, "y"), (unload, "x")):
        ingress.adapters[name] = {"path": path, "body": json.dumps({"lora_name": name})}
    asyncio.run(ingress._replay_adapters())
    assert sent == []  # nothing new
    replicas.append("r2")
    asyncio.run(ingress._replay_adapters())
    assert sent == [("r2", unload, "x"), ("r2", load, "y")]
    asyncio.run(ingress._replay_adapters())
    assert len(sent) == 2  # r2 is not asked again
    replicas.append("r3")
    with caplog.at_level("WARNING", logger=ingress_module.__name__):
        asyncio.run(ingress._replay_adapters())
    assert sent[2:] == [("r3", unload, "x"), ("r3", load, "y")]
    assert [r.getMessage() for r in caplog.records] == ["replica r3 refused adapter 'y': gone"]


def test_a_new_ingress_reads_the_run_time_adapters_back_from_the_replicas(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An ingress Ray Serve started after another died knows no run-time adapter: before its
    first replay it asks every live replica what it took (``EngineReplica.adapter_requests``),
    once. A replica that holds all of them is up to date; one that lacks some (it started
    while no ingress ran) gets them replayed; a replica that died meanwhile is skipped.
    (Planted: no read-back replays nothing and fails; reading on every request fails the
    count of calls.)"""
    import asyncio
    from types import SimpleNamespace

    from ray.exceptions import RayActorError
    from starlette.responses import Response

    from prefixserve.serve_ray import ingress as ingress_module

    load = ingress_module.LORA_ADMIN_PATHS[0]
    x, y = ({"path": load, "body": json.dumps({"lora_name": name})} for name in "xy")
    held = {"r0": {"x": x, "y": y}, "r1": {}, "r2": {"x": x, "y": y}, "r3": {}}
    asked: list[str] = []

    async def adapter_requests(replica: str) -> dict[str, Any]:
        asked.append(replica)
        if replica == "r2":
            raise RayActorError()
        return held[replica]

    sent: list[tuple[str, str]] = []

    async def on_replica(forwarded: dict[str, Any], rid: str) -> Response:
        sent.append((rid, json.loads(forwarded["body"])["lora_name"]))
        return Response(b"{}")

    replicas = ["r0", "r1", "r2"]
    monkeypatch.setattr(ingress_module.router_module, "known_replicas", lambda: list(replicas))
    ingress = ingress_module.Ingress.__new__(ingress_module.Ingress)
    ingress.engine = SimpleNamespace(  # type: ignore[assignment]
        adapter_requests=SimpleNamespace(remote=adapter_requests))
    ingress.adapters, ingress.replicas_with_adapters = {}, set()
    ingress.adapters_restored = False
    ingress.adapter_lock = asyncio.Lock()
    ingress._on_replica = on_replica  # type: ignore[method-assign]
    asyncio.run(ingress._replay_adapters())
    assert asked == ["r0", "r1", "r2"]
    assert ingress.adapters == {"x": x, "y": y}
    assert sent == [("r1", "x"), ("r1", "y"), ("r2", "x"), ("r2", "y")]
    replicas.append("r3")
    asyncio.run(ingress._replay_adapters())
    assert asked == ["r0", "r1", "r2"]  # read once
    assert sent[4:] == [("r3", "x"), ("r3", "y")]
