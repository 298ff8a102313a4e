"""Two-pass decode attention for decoding sequences that share their first cached blocks.

Decoding sequences that begin with the same cached blocks (a shared system prompt, the turns of
one conversation) attend in two passes: each group's shared keys are read from the cache once
for all its members (a sequence without a partner is a group of one), the keys after the prefix
once per sequence, and the two partial results are merged by their log-sum-exp. Without it every
member copies the whole shared prefix out of the cache at every layer, which at long shared
contexts is most of the time of a decode step on CPU.

:func:`split_shared_prefixes` plans a step (once, for all layers): it groups the sequences
(:func:`shared_prefix_groups`, with the threshold rule that decides whether the two passes pay
off) and cuts each sequence's prefix off its block table. :func:`two_pass_decode` runs the two
passes in each layer. The paged layout itself is :mod:`prefixserve.model.attention.paged`'s, which
calls into this module and hands it the two things of that layout it needs: a padding mask and
a way to read K/V out of the cache (:data:`PaddingMask`, :data:`ReadBlocks`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

MIN_SAVED_KEYS = 2048
"""Two-pass decode is used when it saves copying at least this many keys in a step (each
layer): below that its extra operations cost more than the copies they save."""
MIN_GROUP_BLOCKS = 4
"""Sequences are grouped on a shared prefix of at least this many blocks."""

PaddingMask = Callable[[list[int], int], torch.Tensor | None]
"""``mask(lens, num_keys)``: the additive mask ``[len(lens), 1, 1, num_keys]`` of key rows of
these lengths padded to ``num_keys`` (0 before each length, -inf after), None when no row is
padded."""
ReadBlocks = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
"""``read(block_tables, num_keys)``: K and V of the first ``num_keys`` positions of the blocks
of each row of ``block_tables`` ``[G, blocks]``, each ``[G, num_keys, kv_heads, head_dim]``."""


@dataclass
class PrefixBatch:
    """Prefix groups with the same number of members, attended in one call.

    ``block_tables`` is ``[G, max_blocks]``: the blocks each of the G groups has in common
    (padded with block 0), ``num_keys`` the longest of those prefixes in tokens, ``key_mask``
    ``[G, 1, 1, num_keys]`` additive (0 or -inf; None when every prefix has ``num_keys``
    tokens), and ``members`` ``[G, M]`` the positions of each group's sequences in the decode
    batch.
    """

    block_tables: torch.Tensor
    num_keys: int
    key_mask: torch.Tensor | None
    members: torch.Tensor


@dataclass
class SharedPrefixes:
    """The decoding sequences split into a prefix (shared by a group, or a sequence's own when
    alone) and what follows it. ``batches`` hold the groups, by number of members; ``grouped``
    is ``cat(batch.members.flatten() for batch in batches)``: which decode-batch position each
    row of the concatenated prefix results belongs to.
    """

    batches: list[PrefixBatch]
    grouped: torch.Tensor


def split_shared_prefixes(
    tables: list[list[int]],
    lens: list[int],
    block_size: int,
    device: torch.device,
    mask: PaddingMask,
) -> tuple[SharedPrefixes | None, list[list[int]], list[int]]:
    """The prefixes of the decoding sequences with block tables ``tables`` and context lengths
    ``lens``, and each sequence's table and length after its prefix: ``(None, tables, lens)``
    unchanged when :func:`shared_prefix_groups` finds no groups (the two passes would not pay
    off). ``mask`` builds the prefixes' padding masks."""
    groups = shared_prefix_groups(tables, lens, block_size)
    if not groups:
        return None, tables, lens
    shared = _shared_prefixes(groups, tables, block_size, device, mask)
    skip = [0] * len(tables)
    for members, n in groups:
        for i in members:
            skip[i] = n
    tables = [t[n:] for t, n in zip(tables, skip, strict=True)]
    lens = [length - n * block_size for length, n in zip(lens, skip, strict=True)]
    return shared, tables, lens


