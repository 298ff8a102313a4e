"""Quantized weights: kernel speed by batch rows, and what quantized activations do to tokens.

    .venv/bin/python benchmarks/bench_quant.py [--parts 1,2,3,7,8] [--threads N] [--repeat 5]

Part 1 times one product ``x @ W.T`` for each weight shape of the default model (SmolLM2-135M)
with M input rows: the packed kernel with 16-bit and with 8-bit activations, the expand path
(weight slices dequantized to float32, then torch's GEMM) and a dense float32 weight (what
``--weights bf16`` holds on a CPU without native bfloat16). Median of ``--repeat`` runs of 20
calls each, in microseconds. It is the measurement behind ``quant.SMALL_M``.

Part 2 runs the default model over ``--positions`` tokens of natural text (this repository's
docs), ``SMALL_M`` positions per forward so every product takes the packed kernel, and compares
the next-token argmax and the perplexity with the dense float32 model of the same GGUF file
(teacher forcing: every model sees the same tokens), with 16- and 8-bit activations and with
a float16 and a bfloat16 KV cache, then a bfloat16 model, packed (whose products of 8-16 rows
take the bfloat16 kernel on AVX512-BF16) and dense, with torch's attention, and the packed one
through the C attention the engine's prompt steps take, attending in bfloat16
(``bf16_queries``) and in float32. It is the measurement behind ``quant.ACTIVATION_BITS``, the
bfloat16 batch kernel, the bfloat16 attention and ``--kv-cache-dtype``.

Part 3 is the engine on the default model four ways, interleaved run by run: packed weights
(``--weights auto``) with the fused decode step, packed weights with ``--enforce-eager`` (the
decode step layer by layer in torch), dense weights (``--weights bf16``, float32 on a CPU
without native bfloat16) with ``--enforce-eager``: the path before packed weights, torch's
attention included, the reference of issue 11's ratios; and dense weights as the engine runs
them, attending through the C kernel. Resident weight bytes, prefill
tokens/s of a 1,024-token prompt, greedy decode tokens/s of 1 sequence (after 32 and after
1,024 prompt tokens), of 8 and of 16 (prefill excluded); medians with ranges and ratios.
With ``--llama-bench PATH`` llama.cpp's ``llama-bench`` then runs on the same GGUF file
(``-p 1024 -n 128 -r 3``, the same threads) and the ratios to it are printed.

Part 4 measures what bounds one sequence's decode step: the memory read bandwidth of the
machine (a torch sum over 512 MiB) against the rate at which the M = 1 products read their
packed weights (all layers' products, and the head); with ``--compare-kernel PATH`` it also
times another ``decode.c``'s layers beside this one's. Part 5 times the fused decode layers
from the thread that loaded the model and from another one (why the server's engine thread
loads the model itself). Part 6 splits the fused step of 16 sequences at ~1,100 tokens of context
into products and attention, with and without shared prefixes; with a bfloat16 model and cache
it also times this kernel attending in float32 (``bf16_queries`` off), and
``--compare-kernel PATH`` times another ``decode.c`` beside this one, e.g. an earlier commit's
whose ``DecodeModel`` has the same fields (it includes ``quant.c``, so copy that beside it):

    mkdir -p /tmp/k && git show REV:prefixserve/model/kernels/decode.c > /tmp/k/decode.c
    cp prefixserve/model/kernels/quant.c /tmp/k/
    .venv/bin/python benchmarks/bench_quant.py --parts 6 --compare-kernel /tmp/k/decode.c

    .venv/bin/python benchmarks/bench_quant.py --parts 3 --repeat 3 \
        --llama-bench /work/llamacpp-build/bin/llama-bench

Part 7 times one product of a bfloat16 model, x @ W.T with bfloat16 rows, by M, for each
weight shape of the default model packed as the file has it (Q4_1 layers, Q8_0 head): the
16-bit integer kernel (what fewer rows than the bfloat16 kernels' thresholds take), the bfloat16
batch kernel (AVX512-BF16), the AMX tile kernel (AMX-BF16) and expand-and-GEMM in bfloat16;
columns a CPU's build lacks are empty. It is the measurement behind ``amx_rows()`` in
``quant.c`` and ``quant.AMX_MAX``.

Part 8 times one bfloat16 product of 160 to 2,000 rows (a prompt step) for the default
model's weights and Gemma 3 270M's shapes, Q4_1: the large-row AMX kernel
(``gemm_bf16_amx_large``), expand-and-GEMM into a reused buffer, and the dense bfloat16 GEMM of
the same weights, with the way the engine takes. It is the measurement behind
``quant.AMX_LARGE_MAX_ROWS`` and ``quant.AMX_LARGE_MAX_OUTPUTS``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import prefixserve.model.weights.quant as quant
from prefixserve import LLM
from prefixserve.model.arch.config import default_model_path
from prefixserve.model.attention import fused_decode
from prefixserve.model.attention import prompt as prompt_attention
from prefixserve.model.attention.paged import TableRows, build_metadata
from prefixserve.model.text.tokenizer import load_tokenizer
from prefixserve.model.weights import quant_kernels
from prefixserve.model.weights.loader import load_model

# bench_engine.py lies beside this script (its folder is on sys.path when run as a script).
from bench_engine import decode_rate, median_range, ours_decode, ours_prefill  # isort: skip

# (name, rows N, cols K) of SmolLM2-135M's products.
SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
          ("head", 49152, 576)]
ROWS = (1, 2, 4, 8, 16, 64)
REPO = Path(__file__).resolve().parent.parent


def median_us(fn: Callable[[], object], repeat: int, calls: int = 20) -> float:
    fn()
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


def kernel_row(lin: quant.QuantLinear, dense: torch.Tensor, m: int, repeat: int) -> list[float]:
    x = torch.randn(m, lin.in_features)
    times = []
    for bits in (16, 8):
        lin.activation_bits = bits
        times.append(median_us(lambda: lin._small(x), repeat))
    times.append(median_us(lambda: lin._large(x, torch.float32), repeat))
    times.append(median_us(lambda: x @ dense.t(), repeat))
    lin.activation_bits = quant.ACTIVATION_BITS
    return times


def table_head(title: str, *columns: str) -> None:
    """A part's heading and its table's header rows (Markdown)."""
    print(f"\n## {title}")
    print("| " + " | ".join(columns) + " |")
    print("|---" * len(columns) + "|")


def part_kernels(repeat: int) -> None:
    table_head("Part 1: one product x @ W.T, microseconds (median of repeats)",
               "weight", "N x K", "format", "M", "kernel 16-bit act.", "kernel 8-bit act.",
               "expand + GEMM", "dense float32", "best packed vs dense")
    rng = np.random.default_rng(0)
    for name, n, k in SHAPES:
        weight = rng.standard_normal((n, k), dtype=np.float32)
        dense = torch.from_numpy(weight)
        for fmt in (quant.FMT_Q4_1, quant.FMT_Q8_0):
            lin = quant.QuantLinear(quant.pack_float(weight, fmt))
            for m in ROWS:
                k16, k8, expand, flt = kernel_row(lin, dense, m, repeat)
                best = min(k16, expand) if m <= quant.SMALL_M else expand
                print(f"| {name} | {n} x {k} | {quant.FORMAT_NAMES[fmt]} | {m} | {k16:.0f} | "
                      f"{k8:.0f} | {expand:.0f} | {flt:.0f} | {flt / best:.2f}x |")


BF16_ROWS = (1, 2, 4, 6, 8, 16, 32, 64, 96, 128, 192, 256)


def bfloat16_times(lin: quant.QuantLinear, m: int, repeat: int) -> dict[str, float]:
    """Microseconds of one product of ``m`` bfloat16 rows by each way this build has."""
    x = torch.randn(m, lin.in_features).bfloat16()
    times = {"16-bit": median_us(lambda: lin._small(x.float()), repeat, 5)}
    if lin.bf16_batch_from:
        times["batch"] = median_us(lambda: lin._bf16_batch(x), repeat, 5)
    if lin.amx_from:
        times["AMX"] = median_us(lambda: lin._bf16_amx(x), repeat, 5)
    times["expand"] = median_us(lambda: lin._large(x, torch.bfloat16), repeat, 5)
    return times


def part_bfloat16_kernels(repeat: int) -> None:
    table_head("Part 7: one bfloat16 product x @ W.T, microseconds (median of repeats)",
               "weight", "N x K", "format", "M", "16-bit kernel", "bfloat16 batch kernel",
               "AMX kernel", "expand + bfloat16 GEMM", "fastest")
    rng = np.random.default_rng(0)
    for name, n, k in SHAPES:
        fmt = quant.FMT_Q8_0 if name == "head" else quant.FMT_Q4_1
        lin = quant.QuantLinear(quant.pack_float(rng.standard_normal((n, k), dtype=np.float32),
                                                 fmt))
        for m in BF16_ROWS:
            times = bfloat16_times(lin, m, repeat)
            cells = [f"{times[c]:.0f}" if c in times else "" for c in
                     ("16-bit", "batch", "AMX", "expand")]
            print(f"| {name} | {n} x {k} | {quant.FORMAT_NAMES[fmt]} | {m} | "
                  f"{' | '.join(cells)} | {min(times, key=times.__getitem__)} |")


LARGE_ROWS = (160, 256, 512, 1024, 2000)
GEMMA_SHAPES = [("gemma qkv", 1536, 640), ("gemma o", 640, 1024), ("gemma gate_up", 4096, 640),
                ("gemma down", 640, 2048)]


def part_large_products(repeat: int) -> None:
    table_head("Part 8: one bfloat16 product of many rows, microseconds (median of repeats)",
               "weight", "N x K", "M", "large-row AMX kernel", "expand + bfloat16 GEMM",
               "dense bfloat16 GEMM", "AMX / expand", "the engine takes")
    rng = np.random.default_rng(0)
    for name, n, k in SHAPES[:-1] + GEMMA_SHAPES:
        packed = quant.pack_float(rng.standard_normal((n, k), dtype=np.float32), quant.FMT_Q4_1)
        lin = quant.QuantLinear(packed)
        dense = quant.dequantize_packed(packed).bfloat16()
        for m in LARGE_ROWS:
            amx, expand, gemm = large_product_times(lin, dense, m, repeat)
            taken = "large-row AMX" if lin._amx_large_rows(m) else "expand"
            ratio = f"{amx / expand:.2f}x" if amx else ""
            print(f"| {name} | {n} x {k} | {m} | {f'{amx:.0f}' if amx else ''} | {expand:.0f} "
                  f"| {gemm:.0f} | {ratio} | {taken} |")


def large_product_times(lin: quant.QuantLinear, dense: torch.Tensor, m: int, repeat: int
                        ) -> tuple[float | None, float, float]:
    """Microseconds of one product of ``m`` bfloat16 rows: the large-row AMX kernel (None
    without AMX), expand-and-GEMM, and the dense GEMM."""
    x = torch.randn(m, lin.in_features).bfloat16()
    amx = median_us(lambda: lin._bf16_amx_large(x), repeat, 5) if lin.amx_from else None
    return (amx, median_us(lambda: lin._large(x, torch.bfloat16), repeat, 5),
            median_us(lambda: x @ dense.t(), repeat, 5))


def text_tokens(count: int) -> list[int]:
    text = "\n\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    text += "\n\n" + (REPO / "README.md").read_text()
    ids = load_tokenizer(None).encode(text)
    if len(ids) < count + 1:
        raise SystemExit(f"only {len(ids)} tokens of text, fewer than {count + 1}")
    return ids[: count + 1]


def next_token_logits(weights: str, ids: list[int], rows: int,
                      cache_dtype: torch.dtype = torch.float32,
                      dtype: torch.dtype = torch.float32,
                      kernel_attention: bool | None = None) -> torch.Tensor | None:
    """Logits of every position after the first, computed ``rows`` positions per forward, the
    model in ``dtype``, the KV cache in ``cache_dtype``. Attention is torch's SDPA, or with
    ``kernel_attention`` the C kernel's that the engine's prompt steps take
    (``prompt_attention``), its ``bf16_queries`` set to the flag's value: None where this
    CPU's build has no such kernel for the model's head size."""
    config, net = load_model(None, dtype, "cpu", weights)
    block_size, blocks = 16, len(ids) // 16 + 2
    cache = torch.zeros(config.num_hidden_layers, 2, blocks * block_size,
                        config.num_key_value_heads, config.head_dim, dtype=cache_dtype)
    table = list(range(blocks))
    kernel, table_rows = None, None
    if kernel_attention is not None:
        if not prompt_attention.available(config.head_dim):
            return None
        kernel = prompt_attention.PromptAttention(
            config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            block_size, cache, bf16_queries=kernel_attention)
        table_rows = TableRows(torch.tensor([table]), [0])
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, rows):
            part = ids[start : min(start + rows, len(ids) - 1)]
            meta = build_metadata([(start, len(part))], [table], block_size,
                                  torch.device("cpu"), torch.float32, table_rows,
                                  kernel=kernel)
            hidden = net(torch.tensor(part), torch.arange(start, start + len(part)), cache, meta,
                         block_size)
            out.append(net.compute_logits(hidden))
    return torch.cat(out)


def perplexity(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return math.exp(torch.nn.functional.cross_entropy(logits, targets).item())


def accuracy_reference(positions: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """``positions`` + 1 tokens of text, the next-token targets, and the dense float32 model's
    logits at every position (the reference of the accuracy tables)."""
    ids = text_tokens(positions)
    reference = next_token_logits("bf16", ids, 256)
    assert reference is not None  # SDPA: always
    return ids, torch.tensor(ids[1:]), reference


def part_accuracy(positions: int) -> None:
    print(f"\n## Part 2: next-token agreement with the dense float32 model, {positions} "
          "positions of this repository's docs (teacher forcing)")
    ids, targets, reference = accuracy_reference(positions)
    top1 = reference.argmax(-1)
    print("| activations | KV cache | top-1 agreement | positions that differ | perplexity | "
          "reference perplexity |")
    print("|---|---|---|---|---|---|")
    for bits, cache in ((16, torch.float32), (8, torch.float32), (16, torch.float16),
                        (16, torch.bfloat16)):
        quant.ACTIVATION_BITS = bits
        logits = next_token_logits("auto", ids, quant.SMALL_M, cache)
        assert logits is not None
        same = (logits.argmax(-1) == top1).float().mean().item()
        differ = int((logits.argmax(-1) != top1).sum())
        print(f"| {bits}-bit | {str(cache).removeprefix('torch.')} | {same:.2%} | {differ} | "
              f"{perplexity(logits, targets):.3f} | {perplexity(reference, targets):.3f} |")
    quant.ACTIVATION_BITS = 16
    # A bfloat16 model: packed (on AVX512-BF16 its products of 8-16 rows take bfloat16
    # activations) and dense (--weights bf16), both against the same float32 reference.
    # The packed bfloat16 model also through the C kernel's attention (the engine's prompt
    # steps), attending in bfloat16 (bf16_queries, on AVX512-BF16) and in float32.
    cases: list[tuple[str, str, bool | None]] = [
        ("bfloat16 model, packed", "auto", None), ("bfloat16 model, dense", "bf16", None),
        ("bfloat16 model, packed, kernel attention in bfloat16", "auto", True),
        ("bfloat16 model, packed, kernel attention in float32", "auto", False)]
    for label, weights, kernel_attention in cases:
        computed = next_token_logits(weights, ids, quant.SMALL_M, torch.bfloat16,
                                     torch.bfloat16, kernel_attention)
        if computed is None:
            print(f"| {label} | bfloat16 | no such kernel on this CPU | | | |")
            continue
        logits = computed.float()
        same = (logits.argmax(-1) == top1).float().mean().item()
        differ = int((logits.argmax(-1) != top1).sum())
        print(f"| {label} | bfloat16 | {same:.2%} | {differ} | "
              f"{perplexity(logits, targets):.3f} | {perplexity(reference, targets):.3f} |")


ENGINES = (("fused", {"weights": "auto"}), ("eager", {"weights": "auto", "enforce_eager": True}),
           ("dense", {"weights": "bf16", "enforce_eager": True}),
           ("dense, kernel attention", {"weights": "bf16"}))


def long_decode(llm: LLM, rng: random.Random, context: int = 1024) -> float:
    """Greedy decode tokens/s of one sequence after a ``context``-token prompt."""
    return decode_rate(llm, [[rng.randrange(1000, 20000) for _ in range(context)]])


def part_engine(repeat: int) -> dict[str, float]:
    """The engine three ways, interleaved run by run; returns the fused engine's medians."""
    print("\n## Part 3: the engine: packed weights with the fused decode step (auto), packed "
          "with --enforce-eager, dense (--weights bf16) with --enforce-eager (torch's "
          "attention: the path before packed weights) and as the engine runs it (the C "
          "kernel's attention)")
    kwargs = {"kv_cache_memory": "1GiB", "max_num_batched_tokens": 2048, "max_num_seqs": 32}
    llms = {name: LLM(**options, **kwargs) for name, options in ENGINES}
    sizes = {name: quant.module_bytes(llm.engine.runner.model) / 2**20
             for name, llm in llms.items()}
    cases: list[tuple[str, Callable[[LLM, random.Random], float]]] = [
        ("prefill 1024 tok/s", lambda llm, rng: ours_prefill(llm, 1024, rng)),
        ("decode x1 tok/s", lambda llm, rng: ours_decode(llm, 1, rng)),
        ("decode x1 after 1,024 tokens, tok/s", long_decode),
        ("decode x8 tok/s", lambda llm, rng: ours_decode(llm, 8, rng)),
        ("decode x16 tok/s", lambda llm, rng: ours_decode(llm, 16, rng)),
    ]
    others = [name for name, _ in ENGINES if name != "fused"]
    print("| case | fused (auto) | eager (auto) | dense (bf16), torch attention | dense (bf16), "
          "kernel attention | " + " | ".join(f"fused / {name}" for name in others) + " |")
    print("|---" * (2 + 2 * len(others)) + "|")
    print(f"| resident weights MiB | {' | '.join(f'{sizes[n]:.1f}' for n, _ in ENGINES)} | | "
          f"{sizes['fused'] / sizes['dense']:.2f}x | |")
    medians = {}
    for label, run in cases:
        rates: dict[str, list[float]] = {name: [] for name, _ in ENGINES}
        for i in range(repeat):
            for name, _ in ENGINES:
                rates[name].append(run(llms[name], random.Random(i)))
        cells = [median_range(rates[name], "{:.1f}") for name, _ in ENGINES]
        ratios = [median_range([a / b for a, b in zip(rates["fused"], rates[other], strict=True)],
                               "{:.2f}") + "x" for other in others]
        print(f"| {label} | {' | '.join(cells)} | {' | '.join(ratios)} |")
        medians[label] = statistics.median(rates["fused"])
    return medians


