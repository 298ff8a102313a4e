"""PEFT-format LoRA adapters for the default model, written with safetensors (random low-rank
weights), for the engine and server tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from prefixserve.model.arch.config import ModelConfig
from prefixserve.model.arch.lora import part_shapes
from prefixserve.model.weights.gguf_file import GGUFFile
from prefixserve.model.weights.loader import default_model_path

PEFT_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                "down": "mlp.down_proj"}


def default_config() -> ModelConfig:
    """The default model's configuration, read from its GGUF file (the base of the adapters)."""
    gguf = GGUFFile(default_model_path())
    return ModelConfig.from_gguf_metadata(gguf.metadata, set(gguf.tensors))


def write_peft_adapter(path: Path, config: ModelConfig, seed: int, rank: int = 4,
                       alpha: float = 8.0, std: float = 0.05,
                       parts: tuple[str, ...] = tuple(PEFT_MODULES)) -> Path:
    """A PEFT adapter directory for the base model of ``config``: every layer's ``parts``
    with ``A``, ``B`` ~ N(0, ``std``)."""
    path.mkdir(parents=True, exist_ok=True)
    shapes = part_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for part in parts:
            out, inp = shapes[part]
            key = f"base_model.model.model.layers.{layer}.{PEFT_MODULES[part]}"
            tensors[f"{key}.lora_A.weight"] = std * torch.randn(rank, inp, generator=gen)
            tensors[f"{key}.lora_B.weight"] = std * torch.randn(out, rank, generator=gen)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none",
        "target_modules": [PEFT_MODULES[p].split(".")[1] for p in parts]}))
    return path
