"""Chaos on 127.0.0.1: processes die and cache tiers fail while clients stream; nothing may be
lost.

Each scenario runs real processes under a steady load of streamed chat completions (clients
that send one request after another: four shared system prompts, each with its own question)
and injects one fault:

* ``redis-kill``: the Redis tier's ``redis-server`` is killed (SIGKILL), then started again;
* ``disk-read-only``: the disk tier's file system (a tmpfs in the server's own mount namespace)
  is remounted read-only, then writable again;
* ``disk-corrupt``: every block file of the disk tier is overwritten with garbage (Redis
  flushed and the pool reset, so that lookups reach them);
* ``hostile``: a 200-level nested ``json_schema``, then an 8,000-token prompt with short
  requests behind it, then more prompts in one request than the waiting queue holds;
* ``replica-kill``: ``serve --replicas 2`` on a local Ray cluster; one replica is killed
  (SIGKILL) and Ray Serve starts another;
* ``ingress-kill``: the same cluster's ingress is killed (SIGKILL) and Ray Serve starts another
  (the note says when a request sent right after the kill was answered).

For each it prints: requests sent, completed, failed with a clear error (an API error body, or
an error event ending a started stream), lost (no answer: a refused or cut connection, a
timeout), 5xx answers, the completion rate over the 10 s before the fault, and the recovery
time: from the fault until the rate over 5 s is back to 90% of that (0 when it never fell).
The tier scenarios also wait for the tier's own gauge (``kv_tier_up`` / ``kv_tier_writable``)
to come back and say how long that took. Lost and 5xx must be 0; the exit status is 1 if not.

Usage (about 8 minutes on 2 cores; the Ray scenarios about 5 of them)::

    .venv/bin/python benchmarks/chaos.py [--only redis-kill,replica-kill] [--clients 8]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))
from hostile_clients import Server  # noqa: E402
from redis_helpers import RedisServer  # noqa: E402

ADMIN = "chaos-admin"
SYSTEMS = [f"You are assistant number {i} of a help desk. Answer in one short sentence, "
           f"politely, and never make up facts. Topic {i}: " + "details " * 40 for i in range(4)]
SCENARIOS = ("redis-kill", "disk-read-only", "disk-corrupt", "hostile", "replica-kill",
             "ingress-kill")


@dataclass
class Outcome:
    sent: float
    done: float = 0.0
    kind: str = ""
    """``ok``, ``error`` (a clear error) or ``lost``."""
    status: int = 0


class Load:
    """``clients`` threads streaming chat completions one after another, recording each."""

    def __init__(self, url: str, clients: int, headers: dict[str, str] | None = None,
                 model: str | None = None) -> None:
        self.url = url
        self.headers = headers or {}
        self.model = model
        self.outcomes: list[Outcome] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._work, args=(c,), daemon=True)
                        for c in range(clients)]
        for thread in self.threads:
            thread.start()

    def _work(self, client: int) -> None:
        n = 0
        with httpx.Client(timeout=120, headers=self.headers) as http:
            while not self.stopping.is_set():
                n += 1
                self._one(http, SYSTEMS[(client + n) % len(SYSTEMS)], f"Question {client}.{n}?")

    def _one(self, http: httpx.Client, system: str, question: str) -> None:
        outcome = Outcome(time.monotonic())
        body: dict[str, Any] = {"messages": [{"role": "system", "content": system},
                                             {"role": "user", "content": question}],
                                "max_tokens": 12, "stream": True}
        if self.model:
            body["model"] = self.model
        try:
            with http.stream("POST", self.url + "/v1/chat/completions", json=body) as response:
                outcome.status = response.status_code
                lines = [line for line in response.iter_lines() if line]
            outcome.kind = classify(response.status_code, lines)
        except httpx.HTTPError:
            outcome.kind = "lost"
        outcome.done = time.monotonic()
        with self.lock:
            self.outcomes.append(outcome)

    def stop(self) -> list[Outcome]:
        self.stopping.set()
        for thread in self.threads:
            thread.join(180)
        return self.outcomes

    def rate(self, start: float, end: float) -> float:
        with self.lock:
            return sum(start <= o.done < end and o.kind == "ok"
                       for o in self.outcomes) / (end - start)


def classify(status: int, lines: list[str]) -> str:
    """``ok`` for a whole stream, ``error`` for an API error body or an error event, else
    ``lost`` (a stream that just stops)."""
    if status != 200:
        try:
            return "error" if "error" in json.loads("".join(lines)) else "lost"
        except ValueError:
            return "lost"
    if lines and lines[-1] == "data: [DONE]":
        return "error" if any(_error_event(line) for line in lines[-2:]) else "ok"
    return "error" if any(line.startswith("event: error") for line in lines) else "lost"


def _error_event(line: str) -> bool:
    """Whether ``line`` is a ``data:`` event of an error object (a token's text may be
    ``"error"`` too)."""
    try:
        return line.startswith("data: {") and "error" in json.loads(line.removeprefix("data: "))
    except ValueError:
        return False


@dataclass
class Row:
    scenario: str
    outcomes: list[Outcome]
    rate_before: float
    recovery_s: float | None
    note: str = ""

    def cells(self) -> list[str]:
        kinds = [o.kind for o in self.outcomes]
        fivexx = sum(o.status >= 500 for o in self.outcomes)
        recovery = "never" if self.recovery_s is None else f"{self.recovery_s:.1f}"
        return [self.scenario, str(len(kinds)), str(kinds.count("ok")),
                str(kinds.count("error")), str(kinds.count("lost")), str(fivexx),
                f"{self.rate_before:.2f}", recovery, self.note]

    @property
    def bad(self) -> bool:
        return any(o.kind == "lost" or o.status >= 500 for o in self.outcomes)


def recovery(load: Load, fault: float, before: float, until: float) -> float | None:
    """Seconds from ``fault`` to the end of the first 5 s window at >= 90% of ``before``, less
    the window (0 when the rate never fell); None when it never came back by ``until``."""
    t = fault + 5.0
    while t <= until:
        if load.rate(t - 5.0, t) >= 0.9 * before:
            return max(0.0, t - 5.0 - fault)
        t += 0.5
    return None


def run_fault(name: str, load: Load, inject: Callable[[], str], settle_s: float,
              after_s: float) -> Row:
    """Load for ``settle_s``, the fault, load for ``after_s``: a row of the table."""
    time.sleep(settle_s)
    fault = time.monotonic()
    before = load.rate(fault - 10.0, fault)
    note = inject()
    time.sleep(max(0.0, fault + after_s - time.monotonic()))
    outcomes = load.stop()
    return Row(name, outcomes, before, recovery(load, fault, before, time.monotonic()), note)


def tier_gauge(url: str, gauge: str, tier: str) -> float | None:
    """``prefixserve:kv_tier_<gauge>`` of ``tier`` now."""
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(f"prefixserve:kv_tier_{gauge}{{") and f'tier="{tier}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def wait_gauge(url: str, gauge: str, tier: str, wanted: float, timeout: float = 120.0
               ) -> float | None:
    """Seconds until the tier's gauge reads ``wanted`` (None if it never does)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if tier_gauge(url, gauge, tier) == wanted:
            return time.monotonic() - start
        time.sleep(0.1)
    return None


def seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


# ----------------------------------------------------------------------------- the tiers


@contextmanager
def tier_server(folder: Path) -> Iterator[tuple[Server, RedisServer, Path]]:
    """One server with a disk tier on a tmpfs of its own (256 MiB, the tier's budget 160 MiB)
    and a Redis tier."""
    from server_helpers import small_filesystem

    disk = folder / "kv"
    disk.mkdir()
    wrapper = small_filesystem(disk, "256m")
    if wrapper is None:
        raise SystemExit("cannot mount a tmpfs in a namespace of its own here")
    redis = RedisServer(folder).start()
    server = Server(["--admin-key", ADMIN, "--kv-disk-dir", str(disk), "--kv-redis-url",
                     redis.url, "--kv-tier-min-prefix-tokens", "0", "--kv-tier-retry-after",
                     "2", "--num-blocks", "1024", "--kv-disk-size", "160MiB"],
                    folder / "tiers.log")
    server.command = [*wrapper, *server.command]
    try:
        yield server.start(), redis, disk
    finally:
        print(f"server exit status {server.stop()}")
        redis.stop()


def redis_kill(server: Server, redis: RedisServer, clients: int) -> Row:
    def inject() -> str:
        redis.stop(kill=True)
        down = wait_gauge(server.url, "up", "redis", 0.0)
        time.sleep(5.0)
        redis.start()
        back = wait_gauge(server.url, "up", "redis", 1.0)
        return f"tier down after {seconds(down)}; up {seconds(back)} after the restart"

    return run_fault("redis-kill", Load(server.url, clients), inject, 12.0, 30.0)


