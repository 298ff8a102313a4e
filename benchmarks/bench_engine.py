"""The engine on the default model: what the prefix cache buys, what it costs, and raw speed.

Reproduce with::

    .venv/bin/python benchmarks/bench_engine.py                 # all four parts, float32
    .venv/bin/python benchmarks/bench_engine.py --dtype bfloat16 --parts 3
    .venv/bin/python benchmarks/bench_engine.py --parts 5 --repeat 5    # per-step breakdown

Parts 1-4 compare within one run, as ratios:

1. TTFT of a 64-token question on a cached 1,024-token prefix vs the same request cold, next to
   the 1/(1-h) bound on the prefill speed-up (h = cached share of the prompt).
2. Throughput at a 0% hit rate with prefix caching on vs off (unique prompts: the cache only
   costs, one hash and one map insert per full block).
3. Prefill tokens/s at 256 / 1,024 / 2,048 tokens and decode tokens/s at batch 1 / 8 / 32,
   for prefixserve and Hugging Face transformers on the same weights and dtype.
4. Decode tokens/s of 16 sequences on shared cached prefixes, with the two-pass attention for
   shared prefixes and without it (plain: every sequence copies its whole context).

Part 5 splits one greedy decode step of 1 and of 8 sequences (after a 32-token prompt) into
the model (forward pass and logits, ``ModelRunner.model_seconds``) and everything else the
engine does in ``LLMEngine.step``: scheduling and block bookkeeping, the runner's inputs and
attention metadata, sampling, output processing (detokenisation included) and the rest.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from prefixserve import LLM, SamplingParams
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.model.attention import shared_prefix as shared_prefix_attention

console = Console()


def median_range(values: list[float], fmt: str = "{:.3f}") -> str:
    med = statistics.median(values)
    return f"{fmt.format(med)} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def ttft(engine: LLMEngine, prompt: list[int]) -> float:
    """Seconds from submission to the first token of one request running alone."""
    start = time.perf_counter()
    request_id = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    assert request_id not in engine.output_processor.requests
    return time.perf_counter() - start


def part1(llm: LLM, repeat: int) -> None:
    engine = llm.engine
    rng = random.Random(0)
    ratios, cold_times, warm_times = [], [], []
    for _ in range(repeat):
        prefix = random_tokens(rng, 1024)
        question = random_tokens(rng, 64)
        ttft(engine, random_tokens(rng, 64))  # warm the code paths
        cold = ttft(engine, prefix + question)  # computes all 1,088 tokens, caches the prefix
        warm = ttft(engine, prefix + random_tokens(rng, 64))  # new question, cached prefix
        cold_times.append(cold)
        warm_times.append(warm)
        ratios.append(warm / cold)
    h = 1024 / 1088
    table = Table(title="1. TTFT, 64-token question after a 1,024-token prefix")
    for col in ("cold TTFT s", "cached TTFT s", "ratio", "bound 1-h", "target"):
        table.add_column(col, justify="right")
    table.add_row(median_range(cold_times), median_range(warm_times), median_range(ratios),
                  f"{1 - h:.3f}", "<= 0.13")
    console.print(table)


def throughput(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    """Generated + prompt tokens per second for the whole batch."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outputs)
    return tokens / elapsed


def part2(model_kwargs: dict, repeat: int) -> None:
    on = LLM(**model_kwargs)
    off = LLM(enable_prefix_caching=False, **model_kwargs)
    rng = random.Random(1)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ratios, on_tps, off_tps = [], [], []
    throughput(on, [random_tokens(rng, 64)], params)
    throughput(off, [random_tokens(rng, 64)], params)
    for i in range(repeat):
        prompts = [random_tokens(rng, 256) for _ in range(16)]  # unique: 0% hits
        pair = [(on, on_tps), (off, off_tps)]
        if i % 2:
            pair.reverse()
        result = {}
        for llm, sink in pair:
            result[id(llm)] = throughput(llm, prompts, params)
            sink.append(result[id(llm)])
        ratios.append(result[id(on)] / result[id(off)])
        assert on.engine.metrics.hits == 0
    table = Table(title="2. Throughput at 0% hits, 16 x (256 prompt + 32 output) tokens")
    for col in ("caching on tok/s", "caching off tok/s", "on / off", "target"):
        table.add_column(col, justify="right")
    table.add_row(median_range(on_tps, "{:.0f}"), median_range(off_tps, "{:.0f}"),
                  median_range(ratios), ">= 0.99")
    console.print(table)


def ours_prefill(llm: LLM, n: int, rng: random.Random) -> float:
    llm.reset_prefix_cache()
    return n / ttft(llm.engine, random_tokens(rng, n))


