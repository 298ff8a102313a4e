"""The cache tiers' rules pinned exactly (docs/tiers.md, ``prefixserve/core/tiers.py``):
record and key layout, the single-key calls, and the chain's health bookkeeping (down, full,
probes at ``retry_after``, counters, log lines), with a real disk tier where one serves and a
small in-memory tier that fails on purpose where a fault is wanted."""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from pathlib import Path

import pytest
import xxhash

from prefixserve.core.tiers import (
    RECORD_MAGIC,
    FetchedRun,
    KVTier,
    TierChain,
    TierFull,
    TierStats,
    decode_record,
    encode_record,
    tier_key,
)
from prefixserve.tiers.disk import DiskTier

pytestmark = pytest.mark.fast

NS = b"s" * 16
PAYLOAD = 16
TOKENS = [[10 * i + j for j in range(4)] for i in range(6)]
LOGGER = "prefixserve.tiers"


def key(i: int) -> bytes:
    return tier_key(NS, bytes([i + 1]) * 32)


def record(i: int) -> bytes:
    return encode_record(TOKENS[i], bytes([i + 1]) * PAYLOAD)


def payload(i: int) -> bytes:
    return bytes([i + 1]) * PAYLOAD


class Clock:
    """A clock the test sets by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class MemoryTier(KVTier):
    """A tier in a dict that records what it is asked, fails on purpose (the operations named in
    ``failing`` raise ``error``) and has room for ``room`` records (then ``TierFull``)."""

    def __init__(self, name: str = "memory", room: int | None = None) -> None:
        self.name = name
        self.room = room
        self.records: dict[bytes, bytes] = {}
        self.failing: set[str] = set()
        self.error: Exception = ConnectionError("refused")
        self.calls: list[str] = []
        self.loads: list[list[bytes]] = []
        self.closed = 0

    def _enter(self, operation: str) -> None:
        self.calls.append(operation)
        if operation in self.failing:
            raise self.error

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        self._enter("contains_many")
        return [k in self.records for k in keys]

    def load_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        self._enter("load_many")
        self.loads.append(list(keys))
        return [self.records.get(k) for k in keys]

    def store_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        self._enter("store_many")
        for done, (k, rec) in enumerate(items):
            if self.room is not None and k not in self.records and len(self.records) >= self.room:
                raise TierFull("no room", stored=done)
            self.records[k] = rec

    def evict_many(self, keys: Sequence[bytes]) -> None:
        self._enter("evict_many")
        for k in keys:
            self.records.pop(k, None)

    def close(self) -> None:
        self._enter("close")
        self.closed += 1


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def blocks(runs: Sequence[FetchedRun]) -> list[tuple[int, list[bytes]]]:
    return [(run.tier, [bytes(p) for p in run.payloads]) for run in runs]


# ---------------------------------------------------------------------- keys and records
def test_builtin_hash_keys_are_little_endian_after_the_namespace() -> None:
    """Catches an int hash value written in another byte order than little-endian."""
    assert tier_key(NS, 1) == NS + b"\x01" + b"\x00" * 7
    assert tier_key(NS, 0x0102030405060708) == NS + bytes([8, 7, 6, 5, 4, 3, 2, 1])
    assert tier_key(NS, -2) == NS + b"\xfe" + b"\xff" * 7


def test_a_hash_value_of_another_type_is_refused_naming_its_type() -> None:
    """Catches a TypeError that loses its message or names the wrong type."""
    with pytest.raises(TypeError) as error:
        tier_key(NS, "abc")
    assert str(error.value) == "cannot make a tier key of a str hash value"
    with pytest.raises(TypeError) as error:
        tier_key(NS, (1, 2))
    assert str(error.value) == "cannot make a tier key of a tuple hash value"


def test_record_tokens_are_signed_native_int64_and_round_trip() -> None:
    """Catches token ids written or read as unsigned integers (a negative id breaks them)."""
    tokens = [-1, 7, -(2**63), 2**63 - 1]
    body = struct.pack("=4q", *tokens) + b"kv"
    header = struct.pack("<6sQII", RECORD_MAGIC, xxhash.xxh3_64_intdigest(body), 4, 2)
    assert encode_record(tokens, b"kv") == header + body
    decoded = decode_record(header + body, tokens, 2)
    assert decoded is not None and bytes(decoded) == b"kv"


def test_a_record_of_no_tokens_and_no_payload_decodes_to_an_empty_payload() -> None:
    """Catches a whole record of exactly the header's size taken for a truncated one."""
    empty = encode_record([], b"")
    assert len(empty) == struct.calcsize("<6sQII")
    decoded = decode_record(empty, [], 0)
    assert decoded is not None and bytes(decoded) == b""


