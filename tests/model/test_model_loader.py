"""Loading GGUF files and configs: tiny GGUF files written here vs HF transformers.

The GGUF files are written the way llama.cpp's converter writes them: Q and K rows of the
``llama`` architecture permuted for llama.cpp's rope, Qwen2/Qwen3 left as they are, an
embedding quantised to Q8_0, and Llama 3 rope scaling stored as a ``rope_freqs`` tensor.
Logits must match HF (float32, ``atol = rtol = 1e-4``) once HF gets the same dequantised
embedding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGUFWriter
from model_helpers import COMMON, HF_CONFIGS, build, write_gguf
from transformers import (
    Qwen2Config,
)

from prefixserve.model.arch.config import ModelConfig, kv_cache_bytes_per_token
from prefixserve.model.runner import ModelRunner, SeqBatchInput
from prefixserve.model.weights.loader import load_model

TOL = {"atol": 1e-4, "rtol": 1e-4}
@pytest.mark.parametrize("arch", sorted(HF_CONFIGS))
def test_gguf_matches_hf(arch: str, tmp_path: Path) -> None:
    hf = build(arch, seed=3)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(hf, arch, path)
    config, model = load_model(str(path), torch.float32)
    assert config.architecture == arch
    assert config.tie_word_embeddings == (arch == "qwen2")
    assert config.attention_bias == (arch == "qwen2")
    assert config.qk_norm == (arch == "qwen3")
    ids = [int(i) for i in torch.randint(0, 128, (70,), generator=torch.Generator().manual_seed(4))]
    runner = ModelRunner(config, model, 24, 4, torch.float32, "cpu")
    out = runner.execute([SeqBatchInput(ids, 0, list(range(18)), need_prompt_logits=True)])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(out.prompt_logits[0], ref, **TOL)


def test_gguf_unexpected_tensor_is_an_error(tmp_path: Path) -> None:
    hf = build("qwen2", seed=5)
    path = tmp_path / "extra.gguf"
    write_gguf(hf, "qwen2", path, extra_tensor=True)
    with pytest.raises(ValueError, match="unexpected tensors"):
        load_model(str(path), torch.float32)


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "falcon.gguf"
    writer = GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'falcon'"):
        load_model(str(path), torch.float32)


def test_hf_unsupported_architecture() -> None:
    with pytest.raises(ValueError, match="'gemma2'"):
        ModelConfig.from_hf_config({"model_type": "gemma2"})


def test_hf_sliding_window_per_layer() -> None:
    """Qwen2 slides from ``max_window_layers`` on (issue 12 replaced the old refusal)."""
    cfg = Qwen2Config(
        **COMMON, num_key_value_heads=2, use_sliding_window=True, sliding_window=64,
        max_window_layers=1,
    ).to_dict()
    config = ModelConfig.from_hf_config(cfg)
    assert config.layer_windows == (None, 64)


def test_hf_config_v4_spelling() -> None:
    """transformers-4 configs spell rope as ``rope_theta`` + ``rope_scaling``."""
    cfg = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0},
        "eos_token_id": [5, 6],
    }
    config = ModelConfig.from_hf_config(cfg, {"eos_token_id": [6, 7]})
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}
    assert config.eos_token_ids == (5, 6, 7)
    assert config.head_dim == 4


def test_kv_cache_sizing() -> None:
    config = ModelConfig(
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
    )
    per_token = 2 * 30 * 3 * 64
    assert kv_cache_bytes_per_token(config, torch.float32) == per_token * 4
    assert kv_cache_bytes_per_token(config, torch.bfloat16) == per_token * 2
    budget = 10 * 16 * per_token * 2 + 5
    assert ModelRunner.num_blocks_for_memory(config, torch.bfloat16, 16, budget) == 10
