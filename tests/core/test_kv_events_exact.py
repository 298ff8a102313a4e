"""KV events pinned exactly (docs/KV_EVENTS.md, docs/replicas.md): the wire form a router
in another process reads, event by event and byte by byte; what ``stored`` reports for a chain
range (parent, token count, adapter); the epoch; and the publisher's kept history."""

from __future__ import annotations

import json
import string

import pytest
from core_helpers import run_once

from prefixserve.core import CacheRequest, KVCacheManager
from prefixserve.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    KVSnapshot,
    decode_hash,
    encode_hash,
)

pytestmark = pytest.mark.fast

BS = 4

# Known hash values and their documented wire form: bytes -> lowercase hex, int -> JSON integer.
SHA_A = bytes(range(32))
SHA_A_HEX = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
XXH_B = bytes([0xAB]) * 8 + bytes([0x01]) * 8
XXH_B_HEX = "abababababababab0101010101010101"
PARENT = bytes([0xFE, 0xDC, 0xBA, 0x98]) + bytes(28)
PARENT_HEX = "fedcba98" + "00" * 28
GONE = bytes([0xDE, 0xAD, 0xBE, 0xEF])
GONE_HEX = "deadbeef"


def _known_batch() -> KVEventBatch:
    return KVEventBatch(
        "r7", "0123456789abcdef", 42, 1795000000.25,
        (BlockStored((SHA_A, XXH_B), PARENT, 8, "ad1"),
         BlockRemoved((GONE,)),
         AllBlocksCleared(),
         BlockStored((12345, -6), 777, 8, None),
         BlockStored((SHA_A,), None, 4, None),
         BlockRemoved((5, -3))))


KNOWN_WIRE = {
    "replica": "r7", "epoch": "0123456789abcdef", "seq": 42, "ts": 1795000000.25,
    "events": [["stored", [SHA_A_HEX, XXH_B_HEX], PARENT_HEX, 8, "ad1"],
               ["removed", [GONE_HEX]],
               ["cleared"],
               ["stored", [12345, -6], 777, 8, None],
               ["stored", [SHA_A_HEX], None, 4, None],
               ["removed", [5, -3]]],
}


def _hashes(n: int, extras: object = None) -> list[tuple[object, tuple[int, ...], object]]:
    """``n`` computed-style block hashes ``(value, tokens, extras)`` with values 100, 101, ..."""
    return [(100 + i, tuple(range(i * BS, (i + 1) * BS)), extras) for i in range(n)]


# ------------------------------------------------------------------------------- wire form


def test_known_batch_encodes_to_the_documented_wire_form() -> None:
    """Catches a renamed event kind ("removed", "cleared"), a parent dropped or mis-encoded, or a
    hash value not written as lowercase hex / JSON integer."""
    assert _known_batch().to_wire() == KNOWN_WIRE


def test_known_batch_wire_json_text_is_exact() -> None:
    """Catches any change a JSON reader in another language would see in the encoded text."""
    text = json.dumps(_known_batch().to_wire())
    assert text == (
        '{"replica": "r7", "epoch": "0123456789abcdef", "seq": 42, "ts": 1795000000.25, '
        f'"events": [["stored", ["{SHA_A_HEX}", "{XXH_B_HEX}"], "{PARENT_HEX}", 8, "ad1"], '
        f'["removed", ["{GONE_HEX}"]], ["cleared"], ["stored", [12345, -6], 777, 8, null], '
        f'["stored", ["{SHA_A_HEX}"], null, 4, null], ["removed", [5, -3]]]}}')


def test_documented_wire_form_decodes_to_the_known_batch() -> None:
    """Catches a decoder that drops or misreads the parent, the removed values (bytes and ints)
    or the "removed" / "cleared" kinds."""
    decoded = KVEventBatch.from_wire(json.loads(json.dumps(KNOWN_WIRE)))
    assert decoded == _known_batch()
    stored = decoded.events[0]
    assert isinstance(stored, BlockStored) and stored.parent_block_hash == PARENT
    assert decoded.events[1] == BlockRemoved((GONE,))
    assert decoded.events[2] == AllBlocksCleared()
    assert decoded.events[3] == BlockStored((12345, -6), 777, 8, None)
    assert decoded.events[5] == BlockRemoved((5, -3))


