"""The fused decode step (``prefixserve/model/attention/fused_decode.py``, ``kernels/decode.c``).

It must compute what the eager layer stack computes: the same logits up to float rounding and
the same K/V written into the cache, for batches of sequences with different context lengths
(some longer than one attention chunk of the kernel), shuffled and shared blocks (a shared
chunk, which the kernel reads once for all its rows), GQA groups of 2 and 3, QKV biases,
Qwen3's Q/K norms, and sliding windows in one or several KV cache groups (Qwen2, Mistral,
Gemma 3 with its norms, GELU and second rotary base); greedy tokens of the default model must
not change; and it must stay out of the way wherever it does not apply.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from isa_helpers import AVX2_BUILD, has_avx512_and_avx2, panel_build
from model_helpers import dense_model, pack_projections, packed_model, tiny_config

from prefixserve import LLM, SamplingParams
from prefixserve.model.arch.config import ModelConfig
from prefixserve.model.arch.llama import CausalLM
from prefixserve.model.arch.lora import (
    LoRAAdapter,
    LoRAModel,
    install_lora,
    part_shapes,
)
from prefixserve.model.attention import decode_kernel, fused_decode
from prefixserve.model.runner import (
    FUSED_STEP_ROWS,
    MIN_SPLIT_CONTEXT,
    PANEL_STEP_ROWS,
    ModelRunner,
    SeqBatchInput,
    fused_step_rows,
)
from prefixserve.model.weights import quant, quant_kernels
from prefixserve.model.weights.quant import (
    FMT_Q4_0,
    FMT_Q4_0S,
    FMT_Q4_1,
    FMT_Q4_K,
    FMT_Q5_K,
    FMT_Q6_K,
    FMT_Q8_0,
    PackedParts,
    PackedWeight,
    QuantLinear,
    SplitQuantLinear,
    pack_float,
)

#: Logits of the fused step vs the eager one, as a fraction of the largest |logit|. Both run
#: the same packed products; the norms, attention and exp sum in another order (~1e-7), and
#: that flips the 16-bit rounding of a few activations before each product, by 1/32767 of
#: their block's largest value. Measured: 2.6e-5 to 5.3e-5 per decode step for one layer,
#: up to 1.3e-4 for two or four (the K/V of the first layer agree to 1e-6).
LOGIT_TOL = 3e-4
#: The same for the K/V the two paths write, as a fraction of the largest (measured 4.2e-5).
KV_TOL = 1e-4
#: Attention works over chunks of this many keys in ``decode.c`` (``CHUNK``): contexts below,
#: at and well above it are covered.
CHUNK = 256



def run(model: CausalLM, config: ModelConfig, enforce_eager: bool, block_size: int,
        seed: int = 1, dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None,
        extra: int = 0, blocks: int = 2000, lora: LoRAModel | None = None,
        slots: list[int | None] | None = None
        ) -> tuple[list[torch.Tensor], torch.Tensor, ModelRunner]:
    """Five sequences prefilled, then five decode steps of all five; the logits of each decode
    step and the cache at the end. Contexts: ~300 tokens; ~37; ~530, sharing the first's first
    256 tokens and their blocks (one attention chunk, which the kernel reads once for both);
    ~300, as long as the first but sharing nothing; ~300, sharing only the first's first
    block, so a chunk that starts alike but is not the same. ``extra`` more sequences of 20
    to 60 tokens make the batch as many rows larger; ``blocks`` tokens' worth of cache blocks.
    With ``lora`` (the model's adapter slots), sequence i runs under ``slots[i % len(slots)]``.
    The prompts ask for their logits, which keeps them on the eager layers in both runners
    (``FUSED_STEP_ROWS``): the decode steps start from the same cache."""
    rng = random.Random(seed)
    num_blocks = blocks // block_size
    runner = ModelRunner(config, model, num_blocks, block_size, dtype, "cpu",
                         enforce_eager=enforce_eager, kv_cache_dtype=kv_dtype)
    runner.lora = lora
    slots = slots or [None]
    free = list(range(num_blocks))
    rng.shuffle(free)
    first = [rng.randrange(config.vocab_size) for _ in range(300)]
    prompts = [first, [rng.randrange(config.vocab_size) for _ in range(37)],
               first[:CHUNK] + [rng.randrange(config.vocab_size) for _ in range(274)],
               [rng.randrange(config.vocab_size) for _ in range(300)],
               first[:block_size] + [rng.randrange(config.vocab_size)
                                     for _ in range(300 - block_size)]]
    prompts += [[rng.randrange(config.vocab_size) for _ in range(20 + 7 * i)]
                for i in range(extra)]
    tables = []
    for prompt in prompts:
        need = (len(prompt) + 5) // block_size + 1
        tables.append([free.pop() for _ in range(need)])
    shared = CHUNK // block_size
    tables[2][:shared] = tables[0][:shared]
    tables[4][0] = tables[0][0]
    for i, prompt in enumerate(prompts):  # prompt logits keep even the short ones eager
        runner.execute([SeqBatchInput(prompt, 0, tables[i], seq_id=i, need_prompt_logits=True,
                                      lora_slot=slots[i % len(slots)])])
    logits = []
    for step in range(5):
        seqs = [SeqBatchInput([rng.randrange(config.vocab_size)], len(p) + step, tables[i],
                              seq_id=i, lora_slot=slots[i % len(slots)])
                for i, p in enumerate(prompts)]
        logits.append(runner.execute(seqs).logits)
    return logits, runner.kv_cache, runner


#: A model whose every product's width is a multiple of 128 and at least 1,024 (hidden 1,024,
#: 16 heads of 64, FFN 1,152: down's runs of 16 blocks end with one of 4), so that its Q4_0
#: weights take the stream layout (``q4_0s_fits``; AVX2 builds from 1,024 wide).
STREAM_CONFIG = replace(tiny_config(heads=16, kv_heads=4, head_dim=64), hidden_size=1024,
                        intermediate_size=1152)
#: (config, weight format, block size, activations, cache (None: the activations' dtype)).
CASES: dict[str, tuple[ModelConfig, int, int, torch.dtype, torch.dtype | None]] = {
    "q4_1-gqa2": (tiny_config(), FMT_Q4_1, 16, torch.float32, None),
    "q8_0-gqa2": (tiny_config(), FMT_Q8_0, 16, torch.float32, None),
    "q4_0-gqa2": (tiny_config(), FMT_Q4_0, 16, torch.float32, None),
    "q4_0-gqa2-bfloat16": (tiny_config(), FMT_Q4_0, 16, torch.bfloat16, None),
    # every product a multiple of 128 wide: Q4_0 in the stream layout (kernels/stream.c)
    "q4_0-stream": (STREAM_CONFIG, FMT_Q4_0, 16, torch.float32, None),
    "q4_1-gqa3-bias-block4": (tiny_config(heads=6, kv_heads=2, bias=True), FMT_Q4_1, 4,
                              torch.float32, None),
    "q4_1-gqa2-bfloat16": (tiny_config(), FMT_Q4_1, 16, torch.bfloat16, None),
    "q4_1-head64": (tiny_config(heads=2, kv_heads=1, head_dim=64), FMT_Q4_1, 16, torch.float32,
                    None),
    "q4_1-head128-bfloat16": (tiny_config(heads=2, kv_heads=1, head_dim=128), FMT_Q4_1, 16,
                              torch.bfloat16, None),
    "q4_1-gqa3-float16-cache": (tiny_config(heads=6, kv_heads=2), FMT_Q4_1, 16, torch.float32,
                                torch.float16),
    "q4_1-head64-float16-cache": (tiny_config(heads=4, kv_heads=2, head_dim=64), FMT_Q4_1, 16,
                                  torch.float32, torch.float16),
    "q4_1-head128-bfloat16-cache": (tiny_config(heads=2, kv_heads=1, head_dim=128), FMT_Q4_1,
                                    16, torch.float32, torch.bfloat16),
    # Qwen3: a per-head RMSNorm of the queries and keys before rotary
    "q4_1-qwen3": (replace(tiny_config(heads=6, kv_heads=2), qk_norm=True), FMT_Q4_1, 16,
                   torch.float32, None),
    "q8_0-qwen3-head64-bfloat16": (replace(tiny_config(heads=4, kv_heads=2, head_dim=64),
                                           qk_norm=True), FMT_Q8_0, 16, torch.bfloat16, None),
}
#: With bfloat16 the eager path rounds every activation to bfloat16 (8 bits of mantissa) and
#: the fused one computes in float32, rounding only the K/V it writes: both tolerances are
#: those of bfloat16 (measured: logits up to 1.7e-2, K/V up to 1.0e-2 of the largest). A bug
#: in reading the bfloat16 cache (one element off) fails them; a wrong rounding mode of the
#: K/V written (half a unit in the last place) is below this noise and is not caught here.
BF16_TOL = {"logits": 0.05, "kv": 0.05}
#: With a float16 cache beside float32 activations both paths compute K/V in float32 and round
#: them to float16 as they write them; where the two float32 values straddle a rounding
#: boundary they land one float16 step apart (2^-11 of the value), and the logits follow.
F16_TOL = {"logits": 2e-3, "kv": 1e-3}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_decode_matches_the_eager_layers(case: str) -> None:
    """Logits of every decode step and the K/V written agree with the eager path; the fused
    path really ran (and the eager one did not)."""
    check_against_eager(case)


@pytest.mark.parametrize("case", ["q4_1-gqa2", "q8_0-gqa2", "q4_1-head64", "q4_1-gqa2-bfloat16",
                                  "q4_1-head128-bfloat16", "q4_1-head64-float16-cache"])
@pytest.mark.parametrize("extra", [0, 6], ids=["5-rows", "11-rows"])
def test_the_avx2_build_matches_the_eager_layers(case: str, extra: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """On an AVX-512 machine the native build leaves the AVX2 form of the eight-row product out
    (and takes the bfloat16 batch kernel for a bfloat16 model): ``decode.c`` built without
    AVX-512 agrees with the eager layers as the native build does, at 5 rows and at 11
    (skipped where the native build is AVX2)."""
    if not has_avx512_and_avx2():
        pytest.skip("the native build is the AVX2 one, or there is none")
    avx2 = quant_kernels.KernelLibrary(decode_kernel.SOURCE, decode_kernel.declare, AVX2_BUILD)
    monkeypatch.setattr(decode_kernel, "library", avx2)
    check_against_eager(case, extra)
    assert avx2.lib is not None


@pytest.mark.parametrize("extra", [6, 10], ids=["11-rows", "15-rows"])
def test_a_stream_layout_model_decodes_11_and_15_rows_fused_as_the_eager_layers(
        extra: int) -> None:
    """On AVX2 builds without AVX-512 the Q4 products that ``row_q4_pairs`` takes (here the
    stream layout's ``rows_q4_0s``) run row after row up to PAIR_ROWS (15) rows, their
    activations split unit by unit of 8 rows as each thread rounds them (``quantize_rows``):
    the logits and K/V of steps of 11 and 15 rows agree with the eager layers (on other builds
    the batch kernels take these rows: the same check). (Planted: each unit's rows split to
    the first unit's place, at ``b`` for ``b0 + b``: both fail.)"""
    check_against_eager("q4_0-stream", extra, blocks=3000)


def check_against_eager(case: str, extra: int = 0, blocks: int = 2000) -> None:
    """The logits of every decode step and the K/V written by the fused and the eager path of
    CASES[case], with ``extra`` more rows and ``blocks`` tokens of cache (``run``)."""
    config, fmt, block_size, dtype, kv_dtype = CASES[case]
    model = packed_model(config, fmt).to(dtype)
    fused, fused_cache, fused_runner = run(model, config, False, block_size, dtype=dtype,
                                           kv_dtype=kv_dtype, extra=extra, blocks=blocks)
    eager, eager_cache, eager_runner = run(model, config, True, block_size, dtype=dtype,
                                           kv_dtype=kv_dtype, extra=extra, blocks=blocks)
    assert fused_cache.dtype == (kv_dtype or dtype)
    logit_tol, kv_tol = ((BF16_TOL["logits"], BF16_TOL["kv"]) if torch.bfloat16 in (dtype, kv_dtype)
                         else (F16_TOL["logits"], F16_TOL["kv"]) if kv_dtype == torch.float16
                         else (LOGIT_TOL, KV_TOL))
    assert fused_runner.fused_decode_reason is None and fused_runner._fused is not None
    assert eager_runner.fused_decode_reason == "enforce_eager" and eager_runner._fused is None
    for step, (got, want) in enumerate(zip(fused, eager, strict=True)):
        tol = logit_tol * float(want.abs().max())
        torch.testing.assert_close(got, want, atol=tol, rtol=0,
                                   msg=lambda m, step=step: f"decode step {step}: {m}")
    torch.testing.assert_close(fused_cache.float(), eager_cache.float(), rtol=0,
                               atol=kv_tol * float(eager_cache.abs().max()))


@pytest.mark.parametrize(("fmt", "dtype"), [(FMT_Q4_1, torch.float32), (FMT_Q8_0, torch.float32),
                                           (FMT_Q4_0, torch.float32),
                                           (FMT_Q4_1, torch.bfloat16), (FMT_Q8_0, torch.bfloat16),
                                           (FMT_Q4_0, torch.bfloat16)],
                         ids=["q4_1", "q8_0", "q4_0", "q4_1-bfloat16", "q8_0-bfloat16",
                              "q4_0-bfloat16"])
def test_fused_decode_of_eight_rows_or_more_matches_the_eager_layers(fmt: int,
                                                                      dtype: torch.dtype) -> None:
    """Eleven rows: the products take eight rows at a time through another kernel (its
    activation scales regrouped by eight; for a bfloat16 model on a CPU with AVX512-BF16, the
    bfloat16 batch kernel for all eleven, and with AMX the tile kernel, one 16-row tile) and
    the last three through the one of smaller batches; with QKV biases, which all add."""
    config = tiny_config(heads=6, kv_heads=2, bias=True)
    model = packed_model(config, fmt).to(dtype)
    fused, fused_cache, fused_runner = run(model, config, False, 16, dtype=dtype, extra=6)
    eager, eager_cache, _ = run(model, config, True, 16, dtype=dtype, extra=6)
    assert fused_runner._fused is not None and fused[0].shape[0] == 11
    logit_tol, kv_tol = ((BF16_TOL["logits"], BF16_TOL["kv"]) if dtype == torch.bfloat16
                         else (LOGIT_TOL, KV_TOL))
    for got, want in zip(fused, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=logit_tol * float(want.abs().max()))
    torch.testing.assert_close(fused_cache.float(), eager_cache.float(), rtol=0,
                               atol=kv_tol * float(eager_cache.abs().max()))


@pytest.mark.parametrize("fmt", [FMT_Q4_0, FMT_Q4_1], ids=["q4_0", "q4_1"])
def test_a_bfloat16_step_takes_the_tiles_from_the_row_count_of_its_products(fmt: int) -> None:
    """With AMX, the fused step of a bfloat16 model takes the tiles from the row count its
    products do (``DecodeModel.amx_from``, ``QuantLinear.amx_from``): a Q4_0 model (the stream
    layout) decodes 5 sequences with the 16-bit kernel, one row after another, so each gets
    the bits it gets alone; a Q4_1 model on the tiles, whose bfloat16 rows give other bits.
    (Planted: the step's rows counted against ``amx_rows()``, 4; the Q4_0 case fails.)"""
    lib = quant_kernels.kernels()
    if lib is None or not lib.amx_rows() or not lib.q4_0s_fits(4, 1024):
        pytest.skip("no AMX in this build (or the OS refused the tile state)")
    model = packed_model(STREAM_CONFIG, fmt).to(torch.bfloat16)
    assert {m.amx_from for m in model.modules() if isinstance(m, QuantLinear)} == {
        8 if fmt == FMT_Q4_0 else 4}
    rng = random.Random(5)
    runner = ModelRunner(STREAM_CONFIG, model, 100, 16, torch.bfloat16, "cpu")
    vocab = STREAM_CONFIG.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(20 + 9 * i)] for i in range(5)]
    steps = [SeqBatchInput([rng.randrange(vocab)], len(p), list(range(8 * i, 8 * i + 8)),
                           seq_id=i) for i, p in enumerate(prompts)]
    for step, prompt in zip(steps, prompts, strict=True):
        runner.execute([SeqBatchInput(prompt, 0, step.block_table, seq_id=step.seq_id)])
    together = runner.execute(steps).logits  # each step rewrites its own token's K/V
    alone = torch.cat([runner.execute([step]).logits for step in steps])
    assert runner._fused is not None, runner.fused_decode_reason
    assert torch.equal(together, alone) == (fmt == FMT_Q4_0)


def formats(model: CausalLM) -> list[int]:
    return [m.fmt for m in model.modules() if isinstance(m, QuantLinear)]


def decode_steps(model: CausalLM, config: ModelConfig, rows: int, dtype: torch.dtype
                 ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The logits of four fused decode steps of ``rows`` sequences (of 40 to 100 tokens
    prefilled) and the cache at the end."""
    rng = random.Random(3)
    runner = ModelRunner(config, model, 200, 16, dtype, "cpu")
    prompts = [[rng.randrange(config.vocab_size) for _ in range(40 + 7 * i)] for i in range(rows)]
    tables = [list(range(12 * i, 12 * i + 12)) for i in range(rows)]
    for i, prompt in enumerate(prompts):
        runner.execute([SeqBatchInput(prompt, 0, tables[i], seq_id=i)])
    logits = []
    for step in range(4):
        logits.append(runner.execute([
            SeqBatchInput([rng.randrange(config.vocab_size)], len(p) + step, tables[i], seq_id=i)
            for i, p in enumerate(prompts)]).logits)
    assert runner._fused is not None, runner.fused_decode_reason
    return logits, runner.kv_cache


@pytest.mark.parametrize("rows", [1, 5, 11])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_stream_layout_changes_no_number_of_the_fused_step(
        rows: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Q4_0 weights in the stream layout (``kernels/stream.c``: every product of STREAM_CONFIG
    is a multiple of 128 wide) decode with the same bits as in the file's layout: one row, and 5
    rows of 16-bit activations row after row, through the stream kernel (its sums in
    rows_q4_wide's order); 11 rows, and bfloat16 rows where the CPU takes them in bfloat16,
    through the file layout's kernels over unpacked groups. Kills a repacking or unpacking that
    moves a block, a scale or a row (planted: the scales of a run shifted by one block, in the
    repacking; every logit moved), and a one-row stream kernel that differs (planted: -7 for
    Q4_0's -8 offset; the 1- and 5-row cases fail on Zen 5)."""
    lib = quant_kernels.kernels()
    if lib is None or not lib.q4_0s_fits(4, 1024):
        pytest.skip("the stream layout needs the kernels' AVX2 or 512-bit build")

    def model() -> CausalLM:
        return packed_model(STREAM_CONFIG, FMT_Q4_0).to(dtype)

    streamed = model()
    assert formats(streamed) == [FMT_Q4_0S] * 8  # QKV, O, gate/up and down of both layers
    stream_logits, stream_cache = decode_steps(streamed, STREAM_CONFIG, rows, dtype)
    monkeypatch.setattr(quant, "stream_layout", lambda weight, lib, arena=None: weight)
    filed = model()
    assert formats(filed) == [FMT_Q4_0] * 8
    file_logits, file_cache = decode_steps(filed, STREAM_CONFIG, rows, dtype)
    for got, want in zip(stream_logits, file_logits, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(stream_cache, file_cache)


#: Block bytes and the offsets of fp16 scales of the K-quant formats (random blocks with small
#: scales stand for a file's weights).
K_BLOCKS = {FMT_Q4_K: (144, (0, 2)), FMT_Q5_K: (176, (0, 2)), FMT_Q6_K: (210, (208,))}


def packed_part(values: torch.Tensor, fmt: int, seed: int) -> PackedWeight:
    """``values``' rows packed in ``fmt``: a K-quant as random blocks of small scales."""
    if fmt not in K_BLOCKS:
        return pack_float(values.numpy(), fmt)
    size, scales = K_BLOCKS[fmt]
    rows, cols = values.shape
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
    for offset in scales:
        scale = rng.uniform(1e-5, 1e-4, blocks.shape[0]).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return PackedWeight(fmt, torch.from_numpy(blocks.reshape(rows, -1)), cols)


def split_model(config: ModelConfig, qkv: tuple[int, ...], gate_up: tuple[int, ...],
                dtype: torch.dtype) -> CausalLM:
    """A random model whose QKV parts (Q, K, V rows) and gate/up parts are packed in the
    formats ``qkv`` and ``gate_up`` (:class:`SplitQuantLinear`), O and down in Q8_0."""
    model = pack_projections(dense_model(config), FMT_Q8_0)
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            for owner, attr, sizes, formats in (
                    (layer.attn, "qkv_proj", (q, kv, kv), qkv),
                    (layer.mlp, "gate_up_proj", (config.intermediate_size,) * 2, gate_up)):
                old = getattr(owner, attr)
                values = quant.dequantize_packed(
                    PackedWeight(old.fmt, old.qweight, old.in_features))
                parts = [packed_part(rows, fmt, 10 * i + j) for j, (rows, fmt) in
                         enumerate(zip(values.split(sizes), formats, strict=True))]
                split = SplitQuantLinear(PackedParts(parts), bias=old.bias is not None)
                if old.bias is not None:
                    split.bias.copy_(old.bias)
                setattr(owner, attr, split)
    return model.to(dtype)


#: (QKV part formats, gate/up part formats, hidden size, activations, QKV biases).
SPLIT_CASES = {
    "q4_1-q8_0": ((FMT_Q4_1, FMT_Q4_1, FMT_Q8_0), (FMT_Q8_0, FMT_Q4_0), 64, torch.float32, True),
    "three-formats-bfloat16": ((FMT_Q8_0, FMT_Q4_0, FMT_Q4_1), (FMT_Q4_1, FMT_Q8_0), 64,
                               torch.bfloat16, False),
    "q4_k-q6_k": ((FMT_Q4_K, FMT_Q4_K, FMT_Q6_K), (FMT_Q4_K, FMT_Q6_K), 256, torch.float32,
                  True),
    "q5_k-q6_k": ((FMT_Q5_K, FMT_Q5_K, FMT_Q6_K), (FMT_Q5_K, FMT_Q6_K), 256, torch.float32,
                  False),
}


@pytest.mark.parametrize("case", sorted(SPLIT_CASES))
@pytest.mark.parametrize("extra", [0, 6, 15], ids=["5-rows", "11-rows", "20-rows"])
def test_projections_of_parts_in_different_formats_run_fused(case: str, extra: int) -> None:
    """QKV and gate/up whose parts keep different formats (a Q4_K_M file's Q6_K V beside Q4_K Q
    and K) take the fused step, each part a product of its own into its columns (with its
    share of the bias), and agree with the eager path, which concatenates the parts' outputs.
    20 rows of 16-bit activations take the panels on AVX2 builds (``team_panel``). (Planted
    there: the bias left out: the cases with biases fail; the rows paired one row off: all
    four fail.)"""
    check_split_case(case, extra)


@pytest.mark.parametrize("case", ["q4_k-q6_k", "q5_k-q6_k"])
@pytest.mark.parametrize("extra", [0, 6, 15], ids=["5-rows", "11-rows", "20-rows"])
def test_the_avx2_build_runs_k_quant_parts_as_the_eager_layers(case: str, extra: int,
                                                               monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """``decode.c`` built without AVX-512 runs K-quant parts through its 256-bit kernels and
    agrees with the eager layers: 5 rows through the one-row kernels, which read the
    activations as ``split_k`` reorders them (words 0-7, 16-23, 8-15, 24-31 of each 32, and
    Q6_K's sums of each 16 after them); 11 rows through the many-row kernels
    (``kq_rows_few``), which read them so too. Skipped where the native build is AVX2: the
    test above runs those kernels there."""
    if not has_avx512_and_avx2():
        pytest.skip("the native build is the AVX2 one, or there is none")
    avx2 = quant_kernels.KernelLibrary(decode_kernel.SOURCE, decode_kernel.declare, AVX2_BUILD)
    monkeypatch.setattr(decode_kernel, "library", avx2)
    check_split_case(case, extra)
    assert avx2.lib is not None


def check_split_case(case: str, extra: int) -> None:
    """The fused and the eager path of SPLIT_CASES[case] agree (``extra`` more rows)."""
    qkv, gate_up, hidden, dtype, bias = SPLIT_CASES[case]
    config = replace(tiny_config(heads=4, kv_heads=2, bias=bias, head_dim=hidden // 4),
                     hidden_size=hidden, intermediate_size=hidden)
    model = split_model(config, qkv, gate_up, dtype)
    assert fused_decode.unsupported(model, torch.zeros(2, 2, 8, 2, hidden // 4)) is None
    blocks = 2000 if extra <= 6 else 4000
    fused, fused_cache, fused_runner = run(model, config, False, 16, dtype=dtype, extra=extra,
                                           blocks=blocks)
    eager, eager_cache, _ = run(model, config, True, 16, dtype=dtype, extra=extra, blocks=blocks)
    assert fused_runner._fused is not None and fused_runner.fused_decode_reason is None
    # past SMALL_M rows the eager products keep float32 activations where the build has no
    # panel kernel, as a prompt step's do (PROMPT_KV_TOL)
    kv_float = PROMPT_KV_TOL if 5 + extra > quant.SMALL_M else KV_TOL
    logit_tol, kv_tol = ((BF16_TOL["logits"], BF16_TOL["kv"]) if dtype == torch.bfloat16
                         else (LOGIT_TOL, kv_float))
    for got, want in zip(fused, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=logit_tol * float(want.abs().max()))
    torch.testing.assert_close(fused_cache.float(), eager_cache.float(), rtol=0,
                               atol=kv_tol * float(eager_cache.abs().max()))


def test_where_the_fused_path_does_not_apply() -> None:
    """Dense projections (with adapters or not), float16 activations, a float64 cache and the
    deterministic mode keep the eager path (and torch's attention), and the runner says why."""
    config = tiny_config()
    dense = CausalLM(config).eval()
    assert fused_decode.unsupported(dense, torch.zeros(2, 2, 8, 2, 16)) == \
        "a projection not packed (dense weights)"
    install_lora(dense, config, 2, 4)  # adapters do not make dense weights packed
    assert fused_decode.unsupported(dense, torch.zeros(2, 2, 8, 2, 16)) == \
        "a projection not packed (dense weights)"
    model = packed_model(config)
    assert fused_decode.unsupported(model, torch.zeros(2, 2, 8, 2, 16)) is None
    for cache_dtype in (torch.bfloat16, torch.float16):  # beside float32 activations
        assert fused_decode.unsupported(model, torch.zeros(2, 2, 8, 2, 16,
                                                           dtype=cache_dtype)) is None
    assert fused_decode.unsupported(model, torch.zeros(2, 2, 8, 2, 16, dtype=torch.float64)) \
        == "a KV cache not float32, bfloat16 or float16"
    assert fused_decode.unsupported(packed_model(config).half(), torch.zeros(2, 2, 8, 2, 16)) \
        == "activations not float32 or bfloat16"
    runner = ModelRunner(config, model, 8, 4, torch.float32, "cpu", deterministic=True)
    runner.execute([SeqBatchInput([1, 2, 3], 0, [0])])  # a prefill decides (its attention)
    assert runner.fused_decode_reason == "deterministic mode" and runner._fused is None
    assert runner._prompt_attention is None
    runner.execute([SeqBatchInput([4], 3, [0, 1])])
    assert runner.fused_decode_reason == "deterministic mode" and runner._fused is None


def random_adapter(config: ModelConfig, name: str, rank: int, seed: int,
                   parts: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
                   ) -> LoRAAdapter:
    """An adapter of ``rank`` on ``parts`` of every layer, large enough to move the logits."""
    gen = torch.Generator().manual_seed(seed)
    shapes = part_shapes(config)
    deltas = {(layer, part): (0.3 * torch.randn(rank, shapes[part][1], generator=gen),
                              0.3 * torch.randn(shapes[part][0], rank, generator=gen))
              for layer in range(config.num_hidden_layers) for part in parts}
    return LoRAAdapter(name, deltas, rank)


def lora_model(config: ModelConfig, model: CausalLM, max_rank: int = 4) -> LoRAModel:
    """Three slots on ``model``: 0 and 1 hold adapters on every projection, of ranks 4 and 2;
    2 one on the attention's output and the MLP's down projection only (its QKV and gate/up
    leave the base alone)."""
    lora = install_lora(model, config, 3, max_rank)
    lora.load_slot(0, random_adapter(config, "a", 4, 1))
    lora.load_slot(1, random_adapter(config, "b", 2, 2))
    lora.load_slot(2, random_adapter(config, "c", 4, 3, parts=("o", "down")))
    return lora


@pytest.mark.parametrize(("case", "extra"), [("q4_1-gqa2", 0), ("q4_1-gqa2", 6),
                                             ("q4_0-gqa2-bfloat16", 0),
                                             ("q4_1-gqa3-bias-block4", 6)])
def test_rows_under_different_adapters_decode_fused_as_the_eager_layers(case: str,
                                                                         extra: int) -> None:
    """LoRA adapters run inside the fused layers: each row adds its own slot's delta after
    each of the four products (or none, for a row of the base model), at 5 rows and at 11,
    float32 and bfloat16. The logits of every decode step and the K/V written agree with the
    eager path's, and the adapters change the logits far beyond that tolerance (a row given
    another row's slot, a product's delta left out, fails)."""
    config, fmt, block_size, dtype, _ = CASES[case]
    model = packed_model(config, fmt).to(dtype)
    base, _, _ = run(model, config, False, block_size, dtype=dtype, extra=extra)
    lora = lora_model(config, model)
    slots: list[int | None] = [0, None, 1, 2, 0, 1]
    fused, fused_cache, fused_runner = run(model, config, False, block_size, dtype=dtype,
                                           extra=extra, lora=lora, slots=slots)
    eager, eager_cache, _ = run(model, config, True, block_size, dtype=dtype, extra=extra,
                                lora=lora, slots=slots)
    assert fused_runner._fused is not None and fused_runner._fused.has_lora
    logit_tol, kv_tol = ((BF16_TOL["logits"], BF16_TOL["kv"]) if dtype == torch.bfloat16
                         else (LOGIT_TOL, KV_TOL))
    for step, (got, want, plain) in enumerate(zip(fused, eager, base, strict=True)):
        tol = logit_tol * float(want.abs().max())
        torch.testing.assert_close(got, want, atol=tol, rtol=0,
                                   msg=lambda m, step=step: f"decode step {step}: {m}")
        moved = (want - plain).abs().amax(dim=1)
        rows = [i for i in range(len(moved)) if slots[i % len(slots)] is not None]
        assert float(moved[rows].min()) > 10 * tol  # every adapter row really moved
    torch.testing.assert_close(fused_cache.float(), eager_cache.float(), rtol=0,
                               atol=kv_tol * float(eager_cache.abs().max()))


def test_adapters_installed_after_the_fused_layers_are_taken_in() -> None:
    """LoRA wraps the projections that the fused layers read directly: adapters installed
    after the layers were built make the runner build them again, with the adapters, and a
    row under a slot decodes as the eager layers decode it."""
    config = tiny_config()
    model = packed_model(config)
    runner = ModelRunner(config, model, 8, 4, torch.float32, "cpu")
    runner.execute([SeqBatchInput([1, 2, 3], 0, [0, 1], seq_id="a")])
    runner.execute([SeqBatchInput([4], 3, [0, 1], seq_id="a")])
    first = runner._fused
    assert first is not None and not first.has_lora
    runner.lora = lora_model(config, model)
    got = runner.execute([SeqBatchInput([5], 4, [0, 1], seq_id="a", lora_slot=0)]).logits
    assert runner._fused is not first and runner._fused is not None and runner._fused.has_lora
    eager = ModelRunner(config, model, 8, 4, torch.float32, "cpu", enforce_eager=True)
    eager.lora = runner.lora
    eager.execute([SeqBatchInput([1, 2, 3, 4], 0, [0, 1], seq_id="a")])  # the same history
    want = eager.execute([SeqBatchInput([5], 4, [0, 1], seq_id="a", lora_slot=0)]).logits
    torch.testing.assert_close(got, want, rtol=0, atol=LOGIT_TOL * float(want.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_adapter_loaded_after_the_fused_layers_were_built_is_used(dtype: torch.dtype) -> None:
    """A slot filled after the fused layers were built (an adapter loaded at run time): its
    weights reach the kernel (a bfloat16 model's float32 copies are refreshed as it loads),
    and the next decode under it agrees with the eager layers."""
    config = tiny_config()
    model = packed_model(config).to(dtype)
    lora = install_lora(model, config, 2, 4)
    outputs = []
    for eager in (False, True):
        runner = ModelRunner(config, model, 8, 4, dtype, "cpu", enforce_eager=eager)
        runner.lora = lora
        lora.load_slot(1, None)
        runner.execute([SeqBatchInput([1, 2, 3], 0, [0, 1], seq_id="a", lora_slot=1)])
        runner.execute([SeqBatchInput([4], 3, [0, 1], seq_id="a", lora_slot=1)])
        assert (runner._fused is None) == eager
        lora.load_slot(1, random_adapter(config, "late", 4, 5))
        outputs.append(runner.execute([SeqBatchInput([5], 4, [0, 1], seq_id="a",
                                                     lora_slot=1)]).logits)
    tol = (BF16_TOL["logits"] if dtype == torch.bfloat16 else LOGIT_TOL) * \
        float(outputs[1].abs().max())
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=tol)


PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors:",
           "Once upon a time, in a small village by the sea,"]


@pytest.fixture(scope="module")
def smollm2_pair() -> tuple[LLM, LLM]:
    return LLM(dtype="float32"), LLM(dtype="float32", enforce_eager=True)


def test_default_model_greedy_tokens_do_not_change(smollm2_pair: tuple[LLM, LLM]) -> None:
    """The default model (packed Q4_1/Q8_0 weights, float32) decodes the same greedy tokens
    through the fused step as through the eager one, alone and in a batch."""
    fused, eager = smollm2_pair
    assert fused.engine.runner.fused_decode_reason is None
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in fused.generate(PROMPTS, params)]
    alone = [fused.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS[:2]]
    reference = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, params)]
    assert fused.engine.runner._fused is not None and eager.engine.runner._fused is None
    assert together == reference
    assert alone == reference[:2]


def test_a_step_of_prefills_and_decodes_runs_its_decodes_fused() -> None:
    """A step that mixes prefills and decodes computes the prefills eagerly and, once the
    decodes' contexts reach ``MIN_SPLIT_CONTEXT``, the decodes fused: the same logits (prompt
    logits included) and K/V as an all-eager runner; below the threshold nothing is fused."""
    config = tiny_config()
    model = packed_model(config)
    rng = random.Random(3)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(n)] for n in (600, 500, 40, 30)]
    tables = [list(range(i * 40, (i + 1) * 40)) for i in range(4)]

    def steps(enforce_eager: bool) -> tuple[list[torch.Tensor], torch.Tensor, list[int]]:
        runner = ModelRunner(config, model, 160, 16, torch.float32, "cpu",
                             enforce_eager=enforce_eager)
        for i in (0, 1):
            runner.execute([SeqBatchInput(prompts[i], 0, tables[i], seq_id=i)])
        calls: list[int] = []
        out = []
        if runner._fused_ready():  # count the fused layers' calls (the real ones run)
            fused = runner._fused
            assert fused is not None
            run = fused.run
            fused.run = lambda *a, **k: calls.append(len(out)) or run(*a, **k)  # type: ignore
        for step, prefill in enumerate((2, 3)):
            decodes = [SeqBatchInput([7 + step], len(prompts[i]) + step, tables[i], seq_id=i)
                       for i in (0, 1)]
            new = SeqBatchInput(prompts[prefill], 0, tables[prefill], prefill == 3, prefill)
            result = runner.execute([decodes[0], new, decodes[1]])
            out += [result.logits] + [p for p in result.prompt_logits if p is not None]
        return out, runner.kv_cache, calls

    fused, fused_cache, calls = steps(False)
    eager, eager_cache, _ = steps(True)
    assert calls == [0, 1]  # 600 + 500 >= MIN_SPLIT_CONTEXT: both steps split
    for got, want in zip(fused, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=LOGIT_TOL * float(want.abs().max()))
    torch.testing.assert_close(fused_cache, eager_cache, rtol=0,
                               atol=KV_TOL * float(eager_cache.abs().max()))


def test_short_decodes_ride_along_in_a_prefill_step() -> None:
    """Below ``MIN_SPLIT_CONTEXT`` of decode context a mixed step of more than
    ``fused_step_rows`` new tokens stays one eager pass."""
    config = tiny_config()
    runner = ModelRunner(config, packed_model(config), 64, 16, torch.float32, "cpu")
    runner.execute([SeqBatchInput([1, 2, 3], 0, [0], seq_id="a")])
    runner.execute([SeqBatchInput([4], 3, [0], seq_id="a")])  # builds the fused layers
    fused = runner._fused
    assert fused is not None
    calls: list[int] = []
    run = fused.run
    fused.run = lambda *a, **k: calls.append(1) or run(*a, **k)  # type: ignore
    runner.execute([SeqBatchInput([5], 4, [0], seq_id="a"),
                    SeqBatchInput([1 + i % 50 for i in range(fused_step_rows(torch.float32))], 0,
                                  list(range(1, 10)), seq_id="b")])
    assert calls == [] and MIN_SPLIT_CONTEXT > 5
    runner.execute([SeqBatchInput([6], 5, [0], seq_id="a")])
    assert calls == [1]


#: The K/V of a fused step's prompt rows against the eager step's, as a fraction of the
#: largest: past ``SMALL_M`` rows the eager step multiplies the float32 activations as they
#: are where the build has no panel kernel, the fused layers round them to 16 bits per block
#: as in a decode step (measured up to 1.9e-4 over five seeds of ``short_prompt_steps``;
#: logits within ``LOGIT_TOL``).
PROMPT_KV_TOL = 4e-4


def short_prompt_steps(enforce_eager: bool, monkeypatch: pytest.MonkeyPatch,
                       adapters: bool = False
                       ) -> tuple[list[torch.Tensor], torch.Tensor, list[int]]:
    """Four steps on a tiny packed model: a prompt of L + 6 tokens, L = ``fused_step_rows``
    (more than the limit: eager); its decode beside a 5-token prompt and, behind a cached block
    of the first prompt, a 7-token rest (13 rows); the three decoding beside a 3-token prompt
    that asks for its prompt's logits; the four decoding beside a new prompt that fills the
    step to L rows. With ``adapters`` the sequences run under LoRA slots 0, 1, none,
    2 and 0 (``lora_model``). Returns each step's last-row logits, the cache, and the steps that
    ran the fused layers."""
    config = replace(tiny_config(heads=4, kv_heads=2, head_dim=64), hidden_size=256,
                     intermediate_size=256)
    model = packed_model(config)
    runner = ModelRunner(config, model, 64, 16, torch.float32, "cpu",
                         enforce_eager=enforce_eager)
    runner.lora = lora_model(config, model) if adapters else None
    slots = {"a": 0, "b": 1, "d": 2, "e": 0} if adapters else {}
    rng = random.Random(5)
    limit = fused_step_rows(torch.float32)
    ids = [rng.randrange(config.vocab_size) for _ in range(2 * limit + 40)]
    rest, n = limit - 4, limit + 6  # n: the first prompt's length

    def seq(name: str, first: int, end: int, start: int, table: list[int],
            logits: bool = False) -> SeqBatchInput:
        return SeqBatchInput(ids[first:end], start, table, seq_id=name,
                             need_prompt_logits=logits, lora_slot=slots.get(name))

    a = list(range(n // 16 + 1))
    b, c, d = [len(a)], [0, len(a) + 1], [len(a) + 2]  # c's first block is a's
    e = list(range(len(a) + 3, len(a) + 3 + rest // 16 + 1))
    steps = [[seq("a", 0, n, 0, a)],
             [seq("a", n, n + 1, n, a), seq("b", n + 1, n + 6, 0, b),
              seq("c", n + 6, n + 13, 16, c)],
             [seq("a", n + 13, n + 14, n + 1, a), seq("b", n + 14, n + 15, 5, b),
              seq("c", n + 15, n + 16, 23, c), seq("d", n + 16, n + 19, 0, d, logits=True)],
             [seq("a", n + 19, n + 20, n + 2, a), seq("b", n + 20, n + 21, 6, b),
              seq("c", n + 21, n + 22, 24, c), seq("d", n + 22, n + 23, 3, d),
              seq("e", n + 23, n + 23 + rest, 0, e)]]
    calls: list[int] = []
    run = fused_decode.FusedDecode.run
    monkeypatch.setattr(fused_decode.FusedDecode, "run", lambda *args, **kwargs: (
        calls.append(1), run(*args, **kwargs))[1])
    logits, fused_steps = [], []
    for number, step in enumerate(steps):
        logits.append(runner.execute(step).logits)
        if calls:
            fused_steps.append(number)
            calls.clear()
    monkeypatch.undo()
    return logits, runner.kv_cache, fused_steps


@pytest.mark.parametrize("adapters", [False, True], ids=["base", "lora"])
def test_a_step_of_short_prompts_runs_fused_as_the_eager_layers(
        adapters: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of at most ``fused_step_rows`` new tokens, short prompts (one behind a cached
    block) among decodes, runs whole through the fused layers, and its logits and the K/V it
    writes agree with the eager path's, under LoRA adapters too (each prompt row under its
    sequence's slot); a step with a prompt that asks for its prompt's logits, or of more rows,
    stays eager. (Planted: every row of a prompt at the prompt's first position fails the
    logits and the cache; a prompt's rows after its first under the base model fail the lora
    case; the limit taken as ``<`` leaves the last step eager and fails the steps' list.)"""
    fused, fused_cache, fused_steps = short_prompt_steps(False, monkeypatch, adapters)
    eager, eager_cache, eager_steps = short_prompt_steps(True, monkeypatch, adapters)
    assert fused_steps == [1, 3] and eager_steps == []
    for got, want in zip(fused, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=LOGIT_TOL * float(want.abs().max()))
    torch.testing.assert_close(fused_cache, eager_cache, rtol=0,
                               atol=PROMPT_KV_TOL * float(eager_cache.abs().max()))


def test_panel_builds_run_steps_of_up_to_128_tokens_fused() -> None:
    """Where both steps of a float32 model multiply more than 16 rows in panels (AVX2 builds),
    a step of up to ``PANEL_STEP_ROWS`` (128) new tokens runs whole through the fused layers,
    elsewhere, and for a bfloat16 model everywhere, up to ``FUSED_STEP_ROWS`` (64); a runner
    takes the limit when it builds them and then runs a prompt of that many tokens fused.
    (Planted: the panel builds' limit left at 64: fails on AVX2 builds; the limit not keyed on
    the dtype: fails there too.)"""
    want = PANEL_STEP_ROWS if panel_build() else FUSED_STEP_ROWS
    assert fused_step_rows(torch.float32) == want and PANEL_STEP_ROWS > FUSED_STEP_ROWS
    assert fused_step_rows(torch.bfloat16) == FUSED_STEP_ROWS
    config = tiny_config()
    runner = ModelRunner(config, packed_model(config), 64, 16, torch.float32, "cpu")
    runner.execute([SeqBatchInput([1, 2, 3], 0, [0], seq_id="a")])
    assert runner._fused is not None and runner.fused_step_rows == want
    fused = runner._fused
    calls: list[int] = []
    run = fused.run
    fused.run = lambda *a, **k: calls.append(1) or run(*a, **k)  # type: ignore
    runner.execute([SeqBatchInput([1 + i % 50 for i in range(want)], 0, list(range(1, 10)),
                                  seq_id="b")])
    assert calls == [1]


def test_a_kernel_that_does_not_build_says_why(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel file that fails to compile gives no library and its own compiler message (the
    fused path reports it as its reason); a second ``get`` does not try again."""
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "broken.c"
    source.write_text("int broken( {\n")
    declared: list[object] = []
    library = quant_kernels.KernelLibrary(source, declared.append)
    assert library.get() is None and declared == []
    assert library.error is not None and "broken.c:1" in library.error  # the compiler's line
    source.write_text("int fine(void) { return 1; }\n")
    assert library.get() is None  # tried once per process


@pytest.mark.parametrize(("dtype", "extra"), [(torch.float32, 11), (torch.bfloat16, 11),
                                             (torch.float32, 15)],
                         ids=["float32", "bfloat16", "float32-20-rows"])
def test_the_fused_step_gives_the_same_bits_on_one_and_on_two_threads(dtype: torch.dtype,
                                                                      extra: int) -> None:
    """Sixteen rows shared out among two threads (the products by weight rows, attention by
    chunk groups, the row-wise steps by rows: two units of 8 rows for a float32 model's 16-bit
    rounding, single rows for a bfloat16 model) give what one thread gives, bit for bit: every
    output is computed by one thread in one order; so do 20 float32 rows (on AVX2 builds the
    panels: each panel of 16 outputs one thread's). The suite's workers run one thread each, so
    this is the test that sees the threads meet. Kills: a row-wise step without its barrier (a
    product reading rows another thread has not rounded yet), or one writing outside its rows."""
    config = tiny_config(heads=6, kv_heads=2, head_dim=64)
    model = packed_model(config).to(dtype)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            logits, cache, runner = run(model, config, False, 16, dtype=dtype, extra=extra,
                                        blocks=4000)
            assert runner._fused is not None and logits[0].shape[0] == 5 + extra
            results.append((logits, cache))
    finally:
        torch.set_num_threads(threads)
    (one, one_cache), (two, two_cache) = results
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(one_cache, two_cache)


#: Tiny sliding-window models built with transformers (as ``test_model_windows.py`` builds
#: them) and packed here: Qwen2 with a sliding layer after a full one (two KV cache groups),
#: Mistral (every layer slides: one window group) and Gemma 3 (a sliding and a full layer;
#: Q/K norms, sandwich norms, GELU, a query scale that is not head_dim's, a second rotary
#: base). name: (head size, activations).
WINDOWED = {"qwen2": (16, torch.float32), "mistral": (16, torch.float32),
            "gemma3": (16, torch.float32), "gemma3-head256-bfloat16": (256, torch.bfloat16)}


def windowed_model(name: str, window: int, folder: Path) -> tuple[ModelConfig, CausalLM]:
    """The model ``name`` of WINDOWED with random weights and a sliding window of ``window``,
    loaded through ``load_model`` and its four projections per layer packed in Q8_0."""
    transformers = pytest.importorskip("transformers")
    from prefixserve.model.weights.loader import load_model

    common = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 1024}
    head_dim, dtype = WINDOWED[name]
    if name == "qwen2":
        hf_config = transformers.Qwen2Config(**common, use_sliding_window=True,
                                             sliding_window=window, max_window_layers=1)
    elif name == "mistral":
        hf_config = transformers.MistralConfig(**common, sliding_window=window)
    else:
        hf_config = transformers.Gemma3TextConfig(
            **common, head_dim=head_dim, sliding_window=window, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    with torch.no_grad():
        for param_name, param in hf.named_parameters():
            noise = torch.randn(param.shape)
            scale = 1.0 if "embed" in param_name else 0.15
            param.copy_(1.0 + 0.2 * noise if "norm" in param_name else scale * noise)
    hf.save_pretrained(folder)
    config, model = load_model(str(folder), torch.float32)
    return config, pack_projections(model, FMT_Q8_0).to(dtype)


def run_windowed(model: CausalLM, config: ModelConfig, enforce_eager: bool,
                 dtype: torch.dtype, lora: LoRAModel | None = None
                 ) -> tuple[list[torch.Tensor], torch.Tensor, ModelRunner]:
    """Three sequences of 700, 40 and 530 tokens prefilled (in chunks of 300), then five
    decode steps of all three, then a step of their decodes beside a new 50-token prompt
    (their contexts pass ``MIN_SPLIT_CONTEXT``: the decodes fused, the prompt eager); each
    KV cache group's tables shuffled, and before every step a window group's blocks wholly
    before the window replaced by block 0 (zeros: never written), as the hybrid manager
    leaves them. The logits of each decode step (the last step's prompt logits too) and the
    cache at the end. With ``lora`` (the model's slots) sequence i runs under slot i % 3."""
    block_size, rng = 16, random.Random(3)
    runner = ModelRunner(config, model, 400, block_size, dtype, "cpu",
                         enforce_eager=enforce_eager)
    runner.lora = lora
    groups = runner.layout.groups
    free = list(range(1, 400))
    rng.shuffle(free)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(n)] for n in (700, 40, 530)]
    late = [rng.randrange(config.vocab_size) for _ in range(50)]
    tables = [[[free.pop() for _ in range((len(p) + 6) // block_size + 1)] for _ in groups]
              for p in [*prompts, late]]

    def seq(i: int, ids: list[int], start: int, logits: bool = False) -> SeqBatchInput:
        # window groups read from the first token's window on: the blocks before it nulled
        slid = [0 if group.window is None else max(0, (start - group.window + 1) // block_size)
                for group in groups]
        own = [[0] * n + table[n:] for n, table in zip(slid, tables[i], strict=True)]
        assert (start + len(ids) - 1) // block_size < len(own[0])
        return SeqBatchInput(ids, start, own[0], logits, seq_id=i,
                             extra_block_tables=tuple(own[1:]),
                             lora_slot=None if lora is None else i % 3)

    for i, prompt in enumerate(prompts):
        for start in range(0, len(prompt), 300):
            runner.execute([seq(i, prompt[start:start + 300], start)])
    logits = []
    for step in range(5):
        steps = [seq(i, [rng.randrange(config.vocab_size)], len(p) + step)
                 for i, p in enumerate(prompts)]
        logits.append(runner.execute(steps).logits)
    split = runner.execute([seq(0, [5], 705), seq(3, late, 0, logits=True), seq(1, [6], 45),
                            seq(2, [7], 535)])
    prompt_logits = split.prompt_logits[1]
    assert prompt_logits is not None
    return [*logits, split.logits, prompt_logits], runner.kv_cache, runner


def assert_windowed_agree(fused: list[torch.Tensor], eager: list[torch.Tensor],
                          fused_cache: torch.Tensor, eager_cache: torch.Tensor,
                          dtype: torch.dtype) -> None:
    """``run_windowed``'s logits of every step and caches agree within the dtype's bounds."""
    logit_tol, kv_tol = ((BF16_TOL["logits"], BF16_TOL["kv"]) if dtype == torch.bfloat16
                         else (LOGIT_TOL, KV_TOL))
    for step, (got, want) in enumerate(zip(fused, eager, strict=True)):
        torch.testing.assert_close(got, want, rtol=0, atol=logit_tol * float(want.abs().max()),
                                   msg=lambda m, step=step: f"decode step {step}: {m}")
    torch.testing.assert_close(fused_cache.float(), eager_cache.float(), rtol=0,
                               atol=kv_tol * float(eager_cache.abs().max()))


@pytest.mark.parametrize("name", ["gemma3", "gemma3-head256-bfloat16"])
def test_gemma3_rows_under_adapters_decode_fused_as_the_eager_layers(name: str,
                                                                     tmp_path: Path) -> None:
    """Gemma 3's fused layers with LoRA adapters (rows under slots 0, 1, 2 and the base, its
    norms of each block's output taken after the delta): the logits of every decode step and
    the K/V written agree with the eager layers'."""
    config, model = windowed_model(name, 300, tmp_path)
    dtype = WINDOWED[name][1]
    lora = lora_model(config, model)
    fused, fused_cache, fused_runner = run_windowed(model, config, False, dtype, lora)
    eager, eager_cache, _ = run_windowed(model, config, True, dtype, lora)
    assert fused_runner._fused is not None and fused_runner._fused.has_lora
    assert_windowed_agree(fused, eager, fused_cache, eager_cache, dtype)


@pytest.mark.parametrize("name", sorted(WINDOWED))
@pytest.mark.parametrize("window", [8, 300])
@pytest.mark.parametrize("build", ["native", "avx2"])
def test_sliding_window_models_take_the_fused_layers(name: str, window: int, build: str,
                                                     tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Sliding-window and hybrid models (Qwen2, Mistral, Gemma 3) decode through the fused
    layers, each layer attending through its KV cache group's tables over its window (8
    positions: inside one block; 300: across the kernel's chunks of 256), with the logits and
    the K/V written of the eager layers, in the native build and (on an AVX-512 machine) in
    the AVX2 one. The blocks before a window hold zeros, so attending a position outside it
    fails the logits. Kills: a window ignored or off by one, a layer on another group's
    tables, a missing Gemma norm, GELU taken for SiLU, the query scale or the local rotary
    base left out."""
    if build == "avx2":
        if not has_avx512_and_avx2():
            pytest.skip("the native build is the AVX2 one, or there is none")
        monkeypatch.setattr(decode_kernel, "library", quant_kernels.KernelLibrary(
            decode_kernel.SOURCE, decode_kernel.declare, AVX2_BUILD))
    config, model = windowed_model(name, window, tmp_path)
    dtype = WINDOWED[name][1]
    fused, fused_cache, fused_runner = run_windowed(model, config, False, dtype)
    eager, eager_cache, eager_runner = run_windowed(model, config, True, dtype)
    assert fused_runner.fused_decode_reason is None and fused_runner._fused is not None
    assert eager_runner._fused is None
    assert_windowed_agree(fused, eager, fused_cache, eager_cache, dtype)
