"""``prefixserve estimate`` side by side with KVCache.AI's ``kvcache-simulator`` on the Mooncake
traces: hit rates, wall time and peak memory of both tools.

Needs ``pip install kvcache-simulator==0.1.3`` (pure Python, no torch) and a C++ compiler for its
default backend. Usage::

    .venv/bin/python benchmarks/compare_estimate.py [--traces ../shared/traces] [--repeats 3]

Three parts:

1. **Same definitions.** Block size 512 (the traces' own), LRU, hit rate by tokens over the last
   50% of requests, budgets of 8 to 2048 GiB at 64 MiB a block (kvcache-simulator's
   ``llama-3.1-8b`` preset: 128 KiB a token in bf16). The engine never caches a partial block;
   kvcache-simulator lets a request's partial last block hit when its id comes again. So it runs
   twice: on the trace as it is (its own definition) and on the trace with each partial last block
   renamed to a fresh id (the engine's definition), where the two tools must agree to 3 decimals.
2. **Speed.** The conversation trace at 16-token blocks (512-token ids split in 32), five budgets
   (8 to 2048 GiB at 2 MiB a block): ``prefixserve estimate`` (its parallel processes) against
   kvcache-simulator (its C++ core) fed the same split trace, both run as subprocesses.
3. **The paper.** The infinite cache over all requests against the Mooncake (FAST'25) Table 2
   cache ratio, from both tools.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
TRACE_NAMES = ("conversation", "synthetic")
BUDGETS_GIB = (8, 32, 128, 512, 2048)
KV_BYTES_PER_TOKEN = 131072
"""Llama 3.1 8B, bf16: 32 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes."""
KVSIM_MODEL = "llama-3.1-8b"
TRACE_BLOCK = 512
SMALL_BLOCK = 16
PAPER_CACHE_RATIO = {"conversation": 0.40, "synthetic": 0.66}
FRESH_ID_BASE = 1 << 40
"""Ids given to partial last blocks, above any id of the traces."""


@dataclass
class Measured:
    """One subprocess run: wall seconds, CPU seconds (user + system) and peak resident memory
    (MiB), of the process and the children it waited for."""

    seconds: float
    cpu_seconds: float
    peak_mib: float


def run_measured(command: list[str]) -> Measured:
    """Runs ``command`` to completion; raises CalledProcessError when it fails."""
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    assert process.stderr is not None
    stderr = process.stderr.read()
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({process.returncode}):\n"
                           f"{stderr.decode(errors='replace')}")
    return Measured(seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024)


def repeat(command: list[str], times: int) -> list[Measured]:
    return [run_measured(command) for _ in range(times)]


def spread(values: list[float], unit: str = "s") -> str:
    """``median [min-max]`` of ``values``."""
    return escape(f"{statistics.median(values):.1f} {unit} "
                  f"[{min(values):.1f}-{max(values):.1f}]")


# ----------------------------------------------------------------------------- traces


def _records(path: Path) -> Iterator[dict]:
    with path.open() as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def write_renamed_partials(source: Path, target: Path) -> None:
    """``source`` with each partial last 512-token block renamed to a fresh id."""
    fresh = FRESH_ID_BASE
    with target.open("w") as out:
        for record in _records(source):
            length = record["input_length"]
            ids = record["hash_ids"][: length // TRACE_BLOCK]
            if length % TRACE_BLOCK:
                ids.append(fresh)
                fresh += 1
            out.write(json.dumps({"input_length": length, "hash_ids": ids,
                                  "block_size": TRACE_BLOCK}) + "\n")


def write_split(source: Path, target: Path) -> None:
    """``source`` at 16-token blocks, as ``prefixserve estimate`` splits it: id ``i`` becomes
    ``i * 32 + j``; the partial last 16-token block gets a fresh id."""
    k = TRACE_BLOCK // SMALL_BLOCK
    fresh = FRESH_ID_BASE
    with target.open("w") as out:
        for record in _records(source):
            length = record["input_length"]
            full = length // SMALL_BLOCK
            ids = [i * k + j for i in record["hash_ids"] for j in range(k)][:full]
            if length % SMALL_BLOCK:
                ids.append(fresh)
                fresh += 1
            out.write(json.dumps({"input_length": length, "hash_ids": ids,
                                  "block_size": SMALL_BLOCK}) + "\n")


# ----------------------------------------------------------------------------- the two tools


def ours_command(trace: Path, out: Path, block_size: int) -> list[str]:
    budgets = ",".join(f"{gib}GiB" for gib in BUDGETS_GIB)
    return [sys.executable, "-m", "prefixserve", "estimate", str(trace), "--block-size",
            str(block_size), "--kv-memory", budgets, "--kv-bytes-per-token",
            str(KV_BYTES_PER_TOKEN), "--warmup-fraction", "0.5", "--json", str(out),
            "--no-progress"]


def kvsim_command(kvsim: str, trace: Path, out: Path) -> list[str]:
    return [kvsim, "run", "--trace", str(trace), "--block-size", str(TRACE_BLOCK), "--model",
            KVSIM_MODEL, "--policies", "lru",
            "--budgets-gib", ",".join(str(g) for g in BUDGETS_GIB), "--format", "json",
            "--output", str(out), "--no-progress"]


def ours_rates(out: Path) -> tuple[dict[int, float], float]:
    """Token hit rate per pool size in blocks, and the infinite cache's."""
    report = json.loads(out.read_text())
    rates = {c["capacity_blocks"]: c["token_hit_rate"] for c in report["caches"]
             if not c["infinite"]}
    infinite = next(c["token_hit_rate"] for c in report["caches"] if c["infinite"])
    return rates, infinite


