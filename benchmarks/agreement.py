"""Top-1 agreement of packed weights with the float32 dequantized reference of the same file.

    .venv/bin/python benchmarks/agreement.py [MODEL ...] [--positions 2048] [--chunk 512]
        [--step-tokens 1]

For each model (a GGUF path or a named model; default: the default model and gemma-3-270m):
the engine in float32 with the file's packed weights (``--weights auto``: what the kernels
compute) and with dense float32 weights (``--weights bf16`` in float32: every tensor
dequantized, products in torch), teacher-forced over ``--positions`` tokens of this
repository's docs in prompts of ``--chunk`` tokens (``prompt_logprobs=1``). Prints the share of
positions whose most likely next token is the same, and the packed formats the file holds.
``--step-tokens 1`` caps the packed engine's steps at one token (chunked prefill,
``max_num_batched_tokens=1``), so that every product has one row and runs the one-row
kernels of decode steps; otherwise prompt steps run the batch products.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from prefixserve import LLM, SamplingParams
from prefixserve.model.weights.quant import FORMAT_NAMES, QuantEmbedding, QuantLinear

REPO = Path(__file__).resolve().parent.parent


def top1(llm: LLM, chunks: list[list[int]]) -> list[int]:
    """The most likely next token at every position after the first of each chunk."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    best = []
    for output in llm.generate(chunks, [params] * len(chunks)):
        assert output.prompt_logprobs is not None
        for entry in output.prompt_logprobs[1:]:
            assert entry is not None
            best.append(min(entry.items(), key=lambda item: item[1].rank)[0])
    return best


def formats(llm: LLM) -> str:
    model = llm.engine.runner.model
    counts: Counter[str] = Counter()
    for module in model.modules():
        if isinstance(module, QuantLinear):
            counts[FORMAT_NAMES[module.fmt]] += 1
        elif isinstance(module, QuantEmbedding):
            counts[FORMAT_NAMES[module.head.fmt] + " (embedding)"] += 1
    return ", ".join(f"{name} x{count}" for name, count in sorted(counts.items()))


def measure(model: str | None, positions: int, chunk: int, step_tokens: int | None) -> None:
    budget = {} if step_tokens is None else {"max_num_batched_tokens": step_tokens}
    packed = LLM(model, dtype="float32", weights="auto", kv_cache_memory="256MiB", **budget)
    text = "\n\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    ids = packed.get_tokenizer().encode(text)
    count = positions // (chunk - 1) + 1
    chunks = [ids[i * chunk:(i + 1) * chunk] for i in range(count)]
    if len(chunks[-1]) < chunk:
        raise SystemExit(f"only {len(ids)} tokens of text")
    ours, held = top1(packed, chunks), formats(packed)
    packed.close()
    dense = LLM(model, dtype="float32", weights="bf16", kv_cache_memory="256MiB")
    reference = top1(dense, chunks)
    dense.close()
    same = sum(a == b for a, b in zip(ours, reference, strict=True))
    print(f"| {model or 'default model'} | {held} | {same / len(ours):.2%} "
          f"({len(ours) - same} of {len(ours)} differ) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", default=[None, "gemma-3-270m"])
    parser.add_argument("--positions", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--step-tokens", type=int, default=None)
    args = parser.parse_args()
    print("| model | packed formats | top-1 agreement with float32 dequantized |")
    print("|---|---|---|")
    for model in args.models:
        measure(model, args.positions, args.chunk, args.step_tokens)


if __name__ == "__main__":
    main()