def disk_read_only(server: Server, disk: Path, clients: int) -> Row:
    from server_helpers import remount

    assert server.process is not None
    pid = server.process.pid

    def inject() -> str:
        remount(pid, disk, "ro")
        refused = wait_gauge(server.url, "writable", "disk", 0.0)
        up = tier_gauge(server.url, "up", "disk")
        time.sleep(5.0)
        remount(pid, disk, "rw")
        back = wait_gauge(server.url, "writable", "disk", 1.0)
        return (f"not writable after {seconds(refused)} (up: {up:g}); writable "
                f"{seconds(back)} after the remount")

    return run_fault("disk-read-only", Load(server.url, clients), inject, 8.0, 25.0)


def disk_corrupt(server: Server, redis: RedisServer, disk: Path, clients: int) -> Row:
    assert server.process is not None
    view = Path(f"/proc/{server.process.pid}/root") / disk.relative_to("/")

    def inject() -> str:
        files = 0
        for path in view.rglob("*.kv"):
            try:  # the tier may evict a file meanwhile
                path.write_bytes(os.urandom(path.stat().st_size))
                files += 1
            except FileNotFoundError:
                continue
        redis.client().flushall()  # so that the lookups past the pool reach the disk
        httpx.post(server.url + "/reset_prefix_cache", timeout=60,
                   headers={"Authorization": f"Bearer {ADMIN}"}).raise_for_status()
        time.sleep(10.0)
        corrupt = tier_gauge(server.url, "corrupt_blocks_total", "disk")
        return (f"{files} files overwritten, Redis flushed, pool reset; corrupt blocks "
                f"counted: {corrupt:g}")

    return run_fault("disk-corrupt", Load(server.url, clients), inject, 8.0, 25.0)


def hostile(server: Server, clients: int) -> Row:
    def inject() -> str:
        schema: dict[str, Any] = {"type": "string"}
        for _ in range(200):
            schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        notes = []
        with httpx.Client(base_url=server.url, timeout=300) as http:
            deep = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "deep", "schema": schema}}})
            after = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
            notes.append(f"deep schema {deep.status_code}, same connection then "
                         f"{after.status_code}")
            long_prompt = [1000 + (i * 7919) % 30000 for i in range(8000)]
            started = time.monotonic()
            result: list[int] = []
            thread = threading.Thread(target=lambda: result.append(httpx.post(
                server.url + "/v1/completions", timeout=600,
                json={"prompt": long_prompt, "max_tokens": 1}).status_code))
            thread.start()
            time.sleep(1.0)
            short = time.monotonic()
            http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
            short_s = time.monotonic() - short
            thread.join()
            notes.append(f"8,000-token prompt {result[0]} in {time.monotonic() - started:.1f} "
                         f"s, a short request behind it {short_s:.1f} s")
        return "; ".join(notes)

    return run_fault("hostile", Load(server.url, clients), inject, 8.0, 30.0)


# ----------------------------------------------------------------------------- Ray Serve


