"""The deterministic mode's kernels: a row's result is bitwise the same whatever else is in the
step (``prefixserve/model/attention/batch_invariant.py``).

Each kernel is checked at every row count 1..64 and every 13th up to 300 (each row of a product
of M rows against the same row of a product of 300 rows, at varied offsets so that rows land at
every place of a row tile), attention across the ways a prompt can be split between cache and
compute, and the norm, rotary embedding and sampler across batch compositions. End-to-end checks
with the real model are in ``tests/engine/test_deterministic.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from isa_helpers import kernels_or_skip
from torch import nn

from prefixserve.model.arch.layers import RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq
from prefixserve.model.arch.lora import LoRABatch, LoRALinear
from prefixserve.model.attention import batch_invariant
from prefixserve.model.attention.batch_invariant import (
    RowTiledLinear,
    make_batch_invariant,
    tiled_linear,
)
from prefixserve.model.attention.paged import build_metadata, paged_attention, write_kv
from prefixserve.model.attention.window import build_window_metadata
from prefixserve.model.sampler import Sampler, make_generator
from prefixserve.model.weights.quant import QuantEmbedding, QuantLinear, pack_float
from prefixserve.model.weights.quant_kernels import FMT_Q4_1, FMT_Q8_0
from prefixserve.sampling_params import SamplingParams

CPU = torch.device("cpu")
MAX_ROWS = 300
#: Every row count up to 64 (each tail size and place in a row tile, past SMALL_M), then every
#: 13th up to MAX_ROWS (13 is prime to the tile of 8: every tail size again, in large products).
ROW_COUNTS = sorted({*range(1, 65), *range(65, MAX_ROWS, 13), MAX_ROWS})
DTYPES = [torch.float32, torch.bfloat16]


def rows_unchanged(product: Callable[[torch.Tensor, int], torch.Tensor], x: torch.Tensor
                   ) -> list[tuple[int, int]]:
    """``(rows, offset)`` pairs where some row of ``product(x[offset : offset + rows],
    offset)`` differs from the same row of ``product(x, 0)`` (``x`` has MAX_ROWS rows)."""
    reference = product(x, 0)
    bad = []
    for rows in ROW_COUNTS:
        offset = (rows * 7) % (MAX_ROWS - rows + 1)  # varied places in a row tile
        got = product(x[offset : offset + rows], offset)
        if not torch.equal(got, reference[offset : offset + rows]):
            bad.append((rows, offset))
    return bad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 576), (40, 100)])
def test_tiled_linear_rows_do_not_depend_on_the_row_count(dtype: torch.dtype, out_features: int,
                                                          in_features: int) -> None:
    """Kills: a product whose kernel depends on the number of rows (plain ``F.linear`` in
    float32 on the reference CPU: 1, 2-3 and 4+ rows are three kernels), or a tile that
    depends on where a row sits in it."""
    gen = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    x = torch.randn(MAX_ROWS, in_features, generator=gen).to(dtype)
    assert rows_unchanged(lambda rows, _: tiled_linear(rows, weight, bias), x) == []
    # Against torch's own product, within float32 rounding of the terms' magnitudes: two
    # summation orders of the same terms (torch's order changes with its kernel: one CPU's
    # float32 GEMM differed from the tiles by 4e-5 on an output of 0.02, terms of ~20 each).
    got, want = tiled_linear(x, weight, bias).double(), F.linear(x, weight, bias).double()
    scale = x.double().abs() @ weight.double().abs().t() + bias.double().abs()
    eps = torch.finfo(dtype).eps
    assert float(((got - want).abs() - in_features * eps * scale).max()) <= 0


@pytest.fixture(scope="module")
def lib():
    built = kernels_or_skip()
    if batch_invariant.attention_kernel_error() is not None:
        pytest.skip(f"attention kernel unavailable: {batch_invariant.attention_kernel_error()}")
    return built


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", [FMT_Q4_1, FMT_Q8_0])
def test_quant_linear_rows_do_not_depend_on_the_row_count(lib, fmt: int, dtype: torch.dtype
                                                          ) -> None:
    """Float32 rows take the integer kernel at every row count, bfloat16 rows the bfloat16
    batch kernel where the CPU has it (in slices of BF16_BATCH_MAX rows past it). Kills: the
    packed path switching kernels with the row count in the deterministic mode (to
    expand-and-GEMM above SMALL_M rows, or to the integer kernel below the batch kernel's 8
    rows: each rounds differently)."""
    gen = torch.Generator().manual_seed(fmt)
    linear = QuantLinear(pack_float(torch.randn(64, 128, generator=gen).numpy(), fmt))
    linear.row_invariant = True
    x = torch.randn(MAX_ROWS, 128, generator=gen).to(dtype)
    assert rows_unchanged(lambda rows, _: linear(rows), x) == []
    linear.invariant_batch_kernel = False  # an output head's choice
    assert rows_unchanged(lambda rows, _: linear(rows), x) == []
    linear.invariant_batch_kernel = True
    expected = x.float() @ linear._expand(0, 64).t()  # and the rows are the right products
    scale = expected.abs().max().item()
    torch.testing.assert_close(linear(x).float(), expected, atol=0.01 * scale, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_deltas_rows_do_not_depend_on_the_row_count(dtype: torch.dtype) -> None:
    """A LoRA projection in the mode (row-tiled base, ``row_invariant`` deltas of a fused
    two-part projection, rank 8) at every row count; without the flag some row counts round
    differently in float32 (the reason for it). Kills: the deltas' two products left on
    torch's plain matmul in the mode."""
    gen = torch.Generator().manual_seed(7)
    base = nn.Linear(96, 80, bias=False).to(dtype)
    base.__class__ = RowTiledLinear
    batch = LoRABatch()
    lora = LoRALinear(base, 96, (48, 32), 2, 8, dtype, CPU, batch)
    parts = [(torch.randn(8, 96, generator=gen), torch.randn(48, 8, generator=gen)),
             (torch.randn(8, 96, generator=gen), torch.randn(32, 8, generator=gen))]
    lora.set_slot(1, parts, 8)
    batch.groups = [(1, None)]
    x = torch.randn(MAX_ROWS, 96, generator=gen).to(dtype)
    with torch.inference_mode():
        lora.row_invariant = True
        assert rows_unchanged(lambda rows, _: lora(rows), x) == []
        if dtype == torch.float32:
            lora.row_invariant = False
            assert rows_unchanged(lambda rows, _: lora(rows), x) != []


