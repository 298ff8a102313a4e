"""Multi-LoRA serving on the default model: throughput with 1, 4 and 8 adapters mixed into
shared-prefix traffic, against the base model alone, and the prefix-cache hit rate per adapter.

Reproduce with (on a quiet machine; the timings mean nothing while other work runs)::

    .venv/bin/python benchmarks/bench_lora.py                       # 1, 4, 8 adapters, 3 repeats
    .venv/bin/python benchmarks/bench_lora.py --adapters 0,1,4,8 --repeat 5 --rank 16
    .venv/bin/python benchmarks/bench_lora.py --groups 2 --prompts-per-group 4 --repeat 1  # smoke

Workload (the same for every row): ``--groups`` groups of ``--prompts-per-group`` prompts, each
prompt a ``--prefix-tokens`` system prompt shared by its group plus ``--question-tokens`` of its
own, ``--max-tokens`` greedy tokens each, all submitted at once to one ``LLM``
(``max_num_seqs`` 32). The row's k adapters are random PEFT adapters of rank ``--rank`` on all
seven projections, written to a temporary directory. Two assignments: **by group** (every
request of group g under adapter ``g % k``: each tenant's prefix under its own adapter, so the
hit rate stays that of the base model while k adapters run in the same batches) and **mixed**
(request i of group g under ``(g + i) % k``: every adapter sees every group, so each shared
prefix is computed once per adapter namespace, the most the split can cost). Rows:

* ``base, LoRA off``: an engine without adapter slots (the reference of every ratio);
* ``base, LoRA on``: the same requests with ``enable_lora`` and no adapter (the cost of the
  slots when unused);
* ``k adapters, by group`` and ``k adapters, mixed``: k in ``--adapters`` (``--max-loras``
  slots, default 8: no swaps up to 8).

Each row runs ``--repeat`` times, in rounds of one run per row (both engines held at once),
with a cold cache (``reset_prefix_cache``), and reports the median and the range of output
tokens/s and requests/s, the median over the rounds of its tokens/s over the reference's in the
same round, and the token hit rate of the prompts overall and per adapter (from
``LLMEngine.lora_cache_counts``: hit rates do not depend on machine load).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import save_file

from prefixserve import LLM, SamplingParams
from prefixserve.model.arch.config import ModelConfig
from prefixserve.model.arch.lora import part_shapes
from prefixserve.model.weights.gguf_file import GGUFFile
from prefixserve.model.weights.loader import default_model_path

PEFT = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
        "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
        "down": "mlp.down_proj"}


def write_adapter(path: Path, config: ModelConfig, rank: int, seed: int) -> str:
    """A random PEFT adapter of ``rank`` on every projection of every layer."""
    import json

    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for part, (out, inp) in part_shapes(config).items():
            key = f"base_model.model.model.layers.{layer}.{PEFT[part]}"
            tensors[f"{key}.lora_A.weight"] = 0.03 * torch.randn(rank, inp, generator=gen)
            tensors[f"{key}.lora_B.weight"] = 0.03 * torch.randn(out, rank, generator=gen)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
         "target_modules": [m.split(".")[1] for m in PEFT.values()]}))
    return str(path)


Request = tuple[int, int, list[int]]


def workload(args: argparse.Namespace) -> list[Request]:
    """``(group, index in the group, token ids)`` of every request, groups interleaved."""
    out = []
    for i in range(args.prompts_per_group):
        for g in range(args.groups):
            prefix = [1000 + (g * 7919 + j * 104729) % 30000 for j in range(args.prefix_tokens)]
            question = [200 + (g * 31 + i * 977 + j * 13) % 700
                        for j in range(args.question_tokens)]
            out.append((g, i, prefix + question))
    return out


def adapter_of(group: int, index: int, names: list[str], mixed: bool) -> str | None:
    """By group, every request of group g runs under adapter g % k (each group's prefix is
    computed once); mixed, request i of group g under (g + i) % k (each prefix once per
    adapter: the most the split can cost)."""
    if not names:
        return None
    return names[((group + index) if mixed else group) % len(names)]


def run_once(llm: LLM, requests: list[Request], names: list[str], mixed: bool,
             params: SamplingParams) -> tuple[float, int, dict[str, tuple[int, int]]]:
    """Seconds, output tokens and (queries, hits) per adapter name for one cold run."""
    engine = llm.engine
    llm.reset_prefix_cache()
    before = {k: (v.queries, v.hits) for k, v in engine.lora_cache_counts().items()}
    stats = engine.get_stats()
    total_before = (stats.prefix_cache_query_tokens, stats.prefix_cache_hit_tokens)
    states = []
    start = time.perf_counter()
    for group, index, ids in requests:
        request_id = engine.add_request(ids, params, lora=adapter_of(group, index, names, mixed))
        states.append(engine.request_state(request_id))
    while engine.has_unfinished_requests():
        engine.step()
    seconds = time.perf_counter() - start
    tokens = sum(len(s.output(delta=False).outputs[0].token_ids) for s in states)
    counts = {}
    for name, value in engine.lora_cache_counts().items():
        q0, h0 = before.get(name, (0, 0))
        if value.queries > q0:
            counts[name or "base"] = (value.queries - q0, value.hits - h0)
    stats = engine.get_stats()
    counts["all"] = (stats.prefix_cache_query_tokens - total_before[0],
                     stats.prefix_cache_hit_tokens - total_before[1])
    return seconds, tokens, counts


Row = tuple[str, LLM, list[str], bool]
"""A row of the table: its name, the engine, the adapter names it uses and whether mixed."""


def measure(rows: list[Row], requests: list[Request], args: argparse.Namespace
            ) -> list[tuple[str, dict[str, Any]]]:
    """Every row warmed up, then ``--repeat`` rounds of one run of each row in turn: a machine
    whose speed drifts (a VM's can swing by 1.5x within minutes) slows every row alike, where
    all of one row's runs before the next's would set the drift into the ratios."""
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for _, llm, names, mixed in rows:
        run_once(llm, requests[: min(4, len(requests))], names, mixed, params)
    runs: dict[str, list[tuple[float, int, dict[str, tuple[int, int]]]]] = {
        name: [] for name, *_ in rows}
    for _ in range(args.repeat):
        for name, llm, names, mixed in rows:
            runs[name].append(run_once(llm, requests, names, mixed, params))
    return [(name, summary(runs[name], len(requests))) for name, *_ in rows]


def summary(runs: list[tuple[float, int, dict[str, tuple[int, int]]]], num_requests: int
            ) -> dict[str, Any]:
    tok_s = [tokens / seconds for seconds, tokens, _ in runs]
    req_s = [num_requests / seconds for seconds, _, _ in runs]
    counts = dict(runs[-1][2])
    queries, hits = counts.pop("all")
    return {"tok_s": tok_s, "req_s": req_s, "hit_rate": hits / queries if queries else 0.0,
            "per_adapter": {k: h / q if q else 0.0 for k, (q, h) in sorted(counts.items())}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--adapters", default="1,4,8", help="adapter counts (default 1,4,8)")
    parser.add_argument("--max-loras", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--prompts-per-group", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--num-blocks", type=int, default=2048)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--weights", default="auto")
    args = parser.parse_args()
    counts = [int(k) for k in args.adapters.split(",") if k.strip()]
    gguf = GGUFFile(default_model_path())
    config = ModelConfig.from_gguf_metadata(gguf.metadata, set(gguf.tensors))
    requests = workload(args)
    # 2,048 blocks (1.5 GiB of float32 KV) hold 32 running requests of ~560 tokens and more.
    common = {"dtype": args.dtype, "weights": args.weights, "num_blocks": args.num_blocks,
              "max_num_seqs": 32}
    plain = LLM(**common)  # both engines at once: 2 x 1.5 GiB of KV
    with tempfile.TemporaryDirectory() as tmp:
        paths = {f"lora{i}": write_adapter(Path(tmp) / f"lora{i}", config, args.rank, i)
                 for i in range(max(counts, default=0))}
        llm = LLM(**common, enable_lora=True, max_loras=args.max_loras,
                  max_lora_rank=args.rank, lora_modules=paths)
        table: list[Row] = [("base, LoRA off", plain, [], False), ("base, LoRA on", llm, [], False)]
        for k in counts:
            if k:
                names = list(paths)[:k]
                table.append((f"{k} adapter(s), by group", llm, names, False))
                table.append((f"{k} adapter(s), mixed", llm, names, True))
        rows = measure(table, requests, args)
    report(rows, args, len(requests))


def report(rows: list[tuple[str, dict[str, Any]]], args: argparse.Namespace,
           num_requests: int) -> None:
    table = Table(title=f"{num_requests} requests: {args.groups} groups x "
                  f"{args.prompts_per_group}, {args.prefix_tokens}-token shared prefix + "
                  f"{args.question_tokens}, {args.max_tokens} output tokens; rank {args.rank}, "
                  f"{args.dtype}, weights {args.weights}; median (min-max) of {args.repeat}")
    for column in ("traffic", "output tok/s", "req/s", "vs base", "hit rate",
                   "hit rate per adapter"):
        table.add_column(column)
    reference = rows[0][1]["tok_s"]
    for name, row in rows:
        tok, req = row["tok_s"], row["req_s"]
        ratio = statistics.median(t / r for t, r in zip(tok, reference, strict=True))
        per = ", ".join(f"{k} {v:.1%}" for k, v in row["per_adapter"].items())
        table.add_row(name, f"{statistics.median(tok):.1f} ({min(tok):.1f}-{max(tok):.1f})",
                      f"{statistics.median(req):.2f}",
                      f"{ratio:.2f}x", f"{row['hit_rate']:.1%}",
                      per)
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
