"""Sliding-window layers in the paged runner vs transformers, on tiny random-weight models.

Qwen2 with ``use_sliding_window`` (full layer 0, window layer 1: two KV cache groups), Mistral
(every layer slides: one window group) and a Gemma 3 HF directory (window layer 0, full layer
1), window 8 at block size 4, built here with transformers, saved with safetensors and loaded
with ``load_model``. Prompts are several windows long, run in
one step, in chunks and then decoded, with each group's blocks in its own shuffled table and
window blocks that slid out replaced by block 0, as the hybrid manager leaves them.
Float32, ``atol = rtol = 1e-4``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    PreTrainedModel,
    Qwen2Config,
)

from prefixserve.model.runner import ModelRunner, SeqBatchInput
from prefixserve.model.weights.loader import load_model

TOL = {"atol": 1e-4, "rtol": 1e-4}
WINDOW = 8
BS = 4
COMMON = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 256}
CONFIGS = {
    "qwen2": lambda: Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW,
                                 max_window_layers=1),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=WINDOW),
    # an HF Gemma 3 directory: norms stored as w of (1 + w), a query scale that is not
    # head_dim's, per-layer-type rope bases
    "gemma3": lambda: Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=WINDOW,
                                       query_pre_attn_scalar=24,
                                       layer_types=["sliding_attention", "full_attention"]),
}


class Tiny(NamedTuple):
    hf: PreTrainedModel
    runner: ModelRunner
    path: Path


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    torch.manual_seed(0)
    hf_config = CONFIGS[request.param]()
    hf_config._attn_implementation = "eager"
    hf = AutoModelForCausalLM.from_config(hf_config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            # embeddings of unit scale: with small ones attention barely mixes positions, and
            # a window off by one would go unseen
            scale = 1.0 if "embed" in name else 0.15
            param.copy_(1.0 + 0.2 * noise if "norm" in name else scale * noise)
    hf.eval()
    path: Path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    config, model = load_model(str(path), torch.float32)
    assert config.sliding_window == WINDOW
    return Tiny(hf, ModelRunner(config, model, 128, BS, torch.float32, "cpu"), path)


def tables(runner: ModelRunner, num_tokens: int, seed: int) -> list[list[int]]:
    """One shuffled table per group, block ids 1.. (block 0 stands for the null block)."""
    groups = len(runner.layout.groups)
    n = -(-num_tokens // BS)
    ids = list(range(1, 1 + groups * n))
    random.Random(seed).shuffle(ids)
    return [ids[g * n:(g + 1) * n] for g in range(groups)]


def null_out(runner: ModelRunner, group_tables: list[list[int]], next_pos: int
             ) -> list[list[int]]:
    """Window groups' blocks wholly before the window of ``next_pos`` become block 0."""
    out = []
    for group, table in zip(runner.layout.groups, group_tables, strict=True):
        if group.window is None:
            out.append(table)
            continue
        skipped = max(0, (next_pos - group.window + 1) // BS)
        out.append([0] * skipped + table[skipped:])
    return out


def step(runner: ModelRunner, ids: list[int], start: int, group_tables: list[list[int]],
         logits: bool = False) -> torch.Tensor:
    seq = SeqBatchInput(ids, start, group_tables[0], need_prompt_logits=logits,
                        extra_block_tables=tuple(group_tables[1:]))
    out = runner.execute([seq])
    return out.prompt_logits[0] if logits else out.logits[0]


def reference(hf: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_prompt_longer_than_window_in_one_step(tiny: Tiny) -> None:
    rng = random.Random(2)
    ids = [rng.randrange(128) for _ in range(37)]
    got = step(tiny.runner, ids, 0, tables(tiny.runner, 37, 3), logits=True)
    torch.testing.assert_close(got, reference(tiny.hf, ids), **TOL)


def test_chunks_then_decode_with_blocks_slid_out(tiny: Tiny) -> None:
    rng = random.Random(4)
    ids = [rng.randrange(128) for _ in range(45)]
    want = reference(tiny.hf, ids)
    base = tables(tiny.runner, 45, 5)
    pos = 0
    for chunk in (7, 13, 10):  # chunked prefill to 30 tokens
        got = step(tiny.runner, ids[pos:pos + chunk], pos, null_out(tiny.runner, base, pos),
                   logits=True)
        torch.testing.assert_close(got, want[pos:pos + chunk], **TOL)
        pos += chunk
    while pos < 45:  # decode the rest, one token at a time
        got = step(tiny.runner, ids[pos:pos + 1], pos, null_out(tiny.runner, base, pos))
        torch.testing.assert_close(got, want[pos], **TOL)
        pos += 1


def test_batch_of_decodes_and_a_prefill(tiny: Tiny) -> None:
    rng = random.Random(6)
    a = [rng.randrange(128) for _ in range(30)]
    b = [rng.randrange(128) for _ in range(21)]
    groups = len(tiny.runner.layout.groups)
    ta = tables(tiny.runner, 31, 7)
    tb = [[i + 64 for i in t] for t in tables(tiny.runner, 21, 8)]
    assert len(ta) == groups
    step(tiny.runner, a[:29], 0, ta)
    seqs = [SeqBatchInput(a[29:30], 29, null_out(tiny.runner, ta, 29)[0],
                          extra_block_tables=tuple(null_out(tiny.runner, ta, 29)[1:])),
            SeqBatchInput(b, 0, tb[0], extra_block_tables=tuple(tb[1:]))]
    out = tiny.runner.execute(seqs)
    torch.testing.assert_close(out.logits[0], reference(tiny.hf, a)[-1], **TOL)
    torch.testing.assert_close(out.logits[1], reference(tiny.hf, b)[-1], **TOL)


def test_the_deterministic_mode_attends_over_windows_the_same_in_every_split(tiny: Tiny
                                                                            ) -> None:
    """The deterministic mode on a sliding-window model: a prompt's logits in one step match
    transformers, and come out bit for bit the same computed in chunks with decode steps after
    them, and as a decode step beside another sequence's prefill (windows' blocks that slid
    out replaced by block 0). Kills: the mode refusing windows, or its window metadata or
    kernel ignoring the window (keys outside it, or block 0's keys, would enter the sum)."""
    config, model = load_model(str(tiny.path), torch.float32)
    runner = ModelRunner(config, model, 128, BS, torch.float32, "cpu", deterministic=True)
    rng = random.Random(9)
    ids = [rng.randrange(128) for _ in range(45)]
    base = tables(runner, 45, 10)
    whole = step(runner, ids, 0, base, logits=True)
    torch.testing.assert_close(whole, reference(tiny.hf, ids), **TOL)
    pos = 0
    for chunk in (7, 13, 10):
        got = step(runner, ids[pos:pos + chunk], pos, null_out(runner, base, pos), logits=True)
        assert torch.equal(got, whole[pos:pos + chunk]), pos
        pos += chunk
    while pos < 44:
        assert torch.equal(step(runner, ids[pos:pos + 1], pos, null_out(runner, base, pos)),
                           whole[pos]), pos
        pos += 1
    other = [rng.randrange(128) for _ in range(21)]
    tb = [[i + 64 for i in t] for t in tables(runner, 21, 11)]
    nulled = null_out(runner, base, 44)
    out = runner.execute([SeqBatchInput(ids[44:], 44, nulled[0],
                                        extra_block_tables=tuple(nulled[1:])),
                          SeqBatchInput(other, 0, tb[0], extra_block_tables=tuple(tb[1:]))])
    assert torch.equal(out.logits[0], whole[44])


def test_drafts_on_windows_change_no_token_in_the_deterministic_mode(tiny: Tiny) -> None:
    """n-gram speculation in the deterministic mode on a sliding-window model, through the
    engine (8-token windows at 8-token blocks; the default model's tokenizer beside the tiny
    model, whose ids it covers). Prompts several windows long, some repeating a prompt after
    its own output (drafts from the first time, which the second context may or may not
    follow), 40 greedy tokens each: the tokens of the same mode without drafts, drafts kept
    (and rejected too, except for the model whose output settles into one repeated token),
    every block back in the pool when idle. A draft row verified over the wrong
    window would change a token, since the mode's logits depend on nothing but the sequence."""
    from prefixserve import LLM, SamplingParams
    from prefixserve.model.text.tokenizer import load_tokenizer

    if not (tiny.path / "tokenizer.json").exists():
        load_tokenizer(None).backend.save(str(tiny.path / "tokenizer.json"))
    rng = random.Random(4)
    motif = [5, 17, 99, 42, 8, 63]
    base = [motif * 8, [rng.randrange(128) for _ in range(30)],
            [rng.choice(motif) for _ in range(50)]]  # few distinct tokens: n-grams recur
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    settings = dict(model=str(tiny.path), dtype="float32", deterministic=True, block_size=8,
                    num_blocks=256)
    plain, spec = LLM(**settings), LLM(num_speculative_tokens=3, **settings)
    first = [o.outputs[0].token_ids for o in plain.generate(base, params)]
    prompts = base + [p + out + p for p, out in zip(base, first, strict=True)]
    idle = spec.engine.get_stats().num_free_blocks
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert got == want
    stats = spec.engine.get_stats()
    assert stats.num_free_blocks == idle
    assert 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens, stats