def part_llama_bench(binary: str, threads: int, ours: dict[str, float]) -> None:
    """llama.cpp's ``llama-bench`` on the same GGUF file, right after part 3, and our ratios."""
    model = str(default_model_path())
    cmd = [binary, "-m", model, "-t", str(threads), "-p", "1024", "-n", "128", "-r", "3",
           "-o", "json"]
    print("\n## llama-bench:", " ".join(cmd))
    rows = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    for row in rows:
        test = "decode" if row["n_gen"] else "prefill"
        rate, spread = row["avg_ts"], row["stddev_ts"]
        ours_rate = ours["decode x1 tok/s" if test == "decode" else "prefill 1024 tok/s"]
        name = f"tg{row['n_gen']}" if row["n_gen"] else f"pp{row['n_prompt']}"
        print(f"| {test} ({name}) | llama.cpp {rate:.1f} ± {spread:.1f} tok/s | "
              f"prefixserve (fused) {ours_rate:.1f} | {ours_rate / rate:.2f}x |")


def part_bandwidth(repeat: int, compare: str | None = None) -> None:
    """What bounds a decode step of one sequence: the machine's memory read bandwidth (a torch
    sum over 512 MiB, far more than any cache) against the rate at which the fused decode
    layers (at one position of context: their products, plus norms and a trivial attention)
    and the head read the default model's packed weights, each weight once per pass as in a
    decode step. With ``compare`` (another ``decode.c``) its layers are timed too, each
    repeat interleaved with this kernel's."""
    print("\n## Part 4: memory read bandwidth vs one sequence's decode step")
    big = torch.ones(2**27, dtype=torch.float32)
    llm = LLM(weights="auto", num_blocks=16)
    runner = llm.engine.runner
    model = runner.model
    fused = fused_decode.FusedDecode(model, runner.kv_cache, runner.block_size)
    x = torch.randn(1, model.config.hidden_size)
    tables = torch.zeros((1, 4), dtype=torch.long)
    head = model.embed_tokens.head if model.lm_head is None else model.lm_head
    layer_bytes = sum(b.numel() for layer in model.layers for b in layer.buffers())
    rows = [("torch sum, 512 MiB float32", lambda: big.sum(), big.numel() * 4),
            (f"fused layers ({len(model.layers)}), 1 position",
             lambda: fused.run(x.clone(), [0], tables, [0]),
             layer_bytes),
            ("head (one product, M = 1)", lambda: head(x), head.qweight.numel())]
    if compare:
        other = quant_kernels.KernelLibrary(Path(compare), fused_decode._declare).get()
        assert other is not None, f"{compare} did not build"
        libs = {"this kernel": fused._lib, "compared": other}
        layers: dict[str, list[float]] = {name: [] for name in libs}
        for _ in range(repeat):
            for name, lib in libs.items():
                fused._lib = lib
                layers[name].append(median_us(rows[1][1], 1, calls=5) / 1e3)
        fused._lib = libs["this kernel"]
        for name, runs in layers.items():
            print(f"fused layers, {name}: {statistics.median(runs):.2f} ms "
                  f"({min(runs):.2f}-{max(runs):.2f}), median (range) of {repeat}")
    print("| what | ms per pass | bytes read | GB/s |")
    print("|---|---|---|---|")
    for label, fn, nbytes in rows:
        ms = median_us(fn, repeat, calls=5) / 1e3
        print(f"| {label} | {ms:.2f} | {nbytes / 2**20:.1f} MiB | {nbytes / ms / 1e6:.1f} |")