def test_make_batch_invariant_switches_every_product(lib) -> None:
    """Kills: a linear layer left on the plain product, or a tied head without a tiled
    product (the output head of SmolLM2 is the embedding); packed layers keep the batch
    kernel for bfloat16 rows, packed heads (tied or not) the integer kernel."""
    model = nn.Module()
    model.embed_tokens = nn.Embedding(50, 32)
    model.lm_head = None
    model.proj = nn.Linear(32, 32)
    model.packed = QuantLinear(pack_float(torch.randn(32, 32).numpy(), FMT_Q8_0))
    make_batch_invariant(model)
    assert type(model.proj) is RowTiledLinear and model.packed.row_invariant
    assert model.packed.invariant_batch_kernel
    assert isinstance(model.lm_head, RowTiledLinear)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())  # shared, counted once
    packed = nn.Module()
    packed.embed_tokens = QuantEmbedding(pack_float(torch.randn(50, 32).numpy(), FMT_Q8_0),
                                         torch.float32)
    packed.lm_head = None
    make_batch_invariant(packed)
    assert packed.embed_tokens.head.row_invariant and packed.lm_head is None
    assert not packed.embed_tokens.head.invariant_batch_kernel
    untied = nn.Module()
    untied.lm_head = QuantLinear(pack_float(torch.randn(50, 32).numpy(), FMT_Q8_0))
    make_batch_invariant(untied)
    assert untied.lm_head.row_invariant and not untied.lm_head.invariant_batch_kernel


# ------------------------------------------------------------------ attention

BLOCK = 16
HEADS, KV_HEADS, HEAD_DIM = 6, 2, 36  # grouped queries; 36 is not a multiple of 8 lanes


