"""How fast the one-row kernels (decode of one sequence) stream each weight format, against a
plain read of the same bytes in the same process.

    .venv/bin/python benchmarks/kernel_rates.py [--rows 8192] [--cols 2048] [--copies 24]
        [--threads 2] [--repeat 15] [--formats Q4_0,Q4_1,Q8_0,Q4_K,Q5_K,Q6_K]

For each format a C harness built from ``prefixserve/model/kernels/quant.c`` (the library's own
source, the library's flags) fills ``--copies`` matrices of ``--rows`` x ``--cols`` random
weights (blocks with sane fp16 scales) and, ``--repeat`` times, alternates one pass of
``gemm_quant16_batch`` with one activation row over every copy (far more bytes than the caches
hold: the decode step's case) and one pass summing the same bytes as 64-bit words, both on
``--threads`` threads. It prints each rate (median and range) and the median ratio of the two,
then the kernel's rate on one thread over a single matrix of 256 rows (in L2), the fastest of
``50 x --repeat`` passes: the ceiling its arithmetic sets per core (a pass takes tens of
microseconds, so a median there moves with whatever else the machine runs). A kernel whose
per-core ceiling is not well above its share of the memory's rate cannot stream at the
memory's speed. Needs a C compiler with OpenMP.

Two profiling builds of the 512-bit 4-bit kernels (Q4_0, Q4_1; wrong results, rates only) show
where the time goes: ``PREFIXSERVE_KERNEL_FLAGS=-DPROFILE_Q4_LOADS`` keeps the loads, the scales
and the accumulation but no nibble arithmetic (the kernel's shape's ceiling), and
``-DPROFILE_Q4_HIGH_BYTES`` drops the products with the activations' low bytes (what 8-bit
activations would cost).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prefixserve.model.weights.quant_kernels import _flags  # noqa: E402

FORMATS = {"Q4_1": 0, "Q8_0": 1, "Q4_K": 2, "Q6_K": 3, "Q4_0": 4, "Q5_K": 5}

HARNESS = r"""
#define _GNU_SOURCE
#include "quant.c"
#include <stdio.h>

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, z = *(const double *)b;
    return x < z ? -1 : x > z;
}

/* scale offset of a block of format fmt: d of Q4/Q8 blocks (and Q4_K/Q5_K's d, dmin) at 0,
 * Q6_K's d at 208 */
static void sane_scales(uint8_t *w, int64_t bytes, int fmt) {
    int64_t block = fmt == FMT_Q4_K ? Q4_K_BYTES : fmt == FMT_Q5_K ? Q5_K_BYTES
                  : fmt == FMT_Q6_K ? Q6_K_BYTES : block_bytes(fmt);
    for (int64_t at = 0; at < bytes; at += block) {
        uint16_t d = (uint16_t)(0x2000 + (rand() & 0x3ff));
        uint16_t m = (uint16_t)(0x1c00 + (rand() & 0x3ff));
        memcpy(w + at + (fmt == FMT_Q6_K ? 208 : 0), &d, 2);
        if (fmt == FMT_Q4_1 || fmt == FMT_Q4_K || fmt == FMT_Q5_K) memcpy(w + at + 2, &m, 2);
    }
}

/* seconds of one pass of the one-row product over `copies` matrices, and of a read of them */
static double product_pass(const uint8_t *w, int fmt, int64_t n, int64_t k, int copies,
                           const int16_t *xq, const float *xd, const float *xs, float *y) {
    int64_t bytes = fmt_row_bytes(fmt, k) * n;
    double start = omp_get_wtime();
    for (int c = 0; c < copies; c++) {
        gemm_quant16_batch(w + c * bytes, fmt, n, k, xq, xd, xs, 1, y, n);
    }
    return omp_get_wtime() - start;
}

static double read_pass(const uint8_t *w, int64_t bytes, int64_t *sink) {
    const int64_t *words = (const int64_t *)w;
    int64_t sum = 0;
    double start = omp_get_wtime();
#pragma omp parallel for schedule(static) reduction(+ : sum)
    for (int64_t i = 0; i < bytes / 8; i++) sum += words[i];
    *sink += sum;
    return omp_get_wtime() - start;
}