def part_threads(repeat: int) -> None:
    """The fused decode layers (one sequence, one position of context) timed from the thread
    that loaded the model and from another thread, as the server ran them before its engine
    thread loaded the model itself (two OpenMP thread pools on the same cores)."""
    print("\n## Part 5: the fused step from the loading thread vs from another thread")
    llm = LLM(weights="auto", num_blocks=16)
    runner = llm.engine.runner
    fused = fused_decode.FusedDecode(runner.model, runner.kv_cache, runner.block_size)
    x = torch.randn(1, runner.model.config.hidden_size)
    tables = torch.zeros((1, 4), dtype=torch.long)

    def step() -> None:
        fused.run(x.clone(), [0], tables, [0])

    results: dict[str, float] = {"loading thread": median_us(step, repeat) / 1e3}
    other = threading.Thread(target=lambda: results.update(
        {"another thread": median_us(step, repeat) / 1e3}))
    other.start()
    other.join()
    print("| thread | ms per step |")
    print("|---|---|")
    for name, ms in results.items():
        print(f"| {name} | {ms:.2f} |")


#: Part 6's batch: the decode step of side_by_side at 16 clients on shared-prefix traffic
#: (a 1,024-token system prompt, a 64-token question, up to 64 tokens of answer).
LONG_ROWS, LONG_CONTEXT, LONG_SHARED = 16, 1100, 1024


