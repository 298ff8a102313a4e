"""What 8-bit integer products would buy the default model on this CPU: their rate, and what
rounding the activations to 8 bits costs in next-token agreement (issue 11, round 11).

    .venv/bin/python benchmarks/int8_products.py [--rows 16,1274] [--repeat 15]
        [--positions 2048] [--parts 1,2]

Part 1, rates. Each product of the default model (layer 0's packed Q4_1 qkv, o, gate_up and
down, and the Q8_0 output head up to 64 rows) at each row count, the candidates timed in turn
call by call (median of --repeat calls; GFLOP/s = 2 x rows x out x in / time):
- ``engine``: ``QuantLinear`` on bfloat16 rows, as the engine multiplies them (the bfloat16
  batch kernel up to 64 rows, expand-and-GEMM above; the fused decode step runs the same
  batch kernel);
- ``bf16 GEMM``: torch's bfloat16 GEMM (oneDNN) on the weights expanded beforehand, so the
  expansion is not in the time;
- ``int8 GEMM``: ``torch._int_mm`` on int8 rows and int8 weights: the GEMM alone (rounding
  the rows and scaling the int32 sums back are not in the time);
- ``int8 dynamic``: torch's dynamic int8 linear (``quantized::linear_dynamic``, the x86
  engine): float32 rows rounded to int8 with one scale per call, per-channel int8 weights,
  float32 out, all in the time.

Part 2, accuracy. Next-token top-1 agreement with the dense float32 model and perplexity over
``--positions`` tokens of this repository's docs (``bench_quant.py`` part 2's text and
reference), 256 positions a forward, the bfloat16 model with the kernel's attention as the
engine's prompt steps run it. The decoder layers' products are computed in float32 from the
packed weights and rows, each rounded as an int8 product would take them (symmetric, 127
levels): nothing rounded (the baseline of this part), weights per output channel, rows per
token, rows per call (one scale for all rows, as the dynamic linear), weights per channel and
rows per token (what ``torch._int_mm`` with scales on both sides computes), and rows per block
of 32 (as llama.cpp rounds the rows of its Q4/Q8 products: accurate, but a product of such rows
needs a scale per block inside the sum, which neither int8 GEMM above has). The head is left
as it is. The engine's own products (bfloat16 GEMM) are the first row.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from bench_quant import accuracy_reference, next_token_logits, perplexity

from prefixserve.model.weights import quant
from prefixserve.model.weights.loader import load_model

BLOCK = 32  # llama.cpp rounds the rows of its Q4/Q8 products to int8 in blocks of 32
Rounding = tuple[str, str]  # weights: "" or "channel"; rows: "", "token", "call" or "block"


def round_int8(t: torch.Tensor, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of ``t`` with one scale per slice along ``dim`` (None: one for all)."""
    top = t.abs().amax() if dim is None else t.abs().amax(dim, keepdim=True)
    scale = top.clamp_min(1e-12) / 127
    return torch.round(t / scale).clamp(-127, 127).to(torch.int8), scale