@pytest.mark.parametrize("event, wire", [
    (BlockStored((SHA_A,), PARENT, 4, None), ["stored", [SHA_A_HEX], PARENT_HEX, 4, None]),
    (BlockStored((9,), 8, 4, 3), ["stored", [9], 8, 4, 3]),
    (BlockStored((9,), None, 4, None), ["stored", [9], None, 4, None]),
    (BlockRemoved((GONE, XXH_B)), ["removed", [GONE_HEX, XXH_B_HEX]]),
    (BlockRemoved((1, 2, 3)), ["removed", [1, 2, 3]]),
    (AllBlocksCleared(), ["cleared"]),
])
def test_each_event_kind_alone_encodes_and_decodes_exactly(event: object, wire: list[object]
                                                          ) -> None:
    """Catches a kind decoded as another (a "cleared" read as a removal) or a wrong field."""
    batch = KVEventBatch("r", "e", 1, 0.0, (event,))  # type: ignore[arg-type]
    assert batch.to_wire()["events"] == [wire]
    back = KVEventBatch.from_wire({"replica": "r", "epoch": "e", "seq": 1, "ts": 0.0,
                                   "events": [wire]})
    assert back.events == (event,)


def test_a_cleared_event_decodes_without_reading_further_fields() -> None:
    """Catches a decoder that treats every kind other than "removed" as a removal."""
    back = KVEventBatch.from_wire({"replica": "r", "epoch": "e", "seq": 2, "ts": 1.5,
                                   "events": [["cleared"], ["removed", [GONE_HEX]]]})
    assert back.events == (AllBlocksCleared(), BlockRemoved((GONE,)))


def test_an_unknown_event_kind_is_rejected_with_its_name() -> None:
    """Catches a decoder that reads an unknown kind as "cleared" or drops the kind's name."""
    wire = {"replica": "r", "epoch": "e", "seq": 1, "ts": 0.0, "events": [["moved", [1]]]}
    with pytest.raises(ValueError, match=r"^unknown KV event kind 'moved'$"):
        KVEventBatch.from_wire(wire)


def test_hash_values_encode_and_decode_both_ways() -> None:
    """Catches an int wire value decoded as hex or lost, or bytes not written as hex."""
    assert encode_hash(SHA_A) == SHA_A_HEX
    assert encode_hash(b"") == ""
    assert encode_hash(-12) == -12
    assert decode_hash(SHA_A_HEX) == SHA_A
    assert decode_hash(-12) == -12
    assert decode_hash(2**70) == 2**70


def test_a_hash_value_without_wire_form_names_its_type() -> None:
    """Catches an error message that loses or misnames the offending type."""
    with pytest.raises(TypeError, match=r"^hash value of type str has no wire form$"):
        encode_hash("trace-17")
    with pytest.raises(TypeError, match=r"^hash value of type float has no wire form$"):
        encode_hash(1.5)


def test_snapshot_wire_form_of_int_values_round_trips() -> None:
    """Catches int values in a snapshot decoded wrongly."""
    snapshot = KVSnapshot("r", "e", 4, frozenset({3, -9, 2**64}))
    wire = json.loads(json.dumps(snapshot.to_wire()))
    assert sorted(wire["blocks"]) == [-9, 3, 2**64]
    assert wire["replica"] == "r" and wire["epoch"] == "e" and wire["seq"] == 4
    assert KVSnapshot.from_wire(wire) == snapshot


# ------------------------------------------------------------------------------- stored


def test_stored_from_block_zero_has_no_parent() -> None:
    """Block 0 of a chain: parent None, tokens = blocks * block size."""
    publisher = KVEventPublisher("r", BS, epoch="e")
    publisher.stored(_hashes(3), 0, 2)
    batch = publisher.flush()
    assert batch is not None
    assert batch.events == (BlockStored((100, 101), None, 2 * BS, None),)


def test_stored_from_block_one_reports_block_zero_as_parent() -> None:
    """Catches a parent dropped for a range starting at block 1 (e.g. ``start > 1``)."""
    publisher = KVEventPublisher("r", BS, epoch="e")
    publisher.stored(_hashes(3), 1, 3)
    batch = publisher.flush()
    assert batch is not None
    assert batch.events == (BlockStored((101, 102), 100, 2 * BS, None),)


def test_stored_from_a_later_block_reports_the_block_just_before_as_parent() -> None:
    """Catches a parent taken from the wrong block (``start - 2``) and a token count computed from
    anything but the range's length."""
    publisher = KVEventPublisher("r", BS, epoch="e")
    publisher.stored(_hashes(6), 3, 5)
    batch = publisher.flush()
    assert batch is not None
    assert batch.events == (BlockStored((103, 104), 102, 2 * BS, None),)


