"""The engine releases the blocks that slid out of a window right after the step that pushed
them out (the core's rule: ``tests/core/test_core_window_release.py``), on a tiny random-weight
Mistral model with a window."""

from __future__ import annotations

from pathlib import Path

from prefixserve.sampling_params import SamplingParams


def test_engine_releases_window_blocks_right_after_prefill(tmp_path: Path) -> None:
    """A tiny Mistral (window 16 in every layer) at block size 8: right after the step that
    prefilled 40 tokens only the blocks the next token's window reads are held (it reads
    positions 25..40: blocks 3 and 4 now, 5 once allocated), not all five. Kills: the engine
    not calling the release after a step."""
    import torch
    from transformers import AutoModelForCausalLM, MistralConfig

    from prefixserve.engine.config import EngineConfig
    from prefixserve.engine.llm_engine import LLMEngine
    from prefixserve.model.text.tokenizer import load_tokenizer

    backend = load_tokenizer(None).backend
    backend.save(str(tmp_path / "tokenizer.json"))
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=backend.get_vocab_size(), hidden_size=32,
                           intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, max_position_embeddings=256,
                           sliding_window=16, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), num_blocks=64, block_size=8,
                                    dtype="float32", max_model_len=128))
    prompt = [100 + 7 * i for i in range(40)]
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.step()
    assert engine.get_stats().num_free_blocks == 63 - 2
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats().num_free_blocks == 63
