"""Paged decode attention: the two-pass path for shared prefixes against plain attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixserve.model.attention import shared_prefix as shared_prefix_attention
from prefixserve.model.attention.paged import build_metadata, paged_attention

BLOCK = 16
KV_HEADS, PER_KV, HEAD_DIM = 2, 3, 16
NUM_BLOCKS = 400


def reference(q: torch.Tensor, cache: torch.Tensor, table: list[int], length: int) -> torch.Tensor:
    """One decoding sequence's attention, its keys read position by position."""
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(length)])
    keys, values = cache[0, slots].transpose(0, 1), cache[1, slots].transpose(0, 1)
    query = q.view(KV_HEADS, PER_KV, HEAD_DIM)
    return F.scaled_dot_product_attention(query, keys, values).reshape(-1, HEAD_DIM)


def decode_batch() -> tuple[list[list[int]], list[int]]:
    """Block tables and lengths: a group of three sharing 70 blocks (then diverging, with
    different lengths), a pair sharing 40, one sequence alone, and one that shares only its
    first block with the pair."""
    fresh = iter(range(200, NUM_BLOCKS))
    prefix_a, prefix_b = list(range(70)), list(range(100, 140))
    tables = [prefix_a + [next(fresh) for _ in range(extra)] for extra in (1, 3, 5)]
    tables += [prefix_b + [next(fresh) for _ in range(extra)] for extra in (2, 2)]
    tables.append([next(fresh) for _ in range(30)])
    tables.append([100] + [next(fresh) for _ in range(9)])
    lens = [(len(t) - 1) * BLOCK + r for t, r in zip(tables, (1, 16, 9, 4, 12, 7, 16),
                                                         strict=True)]
    return tables, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_prefill", [False, True])
def test_two_pass_decode_matches_plain_attention(dtype: torch.dtype, with_prefill: bool) -> None:
    torch.manual_seed(0)
    cache = torch.randn(2, NUM_BLOCKS * BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    tables, lens = decode_batch()
    seq_lens = [(length - 1, 1) for length in lens]
    if with_prefill:
        # A prefill in the same step puts the decoding rows at offsets of the flattened batch.
        tables.insert(2, [150, 151])
        seq_lens.insert(2, (0, 20))
    meta = build_metadata(seq_lens, tables, BLOCK, torch.device("cpu"), dtype)
    assert meta.decode is not None and meta.decode.shared is not None
    # The group of three, the pair, and the other two alone (each with its own prefix).
    sizes = sorted(tuple(b.members.shape) for b in meta.decode.shared.batches)
    assert sizes == [(1, 2), (1, 3), (2, 1)]
    # The second pass: the longest part after a prefix, the third member's 4 blocks and 9.
    assert meta.decode.num_keys == 4 * BLOCK + 9
    num_tokens = sum(n for _, n in seq_lens)
    q = torch.randn(num_tokens, KV_HEADS * PER_KV, HEAD_DIM, dtype=dtype)
    k = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, dtype=dtype)
    v = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, dtype=dtype)
    out = paged_attention(q, k, v, cache, meta, BLOCK)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    row = 0
    for (start, n), table in zip(seq_lens, tables, strict=True):
        if n == 1:
            expected = reference(q[row].float(), cache.float(), table, start + 1)
            torch.testing.assert_close(out[row].float(), expected, atol=tolerance, rtol=0)
        row += n


def test_two_pass_only_when_it_saves_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    tables, lens = decode_batch()
    cpu = torch.device("cpu")
    seq_lens = [(length - 1, 1) for length in lens]
    # Saved copies: 2 x 70 blocks + 1 x 40 blocks = 2,880 keys.
    monkeypatch.setattr(shared_prefix_attention, "MIN_SAVED_KEYS", 2880)
    assert build_metadata(seq_lens, tables, BLOCK, cpu).decode.shared is not None
    monkeypatch.setattr(shared_prefix_attention, "MIN_SAVED_KEYS", 2881)
    assert build_metadata(seq_lens, tables, BLOCK, cpu).decode.shared is None
    # A prefix stops before the block that holds a member's new token.
    same = [list(range(10)), list(range(10))]
    monkeypatch.setattr(shared_prefix_attention, "MIN_SAVED_KEYS", 1)
    shared = build_metadata([(159, 1), (150, 1)], same, BLOCK, cpu).decode.shared
    assert shared is not None and shared.batches[0].num_keys == 9 * BLOCK
