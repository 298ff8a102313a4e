"""What the cache tiers buy: TTFT of a cached prefix from each place, and a trace replay with a
pool too small for it, with and without the tiers.

Part 1 (in-process, one engine per tier): time to first token of a ``--prefix``-token prompt
(default 2,000) that is **cold** (computed), a **pool** hit, loaded from the **disk** tier (the
pool emptied first) and loaded from the **Redis** tier (likewise). Each repeat uses a new random
prompt; the table gives the median and the spread (min-max) of ``--repeats`` runs and each
median as a ratio to cold. The engine's own clock: arrival to first token (``RequestMetrics``).

Part 2 (``--trace``): two real servers with a pool of ``--pool-blocks`` blocks, one without
tiers and one with a disk tier and Redis, each replaying ``--trace-requests`` requests of a
Mooncake trace (whole conversations drawn at random, so that turns come back after the small
pool has evicted them) with ``prefixserve bench --dataset trace``; then ``prefixserve
bench compare`` prints both runs side by side (TTFT percentiles, cached-token share).

Both parts start their own ``redis-server`` (the one ``make install`` puts in ``.venv``, else
one on ``PATH``) on a free local port unless
``--redis-url`` is given. Run on a quiet machine:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_tiers.py --repeats 7
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_tiers.py --part 2 \\
        --trace ../shared/traces/mooncake_conversation_trace.jsonl

Smoke test (small sizes): ``--prefix 256 --repeats 2`` and ``--part 2 --trace-requests 10``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from local_server import free_port, start_server

from prefixserve.engine.llm import LLM
from prefixserve.sampling_params import SamplingParams

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0)


@contextmanager
def redis_server(url: str | None, workdir: str) -> Iterator[str]:
    """The given Redis URL, or a private ``redis-server`` for the run."""
    if url:
        yield url
        return
    beside = os.path.join(os.path.dirname(sys.executable), "redis-server")
    binary = beside if os.path.isfile(beside) else shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (`make install` brings it into .venv), "
                         "or give --redis-url")
    port = free_port()
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save",
                                "", "--appendonly", "no", "--dir", workdir],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        _wait_for_redis(url, process)
        yield url
    finally:
        process.terminate()
        process.wait(10)


def _wait_for_redis(url: str, process: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Returns once the Redis at ``url`` answers PING (a tier whose first call fails is marked
    down for a while, which would spoil the first repeat)."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=2)
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"redis-server did not start at {url}") from None
            time.sleep(0.05)
        finally:
            client.close()


def _ttft(llm: LLM, prompt: list[int]) -> tuple[float, dict[str, int] | None]:
    output = llm.generate(prompt, FIRST_TOKEN)[0]
    times = output.metrics
    assert times.first_token_time is not None
    return times.first_token_time - times.arrival_time, output.num_cached_tokens_by_tier


def part1(args: argparse.Namespace, workdir: str, redis_url: str) -> None:
    common = {"dtype": args.dtype, "kv_tier_min_prefix_tokens": 0}
    disk = LLM(kv_disk_dir=os.path.join(workdir, "disk"), **common)
    remote = LLM(kv_redis_url=redis_url, **common)
    rng = random.Random(0)
    times: dict[str, list[float]] = {"cold": [], "pool": [], "disk": [], "redis": []}
    for _ in range(args.repeats):
        prompt = [rng.randrange(200, 40000) for _ in range(args.prefix)]
        for name, llm in (("disk", disk), ("redis", remote)):
            seconds, _ = _ttft(llm, prompt)
            # the cold run's blocks are written to the tier in the background: wait for
            # that, so that the pool hit is not timed against the writer thread
            assert llm.engine.tiers is not None and llm.engine.tiers.flush(120)
            if name == "disk":
                times["cold"].append(seconds)
            pool, _ = _ttft(llm, prompt)
            if name == "disk":
                times["pool"].append(pool)
            llm.reset_prefix_cache()
            loaded, split = _ttft(llm, prompt)
            assert split is not None and split[name] > 0, split
            times[name].append(loaded)
    cold = statistics.median(times["cold"])
    print(f"TTFT of a {args.prefix}-token prompt, {args.repeats} repeats, {args.dtype}")
    print(f"{'source':<8}{'median ms':>11}{'min-max ms':>18}{'vs cold':>9}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<8}{median * 1e3:>11.1f}{min(values) * 1e3:>9.1f}-"
              f"{max(values) * 1e3:<8.1f}{median / cold:>9.2f}")
    disk.close()
    remote.close()


def _serve(args: argparse.Namespace, extra: list[str], log: Path) -> tuple[subprocess.Popen[bytes],
                                                                               str]:
    return start_server(["--dtype", args.dtype, "--num-blocks", str(args.pool_blocks), *extra],
                        log)


def part2(args: argparse.Namespace, workdir: str, redis_url: str) -> None:
    runs = []
    for label, extra in (("pool only", []),
                         ("pool+disk+redis", ["--kv-disk-dir", os.path.join(workdir, "trace"),
                                              "--kv-redis-url", redis_url])):
        process, url = _serve(args, extra, Path(workdir) / f"{label.replace(' ', '_')}.log")
        out = os.path.join(workdir, f"{len(runs)}.json")
        try:
            subprocess.run([sys.executable, "-m", "prefixserve", "bench", "--base-url",
                            url + "/v1", "--dataset", "trace", "--trace-path", args.trace,
                            "--num-prompts", str(args.trace_requests), "--trace-sample",
                            "conversations", "--scale",
                            str(args.scale), "--compress-arrivals", "--max-concurrency", "4",
                            "--label", label, "--json", out, "--no-progress"], check=True)
        finally:
            process.terminate()
            process.wait(60)
        runs.append(out)
        with open(out) as file:
            data = json.load(file)
        print(label, json.dumps({k: v for k, v in data.items() if "cache" in k})[:400])
    subprocess.run([sys.executable, "-m", "prefixserve", "bench", "compare", *runs], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", type=int, choices=(1, 2), default=1)
    parser.add_argument("--prefix", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--redis-url")
    parser.add_argument("--trace", default="../shared/traces/mooncake_conversation_trace.jsonl")
    parser.add_argument("--trace-requests", type=int, default=200)
    parser.add_argument("--scale", type=int, default=16,
                        help="trace scale-down (512-token trace blocks become 512/scale)")
    parser.add_argument("--pool-blocks", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir, redis_server(args.redis_url, workdir) as url:
        (part1 if args.part == 1 else part2)(args, workdir, url)


if __name__ == "__main__":
    main()
