/*
 * How much faster does the stream layout (prefixserve/model/kernels/stream.c) let the 4-bit
 * one-row product stream than the file's layout?
 *
 *     cc -O3 -march=native -fopenmp benchmarks/q4_layout_probe.c -o /tmp/q4_layout_probe -lm
 *     OMP_NUM_THREADS=2 /tmp/q4_layout_probe
 *
 * Needs AVX512-VNNI. The same Q4_0 weights (24 matrices of 8192 x 2048, far more than the
 * caches hold) are held twice: in the loader's layout (each row's 18-byte blocks in order)
 * and repacked (repack, as stream.c's pack_group): groups of four rows as one contiguous
 * stream, each run of 16 blocks as the four rows' fp16 scales, then four aligned 64-byte
 * chunks per row, with one prefetch into L2 per chunk, AHEAD bytes ahead (-DAHEAD=0: none). The library's one-row kernel
 * (rows_q4_wide, prefixserve/model/kernels/quant.c, included here) multiplies the first; the
 * probe's (group4) the second, with the same arithmetic: 16-bit activations split into
 * bytes, four vpdpbusd per 64 bytes of nibbles and row, Q4_0's -8 offsets through the
 * activation sums. Both are first checked against each other and against scalar sums (it
 * exits 1 where they differ). Then each product runs alternately with a 64-bit-word sum of
 * its own bytes, 2 threads, one parallel loop over all the rows: the library's, and the
 * probe's whole product, its products with the activations' high bytes only (8-bit
 * activations' cost) and its loads alone (no nibble arithmetic; wrong results, timing only).
 * It prints each rate's median of 15 and kernel / read. The plain read prefetches nothing,
 * so a kernel that does can beat it: compare the kernels' GB/s.
 */
#include "../prefixserve/model/kernels/quant.c"

#include <stdio.h>
#include <time.h>

/* Bytes ahead of each 64-byte chunk that one prefetch (into L2) asks for: one prefetch per
 * cache line of nibbles, as the loader layout's kernels prefetch (WIDE_PREFETCH); 0: none. */
#ifndef AHEAD
#define AHEAD 16384
#endif
#define MATRIX_ROWS 8192
#define COLS 2048
#define NB (COLS / 32)
#define COPIES 24
#define REPEAT 15
#define ROW_BYTES ((size_t)NB * Q4_0_BYTES)
#define RUN_BYTES (128 + 4 * 4 * 64) /* 16 blocks of four rows: scales, then nibbles */
#define GROUP_BYTES ((size_t)NB / 16 * RUN_BYTES)
enum { FULL, HIGH_ONLY, LOADS_ONLY, LOADER };
static volatile uint64_t sink;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* The four rows of group g in the loader's layout (rows, ROW_BYTES each) as one run after
 * another at out (GROUP_BYTES). */
static void repack(const uint8_t *rows, uint8_t *out) {
    for (int b0 = 0; b0 < NB; b0 += 16, out += RUN_BYTES) {
        for (int r = 0; r < 4; r++) {
            for (int i = 0; i < 16; i++) {
                const uint8_t *blk = rows + r * ROW_BYTES + (size_t)(b0 + i) * Q4_0_BYTES;
                memcpy(out + 32 * r + 2 * i, blk, 2);
                memcpy(out + 128 + 256 * (i / 4) + 64 * r + 16 * (i % 4), blk + 2, 16);
            }
        }
    }
}

static inline __m512i sums(const uint8_t *p, const __m512i *l, const __m512i *h, int mode) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512i v = _mm512_load_si512(p);
    if (mode == LOADS_ONLY) return v;
    __m512i q0 = _mm512_and_si512(v, low), q1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    __m512i s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q0, h[0]), q1,
                                    h[1]);
    if (mode == HIGH_ONLY) return s;
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_slli_epi32(s, 8), l[0], q0), l[1], q1);
}

/* Outputs y[0..4) of one repacked group of four rows g for the split activations xl, xh
 * (scales xd, sums xs). */
