"""bfloat16 against float32 for the default model's matmul shapes, on this CPU.

    python benchmarks/bench_dtype.py [--repeats 7] [--threads N]

Prints, for each shape (rows x the weight's out x in), the median time of ``torch.nn.functional
.linear`` in float32 and in bfloat16 and their ratio, with whether the CPU has native bfloat16
(AVX512-BF16 or AMX), which is what ``dtype="auto"`` decides on. Nothing else should be busy.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from prefixserve.model.weights.dtypes import cpu_has_native_bfloat16

#: (out, in) of SmolLM2-135M's projections: q/o, k/v, MLP up, MLP down, the output head.
SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576))
ROWS = (1, 16, 256)


def median_ms(x: torch.Tensor, w: torch.Tensor, repeats: int) -> float:
    torch.nn.functional.linear(x, w)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"CPU: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, native bfloat16: {cpu_has_native_bfloat16()}")
    print(f"{'rows':>5} {'out x in':>12} {'float32 ms':>11} {'bfloat16 ms':>12} {'bf16/fp32':>10}")
    generator = torch.Generator().manual_seed(0)
    for out_features, in_features in SHAPES:
        w = torch.randn(out_features, in_features, generator=generator)
        for rows in ROWS:
            x = torch.randn(rows, in_features, generator=generator)
            fp32 = median_ms(x, w, args.repeats)
            bf16 = median_ms(x.bfloat16(), w.bfloat16(), args.repeats)
            print(f"{rows:>5} {out_features:>6}x{in_features:<5} {fp32:>11.3f} {bf16:>12.3f} "
                  f"{bf16 / fp32:>9.1f}x")


if __name__ == "__main__":
    main()