def test_stored_with_an_empty_range_reports_nothing() -> None:
    """Catches an empty range (start == end) turned into an empty BlockStored."""
    publisher = KVEventPublisher("r", BS, epoch="e")
    publisher.stored(_hashes(2), 0, 0)
    publisher.stored(_hashes(2), 2, 2)
    assert publisher.flush() is None
    publisher.removed(55)
    publisher.stored(_hashes(2), 1, 1)
    publisher.removed(56)
    batch = publisher.flush()
    assert batch is not None and batch.events == (BlockRemoved((55, 56)),)


def test_extending_a_cached_prefix_publishes_the_new_blocks_with_their_parent() -> None:
    """Through the pool: a request continuing a cached prefix publishes only its new blocks,
    chained to the prefix's last published value, with their own token count."""
    manager = KVCacheManager(16, BS, hash_algo="sha256")
    publisher = KVEventPublisher("r", BS, epoch="e")
    manager.block_pool.event_sink = publisher
    run_once(manager, CacheRequest("a", list(range(9))))  # blocks 0, 1
    first = publisher.flush()
    assert first is not None
    (head,) = first.events
    assert isinstance(head, BlockStored) and head.parent_block_hash is None
    assert len(head.block_hashes) == 2 and head.num_tokens == 8
    run_once(manager, CacheRequest("b", list(range(13))))  # hits 0, 1; registers block 2
    second = publisher.flush()
    assert second is not None
    (tail,) = second.events
    assert isinstance(tail, BlockStored)
    assert tail.parent_block_hash == head.block_hashes[1]
    assert len(tail.block_hashes) == 1 and tail.num_tokens == BS
    assert tail.block_hashes[0] not in head.block_hashes
    wire = json.loads(json.dumps(second.to_wire()))
    assert wire["events"][0][2] == head.block_hashes[1].hex()  # type: ignore[union-attr]
    assert KVEventBatch.from_wire(wire) == second


def test_builtin_hash_events_round_trip_through_json() -> None:
    """Through the pool with ``builtin`` (int values): catches int wire values mis-decoded."""
    manager = KVCacheManager(4, BS, hash_algo="builtin")
    publisher = KVEventPublisher("r", BS, epoch="e")
    manager.block_pool.event_sink = publisher
    run_once(manager, CacheRequest("a", list(range(9))))
    run_once(manager, CacheRequest("b", list(range(9)) + list(range(50, 54))))
    run_once(manager, CacheRequest("c", list(range(100, 113))))  # evicts
    batch = publisher.flush()
    assert batch is not None
    kinds = [type(e) for e in batch.events]
    assert kinds.count(BlockStored) == 3 and BlockRemoved in kinds
    assert all(type(h) is int for e in batch.events if isinstance(e, BlockRemoved)
               for h in e.block_hashes)
    assert KVEventBatch.from_wire(json.loads(json.dumps(batch.to_wire()))) == batch


def test_a_salted_request_without_adapter_publishes_no_lora_id() -> None:
    """Catches the salt key ``("salt", s)`` mistaken for an adapter key (which would also leak the
    salt to every router)."""
    manager = KVCacheManager(16, BS, hash_algo="sha256")
    publisher = KVEventPublisher("r", BS, epoch="e")
    manager.block_pool.event_sink = publisher
    run_once(manager, CacheRequest("a", list(range(9)), cache_salt="tenant-secret"))
    batch = publisher.flush()
    assert batch is not None
    (stored,) = batch.events
    assert isinstance(stored, BlockStored) and stored.lora_id is None
    assert "tenant-secret" not in json.dumps(batch.to_wire())


def test_lora_id_is_read_only_from_a_lora_pair_among_the_extra_keys() -> None:
    """Only a 2-item ``("lora", id)`` key names the adapter; other keys (a salt, an mm key, a
    longer tuple, plain values) do not, and do not break the sink."""
    cases: list[tuple[object, object]] = [
        ((("salt", "s"),), None),
        ((("mm", "h1"), ("salt", "s")), None),
        ((("lora", "ad9", "x"),), None),
        ((("lora",), ("salt", "s")), None),
        ((7, 8), None),
        ((("salt", "s"), ("lora", "ad2")), "ad2"),
        ((("lora", 5),), 5),
    ]
    for extras, lora in cases:
        publisher = KVEventPublisher("r", BS, epoch="e")
        publisher.stored(_hashes(2, extras), 0, 2)
        batch = publisher.flush()
        assert batch is not None
        assert batch.events == (BlockStored((100, 101), None, 2 * BS, lora),), extras


