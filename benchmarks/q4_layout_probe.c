/*
 * Would a repacked weight layout let the 4-bit one-row product stream at the memory's speed?
 *
 *     cc -O3 -march=native -fopenmp benchmarks/q4_layout_probe.c -o /tmp/q4_layout_probe -lm
 *     OMP_NUM_THREADS=2 /tmp/q4_layout_probe
 *
 * Needs AVX512-VNNI. Q4_0 weights (24 matrices of 8192 x 2048, far more than the caches hold)
 * in a layout the loader does not use: groups of four rows as one contiguous stream, each run
 * of 16 blocks as the four rows' fp16 scales, then four 64-byte chunks per row (aligned),
 * with one prefetch into L2 per chunk, AHEAD bytes ahead (-DAHEAD=0: none).
 * The products are the ones in rows_q4_wide (prefixserve/model/kernels/quant.c): 16-bit
 * activations split into bytes, four vpdpbusd per 64 bytes of nibbles and row (Q4_0's -8
 * offsets left out). The whole product is first checked against scalar sums over 64 groups
 * (it exits 1 where they differ). Three builds of the inner step then run alternately with a
 * 64-bit-word sum of the same bytes (2 threads): the whole product, the products with the
 * activations' high bytes only (8-bit activations' cost), and the loads alone (no nibble
 * arithmetic; wrong results, timing only). It prints each rate's median of 15 and kernel /
 * read; compare kernel_rates.py --formats Q4_0 run in the same minutes (the loader's layout).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

/* Bytes ahead of each 64-byte chunk that one prefetch (into L2) asks for: one prefetch per
 * cache line of nibbles, as the loader layout's kernels prefetch (WIDE_PREFETCH); 0: none. */
#ifndef AHEAD
#define AHEAD 16384
#endif
#define ROWS 8192
#define K 2048
#define NB (K / 32)
#define COPIES 24
#define REPEAT 15
#define RUN_BYTES (128 + 4 * 4 * 64) /* 16 blocks of four rows: scales, then nibbles */
#define GROUP_BYTES ((size_t)NB / 16 * RUN_BYTES)
enum { FULL, HIGH_ONLY, LOADS_ONLY };
static volatile uint64_t sink;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
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

/* Outputs y[0..4) of one group of four rows g for the split activations xl, xh (scales xd). */
static inline __attribute__((always_inline)) void group4(const uint8_t *g, const uint8_t *xl,
                                                         const uint8_t *xh, const float *xd,
                                                         float *y, int mode) {
    __m512 acc[4];
    for (int r = 0; r < 4; r++) acc[r] = _mm512_setzero_ps();
    for (int b0 = 0; b0 < NB; b0 += 16, g += RUN_BYTES) {
        __m512 scale[4];
        for (int r = 0; r < 4; r++)
            scale[r] = _mm512_mul_ps(
                _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(g + 32 * r))),
                _mm512_loadu_ps(xd + b0));
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
    for (int r = 0; r < 4; r++) y[r] = _mm512_reduce_add_ps(acc[r]);
}

static double product(const uint8_t *w, size_t groups, const uint8_t *xb, const float *xd,
                      float *y, int mode) {
    double t0 = now();
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < groups; i++) {
        /* a constant mode per call, so that each inlined copy has its branches folded away */
        const uint8_t *g = w + i * GROUP_BYTES;
        if (mode == FULL) group4(g, xb, xb + K, xd, y + 4 * i, FULL);
        else if (mode == HIGH_ONLY) group4(g, xb, xb + K, xd, y + 4 * i, HIGH_ONLY);
        else group4(g, xb, xb + K, xd, y + 4 * i, LOADS_ONLY);
    }
    return now() - t0;
}

/* The whole product's outputs of group g, summed one by one in the order of the layout's
 * bytes (scalar): what the vector build must give, up to the float sums' order. */
static void reference(const uint8_t *g, const uint8_t *xl, const uint8_t *xh, const float *xd,
                      double *y) {
    for (int r = 0; r < 4; r++) y[r] = 0;
    for (int b0 = 0; b0 < NB; b0 += 16, g += RUN_BYTES) {
        for (int r = 0; r < 4; r++) {
            for (int b = b0; b < b0 + 16; b++) {
                int p = (b - b0) / 4, j = (b - b0) % 4, e = (b0 + 4 * p) * 32 + 16 * j;
                const uint8_t *nibbles = g + 128 + 256 * p + 64 * r + 16 * j;
                int64_t sum = 0;
                for (int i = 0; i < 16; i++) {
                    int x0 = 256 * (int8_t)xh[e + i] + xl[e + i];
                    int x1 = 256 * (int8_t)xh[e + 64 + i] + xl[e + 64 + i];
                    sum += (nibbles[i] & 15) * x0 + (nibbles[i] >> 4) * x1;
                }
                y[r] += (double)_cvtsh_ss(((const uint16_t *)(g + 32 * r))[b - b0]) * xd[b] *
                        (double)sum;
            }
        }
    }
}

static double median(double *v) {
    for (int i = 0; i < REPEAT; i++)
        for (int j = i + 1; j < REPEAT; j++)
            if (v[j] < v[i]) { double t = v[i]; v[i] = v[j]; v[j] = t; }
    return v[REPEAT / 2];
}

int main(void) {
    size_t groups = (size_t)COPIES * ROWS / 4, bytes = groups * GROUP_BYTES;
    uint8_t *w = aligned_alloc(64, bytes), *xb = aligned_alloc(64, 2 * K);
    float *xd = aligned_alloc(64, NB * sizeof(float));
    float *y = aligned_alloc(64, 4 * groups * sizeof(float));
    if (!w || !xb || !xd || !y) return 1;
    for (size_t i = 0; i < bytes; i++) w[i] = (uint8_t)((i * 2654435761u) >> 13);
    for (size_t i = 0; i < groups * (NB / 16); i++) { /* sane scales: 0.0625 */
        uint16_t *s = (uint16_t *)(w + i * RUN_BYTES);
        for (int k = 0; k < 64; k++) s[k] = 0x2c00;
    }
    for (int i = 0; i < 2 * K; i++) xb[i] = (uint8_t)(i * 7);
    for (int i = 0; i < NB; i++) xd[i] = 0.01f;
    product(w, groups, xb, xd, y, FULL);
    double worst = 0;
    for (size_t i = 0; i < groups; i += groups / 64) { /* 64 groups across the matrices */
        double want[4];
        reference(w + i * GROUP_BYTES, xb, xb + K, xd, want);
        for (int r = 0; r < 4; r++) {
            double error = (y[4 * i + r] - want[r]) / (fabs(want[r]) + 1e-30);
            worst = fabs(error) > worst ? fabs(error) : worst;
        }
    }
    if (worst > 1e-4) {
        printf("the whole product differs from the scalar sums by %.2g (relative)\n", worst);
        return 1;
    }
    const char *names[3] = {"whole product", "high bytes only", "loads only"};
    printf("| build | kernel, GB/s | read, GB/s | kernel / read |  (repacked Q4_0, %d x %d x %d,"
           " %d threads, median of %d)\n|---|---:|---:|---:|\n", COPIES, ROWS, K,
           omp_get_max_threads(), REPEAT);
    for (int mode = FULL; mode <= LOADS_ONLY; mode++) {
        double kern[REPEAT], read[REPEAT];
        for (int rep = 0; rep < REPEAT; rep++) {
            kern[rep] = (double)bytes / product(w, groups, xb, xd, y, mode) / 1e9;
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
    return 0;
}
