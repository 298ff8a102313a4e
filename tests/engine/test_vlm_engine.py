"""Chats with images through ``LLM`` on a tiny random-weight LLaVA model (transformers' own
classes, ``tests/vlm_helpers.py``): the engine's next-token logprobs equal transformers' with
and without a cached prefix, images are cached by content (prefix blocks and encoder output),
``prefixserve estimate`` on the prompts with their images finds the engine's hits, and bad
images are refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlavaForConditionalGeneration
from vlm_helpers import (
    TOKENS_PER_IMAGE,
    data_url,
    encoded,
    hf_processor,
    picture,
    write_tiny_llava,
)

from prefixserve import LLM, SamplingParams
from prefixserve.engine.errors import RequestError
from prefixserve.engine.multimodal import EncoderCache, ImageInputs
from prefixserve.model.vision.image import ImageError, decode_image, from_pil
from prefixserve.outputs import RequestOutput
from prefixserve.tools.estimate.replay import replay_infinite
from prefixserve.tools.estimate.results import ReplaySettings
from prefixserve.tools.trace_formats import ReadOptions, read_workload

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
SYSTEM = {"role": "system", "content": "You describe pictures in one short sentence, "
          "plainly and without guessing what you cannot see in them."}


class Served:
    def __init__(self, path: Path, hf: LlavaForConditionalGeneration, llm: LLM) -> None:
        self.path, self.hf, self.llm = path, hf, llm

    def stats(self) -> tuple[int, int]:
        stats = self.llm.engine.get_stats()
        return stats.encoder_runs, stats.encoder_cache_hits


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    path = tmp_path_factory.mktemp("llava")
    hf = write_tiny_llava(path, "clip")
    llm = LLM(str(path), dtype="float32", block_size=BLOCK, num_blocks=64,
              limit_mm_per_prompt=2)
    return Served(path, hf, llm)


def chat(question: str, *images: Any) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": image}}
                                   if isinstance(image, str) else
                                   {"type": "image", "image": image} for image in images]
    return [SYSTEM, {"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


def assert_logprobs_match_transformers(served: Served, out: RequestOutput, image: Any) -> None:
    """The next token's top-20 logprobs equal transformers' on the same ids and image."""
    pixels = hf_processor(served.path)(images=image, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        logits = served.hf(input_ids=torch.tensor([out.prompt_token_ids]),
                           pixel_values=pixels).logits[0, -1]
    reference = torch.log_softmax(logits, dim=-1)
    logprobs = out.outputs[0].logprobs
    assert logprobs is not None
    for token, entry in logprobs[0].items():
        assert abs(entry.logprob - reference[token].item()) < 1e-4


def image_offset(served: Served, out: RequestOutput) -> int:
    return out.prompt_token_ids.index(served.llm.engine.images.image_token_id or -1)


def test_image_chat_matches_transformers_cold_then_from_the_cache(served: Served) -> None:
    """The same chat again takes every full block of its prompt from the cache and runs no
    encoder; both times the logprobs are transformers'."""
    image = picture(10)
    runs, _ = served.stats()
    [cold] = served.llm.chat(chat("What is in it?", data_url(image)), GREEDY)
    assert cold.num_cached_tokens == 0
    assert served.stats()[0] == runs + 1
    assert cold.prompt_token_ids.count(served.llm.engine.images.image_token_id or -1) == \
        TOKENS_PER_IMAGE
    assert_logprobs_match_transformers(served, cold, image)
    [warm] = served.llm.chat(chat("What is in it?", data_url(image)), GREEDY)
    assert warm.num_cached_tokens == (len(warm.prompt_token_ids) - 1) // BLOCK * BLOCK
    assert served.stats()[0] == runs + 1
    assert_logprobs_match_transformers(served, warm, image)


