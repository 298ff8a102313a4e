"""Load a model (config + weights) from a GGUF file or an HF safetensors directory.

GGUF tensors are dequantised to float32 with ``gguf.quants.dequantize`` and then cast to the
requested dtype. llama.cpp's converter reorders the rows of the Q and K projections of
``llama``-architecture models (it interleaves the two rotary halves of each head for its rope
kernel); :func:`_unpermute_rows` undoes that so the model can use HF's "rotate half" rope.
Qwen2/Qwen3 GGUF files are not permuted.

Q/K/V and gate/up weights are fused at load (see :mod:`prefixserve.model.llama`).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from contextlib import ExitStack

import torch

from prefixserve.model.config import ModelConfig, default_model_path, resolve_model_path
from prefixserve.model.gguf_file import GGUFFile
from prefixserve.model.llama import CausalLM

__all__ = ["default_model_path", "load_model"]

TensorSource = Callable[[str], torch.Tensor]


def load_model(
    model: str | None, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> tuple[ModelConfig, CausalLM]:
    """Load ``model`` (a ``.gguf`` path, an HF directory, or None for the default model).

    Returns the config and a :class:`CausalLM` in eval mode with weights in ``dtype`` on
    ``device``. Raises ValueError for an unsupported architecture or a weight set that does not
    match the config (missing or unexpected tensors).
    """
    path = resolve_model_path(model)
    device = torch.device(device)
    if path.endswith(".gguf"):
        config, state, freq_factors = _gguf_state(path, dtype, device)
    else:
        config, state = _hf_state(path, dtype, device)
        freq_factors = None
    with torch.device("meta"):
        net = CausalLM(config)
    net.load_state_dict(state, strict=True, assign=True)
    net.to(device)
    if freq_factors is not None:
        net.set_rope_freq_factors(freq_factors)
    net.requires_grad_(False)
    net.eval()
    return config, net


def _unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation.

    Within each head, HF row ``half * head_dim / 2 + j`` was stored at row ``2 * j + half``.
    """
    head_dim = weight.shape[0] // num_heads
    split = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return split.transpose(1, 2).reshape(weight.shape)


def _assemble(
    config: ModelConfig, get: TensorSource, names: dict[str, str], unpermute: bool
) -> dict[str, torch.Tensor]:
    """Our state dict from a source of tensors, given the source's naming of each part.

    ``names`` maps part keys (``embed``, ``norm``, ``lm_head``, and per-layer ``q``, ``k``,
    ``v``, ``o``, ``q_bias``, ``k_bias``, ``v_bias``, ``o_bias``, ``q_norm``, ``k_norm``,
    ``input_norm``, ``post_norm``, ``gate``, ``up``, ``down`` with ``{i}`` for the layer, plus
    ``gate_bias``, ``up_bias``, ``down_bias``) to source tensor names.
    """
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    state = {"embed_tokens.weight": get(names["embed"]), "norm.weight": get(names["norm"])}
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = get(names["lm_head"])
    for i in range(config.num_hidden_layers):

        def part(key: str, layer: int = i) -> torch.Tensor:
            return get(names[key].format(i=layer))

        def qkv(suffix: str) -> torch.Tensor:
            q, k, v = part("q" + suffix), part("k" + suffix), part("v" + suffix)
            if unpermute:
                q, k = _unpermute_rows(q, heads), _unpermute_rows(k, kv_heads)
            return torch.cat((q, k, v))

        prefix = f"layers.{i}."
        state[prefix + "input_norm.weight"] = part("input_norm")
        state[prefix + "post_attn_norm.weight"] = part("post_norm")
        state[prefix + "attn.qkv_proj.weight"] = qkv("")
        state[prefix + "attn.o_proj.weight"] = part("o")
        state[prefix + "mlp.gate_up_proj.weight"] = torch.cat((part("gate"), part("up")))
        state[prefix + "mlp.down_proj.weight"] = part("down")
        if config.attention_bias:
            state[prefix + "attn.qkv_proj.bias"] = qkv("_bias")
        if config.attention_out_bias:
            state[prefix + "attn.o_proj.bias"] = part("o_bias")
        if config.mlp_bias:
            state[prefix + "mlp.gate_up_proj.bias"] = torch.cat(
                (part("gate_bias"), part("up_bias"))
            )
            state[prefix + "mlp.down_proj.bias"] = part("down_bias")
        if config.qk_norm:
            state[prefix + "attn.q_norm.weight"] = part("q_norm")
            state[prefix + "attn.k_norm.weight"] = part("k_norm")
    return state


