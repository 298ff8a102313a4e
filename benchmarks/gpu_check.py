"""GPU check: the engine on CUDA against the CPU, its features there, speed beside transformers.

Never needed by the tests. On a machine with a CUDA GPU::

    .venv/bin/python benchmarks/gpu_check.py [--model M] [--window-model G] [--out FILE.json]

``--model`` defaults to the default model; ``--window-model`` (optional) is a model with
sliding-window layers (Gemma 3). On a machine without the model packages, make random-weight
stand-ins with ``benchmarks/random_model.py`` (docs/gpu.md gives the steps).

Checks, each reported PASS or FAIL with what it measured (the run goes on after a failure):

1. greedy tokens and their logprobs in float32 on CUDA equal the CPU's (prompts in chunks);
2. prefix caching on CUDA: cached tokens where the design predicts them, the same greedy
   tokens with caching on and off (float32), no KV block leaked (bfloat16 reported);
3. ``--weights int8|int4`` on CUDA keep dense weights: the same tokens as ``auto``;
4. n-gram speculation on CUDA changes no greedy token;
5. a LoRA adapter on CUDA gives the CPU's tokens;
6. a float16 KV cache beside float32 activations runs on CUDA;
7. the deterministic mode is refused on CUDA with a clear error (it is CPU code);
8. ``prefixserve serve --device cuda`` answers the real ``openai`` client, streaming and not,
   reports cached prompt tokens and exports its metrics;
9. speed in bfloat16: prefill and decode tokens/s, and the same with transformers'
   ``generate`` on the same weights and GPU, in the same run (ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from prefixserve import LLM, SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

class Device:
    """The device under test: ``cuda``, or ``cpu`` to try this script where there is no GPU
    (``--device cpu``: every check compares the CPU with itself)."""

    name = "cuda"


DEVICE = Device()
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)


def prompt_ids(n: int, seed: int) -> list[int]:
    """``n`` token ids of a fixed pseudo-random text (ids 100..40099)."""
    return [100 + (seed * 7919 + i * 104729) % 40000 for i in range(n)]


def greedy(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY,
           **kwargs: Any) -> list[tuple[list[int], list[float], int]]:
    """Each prompt's (tokens, their logprobs, cached prompt tokens)."""
    outs = llm.generate(prompts, params, **kwargs)
    result = []
    for out in outs:
        comp = out.outputs[0]
        steps = comp.logprobs
        probs = [] if steps is None else [
            step[tok].logprob for tok, step in zip(comp.token_ids, steps, strict=True)]
        result.append((list(comp.token_ids), probs, out.num_cached_tokens))
    return result


def idle_free(llm: LLM) -> int:
    return llm.engine.get_stats().num_free_blocks


