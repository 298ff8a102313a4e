"""Time to first token of a chat about an image: the first turn, and the second turn about the
same image (its prompt from the prefix cache, no vision encoder run), in process with ``LLM``.

The model is a directory ``benchmarks/random_model.py --vlm`` wrote (the default model's
decoder, a CLIP ViT-B/16 tower of 86M parameters)::

    .venv/bin/python benchmarks/random_model.py /tmp/vlm --vlm
    .venv/bin/python benchmarks/bench_vlm.py /tmp/vlm

Each round uses a fresh picture and system prompt (nothing cached from an earlier round);
the table gives the median of the rounds, after one warm-up round.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from typing import Any

import numpy as np
from PIL import Image

from prefixserve import LLM, SamplingParams
from prefixserve.model.vision.image import from_pil

SYSTEM = ("You look at pictures for a museum's visitors and answer questions about them: the "
          "colours, the shapes, what the picture may show and how it was made. Keep answers "
          "short, plain and kind. ")
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)
ANSWER = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def picture(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8), "RGB")


def ttft(llm: LLM, messages: list[dict[str, Any]], params: SamplingParams) -> tuple[float, Any]:
    [out] = llm.chat(messages, params)
    assert out.metrics.first_token_time is not None
    return out.metrics.first_token_time - out.metrics.arrival_time, out


def one_round(llm: LLM, seed: int) -> tuple[float, float, int, int]:
    """(first turn's TTFT, second turn's, the second's prompt tokens, of them cached)."""
    image = picture(seed)
    turn: list[dict[str, Any]] = [
        {"role": "system", "content": f"[{uuid.uuid4().hex}] {SYSTEM}"},
        {"role": "user", "content": [{"type": "image", "image": image},
                                     {"type": "text", "text": "What is in the picture?"}]}]
    first, out = ttft(llm, turn, ANSWER)
    turn += [{"role": "assistant", "content": out.outputs[0].text},
             {"role": "user", "content": "And which colours stand out?"}]
    second, again = ttft(llm, turn, ONE_TOKEN)
    return first, second, len(again.prompt_token_ids), again.num_cached_tokens


def encoder_seconds(llm: LLM) -> float:
    """One picture through the processor and the vision encoder, alone."""
    image = from_pil(picture(99))
    start = time.perf_counter()
    llm.engine.images.encode([image])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a directory random_model.py --vlm wrote")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    llm = LLM(args.model, dtype=args.dtype)
    one_round(llm, 0)  # warm-up
    rounds = [one_round(llm, seed) for seed in range(1, args.rounds + 1)]
    first = statistics.median(r[0] for r in rounds)
    second = statistics.median(r[1] for r in rounds)
    encoder = encoder_seconds(llm)
    stats = llm.engine.get_stats()
    print(f"dtype {llm.engine.dtype}, {args.rounds} rounds (medians)")
    print(f"first turn TTFT   {first * 1000:8.1f} ms")
    print(f"second turn TTFT  {second * 1000:8.1f} ms  ({rounds[-1][3]} of {rounds[-1][2]} "
          "prompt tokens cached)")
    print(f"ratio             {second / first:8.3f}")
    print(f"vision encoder    {encoder * 1000:8.1f} ms per picture (of the first turn's TTFT)")
    print(f"images encoded {stats.encoder_runs}, encoder cache hits "
          f"{stats.encoder_cache_hits}")


if __name__ == "__main__":
    main()
