"""One prefill product ``x @ W.T`` by row count, for real weight shapes: the panel kernel
(``kernels/panel.c``) against the 16-bit integer batch kernel and expand-and-GEMM, in one run.

    .venv/bin/python benchmarks/prefill_products.py [--shape llama-1b|default]
        [--formats Q4_0,Q4_K,Q6_K,Q8_0] [--rows 8,16,32,64,128,512] [--repeat 5] [--threads 2]
    .venv/bin/python benchmarks/prefill_products.py --file FILE.gguf [--prompt 512] [--repeat 5]

Weights are random: normal(0, 0.02) values quantized with gguf-py (Q4_0, Q8_0; Q4_0 in the
layout the engine keeps: the stream layout where it fits), random K-quant blocks with small
fp16 scales (gguf-py cannot quantize to K-quants). For each
shape's products (q, k/v, o, gate+up, down; the head is left out: a prompt step's logits take
one row per sequence) and each row count M, the three paths alternate call by call; each
time is the median of ``--repeat`` rounds of the summed products (one layer), in ms, and the
ratios are expand-and-GEMM / panel and batch / panel (above 1: the panel is faster); the
panel's rate in multiply-adds a second is printed beside the rate of its tile alone
(``panel_peak``: one thread over data in L1, times the threads). The panel kernel exists in
every AVX2 build (256 bits; 512 on AVX-512 CPUs); elsewhere its columns are empty. It is the
measurement behind ``quant.SMALL_M`` and the panel path of ``QuantLinear``.

With ``--file``, whole prompts through the engine instead: a prompt of ``--prompt`` random
tokens (nothing cached) to its first token, on FILE's model in float32, with the panel kernel
(as shipped) and without it (every packed layer's ``panel`` off: expand-and-GEMM), alternated
prompt by prompt; prints prefill tokens/s, median and range, and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

from prefixserve.model.weights import quant_kernels
from prefixserve.model.weights.quant import QuantLinear, pack_gguf

#: (outputs, inputs) of one layer's products: q, k and v, o, gate and up, down.
SHAPES = {
    "llama-1b": [(2048, 2048), (1024, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],
    "default": [(576, 576), (384, 576), (576, 576), (3072, 576), (576, 1536)],
}
TYPES = {"Q4_0": GGMLQuantizationType.Q4_0, "Q4_1": GGMLQuantizationType.Q4_1,
         "Q4_K": GGMLQuantizationType.Q4_K,
         "Q6_K": GGMLQuantizationType.Q6_K, "Q8_0": GGMLQuantizationType.Q8_0}


#: Where the fp16 scales of a K-quant super-block lie.
SCALES = {"Q4_K": (0, 2), "Q6_K": (208,)}


def raw_weight(fmt: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """A weight's GGUF bytes ``[rows, row_bytes]``."""
    if fmt not in SCALES:
        return quantize((0.02 * rng.standard_normal((rows, cols))).astype(np.float32),
                        TYPES[fmt])
    elems, size = GGML_QUANT_SIZES[TYPES[fmt]]
    n = rows * cols // elems
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for at in SCALES[fmt]:
        blocks[:, at:at + 2] = rng.uniform(1e-4, 1e-3, n).astype(np.float16).view(
            np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)


def layers(shape: str, fmt: str) -> list[QuantLinear]:
    rng = np.random.default_rng(0)
    out = []
    for rows, cols in SHAPES[shape]:
        raw = raw_weight(fmt, rows, cols, rng)
        packed = pack_gguf(raw, int(TYPES[fmt]), cols, lambda: np.zeros(0, np.float32))
        assert packed is not None
        out.append(QuantLinear(packed))
    return out


def paths(layer: QuantLinear) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    found: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "expand": lambda x: layer._large(x, torch.float32), "batch": layer._small}
    if layer.panel:
        found["panel"] = layer._prefill
    return found


def time_rows(stack: list[QuantLinear], m: int, repeat: int) -> dict[str, float]:
    """Median ms of one layer's products of m rows, per path, the paths alternated."""
    xs = [torch.randn(m, layer.in_features) for layer in stack]
    names = list(paths(stack[0]))
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(repeat):
        for name in names:
            start = time.perf_counter()
            for layer, x in zip(stack, xs, strict=True):
                paths(layer)[name](x)
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def engine_prompts(path: str, length: int, repeat: int, threads: int) -> None:
    """Prefill tokens/s of fresh prompts, the panel kernel on and off, alternated."""
    import random

    from prefixserve import LLM, SamplingParams

    llm = LLM(path, num_threads=threads, dtype="float32", max_model_len=length + 16)
    model = llm.engine.runner.model
    packed = [m for m in model.modules() if isinstance(m, QuantLinear)]
    shipped = [m.panel for m in packed]
    if not any(shipped):
        print("this build has no panel kernel (AVX2 builds only)")
        return
    rng = random.Random(0)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    rates: dict[str, list[float]] = {"panel": [], "expand": []}
    for i in range(repeat + 1):
        for name in rates:
            for module, on in zip(packed, shipped, strict=True):
                module.panel = on and name == "panel"
            prompt = [rng.randrange(1000, 30000) for _ in range(length)]
            start = time.perf_counter()
            llm.generate(prompt, one)
            if i:  # the first round warms up
                rates[name].append(length / (time.perf_counter() - start))
    for name, r in rates.items():
        print(f"{name}: {statistics.median(r):.1f} tok/s ({min(r):.1f}-{max(r):.1f})")
    ratio = statistics.median(rates["panel"]) / statistics.median(rates["expand"])
    print(f"panel / expand: {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    parser.add_argument("--formats", default="Q4_0,Q4_K,Q6_K,Q8_0")
    parser.add_argument("--rows", default="8,16,32,64,128,512")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--file", help="whole prompts on this GGUF file's model instead")
    parser.add_argument("--prompt", type=int, default=512, help="--file: prompt tokens")
    args = parser.parse_args()
    if args.file:
        engine_prompts(args.file, args.prompt, args.repeat, args.threads)
        return
    torch.set_num_threads(args.threads)
    lib = quant_kernels.kernels()
    peak = lib.panel_peak(1 << 22) if lib is not None else 0.0
    print(f"{args.shape}, {args.threads} threads, median of {args.repeat}, ms per layer; the "
          f"panel's tile alone: {peak * args.threads / 1e9:.1f} G multiply-adds/s")
    print("| format | M | expand | batch | panel | expand / panel | batch / panel | panel G/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for fmt in args.formats.split(","):
        stack = layers(args.shape, fmt)
        for m in (int(r) for r in args.rows.split(",")):
            t = time_rows(stack, m, args.repeat)
            panel = t.get("panel")
            macs = m * sum(n * k for n, k in SHAPES[args.shape])
            cells = [f"{t['expand']:.2f}", f"{t['batch']:.2f}",
                     f"{panel:.2f}" if panel else "",
                     f"{t['expand'] / panel:.2f}x" if panel else "",
                     f"{t['batch'] / panel:.2f}x" if panel else "",
                     f"{macs / panel / 1e6:.1f}" if panel else ""]
            print(f"| {fmt} | {m} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