def ours_too_large(out: Path) -> dict[int, int]:
    """Measured requests per pool size that need more blocks than the pool holds."""
    report = json.loads(out.read_text())
    return {c["capacity_blocks"]: c["requests_too_large"] for c in report["caches"]}


def kvsim_rates(out: Path) -> tuple[dict[int, float], float]:
    """LRU hit rate per budget in blocks (budgets it reports), and its ceiling."""
    report = json.loads(out.read_text())
    rates = {p["cacheBlocks"]: p["results"]["lru"]["hitRate"] for p in report["points"]}
    return rates, report["hitRateCeiling"]


# ----------------------------------------------------------------------------- the parts


def _rate(rates: dict[int, float], blocks: int) -> str:
    return f"{rates[blocks]:.4f}" if blocks in rates else "omitted"


def same_definitions(console: Console, kvsim: str, traces: Path, work: Path,
                     repeats: int) -> dict:
    """Part 1: block size 512; returns every figure for the JSON record."""
    table = Table(title="Same definitions: block size 512, LRU, last 50% of requests, "
                  "hit rate by tokens")
    for column in ("trace", "budget", "blocks", "prefixserve", "kvsim (partial renamed)",
                   "|diff|", "kvsim (as is)", "too large"):
        table.add_column(column, justify="right")
    record: dict = {}
    times = Table(title=escape(f"Time of one run (median [min-max] of {repeats})"))
    for column in ("trace", "prefixserve wall", "prefixserve CPU", "kvsim wall", "kvsim CPU"):
        times.add_column(column, justify="right")
    for name in TRACE_NAMES:
        source = traces / f"mooncake_{name}_trace.jsonl"
        renamed = work / f"{name}_renamed.jsonl"
        write_renamed_partials(source, renamed)
        ours_out, aligned_out, raw_out = (work / f"{name}_{x}.json" for x in
                                          ("ours", "kvsim_renamed", "kvsim_raw"))
        ours_runs = repeat(ours_command(source, ours_out, TRACE_BLOCK), repeats)
        kvsim_runs = repeat(kvsim_command(kvsim, renamed, aligned_out), repeats)
        run_measured(kvsim_command(kvsim, source, raw_out))
        ours, ours_inf = ours_rates(ours_out)
        aligned, aligned_inf = kvsim_rates(aligned_out)
        raw, raw_inf = kvsim_rates(raw_out)
        too_large = ours_too_large(ours_out)
        rows = []
        for gib in BUDGETS_GIB:
            blocks = gib * 2**30 // (KV_BYTES_PER_TOKEN * TRACE_BLOCK)
            diff = abs(ours[blocks] - aligned[blocks]) if blocks in aligned else None
            table.add_row(name, f"{gib} GiB", f"{blocks:,}", f"{ours[blocks]:.4f}",
                          _rate(aligned, blocks), "-" if diff is None else f"{diff:.4f}",
                          _rate(raw, blocks), f"{too_large[blocks]:,}")
            rows.append({"gib": gib, "blocks": blocks, "prefixserve": ours[blocks],
                         "kvsim_renamed": aligned.get(blocks), "kvsim_raw": raw.get(blocks),
                         "too_large": too_large[blocks]})
        table.add_row(name, "infinite", "-", f"{ours_inf:.4f}", f"{aligned_inf:.4f}",
                      f"{abs(ours_inf - aligned_inf):.4f}", f"{raw_inf:.4f}", "0",
                      end_section=True)
        times.add_row(name, spread([m.seconds for m in ours_runs]),
                      spread([m.cpu_seconds for m in ours_runs]),
                      spread([m.seconds for m in kvsim_runs]),
                      spread([m.cpu_seconds for m in kvsim_runs]))
        record[name] = {"rows": rows, "infinite": {"prefixserve": ours_inf,
                                                   "kvsim_renamed": aligned_inf,
                                                   "kvsim_raw": raw_inf},
                        "runs": {"prefixserve": [vars(m) for m in ours_runs],
                                 "kvsim": [vars(m) for m in kvsim_runs]}}
    console.print(table)
    console.print("too large: measured requests that need more blocks than the pool holds. "
                  "The engine cannot run them (prefixserve counts them with no hit and leaves "
                  "the cache as it is); kvcache-simulator inserts what fits, evicting. The two "
                  "definitions differ only there.\nomitted: kvcache-simulator leaves out "
                  "budgets whose cache is not full before the measured window.")
    console.print(times)
    return record


