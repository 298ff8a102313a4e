"""The cache tiers end to end, on real servers (float32, the default model): a restart finds
its blocks on disk, two servers share blocks through one real Redis, tenants' salts separate
them in every tier, and a tier that fails never fails a request (docs/tiers.md)."""

from __future__ import annotations

import itertools
import random
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis_helpers import RedisServer
from server_helpers import HTTP, ServerProcess, idle, remount, small_filesystem

pytestmark = pytest.mark.slow

_RNG = random.Random(15)
PROMPT = [_RNG.randrange(200, 40000) for _ in range(2000)]
KEYS = ["--api-key", "tenant-one", "--api-key", "tenant-two", "--admin-key", "admin"]
ARGS = ["--dtype", "float32", "--log-stats-interval", "0", "--kv-tier-retry-after", "1",
        "--kv-tier-timeout", "5", *KEYS]
STORED = "prefixserve:kv_tier_stored_blocks_total{tier=%s}"
FULL_BLOCKS = (len(PROMPT) - 1) // 16  # the lookup leaves the last token to compute


def complete(server: ServerProcess, prompt: list[int], key: str = "tenant-one",
             max_tokens: int = 8) -> dict[str, Any]:
    response = HTTP.post(server.url + "/v1/completions", timeout=300,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def cached(body: dict[str, Any]) -> tuple[int, dict[str, int]]:
    details = body["usage"]["prompt_tokens_details"]
    return details["cached_tokens"], details["cached_tokens_by_tier"]


def tier_metrics(server: ServerProcess) -> dict[str, float]:
    return {k: v for k, v in server.metrics().items() if "kv_tier" in k}


def text(body: dict[str, Any]) -> str:
    return body["choices"][0]["text"]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer
              ) -> tuple[Path, dict[str, Any]]:
    """A server with a disk tier and the Redis tier computes the 2,000-token prompt (nothing
    cached anywhere), writes its blocks to both and stops: the disk directory and the reply,
    for the restart and the sharing tests (one cold prompt and one server for both)."""
    workdir = tmp_path_factory.mktemp("first")
    disk = workdir / "kv"
    args = [*ARGS, "--kv-disk-dir", str(disk), "--kv-redis-url", redis_server.url]
    server = ServerProcess(args, workdir / "first.log").start()
    try:
        first = complete(server, PROMPT)
        assert cached(first) == (0, {"pool": 0, "disk": 0, "redis": 0})
        server.wait_for_metrics(lambda m: min(m[STORED % "disk"], m[STORED % "redis"])
                                >= FULL_BLOCKS, timeout=120)
    finally:
        assert server.stop() == 0
    return disk, first


