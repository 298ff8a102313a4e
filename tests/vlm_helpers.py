"""Tiny random-weight LLaVA models built with transformers' own classes, and test images.

``write_tiny_llava`` saves ``LlavaForConditionalGeneration`` (a CLIP or SigLIP tower, the
projector, a two-layer Llama decoder) with ``save_pretrained``, its image processor's
``preprocessor_config.json`` (transformers' Pillow processor) and a tokenizer: the default
model's, with ``<image>`` added as a special token, so that the engine serves the directory as
it would a real one.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from tokenizers import AddedToken
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    SiglipVisionConfig,
)
from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from prefixserve.model.text.tokenizer import load_tokenizer

IMAGE_TOKEN = "<image>"
TOKENS_PER_IMAGE = 16
"""Both towers: 28x28 images in 7x7 patches (CLIP's class token dropped, SigLIP's none)."""


def write_tokenizer(out: Path) -> int:
    """The default model's tokenizer with ``<image>`` added; returns the image token's id."""
    tok = load_tokenizer(None)
    backend = tok.backend
    backend.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    backend.save(str(out / "tokenizer.json"))
    config = {"chat_template": tok.chat_template, "bos_token": tok.bos_token,
              "eos_token": tok.eos_token}
    (out / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    token_id = backend.token_to_id(IMAGE_TOKEN)
    assert token_id is not None
    return token_id


def tower(kind: str) -> Any:
    """The vision config of a tiny tower: 3 layers of width 32, 28x28 images, 7x7 patches."""
    shape = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
             "num_attention_heads": 4, "image_size": 28, "patch_size": 7}
    return CLIPVisionConfig(**shape) if kind == "clip" else SiglipVisionConfig(**shape)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (norm weights around 1), so that each one matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.2 * noise if "norm" in name else 0.15 * noise)


def write_tiny_llava(out: Path, kind: str = "clip", seed: int = 0
                     ) -> LlavaForConditionalGeneration:
    """A tiny LLaVA directory at ``out`` (``kind``: ``clip``, untied head, the ``default``
    feature strategy at layer -2; ``siglip``: tied head, ``full`` features of layers -1 and
    1); returns the transformers model, in eval mode."""
    out.mkdir(parents=True, exist_ok=True)
    image_token_id = write_tokenizer(out)
    text = LlamaConfig(vocab_size=image_token_id + 1, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                       tie_word_embeddings=kind == "siglip")
    layers: int | list[int] = -2 if kind == "clip" else [-1, 1]
    config = LlavaConfig(vision_config=tower(kind), text_config=text,
                         image_token_index=image_token_id, vision_feature_layer=layers,
                         vision_feature_select_strategy="default" if kind == "clip" else "full",
                         tie_word_embeddings=kind == "siglip")
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    randomize(model, seed)
    model.eval()
    model.save_pretrained(out)
    if kind == "clip":
        processor: Any = LlavaImageProcessorPil(size={"shortest_edge": 28},
                                                crop_size={"height": 28, "width": 28},
                                                do_pad=True)
    else:
        processor = SiglipImageProcessorPil(size={"height": 28, "width": 28})
    processor.save_pretrained(out)
    return model


def write_tiny_text_model(out: Path, seed: int = 0) -> None:
    """A tiny text-only Llama directory at ``out``, with the same tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(out) + 1
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    randomize(model, seed)
    model.save_pretrained(out)


def hf_processor(path: Path) -> Any:
    """transformers' image processor of a directory ``write_tiny_llava`` wrote."""
    config = json.loads((path / "preprocessor_config.json").read_text())
    if config["image_processor_type"].startswith("Siglip"):
        return SiglipImageProcessorPil.from_pretrained(path)
    return LlavaImageProcessorPil.from_pretrained(path)


def picture(seed: int, size: tuple[int, int] = (45, 31)) -> Image.Image:
    """A random RGB picture of ``size`` (width, height)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    """``image`` as a file of ``fmt`` (WebP lossless: the same pixels as the PNG)."""
    buffer = io.BytesIO()
    image.save(buffer, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return buffer.getvalue()


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    media = {"PNG": "image/png", "WEBP": "image/webp", "JPEG": "image/jpeg"}[fmt]
    return f"data:{media};base64,{base64.b64encode(encoded(image, fmt)).decode()}"