def speed(console: Console, kvsim: str, traces: Path, work: Path, repeats: int) -> dict:
    """Part 2: the conversation trace at 16-token blocks, five budgets, both tools."""
    source = traces / "mooncake_conversation_trace.jsonl"
    split = work / "conversation_split16.jsonl"
    write_split(source, split)
    ours_out, kvsim_out = work / "speed_ours.json", work / "speed_kvsim.json"
    ours_runs = repeat(ours_command(source, ours_out, SMALL_BLOCK), repeats)
    kvsim_runs = repeat(kvsim_command(kvsim, split, kvsim_out), repeats)
    report = json.loads(ours_out.read_text())
    timing = report["timing"]
    ours, ours_inf = ours_rates(ours_out)
    theirs, theirs_inf = kvsim_rates(kvsim_out)
    table = Table(title="Conversation trace at 16-token blocks: hit rate by tokens, last 50%")
    for column in ("budget", "blocks", "prefixserve", "kvsim", "|diff|"):
        table.add_column(column, justify="right")
    for gib in BUDGETS_GIB:
        blocks = gib * 2**30 // (KV_BYTES_PER_TOKEN * SMALL_BLOCK)
        diff = f"{abs(ours[blocks] - theirs[blocks]):.4f}" if blocks in theirs else "-"
        table.add_row(f"{gib} GiB", f"{blocks:,}", f"{ours[blocks]:.4f}",
                      _rate(theirs, blocks), diff)
    table.add_row("infinite", "-", f"{ours_inf:.4f}", f"{theirs_inf:.4f}",
                  f"{abs(ours_inf - theirs_inf):.4f}")
    console.print(table)
    blocks_per_replay = report["input"]["prompt_blocks"]
    speed_table = Table(title=escape(f"Five budgets + infinite cache, {blocks_per_replay:,} "
                                     f"block lookups a cache (median [min-max] of {repeats})"))
    for column in ("tool", "wall time", "CPU time", "peak memory", "blocks/s (wall)"):
        speed_table.add_column(column, justify="right")
    for tool, runs in (("prefixserve estimate", ours_runs),
                       ("kvcache-simulator (C++)", kvsim_runs)):
        seconds = [m.seconds for m in runs]
        speed_table.add_row(tool, spread(seconds), spread([m.cpu_seconds for m in runs]),
                            spread([m.peak_mib for m in runs], "MiB"),
                            f"{6 * blocks_per_replay / statistics.median(seconds):,.0f}")
    console.print(speed_table)
    console.print(f"prefixserve, last run: read {timing['read_seconds']:.1f} s, replay "
                  f"{timing['replay_seconds']:.1f} s in {timing['processes']} processes, "
                  f"peak {timing['peak_rss_mib']:.0f} MiB main + "
                  f"{timing['worker_peak_rss_mib']:.0f} MiB largest worker.")
    return {"prefixserve": {"runs": [vars(m) for m in ours_runs], "rates": ours,
                            "infinite": ours_inf, "timing": timing},
            "kvsim": {"runs": [vars(m) for m in kvsim_runs], "rates": theirs,
                      "infinite": theirs_inf}}


