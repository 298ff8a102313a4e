"""What a grammar mask costs per constrained token, and what it costs the rows without one.

One sampling step of a batch of ``--batch`` rows over the default model's vocabulary (random
logits, temperature 1), three ways: no row constrained; one row under a JSON-schema grammar
(a nested schema with enums, arrays and required fields); every row under it. A constrained
row samples under its mask, and its matcher advances by the token drawn (a row whose grammar
ends starts a new document), so the masks are those of real JSON generation. Also timed alone:
the engine's mask step (``StructuredOutputs.masks``: sync the matchers, fill llguidance's
bitmask, unpack it) per constrained row.

Each configuration runs ``--steps`` steps, ``--repeats`` times, interleaved; the table gives
the median per step with the spread (min-max) and the ratios to the unconstrained step. The
cost per constrained token is (one-row step - plain step); the rows without a grammar pay
nothing for it (they are never masked or copied apart from the batch's one clone).

Command (on a quiet machine; timing figures measured on a busy one mean nothing):

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_grammar.py \\
        --batch 8 --steps 300 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from prefixserve.engine.structured_output import StructuredOutputs
from prefixserve.model.sampler import Sampler
from prefixserve.model.text.tokenizer import load_tokenizer
from prefixserve.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "role": {"enum": ["admin", "user", "guest"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
    },
    "required": ["name", "role", "age", "address", "tags"],
}


class Rows:
    """``batch`` rows of which the first ``constrained`` follow the schema."""

    def __init__(self, structured: StructuredOutputs, spec: StructuredOutputsParams,
                 batch: int, constrained: int, eos: tuple[int, ...]) -> None:
        self.structured, self.spec, self.eos = structured, spec, eos
        self.grammar = structured.compile(spec)
        self.batch, self.constrained = batch, constrained
        self.serial = 0
        self.ids = [self._new() if i < constrained else f"free-{i}" for i in range(batch)]
        self.outputs: list[list[int]] = [[] for _ in range(batch)]

    def _new(self) -> str:
        self.serial += 1
        sequence_id = f"g-{self.serial}"
        self.structured.add(sequence_id, self.grammar, self.spec)
        return sequence_id

    def step_masks(self) -> dict[int, torch.Tensor]:
        return self.structured.masks([(self.ids[i], self.outputs[i], 0)
                                      for i in range(self.batch)])

    def advance(self, tokens: list[int]) -> None:
        for row, token in enumerate(tokens):
            if row < self.constrained and (token in self.eos or len(self.outputs[row]) > 200):
                self.structured.remove(self.ids[row])
                self.ids[row], self.outputs[row] = self._new(), []
            else:
                self.outputs[row].append(token)


def run(rows: Rows, sampler: Sampler, steps: int, vocab: int) -> float:
    """Seconds per step of masks + sampling + advancing."""
    params = [SamplingParams(temperature=1.0)] * rows.batch
    generators = [None] * rows.batch
    prompts = [[1]] * rows.batch
    logits = torch.randn(rows.batch, vocab)
    start = time.perf_counter()
    for _ in range(steps):
        masks = rows.step_masks() if rows.constrained else None
        out = sampler.sample(logits, params, generators, prompts, rows.outputs, token_masks=masks)
        rows.advance(out.token_ids)
    return (time.perf_counter() - start) / steps


def run_masks_only(rows: Rows, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        masks = rows.step_masks()
        # advance each constrained row by its first allowed token
        rows.advance([int(masks[r].nonzero()[0]) if r in masks else 0
                      for r in range(rows.batch)])
    return (time.perf_counter() - start) / steps / max(1, rows.constrained)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tokenizer = load_tokenizer(None)
    vocab = tokenizer.vocab_size
    structured = StructuredOutputs(tokenizer, vocab, tokenizer.eos_token_ids)
    spec = StructuredOutputsParams(json=SCHEMA)
    sampler = Sampler(tokenizer.eos_token_ids)
    eos = tokenizer.eos_token_ids
    configs = {"plain (no grammar)": 0, "1 row constrained": 1,
               f"{args.batch} rows constrained": args.batch}
    times: dict[str, list[float]] = {name: [] for name in configs}
    mask_times: list[float] = []
    run(Rows(structured, spec, args.batch, 1, eos), sampler, 20, vocab)  # warm up
    for _ in range(args.repeats):
        for name, constrained in configs.items():
            rows = Rows(structured, spec, args.batch, constrained, eos)
            times[name].append(run(rows, sampler, args.steps, vocab))
        mask_times.append(run_masks_only(Rows(structured, spec, args.batch, args.batch, eos),
                                         args.steps))
    base = statistics.median(times["plain (no grammar)"])
    print(f"batch {args.batch}, vocabulary {vocab}, {args.steps} steps x {args.repeats} "
          "repeats; ms per step: median (min-max), ratio to plain")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:<24} {median * 1e3:8.3f} ({min(values) * 1e3:.3f}-"
              f"{max(values) * 1e3:.3f})  x{median / base:.2f}")
    cost = statistics.median(times["1 row constrained"]) - base
    print(f"  cost per constrained token (1-row step - plain step): {cost * 1e3:.3f} ms")
    print(f"  mask step alone per constrained row: {statistics.median(mask_times) * 1e3:.3f} ms "
          f"({min(mask_times) * 1e3:.3f}-{max(mask_times) * 1e3:.3f})")


if __name__ == "__main__":
    main()
