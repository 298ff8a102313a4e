"""Decode of a few sequences at once: the one-row kernels row after row (``FEW_ROWS``; on AVX2
builds, ``PAIR_ROWS`` for the Q4 rows ``row_q4_pairs`` takes; ``kernels/quant.c``) against
the batch kernel, in one run.

    .venv/bin/python benchmarks/few_rows.py [FILE.gguf] [--sequences 1,2,4,8] [--rounds 3]
        [--threads 2]

FILE defaults to the default model. For each build (the library as it is, and
``PREFIXSERVE_KERNEL_FLAGS="-DFEW_ROWS=1 -DPAIR_ROWS=1"``, which sends every product of more
than one row to the batch kernels), a child process loads the file and, for each number of
sequences, decodes that many greedy sequences together (48 tokens each after a 32-token
prompt, the prompts cached first), ``--rounds`` times; the builds alternate round by round.
Prints the tokens/s of all sequences together and the ms a step (median and range), and the
ratio of the two builds.
From 8 sequences a bfloat16 model's steps take the bfloat16 batch kernels in both builds; on
a CPU with AMX, the tiles from 4 (Q4_0 weights: 8; ``amx_rows`` in ``kernels/quant.c``). On
AVX2 builds a K-quant model's products take ``kq_rows_few`` at any row count in both builds
(``KQ_FEW_ROWS``: from 8 rows the many-row kernels where the build has them, without AVX-512).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

PROMPT_TOKENS = 32
DECODE_TOKENS = 48
BUILDS = {"one row after another": "",
          "batch kernel (-DFEW_ROWS=1 -DPAIR_ROWS=1)": "-DFEW_ROWS=1 -DPAIR_ROWS=1"}


def measure(path: str | None, sequences: list[int], threads: int) -> dict[int, float]:
    """Seconds a step for each number of sequences, in this process."""
    from prefixserve import LLM, SamplingParams

    # the pool in blocks, not bytes: enough for the most sequences at once, whatever the
    # model's KV takes a token (256 MiB held 1,145 tokens of a 3B model's float32 KV)
    blocks = max(sequences) * -(-(PROMPT_TOKENS + 1 + DECODE_TOKENS) // 16) + 16
    llm = LLM(path, num_threads=threads, num_blocks=blocks) if path else \
        LLM(num_threads=threads, num_blocks=blocks)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
    out = {}
    for n in sequences:
        prompts = [[rng.randrange(1000, 30000) for _ in range(PROMPT_TOKENS)] for _ in range(n)]
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))
        start = time.perf_counter()
        llm.generate([p + [7] for p in prompts], params)
        out[n] = (time.perf_counter() - start) / DECODE_TOKENS
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", nargs="?", default=None)
    parser.add_argument("--sequences", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sequences = [int(v) for v in args.sequences.split(",")]
    if args.child:
        print(json.dumps(measure(args.file, sequences, args.threads)))
        return
    steps: dict[str, dict[int, list[float]]] = {b: {n: [] for n in sequences} for b in BUILDS}
    for _ in range(args.rounds):
        for build, flags in BUILDS.items():
            env = dict(os.environ, PREFIXSERVE_KERNEL_FLAGS=flags)
            command = [sys.executable, __file__, "--child", "--sequences", args.sequences,
                       "--threads", str(args.threads), *([args.file] if args.file else [])]
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            for n, seconds in json.loads(done.stdout.strip().splitlines()[-1]).items():
                steps[build][int(n)].append(seconds)
    print(f"$ python benchmarks/few_rows.py {args.file or ''} --sequences {args.sequences} "
          f"--rounds {args.rounds} --threads {args.threads}")
    names = list(BUILDS)
    print(f"| sequences | {names[0]}: tok/s, ms a step | {names[1]}: tok/s, ms a step | "
          "tok/s ratio |")
    print("|---:|---|---|---:|")
    for n in sequences:
        cells, rates = [], []
        for build in names:
            ms = [1e3 * s for s in steps[build][n]]
            rate = n * 1e3 / statistics.median(ms)
            rates.append(rate)
            cells.append(f"{rate:.1f}, {statistics.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f})")
        print(f"| {n} | {cells[0]} | {cells[1]} | {rates[0] / rates[1]:.2f}x |")


if __name__ == "__main__":
    main()
