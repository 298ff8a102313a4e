"""A random-weight model with the shape and tokenizer of an installed one, as an HF directory.

For a machine that lacks the model packages and cannot install them (the GPU machine of
``benchmarks/gpu_check.py``, which reaches no registry): speed, the CUDA code path and caching
do not depend on the weights' values. Two steps, since the tokenizer comes from a model file
that is installed here and the weights are made where they are used::

    # here: config.json, tokenizer.json, tokenizer_config.json (a few MB)
    .venv/bin/python benchmarks/random_model.py OUT --skip-weights
    .venv/bin/python benchmarks/random_model.py OUT-gemma --gemma3-tiny --skip-weights
    # there: model.safetensors from a seeded generator (transformers' own initialisation)
    python benchmarks/random_model.py OUT --weights-only

``--gemma3-tiny`` writes a 6-layer Gemma 3 shape (5 sliding-window layers of 32 tokens, one
full) with the default model's tokenizer, to run the sliding-window path. ``--vlm`` writes a
LLaVA model (transformers' ``LlavaForConditionalGeneration`` layout) that takes images: the
decoder of ``--like``, a CLIP ViT-B/16 vision tower at 224x224 (86M parameters, 196 image
tokens per picture), the projector, the tokenizer with an ``<image>`` token added and a CLIP
``preprocessor_config.json``; serve it with ``prefixserve serve OUT``. ``--init-std`` scales
the random weights (larger: more peaked next-token distributions, so greedy outputs rarely sit
on near-ties).

    .venv/bin/python benchmarks/random_model.py /tmp/vlm --vlm   # ~1.4 GB of float32 weights
    .venv/bin/prefixserve serve /tmp/vlm
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from tokenizers import AddedToken

from prefixserve.model.arch.config import ModelConfig, resolve_model_path
from prefixserve.model.text.tokenizer import load_tokenizer
from prefixserve.model.weights.gguf_file import GGUFFile


def load_model_config(model: str | None) -> ModelConfig:
    """The config of ``model`` (a GGUF file, an HF directory, or None: the default model)."""
    path = resolve_model_path(model)
    if not path.endswith(".gguf"):
        return ModelConfig.from_hf_dir(path)
    gguf = GGUFFile(path)
    return ModelConfig.from_gguf_metadata(gguf.metadata, set(gguf.tensors))


def llama_config(config: ModelConfig) -> dict[str, Any]:
    """An HF ``config.json`` (Llama) of ``config``'s shape."""
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
        "rope_theta": config.rope_theta, "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings, "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids),
    }


def gemma3_tiny_config(vocab_size: int, eos: list[int]) -> dict[str, Any]:
    """An HF ``config.json`` of a small Gemma 3 text model: 5 sliding layers, then 1 full."""
    return {
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": vocab_size, "hidden_size": 256, "intermediate_size": 768,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 64, "sliding_window": 32, "query_pre_attn_scalar": 64,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 4096,
        "tie_word_embeddings": True, "eos_token_id": eos,
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
    }


IMAGE_TOKEN = "<image>"

# CLIP ViT-B/16 at 224x224 (openai/clip-vit-base-patch16's vision tower): 86M parameters.
VIT_B16 = {
    "model_type": "clip_vision_model", "hidden_size": 768, "intermediate_size": 3072,
    "num_hidden_layers": 12, "num_attention_heads": 12, "image_size": 224, "patch_size": 16,
    "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5, "num_channels": 3,
}

# What transformers' CLIP image processor does for that tower.
CLIP_PREPROCESSOR = {
    "image_processor_type": "CLIPImageProcessor", "do_resize": True,
    "size": {"shortest_edge": 224}, "resample": 3, "do_center_crop": True,
    "crop_size": {"height": 224, "width": 224}, "do_rescale": True,
    "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def llava_config(text: dict[str, Any], image_token_id: int) -> dict[str, Any]:
    """An HF ``config.json`` of a LLaVA model around the decoder config ``text``."""
    return {
        "model_type": "llava", "architectures": ["LlavaForConditionalGeneration"],
        "text_config": text, "vision_config": VIT_B16, "image_token_index": image_token_id,
        "projector_hidden_act": "gelu", "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default", "multimodal_projector_bias": True,
        "tie_word_embeddings": text["tie_word_embeddings"],
    }


def write_skeleton(out: str, source: str | None, gemma3_tiny: bool, vlm: bool = False) -> None:
    """config.json and the tokenizer's files of ``source`` (None: the default model); with
    ``vlm``, a LLaVA config around that decoder, the ``<image>`` token and the image
    processor's config."""
    os.makedirs(out, exist_ok=True)
    tok = load_tokenizer(source)
    if vlm:
        tok.backend.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    tok.backend.save(os.path.join(out, "tokenizer.json"))
    tok_cfg = {"chat_template": tok.chat_template, "bos_token": tok.bos_token,
               "eos_token": tok.eos_token}
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tok_cfg, f)
    if gemma3_tiny:
        cfg = gemma3_tiny_config(tok.vocab_size, list(tok.eos_token_ids))
    else:
        cfg = llama_config(load_model_config(source))
    if vlm:
        image_token_id = tok.backend.token_to_id(IMAGE_TOKEN)
        cfg["vocab_size"] = max(cfg["vocab_size"], image_token_id + 1)
        cfg = llava_config(cfg, image_token_id)
        with open(os.path.join(out, "preprocessor_config.json"), "w", encoding="utf-8") as f:
            json.dump(CLIP_PREPROCESSOR, f, indent=1)
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=1)


def write_weights(out: str, seed: int, init_std: float) -> None:
    """model.safetensors for ``out``'s config.json: transformers' initialisation, seeded."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlavaForConditionalGeneration

    config = AutoConfig.from_pretrained(out)
    config.initializer_range = init_std
    torch.manual_seed(seed)
    if config.model_type == "llava":
        config.text_config.initializer_range = config.vision_config.initializer_range = init_std
        model = LlavaForConditionalGeneration(config).to(torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random norm weights around their identity, as trained ones are
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.normal_(0.0 if config.model_type.startswith("gemma") else 1.0, 0.1)
    model.save_pretrained(out)
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        saved = json.load(f)
    print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M random parameters "
          f"({saved.get('model_type')})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="directory to write")
    parser.add_argument("--like", default=None, help="model whose shape and tokenizer to copy "
                        "(default: the default model)")
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--gemma3-tiny", action="store_true",
                       help="a small Gemma 3 shape with sliding windows (tokenizer of --like)")
    shape.add_argument("--vlm", action="store_true",
                       help="a LLaVA model that takes images: --like's decoder, a CLIP "
                       "ViT-B/16 vision tower and a projector")
    step = parser.add_mutually_exclusive_group()
    step.add_argument("--skip-weights", action="store_true", help="config and tokenizer only")
    step.add_argument("--weights-only", action="store_true",
                      help="weights for the config.json already in OUT")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-std", type=float, default=0.05)
    args = parser.parse_args()
    if not args.weights_only:
        write_skeleton(args.out, args.like, args.gemma3_tiny, args.vlm)
    if not args.skip_weights:
        write_weights(args.out, args.seed, args.init_std)


if __name__ == "__main__":
    main()