def test_same_pixels_in_another_format_hit(served: Served) -> None:
    image = picture(11)
    [png] = served.llm.chat(chat("Describe it.", data_url(image, "PNG")), GREEDY)
    [webp] = served.llm.chat(chat("Describe it.", data_url(image, "WEBP")), GREEDY)
    [pil] = served.llm.chat(chat("Describe it.", image), GREEDY)
    assert png.num_cached_tokens < BLOCK * (image_offset(served, png) // BLOCK + 1)
    assert webp.num_cached_tokens == pil.num_cached_tokens == \
        (len(png.prompt_token_ids) - 1) // BLOCK * BLOCK


def test_another_image_misses_past_the_text_before_it(served: Served) -> None:
    """Same text, another picture: the blocks before the image's first block hit, none
    after (a cache that ignored the image would hit the whole prompt)."""
    [first] = served.llm.chat(chat("And this one?", picture(12)), GREEDY)
    [other] = served.llm.chat(chat("And this one?", picture(13)), GREEDY)
    assert other.prompt_token_ids == first.prompt_token_ids
    assert other.num_cached_tokens == image_offset(served, other) // BLOCK * BLOCK
    assert_logprobs_match_transformers(served, other, picture(13))


def test_a_just_encoded_image_skips_the_encoder(served: Served) -> None:
    """Another tenant's salt misses the prefix cache, but the image's embeddings come from
    the encoder cache."""
    image = picture(14)
    served.llm.chat(chat("Colours?", image), GREEDY)
    runs, hits = served.stats()
    [salted] = served.llm.chat(chat("Colours?", image), GREEDY, cache_salt="tenant-b")
    assert salted.num_cached_tokens == 0
    assert served.stats() == (runs, hits + 1)
    assert_logprobs_match_transformers(served, salted, image)


def test_two_images_in_one_prompt(served: Served) -> None:
    one, two = picture(15), picture(16)
    [out] = served.llm.chat(chat("Which is brighter?", data_url(one), data_url(two)), GREEDY)
    ids = out.prompt_token_ids
    assert ids.count(served.llm.engine.images.image_token_id or -1) == 2 * TOKENS_PER_IMAGE
    pixels = hf_processor(served.path)(images=[one, two], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        logits = served.hf(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0, -1]
    logprobs = out.outputs[0].logprobs
    assert logprobs is not None
    reference = torch.log_softmax(logits, dim=-1)
    assert all(abs(e.logprob - reference[t].item()) < 1e-4 for t, e in logprobs[0].items())


def test_the_estimate_of_a_trace_with_images_finds_the_engines_hits(served: Served,
                                                                     tmp_path: Path) -> None:
    """Chats with one or two pictures (the same, another, in another order) through the engine,
    then their prompts as a ``prefixserve estimate`` token trace whose ``mm_inputs`` name the
    image tokens' runs and the pictures' hashes: the estimator's infinite cache finds exactly
    the prompt tokens the engine served from its cache (an estimate that ignored the hashes
    would find more)."""
    one, two = picture(21), picture(22)
    chats = [("Shapes?", one), ("Shapes?", one), ("Shapes?", two), ("Colours?", one, two),
             ("Colours?", one, two), ("Colours?", two, one), ("Colours?", two, two)]
    image_id = served.llm.engine.images.image_token_id
    served.llm.reset_prefix_cache()
    records, engine_hits = [], 0
    for question, *images in chats:
        [out] = served.llm.chat(chat(question, *images), GREEDY)
        engine_hits += out.num_cached_tokens
        ids = list(out.prompt_token_ids)
        starts = [i for i, t in enumerate(ids) if t == image_id and ids[i - 1] != image_id]
        records.append({"token_ids": ids, "mm_inputs": [
            {"offset": start, "length": TOKENS_PER_IMAGE, "hash": from_pil(image).content_hash}
            for start, image in zip(starts, images, strict=True)]})
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    workload = read_workload(str(path), ReadOptions(block_size=BLOCK))
    assert replay_infinite(workload, ReplaySettings()).hit_tokens == engine_hits > 0


def test_bad_images_are_refused(served: Served) -> None:
    llm = served.llm
    with pytest.raises(RequestError, match="at most 2") as too_many:
        llm.chat(chat("?", picture(1), picture(2), picture(3)), GREEDY)
    assert too_many.value.code == "too_many_images"
    with pytest.raises(ImageError, match="not an image"):
        llm.chat(chat("?", b"plain text, no picture"), GREEDY)
    with pytest.raises(RequestError, match="placeholder"):  # the image token typed as text
        llm.chat(chat("<image> here", picture(1)), GREEDY)
    with pytest.raises(RequestError, match="data: URL"):
        llm.chat(chat("?", "https://example.com/cat.png"), GREEDY)
    with pytest.raises(RequestError, match="do not match"):  # placeholders with no images
        llm.engine.add_request([5, 6, llm.engine.images.image_token_id or -1, 7], GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_pixel_limit_is_checked_before_decoding() -> None:
    """A 20000x20000 PNG of a few hundred KB is refused from its header."""
    from PIL import Image

    bomb = encoded(Image.new("L", (20000, 20000)))
    assert len(bomb) < 1_000_000
    with pytest.raises(ImageError, match="limit of 16,777,216 pixels") as error:
        decode_image(bomb, max_pixels=4096 * 4096)
    assert error.value.code == "image_too_large"
    with pytest.raises(ImageError, match="300x200 = 60,000 pixels, more than the limit of "
                       "50,000") as error:
        decode_image(encoded(picture(1, (300, 200))), max_pixels=50_000)
    assert error.value.code == "image_too_large"


def test_a_text_only_model_takes_no_images() -> None:
    inputs = ImageInputs(None, limit=4, cache_rows=0)
    with pytest.raises(RequestError, match="takes no images") as error:
        inputs.place([1, 2, 3], [decode_image(encoded(picture(1)))])
    assert error.value.code == "image_not_supported"


def test_encoder_cache_keeps_the_most_recent_rows() -> None:
    cache = EncoderCache(capacity=40)
    for name in "abc":
        cache.put(name, torch.zeros(16, 4))
    assert cache.get("a") is None and cache.rows == 32  # a was dropped to make room for c
    assert cache.get("b") is not None  # b is now the most recent
    cache.put("d", torch.zeros(16, 4))
    assert cache.get("c") is None and cache.get("b") is not None and len(cache) == 2
    cache.put("huge", torch.zeros(41, 4))
    assert cache.get("huge") is None and len(cache) == 2