def test_a_record_longer_or_shorter_than_its_header_says_is_refused() -> None:
    """Catches the length check skipped when the token count matches: a record with bytes
    added or missing, whose checksum covers what is there, is still no payload."""
    tokens = [5]
    for body in (struct.pack("=q", 5) + b"abcd" + b"xyz", struct.pack("=q", 5) + b"abc"):
        header = struct.pack("<6sQII", RECORD_MAGIC, xxhash.xxh3_64_intdigest(body), 1, 4)
        assert decode_record(header + body, tokens, 4) is None
    body = struct.pack("=q", 5) + b"abcd"
    header = struct.pack("<6sQII", RECORD_MAGIC, xxhash.xxh3_64_intdigest(body), 1, 4)
    good = decode_record(header + body, tokens, 4)
    assert good is not None and bytes(good) == b"abcd"


def test_tier_full_keeps_its_message_and_by_default_stored_nothing() -> None:
    """Catches TierFull losing its message or claiming a stored record by default."""
    full = TierFull("disk quota")
    assert str(full) == "disk quota" and full.args == ("disk quota",) and full.stored == 0
    assert TierFull("oom", stored=3).stored == 3
    tier = MemoryTier("quota")
    tier.failing, tier.error = {"store_many"}, TierFull("quota")
    chain = TierChain([tier], retry_after=5, clock=Clock())
    chain.store([(key(0), record(0)), (key(1), record(1))])
    stats = chain.snapshot()[0]
    assert (stats.stored_blocks, stats.dropped_writes, stats.full_events) == (0, 2, 1)


def test_the_single_key_calls_go_through_the_batch_calls(tmp_path: Path) -> None:
    """Catches KVTier.load / store / evict handing the batch call the wrong keys or index."""
    disk = DiskTier(str(tmp_path), NS.hex(), 1 << 20)
    disk.store(key(0), record(0))
    disk.store(key(1), record(1))
    assert disk.contains(key(0)) and disk.contains(key(1)) and not disk.contains(key(2))
    assert disk.load(key(1)) == record(1) and disk.load(key(0)) == record(0)
    assert disk.load(key(2)) is None
    disk.evict(key(0))
    assert disk.load(key(0)) is None and disk.load(key(1)) == record(1)


# ---------------------------------------------------------------------- health
def test_a_fresh_chain_reports_each_tier_by_name_up_and_writable(tmp_path: Path) -> None:
    """Catches a tier's counters created without its name."""
    chain = TierChain([DiskTier(str(tmp_path), NS.hex(), 1 << 20), MemoryTier("spare")])
    assert chain.names == ["disk", "spare"]
    assert chain.snapshot() == (TierStats("disk"), TierStats("spare"))


