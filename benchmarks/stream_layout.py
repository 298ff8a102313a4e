"""The products of one Q4_0 weight in the stream layout against the same weight in the file's
layout, in one run (``kernels/stream.c``, docs/kernels.md).

    .venv/bin/python benchmarks/stream_layout.py [--shapes 16384x2048,2048x8192]
        [--rows 1,4,16,64,512] [--repeat 12] [--threads 2]

For each shape (output rows x width; the defaults are Llama 3.2 1B's gate/up and down) a random
Q4_0 weight is held twice, as ``QuantLinear(weight)`` (the stream layout) and
``QuantLinear(weight, stream=False)``; for each row count and activation dtype (float32, bfloat16)
the two products alternate ``--repeat`` times and the fastest of each is kept. Prints the times
and their ratio (stream / file: below 1, the stream layout is faster). Timings include the
product's own set-up (activation rounding, the unpacking of the stream layout's groups for more
than one row). Needs the kernels' 512-bit build (else the two layouts are the same).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from prefixserve.model.weights.quant import (
    FMT_Q4_0,
    FMT_Q4_0S,
    QuantLinear,
    pack_float,
)


def fastest(layers: dict[str, QuantLinear], x: torch.Tensor, repeat: int) -> dict[str, float]:
    """The fastest of ``repeat`` calls of each layer on ``x``, alternated, in seconds."""
    best = dict.fromkeys(layers, float("inf"))
    for _ in range(repeat):
        for name, layer in layers.items():
            start = time.perf_counter()
            layer(x)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="16384x2048,2048x8192")
    parser.add_argument("--rows", default="1,4,16,64,512")
    parser.add_argument("--repeat", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print("| weight | rows | activations | file layout, ms | stream layout, ms | stream / file |")
    print("|---|---:|---|---:|---:|---:|")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        packed = pack_float(rng.standard_normal((n, k)).astype(np.float32), FMT_Q4_0)
        layers = {"file": QuantLinear(packed, stream=False), "stream": QuantLinear(packed)}
        if layers["stream"].fmt != FMT_Q4_0S:
            raise SystemExit(f"{shape}: no stream layout here (the kernels' 512-bit build, "
                             "rows in fours, a width that is a multiple of 128)")
        for m in (int(v) for v in args.rows.split(",")):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(dtype)
                best = fastest(layers, x, args.repeat if m < 512 else max(2, args.repeat // 3))
                print(f"| {n} x {k} | {m} | {str(dtype).removeprefix('torch.')} | "
                      f"{best['file'] * 1e3:.2f} | {best['stream'] * 1e3:.2f} | "
                      f"{best['stream'] / best['file']:.2f} |")


if __name__ == "__main__":
    main()