class Report:
    """PASS/FAIL lines as the checks end, and everything measured, for ``--out``."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def check(self, name: str, fn: Callable[[], str]) -> None:
        start = time.perf_counter()
        try:
            detail, ok = fn(), True
        except Exception as error:  # every failure is reported, the run goes on
            detail, ok = f"{type(error).__name__}: {error}", False
            traceback.print_exc()
        seconds = time.perf_counter() - start
        self.rows.append({"check": name, "ok": ok, "detail": detail, "seconds": seconds})
        print(f"{'PASS' if ok else 'FAIL'} {name} ({seconds:.1f} s): {detail}", flush=True)

    @property
    def failed(self) -> list[str]:
        return [row["check"] for row in self.rows if not row["ok"]]


def engine(model: str | None, device: str, dtype: str = "float32", **kwargs: Any) -> LLM:
    kwargs.setdefault("num_blocks", 512)
    kwargs.setdefault("max_num_batched_tokens", 128)  # long prompts run in chunks
    return LLM(model=model, device=device, dtype=dtype, **kwargs)


def check_cpu_vs_cuda(model: str | None) -> str:
    prompts = [prompt_ids(300, 1), prompt_ids(47, 2), prompt_ids(130, 3)]
    runs = {device: greedy(engine(model, device), prompts) for device in ("cpu", DEVICE.name)}
    worst = 0.0
    pairs = zip(runs["cpu"], runs[DEVICE.name], strict=True)
    for (cpu_ids, cpu_lp, _), (gpu_ids, gpu_lp, _) in pairs:
        assert cpu_ids == gpu_ids, f"greedy tokens differ: cpu {cpu_ids} cuda {gpu_ids}"
        worst = max([worst, *(abs(a - b) for a, b in zip(cpu_lp, gpu_lp, strict=True))])
    assert worst < 1e-3, f"logprobs differ by {worst:.2e}"
    return f"3 prompts x 16 tokens identical, max |logprob cpu - cuda| {worst:.1e}"


def check_caching(model: str | None, dtype: str) -> str:
    system = prompt_ids(200, 7)
    prompts = [system + prompt_ids(20 + 5 * i, 10 + i) for i in range(4)]
    results, lines = {}, []
    for caching in (True, False):
        llm = engine(model, DEVICE.name, dtype, enable_prefix_caching=caching)
        idle = idle_free(llm)
        runs = [greedy(llm, [p])[0] for p in prompts]
        results[caching] = [r[0] for r in runs]
        cached = [r[2] for r in runs]
        assert idle_free(llm) == idle, f"blocks leaked: {idle - idle_free(llm)}"
        if caching:
            assert cached[0] == 0 and all(c >= 192 and c % 16 == 0 for c in cached[1:]), cached
            lines.append(f"cached tokens {cached}")
    same = sum(a == b for a, b in zip(results[True], results[False], strict=True))
    if dtype == "float32":
        assert same == len(prompts), "greedy outputs differ with caching on and off"
    lines.append(f"{same}/{len(prompts)} outputs identical on/off, no block leaked")
    return "; ".join(lines)


def check_weight_modes(model: str | None) -> str:
    prompts = [prompt_ids(90, 4)]
    want = greedy(engine(model, DEVICE.name), prompts)[0][0]
    for mode in ("int8", "int4"):
        got = greedy(engine(model, DEVICE.name, weights=mode), prompts)[0][0]
        assert got == want, f"--weights {mode} on CUDA changed the tokens"
    return "int8 and int4 on CUDA load dense weights: tokens equal auto's"


def check_speculation(model: str | None) -> str:
    motif = prompt_ids(12, 5)
    prompts = [motif * 10, [500] * 64, prompt_ids(64, 6)]  # a repeated token: drafts at once
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    want = [r[0] for r in greedy(engine(model, DEVICE.name), prompts, params)]
    llm = engine(model, DEVICE.name, num_speculative_tokens=4)
    idle = idle_free(llm)
    got = [r[0] for r in greedy(llm, prompts, params)]
    assert got == want, "speculation changed greedy tokens"
    assert idle_free(llm) == idle, "blocks leaked"
    stats = llm.engine.get_stats()
    assert stats.spec_draft_tokens > 0, "nothing was drafted: the check checked nothing"
    return (f"3 prompts x 64 tokens identical with up to 4 draft tokens (drafted "
            f"{stats.spec_draft_tokens}, accepted {stats.spec_accepted_tokens})")


def check_lora(model: str | None) -> str:
    from lora_helpers import write_peft_adapter

    from prefixserve.model.arch.config import ModelConfig, resolve_model_path

    path = resolve_model_path(model)
    if path.endswith(".gguf"):
        from prefixserve.model.weights.gguf_file import GGUFFile

        gguf = GGUFFile(path)
        config = ModelConfig.from_gguf_metadata(gguf.metadata, set(gguf.tensors))
    else:
        config = ModelConfig.from_hf_dir(path)
    with tempfile.TemporaryDirectory() as tmp:
        adapter = write_peft_adapter(__import__("pathlib").Path(tmp) / "a", config, seed=3,
                                     rank=8, std=0.2)
        prompts = [prompt_ids(70, 8)]
        runs = {}
        for device in ("cpu", DEVICE.name):
            llm = engine(model, device, enable_lora=True, max_lora_rank=8,
                         lora_modules={"a": str(adapter)})
            runs[device] = (greedy(llm, prompts, lora="a")[0][0], greedy(llm, prompts)[0][0])
    assert runs["cpu"][0] == runs[DEVICE.name][0], "LoRA tokens differ between CPU and CUDA"
    changed = runs[DEVICE.name][0] != runs[DEVICE.name][1]
    return f"adapter tokens equal on CPU and CUDA (the adapter changes the output: {changed})"


def check_kv_float16(model: str | None) -> str:
    prompts = [prompt_ids(150, 9)]
    want = greedy(engine(model, DEVICE.name), prompts)[0][0]
    got = greedy(engine(model, DEVICE.name, kv_cache_dtype="float16"), prompts)[0][0]
    same = sum(a == b for a, b in zip(want, got, strict=True))
    return f"float16 KV cache ran; {same}/16 tokens as with a float32 cache"


def check_deterministic_refused(model: str | None) -> str:
    try:
        engine(model, DEVICE.name, deterministic=True)
    except ValueError as error:
        assert "CPU" in str(error), error
        return f"refused: {error}"
    raise AssertionError("the deterministic mode started on CUDA")


def check_server(model: str | None) -> str:
    import httpx
    import openai

    port = 18731
    command = [sys.executable, "-m", "prefixserve", "serve", *([model] if model else []),
               "--device", DEVICE.name, "--port", str(port), "--disable-access-log"]
    log = os.path.join(tempfile.mkdtemp(), "serve.log")
    with open(log, "w") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def log_text() -> str:
        with open(log, encoding="utf-8") as f:
            return f.read()

    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, "server exited: " + log_text()[-2000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server not up in 180 s"
            time.sleep(0.5)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        name = client.models.list().data[0].id
        system = "You answer in one short sentence about rivers and lakes. " * 20
        cached = []
        for question in ("Which river is longest?", "Which lake is deepest?"):
            reply = client.chat.completions.create(
                model=name, max_tokens=12, temperature=0,
                messages=[{"role": "system", "content": system},
                          {"role": "user", "content": question}])
            details = reply.usage.prompt_tokens_details if reply.usage else None
            cached.append(details.cached_tokens if details else None)
        pieces = list(client.chat.completions.create(
            model=name, max_tokens=12, temperature=0, stream=True,
            messages=[{"role": "user", "content": "Name a river."}]))
        assert cached[0] == 0 and (cached[1] or 0) > 0, cached
        assert len(pieces) > 2, "stream too short"
        metrics = httpx.get(url + "/metrics", timeout=10).text
        hits = [line for line in metrics.splitlines()
                if "prefix_cache_hits" in line and not line.startswith("#")]
        assert hits, "no prefix cache hit counter in /metrics"
        startup = [line for line in log_text().splitlines() if "serving" in line]
        assert startup and DEVICE.name in startup[0], startup
        return f"cached prompt tokens {cached}, {len(pieces)} stream chunks, {hits[0]}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE.name == "cuda" else "cpu"


def sync() -> None:
    if DEVICE.name.startswith("cuda"):
        torch.cuda.synchronize()


def median_rate(run: Callable[[], float], repeats: int) -> float:
    """Median of ``repeats`` rates, after one warm-up run."""
    run()
    return statistics.median(run() for _ in range(repeats))


def prefixserve_speed(model: str | None, repeats: int) -> dict[str, float]:
    llm = LLM(model=model, device=DEVICE.name, dtype="bfloat16", kv_cache_memory="8GiB",
              max_num_seqs=64, max_num_batched_tokens=8192)
    out: dict[str, float] = {}
    for n in (1024, 4096):
        ids = prompt_ids(n, n)

        def prefill(ids: list[int] = ids, n: int = n) -> float:
            llm.reset_prefix_cache()
            sync()
            start = time.perf_counter()
            llm.generate(ids, SamplingParams(max_tokens=1))
            sync()
            return n / (time.perf_counter() - start)

        out[f"prefill {n} tok/s"] = median_rate(prefill, repeats)
    for batch in (1, 16, 64):
        prompts = [prompt_ids(4, 100 + b) for b in range(batch)]

        def decode(prompts: list[list[int]] = prompts, batch: int = batch) -> float:
            llm.reset_prefix_cache()
            start = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=64, ignore_eos=True))
            sync()
            return batch * 64 / (time.perf_counter() - start)

        out[f"decode batch {batch} tok/s"] = median_rate(decode, repeats)
    return out


def transformers_speed(model: str | None, repeats: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    from prefixserve.model.arch.config import resolve_model_path

    path = resolve_model_path(model)
    net = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEVICE.name).eval()
    out: dict[str, float] = {}
    for n in (1024, 4096):
        ids = torch.tensor([prompt_ids(n, n)], device=DEVICE.name)

        def prefill(ids: torch.Tensor = ids, n: int = n) -> float:
            sync()
            start = time.perf_counter()
            with torch.no_grad():
                net(ids, logits_to_keep=1)
            sync()
            return n / (time.perf_counter() - start)

        out[f"prefill {n} tok/s"] = median_rate(prefill, repeats)
    for batch in (1, 16, 64):
        ids = torch.tensor([prompt_ids(4, 100 + b) for b in range(batch)], device=DEVICE.name)

        def decode(ids: torch.Tensor = ids, batch: int = batch) -> float:
            sync()
            start = time.perf_counter()
            with torch.no_grad():
                net.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64,
                             min_new_tokens=64, do_sample=False, pad_token_id=0)
            sync()
            return batch * 64 / (time.perf_counter() - start)

        out[f"decode batch {batch} tok/s"] = median_rate(decode, repeats)
    return out


def speed_table(model: str | None, repeats: int) -> dict[str, Any]:
    ours = prefixserve_speed(model, repeats)
    try:
        peer = transformers_speed(model, repeats)
    except Exception as error:  # a model transformers cannot load: ours alone
        print(f"transformers row skipped: {type(error).__name__}: {error}")
        peer = {}
    print(f"\nbfloat16 on {device_name()}, median of {repeats} after a warm-up")
    print("| figure | prefixserve | transformers | ratio |\n|---|---|---|---|")
    for key, value in ours.items():
        other = peer.get(key)
        ratio = f"{value / other:.2f}x" if other else "-"
        print(f"| {key} | {value:,.0f} | {other:,.0f} | {ratio} |" if other else
              f"| {key} | {value:,.0f} | - | - |")
    return {"prefixserve": ours, "transformers": peer}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model to check (default: the default)")
    parser.add_argument("--window-model", default=None,
                        help="a model with sliding-window layers, checked as well")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per speed figure")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: try the script itself where there is no GPU")
    parser.add_argument("--out", default=None, help="write every result here as JSON")
    args = parser.parse_args()
    DEVICE.name = args.device
    if DEVICE.name == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    print(device_name(), "torch", torch.__version__, flush=True)
    report = Report()
    models = [("model", args.model)]
    if args.window_model:
        models.append(("window model", args.window_model))
    for label, model in models:
        report.check(f"{label}: cpu vs cuda, float32", lambda m=model: check_cpu_vs_cuda(m))
        for dtype in ("float32", "bfloat16"):
            report.check(f"{label}: prefix caching on cuda, {dtype}",
                         lambda m=model, d=dtype: check_caching(m, d))
        report.check(f"{label}: speculation on cuda", lambda m=model: check_speculation(m))
    model = args.model
    report.check("weights int8/int4 on cuda", lambda: check_weight_modes(model))
    report.check("lora on cuda", lambda: check_lora(model))
    report.check("float16 kv cache on cuda", lambda: check_kv_float16(model))
    report.check("deterministic mode refused on cuda", lambda: check_deterministic_refused(model))
    report.check("serve --device cuda", lambda: check_server(model))
    results: dict[str, Any] = {"device": device_name(),
                               "torch": torch.__version__, "checks": report.rows}
    if not args.skip_speed:
        speed: dict[str, Any] = {}

        def run_speed() -> str:
            speed.update(speed_table(model, args.repeats))
            return "table above"

        report.check("speed, bfloat16", run_speed)
        results["speed"] = speed
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    print(f"\n{len(report.rows) - len(report.failed)}/{len(report.rows)} checks passed"
          + (f"; failed: {', '.join(report.failed)}" if report.failed else ""))
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
