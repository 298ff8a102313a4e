"""llama.cpp's raw speed on a GGUF file, for the comparison in bench_engine's part 3.

Runs in the virtual environment that holds llama-cpp-python (a benchmark-only dependency built
from source), not in prefixserve's::

    python3.11 -m venv /work/llamacpp-venv
    /work/llamacpp-venv/bin/pip install 'llama-cpp-python[server]==0.3.36'
    /work/llamacpp-venv/bin/python benchmarks/llamacpp_speed.py MODEL.gguf

Prints prefill tokens/s at 256 / 1,024 / 2,048 tokens and greedy decode tokens/s at batch 1
(llama-cpp-python decodes one sequence at a time), 2 threads, median of 3 with the range.
"""

from __future__ import annotations

import random
import statistics
import sys
import time

from llama_cpp import Llama


def summary(rates: list[float]) -> str:
    return f"{statistics.median(rates):.0f} ({min(rates):.0f}-{max(rates):.0f}) tok/s"


def main() -> None:
    llm = Llama(model_path=sys.argv[1], n_threads=2, n_ctx=4096, verbose=False)
    rng = random.Random(0)
    for n in (256, 1024, 2048):
        rates = []
        for _ in range(3):
            tokens = [rng.randrange(1000, 40000) for _ in range(n)]
            llm.reset()
            start = time.perf_counter()
            llm.eval(tokens)
            rates.append(n / (time.perf_counter() - start))
        print(f"prefill {n}: {summary(rates)}")
    rates = []
    for _ in range(3):
        llm.reset()
        llm.eval([rng.randrange(1000, 40000) for _ in range(32)])
        start = time.perf_counter()
        for _ in range(32):
            llm.eval([llm.sample(temp=0.0)])
        rates.append(32 / (time.perf_counter() - start))
    print(f"decode x1: {summary(rates)}")


if __name__ == "__main__":
    main()