def test_a_restart_finds_the_prompt_on_disk_and_a_corrupt_file_is_skipped(
        tmp_path: Path, first_run: tuple[Path, dict[str, Any]]) -> None:
    """After the first run stopped, a server starts again on the same directory: >= 1,984
    tokens of the 2,000-token prompt come from the disk tier and the greedy output is the same.
    Then one block file is damaged and the pool emptied: the lookup stops at that block (a
    miss, counted), the output is still the same."""
    disk, first = first_run
    args = [*ARGS, "--kv-disk-dir", str(disk)]
    server = ServerProcess(args, tmp_path / "second.log").start()
    try:
        again = complete(server, PROMPT)
        total, by_tier = cached(again)
        assert total >= 1984 and by_tier["disk"] == total and by_tier["pool"] == 0, (
            tier_metrics(server))
        assert text(again) == text(first)

        block = FULL_BLOCKS - 3
        damaged = _block_file(disk, PROMPT[block * 16:(block + 1) * 16])
        data = bytearray(damaged.read_bytes())
        data[len(data) // 2] ^= 0xFF
        damaged.write_bytes(bytes(data))
        reset = HTTP.post(server.url + "/reset_prefix_cache", timeout=30,
                           headers={"Authorization": "Bearer admin"})
        assert reset.status_code == 200
        third = complete(server, PROMPT)
        total, by_tier = cached(third)
        assert total == by_tier["disk"] == block * 16
        assert text(third) == text(first)
        metrics = server.wait_for_metrics(idle)
        assert metrics["prefixserve:kv_tier_corrupt_blocks_total{tier=disk}"] == 1
        assert damaged.read_bytes() != bytes(data)  # deleted, then written again whole
    finally:
        assert server.stop() == 0


def _block_file(disk: Path, tokens: list[int]) -> Path:
    """The record file of the block holding ``tokens`` (read from the records' headers: a
    22-byte header, then the token ids as int64)."""
    for path in disk.rglob("*.kv"):
        head = path.read_bytes()[:22 + 8 * len(tokens)]
        if [int.from_bytes(head[22 + 8 * i:30 + 8 * i], "little", signed=True)
                for i in range(len(tokens))] == tokens:
            return path
    raise AssertionError("no record file holds the block")


def test_two_servers_share_blocks_through_redis_but_not_across_tenants(
        tmp_path: Path, redis_server: RedisServer, first_run: tuple[Path, dict[str, Any]]
        ) -> None:
    """Server B's first request on the prompt the first run computed (on another server, A)
    takes A's blocks from Redis, with the same output; another tenant's request on B finds
    nothing in any tier (its salt makes other keys)."""
    _, first = first_run
    args = [*ARGS, "--kv-redis-url", redis_server.url, "--kv-disk-dir", str(tmp_path / "kv-b")]
    server_b = ServerProcess(args, tmp_path / "b.log")
    try:
        server_b.start()
        shared = complete(server_b, PROMPT)
        total, by_tier = cached(shared)
        assert total >= 1984 and by_tier["redis"] == total, tier_metrics(server_b)
        assert text(shared) == text(first)

        other = complete(server_b, PROMPT[:600], key="tenant-two", max_tokens=1)
        assert cached(other) == (0, {"pool": 0, "disk": 0, "redis": 0})
        assert server_b.wait_for_metrics(idle)
    finally:
        assert server_b.stop() == 0


UP = "prefixserve:kv_tier_up{tier=redis}"
REDIS_HITS = "prefixserve:kv_tier_hit_blocks_total{tier=redis}"
_STREAM_RNG = random.Random(16)
STREAM_PROMPTS = [[_STREAM_RNG.randrange(200, 40000) for _ in range(48)] for _ in range(8)]
"""8 prompts of 3 blocks, cycled by 3 clients: a 20-block pool (12 of them held by the running
requests) keeps about two, so each prompt comes back after the pool evicted it and its blocks
come from Redis while Redis is up."""


class _Stream:
    """``workers`` threads sending the prompts in turn until ``stop``; every reply is kept with
    the time it came, and any error (a status other than 200, a broken connection)."""

    def __init__(self, server: ServerProcess, workers: int = 3) -> None:
        self.server = server
        self.turn = itertools.count()
        self.replies: list[tuple[float, int, str]] = []
        self.errors: list[str] = []
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self._work) for _ in range(workers)]

    def _work(self) -> None:
        with httpx.Client(base_url=self.server.url, timeout=120,
                          headers={"Authorization": "Bearer tenant-one"}) as client:
            while not self.done.is_set():
                index = next(self.turn) % len(STREAM_PROMPTS)
                try:
                    response = client.post("/v1/completions", json={
                        "prompt": STREAM_PROMPTS[index], "max_tokens": 3, "temperature": 0})
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                    continue
                if response.status_code != 200:
                    self.errors.append(response.text)
                    continue
                self.replies.append((time.monotonic(), index, text(response.json())))

    def __enter__(self) -> _Stream:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        for thread in self.threads:
            thread.join(150)

    def finished_since(self, moment: float) -> int:
        return sum(1 for when, _, _ in self.replies if when > moment)


def test_redis_killed_mid_run_fails_no_request_and_its_hits_come_back(
        tmp_path: Path, redis_server: RedisServer) -> None:
    """Three clients send requests without pause to a server with a small pool and a Redis
    tier; Redis is killed (SIGKILL) while requests (and their tier reads and writes) are in
    flight, and starts again (empty). No request fails, requests finish while Redis is down,
    ``kv_tier_up`` goes to 0 and back to 1, blocks come from Redis again after the restart,
    each prompt's greedy output stays the same whether its blocks were computed or loaded (the
    deterministic mode), and no pool block is left held."""
    args = [*ARGS, "--kv-redis-url", redis_server.url, "--num-blocks", "20",
            "--kv-tier-min-prefix-tokens", "0", "--deterministic"]
    server = ServerProcess(args, tmp_path / "outage.log")
    try:
        server.start()
        with _Stream(server) as stream:
            server.wait_for_metrics(lambda m: m[REDIS_HITS] > 0, timeout=300)
            server.wait_for_metrics(lambda m: m["prefixserve:num_requests_running"] > 0)
            stopped = time.monotonic()
            redis_server.stop(kill=True)
            down = server.wait_for_metrics(lambda m: m[UP] == 0)
            assert down["prefixserve:kv_tier_down_events_total{tier=redis}"] == 1
            _wait_for(lambda: stream.finished_since(stopped) >= 4 or bool(stream.errors))
            restarted = time.monotonic()
            redis_server.start()
            hits = server.wait_for_metrics(lambda m: m[UP] == 1)[REDIS_HITS]
            server.wait_for_metrics(lambda m: m[REDIS_HITS] > hits, timeout=300)
        assert not stream.errors, stream.errors[:3]
        assert sum(1 for when, _, _ in stream.replies if stopped < when < restarted) >= 4
        texts: dict[int, set[str]] = {}
        for _, index, output in stream.replies:
            texts.setdefault(index, set()).add(output)
        assert all(len(outputs) == 1 for outputs in texts.values()), texts
        assert server.wait_for_metrics(idle)
    finally:
        assert server.stop() == 0