def ours_decode(llm: LLM, batch: int, rng: random.Random, steps: int = 32) -> float:
    """Decode tokens/s of ``batch`` requests decoding together (prefill excluded)."""
    return decode_rate(llm, [random_tokens(rng, 32) for _ in range(batch)], steps)


def decode_rate(llm: LLM, prompts: list[list[int]], steps: int = 32) -> float:
    """Decode tokens/s of ``prompts`` decoding together (prefill excluded)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    while any(r.num_computed_tokens < r.num_tokens - 1 or not r.output_token_ids
              for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    start = time.perf_counter()
    generated = engine.generation_tokens
    while engine.has_unfinished_requests():
        engine.step()
    return (engine.generation_tokens - generated) / (time.perf_counter() - start)


def hf_model(dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from prefixserve.model.arch.config import default_model_path

    path = default_model_path()
    folder, name = os.path.dirname(path), os.path.basename(path)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, gguf_file=name),
                                             dtype=torch.float32)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    return model.to(dtype).eval()


@torch.inference_mode()
def hf_prefill(model, n: int, rng: random.Random) -> float:
    ids = torch.tensor([random_tokens(rng, n)])
    start = time.perf_counter()
    model(ids)
    return n / (time.perf_counter() - start)


@torch.inference_mode()
def hf_decode(model, batch: int, rng: random.Random, steps: int = 32) -> float:
    from transformers import DynamicCache

    ids = torch.tensor([random_tokens(rng, 32) for _ in range(batch)])
    cache = DynamicCache()
    out = model(ids, past_key_values=cache, use_cache=True)
    token = out.logits[:, -1:].argmax(-1)
    start = time.perf_counter()
    for _ in range(steps):
        out = model(token, past_key_values=out.past_key_values, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
    return batch * steps / (time.perf_counter() - start)


def part3(llm: LLM, dtype: torch.dtype, repeat: int, with_hf: bool) -> None:
    rng = random.Random(2)
    model = hf_model(dtype) if with_hf else None
    table = Table(title=f"3. Raw speed, {str(dtype).removeprefix('torch.')} (tokens/s)")
    for col in ("case", "prefixserve", "transformers", "ratio"):
        table.add_column(col, justify="right")
    cases = [("prefill", n) for n in (256, 1024, 2048)] + [("decode", b) for b in (1, 8, 32)]
    for kind, size in cases:
        ours, theirs = [], []
        for _ in range(repeat):
            if kind == "prefill":
                ours.append(ours_prefill(llm, size, rng))
                if model is not None:
                    theirs.append(hf_prefill(model, size, rng))
            else:
                ours.append(ours_decode(llm, size, rng))
                if model is not None:
                    theirs.append(hf_decode(model, size, rng))
        label = f"{kind} {'x' if kind == 'decode' else ''}{size}"
        ratio = (median_range([a / b for a, b in zip(ours, theirs, strict=True)])
                 if theirs else "-")
        table.add_row(label, median_range(ours, "{:.0f}"),
                      median_range(theirs, "{:.0f}") if theirs else "-", ratio)
    console.print(table)


def part4(llm: LLM, repeat: int) -> None:
    """Decode with and without the two-pass attention for shared prefixes."""
    rng = random.Random(4)
    table = Table(title="4. Decode with shared prefixes: two-pass attention vs plain (tokens/s)")
    for col in ("batch", "two-pass", "plain", "two-pass / plain"):
        table.add_column(col, justify="right")
    cases = [("16 on one 1,024-token prefix, 64 own tokens each", 1, 16),
             ("16 on 8 prefixes of 1,024 tokens (2 each)", 8, 2),
             ("16 on one 256-token prefix", 1, 16)]
    saved_keys = shared_prefix_attention.MIN_SAVED_KEYS
    for label, groups, members in cases:
        prefix_len = 256 if "256" in label else 1024
        on, off, ratios = [], [], []
        for i in range(repeat):
            prefixes = [random_tokens(rng, prefix_len) for _ in range(groups)]
            prompts = [p + random_tokens(rng, 64) for p in prefixes for _ in range(members)]
            result = {}
            for two_pass in ((True, False) if i % 2 == 0 else (False, True)):
                shared_prefix_attention.MIN_SAVED_KEYS = saved_keys if two_pass else 1 << 62
                llm.reset_prefix_cache()
                for prefix in prefixes:  # cache the prefixes, as a server would have them
                    llm.generate([prefix], SamplingParams(max_tokens=1))
                result[two_pass] = decode_rate(llm, prompts)
            shared_prefix_attention.MIN_SAVED_KEYS = saved_keys
            on.append(result[True])
            off.append(result[False])
            ratios.append(result[True] / result[False])
        table.add_row(label, median_range(on, "{:.0f}"), median_range(off, "{:.0f}"),
                      median_range(ratios, "{:.2f}"))
    console.print(table)


class StepTimer:
    """Times the parts of ``LLMEngine.step`` on a real engine: the model through the runner's
    ``model_seconds``, the other parts by wrapping the engine's own methods (instance
    attributes, removed by ``close``; the wrappers cost about a microsecond a step)."""

    PARTS = (("schedule", "scheduler", "schedule"), ("inputs", "runner", "execute"),
             ("sample", None, "_sample"), ("outputs", "output_processor", "process"))

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.seconds = dict.fromkeys([name for name, _, _ in self.PARTS], 0.0)
        self.wrapped: list[tuple[object, str]] = []
        for name, owner_name, method in self.PARTS:
            owner = engine if owner_name is None else getattr(engine, owner_name)
            setattr(owner, method, self._wrap(name, getattr(owner, method)))
            self.wrapped.append((owner, method))

    def _wrap(self, name: str, function):
        seconds = self.seconds

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - start
        return timed

    def step(self) -> dict[str, float]:
        """One engine step; milliseconds of each part."""
        runner = self.engine.runner
        for name in self.seconds:
            self.seconds[name] = 0.0
        model = runner.model_seconds
        start = time.perf_counter()
        self.engine.step()
        total = time.perf_counter() - start
        model = runner.model_seconds - model
        parts = dict(self.seconds, total=total, model=model, nonmodel=total - model,
                     other=total - sum(self.seconds.values()))
        parts["inputs"] -= model  # the runner's own work: inputs, block tables, metadata
        return {name: value * 1e3 for name, value in parts.items()}

    def close(self) -> None:
        for owner, method in self.wrapped:
            delattr(owner, method)


def decode_steps(engine: LLMEngine, batch: int, rng: random.Random, steps: int,
                 prompt_len: int = 32) -> dict[str, float]:
    """Median milliseconds per part over ``steps`` greedy decode steps of ``batch`` sequences
    after a prompt of ``prompt_len`` tokens each (prefill and the first token excluded)."""
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(random_tokens(rng, prompt_len), params)
    while any(not r.output_token_ids for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    timer = StepTimer(engine)
    try:
        rows = [timer.step() for _ in range(steps)]
    finally:
        timer.close()
    assert not engine.has_unfinished_requests()
    return {name: statistics.median(row[name] for row in rows) for name in rows[0]}


def part5(llm: LLM, repeat: int, steps: int = 32) -> None:
    """Where one greedy decode step goes: the model vs the rest of ``LLMEngine.step``."""
    rng = random.Random(5)
    rows = (("total", "step"), ("model", "model"), ("nonmodel", "non-model"),
            ("schedule", "- schedule"), ("inputs", "- inputs"), ("sample", "- sample"),
            ("outputs", "- outputs"), ("other", "- other"))
    decode_steps(llm.engine, 1, rng, 4)  # warm the code paths
    runs = {batch: [decode_steps(llm.engine, batch, rng, steps) for _ in range(repeat)]
            for batch in (1, 8)}
    table = Table(title=f"5. Greedy decode step, ms (median of {steps} steps, then median and "
                        "range over repeats); non-model target <= 1 at batch 1")
    table.add_column("part")
    for batch in (1, 8):
        table.add_column(f"batch {batch}", justify="right")
    for key, label in rows:
        table.add_row(label, *(median_range([r[key] for r in runs[b]]) for b in (1, 8)))
    console.print(table)
    console.print("model: forward pass and logits; schedule: scheduling and KV block bookkeeping; "
                  "inputs: the runner's input tensors, block tables and attention metadata; "
                  "outputs: appending tokens, detokenising, stop checks and outputs.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--parts", default="1,2,3,4")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers columns")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads (default: one per core)")
    args = parser.parse_args()
    parts = {int(p) for p in args.parts.split(",")}
    torch.set_num_threads(args.threads)
    kwargs = {"dtype": args.dtype, "kv_cache_memory": "1GiB", "max_num_batched_tokens": 2048,
              "max_num_seqs": 32}
    console.print(f"command: python benchmarks/bench_engine.py --dtype {args.dtype} "
                  f"--parts {args.parts} --repeat {args.repeat} --threads {args.threads}"
                  + (" --no-hf" if args.no_hf else ""))
    if parts & {1, 3, 4, 5}:
        llm = LLM(**kwargs)
        if 1 in parts:
            part1(llm, args.repeat)
        if 3 in parts:
            part3(llm, getattr(torch, args.dtype), args.repeat, not args.no_hf)
        if 4 in parts:
            part4(llm, args.repeat)
        if 5 in parts:
            part5(llm, args.repeat)
        del llm
    if 2 in parts:
        part2(kwargs, args.repeat)


if __name__ == "__main__":
    main()
