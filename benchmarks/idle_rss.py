"""Idle server RSS against what the server must hold: the weights and the KV pool.

Two measurements, each in a fresh process:

1. **Served**: ``prefixserve serve`` with the default model and flags (or ``--model`` and the
   flags after ``--``), a few requests, then idle: the process's RSS (anonymous and file-backed)
   from ``/proc``.
2. **Accounted**: the same engine built step by step in a child process, with the RSS after each
   step: the interpreter, ``import torch``, the server's modules, the engine (model and KV pool)
   and the served app. The weights are the model's tensors' bytes (packed and dense), the KV
   pool its tensor's bytes, so the rest (runtime, libraries, tokenizer, buffers) is named.

Command: ``.venv/bin/python benchmarks/idle_rss.py [--model NAME_OR_PATH] [-- SERVE_FLAGS...]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from local_server import REPO, start_server

PROMPT = "Tell me about the river town and its stone library. " * 20

#: Run in the child process: builds what ``prefixserve serve`` builds (the same argument
#: parser, engine config and app) and prints the RSS after each step as JSON.
CHILD = r"""
import argparse, json, sys, time

def rss():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "RssAnon", "RssFile")}

steps = [("interpreter", rss())]
import torch
steps.append(("import torch", rss()))
from prefixserve.server import cli_args, launch
from prefixserve.server.app import create_app
from prefixserve.engine.async_llm import AsyncLLM
steps.append(("server modules", rss()))
parser = argparse.ArgumentParser()
cli_args.add_parser(parser.add_subparsers(dest="command"))
args = parser.parse_args(["serve", *sys.argv[1:]])
engine = AsyncLLM(launch.engine_config(args), log_stats_interval=None)
steps.append(("engine (model + KV pool)", rss()))
create_app(engine, launch.server_config(args))
steps.append(("app", rss()))
runner = engine.engine.runner
weights = sum(t.numel() * t.element_size()
              for t in list(runner.model.parameters()) + list(runner.model.buffers()))
kv = runner.kv_cache.numel() * runner.kv_cache.element_size()
engine.shutdown()
print(json.dumps({"steps": steps, "weights": weights, "kv": kv}))
"""


def served_rss(flags: list[str]) -> dict[str, int]:
    """RSS fields (bytes) of an idle served process after a few requests."""
    import httpx

    process, url = start_server(flags)
    try:
        for _ in range(3):
            httpx.post(url + "/v1/completions", timeout=300,
                       json={"prompt": PROMPT, "max_tokens": 16}).raise_for_status()
        time.sleep(2)
        with open(f"/proc/{process.pid}/status", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f)
        return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "RssAnon", "RssFile")}
    finally:
        process.terminate()
        process.wait(60)


def accounted(flags: list[str]) -> dict:
    result = subprocess.run([sys.executable, "-c", CHILD, *flags], cwd=REPO, check=True,
                            capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    return json.loads(result.stdout.strip().splitlines()[-1])


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model name or path (default: the default model)")
    parser.add_argument("flags", nargs="*", help="serve flags (after --)")
    opts = parser.parse_args()
    flags = ([opts.model] if opts.model else []) + opts.flags
    served = served_rss(flags)
    parts = accounted(flags)
    held = parts["weights"] + parts["kv"]
    print(f"flags: {' '.join(flags) or '(defaults)'}")
    print("| step (child process) | RSS MiB | anon | file | added |")
    print("|---|---|---|---|---|")
    last = 0
    for name, rss in parts["steps"]:
        print(f"| {name} | {mib(rss['VmRSS'])} | {mib(rss['RssAnon'])} | {mib(rss['RssFile'])} "
              f"| {mib(rss['VmRSS'] - last)} |")
        last = rss["VmRSS"]
    print(f"\nweights {mib(parts['weights'])} MiB, KV pool {mib(parts['kv'])} MiB: "
          f"{mib(held)} MiB held (the pool's pages are resident only once blocks are written: "
          f"prefixserve/model/kv_pool.py)")
    print(f"served and idle: RSS {mib(served['VmRSS'])} MiB (anon {mib(served['RssAnon'])}, "
          f"file {mib(served['RssFile'])}) = {served['VmRSS'] / held:.2f}x weights + KV")


if __name__ == "__main__":
    main()