def test_a_failed_lookup_marks_the_tier_down_with_one_line_naming_the_error(
        caplog: pytest.LogCaptureFixture) -> None:
    """Catches the down state, its counters or its log line (tier, error type and message,
    retry time) being wrong."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    tier = MemoryTier("flaky")
    tier.records[key(0)] = record(0)
    tier.failing = {"contains_many"}
    chain = TierChain([tier], retry_after=5, clock=Clock())
    assert chain.fetch([key(0)], TOKENS[:1], PAYLOAD) == []
    assert chain.snapshot() == (TierStats("flaky", up=False, writable=False, miss_blocks=1,
                                          errors=1, down_events=1),)
    assert messages(caplog) == ["KV tier flaky is down (ConnectionError: refused); "
                                "retrying in 5 s"]
    assert tier.loads == []


def test_the_tier_is_probed_again_exactly_when_retry_after_has_passed(
        caplog: pytest.LogCaptureFixture) -> None:
    """Catches a probe that waits past ``retry_after``, and a tier that comes back without being
    writable or without its log line."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    clock = Clock()
    tier = MemoryTier("flaky")
    tier.records[key(0)] = record(0)
    tier.failing = {"contains_many"}
    chain = TierChain([tier], retry_after=5, clock=clock)
    chain.fetch([key(0)], TOKENS[:1], PAYLOAD)
    tier.failing = set()
    clock.now = 4.99
    assert chain.fetch([key(0)], TOKENS[:1], PAYLOAD) == []
    assert tier.calls == ["contains_many"]  # not asked while down
    clock.now = 5.0
    assert blocks(chain.fetch([key(0)], TOKENS[:1], PAYLOAD)) == [(0, [payload(0)])]
    assert chain.snapshot() == (TierStats("flaky", up=True, writable=True, hit_blocks=1,
                                          miss_blocks=2, errors=1, down_events=1),)
    assert messages(caplog)[1:] == ["KV tier flaky is up again"]


def test_the_default_retry_after_is_ten_seconds() -> None:
    """Catches another default for ``retry_after``."""
    clock = Clock()
    tier = MemoryTier("flaky")
    tier.failing = {"store_many"}
    chain = TierChain([tier], clock=clock)
    chain.store([(key(0), record(0))])
    tier.failing = set()
    clock.now = 9.99
    chain.store([(key(0), record(0))])
    assert tier.calls == ["store_many"] and not chain.snapshot()[0].up
    clock.now = 10.0
    chain.store([(key(0), record(0))])
    assert tier.calls == ["store_many", "store_many"] and chain.snapshot()[0].up


def test_every_failure_is_an_error_and_every_fall_is_a_down_event(
        caplog: pytest.LogCaptureFixture) -> None:
    """Catches the error or down-event counters set instead of incremented: a failed probe is
    one more error, not a new fall; a fall after coming back is a second one."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    clock = Clock()
    tier = MemoryTier("flaky")
    tier.failing = {"contains_many"}
    chain = TierChain([tier], retry_after=5, clock=clock)
    chain.fetch([key(0)], TOKENS[:1], PAYLOAD)
    clock.now = 5.0
    chain.fetch([key(0)], TOKENS[:1], PAYLOAD)  # the probe fails too
    stats = chain.snapshot()[0]
    assert (stats.up, stats.errors, stats.down_events) == (False, 2, 1)
    tier.failing = set()
    clock.now = 10.0
    chain.fetch([key(0)], TOKENS[:1], PAYLOAD)
    assert chain.snapshot()[0].up
    tier.failing = {"contains_many"}
    clock.now = 11.0
    chain.fetch([key(0)], TOKENS[:1], PAYLOAD)
    stats = chain.snapshot()[0]
    assert (stats.up, stats.writable, stats.errors, stats.down_events) == (False, False, 3, 2)
    down = "KV tier flaky is down (ConnectionError: refused); retrying in 5 s"
    assert messages(caplog) == [down, "KV tier flaky is up again", down]


def test_a_failed_write_stores_nothing_and_drops_every_block(
        caplog: pytest.LogCaptureFixture) -> None:
    """Catches a failed write counted as one stored block, or logged without its error."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    tier = MemoryTier("flaky")
    tier.failing, tier.error = {"store_many"}, OSError("disk gone")
    chain = TierChain([tier], retry_after=7, clock=Clock())
    chain.store([(key(i), record(i)) for i in range(3)])
    assert chain.snapshot() == (TierStats("flaky", up=False, writable=False, dropped_writes=3,
                                          errors=1, down_events=1),)
    assert messages(caplog) == ["KV tier flaky is down (OSError: disk gone); retrying in 7 s"]


