"""The ``multimodal`` dataset: multi-turn chats about a few shared pictures.

The pictures are drawn here with Pillow: a plain background and one to three coloured shapes
(ellipses, rectangles, triangles), at a few sizes, seeded, each different from the others (by
content hash). They are sent as PNG ``data:`` URLs in ``image_url`` parts of
``/v1/chat/completions`` messages, so the dataset always goes to the chat endpoint.

Conversation ``c`` is about picture ``c % num_images``: its first user message is the picture,
then a question; every later turn is another question, sent with the whole history (the
picture included), so a server that caches by image content serves every turn after the first
from its cache up to the new message, and a conversation about a picture an earlier one showed
finds the picture's blocks too (after the same system prompt). Questions differ from their
first token on, as in ``multi-turn``.
"""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image, ImageDraw

from prefixserve.model.vision.image import from_pil
from prefixserve.tools.bench.datasets import (
    BenchImage,
    ChatSetup,
    Dataset,
    Session,
    Turn,
    WordVocabulary,
    check_non_negative,
    check_positive,
)

PICTURE_SIZES = ((224, 224), (320, 240), (240, 320), (448, 336))
"""Width and height of the pictures, in turn."""

SHAPES = ("ellipse", "rectangle", "triangle")


def _colour(rng: np.random.Generator) -> tuple[int, int, int]:
    red, green, blue = (int(v) for v in rng.integers(0, 256, 3))
    return red, green, blue


def draw_picture(rng: np.random.Generator, size: tuple[int, int]) -> Image.Image:
    """A background of one colour and one to three shapes of others, at ``size``."""
    width, height = size
    image = Image.new("RGB", size, _colour(rng))
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(1, 4))):
        x0, x1 = sorted(int(v) for v in rng.integers(0, width, 2))
        y0, y1 = sorted(int(v) for v in rng.integers(0, height, 2))
        box = (x0, y0, max(x1, x0 + 8), max(y1, y0 + 8))
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        if shape == "ellipse":
            draw.ellipse(box, fill=_colour(rng))
        elif shape == "rectangle":
            draw.rectangle(box, fill=_colour(rng))
        else:
            draw.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])],
                         fill=_colour(rng))
    return image


def png_data_url(image: Image.Image) -> str:
    """``image`` as a ``data:image/png;base64,...`` URL."""
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def pictures(count: int, seed: int) -> list[BenchImage]:
    """``count`` different pictures (sizes from ``PICTURE_SIZES`` in turn), with their
    ``data:`` URLs and the content hashes the engine gives them."""
    rng = np.random.default_rng(seed)
    out: list[BenchImage] = []
    seen: set[str] = set()
    while len(out) < count:
        size = PICTURE_SIZES[len(out) % len(PICTURE_SIZES)]
        image = draw_picture(rng, size)
        content_hash = from_pil(image).content_hash
        if content_hash in seen:
            continue
        seen.add(content_hash)
        out.append(BenchImage(png_data_url(image), content_hash, *size))
    return out


def multimodal(vocabulary: WordVocabulary, *, num_images: int, num_conversations: int,
               num_turns: int, system_prompt_len: int, question_len: int, output_len: int,
               seed: int) -> Dataset:
    """``num_conversations`` chats of ``num_turns`` questions of ``question_len`` tokens (each
    answered with ``output_len`` tokens) about ``num_images`` pictures: conversation ``c``
    shows picture ``c % num_images`` in its first message, after a system prompt of
    ``system_prompt_len`` tokens that every conversation shares (none when 0)."""
    check_positive(num_images=num_images, num_conversations=num_conversations,
                   num_turns=num_turns, question_len=question_len, output_len=output_len)
    check_non_negative(system_prompt_len=system_prompt_len)
    images = pictures(num_images, seed)
    rng = np.random.default_rng(seed)
    system = vocabulary.sample(rng, system_prompt_len)
    sessions = []
    for conversation, first in enumerate(vocabulary.distinct(rng, num_conversations)):
        question = [first, *vocabulary.sample(rng, question_len - 1)]
        turns = [Turn(system + question, output_len, image=images[conversation % num_images])]
        turns += [Turn(vocabulary.sample(rng, question_len), output_len)
                  for _ in range(num_turns - 1)]
        sessions.append(Session(turns, group=conversation,
                                chat=ChatSetup(system, [], question)))
    return Dataset("multimodal", sessions, {
        "num_images": num_images, "num_conversations": num_conversations,
        "num_turns": num_turns, "system_prompt_len": system_prompt_len,
        "question_len": question_len, "output_len": output_len, "seed": seed,
        "image_sizes": [[image.width, image.height] for image in images],
        "image_hashes": [image.content_hash for image in images]}, endpoint="chat")
