"""The batched chain hashing (the builtin, sha256 and xxhash fast paths of ``hash_block_chain``
and the manager's incremental chain) against a per-block reference written here from the
definition of docs/prefix-cache.md section 2, over random inputs with extra keys (salt, LoRA,
multimodal) and precomputed hashes."""

from __future__ import annotations

import hashlib
import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.core import (
    HASH_ALGOS,
    NONE_HASH,
    CacheRequest,
    KVCacheManager,
    MultiModalInput,
    block_extra_keys,
    get_hash_function,
    hash_block_chain,
)

pytestmark = pytest.mark.fast

SETTINGS = settings(max_examples=120, deadline=None)


def _encode(value: object) -> bytes:
    """The extra-key serialisation, written out from its specification."""
    if value is None:
        return b"N"
    if value is True or value is False:
        return b"T" if value else b"F"
    if isinstance(value, int):
        raw = str(value).encode()
        return b"i" + struct.pack("<I", len(raw)) + raw
    if isinstance(value, str):
        raw = value.encode()
        return b"s" + struct.pack("<I", len(raw)) + raw
    assert isinstance(value, tuple)
    return b"t" + struct.pack("<I", len(value)) + b"".join(_encode(v) for v in value)


def _block_bytes(parent: bytes, tokens: tuple[int, ...], extras: object) -> bytes:
    return (parent + struct.pack("<I", len(tokens))
            + b"".join(struct.pack("<q", t) for t in tokens) + _encode(extras))


def _reference_value(algo: str, parent: object, tokens: tuple[int, ...], extras: object) -> object:
    if algo == "builtin":
        return hash((parent, tokens)) if extras is None else hash((parent, tokens, extras))
    assert isinstance(parent, bytes)
    data = _block_bytes(parent, tokens, extras)
    return hashlib.sha256(data).digest() if algo == "sha256" else xxhash.xxh3_128_digest(data)


def _reference_root(algo: str) -> object:
    return int.from_bytes(NONE_HASH, "little") if algo == "builtin" else NONE_HASH


def _reference_chain(algo: str, tokens: list[int], bs: int, extras: list[object]) -> list[tuple]:
    parent = _reference_root(algo)
    out = []
    for i in range(len(tokens) // bs):
        block = tuple(tokens[i * bs : (i + 1) * bs])
        parent = _reference_value(algo, parent, block, extras[i])
        out.append((parent, block, extras[i]))
    return out


def _reference_extras(request: CacheRequest, bs: int, num_blocks: int) -> list[object]:
    """LoRA on every block, then the multimodal inputs overlapping the block, then the salt on
    block 0; None for a block with none."""
    out: list[object] = []
    for i in range(num_blocks):
        keys: list[tuple] = []
        if request.lora_id is not None:
            keys.append(("lora", request.lora_id))
        for mm in request.mm_inputs:
            if mm.offset < (i + 1) * bs and i * bs < mm.offset + mm.length:
                keys.append(("mm", mm.content_hash))
        if request.cache_salt is not None and i == 0:
            keys.append(("salt", request.cache_salt))
        out.append(tuple(keys) or None)
    return out


TOKENS = st.lists(st.integers(-(2**40), 2**40), min_size=0, max_size=40)
ALGO = st.sampled_from(HASH_ALGOS)
BS = st.integers(1, 8)


@SETTINGS
@given(algo=ALGO, tokens=TOKENS, bs=BS, split=st.integers(0, 40), with_extras=st.booleans())
def test_hash_block_chain_equals_the_per_block_definition(algo: str, tokens: list[int], bs: int,
                                                          split: int, with_extras: bool) -> None:
    """Batched, in two pieces chained at any block, with and without extras (the fast paths
    take only extra_keys=None)."""
    function, root = get_hash_function(algo)
    assert root == _reference_root(algo)
    n = len(tokens) // bs
    extras: list[object] = ([("lora", 3), None, ("mm", "x"), ("salt", "s")] * n)[:n] \
        if with_extras else [None] * n
    expected = _reference_chain(algo, tokens, bs, extras)
    chain = hash_block_chain(function, root, tokens, bs, 0, n, extras if with_extras else None)
    assert chain == expected
    k = min(split, n)
    head = hash_block_chain(function, root, tokens, bs, 0, k, extras[:k] if with_extras else None)
    parent = head[-1][0] if head else root
    tail = hash_block_chain(function, parent, tokens, bs, k, n,
                            extras[k:] if with_extras else None)
    assert head + tail == expected


MM = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12), st.sampled_from("abc")),
              max_size=3)


@SETTINGS
@given(algo=ALGO, tokens=TOKENS, bs=BS, salt=st.sampled_from([None, "", "t1"]),
       lora=st.sampled_from([None, 0, 7, "adapter"]), mm=MM, steps=st.integers(1, 6))
