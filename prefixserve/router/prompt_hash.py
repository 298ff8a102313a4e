"""The chain of block hash values of a prompt, computed exactly as a replica computes it.

A replica names a full block ``i`` of a request by the core's chain hashing
(``prefixserve.core.hashing``): the hash function over the parent's value, the block's tokens and
its extra keys (LoRA adapter, cache salt in block 0). A router that hashes the incoming prompt's
token ids with the same algorithm, root and block size gets the very values the replicas publish
in their ``BlockStored`` events, so no model is needed to route, only the tokenizer.

The root is ``NONE_HASH``: the same in every process that shares ``PYTHONHASHSEED`` (the Ray
deployment sets it for the router and every replica). ``builtin`` hashes agree across processes
only for int-only chains, so routers should use ``sha256`` or ``xxhash``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from typing import Any

from prefixserve.core.hashing import get_hash_function, hash_block_chain
from prefixserve.core.request import CacheRequest, block_extra_keys


class PromptHasher:
    """Block hash values of prompts for one block size and hash algorithm."""

    def __init__(self, block_size: int, hash_algo: str = "sha256",
                 seed: str | None = None) -> None:
        """``seed``: the replicas' ``PYTHONHASHSEED``, when this process does not share it (the
        root is then derived from it as the replicas derive theirs)."""
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.hash_algo = hash_algo
        self._function, self._root = get_hash_function(hash_algo)
        if seed is not None:
            root = hashlib.sha256(seed.encode()).digest()
            self._root = int.from_bytes(root, "little") if hash_algo == "builtin" else root

    def hash_values(self, token_ids: Sequence[int], cache_salt: str | None = None,
                    lora_id: Any = None) -> list[Hashable]:
        """One value per full block of ``token_ids``, in chain order."""
        num_blocks = len(token_ids) // self.block_size
        if num_blocks == 0:
            return []
        request = CacheRequest("route", token_ids, cache_salt=cache_salt, lora_id=lora_id)
        extras = block_extra_keys(request, self.block_size, 0, num_blocks)
        chain = hash_block_chain(self._function, self._root, token_ids, self.block_size, 0,
                                 num_blocks, extras)
        return [block_hash[0] for block_hash in chain]
