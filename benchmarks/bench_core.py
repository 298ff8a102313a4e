"""Cost of the prefix-cache bookkeeping in prefixserve.core (no model involved).

Reproduce with::

    .venv/bin/python benchmarks/bench_core.py            # full run (10,000 requests per row)
    .venv/bin/python benchmarks/bench_core.py --repeat 5 # median and spread over 5 runs

Rows:

* per request: ``get_computed_blocks`` + ``allocate_slots`` (whole prompt) + ``free`` +
  ``free_block_hashes`` for requests of 1,000 tokens at block size 16, with 0% or 50% of each
  prompt shared by all requests; hashing included, and the hashing alone shown apart.
* per decode step: ``allocate_slots(request, 1)`` after appending one token (a block is hashed
  once every 16 steps).
* per block: ``BlockPool.get_new_blocks(n)`` + ``free_blocks`` for n = 10, 100, 1000.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from rich.console import Console
from rich.table import Table

from prefixserve.core import HASH_ALGOS, BlockPool, CacheRequest, KVCacheManager
from prefixserve.core.hashing import get_hash_function, hash_block_chain

BLOCK_SIZE = 16
PROMPT_LEN = 1000
NUM_BLOCKS = 20_000


def make_prompts(num: int, shared_fraction: float, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared_len = int(PROMPT_LEN * shared_fraction)
    shared = [rng.randrange(50_000) for _ in range(shared_len)]
    return [shared + [rng.randrange(50_000) for _ in range(PROMPT_LEN - shared_len)]
            for _ in range(num)]


def bench_requests(prompts: list[list[int]], hash_algo: str) -> float:
    """Microseconds per request for lookup + allocate + free."""
    manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, hash_algo=hash_algo)
    requests = [CacheRequest(str(i), p) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    for request in requests:
        computed, num_computed = manager.get_computed_blocks(request)
        request.num_computed_tokens = 0
        manager.allocate_slots(request, request.num_tokens - num_computed, computed)
        manager.free(request)
        manager.free_block_hashes(request)
    elapsed = time.perf_counter() - start
    assert manager.num_free_blocks == NUM_BLOCKS
    return elapsed / len(requests) * 1e6


def bench_hashing(prompts: list[list[int]], hash_algo: str) -> float:
    """Microseconds per request to hash its full blocks alone."""
    function, root = get_hash_function(hash_algo)
    num_blocks = PROMPT_LEN // BLOCK_SIZE
    start = time.perf_counter()
    for prompt in prompts:
        hash_block_chain(function, root, prompt, BLOCK_SIZE, 0, num_blocks)
    return (time.perf_counter() - start) / len(prompts) * 1e6


def bench_decode(hash_algo: str, num_requests: int = 200, steps: int = 256) -> float:
    """Microseconds per decode step of one request (append a token, allocate a slot)."""
    manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, hash_algo=hash_algo)
    rng = random.Random(1)
    requests = [CacheRequest(str(i), [rng.randrange(50_000) for _ in range(100)])
                for i in range(num_requests)]
    for request in requests:
        manager.allocate_slots(request, request.num_tokens)
        request.num_computed_tokens = request.num_tokens
    new_tokens = [rng.randrange(50_000) for _ in range(steps)]
    start = time.perf_counter()
    for token in new_tokens:
        for request in requests:
            request.token_ids.append(token)
            manager.allocate_slots(request, 1)
            request.num_computed_tokens += 1
    elapsed = time.perf_counter() - start
    return elapsed / (steps * num_requests) * 1e6


def bench_pool(n: int, rounds: int) -> float:
    """Nanoseconds per block for get_new_blocks(n) followed by free_blocks."""
    pool = BlockPool(max(n, 1000) * 2)
    start = time.perf_counter()
    for _ in range(rounds):
        blocks = pool.get_new_blocks(n)
        pool.free_blocks(reversed(blocks))
    return (time.perf_counter() - start) / (rounds * n) * 1e9


def summary(values: list[float]) -> str:
    median = statistics.median(values)
    if len(values) == 1:
        return f"{median:.1f}"
    return f"{median:.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    table = Table(title=f"prefixserve.core bookkeeping (median of {args.repeat}, range)")
    table.add_column("case")
    table.add_column("hash")
    table.add_column("cost", justify="right")
    table.add_column("unit")
    for shared in (0.0, 0.5):
        prompts = make_prompts(args.num_requests, shared)
        for algo in HASH_ALGOS:
            full = [bench_requests(prompts, algo) for _ in range(args.repeat)]
            hashing = [bench_hashing(prompts, algo) for _ in range(args.repeat)]
            case = f"request, {PROMPT_LEN} tok, {shared:.0%} shared"
            table.add_row(case, algo, summary(full), "us/request")
            table.add_row(f"  of which hashing {PROMPT_LEN // BLOCK_SIZE} blocks", algo,
                          summary(hashing), "us/request")
    for algo in HASH_ALGOS:
        table.add_row("decode step", algo,
                      summary([bench_decode(algo) for _ in range(args.repeat)]), "us/step")
    for n in (10, 100, 1000):
        rounds = 200_000 // n
        table.add_row(f"pool get+free, n={n}", "-",
                      summary([bench_pool(n, rounds) for _ in range(args.repeat)]), "ns/block")
    Console().print(table)


if __name__ == "__main__":
    main()