def test_a_full_tier_stops_its_writes_for_retry_after_while_its_lookups_go_on(
        caplog: pytest.LogCaptureFixture) -> None:
    """Catches the full state, its counters, its boundary or its log lines being wrong: the
    first write that finds no room stores what fitted, later writes are dropped untried until
    exactly ``retry_after`` later, and a write that goes through makes the tier writable."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    clock = Clock()
    tier = MemoryTier("mem", room=1)
    chain = TierChain([tier], retry_after=5, clock=clock)
    chain.store([(key(i), record(i)) for i in range(3)])
    assert chain.snapshot() == (TierStats("mem", up=True, writable=False, stored_blocks=1,
                                          dropped_writes=2, errors=1, full_events=1),)
    assert messages(caplog) == [
        "KV tier mem is full (no room); its writes stop for 5 s, its lookups go on"]
    tier.room = None
    clock.now = 4.99
    chain.store([(key(1), record(1))])
    assert tier.calls == ["store_many"]
    assert blocks(chain.fetch([key(0)], TOKENS[:1], PAYLOAD)) == [(0, [payload(0)])]
    clock.now = 5.0
    chain.store([(key(1), record(1))])
    assert tier.calls == ["store_many", "contains_many", "load_many", "store_many"]
    assert chain.snapshot() == (TierStats("mem", up=True, writable=True, hit_blocks=1,
                                          stored_blocks=2, dropped_writes=3, errors=1,
                                          full_events=1),)
    assert messages(caplog)[1:] == ["KV tier mem takes writes again"]


def test_filling_again_after_taking_writes_again_is_a_second_full_event(
        caplog: pytest.LogCaptureFixture) -> None:
    """Catches a tier that stays flagged full after recovering, or full counters set instead of
    incremented."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    clock = Clock()
    tier = MemoryTier("mem", room=1)
    chain = TierChain([tier], retry_after=5, clock=clock)
    chain.store([(key(0), record(0)), (key(1), record(1))])
    tier.room = 3
    clock.now = 5.0
    chain.store([(key(1), record(1))])
    clock.now = 6.0
    chain.store([(key(2), record(2))])
    assert chain.snapshot()[0].writable
    clock.now = 7.0
    chain.store([(key(3), record(3))])
    assert chain.snapshot() == (TierStats("mem", up=True, writable=False, stored_blocks=3,
                                          dropped_writes=2, errors=2, full_events=2),)
    full = "KV tier mem is full (no room); its writes stop for 5 s, its lookups go on"
    assert messages(caplog) == [full, "KV tier mem takes writes again", full]


# ---------------------------------------------------------------------- lookups
def test_a_lookup_loads_only_the_run_that_contains_reported() -> None:
    """Catches a lookup that loads past the first block a tier lacks."""
    tier = MemoryTier()
    for i in (0, 1, 3):
        tier.records[key(i)] = record(i)
    chain = TierChain([tier], clock=Clock())
    runs = chain.fetch([key(i) for i in range(4)], TOKENS[:4], PAYLOAD)
    assert blocks(runs) == [(0, [payload(0), payload(1)])]
    assert tier.loads == [[key(0), key(1)]]
    assert chain.snapshot()[0].miss_blocks == 1


def test_a_tier_whose_presence_check_failed_is_not_asked_to_load_in_that_lookup() -> None:
    """Catches a lookup that loads from a tier whose ``contains_many`` gave nothing (failed),
    when ``retry_after`` passes during the lookup (the clock ticks a second per reading)."""
    ticks = iter(range(100))
    tier = MemoryTier("flaky")
    tier.records[key(0)] = record(0)
    tier.failing = {"contains_many"}
    chain = TierChain([tier], retry_after=1, clock=lambda: float(next(ticks)))
    assert chain.fetch([key(0)], TOKENS[:1], PAYLOAD) == []
    assert tier.calls == ["contains_many"] and tier.loads == []
    stats = chain.snapshot()[0]
    assert (stats.up, stats.hit_blocks, stats.miss_blocks, stats.errors) == (False, 0, 1, 1)


def test_a_tier_that_fails_at_load_is_a_miss_and_the_next_tier_serves_the_block(
        tmp_path: Path) -> None:
    """Catches a failed load whose fallback breaks the lookup instead of being a miss."""
    first = MemoryTier("flaky")
    first.records[key(0)] = record(0)
    first.failing, first.error = {"load_many"}, TimeoutError("slow")
    disk = DiskTier(str(tmp_path), NS.hex(), 1 << 20)
    disk.store_many([(key(0), record(0))])
    chain = TierChain([first, disk], retry_after=5, clock=Clock())
    assert blocks(chain.fetch([key(0)], TOKENS[:1], PAYLOAD)) == [(1, [payload(0)])]
    flaky, served = chain.snapshot()
    assert (flaky.up, flaky.errors, flaky.hit_blocks, flaky.miss_blocks) == (False, 1, 0, 0)
    assert (served.hit_blocks, served.miss_blocks) == (1, 0)


