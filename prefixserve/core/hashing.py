"""Chained block hashes.

The hash of block ``i`` is ``H(parent, token ids of block i, extra keys of block i)`` where
``parent`` is the hash value of block ``i - 1`` and, for block 0, the per-process constant
``NONE_HASH``. Because the parent is part of the input, equal hash values mean equal tokens *and*
equal history.

A block hash is the plain tuple ``(hash_value, token_ids, extra_keys)``. Tuples hash and compare
in C, and tuple equality compares all three fields, so a collision of ``H`` alone can never make
two different blocks look equal. The pool and the manager treat block hashes as opaque hashable
values: a request may also bring precomputed ones (for example ids replayed from a trace).

Hash algorithms (``hash_algo``):

* ``builtin`` (default): Python's ``hash`` of ``(parent, tokens)`` or ``(parent, tokens, extras)``.
  Fast; deterministic across processes that share ``PYTHONHASHSEED`` (the parent is an ``int`` and
  ``None`` extras are never fed to ``hash``, whose value for ``None`` varies per process before
  Python 3.12).
* ``sha256``: SHA-256 over a deterministic byte serialisation (no pickle). Collisions are
  practically impossible; the value is the 32-byte digest.
* ``xxhash``: 128-bit XXH3 over the same serialisation. Deterministic across processes and
  machines, much cheaper than SHA-256, not cryptographic.
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
from array import array
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import xxhash

BlockHash = Hashable
"""A block hash: ``(hash_value, token_ids, extra_keys)`` when computed here, or any precomputed
hashable value that identifies a block together with its whole history."""

HASH_ALGOS = ("builtin", "sha256", "xxhash")


def _make_none_hash() -> bytes:
    """32 random bytes from the OS, or SHA-256 of ``PYTHONHASHSEED`` when that is set, so that
    processes sharing the seed (replicas, tests) compute the same chains on purpose."""
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        return os.urandom(32)
    return hashlib.sha256(seed.encode()).digest()


NONE_HASH: bytes = _make_none_hash()
"""Parent of block 0. Computed once per process (not a hot path)."""


def _encode(value: Any, out: bytearray) -> None:
    """Appends a deterministic, unambiguous encoding of an extra-key value to ``out``.

    Supported: None, bool, int, float, str, bytes and (nested) tuples/lists of these."""
    if value is None:
        out += b"N"
    elif isinstance(value, bool):
        out += b"T" if value else b"F"
    elif isinstance(value, int):
        raw = str(value).encode()
        out += b"i" + struct.pack("<I", len(raw)) + raw
    elif isinstance(value, float):
        out += b"f" + struct.pack("<d", value)
    elif isinstance(value, str):
        raw = value.encode()
        out += b"s" + struct.pack("<I", len(raw)) + raw
    elif isinstance(value, bytes | bytearray):
        out += b"b" + struct.pack("<I", len(value)) + bytes(value)
    elif isinstance(value, tuple | list):
        out += b"t" + struct.pack("<I", len(value))
        for item in value:
            _encode(item, out)
    else:
        raise TypeError(f"cannot serialise extra key of type {type(value).__name__}")


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64."""
    tokens = array("q", token_ids)
    if sys.byteorder == "big":
        tokens.byteswap()
    return tokens.tobytes()


def serialize_block(parent: bytes, token_ids: Sequence[int], extra_keys: Any) -> bytes:
    """Deterministic bytes of one block's hash input: parent digest, the token count as
    little-endian uint32, the tokens as little-endian int64, then the encoded extra keys."""
    out = bytearray(parent)
    out += struct.pack("<I", len(token_ids))
    out += _token_bytes(token_ids)
    _encode(extra_keys, out)
    return bytes(out)


def _builtin_hash(parent: Any, token_ids: tuple[int, ...], extra_keys: Any) -> int:
    if extra_keys is None:
        return hash((parent, token_ids))
    return hash((parent, token_ids, extra_keys))


def _sha256_hash(parent: Any, token_ids: tuple[int, ...], extra_keys: Any) -> bytes:
    return hashlib.sha256(serialize_block(parent, token_ids, extra_keys)).digest()


