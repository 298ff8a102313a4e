"""Gemma 3 270M (sliding windows, hybrid KV cache): TTFT cached vs cold, and decode speed, with
llama.cpp's ``llama-bench`` on the same GGUF file beside it when it is built.

Run on a quiet machine::

    .venv/bin/python benchmarks/bench_gemma.py                       # prefixserve only
    benchmarks/build_llamacpp.sh                                    # once, tens of minutes
    .venv/bin/python benchmarks/bench_gemma.py --llama-bench /work/llamacpp-build/bin/llama-bench

Smoke run (seconds, no figures worth keeping): ``--prefix-tokens 600 --repeats 1 --decode 8``.

Part 1, TTFT: a shared prefix of ``--prefix-tokens`` tokens (longer than the 512-token window)
plus a distinct question, greedy, one request at a time. Cold: the prefix cache is reset before
each request; cached: the prefix is in the cache (hit in every KV cache group). Reports median
and range over ``--repeats`` and the ratio cold / cached of the medians.
Part 2, decode: ``--decode`` tokens at batch 1 after a ``--prefix-tokens`` prompt (tokens/s,
median and range). Part 3 (with ``--llama-bench``): ``llama-bench -m GGUF -p P -n N -t T``,
prompt processing and generation tokens/s as llama.cpp reports them (mean +- sd of its own
repetitions), on the same file; prefixserve's prefill rate of part 1's cold runs is printed
beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import torch

from prefixserve import LLM, SamplingParams
from prefixserve.model.weights.named_models import named_model_path

WORDS = ("river", "ledger", "bridge", "mill", "clerk", "ferry", "spring", "stone", "town",
         "record", "copy", "late", "farmer", "wedding", "library", "north")


def median_range(values: list[float], unit: str, scale: float = 1.0) -> str:
    vals = [v * scale for v in values]
    return f"{statistics.median(vals):.3g} {unit} ({min(vals):.3g}-{max(vals):.3g})"


def prompt_ids(llm: LLM, num_tokens: int, seed: int) -> list[int]:
    words = [WORDS[(seed + i * 7) % len(WORDS)] for i in range(num_tokens * 2)]
    ids: list[int] = llm.get_tokenizer().encode(" ".join(words))
    return ids[:num_tokens]


def ttft(llm: LLM, ids: list[int]) -> float:
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))[0]
    assert out.metrics is not None and out.metrics.first_token_time is not None
    return out.metrics.first_token_time - out.metrics.arrival_time


def part_ttft(llm: LLM, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    prefix = prompt_ids(llm, args.prefix_tokens, 0)
    tokenizer = llm.get_tokenizer()
    questions = [prefix + tokenizer.encode(f" Question {i}: which {WORDS[i % 16]}? Answer:",
                                           add_special_tokens=False)
                 for i in range(args.repeats)]
    cold, cached = [], []
    for ids in questions:
        llm.reset_prefix_cache()
        cold.append(ttft(llm, ids))
    llm.reset_prefix_cache()
    ttft(llm, prefix + [107])  # prime the prefix
    for ids in questions:
        cached.append(ttft(llm, ids))
    print(f"TTFT, {args.prefix_tokens}-token shared prefix, {args.repeats} repeats")
    print(f"  cold   {median_range(cold, 'ms', 1000)}")
    print(f"  cached {median_range(cached, 'ms', 1000)}")
    print(f"  cold / cached: {statistics.median(cold) / statistics.median(cached):.2f}x")
    return cold, cached


def part_decode(llm: LLM, args: argparse.Namespace) -> None:
    rates = []
    for r in range(args.repeats):
        ids = prompt_ids(llm, args.prefix_tokens, 100 + r)
        params = SamplingParams(temperature=0, max_tokens=args.decode, ignore_eos=True)
        out = llm.generate([ids], params)[0]
        metrics = out.metrics
        assert metrics is not None and metrics.first_token_time is not None
        assert metrics.finished_time is not None
        rates.append((args.decode - 1) / (metrics.finished_time - metrics.first_token_time))
    print(f"decode at batch 1 after {args.prefix_tokens} tokens: "
          f"{median_range(rates, 'tok/s')}")


def part_llama_bench(args: argparse.Namespace, cold: list[float]) -> None:
    path = named_model_path("gemma-3-270m")
    cmd = [args.llama_bench, "-m", path, "-p", str(args.prefix_tokens), "-n", str(args.decode),
           "-t", str(args.threads), "-o", "json"]
    print("llama-bench:", " ".join(cmd))
    result = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    for row in result:
        kind = "prompt" if row.get("n_prompt") else "generation"
        print(f"  llama.cpp {kind}: {row['avg_ts']:.1f} +- {row['stddev_ts']:.1f} tok/s")
    rate = args.prefix_tokens / statistics.median(cold)
    print(f"  prefixserve prompt (cold TTFT): {rate:.1f} tok/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--llama-bench", help="path of llama.cpp's llama-bench binary")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    llm = LLM(model="gemma-3-270m", dtype=args.dtype, weights=args.weights)
    print(f"loaded in {time.perf_counter() - start:.1f} s ({llm.engine.dtype}, "
          f"weights {args.weights}, {args.threads} threads)")
    cold, _ = part_ttft(llm, args)
    part_decode(llm, args)
    if args.llama_bench:
        part_llama_bench(args, cold)


if __name__ == "__main__":
    main()
