"""A LLaVA-style model (CLIP or SigLIP tower, projector, Llama decoder) vs transformers'
``LlavaForConditionalGeneration`` on tiny random-weight models saved with ``save_pretrained``.

The preprocessing equals transformers' Pillow processor, the projected features its
``get_image_features``, and the runner's logits (float32, ``atol = rtol = 1e-4``) its logits,
for a whole prompt and for a prompt whose leading blocks, ending inside the image's
placeholder run, were computed by an earlier request (a cached prefix).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import LlavaForConditionalGeneration
from vlm_helpers import TOKENS_PER_IMAGE, hf_processor, picture, write_tiny_llava

from prefixserve.core import MultiModalInput
from prefixserve.engine.multimodal import ImageInputs
from prefixserve.model.arch.config import ModelConfig
from prefixserve.model.arch.vision_config import read_llava_config
from prefixserve.model.runner import ModelRunner, SeqBatchInput
from prefixserve.model.text.tokenizer import load_tokenizer
from prefixserve.model.vision.image import from_pil
from prefixserve.model.vision.loader import VisionModel, load_vision_model
from prefixserve.model.vision.processor import ImageProcessor
from prefixserve.model.weights.loader import load_model

TOL = {"atol": 1e-4, "rtol": 1e-4}
BLOCK = 16


class Tiny(NamedTuple):
    hf: LlavaForConditionalGeneration
    path: Path
    runner: ModelRunner
    images: ImageInputs
    vision: VisionModel


@pytest.fixture(scope="module", params=["clip", "siglip"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    path = tmp_path_factory.mktemp(request.param)
    hf = write_tiny_llava(path, request.param)
    config, model = load_model(str(path), torch.float32)
    vision = load_vision_model(str(path), torch.float32)
    assert vision is not None
    runner = ModelRunner(config, model, num_blocks=32, block_size=BLOCK, dtype=torch.float32,
                         device="cpu")
    return Tiny(hf, path, runner, ImageInputs(vision, limit=4, cache_rows=1024), vision)


def prompt(tiny: Tiny, before: int, after: int, seed: int = 0) -> list[int]:
    """``before`` text ids, the image placeholder, ``after`` text ids."""
    rng = np.random.default_rng(seed)
    placeholder = tiny.vision.config.image_token_id
    text = rng.integers(3, placeholder, before + after).tolist()
    return text[:before] + [placeholder] + text[before:]


def hf_logits(tiny: Tiny, ids: list[int], image: Image.Image) -> torch.Tensor:
    """transformers' logits of ``ids`` (the placeholder expanded) with ``image``."""
    pixels = hf_processor(tiny.path)(images=image, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = tiny.hf(input_ids=torch.tensor([ids]), pixel_values=pixels)
    return out.logits[0]


def run(tiny: Tiny, ids: list[int], image: Image.Image, start: int, table: list[int]
        ) -> torch.Tensor:
    """The runner's logits of ``ids[start:]`` (``ids`` expanded), positions before ``start``
    being in ``table``'s blocks already."""
    decoded = from_pil(image)
    offset = ids.index(tiny.vision.config.image_token_id)
    run_of_image = MultiModalInput(offset, TOKENS_PER_IMAGE, decoded.content_hash)
    [embeds] = tiny.images.step_embeds([([run_of_image], [decoded], start, len(ids) - start)])
    out = tiny.runner.execute([SeqBatchInput(ids[start:], start, table,
                                             need_prompt_logits=True, embeds=embeds)])
    assert out.prompt_logits[0] is not None
    return out.prompt_logits[0]


def expanded(tiny: Tiny, ids: list[int]) -> list[int]:
    return tiny.images.place(ids, [from_pil(picture(0))])[0]


@pytest.mark.parametrize("size", [(45, 31), (20, 60), (28, 28)])
def test_pixels_match_transformers_processor(tiny: Tiny, size: tuple[int, int]) -> None:
    image = picture(1, size)
    ours = tiny.vision.processor(from_pil(image))
    theirs = hf_processor(tiny.path)(images=image, return_tensors="np")["pixel_values"][0]
    np.testing.assert_allclose(ours, theirs, atol=1e-6, rtol=0)


def test_transparent_pixels_lie_on_white_as_transformers(tiny: Tiny) -> None:
    rgba = np.asarray(picture(2)).copy()
    alpha = np.full(rgba.shape[:2] + (1,), 255, dtype=np.uint8)
    alpha[:10] = 0
    image = Image.fromarray(np.concatenate([rgba, alpha], axis=2), "RGBA")
    ours = tiny.vision.processor(from_pil(image))
    theirs = hf_processor(tiny.path)(images=image, return_tensors="np")["pixel_values"][0]
    np.testing.assert_allclose(ours, theirs, atol=1e-6, rtol=0)


def test_features_match_transformers(tiny: Tiny) -> None:
    images = [picture(3), picture(4, (50, 50))]
    pixels = hf_processor(tiny.path)(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        theirs = torch.stack(list(tiny.hf.model.get_image_features(pixel_values=pixels)
                                  .pooler_output))
    ours = torch.stack(tiny.images.encode([from_pil(i) for i in images]))
    assert ours.shape == (2, TOKENS_PER_IMAGE, 64)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_prefill_logits_match_transformers(tiny: Tiny) -> None:
    ids = expanded(tiny, prompt(tiny, before=11, after=9))
    image = picture(5)
    ours = run(tiny, ids, image, 0, [0, 1, 2])
    torch.testing.assert_close(ours, hf_logits(tiny, ids, image), **TOL)


def test_logits_after_a_cached_prefix_that_ends_inside_the_image(tiny: Tiny) -> None:
    """Request A computes its prompt; B shares A's first block (text, then the start of the
    image run) and computes the rest on blocks of its own: B's logits are those of its whole
    prompt in transformers."""
    image = picture(6)
    first = expanded(tiny, prompt(tiny, before=10, after=12, seed=1))
    run(tiny, first, image, 0, [3, 4, 5])
    end = first.index(tiny.vision.config.image_token_id) + TOKENS_PER_IMAGE
    second = first[:end] + first[end:][::-1]  # the same image, other text after it
    assert tiny.vision.config.image_token_id in second[:BLOCK]
    assert tiny.vision.config.image_token_id in second[BLOCK:]
    ours = run(tiny, second, image, BLOCK, [3, 6, 7])
    torch.testing.assert_close(ours, hf_logits(tiny, second, image)[BLOCK:], **TOL)


def test_another_image_changes_the_logits(tiny: Tiny) -> None:
    """The image rows reach the decoder: the same ids with another picture differ (the test
    that would pass if the runner ignored ``embeds`` fails here)."""
    ids = expanded(tiny, prompt(tiny, before=4, after=4, seed=2))
    one = run(tiny, ids, picture(7), 0, [8, 9])
    other = run(tiny, ids, picture(8), 0, [10, 11])
    assert (one[-1] - other[-1]).abs().max() > 1e-3


def test_random_model_script_writes_a_vlm_that_loads(tmp_path: Path) -> None:
    """``benchmarks/random_model.py --vlm``'s config and processor (the weights skipped):
    the default model's decoder, a ViT-B/16 tower of 196 image tokens, the ``<image>``
    token in the tokenizer."""
    out = tmp_path / "vlm"
    script = Path(__file__).parents[2] / "benchmarks" / "random_model.py"
    subprocess.run([sys.executable, str(script), str(out), "--vlm", "--skip-weights"],
                   check=True, capture_output=True)
    config = read_llava_config(str(out))
    assert config is not None and config.tokens_per_image == 196
    assert config.vision.kind == "clip" and config.vision.hidden_size == 768
    text = ModelConfig.from_hf_dir(str(out))
    assert (text.hidden_size, text.num_hidden_layers) == (576, 30)
    tokenizer = load_tokenizer(str(out))
    assert tokenizer.encode("<image>", add_special_tokens=False) == [config.image_token_id]
    processor = ImageProcessor.from_dir(str(out), config.vision)
    assert processor(from_pil(picture(9, (300, 200)))).shape == (3, 224, 224)
