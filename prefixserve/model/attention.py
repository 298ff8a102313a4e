"""Paged KV cache: per-step attention metadata, cache writes, and attention over blocks.

Cache layout, per layer: ``[2, num_blocks * block_size, num_kv_heads, head_dim]`` (K then V).
Slot ``s`` holds position ``s % block_size`` of block ``s // block_size``; a sequence's
position ``p`` lives at slot ``block_table[p // block_size] * block_size + p % block_size``.

Each layer first writes the new K/V of every sequence of the step (:func:`write_kv`), then
computes attention (:func:`paged_attention`), so a sequence may read blocks that another
sequence of the same step writes. All index tensors are built once per step in
:class:`AttentionMetadata` and reused by every layer.

Decoding sequences that begin with the same cached blocks (a shared system prompt, the turns of
one conversation) attend in two passes (:class:`SharedPrefixes`): each group's shared keys are
read from the cache once for all its members (a sequence without a partner is a group of one),
the keys after the prefix once per sequence, and the two partial results are merged by their
log-sum-exp. Without it every member copies the whole
shared prefix out of the cache at every layer, which at long shared contexts is most of the time
of a decode step on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

MIN_SAVED_KEYS = 2048
"""Two-pass decode is used when it saves copying at least this many keys in a step (each
layer): below that its extra operations cost more than the copies they save."""
MIN_GROUP_BLOCKS = 4
"""Sequences are grouped on a shared prefix of at least this many blocks."""


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


@dataclass
class DecodeGroup:
    """Sequences with exactly one new token, attended in one padded SDPA call.

    ``rows`` are their rows in the flattened token batch (None when they are all the rows, in
    order). ``block_tables`` is ``[B, max_blocks]`` (padded with block 0), ``num_keys`` the
    longest context, and ``mask`` ``[B, 1, 1, num_keys]`` additive (0 or -inf, in the cache's
    dtype) or None when every context has length ``num_keys``. With ``shared`` set,
    ``block_tables`` and ``num_keys`` cover only the blocks after each sequence's prefix (see
    :class:`SharedPrefixes`; all of them for a sequence in no group).
    """

    rows: torch.Tensor | None
    block_tables: torch.Tensor
    num_keys: int
    mask: torch.Tensor | None
    shared: SharedPrefixes | None = None


@dataclass
class PrefillSeq:
    """A sequence with several new tokens: rows ``[start, end)`` of the flattened batch.

    With ``cached`` False (nothing of it was in the cache before this step) attention uses the
    fresh K/V with a plain causal mask. Otherwise K/V of ``num_keys`` positions are gathered
    from ``block_table`` and ``mask`` (``[end-start, num_keys]``) is causal offset by the
    number of cached tokens.
    """

    start: int
    end: int
    cached: bool
    block_table: torch.Tensor | None
    num_keys: int
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, shared by all layers."""

    slot_mapping: torch.Tensor
    decode: DecodeGroup | None
    prefills: list[PrefillSeq]
    num_tokens: int