def test_precomputed_tuple_hashes_with_plain_third_field_publish_no_lora() -> None:
    """Through the pool: precomputed block hashes may be any hashable values, 3-tuples of ints
    included; their events carry no adapter and the sink does not fail on them."""
    manager = KVCacheManager(8, BS)
    publisher = KVEventPublisher("r", BS, epoch="e")
    manager.block_pool.event_sink = publisher
    hashes = [(1, 0, (10, 11)), (2, 1, (12, 13))]
    run_once(manager, CacheRequest("a", range(9), block_hashes=hashes))
    batch = publisher.flush()
    assert batch is not None
    assert batch.events == (BlockStored((1, 2), None, 2 * BS, None),)


def test_a_precomputed_pair_hash_is_not_read_as_a_hybrid_group_key() -> None:
    """A hybrid group key is ``((value, group), block_hash)``: only a pair whose *first* field is
    a tuple is unwrapped. A precomputed hash ``(7, (8, 9, (("lora", "z"),)))`` is a plain value
    and names no adapter. Catches the unwrapping test made on the second field instead."""
    hashes = [(7, (8, 9, (("lora", "z"),))), (8, (9, 10, (("lora", "z"),)))]
    publisher = KVEventPublisher("r", BS, epoch="e")
    publisher.stored(hashes, 0, 2)
    batch = publisher.flush()
    assert batch is not None and batch.events == (BlockStored((7, 8), None, 2 * BS, None),)
    group_keys = [((7, 1), (7, (1, 2), (("lora", "z"),)))]
    publisher.stored(group_keys, 0, 1)
    batch = publisher.flush()
    assert batch is not None and batch.events == (BlockStored(((7, 1),), None, BS, "z"),)


# ------------------------------------------------------------------------------- publisher


def test_a_given_epoch_is_kept() -> None:
    """Catches a publisher that draws a random epoch even when one is given."""
    publisher = KVEventPublisher("r", BS, epoch="fixed-epoch")
    assert publisher.epoch == "fixed-epoch"
    publisher.cleared()
    batch = publisher.flush()
    assert batch is not None and batch.epoch == "fixed-epoch"
    assert batch.to_wire()["epoch"] == "fixed-epoch"


def test_a_drawn_epoch_is_16_lowercase_hex_digits_and_differs_per_publisher() -> None:
    """The documented epoch is 8 random bytes in hex (16 digits); catches another length."""
    epochs = {KVEventPublisher("r", BS).epoch for _ in range(20)}
    assert len(epochs) == 20
    for epoch in epochs:
        assert len(epoch) == 16 and set(epoch) <= set(string.hexdigits.lower())


def test_default_history_keeps_exactly_the_last_256_batches() -> None:
    """Catches a default history other than 256."""
    publisher = KVEventPublisher("r", BS, epoch="e")
    for _ in range(257):
        publisher.cleared()
        publisher.flush()
    assert publisher.batches_after(0) is None
    kept = publisher.batches_after(1)
    assert kept is not None and [b.seq for b in kept] == list(range(2, 258))


def test_history_keeps_exactly_its_size() -> None:
    """With ``history=3`` after 5 batches: batches 3..5 kept, a consumer at 1 needs a snapshot."""
    publisher = KVEventPublisher("r", BS, history=3, epoch="e")
    for _ in range(5):
        publisher.cleared()
        publisher.flush()
    assert publisher.batches_after(1) is None
    assert [b.seq for b in publisher.batches_after(2) or []] == [3, 4, 5]
    assert [b.seq for b in publisher.batches_after(4) or []] == [5]


def test_batches_after_returns_exactly_the_later_batches() -> None:
    """Catches an off-by-two slice that returns only the last batch."""
    publisher = KVEventPublisher("r", BS, epoch="e")
    for _ in range(4):
        publisher.cleared()
        publisher.flush()
    assert [b.seq for b in publisher.batches_after(0) or []] == [1, 2, 3, 4]
    assert [b.seq for b in publisher.batches_after(1) or []] == [2, 3, 4]
    assert [b.seq for b in publisher.batches_after(2) or []] == [3, 4]
    assert publisher.batches_after(4) == []


def test_a_consumer_that_is_up_to_date_needs_nothing() -> None:
    """A consumer at the last seq (or at 0 before any batch) gets an empty list, never None
    (which would force a needless snapshot), even when no history is kept."""
    fresh = KVEventPublisher("r", BS, epoch="e")
    assert fresh.batches_after(0) == []
    no_history = KVEventPublisher("r", BS, history=0, epoch="e")
    no_history.cleared()
    assert no_history.flush() is not None
    assert no_history.batches_after(1) == []
    assert no_history.batches_after(0) is None