static inline __attribute__((always_inline)) void group4(const uint8_t *g, const uint8_t *xl,
                                                         const uint8_t *xh, const float *xd,
                                                         const float *xs, float *y, int mode) {
    __m512 acc[4], off[4];
    for (int r = 0; r < 4; r++) acc[r] = off[r] = _mm512_setzero_ps();
    for (int b0 = 0; b0 < NB; b0 += 16, g += RUN_BYTES) {
        __m512 scale[4];
        for (int r = 0; r < 4; r++) {
            __m512 d = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(g + 32 * r)));
            off[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(-8.0f)),
                                     _mm512_loadu_ps(xs + b0), off[r]);
            scale[r] = _mm512_mul_ps(d, _mm512_loadu_ps(xd + b0));
        }
        __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        for (int p = 0; p < 4; p++, pick = _mm512_add_epi32(pick, _mm512_set1_epi32(4))) {
            int e = (b0 + 4 * p) * 32;
            const uint8_t *chunk = g + 128 + 256 * p;
            __m512i l[2] = {_mm512_loadu_si512(xl + e), _mm512_loadu_si512(xl + e + 64)};
            __m512i h[2] = {_mm512_loadu_si512(xh + e), _mm512_loadu_si512(xh + e + 64)};
            for (int r = 0; r < 4; r++) {
                if (AHEAD) _mm_prefetch((const char *)(chunk + 64 * r + AHEAD), _MM_HINT_T1);
                __m512i s = sums(chunk + 64 * r, l, h, mode);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s),
                                         _mm512_permutexvar_ps(pick, scale[r]), acc[r]);
            }
        }
    }
    for (int r = 0; r < 4; r++) y[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], off[r]));
}

typedef struct {
    const uint8_t *loader, *repacked, *xb;
    const float *xd, *xs;
    size_t groups;
} Product;

/* Seconds of one product over every row: the library's kernel on the loader's layout
 * (LOADER) or the probe's on the repacked one (the other modes). */
static double product(const Product *a, float *y, int mode) {
    double t0 = now();
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < a->groups; i++) {
        /* a constant mode per call, so that each inlined copy has its branches folded away */
        const uint8_t *g = a->repacked + i * GROUP_BYTES, *xl = a->xb, *xh = a->xb + COLS;
        if (mode == LOADER) {
            rows_q4_wide(a->loader + i * 4 * ROW_BYTES, FMT_Q4_0, (int64_t)ROW_BYTES, a->xb,
                         a->xd, a->xs, NB, y + 4 * i);
        } else if (mode == FULL) {
            group4(g, xl, xh, a->xd, a->xs, y + 4 * i, FULL);
        } else if (mode == HIGH_ONLY) {
            group4(g, xl, xh, a->xd, a->xs, y + 4 * i, HIGH_ONLY);
        } else {
            group4(g, xl, xh, a->xd, a->xs, y + 4 * i, LOADS_ONLY);
        }
    }
    return now() - t0;
}

/* Output r of the rows in the loader's layout, summed one by one (scalar). */
static double reference(const uint8_t *row, const uint8_t *xb, const float *xd,
                        const float *xs) {
    double y = 0;
    for (int b = 0; b < NB; b++, row += Q4_0_BYTES) {
        int e = b / 4 * 128 + 16 * (b % 4); /* SPLIT_Q4: a group's elements 0-15, then 16-31 */
        int64_t sum = 0;
        for (int i = 0; i < 16; i++) {
            int x0 = 256 * (int8_t)xb[COLS + e + i] + xb[e + i];
            int x1 = 256 * (int8_t)xb[COLS + e + 64 + i] + xb[e + 64 + i];
            sum += (row[2 + i] & 15) * x0 + (row[2 + i] >> 4) * x1;
        }
        double d = (double)_cvtsh_ss(*(const uint16_t *)row);
        y += d * xd[b] * (double)sum - 8 * d * xs[b];
    }
    return y;
}

static double median(double *v) {
    for (int i = 0; i < REPEAT; i++)
        for (int j = i + 1; j < REPEAT; j++)
            if (v[j] < v[i]) { double t = v[i]; v[i] = v[j]; v[j] = t; }
    return v[REPEAT / 2];
}