class Sequences:
    """Random Q/K/V for a few sequences with their own (scattered) blocks of one cache. With a
    sliding ``window`` each step's tables name a poisoned block (every value NaN) in place of
    the blocks wholly before the windows of the step's queries, as the KV cache manager puts
    the null block there: a kernel that reads one returns NaN."""

    def __init__(self, lengths: list[int], dtype: torch.dtype, seed: int = 0,
                 window: int | None = None) -> None:
        gen = torch.Generator().manual_seed(seed)
        num_blocks = sum((n - 1) // BLOCK + 1 for n in lengths) + 3
        order = torch.randperm(num_blocks, generator=gen).tolist()
        self.window = window
        self.poison = order.pop()
        self.tables = []
        for n in lengths:
            used = (n - 1) // BLOCK + 1
            self.tables.append(order[:used])
            order = order[used:]
        self.q = [torch.randn(n, HEADS, HEAD_DIM, generator=gen).to(dtype) for n in lengths]
        self.k = [torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for n in lengths]
        self.v = [torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for n in lengths]
        self.cache = torch.randn(2, num_blocks * BLOCK, KV_HEADS, HEAD_DIM,
                                 generator=gen).to(dtype)  # stale values in unused slots
        self.cache[:, self.poison * BLOCK : (self.poison + 1) * BLOCK] = float("nan")
        self.dtype = dtype

    def table(self, seq: int, start: int) -> list[int]:
        """Sequence ``seq``'s table for a step from position ``start``: with a window, the
        blocks before the window of ``start`` poisoned."""
        table = self.tables[seq]
        if self.window is None:
            return table
        skipped = max(0, start + 1 - self.window) // BLOCK
        return [self.poison] * skipped + table[skipped:]

    def step(self, work: list[tuple[int, int, int]], deterministic: bool = True
             ) -> list[torch.Tensor]:
        """One step computing ``(seq, start, count)`` for each entry: the outputs per entry."""
        lens = [(s, n) for _, s, n in work]
        tables = [self.table(i, s) for i, s, _ in work]
        if self.window is None:
            meta = build_metadata(lens, tables, BLOCK, CPU, self.dtype,
                                  deterministic=deterministic)
        else:
            meta = build_window_metadata(lens, tables, BLOCK, self.window, CPU, self.dtype,
                                         deterministic=deterministic)
        q, k, v = (torch.cat([t[i][s : s + n] for i, s, n in work])
                   for t in (self.q, self.k, self.v))
        write_kv(self.cache, k, v, meta.slot_mapping)
        out = paged_attention(q, k, v, self.cache, meta, BLOCK)
        return list(out.split([n for _, _, n in work]))


def split_runs(lengths: list[int], dtype: torch.dtype, deterministic: bool = True,
               window: int | None = None) -> dict[str, torch.Tensor]:
    """Sequence 0's attention output under each way of computing it."""
    target = lengths[0]
    runs = {}
    seqs = Sequences(lengths, dtype, window=window)
    runs["whole"] = seqs.step([(0, 0, target)], deterministic)[0]
    seqs = Sequences(lengths, dtype, window=window)
    first = seqs.step([(0, 0, 48)], deterministic)[0]  # a cached prefix of 3 blocks, then the rest
    runs["cached prefix"] = torch.cat([first, seqs.step([(0, 48, target - 48)],
                                                        deterministic)[0]])
    seqs = Sequences(lengths, dtype, window=window)
    chunks = [seqs.step([(0, s, min(7, target - s))], deterministic)[0]
              for s in range(0, target, 7)]
    runs["chunks of 7"] = torch.cat(chunks)
    seqs = Sequences(lengths, dtype, window=window)
    head = seqs.step([(0, 0, 30)], deterministic)[0]
    decoded = [seqs.step([(0, p, 1)], deterministic)[0] for p in range(30, target)]
    runs["decode"] = torch.cat([head, *decoded])
    # in a batch: others prefilling and decoding with it
    seqs = Sequences(lengths, dtype, window=window)
    seqs.step([(1, 0, lengths[1] - 1)], deterministic)
    mixed = seqs.step([(2, 0, lengths[2]), (0, 0, 40), (1, lengths[1] - 1, 1)], deterministic)
    rest = seqs.step([(1, lengths[1] - 1, 1), (0, 40, target - 40)], deterministic)
    runs["in a batch"] = torch.cat([mixed[1], rest[1]])
    return runs


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_is_bitwise_the_same_however_the_prompt_is_split(lib, dtype: torch.dtype
                                                                   ) -> None:
    """Kills: attention whose reduction over keys follows the step's split (the default SDPA
    path: a cached prefix, chunks and decode steps each sum in another order), or a kernel that
    reads another row's keys or a padded key."""
    lengths = [101, 70, 33]
    runs = split_runs(lengths, dtype)
    whole = runs["whole"]
    for name, out in runs.items():
        assert torch.equal(out, whole), name
    seqs = Sequences(lengths, dtype)
    q, k, v = (t[0].float().transpose(0, 1)[None] for t in (seqs.q, seqs.k, seqs.v))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(whole.float(), expected[0].transpose(0, 1), atol=tolerance,
                               rtol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_over_a_sliding_window_is_bitwise_the_same_however_the_prompt_is_split(
        lib, dtype: torch.dtype) -> None:
    """The same splits with a window of 20 keys (not a multiple of the 16-position blocks, so a
    window starts inside a block), the blocks before each step's windows poisoned. Kills: a
    kernel that ignores the window, starts it one key early or late, or reads the keys of the
    window's first block before its start, or reads a block that slid out (NaN)."""
    lengths, window = [101, 70, 33], 20
    runs = split_runs(lengths, dtype, window=window)
    whole = runs["whole"]
    for name, out in runs.items():
        assert torch.equal(out, whole), name
    seqs = Sequences(lengths, dtype)
    q, k, v = (t[0].float().transpose(0, 1)[None] for t in (seqs.q, seqs.k, seqs.v))
    pos = torch.arange(lengths[0])
    band = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=band, enable_gqa=True)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(whole.float(), expected[0].transpose(0, 1), atol=tolerance,
                               rtol=tolerance)


def test_default_attention_does_depend_on_the_split(lib) -> None:
    """The reason for the mode, kept visible: without it the same rows come out of another
    summation order (if torch ever makes them equal, this test says so)."""
    runs = split_runs([101, 70, 33], torch.float32, deterministic=False)
    assert any(not torch.equal(out, runs["whole"]) for out in runs.values())


# ------------------------------------------------------------------ per-row ops


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_and_rotary_embedding_rows_do_not_depend_on_the_row_count(dtype: torch.dtype
                                                                       ) -> None:
    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=gen))
    norm = norm.to(dtype)
    x = torch.randn(MAX_ROWS, 576, generator=gen).to(dtype)
    with torch.inference_mode():
        assert rows_unchanged(lambda rows, _: norm(rows), x) == []
    inv_freq = rope_inv_freq(64, 100000.0, None)
    heads = torch.randn(MAX_ROWS, 12, 64, generator=gen).to(dtype)
    positions = torch.randint(0, 8192, (MAX_ROWS,), generator=gen)

    def rotate(rows: torch.Tensor, start: int) -> torch.Tensor:
        cos, sin = rope_cos_sin(inv_freq, positions[start : start + len(rows)], dtype)
        return apply_rope(rows, cos, sin)

    assert rows_unchanged(rotate, heads) == []