def ray_cluster(folder: Path) -> Server:
    server = Server(["--replicas", "2", "--admin-key", ADMIN, "--dtype", "float32",
                     "--max-num-seqs", "8", "--num-threads", "1", "--num-blocks", "512",
                     "--max-model-len", "1024", "--ray-num-cpus", "2",
                     "--ray-replica-cpus", "0.5"], folder / "ray.log")
    return server.start()


def replicas(server: Server) -> list[dict[str, Any]]:
    response = httpx.get(server.url + "/router/replicas", timeout=60,
                         headers={"Authorization": f"Bearer {ADMIN}"})
    response.raise_for_status()
    live: list[dict[str, Any]] = response.json()["replicas"]
    return live


def replica_kill(server: Server, clients: int) -> Row:
    def inject() -> str:
        victim = replicas(server)[0]
        os.kill(victim["pid"], signal.SIGKILL)
        start = time.monotonic()
        while time.monotonic() - start < 120:
            live = [r for r in replicas(server) if r["id"] != victim["id"]]
            if len(live) == 2:
                return f"a new replica routed to {time.monotonic() - start:.1f} s after the kill"
            time.sleep(0.5)
        return "no second replica within 120 s"

    return run_fault("replica-kill", Load(server.url, clients), inject, 20.0, 60.0)


def ingress_kill(server: Server, clients: int) -> Row:
    title = b"ray::ServeReplica:prefixserve:PrefixserveIngress"

    def inject() -> str:
        pids = sorted(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                      and _cmdline(p).startswith(title))
        os.kill(pids[0], signal.SIGKILL)
        killed = time.monotonic()
        # the front holds this request and sends it again until a new ingress answers it
        status = httpx.get(server.url + "/v1/models", timeout=120).status_code
        answer = "answered again" if status == 200 else f"a {status} answer"
        return (f"1 of {len(pids)} ingress processes killed; {answer} "
                f"{time.monotonic() - killed:.1f} s after")

    return run_fault("ingress-kill", Load(server.url, clients), inject, 15.0, 45.0)


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


# ----------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help=f"comma-separated scenarios of {', '.join(SCENARIOS)}")
    parser.add_argument("--clients", type=int, default=8,
                        help="clients streaming at once (default 8; 16 on the Ray cluster)")
    args = parser.parse_args()
    chosen = args.only.split(",") if args.only else list(SCENARIOS)
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(sorted(unknown))}")
    print("$ " + " ".join([Path(sys.executable).name, *sys.argv]), flush=True)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="prefixserve-chaos-") as tmp:
        folder = Path(tmp)
        if set(chosen) & {"redis-kill", "disk-read-only", "disk-corrupt", "hostile"}:
            with tier_server(folder) as (server, redis, disk):
                steps: dict[str, Callable[[], Row]] = {
                    "redis-kill": lambda: redis_kill(server, redis, args.clients),
                    "disk-read-only": lambda: disk_read_only(server, disk, args.clients),
                    "disk-corrupt": lambda: disk_corrupt(server, redis, disk, args.clients),
                    "hostile": lambda: hostile(server, args.clients)}
                rows += [steps[name]() for name in SCENARIOS if name in chosen and
                         name in steps]
                traceback = "Traceback" in server.log
        else:
            traceback = False
        if set(chosen) & {"replica-kill", "ingress-kill"}:
            cluster = ray_cluster(folder)
            try:
                if "replica-kill" in chosen:
                    rows.append(replica_kill(cluster, 2 * args.clients))
                if "ingress-kill" in chosen:
                    rows.append(ingress_kill(cluster, 2 * args.clients))
            finally:
                print(f"cluster exit status {cluster.stop()}")
    print_table(rows)
    if traceback:
        print("a traceback in the tier server's log")
    return 1 if traceback or any(row.bad for row in rows) else 0


def print_table(rows: list[Row]) -> None:
    header = ["scenario", "sent", "completed", "failed clearly", "lost", "5xx",
              "req/s before", "recovery s", "what happened"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row.cells()) + " |")


if __name__ == "__main__":
    sys.exit(main())