def test_a_whole_hit_counts_no_miss_and_an_empty_lookup_counts_nothing(tmp_path: Path) -> None:
    """Catches a lookup that, having found every block, goes on and counts a miss."""
    disk = DiskTier(str(tmp_path), NS.hex(), 1 << 20)
    spare = MemoryTier("spare")
    disk.store_many([(key(i), record(i)) for i in range(3)])
    chain = TierChain([disk, spare], clock=Clock())
    runs = chain.fetch([key(i) for i in range(3)], TOKENS[:3], PAYLOAD)
    assert blocks(runs) == [(0, [payload(0), payload(1), payload(2)])]
    assert chain.snapshot() == (TierStats("disk", hit_blocks=3), TierStats("spare"))
    assert chain.fetch([], [], PAYLOAD) == []
    assert chain.snapshot() == (TierStats("disk", hit_blocks=3), TierStats("spare"))
    assert spare.calls == []


def test_a_lookup_that_stops_counts_one_miss_in_every_tier(tmp_path: Path) -> None:
    """Catches a miss counted as more than one block."""
    disk = DiskTier(str(tmp_path), NS.hex(), 1 << 20)
    spare = MemoryTier("spare")
    disk.store_many([(key(0), record(0)), (key(2), record(2))])
    spare.records[key(2)] = record(2)
    chain = TierChain([disk, spare], clock=Clock())
    runs = chain.fetch([key(i) for i in range(3)], TOKENS[:3], PAYLOAD)
    assert blocks(runs) == [(0, [payload(0)])]
    assert chain.snapshot() == (TierStats("disk", hit_blocks=1, miss_blocks=1),
                                TierStats("spare", miss_blocks=1))


# ---------------------------------------------------------------------- writes and close
def test_a_write_to_chosen_tiers_leaves_the_others_untouched(tmp_path: Path) -> None:
    """Catches a write that goes to every tier whatever ``tiers`` names."""
    disk = DiskTier(str(tmp_path), NS.hex(), 1 << 20)
    spare = MemoryTier("spare")
    chain = TierChain([disk, spare], clock=Clock())
    chain.store([(key(0), record(0)), (key(1), record(1))], tiers=[1])
    assert disk.contains_many([key(0), key(1)]) == [False, False]
    assert spare.records == {key(0): record(0), key(1): record(1)}
    assert chain.snapshot() == (TierStats("disk"), TierStats("spare", stored_blocks=2))
    chain.store([(key(2), record(2))])
    assert disk.contains_many([key(2)]) == [True] and key(2) in spare.records


def test_blocks_dropped_before_the_tiers_count_as_dropped_writes_in_every_tier() -> None:
    """Catches blocks the write queue dropped not counted, or counted under another field."""
    chain = TierChain([MemoryTier("a"), MemoryTier("b")], clock=Clock())
    chain.count_dropped(3)
    chain.count_dropped(2)
    assert chain.snapshot() == (TierStats("a", dropped_writes=5),
                                TierStats("b", dropped_writes=5))


def test_closing_the_chain_closes_every_tier_once_and_a_failing_close_raises_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    """Catches a close that skips the tiers' own close, or lets a tier's failure escape."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    good, bad = MemoryTier("good"), MemoryTier("bad")
    bad.failing, bad.error = {"close"}, RuntimeError("socket closed")
    chain = TierChain([good, bad], retry_after=5, clock=Clock())
    chain.close()
    assert (good.closed, good.calls, bad.calls) == (1, ["close"], ["close"])
    assert chain.snapshot() == (TierStats("good"),
                                TierStats("bad", up=False, writable=False, errors=1,
                                          down_events=1))
    assert messages(caplog) == ["KV tier bad is down (RuntimeError: socket closed); "
                                "retrying in 5 s"]