def test_sampler_rows_do_not_depend_on_the_batch() -> None:
    """Seeded sampled tokens and logprobs of a row, alone and among others (the vocabulary of
    the default model: reductions large enough to be split across threads)."""
    vocab = 49152
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(20, vocab, generator=gen) * 4
    target = SamplingParams(temperature=0.8, top_p=0.9, top_k=200, seed=11, logprobs=5)
    others = [SamplingParams(temperature=t, seed=i, logprobs=2)
              for i, t in enumerate([0.0, 1.2, 0.5] * 7)]

    def sample(rows: int, at: int):
        params = others[:rows]
        params.insert(at, target)
        generators = [make_generator(p.seed) if p.temperature else None for p in params]
        out = Sampler(()).sample(logits[: rows + 1], params, generators,
                                 [[1, 2]] * (rows + 1), [[3]] * (rows + 1))
        assert out.logprobs is not None
        return out.token_ids[at], out.logprobs[at]

    row_logits = logits.clone()
    alone = Sampler(()).sample(row_logits[:1], [target], [make_generator(11)], [[1, 2]], [[3]])
    assert alone.logprobs is not None
    for rows, at in [(1, 1), (7, 3), (19, 0)]:
        logits[at] = row_logits[0]
        assert sample(rows, at) == (alone.token_ids[0], alone.logprobs[0]), (rows, at)
        logits[at] = row_logits[at]
