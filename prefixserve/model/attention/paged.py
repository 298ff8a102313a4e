"""Paged KV cache: per-step attention metadata, cache writes, and attention over blocks.

Cache layout, per layer: ``[2, num_blocks * block_size, num_kv_heads, head_dim]`` (K then V).
Slot ``s`` holds position ``s % block_size`` of block ``s // block_size``; a sequence's
position ``p`` lives at slot ``block_table[p // block_size] * block_size + p % block_size``.

Each layer first writes the new K/V of every sequence of the step (:func:`write_kv`), then
computes attention (:func:`paged_attention`), so a sequence may read blocks that another
sequence of the same step writes. All index tensors are built once per step in
:class:`AttentionMetadata` and reused by every layer.

Decoding sequences that begin with the same cached blocks (a shared system prompt, the turns of
one conversation) attend in two passes on CPU, the shared keys read from the cache once per
group: :mod:`prefixserve.model.attention.shared_prefix` plans that when building the metadata
(:attr:`DecodeGroup.shared`) and runs it in :func:`paged_attention`; this module keeps the paged
layout and the plain attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from prefixserve.model.attention import shared_prefix as shared_prefix_attention
from prefixserve.model.attention.batch_invariant import KeyTables, invariant_attention
from prefixserve.model.attention.shared_prefix import (
    SharedPrefixes,
    split_shared_prefixes,
    two_pass_decode,
)

if TYPE_CHECKING:  # prompt_attention imports the model, which imports this module
    from prefixserve.model.attention.prompt import KernelPlan, PromptAttention


@dataclass
class DecodeGroup:
    """Sequences with exactly one new token, attended in one padded SDPA call.

    ``rows`` are their rows in the flattened token batch (None when they are all the rows, in
    order). ``block_tables`` is ``[B, max_blocks]`` (padded with block 0), ``num_keys`` the
    longest context, and ``mask`` ``[B, 1, 1, num_keys]`` additive (0 or -inf, in the cache's
    dtype) or None when every context has length ``num_keys``. With ``shared`` set,
    ``block_tables`` and ``num_keys`` cover only the blocks after each sequence's prefix (see
    :class:`~prefixserve.model.attention.shared_prefix.SharedPrefixes`; all of them for a
    sequence in no group).
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
    fresh K/V with a plain causal mask, or with ``mask`` when one is given (a sliding window,
    :mod:`prefixserve.model.attention.window`). Otherwise K/V of ``num_keys`` positions are gathered
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
    """Everything attention needs for one step, shared by all layers. With ``invariant`` set
    (the deterministic mode) or ``kernel`` (the C kernel's plan,
    :mod:`prefixserve.model.attention.prompt`) every row attends through it, and ``decode``
    and ``prefills`` are empty."""

    slot_mapping: torch.Tensor
    decode: DecodeGroup | None
    prefills: list[PrefillSeq]
    num_tokens: int
    invariant: KeyTables | None = None
    kernel: KernelPlan | None = None


@dataclass
class TableRows:
    """Block tables already in a tensor (the model runner keeps them between steps): row
    ``rows[i]`` of ``buffer`` (``[num_rows, width]``, long) holds the block table of sequence i
    in its first entries, at least up to the block of its last new position, and zeros after
    its table. With them, a step's index tensors are views or one ``index_select`` of
    ``buffer`` instead of tensors built from the tables' Python lists."""

    buffer: torch.Tensor
    rows: list[int]


