"""Decode and prefill speed on real-size GGUF files, side by side with llama.cpp in one run.

    .venv/bin/python benchmarks/real_size.py FILE.gguf [FILE.gguf ...] \
        [--llama-bench /work/llamacpp-build/bin/llama-bench] [--threads 2] [--repeats 3]

Files of real shapes come from ``benchmarks/real_size_gguf.py``. For each file, in one process
per file (so that load time and RSS are the file's alone): load time and RSS growth at load,
decode tokens/s of one greedy sequence (64 tokens after a 32-token prompt), prefill tokens/s
of a 512-token prompt, the weight bytes one decode step streams (every matmul weight and the
output head, from the loaded model) and the rate that makes at the measured step time, against
the read bandwidth of the same machine measured in the same run (a torch sum over 512 MiB with
the same threads). With ``--llama-bench``: ``llama-bench -p 512 -n 64`` on the same file, and
the ratios. Prints a table; median of the repeats with the range.
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
DECODE_TOKENS = 64
PREFILL_TOKENS = 512


def rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def read_bandwidth(threads: int, repeats: int = 5) -> float:
    """GB/s of a torch sum over 512 MiB of float32 (best of ``repeats``)."""
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(128 << 20)
    data.sum()
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = max(best, data.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return best


def streamed_bytes(llm: object) -> int:
    """Bytes of the matmul weights one decode step reads: every packed weight and dense
    Linear weight of the model (the token embedding reads one row; a tied head counts once)."""
    from torch import nn

    from prefixserve.model.weights.quant import QuantEmbedding, QuantLinear

    model = llm.engine.runner.model  # type: ignore[attr-defined]
    total, seen = 0, set()
    for module in model.modules():
        tensor = None
        if isinstance(module, QuantLinear):
            tensor = module.qweight
        elif isinstance(module, nn.Linear):
            tensor = module.weight
        elif isinstance(module, QuantEmbedding):
            tensor = module.head.qweight
        if tensor is not None and tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def measure_file(path: str, threads: int, repeats: int) -> dict[str, float | list[float]]:
    """One file's figures, in this process."""
    from prefixserve import LLM, SamplingParams

    before = rss_bytes()
    start = time.perf_counter()
    llm = LLM(path, num_threads=threads, max_model_len=2048, kv_cache_memory="64MiB")
    load = time.perf_counter() - start
    growth = rss_bytes() - before
    top = min(llm.get_tokenizer().vocab_size, 40000)
    rng = random.Random(0)
    decode, prefill = [], []
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    for i in range(repeats + 1):
        llm.reset_prefix_cache()
        prompt = [rng.randrange(1000, top) for _ in range(PROMPT_TOKENS)]
        llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        start = time.perf_counter()
        llm.generate(prompt + [7], params)
        spent = time.perf_counter() - start
        long = [rng.randrange(1000, top) for _ in range(PREFILL_TOKENS)]
        start = time.perf_counter()
        llm.generate(long, one)
        if i:  # the first round warms up
            decode.append(DECODE_TOKENS / spent)
            prefill.append(PREFILL_TOKENS / (time.perf_counter() - start))
    return {"load_s": load, "rss_growth": growth, "file_bytes": os.path.getsize(path),
            "streamed": streamed_bytes(llm), "decode": decode, "prefill": prefill}


def llama_bench(binary: str, path: str, threads: int, repeats: int) -> dict[str, float]:
    out = subprocess.run([binary, "-m", path, "-t", str(threads), "-p", str(PREFILL_TOKENS),
                          "-n", str(DECODE_TOKENS), "-r", str(repeats), "-o", "json"],
                         capture_output=True, text=True, check=True).stdout
    rows = json.loads(out[out.index("["):])
    result = {}
    for row in rows:
        key = "prefill" if row["n_prompt"] else "decode"
        result[key] = float(row["avg_ts"])
    return result


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def report(path: str, mine: dict, bandwidth: float, peer: dict[str, float] | None) -> None:
    name = os.path.basename(path)
    decode = statistics.median(mine["decode"])
    gbs = mine["streamed"] * decode / 1e9
    print(f"\n## {name}  ({mine['file_bytes'] / 2**20:.0f} MiB)")
    print(f"load {mine['load_s']:.2f} s; RSS growth {mine['rss_growth'] / 2**20:.0f} MiB "
          f"= {mine['rss_growth'] / mine['file_bytes']:.2f}x the file")
    print(f"decode 1 seq: {summary(mine['decode'])} tok/s; {mine['streamed'] / 2**20:.0f} MiB "
          f"streamed per token = {gbs:.1f} GB/s, {gbs / bandwidth:.0%} of the {bandwidth:.1f} "
          f"GB/s read rate")
    print(f"prefill {PREFILL_TOKENS}: {summary(mine['prefill'])} tok/s")
    if peer:
        print(f"llama-bench: tg{DECODE_TOKENS} {peer['decode']:.1f} tok/s "
              f"(ratio {decode / peer['decode']:.2f}x); pp{PREFILL_TOKENS} "
              f"{peer['prefill']:.1f} (ratio "
              f"{statistics.median(mine['prefill']) / peer['prefill']:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--llama-bench", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # child: one file, figures as JSON on the last line
        print(json.dumps(measure_file(args.files[0], args.threads, args.repeats)))
        return
    bandwidth = read_bandwidth(args.threads)
    print(f"read bandwidth ({args.threads} threads, torch sum of 512 MiB): {bandwidth:.1f} GB/s")
    for path in args.files:
        out = subprocess.run([sys.executable, __file__, "--one", path, "--threads",
                              str(args.threads), "--repeats", str(args.repeats)],
                             capture_output=True, text=True, check=True).stdout
        mine = json.loads(out.strip().splitlines()[-1])
        peer = (llama_bench(args.llama_bench, path, args.threads, args.repeats)
                if args.llama_bench else None)
        report(path, mine, bandwidth, peer)


if __name__ == "__main__":
    main()
