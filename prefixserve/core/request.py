"""The request as the prefix cache sees it, and the extra keys derived from it.

Extra keys make the same tokens under different conditions different blocks. Each kind is an
``ExtraKeySource``: it says whether it applies to a request and, if so, what it adds to a given
block. The chain logic only concatenates what the applicable sources return, so a new kind of
extra key is one more entry in ``EXTRA_KEY_SOURCES``, with no change to the chain.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from prefixserve.core.retention import Retention


class MultiModalInput(NamedTuple):
    """A multimodal input occupying placeholder tokens ``[offset, offset + length)`` of the
    prompt, identified by a hash of its content."""

    offset: int
    length: int
    content_hash: str


@dataclass(slots=True, eq=False)
class CacheRequest:
    """What the prefix cache needs to know about a request.

    ``token_ids`` holds the prompt followed by the tokens generated so far; the engine appends to
    it during decode. ``num_computed_tokens`` is the number of leading tokens whose KV is in the
    request's blocks; the engine advances it after each step and resets it to 0 on preemption.
    ``block_hashes``, when given, are precomputed block hashes (one per full block, any hashable
    values) used instead of hashing ``token_ids``; ``token_ids`` then only has to have the right
    length (``range(n)`` will do). ``retention``, when given, asks the cache to keep the blocks
    of some prompt ranges longer (``core/retention.py``).
    """

    request_id: str
    token_ids: Sequence[int]
    cache_salt: str | None = None
    lora_id: int | str | None = None
    mm_inputs: Sequence[MultiModalInput] = ()
    wants_prompt_logprobs: bool = False
    block_hashes: Sequence[Hashable] | None = None
    num_computed_tokens: int = 0
    num_prompt_tokens: int = field(default=-1)
    retention: Retention | None = None

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class ExtraKeySource(NamedTuple):
    """One kind of extra key: ``applies(request)`` is checked once per request; ``keys(request,
    block_index, start, end)`` returns the keys it adds to the block covering tokens
    ``[start, end)`` (an empty tuple for none)."""

    applies: Callable[[CacheRequest], bool]
    keys: Callable[[CacheRequest, int, int, int], tuple[Any, ...]]


def _lora_keys(request: CacheRequest, index: int, start: int, end: int) -> tuple[Any, ...]:
    return (("lora", request.lora_id),)


def _mm_keys(request: CacheRequest, index: int, start: int, end: int) -> tuple[Any, ...]:
    return tuple(
        ("mm", mm.content_hash)
        for mm in request.mm_inputs
        if mm.offset < end and mm.offset + mm.length > start
    )


def _salt_keys(request: CacheRequest, index: int, start: int, end: int) -> tuple[Any, ...]:
    return (("salt", request.cache_salt),) if index == 0 else ()


EXTRA_KEY_SOURCES: list[ExtraKeySource] = [
    ExtraKeySource(lambda r: r.lora_id is not None, _lora_keys),
    ExtraKeySource(lambda r: bool(r.mm_inputs), _mm_keys),
    ExtraKeySource(lambda r: r.cache_salt is not None, _salt_keys),
]
"""The kinds of extra key, in the order their keys appear in a block's extras."""


def block_extra_keys(
    request: CacheRequest, block_size: int, first_block: int, end_block: int
) -> list[tuple[Any, ...] | None] | None:
    """Extra keys of blocks ``first_block .. end_block - 1``: one entry per block (``None`` where
    a block has none), or ``None`` when no source applies to the request (the fast path)."""
    sources = [s.keys for s in EXTRA_KEY_SOURCES if s.applies(request)]
    if not sources:
        return None
    out: list[tuple[Any, ...] | None] = []
    for index in range(first_block, end_block):
        start = index * block_size
        end = start + block_size
        keys: tuple[Any, ...] = ()
        for source in sources:
            keys += source(request, index, start, end)
        out.append(keys or None)
    return out