def _wait_for(condition: Callable[[], bool], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_a_full_disk_stops_the_writes_and_serving_goes_on(tmp_path: Path) -> None:
    """The disk tier on a real 2 MiB file system (room for two float32 block records) with a
    budget of 1 GiB: the third write of the first prompt finds no room. The tier is marked full
    (``kv_tier_writable`` 0, a log line), not down; every request succeeds; the blocks stored
    before still load; no temporary file is left and the file count is what was stored."""
    disk = tmp_path / "kv"
    disk.mkdir()
    wrapper = small_filesystem(disk, "2m")
    if wrapper is None:
        pytest.skip("cannot mount a small tmpfs: this kernel allows neither an unprivileged user "
                    "namespace nor (not root) a mount namespace")
    args = [*ARGS, "--kv-disk-dir", str(disk), "--kv-disk-size", "1GiB",
            "--kv-tier-min-prefix-tokens", "0"]
    server = ServerProcess(args, tmp_path / "full.log", wrapper=wrapper).start()
    try:
        prompts = [[_RNG.randrange(200, 40000) for _ in range(160)] for _ in range(3)]
        first = complete(server, prompts[0], max_tokens=2)
        # the tier is marked full inside the write, and the write's counts land just after it
        full = server.wait_for_metrics(
            lambda m: m["prefixserve:kv_tier_writable{tier=disk}"] == 0
            and m["prefixserve:kv_tier_dropped_writes_total{tier=disk}"] > 0)
        stored = int(full[STORED % "disk"])
        assert full["prefixserve:kv_tier_up{tier=disk}"] == 1
        assert full["prefixserve:kv_tier_full_events_total{tier=disk}"] == 1
        assert 1 <= stored <= 2 and full["prefixserve:kv_tier_dropped_writes_total{tier=disk}"]
        assert "KV tier disk is full (ENOSPC" in server.log
        for prompt in prompts[1:]:
            complete(server, prompt, max_tokens=2)
        reset = HTTP.post(server.url + "/reset_prefix_cache", timeout=30,
                           headers={"Authorization": "Bearer admin"})
        assert reset.status_code == 200
        again = complete(server, prompts[0], max_tokens=2)
        assert cached(again) == (stored * 16, {"pool": 0, "disk": stored * 16})
        assert text(again) == text(first)
        metrics = server.wait_for_metrics(idle)
        assert metrics[STORED % "disk"] == stored
        files = [p.name for p in _seen_by(server, disk).rglob("*") if p.is_file()]
        assert len(files) == stored and all(name.endswith(".kv") for name in files), files
    finally:
        assert server.stop() == 0


def _seen_by(server: ServerProcess, path: Path) -> Path:
    """``path`` as the server's mount namespace sees it."""
    return Path(f"/proc/{server.process.pid}/root") / path.relative_to("/")


def test_a_disk_tier_made_read_only_while_serving_keeps_its_hits_and_writes_again_after(
        tmp_path: Path) -> None:
    """The disk tier's file system is remounted read-only under a running server, then
    writable again. While read-only: every request succeeds, the tier is up but not writable
    (one write stop counted, no down event, a log line saying read-only), and the blocks it
    holds still load (the first prompt, its pool blocks reset, is served from disk with the same
    greedy text). Writable again: the next write after ``--kv-tier-retry-after`` goes through."""
    disk = tmp_path / "kv"
    disk.mkdir()
    wrapper = small_filesystem(disk, "64m")
    if wrapper is None or shutil.which("nsenter") is None:
        pytest.skip("cannot mount a tmpfs in a namespace of its own here")
    args = [*ARGS, "--kv-disk-dir", str(disk), "--kv-tier-min-prefix-tokens", "0"]
    server = ServerProcess(args, tmp_path / "read-only.log", wrapper=wrapper).start()
    writable, up = "prefixserve:kv_tier_writable{tier=disk}", "prefixserve:kv_tier_up{tier=disk}"
    try:
        prompts = [[_RNG.randrange(200, 40000) for _ in range(160)] for _ in range(3)]
        first = complete(server, prompts[0], max_tokens=2)
        stored = server.wait_for_metrics(lambda m: m[STORED % "disk"] >= 9)[STORED % "disk"]
        remount(server.process.pid, disk, "ro")
        complete(server, prompts[1], max_tokens=2)
        refused = server.wait_for_metrics(lambda m: m[writable] == 0)
        assert refused[up] == 1 and refused[STORED % "disk"] == stored
        assert refused["prefixserve:kv_tier_down_events_total{tier=disk}"] == 0
        assert refused["prefixserve:kv_tier_full_events_total{tier=disk}"] == 1
        assert "KV tier disk is read-only (EROFS" in server.log
        reset = HTTP.post(server.url + "/reset_prefix_cache", timeout=30,
                           headers={"Authorization": "Bearer admin"})
        assert reset.status_code == 200
        again = complete(server, prompts[0], max_tokens=2)
        assert cached(again) == (9 * 16, {"pool": 0, "disk": 9 * 16})
        assert text(again) == text(first)
        remount(server.process.pid, disk, "rw")
        time.sleep(1.2)  # --kv-tier-retry-after 1
        complete(server, prompts[2], max_tokens=2)
        back = server.wait_for_metrics(lambda m: m[writable] == 1
                                       and m[STORED % "disk"] > stored)
        assert back[up] == 1 and "KV tier disk takes writes again" in server.log
        server.wait_for_metrics(idle)
    finally:
        assert server.stop() == 0
