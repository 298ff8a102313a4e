"""The machine's arithmetic ceiling: register-only loops of 512-bit FMAs and of ``vdpbf16ps``.

    .venv/bin/python benchmarks/peak_flops.py [--threads 1,2] [--repeat 5]

Each thread keeps 12 independent accumulators in registers and updates them in a loop with
nothing else to wait for (no loads), so the rate is what the CPU's vector units can do at the
most: the ceiling against which the kernels' rates in benchmarks/RESULTS.md (issue 11) are
read. A ``vdpbf16ps`` makes 32 multiply-adds (64 flops) of bfloat16 pairs into 16 float32
lanes, a 512-bit FMA 16 (32 flops). Needs a C compiler with OpenMP, as the kernels do; the
``vdpbf16ps`` row only where the CPU has AVX512-BF16, both only with AVX-512. Prints a table
of the median and range of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <string.h>

#define ACCUMULATORS 12
#define ITERATIONS 50000000L

/* flops per second of ITERATIONS rounds of ACCUMULATORS independent updates per thread */
static double rate(int bf16) {
    double start = omp_get_wtime(), sink = 0.0;
#pragma omp parallel reduction(+ : sink)
    {
        __m512 acc[ACCUMULATORS];
        for (int i = 0; i < ACCUMULATORS; i++) acc[i] = _mm512_setzero_ps();
        __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(1e-9f);
#ifdef __AVX512BF16__
        __m512bh ah = (__m512bh)_mm512_set1_epi16(0x3f80), bh = (__m512bh)_mm512_set1_epi16(0x3000);
#endif
/* the 12 updates written out, so that the accumulators stay in registers */
#define TWELVE(STEP) STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5) STEP(6) STEP(7) STEP(8) \
                     STEP(9) STEP(10) STEP(11)
#define FMA(i) acc[i] = _mm512_fmadd_ps(a, b, acc[i]);
#define DOT(i) acc[i] = _mm512_dpbf16_ps(acc[i], ah, bh);
        if (bf16) {
#ifdef __AVX512BF16__
            for (long it = 0; it < ITERATIONS; it++) {
                TWELVE(DOT)
                __asm__ volatile("" : "+v"(ah), "+v"(bh));
            }
#endif
        } else {
            for (long it = 0; it < ITERATIONS; it++) {
                TWELVE(FMA)
                __asm__ volatile("" : "+v"(a), "+v"(b));
            }
        }
        for (int i = 0; i < ACCUMULATORS; i++) sink += _mm512_reduce_add_ps(acc[i]);
    }
    double seconds = omp_get_wtime() - start;
    double flops = (double)omp_get_max_threads() * ITERATIONS * ACCUMULATORS * (bf16 ? 64 : 32);
    if (sink < 0) printf("%g\n", sink); /* keeps the sums */
    return flops / seconds;
}

int main(int argc, char **argv) {
    int bf16 = argc > 1 && strcmp(argv[1], "bf16") == 0;
#ifndef __AVX512BF16__
    if (bf16) return 3;
#endif
    printf("%.1f\n", rate(bf16) / 1e9);
    return 0;
}
"""


def build(directory: Path) -> Path:
    source = directory / "peak.c"
    source.write_text(SOURCE)
    binary = directory / "peak"
    subprocess.run([os.environ.get("CC", "cc"), "-O3", "-march=native", "-fopenmp",
                    str(source), "-o", str(binary)], check=True)
    return binary


def measure(binary: Path, kind: str, threads: int) -> float | None:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_PROC_BIND": "true"}
    result = subprocess.run([str(binary), kind], env=env, capture_output=True, text=True)
    return float(result.stdout) if result.returncode == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            binary = build(Path(tmp))
        except subprocess.CalledProcessError:
            raise SystemExit("the loops did not build: they need a C compiler with OpenMP and "
                             "an AVX-512 CPU") from None
        print("| loop | threads | GFLOP/s, median (range) |")
        print("|---|---|---|")
        for kind, label in (("fma", "512-bit FMA, float32"), ("bf16", "vdpbf16ps, bfloat16")):
            for threads in (int(t) for t in args.threads.split(",")):
                runs = [measure(binary, kind, threads) for _ in range(args.repeat)]
                rates = [r for r in runs if r is not None]
                if not rates:
                    print(f"| {label} | {threads} | not on this CPU |")
                    continue
                print(f"| {label} | {threads} | {statistics.median(rates):.1f} "
                      f"({min(rates):.1f}-{max(rates):.1f}) |")


if __name__ == "__main__":
    main()
