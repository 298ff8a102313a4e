"""Small drivers for the core tests: run a request through the manager the way a scheduler does."""

from __future__ import annotations

from prefixserve.core import CacheRequest, KVCacheManager


def admit(manager: KVCacheManager, request: CacheRequest) -> int:
    """Looks the request up and allocates its whole prompt; returns the cached token count."""
    computed, num_computed = manager.get_computed_blocks(request)
    blocks = manager.allocate_slots(request, request.num_tokens - num_computed, computed)
    assert blocks is not None, "pool too small for the test"
    request.num_computed_tokens = request.num_tokens
    return num_computed


def finish(manager: KVCacheManager, request: CacheRequest) -> None:
    manager.free(request)
    manager.free_block_hashes(request)


def run_once(manager: KVCacheManager, request: CacheRequest) -> int:
    """Admits and finishes the request; returns its cached token count."""
    cached = admit(manager, request)
    finish(manager, request)
    return cached


def decode(manager: KVCacheManager, request: CacheRequest, tokens: list[int]) -> None:
    """Appends ``tokens`` one decode step at a time."""
    for token in tokens:
        list.append(request.token_ids, token)  # type: ignore[arg-type]
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