/* The largest relative difference of the two products from each other and from the scalar
 * sums, over 64 groups across the matrices. */
static double worst_difference(const Product *a, float *y, float *y_loader) {
    product(a, y, FULL);
    product(a, y_loader, LOADER);
    double worst = 0;
    for (size_t i = 0; i < a->groups; i += a->groups / 64) {
        for (int r = 0; r < 4; r++) {
            double want = reference(a->loader + (4 * i + r) * ROW_BYTES, a->xb, a->xd, a->xs);
            double scale = fabs(want) + 1e-30;
            worst = fmax(worst, fabs(y[4 * i + r] - want) / scale);
            worst = fmax(worst, fabs(y_loader[4 * i + r] - want) / scale);
        }
    }
    return worst;
}

int main(void) {
    size_t groups = (size_t)COPIES * MATRIX_ROWS / 4, bytes = groups * GROUP_BYTES;
    uint8_t *loader = aligned_alloc(64, bytes), *repacked = aligned_alloc(64, bytes);
    float *x = malloc(COLS * sizeof(float)), *xd = malloc(NB * sizeof(float));
    float *xs = malloc(NB * sizeof(float)), *y = malloc(4 * groups * sizeof(float));
    float *y_loader = malloc(4 * groups * sizeof(float));
    int16_t *xq = malloc(COLS * sizeof(int16_t));
    if (!loader || !repacked || !x || !xd || !xs || !y || !y_loader || !xq) return 1;
    for (size_t i = 0; i < bytes; i++) loader[i] = (uint8_t)((i * 2654435761u) >> 13);
    for (size_t b = 0; b < bytes / Q4_0_BYTES; b++) { /* sane scales: 1/16 to 1/8 */
        uint16_t d = (uint16_t)(0x2c00 + b % 1024);
        memcpy(loader + b * Q4_0_BYTES, &d, 2);
    }
    for (size_t i = 0; i < groups; i++) {
        repack(loader + i * 4 * ROW_BYTES, repacked + i * GROUP_BYTES);
    }
    for (int i = 0; i < COLS; i++) x[i] = (float)((i * 37) % 2001 - 1000) / 1000.0f;
    quantize_q16(x, 1, COLS, xq, xd, xs);
    uint8_t *xb = split_row(xq, COLS, FMT_Q4_0);
    if (!xb) return 1;
    Product a = {loader, repacked, xb, xd, xs, groups};
    double worst = worst_difference(&a, y, y_loader);
    if (worst > 1e-4) {
        printf("the products differ from the scalar sums by %.2g (relative)\n", worst);
        return 1;
    }
    const char *names[4] = {"repacked: whole product", "repacked: high bytes only",
                            "repacked: loads only", "loader's layout (rows_q4_wide)"};
    printf("| build | kernel, GB/s | read, GB/s | kernel / read |  (Q4_0, %d x %d x %d, %d "
           "threads, median of %d; checked: %.1g)\n|---|---:|---:|---:|\n", COPIES, MATRIX_ROWS,
           COLS, omp_get_max_threads(), REPEAT, worst);
    for (int mode = LOADER; mode >= FULL; mode--) {
        const uint8_t *w = mode == LOADER ? loader : repacked;
        double kern[REPEAT], read[REPEAT];
        for (int rep = 0; rep < REPEAT; rep++) {
            kern[rep] = (double)bytes / product(&a, y, mode) / 1e9;
            double t0 = now();
            uint64_t total = 0;
#pragma omp parallel for reduction(+ : total) schedule(static)
            for (size_t i = 0; i < bytes / 8; i++) total += ((const uint64_t *)w)[i];
            read[rep] = (double)bytes / (now() - t0) / 1e9;
            sink += total + (uint64_t)y[0]; /* both results used: neither loop is dropped */
        }
        double k = median(kern), r = median(read);
        printf("| %s | %.1f | %.1f | %.0f%% |\n", names[mode], k, r, 100 * k / r);
    }
    free(xb);
    return 0;
}
