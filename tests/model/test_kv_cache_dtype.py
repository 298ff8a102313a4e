"""A KV cache in another dtype than the activations (``--kv-cache-dtype``): float16 beside the
default model's float32 activations holds twice the blocks in the same memory, the fused and
the eager decode paths read it, caching still changes no result, and the settings that cannot
take it say so."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_helpers import prompts

from prefixserve import LLM, SamplingParams
from prefixserve.cli import build_parser
from prefixserve.engine.config import EngineConfig
from prefixserve.engine.tier_manager import model_identity
from prefixserve.model.arch.config import ModelConfig, default_model_path
from prefixserve.model.arch.llama import CausalLM
from prefixserve.model.runner import ModelRunner, SeqBatchInput
from prefixserve.server.launch import engine_config

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
MEMORY = "32MiB"


@pytest.fixture(scope="module")
def engines() -> dict[str, LLM]:
    """float32 activations with a float32 cache, and with a float16 one, with and without
    prefix caching; all in the same cache memory."""
    return {
        "float32": LLM(dtype="float32", kv_cache_memory=MEMORY),
        "float16": LLM(dtype="float32", kv_cache_dtype="float16", kv_cache_memory=MEMORY),
        "float16-uncached": LLM(dtype="float32", kv_cache_dtype="float16",
                                kv_cache_memory=MEMORY, enable_prefix_caching=False),
    }


def test_a_float16_cache_holds_twice_the_blocks_in_the_same_memory(
        engines: dict[str, LLM]) -> None:
    full, half = engines["float32"].engine, engines["float16"].engine
    assert half.runner.kv_cache.dtype == torch.float16
    assert full.runner.kv_cache.dtype == torch.float32
    assert 2 * full.num_kv_blocks <= half.num_kv_blocks <= 2 * full.num_kv_blocks + 1
    per_block = [e.runner.kv_cache.nbytes // e.num_kv_blocks for e in (full, half)]
    assert per_block[0] == 2 * per_block[1]
    assert half.runner.kv_cache.nbytes <= 32 << 20


def test_greedy_tokens_follow_the_float32_cache(engines: dict[str, LLM]) -> None:
    """Rounding K/V to float16 (11 bits of mantissa) moves the logits by ~1e-3 of their size,
    which may flip a near tie: at least 90% of the greedy tokens agree (all of them when this
    was written); a cache read as the wrong type, or a wrong row, agrees on almost none."""
    ps = prompts(engines["float32"])
    want = [o.outputs[0].token_ids for o in engines["float32"].generate(ps, GREEDY)]
    got = [o.outputs[0].token_ids for o in engines["float16"].generate(ps, GREEDY)]
    same = sum(a == b for x, y in zip(want, got, strict=True) for a, b in zip(x, y, strict=True))
    assert same >= 0.9 * sum(len(x) for x in want)
    assert engines["float16"].engine.runner.fused_decode_reason is None  # decode ran fused


def test_a_hit_equals_a_miss_with_a_float16_cache(engines: dict[str, LLM]) -> None:
    ps = prompts(engines["float16"])
    cached, uncached = engines["float16"], engines["float16-uncached"]
    cached.generate(ps[:1], GREEDY)  # the system prompt's blocks are now cached
    hits = cached.generate(ps[1:], GREEDY)
    misses = uncached.generate(ps[1:], GREEDY)
    assert all(o.num_cached_tokens > 0 for o in hits)
    assert [o.outputs[0].token_ids for o in hits] == [o.outputs[0].token_ids for o in misses]


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_a_prompt_computed_whole_attends_to_its_kv_as_the_cache_holds_them(
        cache_dtype: torch.dtype) -> None:
    """The logits of a prompt computed in one step equal those of the same prompt computed in
    two, the second reading the first's K/V back from the cache (a prefix-cache hit): the step
    that computes K/V rounds them to the cache's dtype before attending to them. Dense float32
    weights, so that nothing else differs between the two (to ~1e-6); K/V used unrounded
    differ by ~1e-3."""
    config = ModelConfig("llama", vocab_size=96, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = CausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    prompt = [int(t) for t in torch.randint(0, 96, (40,))]
    table = [0, 1, 2]

    def last_logits(split: int | None) -> torch.Tensor:
        runner = ModelRunner(config, model, 4, 16, torch.float32, "cpu",
                             kv_cache_dtype=cache_dtype)
        if split is not None:
            runner.execute([SeqBatchInput(prompt[:split], 0, table)])
            return runner.execute([SeqBatchInput(prompt[split:], split, table)]).logits
        return runner.execute([SeqBatchInput(prompt, 0, table)]).logits

    whole, hit = last_logits(None), last_logits(32)
    torch.testing.assert_close(whole, hit, rtol=0, atol=1e-5 * float(whole.abs().max()))


def test_settings_that_cannot_take_it_say_so() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, float32, bfloat16 or "
                       "float16, got 'int8'"):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="the deterministic mode needs the KV cache in the "
                       "activations' dtype"):
        LLM(dtype="float32", kv_cache_dtype="bfloat16", deterministic=True, num_blocks=8)


def test_engines_with_another_cache_dtype_use_another_tier_namespace(
        engines: dict[str, LLM], tmp_path) -> None:
    """Blocks a float16 cache wrote to a disk or Redis tier are never loaded into a float32
    cache of the same model: the engine puts its cache dtype into the tiers' key namespace."""
    namespaces = set()
    for name in ("float32", "float16"):
        engine = engines[name].engine
        with_tier = dataclasses.replace(engine.config, kv_disk_dir=str(tmp_path))
        namespaces.add(engine._tier_namespace(with_tier))
    assert None not in namespaces and len(namespaces) == 2


def test_the_flag_reaches_the_engine_config_and_the_identity_names_the_cache_dtype() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--kv-cache-dtype", "float16"])
    assert engine_config(args).kv_cache_dtype == "float16"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--kv-cache-dtype", "fp8"])
    path, shape = str(default_model_path()), (30, 2, 64, 3, 64)
    same = model_identity(path, torch.float32, "auto", 16, shape, "sha256")
    assert same == model_identity(path, torch.float32, "auto", 16, shape, "sha256",
                                  torch.float32)
    assert same != model_identity(path, torch.float32, "auto", 16, shape, "sha256",
                                  torch.float16)
