"""Where one decode token's time goes on a GGUF file: the fused layers, the output head, and
the Python and torch work between them, each against the read rate of the same minutes.

    .venv/bin/python benchmarks/decode_split.py FILE.gguf [--threads 2] [--rounds 5]
        [--weight-layout stream|file] [--phases]

One greedy sequence decodes 64 tokens after a 32-token prompt (as ``real_size.py``), ``--rounds``
times, each round between two reads of 512 MiB (``real_size.read_bandwidth``). Timers wrap the
fused layer step (``FusedDecode.run``), the head's product (the head's ``QuantLinear.forward``)
and the whole logits call (``compute_logits``: the final norm, the head and their conversions);
the rest of a step is the engine's Python (scheduling, embedding, sampling, outputs). Each part
prints in ms per token and, for the two weight streams, in GB/s and as a share of the mean of
the reads around its round; median (range) over the rounds.

Then the cost of a cold cache: the model's final norm on one row, timed warm and right after a
sum over 256 MiB (what a decode step's weight stream does to the caches before the work
between the products).

``--phases`` builds the kernels with ``-DPROFILE_PHASES`` (added to ``PREFIXSERVE_KERNEL_FLAGS``)
and splits the fused layers' time further, by the first thread's clock: each product (QKV, O,
gate/up, down, with the wait for the other thread at its end) with the GB/s its weights make,
and the row-wise work between them (norms, the rotary step, the attention, the activation,
each with the rounding of the next product's input), when no weight streams.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_size import read_bandwidth

PROMPT_TOKENS = 32
DECODE_TOKENS = 64


def timed(obj: Any, name: str, spent: dict[str, float], key: str) -> None:
    """Replaces ``obj.name`` by a wrapper that adds its seconds to ``spent[key]``."""
    inner: Callable[..., Any] = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - start

    setattr(obj, name, wrapper)


def summary(values: list[float], digits: int = 2) -> str:
    return (f"{statistics.median(values):.{digits}f} "
            f"({min(values):.{digits}f}-{max(values):.{digits}f})")


def cold_norm(model: Any, dtype: Any, threads: int) -> tuple[float, float]:
    """Microseconds of the final norm on one row of ``dtype``: warm, and after a 256 MiB
    sweep."""
    import torch

    torch.set_num_threads(threads)
    x = torch.randn(1, model.config.hidden_size).to(dtype)
    sweep = torch.ones(64 << 20)
    warm, cold = [], []
    for _ in range(30):
        model.norm(x)
        start = time.perf_counter()
        model.norm(x)
        warm.append(time.perf_counter() - start)
        sweep.sum()
        start = time.perf_counter()
        model.norm(x)
        cold.append(time.perf_counter() - start)
    return 1e6 * statistics.median(warm), 1e6 * statistics.median(cold)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--weight-layout", choices=("stream", "file"), default="stream")
    parser.add_argument("--phases", action="store_true",
                        help="a profiling build: the fused layers' time by part")
    args = parser.parse_args()
    if args.phases:
        flags = os.environ.get("PREFIXSERVE_KERNEL_FLAGS", "")
        os.environ["PREFIXSERVE_KERNEL_FLAGS"] = f"{flags} -DPROFILE_PHASES".strip()
    from prefixserve import LLM, SamplingParams
    from prefixserve.model.attention import decode_kernel

    llm = LLM(args.file, num_threads=args.threads, max_model_len=2048,
              kv_cache_memory="64MiB", weight_layout=args.weight_layout)
    runner = llm.engine.runner
    model: Any = runner.model
    head: Any = model.lm_head if model.lm_head is not None else model.embed_tokens.head
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 30000) for _ in range(PROMPT_TOKENS)]
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
    llm.generate(prompt, params)  # builds the fused step
    if runner._fused is None:
        sys.exit("this model does not take the fused decode step")
    if not hasattr(head, "qweight"):
        sys.exit("this model's output head is not packed (a dense head): nothing to split")
    spent: dict[str, float] = defaultdict(float)
    timed(runner._fused, "run", spent, "layers")
    timed(model, "compute_logits", spent, "logits")
    timed(head, "forward", spent, "head")
    layer_bytes = sum(_weight_bytes(model, head))
    head_bytes = head.qweight.numel() * head.qweight.element_size()
    rows: dict[str, list[float]] = defaultdict(list)
    lib = decode_kernel.library.get()
    timers = (ctypes.c_double * len(PHASES))()
    for i in range(args.rounds):
        before = read_bandwidth(args.threads, 3)
        spent.clear()
        lib.phase_times(timers)
        start = time.perf_counter()
        llm.generate(prompt + [7 + i], params)
        total = time.perf_counter() - start
        timed_parts = lib.phase_times(timers)
        read = (before + read_bandwidth(args.threads, 3)) / 2
        for name, seconds in zip(PHASES, timers[:timed_parts], strict=False):
            rows[f"phase {name}"].append(1e3 * seconds / DECODE_TOKENS)
        per = {k: v / DECODE_TOKENS for k, v in spent.items()}
        rows["token"].append(1e3 * total / DECODE_TOKENS)
        rows["layers"].append(1e3 * per["layers"])
        rows["head"].append(1e3 * per["head"])
        rows["norm and conversions"].append(1e3 * (per["logits"] - per["head"]))
        rows["python"].append(1e3 * (total / DECODE_TOKENS - per["layers"] - per["logits"]))
        rows["read"].append(read)
        rows["layers %"].append(100 * layer_bytes / per["layers"] / 1e9 / read)
        rows["head %"].append(100 * head_bytes / per["head"] / 1e9 / read)
        rows["token %"].append(100 * (layer_bytes + head_bytes) * DECODE_TOKENS / total / 1e9
                               / read)
    _report(args, rows, layer_bytes, head_bytes, cold_norm(model, runner.dtype, args.threads))
    if rows["phase QKV"]:
        _report_phases(rows, _role_bytes(model))
    elif args.phases:
        print("the kernel library has no phase timers (built without -DPROFILE_PHASES)")


def _weight_bytes(model: Any, head: Any) -> list[int]:
    """Bytes of every packed projection of the layers (the head not counted)."""
    from prefixserve.model.weights.quant import QuantLinear

    seen, out = {head.qweight.data_ptr()}, []
    for module in model.modules():
        if isinstance(module, QuantLinear) and module.qweight.data_ptr() not in seen:
            seen.add(module.qweight.data_ptr())
            out.append(module.qweight.numel() * module.qweight.element_size())
    return out


#: The parts of a layer that ``phase_times`` reports, in its order; products by the name of
#: their module (``SplitQuantLinear`` parts included).
PHASES = ("input norm", "QKV", "rotary and attention", "O", "post-attention norm", "gate/up",
          "activation", "down")
ROLES = {"QKV": "qkv_proj", "O": "o_proj", "gate/up": "gate_up_proj", "down": "down_proj"}


def _role_bytes(model: Any) -> dict[str, int]:
    """Bytes of each product's packed weights over all layers, by the part's name."""
    from prefixserve.model.weights.quant import QuantLinear

    out: dict[str, int] = defaultdict(int)
    for name, module in model.named_modules():
        for part, role in ROLES.items():
            if isinstance(module, QuantLinear) and f".{role}" in name:
                out[part] += module.qweight.numel() * module.qweight.element_size()
    return out


def _report_phases(rows: dict[str, list[float]], role_bytes: dict[str, int]) -> None:
    read = statistics.median(rows["read"])
    print("| part of the fused layers | ms per token | GB/s of its weights | share of the read |")
    print("|---|---:|---:|---:|")
    for name in PHASES:
        ms = rows[f"phase {name}"]
        if name in role_bytes:
            rate = role_bytes[name] / (statistics.median(ms) / 1e3) / 1e9
            print(f"| {name} | {summary(ms, 3)} | {rate:.1f} | {100 * rate / read:.1f}% |")
        else:
            print(f"| {name} (no weights) | {summary(ms, 3)} | | |")


def _report(args: argparse.Namespace, rows: dict[str, list[float]], layer_bytes: int,
            head_bytes: int, norm_us: tuple[float, float]) -> None:
    print(f"$ python benchmarks/decode_split.py {args.file} --threads {args.threads} "
          f"--rounds {args.rounds} --weight-layout {args.weight_layout}")
    print(f"layers {layer_bytes / 2**20:.0f} MiB, head {head_bytes / 2**20:.0f} MiB; "
          f"median (range) of {args.rounds} rounds")
    print("| part | ms per token | share of the read rate around its round |")
    print("|---|---:|---:|")
    print(f"| whole token | {summary(rows['token'])} | {summary(rows['token %'], 1)}% |")
    print(f"| fused layers | {summary(rows['layers'])} | {summary(rows['layers %'], 1)}% |")
    print(f"| head product | {summary(rows['head'])} | {summary(rows['head %'], 1)}% |")
    print(f"| final norm and conversions | {summary(rows['norm and conversions'])} | |")
    print(f"| the engine's Python | {summary(rows['python'])} | |")
    print(f"read rate around each round: {summary(rows['read'], 1)} GB/s")
    print(f"final norm of one row: {norm_us[0]:.0f} us warm, {norm_us[1]:.0f} us right after "
          f"a 256 MiB sweep")


if __name__ == "__main__":
    main()