def build_metadata(
    seq_lens: list[tuple[int, int]],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> AttentionMetadata:
    """Index tensors for one step.

    ``seq_lens[i]`` is ``(start_pos, num_new_tokens)`` of sequence i; sequences occupy
    consecutive rows of the flattened batch in order. ``dtype`` is the cache's (for additive
    masks).
    """
    slots: list[int] = []
    decode_rows: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    prefills: list[PrefillSeq] = []
    row = 0
    for (start_pos, n), table in zip(seq_lens, block_tables, strict=True):
        end_pos = start_pos + n
        for b in range(start_pos // block_size, (end_pos - 1) // block_size + 1):
            base = table[b] * block_size
            lo = max(start_pos, b * block_size) - b * block_size
            hi = min(end_pos, (b + 1) * block_size) - b * block_size
            slots.extend(range(base + lo, base + hi))
        used_blocks = table[: (end_pos - 1) // block_size + 1]
        if n == 1:
            decode_rows.append(row)
            decode_tables.append(used_blocks)
            decode_lens.append(end_pos)
        elif start_pos == 0:
            prefills.append(PrefillSeq(row, row + n, False, None, n, None))
        else:
            q_pos = torch.arange(start_pos, end_pos, device=device)
            k_pos = torch.arange(end_pos, device=device)
            mask = k_pos[None, :] <= q_pos[:, None]
            bt = torch.tensor(used_blocks, dtype=torch.long, device=device)
            prefills.append(PrefillSeq(row, row + n, True, bt, end_pos, mask))
        row += n
    decode = None
    if decode_rows:
        decode = _decode_group(decode_rows, decode_tables, decode_lens, row, block_size, device,
                               dtype)
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
    return AttentionMetadata(slot_mapping, decode, prefills, row)


def _shared_prefix_groups(
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
        common = 0
        if i is not None:
            a, b = tables[members[-1]], tables[i]
            limit = min(len(a), len(b), (lens[members[-1]] - 1) // block_size,
                        (lens[i] - 1) // block_size)
            while common < limit and a[common] == b[common]:
                common += 1
        if common >= MIN_GROUP_BLOCKS:
            shared = common if len(members) == 1 else min(shared, common)
            members.append(i)
            continue
        if len(members) > 1:
            groups.append((members, shared))
            saved += (len(members) - 1) * shared * block_size
        else:
            alone.append(members[0])
        members = [i]
    if saved < MIN_SAVED_KEYS:
        return []
    # The rest have their own prefix in the same pass, so that the second pass, padded to its
    # longest sequence, holds only the last blocks of each.
    groups += [([i], (lens[i] - 1) // block_size) for i in alone if lens[i] > block_size]
    return groups


def _additive_mask(lens: list[int], num_keys: int, device: torch.device, dtype: torch.dtype
                   ) -> torch.Tensor | None:
    """``[len(lens), 1, 1, num_keys]``: 0 before each length, -inf after (None if no padding)."""
    if min(lens) == num_keys:
        return None
    lens_t = torch.tensor(lens, device=device)
    pad = torch.arange(num_keys, device=device)[None, :] >= lens_t[:, None]
    mask = torch.zeros(pad.shape, dtype=dtype, device=device).masked_fill_(pad, float("-inf"))
    return mask[:, None, None, :]


def _shared_prefixes(
    groups: list[tuple[list[int], int]],
    tables: list[list[int]],
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> SharedPrefixes:
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
            _additive_mask(lens, max_blocks * block_size, device, dtype),
            torch.tensor([m for m, _ in same_size], dtype=torch.long, device=device),
        ))
        grouped += [i for m, _ in same_size for i in m]
    return SharedPrefixes(batches, torch.tensor(grouped, dtype=torch.long, device=device))


def _decode_group(
    rows: list[int],
    tables: list[list[int]],
    lens: list[int],
    num_tokens: int,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> DecodeGroup:
    rows_t = None
    if len(rows) != num_tokens:
        rows_t = torch.tensor(rows, dtype=torch.long, device=device)
    # The two-pass path uses the CPU flash-attention kernel (for its log-sum-exp).
    groups = _shared_prefix_groups(tables, lens, block_size) if device.type == "cpu" else []
    shared = None
    if groups:
        shared = _shared_prefixes(groups, tables, block_size, device, dtype)
        skip = [0] * len(tables)
        for members, n in groups:
            for i in members:
                skip[i] = n
        tables = [t[n:] for t, n in zip(tables, skip, strict=True)]
        lens = [length - n * block_size for length, n in zip(lens, skip, strict=True)]
    max_blocks = max(len(t) for t in tables)
    padded = [t + [0] * (max_blocks - len(t)) for t in tables]
    num_keys = max(lens)
    tables_t = torch.tensor(padded, dtype=torch.long, device=device)
    return DecodeGroup(rows_t, tables_t, num_keys, _additive_mask(lens, num_keys, device, dtype),
                       shared)


def write_kv(
    layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``k``/``v`` (``[num_tokens, kv_heads, head_dim]``) at their slots."""
    layer_cache[0].index_copy_(0, slot_mapping, k)
    layer_cache[1].index_copy_(0, slot_mapping, v)


def _gather(
    layer_cache: torch.Tensor, block_tables: torch.Tensor, block_size: int, num_keys: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first ``num_keys`` positions of the given blocks (one gather for both).

    ``block_tables`` is ``[blocks]`` or ``[B, blocks]``; K and V come back as
    ``[..., num_keys, kv_heads, head_dim]``.
    """
    shape = layer_cache.shape
    blocks = layer_cache.view(2, shape[1] // block_size, block_size, *shape[2:])[:, block_tables]
    kv = blocks.flatten(-4, -3)[..., :num_keys, :, :]
    return kv[0], kv[1]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_cache: torch.Tensor,
    meta: AttentionMetadata,
    block_size: int,
) -> torch.Tensor:
    """Causal attention of the step's queries over their sequences' cached K/V.

    ``q`` is ``[num_tokens, heads, head_dim]``, ``k``/``v`` the step's new keys/values
    ``[num_tokens, kv_heads, head_dim]`` (already written to ``layer_cache``). Returns
    ``[num_tokens, heads, head_dim]``.
    """
    if meta.decode is not None and meta.decode.rows is None:
        return _decode_attention(q, layer_cache, meta.decode, block_size)
    if meta.decode is None and len(meta.prefills) == 1:
        return _prefill_attention(q, k, v, layer_cache, meta.prefills[0], block_size)
    out = torch.empty_like(q)
    if meta.decode is not None:
        rows = meta.decode.rows
        decoded = _decode_attention(q.index_select(0, rows), layer_cache, meta.decode, block_size)
        out.index_copy_(0, rows, decoded)
    for seq in meta.prefills:
        out[seq.start : seq.end] = _prefill_attention(q, k, v, layer_cache, seq, block_size)
    return out


def _decode_attention(
    q: torch.Tensor, layer_cache: torch.Tensor, group: DecodeGroup, block_size: int
) -> torch.Tensor:
    """One new token per sequence. The query heads sharing a KV head (consecutive heads, as in
    grouped-query attention) are passed to SDPA as that head's queries: ``[B, kv_heads, group,
    head_dim]`` against ``[B, kv_heads, keys, head_dim]``. Same result as SDPA's own GQA
    broadcast, and 3x faster for bfloat16 on CPU, where that path is slow."""
    keys, values = _gather(layer_cache, group.block_tables, block_size, group.num_keys)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[2]
    query = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if group.shared is not None:
        out = _two_pass_decode(query, keys, values, layer_cache, group, block_size)
    else:
        out = F.scaled_dot_product_attention(
            query, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=group.mask
        )
    return out.reshape(batch, num_heads, head_dim)


def _attention_with_lse(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query`` ``[N, kv_heads, Q, head_dim]`` over ``keys``/``values`` ``[N,
    K, kv_heads, head_dim]`` with an additive ``mask``; returns the output and the log-sum-exp
    of each query's scores (float32, ``[N, kv_heads, Q]``)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask
    )
    return out, lse


def _two_pass_decode(
    query: torch.Tensor,
    own_keys: torch.Tensor,
    own_values: torch.Tensor,
    layer_cache: torch.Tensor,
    group: DecodeGroup,
    block_size: int,
) -> torch.Tensor:
    """Decode attention for ``query`` ``[B, kv_heads, heads per kv head, head_dim]`` as the
    softmax-weighted merge of attention over the keys after each sequence's prefix
    (``own_keys``) and over the prefix (read once for all members of a group)."""
    shared = group.shared
    assert shared is not None
    out, lse = _attention_with_lse(query, own_keys, own_values, group.mask)
    num_kv_heads, per_kv, head_dim = query.shape[1:]
    outs, lses = [], []
    for batch in shared.batches:
        num_groups, members = batch.members.shape
        # [G, M, kv_heads, per_kv, D] -> [G, kv_heads, M * per_kv, D]: a group's queries.
        members_q = query.index_select(0, batch.members.flatten())
        members_q = members_q.view(num_groups, members, num_kv_heads, per_kv, head_dim)
        members_q = members_q.transpose(1, 2).reshape(num_groups, num_kv_heads, -1, head_dim)
        keys, values = _gather(layer_cache, batch.block_tables, block_size, batch.num_keys)
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


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_cache: torch.Tensor,
    seq: PrefillSeq,
    block_size: int,
) -> torch.Tensor:
    query = q[seq.start : seq.end].transpose(0, 1)[None]
    if not seq.cached:
        keys = k[seq.start : seq.end]
        values = v[seq.start : seq.end]
    else:
        keys, values = _gather(layer_cache, seq.block_table, block_size, seq.num_keys)
    out = F.scaled_dot_product_attention(
        query,
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=seq.mask,
        is_causal=not seq.cached,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)
