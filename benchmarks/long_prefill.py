"""A short request sent beside one long prompt's prefill, with and without the long-prefill
threshold, on real ``prefixserve serve`` processes on 127.0.0.1.

A client sends an 8,000-token prompt (random token ids, ``max_tokens`` 1); one second later a
second client sends a 4-token prompt (``max_tokens`` 4). The table gives, for each setting, the
short request's time to first token and total time, and the long request's total time, median
and range over ``--repeats`` rounds (a fresh prompt each round, so nothing is cached). Settings:
``--long-prefill-token-threshold 0`` (off: a running prefill takes the whole step budget) and
the default (a quarter of ``--max-num-batched-tokens``). The last column is the ratio of the
short request's TTFT to the off setting's.

Usage (about 3 minutes on 2 cores)::

    .venv/bin/python benchmarks/long_prefill.py [--repeats 3] [--dtype float32]
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import httpx
from local_server import start_server

LONG_TOKENS = 8000
SHORT_PROMPT = [1, 504, 3458, 314]


def start(extra: Sequence[str], dtype: str) -> tuple[subprocess.Popen[bytes], str]:
    return start_server(["--dtype", dtype, "--max-model-len", "8192", "--num-blocks", "1200",
                         *extra])


def short_request(url: str, out: dict[str, float], start_time: float) -> None:
    body = {"prompt": SHORT_PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and "ttft" not in out:
                out["ttft"] = time.monotonic() - start_time
    out["total"] = time.monotonic() - start_time


def one_round(url: str, rng: random.Random) -> dict[str, float]:
    long_ids = [rng.randrange(1000, 40000) for _ in range(LONG_TOKENS)]
    times: dict[str, float] = {}

    def long_request() -> None:
        begin = time.monotonic()
        httpx.post(url + "/v1/completions", json={"prompt": long_ids, "max_tokens": 1},
                   timeout=600).raise_for_status()
        times["long"] = time.monotonic() - begin

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(1.0)
    short: dict[str, float] = {}
    short_request(url, short, time.monotonic())
    thread.join()
    return {"ttft": short["ttft"], "total": short["total"], "long": times["long"]}


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    print(f"command: {' '.join(sys.argv)}")
    rng = random.Random(0)
    settings = {"threshold off": ["--long-prefill-token-threshold", "0"],
                "threshold default (512)": []}
    rows = {}
    for name, extra in settings.items():
        process, url = start(extra, args.dtype)
        try:
            rounds = [one_round(url, rng) for _ in range(args.repeats)]
        finally:
            process.terminate()
            process.wait(60)
        rows[name] = rounds
    base = statistics.median(r["ttft"] for r in rows["threshold off"])
    print("| setting | short TTFT (s) | short total (s) | long total (s) | short TTFT / off |")
    print("|---|---:|---:|---:|---:|")
    for name, rounds in rows.items():
        ttft = [r["ttft"] for r in rounds]
        print(f"| {name} | {summary(ttft)} | {summary([r['total'] for r in rounds])} | "
              f"{summary([r['long'] for r in rounds])} | {statistics.median(ttft) / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