def test_the_managers_chain_equals_the_definition_with_every_extra_key(
        algo: str, tokens: list[int], bs: int, salt: str | None, lora: int | str | None,
        mm: list[tuple[int, int, str]], steps: int) -> None:
    """The manager extends a request's chain step by step as tokens arrive (decode); the result
    equals the chain of the whole sequence computed block by block from the definition."""
    mm_inputs = [MultiModalInput(o, n, h) for o, n, h in mm]
    manager = KVCacheManager(4, bs, hash_algo=algo)
    request = CacheRequest("r", [], cache_salt=salt, lora_id=lora, mm_inputs=mm_inputs)
    cut = [len(tokens) * i // steps for i in range(1, steps + 1)]
    for end in cut:
        request.token_ids = tokens[:end]
        manager.block_hashes(request)
    n = len(tokens) // bs
    extras = _reference_extras(request, bs, n)
    assert block_extra_keys(request, bs, 0, n) == (
        None if salt is None and lora is None and not mm_inputs else extras)
    assert list(manager.block_hashes(request)) == _reference_chain(algo, tokens, bs, extras)


def test_a_partial_block_is_never_hashed_whatever_is_asked() -> None:
    """Asked for more blocks than the tokens fill, the chain covers the full blocks only: a
    hash of a partial block would name content that the block's later tokens change."""
    manager = KVCacheManager(4, 4)
    request = CacheRequest("r", list(range(10)))
    assert len(manager.block_hashes(request, 5)) == 2
    request.token_ids = list(range(12))
    assert list(manager.block_hashes(request, 5)) == list(
        KVCacheManager(4, 4).block_hashes(CacheRequest("s", list(range(12)))))


def test_extra_keys_of_a_multimodal_input_ending_on_a_block_boundary() -> None:
    """An input over tokens [2, 8) at block size 4 touches blocks 0 and 1, not block 2."""
    request = CacheRequest("r", list(range(12)), mm_inputs=[MultiModalInput(2, 6, "img")])
    assert block_extra_keys(request, 4, 0, 3) == [(("mm", "img"),), (("mm", "img"),), None]
    request = CacheRequest("r", list(range(12)), mm_inputs=[MultiModalInput(4, 4, "img")])
    assert block_extra_keys(request, 4, 0, 3) == [None, (("mm", "img"),), None]


@SETTINGS
@given(hashes=st.lists(st.integers(0, 5), max_size=8), extra=st.integers(0, 12))
def test_precomputed_hashes_are_returned_as_given_and_never_extended(hashes: list[int],
                                                                     extra: int) -> None:
    manager = KVCacheManager(4, 4)
    given_hashes = [f"p{h}" for h in hashes]
    request = CacheRequest("r", range(4 * len(hashes) + extra), block_hashes=given_hashes)
    assert manager.block_hashes(request) is given_hashes
    assert manager.block_hashes(request, len(hashes) + 3) is given_hashes
    assert "r" not in manager.req_to_block_hashes


def test_serialize_block_writes_every_extra_key_type_as_specified() -> None:
    """The byte layout, written out by hand: parent, uint32 token count, int64 tokens (also
    negative ones), then the tagged extra keys, nested."""
    from prefixserve.core.hashing import serialize_block

    extras = (None, True, False, 7, -3, 1.5, "sé", b"by", bytearray(b"ba"), [1, (2,)])
    expected = (
        b"P" + struct.pack("<I", 2) + struct.pack("<q", -5) + struct.pack("<q", 2**40)
        + b"t" + struct.pack("<I", 10)
        + b"N" + b"T" + b"F"
        + b"i" + struct.pack("<I", 1) + b"7"
        + b"i" + struct.pack("<I", 2) + b"-3"
        + b"f" + struct.pack("<d", 1.5)
        + b"s" + struct.pack("<I", 3) + "sé".encode()
        + b"b" + struct.pack("<I", 2) + b"by"
        + b"b" + struct.pack("<I", 2) + b"ba"
        + b"t" + struct.pack("<I", 2) + b"i" + struct.pack("<I", 1) + b"1"
        + b"t" + struct.pack("<I", 1) + b"i" + struct.pack("<I", 1) + b"2"
    )
    assert serialize_block(b"P", (-5, 2**40), extras) == expected
    for algo in ("sha256", "xxhash"):
        function, _ = get_hash_function(algo)
        digest = hashlib.sha256 if algo == "sha256" else xxhash.xxh3_128
        assert function(b"P", (-5, 2**40), extras) == digest(expected).digest()
    try:
        serialize_block(b"P", (1,), {1, 2})
    except TypeError as error:
        assert "set" in str(error)
    else:
        raise AssertionError("a set extra key must be refused")


def test_none_hash_is_the_seeds_sha256_under_pythonhashseed_else_random(monkeypatch) -> None:
    from prefixserve.core.hashing import _make_none_hash

    monkeypatch.setenv("PYTHONHASHSEED", "17")
    assert _make_none_hash() == hashlib.sha256(b"17").digest()
    monkeypatch.delenv("PYTHONHASHSEED")
    first, second = _make_none_hash(), _make_none_hash()
    assert len(first) == len(second) == 32 and first != second


def test_a_custom_hash_function_chains_blocks_without_extra_keys() -> None:
    """The generic path (a hash function with no fast path, no extra keys) gives every block
    ``None`` extras and chains each block from the previous one. Bug: the default extra keys
    not built (a crash), or the chain computed from another parent."""
    def custom(parent: object, tokens: tuple[int, ...], extras: object) -> int:
        return hash(("custom", parent, tokens, extras))

    expected, parent = [], 7
    for i in (0, 4):
        block = tuple(range(i, i + 4))
        parent = custom(parent, block, None)
        expected.append((parent, block, None))
    assert hash_block_chain(custom, 7, list(range(10)), 4, 0, 2) == expected
    assert hash_block_chain(custom, expected[0][0], list(range(10)), 4, 1, 2) == expected[1:]
