"""The C kernel's attention for a step's prompt positions (prefixserve.model.attention.prompt)
against torch's paged attention of the same step."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest
import torch
from isa_helpers import has_avx512_and_avx2
from model_helpers import dense_model, packed_model, tiny_config

from prefixserve.model.arch.config import ModelConfig
from prefixserve.model.attention import decode_kernel
from prefixserve.model.attention import prompt as prompt_attention
from prefixserve.model.attention.paged import (
    AttentionMetadata,
    TableRows,
    build_metadata,
    paged_attention,
)
from prefixserve.model.attention.window import build_window_metadata
from prefixserve.model.runner import ModelRunner, SeqBatchInput, fused_step_rows
from prefixserve.model.weights import quant_kernels
from prefixserve.model.weights.dtypes import cpu_has_amx
from prefixserve.model.weights.quant import QuantLinear

BLOCK = 16
#: (heads, kv heads, head size, cache dtype)
CASES = {
    "head64-gqa3-bfloat16": (9, 3, 64, torch.bfloat16),
    "head64-gqa2-float32": (4, 2, 64, torch.float32),
    "head64-gqa3-float16": (6, 2, 64, torch.float16),
    "head128-gqa2-bfloat16": (4, 2, 128, torch.bfloat16),
    "head128-mha-float32": (2, 2, 128, torch.float32),
    # Gemma 3's head size, its 512-bit forms (round 13)
    "head256-gqa4-float32": (4, 1, 256, torch.float32),
    "head256-gqa2-float16": (4, 2, 256, torch.float16),
}


def step(rng: random.Random) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """A step's (start, new tokens) and block tables: three prompts of 40-70 tokens after a
    cached 600-token prefix they share (blocks and all: more rows on those chunks than one
    group holds), a fresh prompt of 300, a decode at position 400 of a context of its own,
    and a prompt after 90 cached tokens that share only the first block of that prefix."""
    free = list(range(1, 400))
    rng.shuffle(free)
    shared = [free.pop() for _ in range(600 // BLOCK)]
    seq_lens: list[tuple[int, int]] = []
    tables: list[list[int]] = []

    def table(length: int, prefix: list[int]) -> list[int]:
        return prefix + [free.pop() for _ in range((length - 1) // BLOCK + 1 - len(prefix))]

    for n in (40, 70, 55):
        seq_lens.append((600, n))
        tables.append(table(600 + n, shared))
    seq_lens.append((0, 300))
    tables.append(table(300, []))
    seq_lens.append((400, 1))
    tables.append(table(401, []))
    seq_lens.append((90, 33))
    tables.append(table(123, shared[:1]))
    return seq_lens, tables


@dataclass
class Planned:
    """One step (:func:`step`) planned for torch (``want``) and for the kernel (``got``), over
    a random cache, with its rows' keys and values gathered."""

    want: AttentionMetadata
    got: AttentionMetadata
    cache: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def planned(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
            bf16_queries: bool = False, window: int | None = None) -> Planned:
    rng = random.Random(7)
    torch.manual_seed(7)
    seq_lens, tables = step(rng)
    cache = torch.randn(2, 400 * BLOCK, kv_heads, head_dim).to(dtype)
    rows = len(tables)
    width = max(len(t) for t in tables)
    buffer = torch.zeros((rows, width), dtype=torch.long)
    for i, t in enumerate(tables):
        buffer[i, :len(t)] = torch.tensor(t)
    table_rows = TableRows(buffer, list(range(rows)))
    kernel = prompt_attention.PromptAttention(heads, kv_heads, head_dim, BLOCK, cache[None],
                                              bf16_queries=bf16_queries)
    cpu = torch.device("cpu")
    if window is None:
        want_meta = build_metadata(seq_lens, tables, BLOCK, cpu, torch.float32, table_rows)
        got_meta = build_metadata(seq_lens, tables, BLOCK, cpu, torch.float32, table_rows,
                                  kernel=kernel)
    else:
        want_meta = build_window_metadata(seq_lens, tables, BLOCK, window, cpu, torch.float32,
                                          table_rows)
        got_meta = build_window_metadata(seq_lens, tables, BLOCK, window, cpu, torch.float32,
                                         table_rows, kernel)
    assert got_meta.kernel is not None and want_meta.kernel is None
    torch.testing.assert_close(got_meta.slot_mapping, want_meta.slot_mapping, rtol=0, atol=0)
    k = cache[0].index_select(0, want_meta.slot_mapping).float()
    v = cache[1].index_select(0, want_meta.slot_mapping).float()
    return Planned(want_meta, got_meta, cache, k, v)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_kernel_attends_as_torch_does(case: str) -> None:
    """Every row's output equals torch's paged attention of the step (SDPA over each
    sequence's gathered context, in float32) within float rounding."""
    heads, kv_heads, head_dim, dtype = CASES[case]
    if not prompt_attention.available(head_dim):
        pytest.skip("no 512-bit form of the kernel on this CPU")
    plan = planned(heads, kv_heads, head_dim, dtype)
    want_meta, got_meta, cache, k, v = plan.want, plan.got, plan.cache, plan.k, plan.v
    q = torch.randn(want_meta.num_tokens, heads, head_dim)
    want = paged_attention(q, k, v, cache, want_meta, BLOCK)
    got = paged_attention(q, k, v, cache, got_meta, BLOCK)
    assert got.dtype == q.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    again = paged_attention(q * 0.5, k, v, cache, got_meta, BLOCK)  # the plan serves each layer
    torch.testing.assert_close(again, paged_attention(q * 0.5, k, v, cache, want_meta, BLOCK),
                               rtol=1e-4, atol=1e-5)
    assert not torch.equal(again, got)  # a result of its own, not the plan's buffer


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("window", [8, 300])
def test_the_kernel_attends_over_sliding_windows_as_torch_does(head_dim: int,
                                                               window: int) -> None:
    """Sliding-window layers (Gemma 3, Mistral): every row's output equals torch's window
    attention of the step (each row over its last ``window`` positions: 8, inside a block;
    300, across the kernel's chunks), prompts several windows long and a decode row included.
    The cache is random everywhere, so a position read outside a window fails it."""
    if not prompt_attention.available(head_dim):
        pytest.skip("no 512-bit form of the kernel on this CPU")
    plan = planned(4, 2, head_dim, torch.float32, window=window)
    q = torch.randn(plan.want.num_tokens, 4, head_dim)
    want = paged_attention(q, plan.k, plan.v, plan.cache, plan.want, BLOCK)
    got = paged_attention(q, plan.k, plan.v, plan.cache, plan.got, BLOCK)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def bf16_reference(q: torch.Tensor, plan: Planned, seq_lens: list[tuple[int, int]],
                   tables: list[list[int]]) -> torch.Tensor:
    """Attention as a bfloat16 model computes it: queries rounded to bfloat16, scores and
    their softmax in float32, the weights rounded to bfloat16 before they multiply the values
    (as torch's CPU flash attention does for bfloat16), normalized by the unrounded sum."""
    out = torch.empty_like(q)
    first = 0
    for (start, n), table in zip(seq_lens, tables, strict=True):
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start + n)])
        keys, values = plan.cache[0][slots].float(), plan.cache[1][slots].float()
        heads, kv_heads = q.shape[1], keys.shape[1]
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)
        values = values.repeat_interleave(heads // kv_heads, dim=1)
        for r in range(n):
            query = q[first + r].bfloat16().float()  # [heads, D]
            context = start + r + 1
            scores = torch.einsum("hd,thd->ht", query, keys[:context]) / q.shape[2] ** 0.5
            weights = torch.exp(scores - scores.max(dim=1, keepdim=True).values)
            total = weights.sum(dim=1, keepdim=True)
            rounded = weights.bfloat16().float()
            out[first + r] = torch.einsum("ht,thd->hd", rounded, values[:context]) / total
        first += n
    return out


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_a_bfloat16_model_attends_in_bfloat16(head_dim: int) -> None:
    """With ``bf16_queries`` and a bfloat16 cache the kernel computes as a bfloat16 model does
    (:func:`bf16_reference`: queries and weights rounded to bfloat16, ``vdpbf16ps`` over keys
    and values in place): within 2^-10 of the largest value (the kernel rounds each chunk's
    weights against the chunk's own maximum, the reference against the row's; measured: at
    most 2^-12 of it and a mean of 2^-17 here; 2^-11 with queries three times as large), and
    further than float rounding from the float32 result (so the path ran). Kills: the flag
    ignored (float32 queries and weights), a query's pairs of elements misordered against the
    keys' (the halves of ``_mm512_cvtne2ps_pbh`` swapped), values interleaved out of order,
    the odd last position of a run weighted by the next one's weight (planted: each caught)."""
    if not (prompt_attention.available(head_dim) and prompt_attention.attends_in_bf16()):
        pytest.skip("no bfloat16 scores in this CPU's build of the kernel")
    heads, kv_heads = (9, 3) if head_dim == 64 else (4, 2)
    plan = planned(heads, kv_heads, head_dim, torch.bfloat16, bf16_queries=True)
    seq_lens, tables = step(random.Random(7))
    q = torch.randn(plan.want.num_tokens, heads, head_dim)
    got = paged_attention(q, plan.k, plan.v, plan.cache, plan.got, BLOCK)
    want = bf16_reference(q, plan, seq_lens, tables)
    largest = float(plan.cache[1].float().abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=2**-10 * largest)
    assert float((got - want).abs().mean()) < 2**-14 * largest
    unrounded = paged_attention(q, plan.k, plan.v, plan.cache, plan.want, BLOCK)
    assert float((got - unrounded).abs().max()) > 1e-3


def test_without_avx512_bf16_the_flag_falls_back_to_float32(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A build with AVX-512 but not AVX512-BF16 (a CPU before it) says it has no bfloat16 form,
    and with ``bf16_queries`` set attends in float32: torch's result within float rounding.
    Kills: the flag honoured where the instructions are absent (the call reaching the empty
    stubs leaves the outputs at zero), ``attends_in_bf16`` asking the wrong build."""
    if not has_avx512_and_avx2():
        pytest.skip("needs an AVX-512 CPU to build its kernel without AVX512-BF16")
    build = quant_kernels.KernelLibrary(decode_kernel.SOURCE, decode_kernel.declare,
                                        ("-mno-avx512bf16",))
    monkeypatch.setattr(decode_kernel, "library", build)
    assert prompt_attention.available(64) and not prompt_attention.attends_in_bf16()
    plan = planned(9, 3, 64, torch.bfloat16, bf16_queries=True)
    q = torch.randn(plan.want.num_tokens, 9, 64)
    got = paged_attention(q, plan.k, plan.v, plan.cache, plan.got, BLOCK)
    want = paged_attention(q, plan.k, plan.v, plan.cache, plan.want, BLOCK)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("dtype", "kv_dtype", "in_bf16"), [
    (torch.bfloat16, None, True), (torch.float32, torch.bfloat16, False),
    (torch.float32, None, False)], ids=["bfloat16-model", "float32-model-bfloat16-cache",
                                        "float32-model"])
def test_only_a_bfloat16_model_attends_in_bfloat16(dtype: torch.dtype,
                                                  kv_dtype: torch.dtype | None,
                                                  in_bf16: bool) -> None:
    """The runner asks the kernel to attend in bfloat16 (``bf16_queries``) in a bfloat16
    model's prompt and decode steps, and never for a float32 model, over a bfloat16 cache
    either: its queries are float32 values, and rounding them would change its results.
    Kills: the flag keyed on the cache's dtype, or not passed to one of the two paths. (The
    prompt step goes to the kernel here even where the runner would give it to SDPA: a
    bfloat16 model on a CPU with AMX, ``prompts_in_kernel``.)"""
    config = tiny_config(heads=6, kv_heads=2, head_dim=64)
    if not prompt_attention.available(config.head_dim):
        pytest.skip("no 512-bit form of the kernel on this CPU")
    model = packed_model(config).to(dtype)
    runner = ModelRunner(config, model, 64, BLOCK, dtype, "cpu", kv_cache_dtype=kv_dtype)
    runner.prompts_in_kernel = True
    runner.execute([SeqBatchInput(list(range(40)), 0, [0, 1, 2], seq_id=0)])
    assert runner._prompt_attention is not None and runner._fused is not None
    assert bool(runner._prompt_attention.model.bf16_queries) is in_bf16
    assert bool(runner._fused.model.bf16_queries) is in_bf16


@pytest.mark.parametrize("window", [None, 16], ids=["full", "sliding"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_a_bfloat16_model_on_amx_attends_its_prompts_through_sdpa(dtype: torch.dtype,
                                                                  window: int | None) -> None:
    """On a CPU with AMX tiles a bfloat16 model's eager prompt steps (longer than the fused
    step takes, ``fused_step_rows``) attend through torch (gather and SDPA, whose products
    run on the tiles), over full and sliding-window layers alike (16-token windows): the
    kernel is not even planned for them, and the logits are SDPA's. Its decode steps, and
    every step of a float32 model or of a CPU without AMX, keep the kernel. Kills: the
    choice ignored (the kernel planned for a prompt step), keyed on the CPU alone, taken for
    decode steps too, or left out for windows."""
    config = replace(tiny_config(heads=6, kv_heads=2, head_dim=64), sliding_window=window)
    if not prompt_attention.available(config.head_dim):
        pytest.skip("no 512-bit form of the kernel on this CPU")
    model = packed_model(config).to(dtype)
    runner = ModelRunner(config, model, 64, BLOCK, dtype, "cpu")
    sdpa = dtype == torch.bfloat16 and cpu_has_amx()
    assert runner.prompts_in_kernel is not sdpa
    length = fused_step_rows(dtype) + 8
    blocks = list(range(length // BLOCK + 1))
    prompt = SeqBatchInput([i % config.vocab_size for i in range(length)], 0, blocks, seq_id=0)
    got = runner.execute([prompt]).logits
    assert (runner._prompt_attention is None) is sdpa
    eager = ModelRunner(config, model, 64, BLOCK, dtype, "cpu", enforce_eager=True)
    want = eager.execute([prompt]).logits
    if sdpa:
        assert torch.equal(got, want)
    runner.execute([SeqBatchInput([7], length, blocks, seq_id=0)])
    assert runner._prompt_attention is not None  # the decode step built the fused layers


def kernel_and_eager(config: ModelConfig, model: torch.nn.Module, seed: int, decode: bool
                     ) -> tuple[list[ModelRunner], list[torch.Tensor]]:
    """Two runners over ``model``, the default one and one with --enforce-eager, and the
    logits each gives for a question after a cached 300-token prefix (and, with ``decode``,
    for the decode step after it). The question is longer than the fused step takes
    (``fused_step_rows``), so that both runners compute it in an eager step."""
    rng = random.Random(seed)
    prefix = [rng.randrange(config.vocab_size) for _ in range(300)]
    question = [rng.randrange(config.vocab_size) for _ in range(fused_step_rows(torch.float32) + 8)]
    first = list(range(19))
    # the prefix's blocks, its last one included, then the question's own
    second = [*first, *range(40, 40 + (300 + len(question)) // BLOCK + 1 - len(first))]
    runners, logits = [], []
    for eager in (False, True):
        runner = ModelRunner(config, model, 64, BLOCK, torch.float32, "cpu",
                             enforce_eager=eager)
        runner.execute([SeqBatchInput(prefix, 0, first, seq_id=0)])
        steps = [runner.execute([SeqBatchInput(question, 300, second, seq_id=1)]).logits]
        if decode:
            steps.append(runner.execute([SeqBatchInput([7], 300 + len(question), second,
                                                        seq_id=1)]).logits)
        runners.append(runner)
        logits.append(torch.cat(steps))
    return runners, logits


def test_the_runner_plans_prompt_steps_with_the_kernel() -> None:
    """Where the fused layers apply (a packed Llama model on CPU) the eager steps' attention
    takes the kernel, and greedy logits after a cached prefix match --enforce-eager's. The
    products expand the weights for float32 GEMMs in both runners (no panels, whose 16-bit
    rounding of each layer's input would blur the two attentions' float32 differences)."""
    config = tiny_config(heads=6, kv_heads=2, head_dim=64)
    if not prompt_attention.available(config.head_dim):
        pytest.skip("no 512-bit form of the kernel on this CPU")
    model = packed_model(config)
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.panel = False
    runners, logits = kernel_and_eager(config, model, 3, decode=False)
    assert runners[0]._prompt_attention is not None and runners[1]._prompt_attention is None
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["dense-llama", "dense-qwen3"])
def test_models_the_fused_layers_cannot_run_attend_in_the_kernel(qk_norm: bool) -> None:
    """A model with dense projections (a safetensors model, ``--weights bf16``), Qwen3's Q/K
    norm included, cannot take the fused layers, but its steps, prompt and decode rows alike,
    attend through the kernel: the projections keep the fused layers off, not the attention.
    The logits of a question after a cached prefix and of the next decode step match
    --enforce-eager's (torch's attention). Kills: the kernel kept for packed models and
    adapters only, or refused for Q/K norm, as it was."""
    config = replace(tiny_config(heads=6, kv_heads=2, head_dim=64), qk_norm=qk_norm)
    if not prompt_attention.available(config.head_dim):
        pytest.skip("no 512-bit form of the kernel on this CPU")
    model = dense_model(config)
    runners, logits = kernel_and_eager(config, model, 4, decode=True)
    assert all(r._fused is None for r in runners), "the model took the fused layers"
    assert runners[0]._prompt_attention is not None and runners[1]._prompt_attention is None
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