def long_tables(groups: int, block_size: int) -> tuple[torch.Tensor, int]:
    """Block tables of LONG_ROWS rows of LONG_CONTEXT + 1 positions: row b shares its first
    LONG_SHARED positions with the rows of its group (b % groups), or nothing when groups is
    0. Returns the tables and how many distinct blocks they hold."""
    width = LONG_CONTEXT // block_size + 1
    tables = torch.zeros((LONG_ROWS, width), dtype=torch.long)
    shared: dict[tuple[int, int], int] = {}
    count = 0
    for b in range(LONG_ROWS):
        for j in range(width):
            key = (b % groups, j) if groups and j < LONG_SHARED // block_size else (-1 - b, j)
            if key not in shared:
                count += 1
                shared[key] = count
            tables[b, j] = shared[key]
    return tables, count


def part_long_contexts(repeat: int, compare: str | None) -> None:
    """Part 6 with a float32, a bfloat16 and a float16 cache (a compared kernel must read all
    three: round 2's on)."""
    for cache in ("float32", "bfloat16", "float16"):
        long_contexts(repeat, compare, cache)


def long_contexts(repeat: int, compare: str | None, cache: str) -> None:
    """Where the fused decode step of 16 sequences at ~1,100 tokens of context goes: its
    layers at one position of context (the products), and at 1,100 with no shared blocks,
    with the rows in 7 groups sharing a 1,024-token prefix (side_by_side's shared-prefix
    traffic at 16 clients) and all sharing one, the KV cache in ``cache``. Attention is the
    difference from one position; bytes are the distinct K/V bytes it reads. With ``compare``
    (another ``decode.c``, e.g. an earlier commit's) both kernels run, interleaved."""
    print(f"\n## Part 6: {LONG_ROWS} sequences at {LONG_CONTEXT} tokens of context, "
          f"{cache} KV cache")
    llm = LLM(weights="auto", kv_cache_dtype=cache,
              num_blocks=LONG_ROWS * (LONG_CONTEXT // 16 + 2))
    runner = llm.engine.runner
    fused = fused_decode.FusedDecode(runner.model, runner.kv_cache, runner.block_size)
    # name: (library, whether a bfloat16 model attends in bfloat16 over a bfloat16 cache)
    scored = bool(fused.model.bf16_queries)
    kernels = {"this kernel": (fused._lib, scored)}
    if scored and cache == "bfloat16":
        kernels["this kernel, float32 attention"] = (fused._lib, False)
    if compare:
        other = quant_kernels.KernelLibrary(Path(compare), fused_decode._declare).get()
        assert other is not None, f"{compare} did not build"
        kernels["compared"] = (other, scored)
    config = runner.model.config
    block_bytes = (runner.block_size * len(runner.model.layers) * 2 * config.num_key_value_heads
                   * config.head_dim * runner.kv_cache.element_size())
    x = torch.randn(LONG_ROWS, config.hidden_size)
    cases = [("1 position", 0, 0), ("1,100, nothing shared", 0, LONG_CONTEXT),
             ("1,100, 7 prefix groups", 7, LONG_CONTEXT), ("1,100, one prefix", 1, LONG_CONTEXT)]
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeat):
        for label, groups, pos in cases:
            tables, _ = long_tables(groups, runner.block_size)
            for name, (lib, bf16_queries) in kernels.items():
                fused._lib, fused.model.bf16_queries = lib, int(bf16_queries)
                runs = times.setdefault((label, name), [])
                runs.append(median_us(lambda pos=pos, tables=tables: fused.run(
                    x.clone(), [pos] * LONG_ROWS, tables, list(range(LONG_ROWS))), 1, 3) / 1e3)
    fused._lib, fused.model.bf16_queries = kernels["this kernel"][0], int(scored)
    print("| context | kernel | step ms | attention ms | K/V read | GB/s |")
    print("|---|---|---|---|---|---|")
    for label, groups, pos in cases:
        for name in kernels:
            step = statistics.median(times[(label, name)])
            attention = step - statistics.median(times[(cases[0][0], name)])
            blocks = long_tables(groups, runner.block_size)[1] if pos else 0
            nbytes = blocks * block_bytes
            rate = f"{nbytes / attention / 1e6:.1f}" if pos and attention > 0 else ""
            print(f"| {label} | {name} | {step:.1f} ({min(times[(label, name)]):.1f}-"
                  f"{max(times[(label, name)]):.1f}) | {attention:.1f} | "
                  f"{nbytes / 2**20:.0f} MiB | {rate} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="1,2,3,4,5,6,7,8",
                        help="comma-separated parts to run")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default all)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--positions", type=int, default=2048)
    parser.add_argument("--llama-bench", help="llama.cpp's llama-bench binary: run it on the "
                        "same file after part 3 and print the ratios")
    parser.add_argument("--compare-kernel", help="parts 4 and 6: another decode.c to time "
                        "beside this one (e.g. `git show REV:prefixserve/model/kernels/decode.c`)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    parts = {int(p) for p in args.parts.split(",")}
    print(f"threads {torch.get_num_threads()}, SMALL_M {quant.SMALL_M}, "
          f"ACTIVATION_BITS {quant.ACTIVATION_BITS}")
    if 1 in parts:
        part_kernels(args.repeat)
    if 2 in parts:
        part_accuracy(args.positions)
    if 4 in parts:
        part_bandwidth(args.repeat, args.compare_kernel)
    if 5 in parts:
        part_threads(args.repeat)
    if 6 in parts:
        part_long_contexts(args.repeat, args.compare_kernel)
    if 7 in parts:
        part_bfloat16_kernels(args.repeat)
    if 8 in parts:
        part_large_products(args.repeat)
    if 3 in parts:
        ours = part_engine(args.repeat)
        if args.llama_bench:
            part_llama_bench(args.llama_bench, torch.get_num_threads(), ours)


if __name__ == "__main__":
    main()
