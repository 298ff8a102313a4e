"""The cache tiers end to end, on real servers (float32, the default model): a restart finds
its blocks on disk, two servers share blocks through one real Redis, tenants' salts separate
them in every tier, and a tier that fails never fails a request (docs/DESIGN.md section 17)."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis_helpers import RedisServer
from server_helpers import ServerProcess, idle

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
    response = httpx.post(server.url + "/v1/completions", timeout=300,
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


def test_a_restart_finds_the_prompt_on_disk_and_a_corrupt_file_is_skipped(tmp_path: Path
                                                                          ) -> None:
    """Serve a 2,000-token prompt, stop, start again on the same directory: >= 1,984 tokens
    come from the disk tier and the greedy output is the same. Then one block file is damaged
    and the pool emptied: the lookup stops at that block (a miss, counted), the output is still
    the same."""
    disk = tmp_path / "kv"
    args = [*ARGS, "--kv-disk-dir", str(disk)]
    first_server = ServerProcess(args, tmp_path / "first.log").start()
    try:
        first = complete(first_server, PROMPT)
        assert cached(first) == (0, {"pool": 0, "disk": 0})
        first_server.wait_for_metrics(lambda m: m[STORED % "disk"] >= FULL_BLOCKS, timeout=120)
    finally:
        assert first_server.stop() == 0
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
        reset = httpx.post(server.url + "/reset_prefix_cache", timeout=30,
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


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


def test_two_servers_share_blocks_through_redis_but_not_across_tenants(
        tmp_path: Path, redis_server: RedisServer) -> None:
    """Server B's first request on A's prompt takes the blocks A wrote to Redis, with the same
    output; another tenant's request on B finds nothing in any tier (its salt makes other
    keys). Then Redis stops: requests still succeed, the tier is marked down; Redis comes
    back: the tier is up again."""
    args = [*ARGS, "--kv-redis-url", redis_server.url]
    server_a = ServerProcess(args, tmp_path / "a.log")
    server_b = ServerProcess([*args, "--kv-disk-dir", str(tmp_path / "kv-b")], tmp_path / "b.log")
    try:
        server_a.start()
        server_b.start()
        first = complete(server_a, PROMPT)
        server_a.wait_for_metrics(lambda m: m[STORED % "redis"] >= FULL_BLOCKS, timeout=120)
        shared = complete(server_b, PROMPT)
        total, by_tier = cached(shared)
        assert total >= 1984 and by_tier["redis"] == total, tier_metrics(server_b)
        assert text(shared) == text(first)

        other = complete(server_b, PROMPT[:600], key="tenant-two", max_tokens=1)
        assert cached(other) == (0, {"pool": 0, "disk": 0, "redis": 0})

        _redis_outage(server_a, redis_server)
        assert server_a.wait_for_metrics(idle)
    finally:
        server_a.stop()
        server_b.stop()


def _redis_outage(server: ServerProcess, redis_server: RedisServer) -> None:
    up = "prefixserve:kv_tier_up{tier=redis}"
    rng = random.Random(16)
    prompt = [rng.randrange(200, 40000) for _ in range(300)]
    later = [rng.randrange(200, 40000) for _ in range(300)]
    redis_server.stop()
    complete(server, prompt, max_tokens=2)
    metrics = server.wait_for_metrics(lambda m: m[up] == 0)
    assert metrics["prefixserve:kv_tier_down_events_total{tier=redis}"] == 1
    redis_server.start()
    time.sleep(1.2)  # --kv-tier-retry-after 1
    complete(server, later, max_tokens=2)  # its lookup probes Redis again
    server.wait_for_metrics(lambda m: m[up] == 1, timeout=10)
