"""What a strided read of the KV cache costs: a third of every slot against whole slots.

    .venv/bin/python benchmarks/strided_reads.py [--mib 1200] [--threads 2] [--repeat 5]

A slot of the paged KV cache holds every KV head's key (or value) side by side: the default
model's three KV heads of 64 bfloat16 elements make 384 bytes, a head's share 128 bytes (two
cache lines of six). Attention that reads one KV head at a time reads two lines of every six;
attention that takes all the KV heads of a run at once reads them all, in order. This loop
reads a buffer of ``--mib`` MiB (far larger than the caches) in three ways on ``--threads``
threads: every line; the first two lines of every 384 bytes; and a contiguous third of the
buffer (the same bytes as the strided read, in order). One 8-byte word is loaded per line, so
the time is the memory's, not arithmetic. Prints the median and range of ``--repeat`` runs
and each time against reading every line (issue 11, round 8 in benchmarks/RESULTS.md). Needs a
C compiler with OpenMP, as the kernels do.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* seconds to read `bytes` of buf: mode 0 every line, 1 two lines of every 384 bytes,
 * 2 the first third contiguously (a word of each 64-byte line) */
static double read_time(const char *buf, long bytes, int mode) {
    double start = omp_get_wtime();
    uint64_t sink = 0;
#pragma omp parallel for schedule(static) reduction(^ : sink)
    for (long slot = 0; slot < bytes / 384; slot++) {
        const uint64_t *at = (const uint64_t *)(buf + slot * (mode == 2 ? 128 : 384));
        if (mode == 0) {
            for (int line = 0; line < 6; line++) sink ^= at[8 * line];
        } else {
            sink ^= at[0] ^ at[8];
        }
    }
    double seconds = omp_get_wtime() - start;
    if (sink == 42) printf("#\n"); /* keeps the loads */
    return seconds;
}

int main(int argc, char **argv) {
    long bytes = atol(argv[1]) << 20;
    bytes -= bytes % 384;
    char *buf = aligned_alloc(4096, bytes);
    if (!buf) return 2;
    memset(buf, 1, bytes);
    for (int mode = 0; mode < 3; mode++) printf("%.6f\n", read_time(buf, bytes, mode));
    return 0;
}
"""

LABELS = ("every line", "two lines of every 384 bytes (one KV head of three)",
          "a contiguous third (the same bytes, in order)")


def build(directory: Path) -> Path:
    source = directory / "strided.c"
    source.write_text(SOURCE)
    binary = directory / "strided"
    subprocess.run([os.environ.get("CC", "cc"), "-O2", "-fopenmp", str(source), "-o",
                    str(binary)], check=True)
    return binary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=1200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    times: list[list[float]] = [[], [], []]
    with tempfile.TemporaryDirectory() as tmp:
        try:
            binary = build(Path(tmp))
        except subprocess.CalledProcessError:
            raise SystemExit("the loop did not build: it needs a C compiler with OpenMP") from None
        for _ in range(args.repeat):
            out = subprocess.run([str(binary), str(args.mib)], env=env, capture_output=True,
                                 text=True, check=True).stdout.split()
            for mode in range(3):
                times[mode].append(float(out[mode]) * 1e3)
    whole = statistics.median(times[0])
    print(f"{args.mib} MiB, {args.threads} threads")
    print("| read | ms, median (range) | GB/s of the bytes used | time / every line |")
    print("|---|---|---|---|")
    for mode, label in enumerate(LABELS):
        ms = statistics.median(times[mode])
        used = args.mib * 2**20 / (1 if mode == 0 else 3)
        print(f"| {label} | {ms:.1f} ({min(times[mode]):.1f}-{max(times[mode]):.1f}) | "
              f"{used / ms / 1e6:.1f} | {ms / whole:.2f} |")


if __name__ == "__main__":
    main()
