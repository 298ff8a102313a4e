"""Loading GGUF files and configs: tiny GGUF files written here vs HF transformers.

The GGUF files are written the way llama.cpp's converter writes them: Q and K rows of the
``llama`` architecture permuted for llama.cpp's rope, Qwen2/Qwen3 left as they are, an
embedding quantised to Q8_0, and Llama 3 rope scaling stored as a ``rope_freqs`` tensor.
Logits must match HF (float32, ``atol = rtol = 1e-4``) once HF gets the same dequantised
embedding.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from prefixserve.model.config import ModelConfig, kv_cache_bytes_per_token
from prefixserve.model.loader import load_model
from prefixserve.model.runner import ModelRunner, SeqBatchInput

TOL = {"atol": 1e-4, "rtol": 1e-4}
COMMON = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
HF_CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON, num_key_value_heads=2, rope_parameters=LLAMA3_ROPE),
    "qwen2": lambda: Qwen2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**COMMON, num_key_value_heads=1, head_dim=24),
}
HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The row order llama.cpp's converter gives Q/K of llama models (interleaved halves)."""
    head_dim = weight.shape[0] // num_heads
    split = weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{HF_TO_GGUF[module]}.{kind}"


def build(arch: str, seed: int) -> PreTrainedModel:
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(HF_CONFIGS[arch](), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.2 * noise if "norm" in name else 0.15 * noise)
    return hf.eval()


def write_gguf(hf: PreTrainedModel, arch: str, path: Path, extra_tensor: bool = False) -> None:
    """Write ``hf`` as llama.cpp would; the embedding goes through Q8_0 (HF gets it back)."""
    cfg = hf.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_eos_token_id(2)
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, value in state.items():
        if arch == "llama" and ".q_proj." in name:
            value = llama_cpp_permute(value, heads)
        elif arch == "llama" and ".k_proj." in name:
            value = llama_cpp_permute(value, kv_heads)
        if name == "model.embed_tokens.weight":
            packed = quantize(value, GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name(name), packed, raw_dtype=GGMLQuantizationType.Q8_0)
            with torch.no_grad():
                restored = dequantize(packed, GGMLQuantizationType.Q8_0)
                hf.get_input_embeddings().weight.copy_(torch.from_numpy(restored))
        else:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(value))
    if arch == "llama":
        rotary = hf.model.rotary_emb
        plain = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        writer.add_tensor("rope_freqs.weight", (plain / rotary.inv_freq.float()).numpy())
    if extra_tensor:
        writer.add_tensor("blk.0.mystery.weight", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


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
