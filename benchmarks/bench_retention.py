"""Cost of retention levels in the prefix-cache core, against a baseline checkout (no model).

Reproduce on a quiet machine with::

    .venv/bin/python benchmarks/bench_retention.py --baseline /path/to/main/checkout
    .venv/bin/python benchmarks/bench_retention.py --baseline ../main --requests 20000 --repeat 7

Each run is a fresh subprocess (so both trees import their own ``prefixserve.core``); runs of
the variants are interleaved, ``--repeat`` times, and the table gives the median time per
request and per decode step, the spread (max-min over median), and the ratio to the baseline.
Variants: the baseline tree; this tree without retention (the path every request takes when
no one asks for retention); this tree with every request retained (priority 80, 300 s, with a
simulated clock: every request expires 300 requests later, so the expiry heap and the
fall-back work too).

A request is ``get_computed_blocks`` + ``allocate_slots`` (whole prompt) + ``free`` +
``free_block_hashes``: 1,000-token prompts, block size 16, half of each prompt shared by all, a
pool of 4,000 blocks (it evicts all the time). A decode step is ``allocate_slots(request, 1)``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent.parent

WORKER = r"""
import json, random, sys, time
from prefixserve.core import CacheRequest, KVCacheManager
retained = sys.argv[1] == "1"
num = int(sys.argv[2])
clock = [0.0]
kwargs = {"clock": lambda: clock[0]} if retained else {}
manager = KVCacheManager(4000, 16, **kwargs)
retention = None
if retained:
    from prefixserve.core import Retention
    retention = Retention.whole_prompt(80, 300.0)
rng = random.Random(0)
shared = [rng.randrange(50_000) for _ in range(500)]
prompts = [shared + [rng.randrange(50_000) for _ in range(500)] for _ in range(num)]
extra = {"retention": retention} if retained else {}
start = time.perf_counter()
for i, tokens in enumerate(prompts):
    clock[0] = float(i)
    r = CacheRequest(str(i), tokens, **extra)
    hits, n = manager.get_computed_blocks(r)
    manager.allocate_slots(r, len(tokens) - n, hits)
    manager.free(r)
    manager.free_block_hashes(r)
per_request = (time.perf_counter() - start) / num
r = CacheRequest("d", list(prompts[0]), **extra)
hits, n = manager.get_computed_blocks(r)
manager.allocate_slots(r, len(r.token_ids) - n, hits)
r.num_computed_tokens = len(r.token_ids)
steps = 2000
start = time.perf_counter()
for t in range(steps):
    r.token_ids.append(t)
    manager.allocate_slots(r, 1)
    r.num_computed_tokens += 1
per_step = (time.perf_counter() - start) / steps
print(json.dumps({"request": per_request, "step": per_step}))
"""


def run(tree: Path, retained: bool, requests: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", WORKER, "1" if retained else "0", str(requests)],
                         env={"PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"},
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True,
                        help="a checkout whose prefixserve/ is the baseline (e.g. main)")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    variants = [("baseline", args.baseline, False), ("this tree", HERE, False),
                ("this tree, all retained", HERE, True)]
    times: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in variants}
    for _ in range(args.repeat):
        for name, tree, retained in variants:
            times[name].append(run(tree, retained, args.requests))
    table = Table(title=f"retention levels: {args.requests:,} requests, {args.repeat} runs")
    for column in ("variant", "us / request", "spread", "vs baseline", "us / decode step",
                   "spread", "vs baseline"):
        table.add_column(column, justify="right")
    base = {k: statistics.median(t[k] for t in times["baseline"]) for k in ("request", "step")}
    for name, _, _ in variants:
        row = [name]
        for key in ("request", "step"):
            values = [t[key] for t in times[name]]
            median = statistics.median(values)
            row += [f"{median * 1e6:.1f}", f"{(max(values) - min(values)) / median:.0%}",
                    f"{median / base[key]:.2f}x"]
        table.add_row(*row)
    Console().print(table)


if __name__ == "__main__":
    main()
