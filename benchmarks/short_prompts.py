"""Short prompts through the fused layers against the eager step, in one run: the time to a
prompt's first token (the measurement behind ``FUSED_STEP_ROWS`` and ``PANEL_STEP_ROWS`` in
``model/runner.py``).

    .venv/bin/python benchmarks/short_prompts.py [FILE.gguf] [--lengths 4,16,32,64]
        [--prefix 512] [--prompts 8] [--rounds 3] [--threads 2] [--dtype auto]

FILE defaults to the default model. For each length N, ``--prompts`` prompts of N new tokens
each run one at a time to their first token: cold (N random tokens, nothing cached) and after
a cached prefix (``--prefix`` shared tokens computed once, then N tokens of each prompt's
own: the rest a prefix-cache hit leaves). The two paths alternate round by round in one
process: every prompt step fused (the runner's ``fused_step_rows`` raised to the longest
length) and every one eager (0). Prints the shipped limit, the median ms a prompt (range over
the rounds' medians) and the ratio eager / fused.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from prefixserve import LLM, SamplingParams


def one_round(llm: LLM, lengths: list[int], prefix: list[int], count: int,
              rng: random.Random) -> dict[tuple[str, int], float]:
    """Median seconds a prompt to its first token, per (case, length), on fresh tokens."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    out = {}
    for n in lengths:
        for case, head in (("cold", []), ("after prefix", prefix)):
            times = []
            for _ in range(count):
                prompt = head + [rng.randrange(1000, 30000) for _ in range(n)]
                start = time.perf_counter()
                llm.generate(prompt, params)
                times.append(time.perf_counter() - start)
            out[(case, n)] = statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", nargs="?", default=None)
    parser.add_argument("--lengths", default="4,16,32,64")
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    llm = LLM(args.file, num_threads=args.threads, dtype=args.dtype) if args.file else \
        LLM(num_threads=args.threads, dtype=args.dtype)
    rng = random.Random(0)
    lengths = [int(n) for n in args.lengths.split(",")]
    prefix = [rng.randrange(1000, 30000) for _ in range(args.prefix)]
    llm.generate(prefix, SamplingParams(max_tokens=1, temperature=0.0))  # cached from here
    runner = llm.engine.runner
    runner._fused_ready()  # the fused layers built, and with them the shipped limit
    shipped = runner.fused_step_rows
    paths = {"fused": max(lengths), "eager": 0}
    results: dict[str, list[dict[tuple[str, int], float]]] = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, rows in paths.items():
            runner.fused_step_rows = rows
            results[name].append(one_round(llm, lengths, prefix, args.prompts, rng))
    runner.fused_step_rows = shipped
    print(f"fused_step_rows {shipped}; {args.dtype}; {args.prompts} prompts a length, "
          f"{args.rounds} rounds, {args.threads} threads; ms a prompt to its first token, "
          "median (range)")
    print("| case | new tokens | fused | eager | eager / fused |\n|---|---:|---:|---:|---:|")
    for case in ("cold", "after prefix"):
        for n in lengths:
            cells = []
            for name in paths:
                values = [r[(case, n)] * 1000 for r in results[name]]
                cells.append((statistics.median(values), min(values), max(values)))
            (f, f_lo, f_hi), (e, e_lo, e_hi) = cells
            label = case if case == "cold" else f"after {args.prefix} cached"
            print(f"| {label} | {n} | {f:.1f} ({f_lo:.1f}-{f_hi:.1f}) | {e:.1f} "
                  f"({e_lo:.1f}-{e_hi:.1f}) | {e / f:.2f}x |")


if __name__ == "__main__":
    main()
