"""GPU check: the same engine code on CUDA, compared with the CPU, plus a speed reading.

Never needed by the tests. Run on a machine with a CUDA GPU::

    .venv/bin/python benchmarks/gpu_check.py

It checks that (1) the default model's logits on CUDA match the CPU's (float32), (2) greedy
outputs on CUDA are identical with prefix caching on and off and report the cached tokens the
design predicts, (3) no block leaks; then prints prefill and decode tokens/s in bfloat16.
"""

from __future__ import annotations

import sys
import time

import torch

from prefixserve import LLM, SamplingParams
from prefixserve.model.loader import load_model
from prefixserve.model.runner import ModelRunner, SeqBatchInput
from prefixserve.model.tokenizer import load_tokenizer


def check_logits() -> float:
    tok = load_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name three rivers."}])
    logits = []
    for device in ("cpu", "cuda"):
        config, model = load_model(None, torch.float32, device)
        runner = ModelRunner(config, model, 64, 16, torch.float32, device)
        out = runner.execute([SeqBatchInput(prompt, 0, list(range(64)), True)])
        logits.append(out.prompt_logits[0].cpu())
    return float((logits[0] - logits[1]).abs().max())


def check_caching() -> None:
    system = "You are a terse assistant that answers geography questions. " * 20
    questions = ["Longest river?", "Highest mountain?", "Largest desert?", "Deepest lake?"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = {}
    for caching in (True, False):
        llm = LLM(device="cuda", dtype="float32", enable_prefix_caching=caching,
                  num_blocks=1024)
        outs = [llm.generate(system + q, params)[0] for q in questions]
        results[caching] = [o.outputs[0].token_ids for o in outs]
        cached = [o.num_cached_tokens for o in outs]
        print(f"caching={caching}: cached tokens per request {cached}")
        assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.num_kv_blocks, "block leak"
        if caching:
            assert cached[0] == 0 and all(c > 0 and c % 16 == 0 for c in cached[1:])
    assert results[True] == results[False], "greedy outputs differ with caching on and off"


def speed() -> None:
    llm = LLM(device="cuda", dtype="bfloat16", kv_cache_memory="8GiB", max_num_seqs=64,
              max_num_batched_tokens=8192)
    engine = llm.engine
    for n in (1024, 4096):
        ids = [100 + i % 30000 for i in range(n)]
        llm.generate(ids, SamplingParams(max_tokens=1))
        llm.reset_prefix_cache()
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(ids, SamplingParams(max_tokens=1))
        torch.cuda.synchronize()
        print(f"prefill {n}: {n / (time.perf_counter() - start):.0f} tok/s")
        llm.reset_prefix_cache()
    for batch in (1, 16, 64):
        params = SamplingParams(max_tokens=64, ignore_eos=True)
        prompts = [[200 + b, 300, 400, 500] for b in range(batch)]
        start = time.perf_counter()
        generated = engine.generation_tokens
        llm.generate(prompts, params)
        torch.cuda.synchronize()
        rate = (engine.generation_tokens - generated) / (time.perf_counter() - start)
        print(f"decode batch {batch}: {rate:.0f} tok/s")


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    diff = check_logits()
    print(f"max |logits cpu - cuda| (float32): {diff:.2e}")
    assert diff < 1e-2, "CUDA logits differ from the CPU's"
    check_caching()
    speed()
    print("GPU check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