def build_metadata(
    seq_lens: list[tuple[int, int]],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    table_rows: TableRows | None = None,
    deterministic: bool = False,
    kernel: PromptAttention | None = None,
) -> AttentionMetadata:
    """Index tensors for one step.

    ``seq_lens[i]`` is ``(start_pos, num_new_tokens)`` of sequence i; sequences occupy
    consecutive rows of the flattened batch in order. ``dtype`` is the cache's (for additive
    masks). ``table_rows``, when given, holds the same tables as ``block_tables`` (which are
    then read only at the new positions, and by the shared-prefix planning of a decode batch).
    ``deterministic`` plans the batch-invariant attention instead (see
    :mod:`prefixserve.model.attention.batch_invariant`), ``kernel`` the C kernel's (on CPU, with
    ``table_rows``).
    """
    if deterministic:
        return _invariant_metadata(seq_lens, block_tables, block_size, device, table_rows)
    if kernel is not None and table_rows is not None:
        return _kernel_metadata(seq_lens, block_tables, block_size, device, table_rows, kernel)
    slots: list[int] = []
    decode_seqs: list[int] = []
    decode_rows: list[int] = []
    decode_lens: list[int] = []
    prefills: list[PrefillSeq] = []
    row = 0
    for i, ((start_pos, n), table) in enumerate(zip(seq_lens, block_tables, strict=True)):
        end_pos = start_pos + n
        if n == 1:
            slots.append(table[start_pos // block_size] * block_size + start_pos % block_size)
            decode_seqs.append(i)
            decode_rows.append(row)
            decode_lens.append(end_pos)
        else:
            slots += _slots(table, start_pos, end_pos, block_size)
            if start_pos == 0:
                prefills.append(PrefillSeq(row, row + n, False, None, n, None))
            else:
                table_t = _table_tensor(table, i, (end_pos - 1) // block_size + 1, table_rows,
                                        device)
                prefills.append(_cached_prefill(row, start_pos, end_pos, table_t))
        row += n
    decode = None
    if decode_rows:
        tables = _DecodeTables(block_tables, decode_seqs, table_rows)
        decode = _decode_group(decode_rows, tables, decode_lens, row, block_size, device, dtype)
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
    return AttentionMetadata(slot_mapping, decode, prefills, row)


def _invariant_metadata(seq_lens: list[tuple[int, int]], block_tables: list[list[int]],
                        block_size: int, device: torch.device, table_rows: TableRows | None,
                        window: int | None = None) -> AttentionMetadata:
    """The metadata of a step whose every row attends by ``invariant_attention``: its slots,
    and for each row its sequence's table and its position (over a sliding ``window``, or the
    whole context)."""
    slots: list[int] = []
    table_of_row: list[int] = []
    positions: list[int] = []
    for i, ((start_pos, n), table) in enumerate(zip(seq_lens, block_tables, strict=True)):
        slots += _slots(table, start_pos, start_pos + n, block_size)
        table_of_row += [i if table_rows is None else table_rows.rows[i]] * n
        positions += range(start_pos, start_pos + n)
    if table_rows is not None:
        tables = table_rows.buffer
    else:
        used = [(s + n - 1) // block_size + 1 for s, n in seq_lens]
        width = max(used)
        tables = torch.tensor([_used(t, u) + [0] * (width - u)
                               for t, u in zip(block_tables, used, strict=True)],
                              dtype=torch.long, device=device)
    keys = KeyTables(tables, torch.tensor(table_of_row, dtype=torch.long, device=device),
                     torch.tensor(positions, dtype=torch.long, device=device), window or 0)
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
    return AttentionMetadata(slot_mapping, None, [], len(slots), keys)


def _kernel_metadata(seq_lens: list[tuple[int, int]], block_tables: list[list[int]],
                     block_size: int, device: torch.device, table_rows: TableRows,
                     kernel: PromptAttention, window: int | None = None) -> AttentionMetadata:
    """The metadata of a step whose every row attends through the C kernel: its slots, and the
    kernel's plan of each row's position and table (over a sliding ``window``, or the whole
    context)."""
    slots: list[int] = []
    table_of_row: list[int] = []
    positions: list[int] = []
    for i, ((start_pos, n), table) in enumerate(zip(seq_lens, block_tables, strict=True)):
        slots += _slots(table, start_pos, start_pos + n, block_size)
        table_of_row += [table_rows.rows[i]] * n
        positions += range(start_pos, start_pos + n)
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
    plan = kernel.plan(positions, table_of_row, table_rows.buffer, window)
    return AttentionMetadata(slot_mapping, None, [], len(slots), kernel=plan)


def _slots(table: list[int], start_pos: int, end_pos: int, block_size: int) -> list[int]:
    """The cache slots of positions ``[start_pos, end_pos)`` of the sequence with blocks
    ``table``, in order."""
    slots: list[int] = []
    for b in range(start_pos // block_size, (end_pos - 1) // block_size + 1):
        base = table[b] * block_size
        lo = max(start_pos, b * block_size) - b * block_size
        hi = min(end_pos, (b + 1) * block_size) - b * block_size
        slots.extend(range(base + lo, base + hi))
    return slots


def _used(table: list[int], num_used: int) -> list[int]:
    """The first ``num_used`` blocks of ``table`` (the table itself when that is all of it)."""
    return table if len(table) == num_used else table[:num_used]


def _table_tensor(table: list[int], index: int, num_used: int, table_rows: TableRows | None,
                  device: torch.device) -> torch.Tensor:
    """The first ``num_used`` blocks of sequence ``index``'s table as a long tensor."""
    if table_rows is not None:
        return table_rows.buffer[table_rows.rows[index], :num_used]
    return torch.tensor(_used(table, num_used), dtype=torch.long, device=device)


def _cached_prefill(row: int, start_pos: int, end_pos: int, block_table: torch.Tensor
                    ) -> PrefillSeq:
    """The prefill of positions ``[start_pos, end_pos)`` (``start_pos`` > 0: earlier positions
    are cached) at rows from ``row``, over the keys of ``block_table``, causally masked."""
    device = block_table.device
    q_pos = torch.arange(start_pos, end_pos, device=device)
    k_pos = torch.arange(end_pos, device=device)
    mask = k_pos[None, :] <= q_pos[:, None]
    return PrefillSeq(row, row + end_pos - start_pos, True, block_table, end_pos, mask)


def _additive_mask(lens: list[int], num_keys: int, device: torch.device, dtype: torch.dtype
                   ) -> torch.Tensor | None:
    """``[len(lens), 1, 1, num_keys]``: 0 before each length, -inf after (None if no padding)."""
    if min(lens) == num_keys:
        return None
    lens_t = torch.tensor(lens, device=device)
    pad = torch.arange(num_keys, device=device)[None, :] >= lens_t[:, None]
    mask = torch.zeros(pad.shape, dtype=dtype, device=device).masked_fill_(pad, float("-inf"))
    return mask[:, None, None, :]


@dataclass
class _DecodeTables:
    """The block tables of a step's decoding sequences (``seqs``: their indices in the step),
    as lists and, when the runner keeps them, as rows of its tensor."""

    all_tables: list[list[int]]
    seqs: list[int]
    table_rows: TableRows | None

    def lists(self, lens: list[int], block_size: int) -> list[list[int]]:
        """Each decoding sequence's table, cut to the blocks its ``lens`` keys use."""
        return [_used(self.all_tables[i], (length - 1) // block_size + 1)
                for i, length in zip(self.seqs, lens, strict=True)]

    def may_share(self) -> bool:
        """False when ``split_shared_prefixes`` would find no group, seen without planning:
        sequences share blocks only from their first one on, so with no first block in common
        nothing is shared (unless the threshold is off, which plans a lone sequence too)."""
        if shared_prefix_attention.MIN_SAVED_KEYS <= 0:
            return True
        tables = self.all_tables
        firsts = {tables[i][0] for i in self.seqs}
        return len(firsts) < len(self.seqs)

    def padded(self, max_blocks: int, device: torch.device) -> torch.Tensor | None:
        """``[B, max_blocks]`` from the runner's rows (zeros after each table), or None."""
        if self.table_rows is None:
            return None
        buffer, rows = self.table_rows.buffer, self.table_rows.rows
        wanted = [rows[i] for i in self.seqs]
        first = wanted[0]
        if wanted == list(range(first, first + len(wanted))):  # the usual case: a view
            return buffer[first : first + len(wanted), :max_blocks]
        index = torch.tensor(wanted, dtype=torch.long, device=device)
        return buffer[:, :max_blocks].index_select(0, index)


def _decode_group(
    rows: list[int],
    tables: _DecodeTables,
    lens: list[int],
    num_tokens: int,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> DecodeGroup:
    rows_t = None
    if len(rows) != num_tokens:
        rows_t = torch.tensor(rows, dtype=torch.long, device=device)
    table_lists = None
    # The two-pass path uses the CPU flash-attention kernel (for its log-sum-exp).
    if device.type == "cpu" and tables.may_share():
        table_lists = tables.lists(lens, block_size)
        shared, own_tables, own_lens = split_shared_prefixes(
            table_lists, lens, block_size, device,
            partial(_additive_mask, device=device, dtype=dtype))
        if shared is not None:
            return _padded_group(rows_t, own_tables, own_lens, shared, device, dtype)
    num_keys = max(lens)
    tables_t = tables.padded((num_keys - 1) // block_size + 1, device)
    if tables_t is None:
        table_lists = table_lists or tables.lists(lens, block_size)
        return _padded_group(rows_t, table_lists, lens, None, device, dtype)
    return DecodeGroup(rows_t, tables_t, num_keys, _additive_mask(lens, num_keys, device, dtype))


def _padded_group(rows_t: torch.Tensor | None, tables: list[list[int]], lens: list[int],
                  shared: SharedPrefixes | None, device: torch.device, dtype: torch.dtype
                  ) -> DecodeGroup:
    """A decode group whose block tables are built from lists, padded with block 0."""
    max_blocks = max(len(t) for t in tables)
    padded = [t + [0] * (max_blocks - len(t)) for t in tables]
    num_keys = max(lens)
    tables_t = torch.tensor(padded, dtype=torch.long, device=device)
    return DecodeGroup(rows_t, tables_t, num_keys, _additive_mask(lens, num_keys, device, dtype),
                       shared)


def write_kv(
    layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``k``/``v`` (``[num_tokens, kv_heads, head_dim]``) at their slots, rounded to the
    cache's dtype where it differs from the activations' (``--kv-cache-dtype``)."""
    dtype = layer_cache.dtype
    layer_cache[0].index_copy_(0, slot_mapping, k.to(dtype))
    layer_cache[1].index_copy_(0, slot_mapping, v.to(dtype))


def _gather(
    layer_cache: torch.Tensor, block_tables: torch.Tensor, block_size: int, num_keys: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first ``num_keys`` positions of the given blocks (one gather for both),
    in ``dtype`` (the activations').

    ``block_tables`` is ``[blocks]`` or ``[B, blocks]``; K and V come back as
    ``[..., num_keys, kv_heads, head_dim]``.
    """
    shape = layer_cache.shape
    # index_select over whole blocks (rows of a 3-D view) copies contiguous runs: 3-5x faster
    # on CPU than advanced indexing of the 5-D view, which gathers element-wise.
    rows = layer_cache.view(2, shape[1] // block_size, -1).index_select(1, block_tables.reshape(-1))
    blocks = rows.view(2, *block_tables.shape, block_size, *shape[2:])
    kv = blocks.flatten(-4, -3)[..., :num_keys, :, :].to(dtype)
    return kv[0], kv[1]


def as_cached(x: torch.Tensor, layer_cache: torch.Tensor) -> torch.Tensor:
    """``x`` as the cache holds it: rounded to the cache's dtype and back where the two differ,
    so that K/V a step uses as computed equal what a later step (or a prefix-cache hit) reads
    back, and caching never changes a result."""
    if layer_cache.dtype == x.dtype:
        return x
    return x.to(layer_cache.dtype).to(x.dtype)


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
    if meta.invariant is not None:
        return invariant_attention(q, layer_cache, meta.invariant, block_size)
    if meta.kernel is not None:
        return meta.kernel.run(q, layer_cache)
    if meta.decode is not None and meta.decode.rows is None:
        return _decode_attention(q, layer_cache, meta.decode, block_size)
    if meta.decode is None and len(meta.prefills) == 1:
        return _prefill_attention(q, k, v, layer_cache, meta.prefills[0], block_size)
    out = torch.empty_like(q)
    if meta.decode is not None:
        rows = meta.decode.rows
        assert rows is not None  # a decode group without rows returned above
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
    keys, values = _gather(layer_cache, group.block_tables, block_size, group.num_keys, q.dtype)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[2]
    query = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if group.shared is not None:
        def read(block_tables: torch.Tensor, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
            return _gather(layer_cache, block_tables, block_size, num_keys, q.dtype)

        out = two_pass_decode(query, keys, values, group.mask, group.shared, read)
    else:
        out = F.scaled_dot_product_attention(
            query, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=group.mask
        )
    return out.reshape(batch, num_heads, head_dim)


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
        keys = as_cached(k[seq.start : seq.end], layer_cache)
        values = as_cached(v[seq.start : seq.end], layer_cache)
    else:
        assert seq.block_table is not None  # a cached sequence's K/V are read from its blocks
        keys, values = _gather(layer_cache, seq.block_table, block_size, seq.num_keys, q.dtype)
    out = F.scaled_dot_product_attention(
        query,
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=seq.mask,
        is_causal=seq.mask is None,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)