int main(int argc, char **argv) {
    int fmt = atoi(argv[1]), copies = atoi(argv[4]), repeat = atoi(argv[5]);
    int64_t n = atol(argv[2]), k = atol(argv[3]);
    int64_t bytes = fmt_row_bytes(fmt, k) * n, all = bytes * copies;
    uint8_t *w = aligned_alloc(64, (size_t)all);
    srand(1);
    for (int64_t i = 0; i < all; i++) w[i] = (uint8_t)rand();
    sane_scales(w, all, fmt);
    float *x = malloc((size_t)k * 4), *xd = malloc((size_t)k / 8 + 64);
    float *xs = malloc((size_t)k / 8 + 64);
    int16_t *xq = aligned_alloc(64, (size_t)k * 2 + 64);
    for (int64_t i = 0; i < k; i++) x[i] = (float)(rand() % 2001 - 1000) / 1000.0f;
    quantize_q16(x, 1, k, xq, xd, xs);
    float *y = malloc((size_t)n * 4);
    double *kernel = malloc(sizeof(double) * repeat), *plain = malloc(sizeof(double) * repeat);
    double *ratio = malloc(sizeof(double) * repeat);
    int64_t sink = 0;
    for (int r = 0; r < repeat; r++) {
        kernel[r] = product_pass(w, fmt, n, k, copies, xq, xd, xs, y);
        plain[r] = read_pass(w, all, &sink);
        ratio[r] = plain[r] / kernel[r];
    }
    qsort(kernel, repeat, sizeof(double), by_value);
    qsort(plain, repeat, sizeof(double), by_value);
    qsort(ratio, repeat, sizeof(double), by_value);
    double gb = (double)all / 1e9;
    /* one thread, one matrix of 256 rows, read from L2 after the first pass */
    omp_set_num_threads(1);
    int64_t small = 256 < n ? 256 : n;
    double fastest = 1e30;
    for (int r = 0; r < 50 * repeat; r++) {
        double t = product_pass(w, fmt, small, k, 1, xq, xd, xs, y);
        fastest = t < fastest ? t : fastest;
    }
    double small_gb = (double)(fmt_row_bytes(fmt, k) * small) / 1e9;
    printf("%.3f %.3f %.3f %.3f %.3f %.3f %.3f %.3f %.3f %lld\n", gb / kernel[repeat / 2],
           gb / kernel[repeat - 1], gb / kernel[0], gb / plain[repeat / 2], gb / plain[repeat - 1],
           gb / plain[0], ratio[repeat / 2], small_gb / fastest, y[0] + 0.0,
           (long long)(sink & 1));
    return 0;
}
"""


def build(folder: Path) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("kernel_rates.py needs a C compiler")
    source = folder / "harness.c"
    source.write_text(HARNESS)
    binary = folder / "harness"
    flags = [f for f in _flags() if f not in ("-shared", "-fPIC")]
    subprocess.run([compiler, *flags, "-I", str(ROOT / "prefixserve/model/kernels"),
                    str(source), "-o", str(binary), "-lm"], check=True)
    return binary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=2048)
    parser.add_argument("--copies", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--formats", default=",".join(FORMATS))
    args = parser.parse_args()
    print("$ " + " ".join([Path(sys.executable).name, *sys.argv]), flush=True)
    with tempfile.TemporaryDirectory(prefix="prefixserve-rates-") as tmp:
        binary = build(Path(tmp))
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        print(f"| format | one-row kernel, GB/s | read, GB/s | kernel / read | "
              f"from L2, 1 thread, fastest, GB/s |  ({args.copies} x {args.rows} x {args.cols}, "
              f"{args.threads} threads, median (range) of {args.repeat})")
        print("|---|---:|---:|---:|---:|")
        for name in args.formats.split(","):
            out = subprocess.run([str(binary), str(FORMATS[name]), str(args.rows),
                                  str(args.cols), str(args.copies), str(args.repeat)],
                                 check=True, capture_output=True, text=True, env=env).stdout
            v = [float(f) for f in out.split()]
            print(f"| {name} | {v[0]:.1f} ({v[1]:.1f}-{v[2]:.1f}) | {v[3]:.1f} "
                  f"({v[4]:.1f}-{v[5]:.1f}) | {v[6]:.0%} | {v[7]:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