def shared_prefix_groups(
    tables: list[list[int]], lens: list[int], block_size: int
) -> list[tuple[list[int], int]]:
    """``(members, shared blocks)`` for each run of at least two decoding sequences that share
    their first ``MIN_GROUP_BLOCKS`` blocks or more, when sharing saves copying
    ``MIN_SAVED_KEYS`` keys or more in all (otherwise none), and then a group of one for every
    other sequence longer than a block.

    Tables are sorted, so sequences with common first blocks are neighbours; a run goes on while
    each next table shares at least ``MIN_GROUP_BLOCKS`` blocks with the one before, and the
    group shares what all its members have in common. A prefix stops before the block of any
    member's last position, so every member keeps at least one key (its new token's) of its own.
    """
    order = sorted(range(len(tables)), key=tables.__getitem__)
    groups: list[tuple[list[int], int]] = []
    alone: list[int] = []
    saved = 0
    members = [order[0]]
    shared = 0
    for i in [*order[1:], None]:
        common = 0 if i is None else _common_blocks(tables, lens, members[-1], i, block_size)
        if i is not None and common >= MIN_GROUP_BLOCKS:
            shared = common if len(members) == 1 else min(shared, common)
            members.append(i)
            continue
        if len(members) > 1:
            groups.append((members, shared))
            saved += (len(members) - 1) * shared * block_size
        else:
            alone.append(members[0])
        if i is None:  # the end, its last run flushed
            break
        members = [i]
    if saved < MIN_SAVED_KEYS:
        return []
    # The rest have their own prefix in the same pass, so that the second pass, padded to its
    # longest sequence, holds only the last blocks of each.
    groups += [([i], (lens[i] - 1) // block_size) for i in alone if lens[i] > block_size]
    return groups


def _common_blocks(tables: list[list[int]], lens: list[int], a: int, b: int,
                   block_size: int) -> int:
    """How many first blocks sequences ``a`` and ``b`` have in common, not counting the block
    of either one's last position or any after it."""
    table_a, table_b = tables[a], tables[b]
    limit = min(len(table_a), len(table_b), (lens[a] - 1) // block_size,
                (lens[b] - 1) // block_size)
    common = 0
    while common < limit and table_a[common] == table_b[common]:
        common += 1
    return common


def _shared_prefixes(
    groups: list[tuple[list[int], int]],
    tables: list[list[int]],
    block_size: int,
    device: torch.device,
    mask: PaddingMask,
) -> SharedPrefixes:
    """The prefix batches of ``groups`` (from :func:`shared_prefix_groups`), one per number of
    members, each group's prefix read from its first member's table."""
    by_size: dict[int, list[tuple[list[int], int]]] = {}
    for members, shared in groups:
        by_size.setdefault(len(members), []).append((members, shared))
    batches = []
    grouped: list[int] = []
    for same_size in by_size.values():
        max_blocks = max(shared for _, shared in same_size)
        prefix_tables = [tables[m[0]][:n] + [0] * (max_blocks - n) for m, n in same_size]
        lens = [n * block_size for _, n in same_size]
        batches.append(PrefixBatch(
            torch.tensor(prefix_tables, dtype=torch.long, device=device),
            max_blocks * block_size,
            mask(lens, max_blocks * block_size),
            torch.tensor([m for m, _ in same_size], dtype=torch.long, device=device),
        ))
        grouped += [i for m, _ in same_size for i in m]
    return SharedPrefixes(batches, torch.tensor(grouped, dtype=torch.long, device=device))


def _attention_with_lse(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query`` ``[N, kv_heads, Q, head_dim]`` over ``keys``/``values`` ``[N,
    K, kv_heads, head_dim]`` with an additive ``mask``; returns the output and the log-sum-exp
    of each query's scores (float32, ``[N, kv_heads, Q]``). Uses the CPU flash-attention
    kernel (the one that returns the log-sum-exp)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask
    )
    return out, lse


def two_pass_decode(
    query: torch.Tensor,
    own_keys: torch.Tensor,
    own_values: torch.Tensor,
    own_mask: torch.Tensor | None,
    shared: SharedPrefixes,
    read: ReadBlocks,
) -> torch.Tensor:
    """Decode attention for ``query`` ``[B, kv_heads, heads per kv head, head_dim]`` as the
    softmax-weighted merge of attention over the keys after each sequence's prefix
    (``own_keys``/``own_values`` ``[B, keys, kv_heads, head_dim]``, padding masked by
    ``own_mask``) and over the prefix (read with ``read`` once for all members of a group).
    Returns ``[B, kv_heads, heads per kv head, head_dim]`` in the query's dtype."""
    out, lse = _attention_with_lse(query, own_keys, own_values, own_mask)
    num_kv_heads, per_kv, head_dim = query.shape[1:]
    outs, lses = [], []
    for batch in shared.batches:
        num_groups, members = batch.members.shape
        # [G, M, kv_heads, per_kv, D] -> [G, kv_heads, M * per_kv, D]: a group's queries.
        members_q = query.index_select(0, batch.members.flatten())
        members_q = members_q.view(num_groups, members, num_kv_heads, per_kv, head_dim)
        members_q = members_q.transpose(1, 2).reshape(num_groups, num_kv_heads, -1, head_dim)
        keys, values = read(batch.block_tables, batch.num_keys)
        prefix_out, prefix_lse = _attention_with_lse(members_q, keys, values, batch.key_mask)
        prefix_out = prefix_out.view(num_groups, num_kv_heads, members, per_kv, head_dim)
        outs.append(prefix_out.transpose(1, 2).reshape(-1, num_kv_heads, per_kv, head_dim))
        prefix_lse = prefix_lse.view(num_groups, num_kv_heads, members, per_kv)
        lses.append(prefix_lse.transpose(1, 2).reshape(-1, num_kv_heads, per_kv))
    prefix_out = outs[0] if len(outs) == 1 else torch.cat(outs)
    prefix_lse = lses[0] if len(lses) == 1 else torch.cat(lses)
    own_out = out.index_select(0, shared.grouped)
    own_lse = lse.index_select(0, shared.grouped)
    total = torch.logaddexp(own_lse, prefix_lse)
    merged = (own_out.float() * torch.exp(own_lse - total).unsqueeze(-1)
              + prefix_out.float() * torch.exp(prefix_lse - total).unsqueeze(-1))
    return out.index_copy(0, shared.grouped, merged.to(out.dtype))
