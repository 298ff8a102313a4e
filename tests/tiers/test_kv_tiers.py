"""The cache tiers' parts without a model: records, the disk tier, the Redis tier (a real
``redis-server``), the chain's lookup rule and health, and the settings that guard them
(docs/tiers.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_helpers import RedisServer

from prefixserve.core.tiers import TierChain, decode_record, encode_record, tier_key
from prefixserve.engine.config import EngineConfig
from prefixserve.tiers.disk import DiskTier
from prefixserve.tiers.redis import RedisTier

pytestmark = pytest.mark.fast

NS = b"n" * 16
TOKENS = [[i * 4 + j for j in range(4)] for i in range(8)]
PAYLOAD = 64


def key(i: int) -> bytes:
    return tier_key(NS, bytes([i]) * 32)


def record(i: int) -> bytes:
    return encode_record(TOKENS[i], bytes([i]) * PAYLOAD)


# ---------------------------------------------------------------------- records
def test_a_record_round_trips() -> None:
    payload = decode_record(record(3), TOKENS[3], PAYLOAD)
    assert payload is not None and bytes(payload) == bytes([3]) * PAYLOAD


@pytest.mark.parametrize("damage", ["truncated", "flipped", "other_tokens", "other_size",
                                    "empty", "garbage"])
def test_a_damaged_record_is_never_a_payload(damage: str) -> None:
    good = record(2)
    tokens, size = TOKENS[2], PAYLOAD
    if damage == "truncated":
        data = good[:-1]
    elif damage == "flipped":
        data = good[:-5] + bytes([good[-5] ^ 1]) + good[-4:]
    elif damage == "other_tokens":
        data, tokens = good, TOKENS[3]
    elif damage == "other_size":
        data, size = good, PAYLOAD * 2
    elif damage == "empty":
        data = b""
    else:
        data = os.urandom(len(good))
    assert decode_record(data, tokens, size) is None


def test_tier_keys_of_builtin_hashes_are_8_bytes_after_the_namespace() -> None:
    assert tier_key(NS, -1) == NS + b"\xff" * 8
    assert tier_key(NS, 5) != tier_key(b"m" * 16, 5)


# ---------------------------------------------------------------------- disk
def test_disk_tier_finds_its_files_again_and_evicts_least_recently_used(tmp_path: Path
                                                                        ) -> None:
    size = len(record(0))
    disk = DiskTier(str(tmp_path), NS.hex(), capacity=3 * size)
    disk.store_many([(key(i), record(i)) for i in range(3)])
    disk.load_many([key(0)])  # 0 is now the most recently used
    disk.store_many([(key(3), record(3))])
    assert disk.contains_many([key(i) for i in range(4)]) == [True, False, True, True]
    assert disk.used <= disk.capacity
    again = DiskTier(str(tmp_path), NS.hex(), capacity=3 * size)
    assert again.contains_many([key(i) for i in range(4)]) == [True, False, True, True]
    assert again.load_many([key(3)]) == [record(3)]
    smaller = DiskTier(str(tmp_path), NS.hex(), capacity=size)  # a smaller budget at start
    assert len(smaller) == 1 and smaller.used == size


def test_disk_tier_namespaces_do_not_see_each_other(tmp_path: Path) -> None:
    DiskTier(str(tmp_path), "a" * 32, 1 << 20).store_many([(key(0), record(0))])
    assert DiskTier(str(tmp_path), "b" * 32, 1 << 20).contains_many([key(0)]) == [False]


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True)
    return done.returncode == 0


def test_a_full_disk_stops_the_writes_and_the_lookups_go_on(tmp_path: Path) -> None:
    """A real full file system (a 1 MiB tmpfs, mounted when the test may): the write fails,
    the tier is marked full (not down), nothing half-written stays, writes are dropped at once
    while it is full, and what was stored still loads through the chain."""
    mount = tmp_path / "small"
    if not _mount_tmpfs(mount, "1M"):
        pytest.skip("cannot mount a tmpfs here (not root); test_kv_tiers_server.py's disk-full "
                    "test mounts one in a user namespace")
    try:
        disk = DiskTier(str(mount), NS.hex(), capacity=1 << 30)  # a budget the disk lacks
        chain = TierChain([disk], retry_after=60)
        chain.store([(key(0), record(0))])
        # One batch: block 3 fits, block 1 (2 MiB) finds no room (ENOSPC).
        chain.store([(key(3), record(3)), (key(1), encode_record(TOKENS[1], b"x" * (2 << 20)))])
        stats = chain.snapshot()[0]
        assert stats.up and not stats.writable and stats.full_events == 1
        assert (stats.errors, stats.stored_blocks, stats.dropped_writes) == (1, 2, 1)
        assert not [p for p in mount.rglob("*") if p.name.endswith(".tmp")]
        chain.store([(key(2), record(2))])  # while full: dropped at once
        assert chain.snapshot()[0].dropped_writes == 2 and chain.snapshot()[0].errors == 1
        runs = chain.fetch([key(0)], TOKENS[:1], PAYLOAD)
        assert [bytes(p) for run in runs for p in run.payloads] == [bytes([0]) * PAYLOAD]
        assert chain.snapshot()[0].hit_blocks == 1 and disk.contains(key(3))
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_read_only_disk_stops_the_writes_the_lookups_go_on_and_writes_come_back(
        tmp_path: Path) -> None:
    """A real file system remounted read-only under the tier (EROFS, which root meets as any
    user does): the tier is not writable but up, what it holds still loads, and once the file
    system is writable again the next write after ``retry_after`` goes through."""
    mount = tmp_path / "ro"
    if not _mount_tmpfs(mount, "4M"):
        pytest.skip("cannot mount a tmpfs here (not root); test_kv_tiers_server.py's read-only "
                    "test mounts one in a user namespace")
    try:
        disk = DiskTier(str(mount), NS.hex(), capacity=1 << 30)
        chain = TierChain([disk], retry_after=0.0)
        chain.store([(key(0), record(0))])
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        chain.store([(key(3), record(3))])
        stats = chain.snapshot()[0]
        assert stats.up and not stats.writable and stats.down_events == 0, stats
        assert (stats.full_events, stats.stored_blocks, stats.dropped_writes) == (1, 1, 1)
        runs = chain.fetch([key(0)], TOKENS[:1], PAYLOAD)
        assert [bytes(p) for run in runs for p in run.payloads] == [bytes([0]) * PAYLOAD]
        subprocess.run(["mount", "-o", "remount,rw", str(mount)], check=True)
        chain.store([(key(3), record(3))])
        stats = chain.snapshot()[0]
        assert stats.up and stats.writable and stats.stored_blocks == 2 and disk.contains(key(3))
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_redis_out_of_memory_is_full_not_down(tmp_path: Path) -> None:
    """A real Redis that refuses writes past its memory (``noeviction``, 3 MiB): the tier is
    marked full, not down, its lookups still hit; once ``retry_after`` has passed and room was
    made, a write goes through and the tier takes writes again."""
    server = RedisServer(tmp_path, max_memory="3mb", policy="noeviction").start()
    now = [0.0]
    try:
        tier = RedisTier(server.url, ttl=60, timeout=2)
        chain = TierChain([tier], retry_after=5, clock=lambda: now[0])
        chain.store([(key(0), record(0))])
        big = [(key(i), encode_record(TOKENS[i], b"x" * (700 << 10))) for i in range(1, 8)]
        for item in big:  # until Redis refuses one
            chain.store([item])
            if not chain.snapshot()[0].writable:
                break
        stats = chain.snapshot()[0]
        assert stats.up and not stats.writable and stats.full_events == 1
        assert stats.dropped_writes == 1 and stats.stored_blocks < 1 + len(big)
        assert [len(r.payloads) for r in chain.fetch([key(0)], TOKENS[:1], PAYLOAD)] == [1]
        tier.evict_many([k for k, _ in big])
        chain.store([(key(2), record(2))])  # still within retry_after: dropped
        assert not chain.snapshot()[0].writable
        now[0] = 6.0
        chain.store([(key(2), record(2))])
        stats = chain.snapshot()[0]
        assert stats.writable and stats.down_events == 0 and tier.contains(key(2))
    finally:
        server.stop()


# ---------------------------------------------------------------------- the chain
@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


def test_redis_tier_stores_loads_and_evicts(redis_server: RedisServer) -> None:
    tier = RedisTier(redis_server.url, ttl=60, timeout=2)
    tier.store_many([(key(i), record(i)) for i in range(3)])
    assert tier.contains_many([key(0), key(5), key(2)]) == [True, False, True]
    assert tier.load_many([key(1), key(6)]) == [record(1), None]
    assert 0 < redis_server.client().ttl(b"prefixserve:kv:" + key(1)) <= 60
    tier.evict_many([key(1)])
    assert tier.contains_many([key(1)]) == [False]
    tier.close()


def test_the_lookup_takes_each_block_from_the_first_tier_and_stops_at_a_miss(
        tmp_path: Path, redis_server: RedisServer) -> None:
    """Blocks 0-1 on disk, 2-3 only in Redis, 4 nowhere, 5 on disk: the run is 0..3, the
    first two from the disk, the next two from Redis; block 5 is never reached."""
    disk = DiskTier(str(tmp_path), NS.hex(), 1 << 20)
    remote = RedisTier(redis_server.url, ttl=60, timeout=2)
    remote.evict_many([key(i) for i in range(8)])
    disk.store_many([(key(i), record(i)) for i in (0, 1, 5)])
    remote.store_many([(key(i), record(i)) for i in (1, 2, 3)])
    chain = TierChain([disk, remote])
    runs = chain.fetch([key(i) for i in range(6)], TOKENS[:6], PAYLOAD)
    assert [(run.tier, [bytes(p)[0] for p in run.payloads]) for run in runs] == [
        (0, [0, 1]), (1, [2, 3])]
    stats = chain.snapshot()
    assert (stats[0].hit_blocks, stats[1].hit_blocks) == (2, 2)


def test_a_corrupt_block_is_a_miss_counted_and_deleted(tmp_path: Path,
                                                       redis_server: RedisServer) -> None:
    """Block 1's file is damaged on disk: the disk run stops before it, Redis (which holds a
    good copy) serves it, and the bad file is gone."""
    disk = DiskTier(str(tmp_path), NS.hex(), 1 << 20)
    remote = RedisTier(redis_server.url, ttl=60, timeout=2)
    remote.evict_many([key(i) for i in range(8)])
    disk.store_many([(key(i), record(i)) for i in range(3)])
    remote.store_many([(key(1), record(1))])
    path = Path(disk._path(key(1)))
    path.write_bytes(path.read_bytes()[:-10])
    chain = TierChain([disk, remote])
    runs = chain.fetch([key(i) for i in range(3)], TOKENS[:3], PAYLOAD)
    assert [(run.tier, len(run.payloads)) for run in runs] == [(0, 1), (1, 1), (0, 1)]
    assert chain.snapshot()[0].corrupt_blocks == 1
    assert not path.exists() and disk.contains_many([key(1)]) == [False]


def test_a_dead_tier_is_a_miss_marked_down_and_tried_again_later(tmp_path: Path) -> None:
    """A Redis that is stopped, then started again: lookups miss and writes drop while it is
    down (no exception reaches the caller), and after ``retry_after`` it is up again."""
    server = RedisServer(tmp_path).start()
    now = [0.0]
    chain = TierChain([RedisTier(server.url, ttl=60, timeout=0.5)], retry_after=5,
                      clock=lambda: now[0])
    chain.store([(key(0), record(0))])
    server.stop()
    try:
        assert chain.fetch([key(0)], TOKENS[:1], PAYLOAD) == []
        stats = chain.snapshot()[0]
        assert not stats.up and stats.errors == 1 and stats.down_events == 1
        chain.store([(key(1), record(1))])
        assert chain.snapshot()[0].errors == 1  # not tried while down
        server.start()
        assert chain.fetch([key(1)], TOKENS[1:2], PAYLOAD) == []  # still within retry_after
        now[0] = 6.0
        chain.store([(key(1), record(1))])
        assert chain.snapshot()[0].up
        assert [len(r.payloads) for r in chain.fetch([key(1)], TOKENS[1:2], PAYLOAD)] == [1]
    finally:
        server.stop()


# ---------------------------------------------------------------------- settings
def test_a_tier_with_the_per_process_builtin_hash_is_refused() -> None:
    code = ("from prefixserve.engine.config import EngineConfig\n"
            "try:\n"
            "    EngineConfig(kv_disk_dir='/nonexistent', prefix_caching_hash_algo='builtin')\n"
            "except ValueError as exc:\n"
            "    print(exc)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert "PYTHONHASHSEED" in out and "sha256" in out
    env["PYTHONHASHSEED"] = "7"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out == ""


def test_a_tier_makes_sha256_the_default_hash() -> None:
    assert EngineConfig().hash_algo == "builtin"
    assert EngineConfig(kv_redis_url="redis://127.0.0.1:1").hash_algo == "sha256"
    assert EngineConfig(kv_disk_dir="/x", prefix_caching_hash_algo="xxhash").hash_algo == "xxhash"
    with pytest.raises(ValueError, match="prefix caching"):
        EngineConfig(kv_disk_dir="/x", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="write_policy"):
        EngineConfig(kv_disk_dir="/x", kv_tier_write_policy="sometimes")


def test_model_digest_is_read_once_per_file_version(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The tier namespace's model digest is the file's SHA-256, kept in the cache folder after
    the first read: a later start takes it from there (here, a planted value comes back, so the
    file was not read), and a file changed in size or time is read again."""
    import hashlib

    from prefixserve.engine.tier_manager import file_digest

    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights " * 1000)
    first = file_digest(str(model))
    assert first == hashlib.sha256(model.read_bytes()).hexdigest()
    [entry] = (tmp_path / "cache" / "digests").iterdir()
    entry.write_text("ab" * 32)
    assert file_digest(str(model)) == "ab" * 32
    with model.open("ab") as f:
        f.write(b"more")
    assert file_digest(str(model)) == hashlib.sha256(model.read_bytes()).hexdigest()
    for old in (tmp_path / "cache" / "digests").iterdir():
        old.write_text("not a digest")  # a damaged entry is read past
    assert file_digest(str(model)) == hashlib.sha256(model.read_bytes()).hexdigest() != first
