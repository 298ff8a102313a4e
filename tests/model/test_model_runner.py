"""Paged-KV model runner vs HF transformers on tiny random-weight Llama / Qwen2 / Qwen3 models.

Every comparison is float32 with ``atol = rtol = 1e-4`` (logits are O(1)-O(10)). The tiny models
are built here with transformers, their weights randomised (norm weights and biases included,
so that each of them matters), saved with safetensors and loaded back with ``load_model``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from model_helpers import COMMON, HF_CONFIGS
from transformers import AutoModelForCausalLM, PreTrainedModel

from prefixserve.model.arch.config import ModelConfig
from prefixserve.model.arch.llama import CausalLM
from prefixserve.model.runner import ModelRunner, SeqBatchInput
from prefixserve.model.weights.loader import load_model

TOL = {"atol": 1e-4, "rtol": 1e-4}
VOCAB = COMMON["vocab_size"]


def randomize(model: PreTrainedModel, seed: int) -> None:
    """Give every parameter random values (norm weights around 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(0.15 * noise)


class Tiny(NamedTuple):
    arch: str
    hf: PreTrainedModel
    config: ModelConfig
    model: CausalLM
    path: Path


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    """HF reference model, its safetensors directory and our model, for one architecture."""
    arch = request.param
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(HF_CONFIGS[arch](), dtype=torch.float32)
    randomize(hf, seed=1)
    hf.eval()
    path: Path = tmp_path_factory.mktemp(arch)
    hf.save_pretrained(path)
    config, model = load_model(str(path), torch.float32)
    return Tiny(arch, hf, config, model, path)


def reference(hf: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """HF logits of every position of ``ids``: ``[len(ids), vocab]``."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def make_runner(tiny: Tiny, block_size: int = 4, num_blocks: int = 96) -> ModelRunner:
    return ModelRunner(tiny.config, tiny.model, num_blocks, block_size, torch.float32, "cpu")


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def shuffled_tables(num_blocks: int, sizes: list[int], seed: int) -> list[list[int]]:
    """Disjoint block tables of the given lengths, made of shuffled block ids."""
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables, start = [], 0
    for size in sizes:
        tables.append(ids[start : start + size])
        start += size
    return tables


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def test_config_matches_hf(tiny: Tiny) -> None:
    arch, hf, config = tiny.arch, tiny.hf, tiny.config
    assert config.architecture == arch
    hf_head_dim = getattr(hf.config, "head_dim", None) or 64 // hf.config.num_attention_heads
    assert config.head_dim == hf_head_dim == (24 if arch == "qwen3" else 16)
    assert config.num_key_value_heads == hf.config.num_key_value_heads
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert config.attention_bias == (arch == "qwen2")
    assert config.qk_norm == (arch == "qwen3")
    assert (config.rope_scaling is not None) == (arch == "llama")


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_full_prompt_one_step(tiny: Tiny, block_size: int) -> None:
    ids = tokens(37, seed=2)
    runner = make_runner(tiny, block_size=block_size, num_blocks=64)
    (table,) = shuffled_tables(64, [blocks_for(len(ids), block_size)], seed=3)
    out = runner.execute([SeqBatchInput(ids, 0, table, need_prompt_logits=True)])
    ref = reference(tiny.hf, ids)
    assert out.logits.shape == (1, VOCAB) and out.logits.dtype == torch.float32
    torch.testing.assert_close(out.prompt_logits[0], ref, **TOL)
    torch.testing.assert_close(out.logits[0], ref[-1], **TOL)


def test_chunked_prefill(tiny: Tiny) -> None:
    ids = tokens(41, seed=4)
    runner = make_runner(tiny)
    (table,) = shuffled_tables(96, [blocks_for(len(ids), 4)], seed=5)
    ref = reference(tiny.hf, ids)
    start = 0
    for size in (5, 11, 1, 3, 21):  # the 1-token chunk takes the decode path
        chunk = ids[start : start + size]
        out = runner.execute([SeqBatchInput(chunk, start, table, need_prompt_logits=True)])
        torch.testing.assert_close(out.prompt_logits[0], ref[start : start + size], **TOL)
        torch.testing.assert_close(out.logits[0], ref[start + size - 1], **TOL)
        start += size
    assert start == len(ids)


def test_prefill_then_decode(tiny: Tiny) -> None:
    ids = tokens(30, seed=6)
    prompt = 19
    runner = make_runner(tiny)
    (table,) = shuffled_tables(96, [blocks_for(len(ids), 4)], seed=7)
    ref = reference(tiny.hf, ids)
    out = runner.execute([SeqBatchInput(ids[:prompt], 0, table)])
    torch.testing.assert_close(out.logits[0], ref[prompt - 1], **TOL)
    for pos in range(prompt, len(ids)):
        out = runner.execute([SeqBatchInput([ids[pos]], pos, table)])
        torch.testing.assert_close(out.logits[0], ref[pos], **TOL)


def test_batch_equals_alone(tiny: Tiny) -> None:
    """Two sequences of different lengths in one batch give what each gives alone."""
    seq_a, seq_b = tokens(29, seed=8), tokens(14, seed=9)
    prompt_a, prompt_b = 23, 9
    table_a, table_b = shuffled_tables(96, [8, 4], seed=10)

    def run(pairs: list[tuple[list[int], list[int], int]]) -> list[list[torch.Tensor]]:
        runner = make_runner(tiny)
        outs = runner.execute([SeqBatchInput(s[:p], 0, t) for s, t, p in pairs])
        logits = [[outs.logits[i]] for i in range(len(pairs))]
        for step in range(5):
            outs = runner.execute([SeqBatchInput([s[p + step]], p + step, t) for s, t, p in pairs])
            for i in range(len(pairs)):
                logits[i].append(outs.logits[i])
        return logits

    together = run([(seq_a, table_a, prompt_a), (seq_b, table_b, prompt_b)])
    alone_a = run([(seq_a, table_a, prompt_a)])[0]
    alone_b = run([(seq_b, table_b, prompt_b)])[0]
    for got, want in zip(together[0], alone_a, strict=True):
        torch.testing.assert_close(got, want, **TOL)
    for got, want in zip(together[1], alone_b, strict=True):
        torch.testing.assert_close(got, want, **TOL)
    ref_a, ref_b = reference(tiny.hf, seq_a), reference(tiny.hf, seq_b)
    torch.testing.assert_close(torch.stack(together[0]), ref_a[prompt_a - 1 : prompt_a + 5], **TOL)
    torch.testing.assert_close(torch.stack(together[1]), ref_b[prompt_b - 1 : prompt_b + 5], **TOL)


def test_mixed_step(tiny: Tiny) -> None:
    """Decodes, a continued prefill and a fresh prefill in one step."""
    seq_a, seq_b, seq_c, seq_d = (tokens(n, seed=20 + n) for n in (18, 25, 12, 7))
    table_a, table_b, table_c, table_d = shuffled_tables(96, [5, 7, 3, 2], seed=11)
    runner = make_runner(tiny)
    runner.execute(
        [
            SeqBatchInput(seq_a[:17], 0, table_a),
            SeqBatchInput(seq_b[:10], 0, table_b),
            SeqBatchInput(seq_d[:6], 0, table_d),
        ]
    )
    out = runner.execute(
        [
            SeqBatchInput(seq_a[17:], 17, table_a),
            SeqBatchInput(seq_b[10:], 10, table_b, need_prompt_logits=True),
            SeqBatchInput(seq_c, 0, table_c, need_prompt_logits=True),
            SeqBatchInput(seq_d[6:], 6, table_d),
        ]
    )
    ref = [reference(tiny.hf, s) for s in (seq_a, seq_b, seq_c, seq_d)]
    torch.testing.assert_close(out.logits, torch.stack([r[-1] for r in ref]), **TOL)
    torch.testing.assert_close(out.prompt_logits[1], ref[1][10:], **TOL)
    torch.testing.assert_close(out.prompt_logits[2], ref[2], **TOL)
    assert out.prompt_logits[0] is None and out.prompt_logits[3] is None


def test_shared_blocks_written_and_read_in_one_step(tiny: Tiny) -> None:
    """B reuses A's first two blocks while A computes them in the same step."""
    block_size = 4
    prefix = tokens(8, seed=12)
    seq_a = prefix + tokens(6, seed=13)
    seq_b = prefix + tokens(9, seed=14)
    shared, own_a, own_b = shuffled_tables(96, [2, 2, 3], seed=15)
    runner = make_runner(tiny, block_size=block_size)
    out = runner.execute(
        [
            SeqBatchInput(seq_a, 0, shared + own_a),
            SeqBatchInput(seq_b[8:], 8, shared + own_b, need_prompt_logits=True),
        ]
    )
    ref_a, ref_b = reference(tiny.hf, seq_a), reference(tiny.hf, seq_b)
    torch.testing.assert_close(out.logits[0], ref_a[-1], **TOL)
    torch.testing.assert_close(out.prompt_logits[1], ref_b[8:], **TOL)
    nxt = 7
    out = runner.execute(
        [
            SeqBatchInput([nxt], len(seq_a), shared + own_a),
            SeqBatchInput([nxt], len(seq_b), shared + own_b),
        ]
    )
    torch.testing.assert_close(out.logits[0], reference(tiny.hf, [*seq_a, nxt])[-1], **TOL)
    torch.testing.assert_close(out.logits[1], reference(tiny.hf, [*seq_b, nxt])[-1], **TOL)


def test_bfloat16_close_to_float32(tiny: Tiny) -> None:
    _, model_bf16 = load_model(str(tiny.path), torch.bfloat16)
    runner = ModelRunner(tiny.config, model_bf16, 16, 4, torch.bfloat16, "cpu")
    ids = tokens(20, seed=16)
    out = runner.execute([SeqBatchInput(ids, 0, list(range(5)))])
    ref = reference(tiny.hf, ids)[-1]
    assert out.logits.dtype == torch.float32
    assert (out.logits[0] - ref).abs().max() < 0.05 * ref.abs().max()


def test_invalid_inputs(tiny: Tiny) -> None:
    runner = make_runner(tiny, block_size=4, num_blocks=8)
    with pytest.raises(ValueError, match="at least one"):
        runner.execute([SeqBatchInput([], 0, [0])])
    with pytest.raises(ValueError, match="does not cover"):
        runner.execute([SeqBatchInput(tokens(9, seed=0), 0, [0, 1])])
    with pytest.raises(ValueError, match="out of range"):
        runner.execute([SeqBatchInput([1, 2], 0, [8])])