_GGUF_NAMES = {
    "embed": "token_embd.weight",
    "norm": "output_norm.weight",
    "lm_head": "output.weight",
    "q": "blk.{i}.attn_q.weight",
    "k": "blk.{i}.attn_k.weight",
    "v": "blk.{i}.attn_v.weight",
    "o": "blk.{i}.attn_output.weight",
    "q_bias": "blk.{i}.attn_q.bias",
    "k_bias": "blk.{i}.attn_k.bias",
    "v_bias": "blk.{i}.attn_v.bias",
    "o_bias": "blk.{i}.attn_output.bias",
    "q_norm": "blk.{i}.attn_q_norm.weight",
    "k_norm": "blk.{i}.attn_k_norm.weight",
    "input_norm": "blk.{i}.attn_norm.weight",
    "post_norm": "blk.{i}.ffn_norm.weight",
    "gate": "blk.{i}.ffn_gate.weight",
    "up": "blk.{i}.ffn_up.weight",
    "down": "blk.{i}.ffn_down.weight",
    "gate_bias": "blk.{i}.ffn_gate.bias",
    "up_bias": "blk.{i}.ffn_up.bias",
    "down_bias": "blk.{i}.ffn_down.bias",
}

_HF_NAMES = {
    "embed": "model.embed_tokens.weight",
    "norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "q": "model.layers.{i}.self_attn.q_proj.weight",
    "k": "model.layers.{i}.self_attn.k_proj.weight",
    "v": "model.layers.{i}.self_attn.v_proj.weight",
    "o": "model.layers.{i}.self_attn.o_proj.weight",
    "q_bias": "model.layers.{i}.self_attn.q_proj.bias",
    "k_bias": "model.layers.{i}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{i}.self_attn.v_proj.bias",
    "o_bias": "model.layers.{i}.self_attn.o_proj.bias",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    "input_norm": "model.layers.{i}.input_layernorm.weight",
    "post_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight",
    "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
    "gate_bias": "model.layers.{i}.mlp.gate_proj.bias",
    "up_bias": "model.layers.{i}.mlp.up_proj.bias",
    "down_bias": "model.layers.{i}.mlp.down_proj.bias",
}


def _tracking_source(
    available: set[str],
    read: Callable[[str], torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[TensorSource, set[str]]:
    """A tensor getter that casts to ``dtype``/``device`` and records which names it served."""
    used: set[str] = set()

    def get(name: str) -> torch.Tensor:
        if name not in available:
            raise ValueError(f"weights lack tensor {name!r}")
        used.add(name)
        return read(name).to(device=device, dtype=dtype)

    return get, used


def _check_all_used(available: set[str], used: set[str], ignorable: set[str], path: str) -> None:
    unexpected = sorted(available - used - ignorable)
    if unexpected:
        shown = ", ".join(unexpected[:5])
        raise ValueError(f"{path}: {len(unexpected)} unexpected tensors, e.g. {shown}")


def _gguf_state(
    path: str, dtype: torch.dtype, device: torch.device
) -> tuple[ModelConfig, dict[str, torch.Tensor], torch.Tensor | None]:
    gguf = GGUFFile(path)
    available = set(gguf.tensors)
    config = ModelConfig.from_gguf_metadata(gguf.metadata, available)

    def read(name: str) -> torch.Tensor:
        return torch.from_numpy(gguf.read_tensor(name))

    get, used = _tracking_source(available, read, dtype, device)
    state = _assemble(config, get, _GGUF_NAMES, unpermute=config.architecture == "llama")
    freq_factors = read("rope_freqs.weight") if "rope_freqs.weight" in available else None
    _check_all_used(available, used, {"rope_freqs.weight"}, path)
    return config, state, freq_factors


def _hf_state(
    path: str, dtype: torch.dtype, device: torch.device
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    config = ModelConfig.from_hf_dir(path)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files")
    with ExitStack() as stack:
        owner = {}
        for file in files:
            handle = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
            owner.update(dict.fromkeys(handle.keys(), handle))

        def read(name: str) -> torch.Tensor:
            return owner[name].get_tensor(name)

        available = set(owner)
        get, used = _tracking_source(available, read, dtype, device)
        state = _assemble(config, get, _HF_NAMES, unpermute=False)
    ignorable = {name for name in available if name.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        ignorable.add("lm_head.weight")
    _check_all_used(available, used, ignorable, path)
    return config, state