def candidates(linear: quant.QuantLinear, rows: int) -> dict[str, Callable[[], object]]:
    n, k = linear.out_features, linear.in_features
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    dense = linear._expand(0, n, torch.bfloat16)
    weight = linear._expand(0, n)
    w8, w_scale = round_int8(weight, 1)
    x8, _ = round_int8(x.float(), 1)
    per_channel = torch.quantize_per_channel(weight, w_scale.reshape(-1).double(),
                                             torch.zeros(n, dtype=torch.long), 0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(per_channel, None)
    xf = x.float()
    return {"engine": lambda: linear(x), "bf16 GEMM": lambda: x @ dense.t(),
            "int8 GEMM": lambda: torch._int_mm(x8, w8.t()),
            "int8 dynamic": lambda: torch.ops.quantized.linear_dynamic(xf, packed, False)}


def part_rates(row_counts: list[int], repeat: int) -> None:
    print("\n## Part 1: products of the default model, GFLOP/s (median of "
          f"{repeat} calls; ms in brackets)")
    torch.backends.quantized.engine = "x86"
    _, net = load_model(None, torch.bfloat16, "cpu", "auto")
    layer = net.layers[0]
    products = {"qkv": layer.attn.qkv_proj, "o": layer.attn.o_proj,
                "gate_up": layer.mlp.gate_up_proj, "down": layer.mlp.down_proj,
                "head": net.embed_tokens.head}
    names = ["engine", "bf16 GEMM", "int8 GEMM", "int8 dynamic"]
    print("| rows | product | " + " | ".join(names) + " | int8 GEMM / engine |")
    print("|---|---|" + "---|" * (len(names) + 1))
    with torch.inference_mode():
        for rows in row_counts:
            for label, linear in products.items():
                if label == "head" and rows > quant.BF16_BATCH_MAX:
                    continue  # prompt steps take the head for their last positions only
                calls = candidates(linear, rows)
                times: dict[str, list[float]] = {name: [] for name in calls}
                for _ in range(repeat + 2):  # the first two of each are warm-up
                    for name, call in calls.items():
                        begin = time.perf_counter()
                        call()
                        times[name].append(time.perf_counter() - begin)
                flops = 2 * rows * linear.out_features * linear.in_features
                med = {name: statistics.median(t[2:]) for name, t in times.items()}
                cells = [f"{flops / med[n] / 1e9:.0f} ({med[n] * 1e3:.3f})" for n in names]
                print(f"| {rows} | {label} | " + " | ".join(cells) +
                      f" | {med['engine'] / med['int8 GEMM']:.2f}x |")


def rounded_large(rounding: Rounding, vocab: int) -> Callable[..., torch.Tensor]:
    """A stand-in for ``QuantLinear._large``: float32 products of rounded weights and rows."""
    weights_by, rows_by = rounding
    keep = quant.QuantLinear._large

    def large(self: quant.QuantLinear, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.out_features == vocab:
            return keep(self, x, dtype)
        weight, rows = self._expand(0, self.out_features), x.float()
        if weights_by == "channel":
            w8, scale = round_int8(weight, 1)
            weight = w8.float() * scale
        if rows_by:
            shaped = rows.reshape(len(rows), -1, BLOCK) if rows_by == "block" else rows
            r8, scale = round_int8(shaped, None if rows_by == "call" else -1)
            rows = (r8.float() * scale).reshape(rows.shape)
        return (rows @ weight.t()).to(dtype)

    return large


def part_accuracy(positions: int) -> None:
    print(f"\n## Part 2: next-token agreement with the dense float32 model, {positions} "
          "positions, 256 a forward, the bfloat16 model")
    ids, targets, reference = accuracy_reference(positions)
    top1 = reference.argmax(-1)
    config, _ = load_model(None, torch.bfloat16, "cpu", "auto")
    cases: list[tuple[str, Rounding | None]] = [
        ("the engine (bfloat16 GEMM)", None), ("float32, nothing rounded", ("", "")),
        ("weights per channel", ("channel", "")), ("rows per token", ("", "token")),
        ("rows per call", ("", "call")),
        ("weights per channel, rows per token", ("channel", "token")),
        (f"rows per block of {BLOCK} (llama.cpp's Q8 rows)", ("", "block"))]
    print("| products | top-1 agreement | positions that differ | perplexity | reference |")
    print("|---|---|---|---|---|")
    keep = quant.QuantLinear._large
    try:
        for label, rounding in cases:
            quant.QuantLinear._large = (  # type: ignore[method-assign]
                keep if rounding is None else rounded_large(rounding, config.vocab_size))
            logits = next_token_logits("auto", ids, 256, torch.bfloat16, torch.bfloat16, True)
            assert logits is not None, "no kernel attention on this CPU"
            logits = logits.float()
            differ = int((logits.argmax(-1) != top1).sum())
            print(f"| {label} | {1 - differ / len(top1):.2%} | {differ} | "
                  f"{perplexity(logits, targets):.3f} | {perplexity(reference, targets):.3f} |")
    finally:
        quant.QuantLinear._large = keep  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="16,1274", help="row counts of part 1")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--positions", type=int, default=2048)
    parser.add_argument("--parts", default="1,2")
    args = parser.parse_args()
    torch.set_num_threads(2)
    parts = {int(p) for p in args.parts.split(",")}
    if 1 in parts:
        part_rates([int(r) for r in args.rows.split(",")], args.repeat)
    if 2 in parts:
        part_accuracy(args.positions)


if __name__ == "__main__":
    main()
