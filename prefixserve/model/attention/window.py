"""Attention metadata for sliding-window layers over the paged KV cache.

A query at position p of a layer with window W attends to positions ``p - W + 1 .. p`` (the
window counts the query's own position). Only the blocks that hold those positions are read:
for each sequence the block table is cut to start at the block of its earliest key, and the
masks are offset to match, so a long sequence costs a window layer ``W`` keys, not ``p``. The
blocks before that first block may be the null block (the KV cache manager frees blocks that
slid out of every window and puts the null block in their place): they are never read.

The result is an :class:`~prefixserve.model.attention.paged.AttentionMetadata` that
:func:`~prefixserve.model.attention.paged.paged_attention` runs unchanged. Decoding sequences of a
window layer do not use the two-pass shared-prefix path: what they could share is at most the
window (``W`` keys, below the threshold where the two passes pay off), and each sequence's
window starts at its own position, so nothing outside it is ever shared.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from prefixserve.model.attention.paged import (
    AttentionMetadata,
    DecodeGroup,
    PrefillSeq,
    TableRows,
    _invariant_metadata,
    _kernel_metadata,
    _slots,
)

if TYPE_CHECKING:  # prompt_attention imports the model, which imports the attention modules
    from prefixserve.model.attention.prompt import PromptAttention


def build_window_metadata(
    seq_lens: list[tuple[int, int]],
    block_tables: list[list[int]],
    block_size: int,
    window: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    table_rows: TableRows | None = None,
    kernel: PromptAttention | None = None,
    deterministic: bool = False,
) -> AttentionMetadata:
    """Index tensors of one step for layers with a sliding window of ``window`` tokens;
    arguments as :func:`~prefixserve.model.attention.paged.build_metadata` (with ``kernel``, the C
    kernel's plan of every row over its window; with ``deterministic``, the batch-invariant
    attention's)."""
    if deterministic:
        return _invariant_metadata(seq_lens, block_tables, block_size, device, table_rows,
                                   window)
    if kernel is not None and table_rows is not None:
        return _kernel_metadata(seq_lens, block_tables, block_size, device, table_rows, kernel,
                                window)
    slots: list[int] = []
    decodes: list[tuple[int, int, list[int]]] = []  # (row, end_pos, table)
    prefills: list[PrefillSeq] = []
    row = 0
    for i, ((start_pos, n), table) in enumerate(zip(seq_lens, block_tables, strict=True)):
        end_pos = start_pos + n
        slots += _slots(table, start_pos, end_pos, block_size)
        if n == 1:
            decodes.append((row, end_pos, table))
        else:
            prefills.append(_window_prefill(row, start_pos, end_pos, table, i, block_size,
                                            window, device, table_rows))
        row += n
    decode = None
    if decodes:
        decode = _window_decode(decodes, row, block_size, window, device, dtype)
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
    return AttentionMetadata(slot_mapping, decode, prefills, row)


def _first_block(first_query: int, window: int, block_size: int) -> int:
    """The block holding the earliest key that a query at ``first_query`` attends to."""
    return max(0, first_query - window + 1) // block_size


def _window_prefill(row: int, start_pos: int, end_pos: int, table: list[int], index: int,
                    block_size: int, window: int, device: torch.device,
                    table_rows: TableRows | None) -> PrefillSeq:
    """Positions ``[start_pos, end_pos)`` at rows from ``row``: fresh keys when nothing is
    cached (masked only once the prompt is longer than the window), else the keys of the
    blocks from the first query's window on."""
    q_pos = torch.arange(start_pos, end_pos, device=device)
    if start_pos == 0:
        if end_pos <= window:
            return PrefillSeq(row, row + end_pos, False, None, end_pos, None)
        k_pos = q_pos
        table_t = None
    else:
        first = _first_block(start_pos, window, block_size)
        last = (end_pos - 1) // block_size + 1
        if table_rows is not None:
            table_t = table_rows.buffer[table_rows.rows[index], first:last]
        else:
            table_t = torch.tensor(table[first:last], dtype=torch.long, device=device)
        k_pos = torch.arange(first * block_size, end_pos, device=device)
    mask = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
    cached = table_t is not None
    return PrefillSeq(row, row + end_pos - start_pos, cached, table_t, k_pos.numel(), mask)


def _window_decode(decodes: list[tuple[int, int, list[int]]], num_tokens: int, block_size: int,
                   window: int, device: torch.device, dtype: torch.dtype) -> DecodeGroup:
    """The decoding sequences (one new token at ``end_pos - 1`` each), each over the blocks of
    its own window, padded with block 0 and masked on both sides."""
    tables: list[list[int]] = []
    spans: list[tuple[int, int]] = []  # (first key, end) relative to each cut table
    for _, end_pos, table in decodes:
        first = _first_block(end_pos - 1, window, block_size)
        tables.append(table[first : (end_pos - 1) // block_size + 1])
        offset = first * block_size
        spans.append((max(0, end_pos - window) - offset, end_pos - offset))
    width = max(len(t) for t in tables)
    tables_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long,
                            device=device)
    num_keys = max(end for _, end in spans)
    keys = torch.arange(num_keys, device=device)[None, :]
    lo = torch.tensor([s for s, _ in spans], device=device)[:, None]
    hi = torch.tensor([e for _, e in spans], device=device)[:, None]
    mask = None
    if any(s > 0 or e < num_keys for s, e in spans):
        outside = (keys < lo) | (keys >= hi)
        mask = torch.zeros(outside.shape, dtype=dtype, device=device)
        mask = mask.masked_fill_(outside, float("-inf"))[:, None, None, :]
    rows = [r for r, _, _ in decodes]
    rows_t = None
    if len(rows) != num_tokens:
        rows_t = torch.tensor(rows, dtype=torch.long, device=device)
    return DecodeGroup(rows_t, tables_t, num_keys, mask)