def paper(console: Console, traces: Path) -> dict:
    """Part 3: infinite cache over all requests, both tools, against Table 2."""
    from kvcache_sim.plan import build_execution_plan
    from kvcache_sim.policies import simulate_ceiling
    from kvcache_sim.trace import parse_trace_file

    from prefixserve.tools.estimate.replay import ReplaySettings, replay_infinite
    from prefixserve.tools.trace_formats import ReadOptions, read_workload

    table = Table(title="Infinite cache over all requests, hit rate by tokens")
    for column in ("trace", "paper (Table 2)", "prefixserve bs 16", "prefixserve bs 512",
                   "kvsim ceiling (as is)"):
        table.add_column(column, justify="right")
    record = {}
    for name in TRACE_NAMES:
        path = traces / f"mooncake_{name}_trace.jsonl"
        ours = {bs: replay_infinite(read_workload(str(path), ReadOptions(block_size=bs)),
                                    ReplaySettings()).token_hit_rate for bs in (16, 512)}
        ceiling = simulate_ceiling(build_execution_plan(
            parse_trace_file(path, block_size=TRACE_BLOCK), 0.0)).hitRate
        table.add_row(name, f"{PAPER_CACHE_RATIO[name]:.0%}", f"{ours[16]:.4f}",
                      f"{ours[512]:.4f}", f"{ceiling:.4f}")
        record[name] = {"paper": PAPER_CACHE_RATIO[name], "prefixserve_16": ours[16],
                        "prefixserve_512": ours[512], "kvsim_ceiling": ceiling}
    console.print(table)
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=Path, default=REPO.parent / "shared" / "traces")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each tool")
    parser.add_argument("--skip-speed", action="store_true", help="skip part 2 (the slow one)")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    args = parser.parse_args()
    kvsim = shutil.which("kvcache-simulator", path=str(Path(sys.executable).parent)) or \
        shutil.which("kvcache-simulator")
    if kvsim is None:
        print("kvcache-simulator is not installed: pip install kvcache-simulator==0.1.3",
              file=sys.stderr)
        return 2
    console = Console(width=max(Console().width, 110))
    console.print(f"{datetime.datetime.now().isoformat(timespec='minutes')}, "
                  f"{platform.node()}: {os.cpu_count()} CPUs, Python "
                  f"{platform.python_version()}, {' '.join(sys.argv)}")
    record: dict = {"date": datetime.date.today().isoformat(), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        run_measured(kvsim_command(kvsim, args.traces / "mooncake_synthetic_trace.jsonl",
                                   work / "warm.json"))  # compiles its C++ core once
        record["same_definitions"] = same_definitions(console, kvsim, args.traces, work,
                                                      args.repeats)
        if not args.skip_speed:
            record["speed"] = speed(console, kvsim, args.traces, work, args.repeats)
    record["paper"] = paper(console, args.traces)
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
