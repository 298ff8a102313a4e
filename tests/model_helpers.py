"""Models the model tests build: tiny random-weight configs and models, dense or with packed
projections, and GGUF files written as llama.cpp's converter writes them (from a random HF
transformers model)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
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

from prefixserve.model.arch.config import ModelConfig
from prefixserve.model.arch.llama import CausalLM
from prefixserve.model.weights.quant import FMT_Q4_1, QuantLinear, pack_float


def tiny_config(heads: int = 4, kv_heads: int = 2, bias: bool = False, head_dim: int = 16
                ) -> ModelConfig:
    """Head sizes 64 and 128 take the kernel's vector paths, others its scalar ones."""
    return ModelConfig("llama", vocab_size=96, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=2, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim, attention_bias=bias,
                       max_position_embeddings=1024, rms_norm_eps=1e-6)


def dense_model(config: ModelConfig, seed: int = 0) -> CausalLM:
    """A random-weight model with dense projections (what a safetensors model loads as)."""
    torch.manual_seed(seed)
    model = CausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name
                    else 0.15 * torch.randn_like(p))
    return model.eval()


def packed_model(config: ModelConfig, fmt: int = FMT_Q4_1, seed: int = 0) -> CausalLM:
    """A random-weight model whose four projections per layer are packed in ``fmt``."""
    return pack_projections(dense_model(config, seed), fmt)


def pack_projections(model: CausalLM, fmt: int) -> CausalLM:
    """``model`` with the four projections of each layer packed in ``fmt`` (in place)."""
    with torch.no_grad():
        for layer in model.layers:
            for owner, attr in ((layer.attn, "qkv_proj"), (layer.attn, "o_proj"),
                                (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
                dense = getattr(owner, attr)
                packed = QuantLinear(pack_float(dense.weight.numpy(), fmt),
                                     bias=dense.bias is not None)
                if dense.bias is not None:
                    packed.bias.copy_(dense.bias)
                setattr(owner, attr, packed)
    return model.eval()


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
