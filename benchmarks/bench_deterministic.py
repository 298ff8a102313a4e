"""What the deterministic mode costs: prefill and decode speed with ``deterministic=True`` vs
the default, for dense bfloat16 weights and for packed (quantized) weights.

Reproduce on a quiet machine with::

    .venv/bin/python benchmarks/bench_deterministic.py --repeat 5
    .venv/bin/python benchmarks/bench_deterministic.py --modes packed --threads 2 --repeat 3
    .venv/bin/python benchmarks/bench_deterministic.py --modes bf16 --row-tile 1   # tile choice
    .venv/bin/python benchmarks/bench_deterministic.py --model gemma-3-270m --modes packed \
        --prompt-len 1024 --repeat 3    # sliding windows: prompts past Gemma 3's 512

For each weights mode (``bf16``: ``--weights bf16 --dtype bfloat16``; ``packed``: ``--weights
auto``) one engine in each mode is loaded, and each measurement alternates between them, run by
run (``--repeat`` times), every request with a fresh cache salt (nothing cached):

* prefill: tokens/s of one ``--prompt-len``-token prompt (time to its first token);
* decode at batch 1 and 16: tokens/s of greedy decoding (``--decode-tokens`` tokens after a
  32-token prompt; the prompt's time, measured apart, is subtracted).

It prints medians with ranges, and the deterministic/default ratio of the medians.
``--row-tile`` overrides ``batch_invariant.ROW_TILE`` (rows per dense product in the mode) to
compare tile sizes: a bigger tile pads a small decode step more, a smaller one makes more calls.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table

from prefixserve import LLM, SamplingParams
from prefixserve.model.attention import batch_invariant

MODES = {"bf16": ("bf16", "bfloat16"), "packed": ("auto", "auto")}
_salts = itertools.count()


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, cache_salt=f"bench-{next(_salts)}")
    return time.perf_counter() - start


def prefill_speed(llm: LLM, rng: random.Random, length: int) -> float:
    prompt = [rng.randrange(1000, 40000) for _ in range(length)]
    return length / timed(llm, [prompt], 1)


def decode_speed(llm: LLM, rng: random.Random, batch: int, tokens: int) -> float:
    prompts = [[rng.randrange(1000, 40000) for _ in range(32)] for _ in range(batch)]
    total = timed(llm, prompts, tokens + 1)
    prompt_only = timed(llm, prompts, 1)
    return batch * tokens / max(total - prompt_only, 1e-9)


def median_range(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a model path or short name "
                        "(default: the default model)")
    parser.add_argument("--modes", default="bf16,packed")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--row-tile", type=int)
    args = parser.parse_args()
    if args.row_tile:
        batch_invariant.ROW_TILE = args.row_tile
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(0)
    measures: dict[str, Callable[[LLM], float]] = {
        f"prefill {args.prompt_len} tok/s": lambda llm: prefill_speed(llm, rng, args.prompt_len),
        "decode batch 1 tok/s": lambda llm: decode_speed(llm, rng, 1, args.decode_tokens),
        "decode batch 16 tok/s": lambda llm: decode_speed(llm, rng, 16, args.decode_tokens),
    }
    table = Table(title=f"deterministic mode (row tile {batch_invariant.ROW_TILE}) vs default "
                  "(median (range))")
    for column in ("weights", "measure", "default", "deterministic", "ratio"):
        table.add_column(column)
    for name in args.modes.split(","):
        weights, dtype = MODES[name]
        engines = {det: LLM(args.model, weights=weights, dtype=dtype, deterministic=det,
                            kv_cache_memory="256MiB") for det in (False, True)}
        for engine in engines.values():  # warm up (first calls build caches)
            decode_speed(engine, rng, 2, 2)
        for label, measure in measures.items():
            runs: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.repeat):
                for det, engine in engines.items():
                    runs[det].append(measure(engine))
            ratio = statistics.median(runs[True]) / statistics.median(runs[False])
            table.add_row(name, label, median_range(runs[False]), median_range(runs[True]),
                          f"{ratio:.2f}")
        del engines
    Console().print(table)


if __name__ == "__main__":
    main()
