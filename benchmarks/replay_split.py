"""Where a serving run's time goes: its prompts replayed through the engine, steps split by kind.

    .venv/bin/python benchmarks/replay_split.py PROMPTS.jsonl [--concurrency 16]
        [--output-len 64] [--kv-cache-dtype auto] [--limit N]
        [--compare-kernel OTHER/decode.c --repeat 3]

PROMPTS.jsonl is what ``side_by_side.py`` (``prefixserve bench --save-prompts``) saved of a run:
one ``{"token_ids": [...]}`` a line, in the order they were sent. The prompts are replayed
closed-loop in this process, as the benchmark's clients sent them: ``--concurrency`` requests in
flight, a new one as soon as one finishes, each generating ``--output-len`` greedy tokens with
EOS ignored. No HTTP, so the total is the engine's share of the run's wall time. Steps are
timed and split into decode steps (every request adds one token: the fused decode step) and
mixed steps (some request computes prompt tokens: prefill chunks, with the running requests'
decodes beside them). It is the measurement behind the concurrency-16 rows of
benchmarks/RESULTS.md (issue 11, round 3). With ``--compare-kernel`` (another ``decode.c``, e.g. an
earlier commit's, beside its ``quant.c``) the replay runs ``--repeat`` times with each kernel,
alternately, and prints the walls and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from prefixserve import LLM, SamplingParams
from prefixserve.engine.output_processor import ExecutedStep
from prefixserve.engine.scheduler import SchedulerOutput
from prefixserve.model.attention import fused_decode
from prefixserve.model.weights import quant_kernels


def step_kind(scheduled: SchedulerOutput) -> str:
    """"decode" when every request of the step adds one token after its prompt, else "mixed"
    (some request computes prompt tokens)."""
    decode = all(s.num_new_tokens == 1
                 and s.request.num_computed_tokens >= s.request.num_prompt_tokens
                 for s in scheduled.scheduled)
    return "decode" if decode else "mixed"


def replay(prompts: list[list[int]], concurrency: int, output_len: int,
           kv_cache_dtype: str) -> tuple[float, dict[str, list[float]]]:
    """The wall time of a closed-loop replay, and per step kind [steps, seconds, tokens]."""
    llm = LLM(max_num_seqs=concurrency, kv_cache_dtype=kv_cache_dtype)
    engine = llm.engine
    split = {"decode": [0.0, 0.0, 0.0], "mixed": [0.0, 0.0, 0.0]}
    execute = engine._execute

    def timed(scheduled: SchedulerOutput) -> ExecutedStep:
        kind = step_kind(scheduled)
        start = time.perf_counter()
        out = execute(scheduled)
        row = split[kind]
        row[0] += 1
        row[1] += time.perf_counter() - start
        row[2] += scheduled.num_tokens
        return out

    engine._execute = timed  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    sent = done = running = 0
    start = time.perf_counter()
    while done < len(prompts):
        while running < concurrency and sent < len(prompts):
            engine.add_request(prompts[sent], params, request_id=str(sent))
            sent += 1
            running += 1
        for output in engine.step():
            if output.finished:
                done += 1
                running -= 1
    return time.perf_counter() - start, split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prompts", type=Path)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--limit", type=int, default=None, help="replay the first N prompts")
    parser.add_argument("--compare-kernel", type=Path, default=None,
                        help="another decode.c: replay with it and with this one, alternately")
    parser.add_argument("--repeat", type=int, default=3, help="replays per kernel when comparing")
    args = parser.parse_args()
    with args.prompts.open() as file:
        prompts = [json.loads(line)["token_ids"] for line in file][: args.limit]
    if args.compare_kernel is not None:
        compare(prompts, args)
        return
    wall, split = replay(prompts, args.concurrency, args.output_len, args.kv_cache_dtype)
    print_split(prompts, args, wall, split)


def compare(prompts: list[list[int]], args: argparse.Namespace) -> None:
    """Replays with this checkout's kernel and with ``args.compare_kernel``, alternately."""
    other = quant_kernels.KernelLibrary(args.compare_kernel, fused_decode._declare)
    assert other.get() is not None, f"{args.compare_kernel} did not build: {other.error}"
    kernels = {"this kernel": fused_decode._library, "compared": other}
    walls: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(args.repeat):
        for name, library in kernels.items():
            fused_decode._library = library
            wall, split = replay(prompts, args.concurrency, args.output_len, args.kv_cache_dtype)
            walls[name].append(wall)
            print(f"\n{name}:")
            print_split(prompts, args, wall, split)
    fused_decode._library = kernels["this kernel"]
    print("\n| kernel | wall s, median (range) |")
    print("|---|---|")
    for name, runs in walls.items():
        print(f"| {name} | {statistics.median(runs):.1f} ({min(runs):.1f}-{max(runs):.1f}) |")
    ratio = statistics.median(walls["compared"]) / statistics.median(walls["this kernel"])
    print(f"compared / this kernel: {ratio:.2f}x")


def print_split(prompts: list[list[int]], args: argparse.Namespace, wall: float,
                split: dict[str, list[float]]) -> None:
    print(f"{len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, concurrency "
          f"{args.concurrency}, KV cache {args.kv_cache_dtype}: {wall:.1f} s, "
          f"{len(prompts) / wall:.3f} req/s")
    print("| steps | count | seconds | share | ms per step | tokens |")
    print("|---|---|---|---|---|---|")
    for kind, (count, seconds, tokens) in split.items():
        if count:
            print(f"| {kind} | {count:.0f} | {seconds:.1f} | {seconds / wall:.0%} | "
                  f"{seconds / count * 1e3:.1f} | {tokens:.0f} |")


if __name__ == "__main__":
    main()
