"""Hit rate on a live server: LRU only vs pinning the most shared prefixes vs TTL retention vs
a breakpoint (``cache_control``-style retention of the first N tokens), next to what
``prefixserve estimate`` predicts for the same prompts and the same pool.

Reproduce (hit rates do not depend on the machine's load; the run starts its own server on a
free port, with a pool small enough that LRU loses the shared prefixes)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_explicit_cache_live.py
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_explicit_cache_live.py \\
        --trace ../shared/traces/mooncake_conversation_trace.jsonl --num-prompts 200 \\
        --scale 16 --num-blocks 256 --breakpoint-tokens 32
    # smoke run
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_explicit_cache_live.py --requests 24 \\
        --num-blocks 48 --prefix-tokens 96 --unique-tokens 96 --pin-top 6

Workloads. Default (synthetic, an agent fleet): ``--groups`` shared prefixes of
``--prefix-tokens`` (a system prompt and tool manifest each) come back, one request in every
``--flood + 1``, with a short unique question; between them come one-off prompts of
``--unique-tokens`` that push the prefixes out of an LRU pool. ``--trace``: a Mooncake-style
trace, whole conversations sampled and scaled down by ``--scale`` (the bench's ``trace``
dataset), one request each.

Policies, each from a reset cache (``/reset_prefix_cache``, pins dropped), requests sent one at
a time to ``/v1/completions`` as token ids with ``max_tokens: 1``:

- ``lru``: nothing asked;
- ``pin-top K``: the K blocks found in the most requests (an oracle choice from the whole
  workload, as ``estimate --pin-top``); the prefix up to each is pinned (``POST /v1/pins``)
  right after the first request that computed it, within the server's pin budget;
- ``ttl S``: every request carries ``retention: {"priority": 80, "duration": S}``;
- ``breakpoint N``: every request that starts with a shared prefix (all of a trace's) keeps
  its first N tokens at priority 80 for ``--ttl`` seconds (what a ``cache_control`` breakpoint
  after the shared system prompt does).

Hit rate = cached prompt tokens (the server's ``usage.prompt_tokens_details.cached_tokens``) /
prompt tokens. The estimate column replays the same prompts, with the same fields, through
``prefixserve estimate`` at the server's block size and pool (its clock is one second a request;
the TTL is chosen long enough that nothing expires in either run).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE / "tests"))
sys.path.insert(0, str(HERE))

from server_helpers import ServerProcess  # noqa: E402

from prefixserve.cli import build_parser  # noqa: E402
from prefixserve.tools.estimate.replay import estimate, most_reused_blocks  # noqa: E402
from prefixserve.tools.trace_formats import ReadOptions, read_workload  # noqa: E402

ADMIN_KEY = "bench-admin"


Workload = tuple[list[list[int]], list[bool]]
"""The prompts, and whether each starts with a shared prefix (where a breakpoint goes)."""


def synthetic(args: argparse.Namespace, vocabulary: Any) -> Workload:
    rng = np.random.default_rng(args.seed)
    prefixes = [vocabulary.distinct(rng, args.prefix_tokens) for _ in range(args.groups)]
    prompts, shared = [], []
    for r in range(args.requests):
        returns = r % (args.flood + 1) == 0
        if returns:
            group = (r // (args.flood + 1)) % args.groups
            prompts.append(prefixes[group] + vocabulary.sample(rng, 8))
        else:
            prompts.append(vocabulary.distinct(rng, args.unique_tokens))
        shared.append(returns)
    return prompts, shared


def from_trace(args: argparse.Namespace, vocabulary: Any) -> Workload:
    from prefixserve.tools.bench.trace import trace_dataset

    dataset = trace_dataset(vocabulary, path=args.trace, num_prompts=args.num_prompts,
                            scale=args.scale, trace_block_size=512, time_scale=0.0,
                            compress=True, trace_format=None, seed=args.seed,
                            sample="conversations")
    prompts = [session.turns[0].tokens[:args.max_model_len - 1] for session in dataset.sessions]
    return prompts, [True] * len(prompts)  # Mooncake's first block: a shared system prompt


Extras = list[dict[str, Any]]


def policies(args: argparse.Namespace, shared: list[bool]) -> list[tuple[str, Extras, int]]:
    """(name, the extra fields of each request, pin-top K)."""
    retention = {"retention": {"priority": 80, "duration": args.ttl}}
    bp = {"retention": {"ranges": [{"start": 0, "end": args.breakpoint_tokens, "priority": 80,
                                    "duration": args.ttl}]}}
    return [("lru", [{}] * len(shared), 0),
            (f"pin-top {args.pin_top}", [{}] * len(shared), args.pin_top),
            (f"ttl {args.ttl:g}, every request", [retention] * len(shared), 0),
            (f"breakpoint at {args.breakpoint_tokens}, shared ones",
             [bp if s else {} for s in shared], 0)]


def pin_ends(prompts: list[list[int]], block_size: int, k: int) -> list[int]:
    """Per request, the token count of the longest pinned-target prefix it holds (0: none)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "w.jsonl"
        path.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in prompts))
        workload = read_workload(str(path), ReadOptions(format="tokens", block_size=block_size))
        targets = most_reused_blocks(workload, k)
        ends = []
        for request in workload.requests:
            keys = workload.block_keys(request)[:request.num_prompt_tokens // block_size]
            ends.append(max((i + 1 for i, key in enumerate(keys) if key in targets), default=0)
                        * block_size)
    return ends


def live(server: ServerProcess, prompts: list[list[int]], extras: Extras,
         ends: list[int]) -> tuple[float, int]:
    """The live token hit rate of one policy, and the pins the budget refused."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    httpx.post(server.url + "/reset_prefix_cache", headers=admin, timeout=60).raise_for_status()
    cached = total = refused = 0
    pinned: set[tuple[int, ...]] = set()
    with httpx.Client(base_url=server.url, timeout=600) as client:
        for prompt, end, extra in zip(prompts, ends, extras, strict=True):
            body = {"model": "smol", "prompt": prompt, "max_tokens": 1, "temperature": 0,
                    **extra}
            usage = client.post("/v1/completions", json=body).raise_for_status().json()["usage"]
            cached += usage["prompt_tokens_details"]["cached_tokens"]
            total += usage["prompt_tokens"]
            key = tuple(prompt[:end])
            if end and key not in pinned:
                pinned.add(key)
                answer = client.post("/v1/pins", headers=admin,
                                     json={"prompt_token_ids": list(key)})
                refused += answer.status_code == 400
    return cached / total, refused


def estimated(prompts: list[list[int]], extras: Extras, pin_top: int, block_size: int,
              capacity: int) -> float:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "w.jsonl"
        path.write_text("".join(json.dumps({"token_ids": p, **extra}) + "\n"
                                for p, extra in zip(prompts, extras, strict=True)))
        options = ["estimate", str(path), "--block-size", str(block_size), "--capacity",
                   str(capacity), "--no-progress", "--jobs", "1"]
        if pin_top:
            options += ["--pin-top", str(pin_top)]
        result = estimate(build_parser().parse_args(options))
    pool = next(r for r in result.results if r.capacity_blocks == capacity)
    return pool.hit_tokens / max(1, pool.query_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", help="a Mooncake-style trace (default: the synthetic fleet)")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--scale", type=int, default=16)
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--flood", type=int, default=3, help="one-off prompts between returns")
    parser.add_argument("--prefix-tokens", type=int, default=320)
    parser.add_argument("--unique-tokens", type=int, default=256)
    parser.add_argument("--num-blocks", type=int, default=96)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--pin-top", type=int, default=60)
    parser.add_argument("--ttl", type=float, default=3600.0)
    parser.add_argument("--breakpoint-tokens", type=int)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.breakpoint_tokens is None:
        args.breakpoint_tokens = 512 // args.scale if args.trace else args.prefix_tokens
    from prefixserve.model.text.tokenizer import load_tokenizer
    from prefixserve.tools.bench.datasets import WordVocabulary

    vocabulary = WordVocabulary(load_tokenizer(None))
    prompts, shared = from_trace(args, vocabulary) if args.trace else synthetic(args,
                                                                                 vocabulary)
    log = Path(tempfile.mkdtemp()) / "server.log"
    server = ServerProcess(["--num-blocks", str(args.num_blocks), "--block-size",
                            str(args.block_size), "--max-model-len", str(args.max_model_len),
                            "--served-model-name", "smol", "--admin-key", ADMIN_KEY,
                            "--max-retention-duration", str(max(args.ttl, 1.0))], log).start()
    try:
        metrics = server.metrics()
        capacity = int(metrics.get("prefixserve:kv_cache_num_blocks", args.num_blocks))
        rows = []
        for name, extras, k in policies(args, shared):
            ends = pin_ends(prompts, args.block_size, k) if k else [0] * len(prompts)
            start = time.monotonic()
            rate, refused = live(server, prompts, extras, ends)
            rows.append((name, rate, estimated(prompts, extras, k, args.block_size, capacity),
                         refused, time.monotonic() - start))
    finally:
        server.stop()
    what = f"trace {Path(args.trace).name}" if args.trace else (
        f"{args.groups} prefixes of {args.prefix_tokens} tokens, {args.flood} one-off prompts "
        f"of {args.unique_tokens} between returns")
    table = Table(title=f"explicit caching, live: {len(prompts)} requests ({what}); pool "
                  f"{capacity} blocks of {args.block_size}")
    for column in ("policy", "live hit rate", "estimate", "pins refused", "run s (not a "
                   "result)"):
        table.add_column(column, justify="right")
    for name, rate, predicted, refused, seconds in rows:
        table.add_row(name, f"{rate:.1%}", f"{predicted:.1%}", str(refused), f"{seconds:.0f}")
    Console().print(table)


if __name__ == "__main__":
    main()