def _xxhash_hash(parent: Any, token_ids: tuple[int, ...], extra_keys: Any) -> bytes:
    return xxhash.xxh3_128_digest(serialize_block(parent, token_ids, extra_keys))


def _sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


HashFunction = Callable[[Any, tuple[int, ...], Any], Hashable]

_HASH_FUNCTIONS: dict[str, tuple[HashFunction, Any]] = {
    "builtin": (_builtin_hash, int.from_bytes(NONE_HASH, "little")),
    "sha256": (_sha256_hash, NONE_HASH),
    "xxhash": (_xxhash_hash, NONE_HASH),
}


_BYTES_HASHES: dict[HashFunction, Callable[[bytes], bytes]] = {
    _sha256_hash: _sha256_digest,
    _xxhash_hash: xxhash.xxh3_128_digest,
}
"""Hash functions over ``serialize_block`` bytes, with their digest of raw bytes (fast path)."""


def get_hash_function(hash_algo: str) -> tuple[HashFunction, Any]:
    """Returns ``(H, root)``: the block hash function and the parent value of block 0."""
    try:
        return _HASH_FUNCTIONS[hash_algo]
    except KeyError:
        raise ValueError(
            f"unknown prefix_caching_hash_algo {hash_algo!r}; choose one of {', '.join(HASH_ALGOS)}"
        ) from None


def hash_block_tokens(
    hash_function: HashFunction, parent: Any, token_ids: Sequence[int], extra_keys: Any = None
) -> tuple[Any, tuple[int, ...], Any]:
    """Hashes one full block and returns its block hash ``(hash_value, token_ids, extra_keys)``."""
    tokens = tuple(token_ids)
    return (hash_function(parent, tokens, extra_keys), tokens, extra_keys)


def hash_block_chain(
    hash_function: HashFunction,
    parent: Any,
    token_ids: Sequence[int],
    block_size: int,
    first_block: int,
    end_block: int,
    extra_keys: Sequence[Any] | None = None,
) -> list[tuple[Any, tuple[int, ...], Any]]:
    """Block hashes of blocks ``first_block .. end_block - 1`` of ``token_ids``.

    ``parent`` is the hash value of block ``first_block - 1`` (or the root for block 0).
    ``extra_keys``, when given, holds one entry per block of the range (``None`` for none);
    when omitted every block has ``None`` extras (the common, fast case)."""
    start = first_block * block_size
    stop = end_block * block_size
    tokens = tuple(token_ids[start:stop])
    out: list[tuple[Any, tuple[int, ...], Any]] = []
    append = out.append
    if extra_keys is None and hash_function is _builtin_hash:
        for i in range(0, stop - start, block_size):
            block = tokens[i : i + block_size]
            parent = hash((parent, block))
            append((parent, block, None))
        return out
    if extra_keys is None and hash_function in _BYTES_HASHES:
        digest = _BYTES_HASHES[hash_function]
        raw = _token_bytes(tokens)
        width = block_size * 8
        header = struct.pack("<I", block_size)
        for j, i in enumerate(range(0, stop - start, block_size)):
            parent = digest(parent + header + raw[j * width : (j + 1) * width] + b"N")
            append((parent, tokens[i : i + block_size], None))
        return out
    if extra_keys is None:
        extra_keys = [None] * (end_block - first_block)
    for j, i in enumerate(range(0, stop - start, block_size)):
        block = tokens[i : i + block_size]
        extras = extra_keys[j]
        parent = hash_function(parent, block, extras)
        append((parent, block, extras))
    return out


def hash_value_of(block_hash: BlockHash) -> Any:
    """The hash value of a block hash: the first field of a computed ``(hash_value, token_ids,
    extra_keys)`` block hash, or a precomputed hash itself. The next block chains from it, and
    the pool's map is keyed by it (cheap to hash again, unlike the whole tuple).

    The two per-block loops of the core (the manager's lookup and ``cache_full_blocks``) write
    this expression out instead of calling it: a call per block costs 2-8% there. Eviction does
    not derive it at all: a cached block keeps its value (``KVCacheBlock.hash_value``)."""
    return block_hash[0] if type(block_hash) is tuple else block_hash
