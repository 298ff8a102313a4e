/*
 * Matrix products with block-quantized weights, for the CPU decode path.
 *
 * Three weight formats, all in the byte layout of GGUF blocks of 32 weights along a row:
 *   Q4_1 (20 bytes): fp16 scale d, fp16 offset m, 16 bytes of nibbles; weight j of the block is
 *                    d * q_j + m, with q_j the low nibble of byte j (j < 16) or the high nibble
 *                    of byte j - 16 (j >= 16).
 *   Q4_0 (18 bytes): fp16 scale d, 16 bytes of nibbles; weight j is d * (q_j - 8). The kernels
 *                    read it as Q4_1 with the offset m = -8 d (exact in float32), so a Q4_0 row
 *                    gives bit for bit what the same row converted to Q4_1 gives.
 *   Q8_0 (34 bytes): fp16 scale d, 32 signed bytes q_j; weight j is d * q_j.
 * A weight matrix is N rows of K / 32 blocks each (row-major, rows contiguous).
 *
 * Products: the activations are first rounded to 16-bit (quantize_q16, gemm_quant16: the
 * default) or 8-bit (quantize_q8, gemm_quant) integers per block of 32, with the block's scale
 * (its largest magnitude over 32767 or 127) and sum (scale * sum(q), for the Q4_1 offset term).
 * Each block pair then reduces with integer multiply-adds into 32-bit sums, scaled once per
 * block. The work is split over output rows (OpenMP, the runtime torch loaded,
 * so both share one thread pool). dequantize() expands rows to float32 for large products,
 * where a float GEMM is faster than these kernels.
 *
 * Built at first use by prefixserve.model.weights.quant_kernels with the host's native ISA. The AVX2
 * path is used where the compiler targets it; a portable scalar path otherwise. The eight-row
 * product and the bfloat16 expansion have AVX-512 forms, used where the compiler targets
 * AVX512F and AVX512BW (tests build the AVX2 forms there too); the bfloat16 batch product
 * (gemm_bf16_batch) exists only where it targets AVX512-BF16, the products on AMX tiles
 * (gemm_bf16_amx and amx_rows_range for a few rows, gemm_bf16_amx_large for a prompt step's)
 * only where it targets AMX-BF16 and Linux grants the tiles.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include <omp.h>

#define QK 32
/* Bytes split_k writes for a row of K activations (512-bit builds; the AVX2 form, 2 K + K / 4). */
#define SPLIT_K_BYTES(K) (4 * (K) + (K) / 4)
#define Q4_1_BYTES 20
#define Q4_0_BYTES 18
#define Q8_0_BYTES 34
#define FMT_Q4_1 0
#define FMT_Q8_0 1
#define FMT_Q4_0 4
/* Q4_0 in the stream layout (stream.c): the same blocks, moved for the one-row product. */
#define FMT_Q4_0S 6

static inline float fp16_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {
            float f = ldexpf((float)mant, -24);
            return sign ? -f : f;
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
#endif
}

/* Whether fmt is a 4-bit format of blocks of 32 (Q4_1 or Q4_0). */
static inline int is_q4(int fmt) { return fmt == FMT_Q4_1 || fmt == FMT_Q4_0; }

/* Bytes of one block of 32 weights of Q4_1, Q4_0 or Q8_0. */
static inline int64_t block_bytes(int fmt) {
    return fmt == FMT_Q4_1 ? Q4_1_BYTES
           : fmt == FMT_Q4_0 || fmt == FMT_Q4_0S ? Q4_0_BYTES : Q8_0_BYTES;
}

/* Where a 4-bit block's 16 bytes of nibbles start. */
static inline int nibbles_at(int fmt) { return fmt == FMT_Q4_1 ? 4 : 2; }

/* A 4-bit block's offset m (weight j = d * q_j + m): stored by Q4_1, -8 d for Q4_0. */
static inline float q4_offset(const uint8_t *blk, int fmt) {
    return fmt == FMT_Q4_1 ? fp16_to_float(blk + 2) : -8.0f * fp16_to_float(blk);
}

/*
 * Round M rows of K floats (K a multiple of 32) to integers of at most `top` in magnitude per
 * block of 32: scale d = max|x| / top, q = round(x / d), and s = d * sum(q) (for the Q4_1
 * offset). q is int8_t (wide = 0) or int16_t (wide = 1); d and s hold M * K / 32 floats.
 */
static void quantize_blocks(const float *x, int64_t M, int64_t K, float top, int wide, void *q,
                            float *d, float *s) {
    int64_t nb = M * K / QK;
    for (int64_t b = 0; b < nb; b++) {
        const float *src = x + b * QK;
        float amax = 0.0f;
#ifdef __AVX2__
        /* the same values as the scalar loop below: max is exact, and the conversion rounds
         * to nearest even as lrintf does in the default rounding mode */
        __m256 sign = _mm256_set1_ps(-0.0f), top8 = _mm256_setzero_ps();
        for (int j = 0; j < QK; j += 8) {
            top8 = _mm256_max_ps(top8, _mm256_andnot_ps(sign, _mm256_loadu_ps(src + j)));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(top8), _mm256_extractf128_ps(top8, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
        float scale = amax / top;
        float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        __m256 inv8 = _mm256_set1_ps(inv);
        __m256i v[4], total = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + 8 * j), inv8));
            total = _mm256_add_epi32(total, v[j]);
        }
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total),
                                   _mm256_extracti128_si256(total, 1));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
        int sum = _mm_cvtsi128_si32(_mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1)));
        if (wide) {
            /* packs saturate, but |v| <= top fits: only the lane order needs the permute */
            __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(v[0], v[1]), 0xd8);
            __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(v[2], v[3]), 0xd8);
            _mm256_storeu_si256((__m256i *)((int16_t *)q + b * QK), lo);
            _mm256_storeu_si256((__m256i *)((int16_t *)q + b * QK + 16), hi);
        } else {
            for (int j = 0; j < 4; j++) {
                __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(v[j]),
                                              _mm256_extracti128_si256(v[j], 1));
                _mm_storel_epi64((__m128i *)((int8_t *)q + b * QK + 8 * j),
                                 _mm_packs_epi16(w16, w16));
            }
        }
#else
        for (int j = 0; j < QK; j++) {
            float a = fabsf(src[j]);
            amax = a > amax ? a : amax;
        }
        float scale = amax / top;
        float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            int v = (int)lrintf(src[j] * inv);
            if (wide) {
                ((int16_t *)q)[b * QK + j] = (int16_t)v;
            } else {
                ((int8_t *)q)[b * QK + j] = (int8_t)v;
            }
            sum += v;
        }
#endif
        d[b] = scale;
        s[b] = scale * (float)sum;
    }
}

/* 8-bit activations for gemm_quant. */
void quantize_q8(const float *x, int64_t M, int64_t K, int8_t *q, float *d, float *s) {
    quantize_blocks(x, M, K, 127.0f, 0, q, d, s);
}

#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* Per 128-bit half, the sums of that half's 4 int32 lanes of a, b, c and d (lanes 0-3 and 4-7
 * of the result: a, b, c, d's low halves and high halves), by unpacks and adds: vphaddd takes
 * about four times a shuffle's time on AMD Zen 3, where the K-quant one-row kernels (which
 * reduce this way per super-block) are 5-11% faster so. The sums are exact integers, the same
 * in any order. */
static inline __m256i hadd4_epi32(__m256i a, __m256i b, __m256i c, __m256i d) {
    __m256i ab = _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
    __m256i cd = _mm256_add_epi32(_mm256_unpacklo_epi32(c, d), _mm256_unpackhi_epi32(c, d));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
}

/* The sums of the 8 int32 lanes of each of 4 vectors v0-v3 and of 4 vectors v4-v7, from their
 * hadd4_epi32 results ab and cd: lane r the sum of v_r. */
static inline __m256i hadd4_halves(__m256i ab, __m256i cd) {
    return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20),
                            _mm256_permute2x128_si256(ab, cd, 0x31));
}

/* Sums of each of 8 vectors of 8 int32, as one vector (lane r: the sum of v[r]). */
static inline __m256i hsum8_epi32(const __m256i *v) {
    return hadd4_halves(hadd4_epi32(v[0], v[1], v[2], v[3]), hadd4_epi32(v[4], v[5], v[6], v[7]));
}

/* 32 unsigned 4-bit weights of a Q4_1 block, in element order, one per byte. */
static inline __m256i unpack_nibbles(const uint8_t *qs) {
    __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

/* Eight int32 partial sums of unsigned u[j] * signed a[j]. */
static inline __m256i dot_u8_i8(__m256i u, __m256i a) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1));
}
#endif

/* One output: row w (K/32 blocks of 4-bit format fmt) times quantized activation row (xq, xd,
 * xs). */
static float dot_q4(const uint8_t *w, int fmt, const int8_t *xq, const float *xd,
                    const float *xs, int64_t nb) {
    float offset_sum = 0.0f;
    int64_t bytes = block_bytes(fmt);
    int nib = nibbles_at(fmt);
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += bytes) {
        __m256i u = unpack_nibbles(w + nib);
        __m256i a = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
        __m256 p = _mm256_cvtepi32_ps(dot_u8_i8(u, a));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(fp16_to_float(w) * xd[b]), p, acc);
        offset_sum += q4_offset(w, fmt) * xs[b];
    }
    return hsum(acc) + offset_sum;
#else
    float total = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += bytes) {
        const int8_t *a = xq + b * QK;
        int sum = 0;
        for (int j = 0; j < 16; j++) {
            sum += (w[nib + j] & 0x0f) * a[j] + (w[nib + j] >> 4) * a[j + 16];
        }
        total += fp16_to_float(w) * xd[b] * (float)sum;
        offset_sum += q4_offset(w, fmt) * xs[b];
    }
    return total + offset_sum;
#endif
}

/* One output: row w (K/32 Q8_0 blocks) times quantized activation row (xq, xd). */
static float dot_q8_0(const uint8_t *w, const int8_t *xq, const float *xd, int64_t nb) {
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += Q8_0_BYTES) {
        __m256i wq = _mm256_loadu_si256((const __m256i *)(w + 2));
        __m256i a = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
        /* |w| * (a * sign(w)) = w * a, with an unsigned left operand for maddubs. */
        __m256i p = dot_u8_i8(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(a, wq));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(fp16_to_float(w) * xd[b]),
                              _mm256_cvtepi32_ps(p), acc);
    }
    return hsum(acc);
#else
    float total = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += Q8_0_BYTES) {
        const int8_t *wq = (const int8_t *)(w + 2);
        const int8_t *a = xq + b * QK;
        int sum = 0;
        for (int j = 0; j < QK; j++) sum += wq[j] * a[j];
        total += fp16_to_float(w) * xd[b] * (float)sum;
    }
    return total;
#endif
}

#define TILE 4
#ifdef __AVX2__
/* Outputs y[m * ldy] for TILE activation rows m of one weight row w: each block of w is
 * unpacked once for all of them. */
static void tile_q4(const uint8_t *w, int fmt, const int8_t *xq, const float *xd,
                    const float *xs, int64_t K, int64_t nb, float *y, int64_t ldy) {
    __m256 acc[TILE];
    float offset_sum[TILE];
    for (int t = 0; t < TILE; t++) {
        acc[t] = _mm256_setzero_ps();
        offset_sum[t] = 0.0f;
    }
    for (int64_t b = 0; b < nb; b++, w += block_bytes(fmt)) {
        __m256i u = unpack_nibbles(w + nibbles_at(fmt));
        float d = fp16_to_float(w), m = q4_offset(w, fmt);
        for (int t = 0; t < TILE; t++) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(xq + t * K + b * QK));
            __m256 p = _mm256_cvtepi32_ps(dot_u8_i8(u, a));
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd[t * nb + b]), p, acc[t]);
            offset_sum[t] += m * xs[t * nb + b];
        }
    }
    for (int t = 0; t < TILE; t++) y[t * ldy] = hsum(acc[t]) + offset_sum[t];
}

static void tile_q8_0(const uint8_t *w, const int8_t *xq, const float *xd, int64_t K,
                      int64_t nb, float *y, int64_t ldy) {
    __m256 acc[TILE];
    for (int t = 0; t < TILE; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += Q8_0_BYTES) {
        __m256i wq = _mm256_loadu_si256((const __m256i *)(w + 2));
        __m256i wabs = _mm256_sign_epi8(wq, wq);
        float d = fp16_to_float(w);
        for (int t = 0; t < TILE; t++) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(xq + t * K + b * QK));
            __m256i p = dot_u8_i8(wabs, _mm256_sign_epi8(a, wq));
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd[t * nb + b]), _mm256_cvtepi32_ps(p),
                                     acc[t]);
        }
    }
    for (int t = 0; t < TILE; t++) y[t * ldy] = hsum(acc[t]);
}
#endif

#ifdef __AVX2__
/* Eight floats scale * q + offset of eight bytes q (unsigned if is_unsigned, else signed). */
static inline void store8(float *o, __m128i bytes8, int is_unsigned, __m256 scale,
                          __m256 offset) {
    __m256i wide = is_unsigned ? _mm256_cvtepu8_epi32(bytes8) : _mm256_cvtepi8_epi32(bytes8);
    _mm256_storeu_ps(o, _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(wide), offset));
}

static void dequant_block(const uint8_t *blk, int fmt, float *o) {
    __m256i q;
    __m256 scale = _mm256_set1_ps(fp16_to_float(blk)), offset;
    if (is_q4(fmt)) {
        q = unpack_nibbles(blk + nibbles_at(fmt));
        offset = _mm256_set1_ps(q4_offset(blk, fmt));
    } else {
        q = _mm256_loadu_si256((const __m256i *)(blk + 2));
        offset = _mm256_setzero_ps();
    }
    __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    int is_unsigned = is_q4(fmt);
    store8(o, lo, is_unsigned, scale, offset);
    store8(o + 8, _mm_srli_si128(lo, 8), is_unsigned, scale, offset);
    store8(o + 16, hi, is_unsigned, scale, offset);
    store8(o + 24, _mm_srli_si128(hi, 8), is_unsigned, scale, offset);
}
#else
static void dequant_block(const uint8_t *blk, int fmt, float *o) {
    float d = fp16_to_float(blk);
    if (is_q4(fmt)) {
        float m = q4_offset(blk, fmt);
        const uint8_t *qs = blk + nibbles_at(fmt);
        for (int j = 0; j < 16; j++) {
            o[j] = d * (float)(qs[j] & 0x0f) + m;
            o[j + 16] = d * (float)(qs[j] >> 4) + m;
        }
    } else {
        const int8_t *q = (const int8_t *)(blk + 2);
        for (int j = 0; j < QK; j++) o[j] = d * (float)q[j];
    }
}
#endif

/*
 * 16-bit activations: the same products with activations rounded to 16 bits per block of 32
 * (scale ax / 32767): 256 times finer than 8 bits, so the result matches a float32 product of
 * the same weights to about 1e-5 relative, for about 1.3x the 8-bit kernel's time.
 */
void quantize_q16(const float *x, int64_t M, int64_t K, int16_t *q, float *d, float *s) {
    quantize_blocks(x, M, K, 32767.0f, 1, q, d, s);
}

#ifdef __AVX2__
/* The 32 weights of a block as two vectors of 16 int16 (unsigned nibbles or signed bytes). */
static inline void block_int16(const uint8_t *blk, int fmt, __m256i *lo, __m256i *hi) {
    if (is_q4(fmt)) {
        __m256i u = unpack_nibbles(blk + nibbles_at(fmt));
        *lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(u));
        *hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(u, 1));
    } else {
        *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2)));
        *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18)));
    }
}

static void tile_q16(const uint8_t *w, int fmt, const int16_t *xq, const float *xd,
                     const float *xs, int64_t K, int64_t nb, int rows, float *y, int64_t ldy) {
    int64_t bytes = block_bytes(fmt);
    __m256 acc[TILE];
    float offset_sum[TILE];
    for (int t = 0; t < TILE; t++) {
        acc[t] = _mm256_setzero_ps();
        offset_sum[t] = 0.0f;
    }
    for (int64_t b = 0; b < nb; b++, w += bytes) {
        __m256i lo, hi;
        block_int16(w, fmt, &lo, &hi);
        float d = fp16_to_float(w), m = is_q4(fmt) ? q4_offset(w, fmt) : 0.0f;
        for (int t = 0; t < rows; t++) {
            const int16_t *a = xq + t * K + b * QK;
            __m256i p = _mm256_add_epi32(
                _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)a)),
                _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(a + 16))));
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd[t * nb + b]), _mm256_cvtepi32_ps(p),
                                     acc[t]);
            offset_sum[t] += m * xs[t * nb + b];
        }
    }
    for (int t = 0; t < rows; t++) y[t * ldy] = hsum(acc[t]) + offset_sum[t];
}
#else
static void tile_q16(const uint8_t *w, int fmt, const int16_t *xq, const float *xd,
                     const float *xs, int64_t K, int64_t nb, int rows, float *y, int64_t ldy) {
    int64_t bytes = block_bytes(fmt);
    int nib = nibbles_at(fmt);
    for (int t = 0; t < rows; t++) {
        float total = 0.0f;
        const uint8_t *blk = w;
        for (int64_t b = 0; b < nb; b++, blk += bytes) {
            const int16_t *a = xq + t * K + b * QK;
            int64_t sum = 0;
            for (int j = 0; j < QK; j++) {
                int q = is_q4(fmt) ? (j < 16 ? blk[nib + j] & 0x0f : blk[nib + j - 16] >> 4)
                                   : ((const int8_t *)(blk + 2))[j];
                sum += (int64_t)q * a[j];
            }
            total += fp16_to_float(blk) * xd[t * nb + b] * (float)sum;
            if (is_q4(fmt)) total += q4_offset(blk, fmt) * xs[t * nb + b];
        }
        y[t * ldy] = total;
    }
}
#endif

#ifdef __AVX2__
/* Products of one 16-bit activation row with a 4-bit block (Q4_1 or Q4_0: fmt, a constant where
 * it is inlined) of each of ROWS weight rows (row_bytes apart): four independent accumulators,
 * the activations loaded once for all of them. The one-row kernel of decode steps, where
 * tile_q16 would run a single dependent chain. */
#define ROWS 4
/* Bytes ahead of a weight block that the batch kernels prefetch into L1 (tile8_q16, the
 * bfloat16 expansion). A decode step's products are short (0.2-1 MB each, split over the
 * threads) and stream from memory; 320 bytes ahead left the fused layers of one row 1.2x
 * slower than 4 KB (benchmarks/RESULTS.md). */
#ifndef PREFETCH
#define PREFETCH 4096
#endif
/* The one-row kernels ask 8 KB ahead of each row's block (the rows of a group lie next to each
 * other: a few dozen rows ahead), into L2. Asked 4 KB ahead into L1, the 30 MB Q8_0 output
 * head of the default model streamed at 16-19 GB/s and took 1.6-1.8 ms a decode step; so, at
 * 34-40 GB/s. The Q4_1 products, bound by their arithmetic, ran about
 * as fast either way. */
#ifndef ROW_PREFETCH
#define ROW_PREFETCH 8192
#endif
#ifndef ROW_PREFETCH_HINT
#define ROW_PREFETCH_HINT _MM_HINT_T1
#endif
/* The byte-split 512-bit kernels (rows_q4_wide, rows_q8_0_wide, kq4_rows4_wide,
 * kq5_rows4_wide, kq6_row_split) ask 16 KB ahead: on the AMX Xeon a 1B-shape Q4_K_M model
 * decoded 1.07x as fast as at 8 KB (median of 30 alternating rounds). */
#ifndef WIDE_PREFETCH
#define WIDE_PREFETCH 16384
#endif
/* v with its 16-bit lane r (0-3) set to x; r is a constant once the caller's loop unrolls. */
static inline __m128i insert16(__m128i v, uint16_t x, int r) {
    switch (r) {
    case 0: return _mm_insert_epi16(v, x, 0);
    case 1: return _mm_insert_epi16(v, x, 1);
    case 2: return _mm_insert_epi16(v, x, 2);
    default: return _mm_insert_epi16(v, x, 3);
    }
}

/* Q4_0/Q4_1 rows of at least this many bytes go through the AVX2 one-row kernel one after
 * another, shorter ones four side by side, block by block (each row's sums the same either
 * way). On Zen 3, one after another was 1.08-1.18x as fast at 1,024-2,048 wide, 0.99-1.09x at
 * 4,096-8,192, and 0.86-0.89x at 576 (324-360 bytes a row: its per-row costs, a horizontal sum
 * and the offsets' scalar chain, weigh more there than the longer streams gain). */
#ifndef Q4_SEQUENTIAL_FROM
#define Q4_SEQUENTIAL_FROM 512
#endif
/* AVX2 builds without AVX-512: Q4_0/Q4_1 rows of at least this many bytes (with an even block
 * count) take row_q4_pairs, shorter ones rows_q16. On Zen 3, from L2, row_q4_pairs took
 * 0.91-0.98x rows_q16's time at 1,024 wide and 0.80-0.89x from 1,536, but 1.1-1.6x at 576-640
 * (its costs per run of 8 blocks and per row weigh more in rows of 18-20 blocks). */
#ifndef PAIRS_FROM
#define PAIRS_FROM 512
#endif

/* acc plus one Q4_0/Q4_1 block's products with the 16-bit activations a0, a1 (elements 0-15,
 * 16-31) times d * xscale, after prefetching ahead of the block. */
static inline __m256 q4_block_q16(const uint8_t *br, int nib, __m256i a0, __m256i a1,
                                  __m256 xscale, __m256 acc) {
    _mm_prefetch((const char *)(br + ROW_PREFETCH), ROW_PREFETCH_HINT);
    /* bytes widened to 16 bits: the low nibble is element j, the high one j + 16 */
    __m256i both = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(br + nib)));
    __m256i lo = _mm256_and_si256(both, _mm256_set1_epi16(0x0f));
    __m256i hi = _mm256_srli_epi16(both, 4);
    __m256 p = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(lo, a0),
                                                   _mm256_madd_epi16(hi, a1)));
    __m256 d = _mm256_mul_ps(_mm256_set1_ps(fp16_to_float(br)), xscale);
    return _mm256_fmadd_ps(d, p, acc);
}

/* The outputs of ROWS Q4_0/Q4_1 rows (row_bytes apart) for one activation row, one row after
 * another from Q4_SEQUENTIAL_FROM bytes a row. Each row's offset term sums, block by block,
 * the offset (float16; Q4_0: -8 times the scale) times the block's activation sum: multiplied,
 * then added, the rounding of tile_q16's scalar sums, so that a row's result does not depend
 * on the number of rows (the deterministic mode relies on it). */
static inline __attribute__((always_inline)) void rows_q4_q16(const uint8_t *w, int fmt,
                                                              int64_t row_bytes,
                                                              const int16_t *xq, const float *xd,
                                                              const float *xs, int64_t nb,
                                                              float *y) {
    int64_t bytes = block_bytes(fmt);
    int nib = nibbles_at(fmt), stored = fmt == FMT_Q4_1 ? 2 : 0; /* Q4_0: the scale's bits */
    if (row_bytes >= Q4_SEQUENTIAL_FROM) {
        for (int r = 0; r < ROWS; r++) {
            const uint8_t *row = w + r * row_bytes;
            __m256 sums = _mm256_setzero_ps();
            float offsets = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *br = row + b * bytes;
                sums = q4_block_q16(br, nib, _mm256_loadu_si256((const __m256i *)(xq + b * QK)),
                                    _mm256_loadu_si256((const __m256i *)(xq + b * QK + 16)),
                                    _mm256_set1_ps(xd[b]), sums);
                float m = fp16_to_float(br + stored);
                offsets += (fmt == FMT_Q4_0 ? -8.0f * m : m) * xs[b];
            }
            y[r] = hsum(sums) + offsets;
        }
        return;
    }
    __m256 acc[ROWS], offsets = _mm256_setzero_ps();
    for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i a0 = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
        __m256i a1 = _mm256_loadu_si256((const __m256i *)(xq + b * QK + 16));
        __m256 xscale = _mm256_set1_ps(xd[b]);
        const uint8_t *blk = w + b * bytes;
        /* the rows' offsets gathered in a register: through a stack array, four 2-byte stores
         * read back by one 16-byte load stalled store forwarding, a third of this loop's time */
        __m128i m = _mm_setzero_si128();
        for (int r = 0; r < ROWS; r++) {
            const uint8_t *br = blk + r * row_bytes;
            acc[r] = q4_block_q16(br, nib, a0, a1, xscale, acc[r]);
            uint16_t offset;
            memcpy(&offset, br + stored, 2);
            m = insert16(m, offset, r);
        }
        __m256 mf = _mm256_cvtph_ps(m);
        if (fmt == FMT_Q4_0) mf = _mm256_mul_ps(mf, _mm256_set1_ps(-8.0f));
        offsets = _mm256_add_ps(offsets, _mm256_mul_ps(mf, _mm256_set1_ps(xs[b])));
    }
    float off[8];
    _mm256_storeu_ps(off, offsets);
    for (int r = 0; r < ROWS; r++) y[r] = hsum(acc[r]) + off[r];
}

/* Q8_0 rows shorter than this many bytes go through the AVX2 one-row kernel one after
 * another, longer ones four side by side, block by block (each row's sums the same either
 * way). Four short streams side by side left the hardware prefetchers little to follow: on
 * Zen 3 the Q8_0 head of Gemma 3 (640 wide, 680 bytes a row) streamed at 9.3 GB/s on one
 * thread against 12.6 at 2,048 wide; one row after another it runs 1.44-1.47x faster at 576
 * and 640 wide, 1.05x at 1,536, and 0.85-0.92x at 2,048-8,192 (the 4-bit kernel's rule,
 * Q4_SEQUENTIAL_FROM, runs the other way). */
#ifndef SEQUENTIAL_ROW_BYTES
#define SEQUENTIAL_ROW_BYTES 2048
#endif

/* acc plus one Q8_0 block's products with the 16-bit activations a0, a1 times d * xscale. */
static inline __m256 q8_0_block_q16(const uint8_t *br, __m256i a0, __m256i a1, __m256 xscale,
                                    __m256 acc) {
    _mm_prefetch((const char *)(br + ROW_PREFETCH), ROW_PREFETCH_HINT);
    __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(br + 2)));
    __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(br + 18)));
    __m256 p = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(lo, a0),
                                                   _mm256_madd_epi16(hi, a1)));
    __m256 d = _mm256_mul_ps(_mm256_set1_ps(fp16_to_float(br)), xscale);
    return _mm256_fmadd_ps(d, p, acc);
}

/* As rows_q4_q16 for Q8_0 weights (no offsets). */
static void rows_q8_0_q16(const uint8_t *w, int64_t row_bytes, const int16_t *xq,
                          const float *xd, int64_t nb, float *y) {
    if (row_bytes < SEQUENTIAL_ROW_BYTES) {
        for (int r = 0; r < ROWS; r++) {
            __m256 sums = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                sums = q8_0_block_q16(w + r * row_bytes + b * Q8_0_BYTES,
                                      _mm256_loadu_si256((const __m256i *)(xq + b * QK)),
                                      _mm256_loadu_si256((const __m256i *)(xq + b * QK + 16)),
                                      _mm256_set1_ps(xd[b]), sums);
            }
            y[r] = hsum(sums);
        }
        return;
    }
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i a0 = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
        __m256i a1 = _mm256_loadu_si256((const __m256i *)(xq + b * QK + 16));
        __m256 xscale = _mm256_set1_ps(xd[b]);
        for (int r = 0; r < ROWS; r++) {
            acc[r] = q8_0_block_q16(w + r * row_bytes + b * Q8_0_BYTES, a0, a1, xscale, acc[r]);
        }
    }
    for (int r = 0; r < ROWS; r++) y[r] = hsum(acc[r]);
}
#endif

#ifdef __AVX2__
/* Outputs y[n .. n + ROWS) of weight rows n .. n + ROWS for one activation row. */
static inline void rows_q16(const uint8_t *W, int fmt, int64_t row_bytes, int64_t n,
                            const int16_t *xq, const float *xd, const float *xs, int64_t nb,
                            float *y) {
    if (fmt == FMT_Q4_1) {
        rows_q4_q16(W + n * row_bytes, FMT_Q4_1, row_bytes, xq, xd, xs, nb, y + n);
    } else if (fmt == FMT_Q4_0) {
        rows_q4_q16(W + n * row_bytes, FMT_Q4_0, row_bytes, xq, xd, xs, nb, y + n);
    } else {
        rows_q8_0_q16(W + n * row_bytes, row_bytes, xq, xd, nb, y + n);
    }
}
#endif

#ifdef __AVX2__
#if !(defined(__AVX512F__) && defined(__AVX512BW__))
/*
 * The AVX2 one-row product of Q4_0/Q4_1 rows (rows_fast: decode steps of up to PAIR_ROWS rows,
 * nb even), from the activations in pair order (pair_q16). Two blocks share one vector: their
 * 32 nibble bytes (block j in 128-bit lane 0, j + 1 in lane 1) widen to 16 bits in place
 * (vpunpcklbw, vpunpckhbw), so the activations come in the order of that widening. Each run of
 * 8 blocks reduces its four pairs' sums to one vector of exact block sums (hadd4_epi32, in run
 * order: blocks 0, 2, 4, 6, 1, 3, 5, 7), converted and multiplied by the 8 blocks' scales at
 * once: one conversion and one multiply-add per 256 weights, where rows_q16 takes one per
 * block, and the scales of a run come in two vectors of four 32-bit loads (d, and for Q4_1 m).
 * The sums run in another order than tile_q16's (rows_fast only, never the deterministic
 * mode's gemm_quant16).
 */

/* One row of 16-bit activations xq [K] in pair order: per pair of blocks j, j + 1 (a last
 * odd block left out), elements 0-7 of j and of j + 1, then 8-15 of each, 16-23, 24-31. */
static void pair_q16(const int16_t *xq, int64_t K, int16_t *xp) {
    for (int64_t e = 0; e + 2 * QK <= K; e += 2 * QK) {
        for (int k = 0; k < 4; k++) {
            memcpy(xp + e + 16 * k, xq + e + 8 * k, 16);
            memcpy(xp + e + 16 * k + 8, xq + e + QK + 8 * k, 16);
        }
    }
}

/* The int32 sums of two blocks' nibbles v (block j in lane 0, j + 1 in lane 1) with their 64
 * activations in pair order at a: lanes 0-3 block j's, 4-7 block j + 1's. */
static inline __m256i q4_pair_sums(__m256i v, const int16_t *a) {
    const __m256i low = _mm256_set1_epi8(0x0f), zero = _mm256_setzero_si256();
    __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    __m256i s = _mm256_add_epi32(
        _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, zero), _mm256_loadu_si256((const __m256i *)a)),
        _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, zero),
                          _mm256_loadu_si256((const __m256i *)(a + 16))));
    __m256i t = _mm256_add_epi32(
        _mm256_madd_epi16(_mm256_unpacklo_epi8(hi, zero),
                          _mm256_loadu_si256((const __m256i *)(a + 32))),
        _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, zero),
                          _mm256_loadu_si256((const __m256i *)(a + 48))));
    return _mm256_add_epi32(s, t);
}

/* acc and off plus a run of n blocks (n even, up to 8): u their sums, d16 their fp16 scales
 * and m16 (Q4_1) their offsets, in run order (zero past n); xd, xs the activations' scales and
 * sums from the run's first block. off sums m times xs (Q4_1) or d times xs (Q4_0, whose
 * offsets are -8 d: the caller multiplies by -8). */
static inline __attribute__((always_inline)) void q4_run_add(__m256i u, __m128i d16,
                                                             __m128i m16, int fmt,
                                                             const float *xd, const float *xs,
                                                             int n, __m256 *acc, __m256 *off) {
    const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    __m256 xd8, xs8;
    if (n == 8) {
        xd8 = _mm256_loadu_ps(xd);
        xs8 = _mm256_loadu_ps(xs);
    } else {
        __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(n),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        xd8 = _mm256_maskload_ps(xd, mask);
        xs8 = _mm256_maskload_ps(xs, mask);
    }
    __m256 d = _mm256_cvtph_ps(d16);
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(u),
                           _mm256_mul_ps(d, _mm256_permutevar8x32_ps(xd8, order)), *acc);
    *off = _mm256_fmadd_ps(fmt == FMT_Q4_1 ? _mm256_cvtph_ps(m16) : d,
                           _mm256_permutevar8x32_ps(xs8, order), *off);
}

/* The fp16 d (d16) and m (m16) of a run of n blocks (n even, up to 8; bytes apart from blk)
 * in run order, zero past n: each block's first 32 bits. */
static inline __attribute__((always_inline)) void q4_run_scales(const uint8_t *blk,
                                                                int64_t bytes, int n,
                                                                __m128i *d16, __m128i *m16) {
    uint32_t w[8] = {0};
    for (int i = 0; i < n; i++) memcpy(&w[i], blk + i * bytes, 4);
    __m128i even = _mm_setr_epi32((int)w[0], (int)w[2], (int)w[4], (int)w[6]);
    __m128i odd = _mm_setr_epi32((int)w[1], (int)w[3], (int)w[5], (int)w[7]);
    const __m128i split = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    even = _mm_shuffle_epi8(even, split);
    odd = _mm_shuffle_epi8(odd, split);
    *d16 = _mm_unpacklo_epi64(even, odd);
    *m16 = _mm_unpackhi_epi64(even, odd);
}

/* acc and off plus a run of n blocks of one row (n even, up to 8) from blk, with their
 * activations in pair order at a. */
static inline __attribute__((always_inline)) void q4_run(const uint8_t *blk, int64_t bytes,
                                                         int fmt, int n, const int16_t *a,
                                                         const float *xd, const float *xs,
                                                         __m256 *acc, __m256 *off) {
    int nib = nibbles_at(fmt);
    __m256i s[4];
    for (int p = 0; p < 4; p++) {
        const uint8_t *b = blk + 2 * p * bytes + nib;
        if (2 * p >= n) {
            s[p] = _mm256_setzero_si256();
            continue;
        }
        _mm_prefetch((const char *)(b + ROW_PREFETCH), ROW_PREFETCH_HINT);
        __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(
                                                _mm_loadu_si128((const __m128i *)b)),
                                            _mm_loadu_si128((const __m128i *)(b + bytes)), 1);
        s[p] = q4_pair_sums(v, a + 2 * p * QK);
    }
    __m128i d16, m16;
    q4_run_scales(blk, bytes, n, &d16, &m16);
    q4_run_add(hadd4_epi32(s[0], s[1], s[2], s[3]), d16, m16, fmt, xd, xs, n, acc, off);
}

/* The output of one Q4_0/Q4_1 row (nb blocks, nb even) for activations in pair order (xp). */
static inline __attribute__((always_inline)) float row_q4_pairs(const uint8_t *row, int fmt,
                                                                const int16_t *xp,
                                                                const float *xd,
                                                                const float *xs, int64_t nb) {
    int64_t bytes = block_bytes(fmt);
    __m256 acc = _mm256_setzero_ps(), off = _mm256_setzero_ps();
    int64_t b0 = 0;
    for (; b0 + 8 <= nb; b0 += 8) {
        q4_run(row + b0 * bytes, bytes, fmt, 8, xp + b0 * QK, xd + b0, xs + b0, &acc, &off);
    }
    if (b0 < nb) {
        q4_run(row + b0 * bytes, bytes, fmt, (int)(nb - b0), xp + b0 * QK, xd + b0, xs + b0,
               &acc, &off);
    }
    float o = hsum(off);
    return hsum(acc) + (fmt == FMT_Q4_1 ? o : -8.0f * o);
}

/* rows_q16 for rows_fast from activations in pair order: ROWS rows one after another. */
static inline __attribute__((always_inline)) void rows_q4_pairs(const uint8_t *w, int fmt,
                                                                int64_t row_bytes,
                                                                const int16_t *xp,
                                                                const float *xd,
                                                                const float *xs, int64_t nb,
                                                                float *y) {
    for (int r = 0; r < ROWS; r++) y[r] = row_q4_pairs(w + r * row_bytes, fmt, xp, xd, xs, nb);
}
#endif
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
/*
 * The one-row product at 512 bits (decode steps of one sequence): outputs y[0 .. ROWS) of
 * ROWS weight rows (row_bytes apart) for one 16-bit activation row, K a multiple of 64.
 *
 * The 4-bit formats multiply bytes, not 16-bit words: each 16-bit activation x is split once
 * per product into its high byte (signed) and low byte (unsigned), x = 256 high + low
 * (split_q16), so that a 4-bit weight meets 64 activations per instruction (vpdpbusd) with no
 * widening, and the integer sums are the 16-bit products' exactly (rows_q4_wide). The scales
 * of 16 blocks come in one gather (fp16 d, and for Q4_1 the offset m in the same 32 bits; a
 * whole group of Q4_0 blocks by two word permutes, q4_0_scales16), converted and multiplied by
 * the activation scales at once; each group of blocks then takes its own from them with one
 * permute. Q8_0 blocks are one vector of 16-bit words each (vpdpwssd where the CPU has
 * AVX512-VNNI).
 *
 * The sums run in another order than tile_q16's, so a row's result differs from it in the last
 * bits: only the row-dependent entry points use this (team_linear's one-row step and
 * gemm_quant16_batch), never gemm_quant16 (the deterministic mode's).
 */
#define WIDE_ROWS ROWS
#ifdef __AVX512VNNI__
#define DPWSSD(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#else
#define DPWSSD(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#endif
/* acc plus the sums of four products of unsigned bytes a and signed bytes b per 32-bit lane.
 * Without AVX512-VNNI, pairs are first summed into 16 bits with saturation, exact only where
 * no pair exceeds 32767: here one factor is a weight of at most 6 bits (63) and the other a
 * byte (at most 255 unsigned, 128 signed), so a pair stays within 32,130. */
#ifdef __AVX512VNNI__
#define DPBUSD(acc, a, b) _mm512_dpbusd_epi32(acc, a, b)
#else
#define DPBUSD(acc, a, b)                                                                      \
    _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(a, b), _mm512_set1_epi16(1)))
#endif

/* Layouts of split_q16. SPLIT_Q4 (Q4_0, Q4_1): per group of four blocks (fewer at the end of a
 * row), elements 0-15 of each block, then elements 16-31 of each. SPLIT_K4 (Q4_K): per
 * super-block, the sub-blocks of 32 in the order 0, 2, 1, 3, 4, 6, 5, 7 (a 64-byte load of
 * nibbles holds sub-blocks 0 and 2 in its low nibbles, 1 and 3 in its high ones). */
#define SPLIT_Q4 0
#define SPLIT_K4 1
#define SPLIT_PLAIN 2 /* Q6_K: in element order */

/* One row of 16-bit activations xq [K] (K a multiple of 32; of 256 for SPLIT_K4) as its low
 * bytes xb[0, K) (unsigned) and high bytes xb[K, 2 K) (signed), x = 256 high + low, each
 * run of 16 moved where the layout puts it. */
static void split_q16(const int16_t *xq, int64_t K, int layout, uint8_t *xb) {
    static const int sub_at[8] = {0, 2, 1, 3, 4, 6, 5, 7};
    const __m256i mask = _mm256_set1_epi16(0xff);
    for (int64_t e = 0; e < K; e += 16) {
        int64_t to;
        if (layout == SPLIT_PLAIN) {
            to = e;
        } else if (layout == SPLIT_K4) {
            to = e / (8 * QK) * (8 * QK) + sub_at[e % (8 * QK) / QK] * QK + e % QK;
        } else {
            int64_t b = e / QK, g = b / 4, c = K / QK - 4 * g < 4 ? K / QK - 4 * g : 4;
            to = 4 * QK * g + 16 * c * (e % QK / 16) + 16 * (b % 4);
        }
        __m256i v = _mm256_loadu_si256((const __m256i *)(xq + e));
        _mm_storeu_si128((__m128i *)(xb + to), _mm256_cvtepi16_epi8(_mm256_and_si256(v, mask)));
        _mm_storeu_si128((__m128i *)(xb + K + to), _mm256_cvtepi16_epi8(_mm256_srai_epi16(v, 8)));
    }
}

/* A row of K activations (K a multiple of 256) split for the K-quant one-row kernels: SPLIT_K4
 * in xb[0, 2 K), SPLIT_PLAIN in xb[2 K, 4 K), then the sum of each 16 activations as a float
 * (exact: at most 16 x 32767) at xb + 4 K. */
static void split_k(const int16_t *xq, int64_t K, uint8_t *xb) {
    split_q16(xq, K, SPLIT_K4, xb);
    split_q16(xq, K, SPLIT_PLAIN, xb + 2 * K);
    float *s16 = (float *)(xb + 4 * K);
    for (int64_t g = 0; g < K / 16; g++) {
        int32_t t = 0;
        for (int i = 0; i < 16; i++) t += xq[16 * g + i];
        s16[g] = (float)t;
    }
}

/* The fp16 scales of 16 Q4_0 blocks (18 bytes apart from w: words 0, 9, .. 135) by two word
 * permutes of four loads, in place of a gather: each permute picks 8 of 64 words. */
static inline __m256i q4_0_scales16(const uint8_t *w) {
    static const uint16_t at[2][32] = {{0, 9, 18, 27, 36, 45, 54, 63},
                                       {0, 0, 0, 0, 0, 0, 0, 0, 0, 9, 18, 27, 36, 45, 54, 63}};
    __m512i a = _mm512_permutex2var_epi16(_mm512_loadu_si512(w), _mm512_loadu_si512(at[0]),
                                          _mm512_loadu_si512(w + 64));
    __m512i b = _mm512_permutex2var_epi16(_mm512_loadu_si512(w + 8 * Q4_0_BYTES),
                                          _mm512_loadu_si512(at[1]),
                                          _mm512_loadu_si512(w + 8 * Q4_0_BYTES + 64));
    return _mm512_castsi512_si256(_mm512_mask_blend_epi16(0xff00, a, b));
}

/* Scales (fp16 at the start of each block, bytes apart) of the blocks b0 .. b0 + n (n <= 16) of
 * one row, as floats times the activation scales xd; offsets times xs added into *offsets when
 * xs is given: the fp16 after each scale, or with `implied` (Q4_0) -8 times the scale. */
static inline __m512 group_scales(const uint8_t *w, int64_t bytes, int64_t b0, int n,
                                  const float *xd, const float *xs, int implied,
                                  __m512 *offsets) {
    if (implied && n == 16 && xs) {
        __m512 d = _mm512_cvtph_ps(q4_0_scales16(w + b0 * bytes));
        *offsets = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(-8.0f)),
                                   _mm512_loadu_ps(xs + b0), *offsets);
        return _mm512_mul_ps(d, _mm512_loadu_ps(xd + b0));
    }
    __mmask16 mask = (__mmask16)((1u << n) - 1);
    __m512i index = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)bytes));
    __m512i raw = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, index,
                                              w + b0 * bytes, 1);
    __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(raw));
    if (xs) {
        __m512 m = implied ? _mm512_mul_ps(d, _mm512_set1_ps(-8.0f))
                           : _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(raw, 16)));
        *offsets = _mm512_fmadd_ps(m, _mm512_maskz_loadu_ps(mask, xs + b0), *offsets);
    }
    return _mm512_mul_ps(d, _mm512_maskz_loadu_ps(mask, xd + b0));
}

/* The sums of c (4, or 2 at the end of a row) consecutive blocks of one 4-bit row (nibbles at
 * blk, bytes apart) with one group of split activations (l: low bytes, h: high bytes, elements
 * 0-15 of each block in [0], 16-31 in [1]): block j's in lanes 4 j to 4 j + 3. Block j's 16
 * nibble bytes are 128-bit lane j of one vector (for four blocks, with AVX512-VBMI, from two
 * loads by one byte permute, gather; else one load per block); the sums with the high bytes
 * (vpdpbusd: nibble times signed byte), shifted left by 8 bits, plus the sums with the low
 * bytes (unsigned byte times nibble) are the 16-bit products exactly. */
static inline __attribute__((always_inline)) __m512i q4_sums(const uint8_t *blk, int64_t bytes,
                                                            int nib, int c, __m512i gather,
                                                            const __m512i *l, const __m512i *h) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512i v = _mm512_zextsi256_si512(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(blk + nib))),
        _mm_loadu_si128((const __m128i *)(blk + bytes + nib)), 1));
    if (c == 4) {
#ifdef __AVX512VBMI__
        (void)v;
        v = _mm512_permutex2var_epi8(_mm512_loadu_si512(blk), gather,
                                     _mm512_loadu_si512(blk + 4 * bytes - 64));
#else
        (void)gather;
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(blk + 2 * bytes + nib)), 2);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(blk + 3 * bytes + nib)), 3);
#endif
    }
#ifdef PROFILE_Q4_LOADS /* profiling only (kernel_rates.py): the loads, no sums; wrong results */
    (void)l, (void)h, (void)low;
    return v;
#endif
    __m512i q0 = _mm512_and_si512(v, low), q1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    __m512i s = DPBUSD(DPBUSD(_mm512_setzero_si512(), q0, h[0]), q1, h[1]);
#ifdef PROFILE_Q4_HIGH_BYTES /* profiling only: the cost of 8-bit activations; wrong results */
    return s;
#endif
    return DPBUSD(DPBUSD(_mm512_slli_epi32(s, 8), l[0], q0), l[1], q1);
}

/* As the vpdpwssd kernel it replaced, from the activations split into bytes (split_q16,
 * SPLIT_Q4: per group of four blocks, elements 0-15 of each block, then elements 16-31, as
 * low bytes at xb and high bytes at xb + K). Four blocks of a row share one vector (q4_sums),
 * so one conversion and one multiply-add by the four blocks' scales (one permute of the
 * group's, group_scales) serve 128 weights. */
static inline __attribute__((always_inline)) void rows_q4_wide(const uint8_t *w, int fmt,
                                                               int64_t row_bytes,
                                                               const uint8_t *xb,
                                                               const float *xd, const float *xs,
                                                               int64_t nb, float *y) {
    int64_t bytes = block_bytes(fmt), K = nb * QK;
    int nib = nibbles_at(fmt);
    const uint8_t *xl = xb, *xh = xb + K;
    __m512 acc[WIDE_ROWS], off[WIDE_ROWS];
    for (int r = 0; r < WIDE_ROWS; r++) acc[r] = off[r] = _mm512_setzero_ps();
    uint8_t at[64]; /* byte o = 16 j + i of four blocks: the load at 0 or at 4 bytes - 64 */
    for (int o = 0; o < 64; o++) {
        int src = (int)(o / 16 * bytes) + nib + o % 16;
        at[o] = (uint8_t)(src < 64 ? src : src - 4 * (int)bytes + 128);
    }
    const __m512i gather = _mm512_loadu_si512(at);
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        int n = nb - b0 < 16 ? (int)(nb - b0) : 16;
        __m512 scales[WIDE_ROWS];
        for (int r = 0; r < WIDE_ROWS; r++) {
            scales[r] = group_scales(w + r * row_bytes, bytes, b0, n, xd, xs, fmt == FMT_Q4_0,
                                     &off[r]);
        }
        __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        int p = 0;
        for (; p + 4 <= n; p += 4, pick = _mm512_add_epi32(pick, _mm512_set1_epi32(4))) {
            int64_t e = (b0 + p) * QK;
            __m512i l[2] = {_mm512_loadu_si512(xl + e), _mm512_loadu_si512(xl + e + 64)};
            __m512i h[2] = {_mm512_loadu_si512(xh + e), _mm512_loadu_si512(xh + e + 64)};
            for (int r = 0; r < WIDE_ROWS; r++) {
                const uint8_t *blk = w + r * row_bytes + (b0 + p) * bytes;
                _mm_prefetch((const char *)(blk + WIDE_PREFETCH), ROW_PREFETCH_HINT);
                _mm_prefetch((const char *)(blk + WIDE_PREFETCH + 64), ROW_PREFETCH_HINT);
                __m512i s = q4_sums(blk, bytes, nib, 4, gather, l, h);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s),
                                         _mm512_permutexvar_ps(pick, scales[r]), acc[r]);
            }
        }
        if (p < n) { /* two blocks left: half a group, lanes 8-15 zero */
            int64_t e = (b0 + p) * QK;
            const __mmask64 half = 0xffffffffu;
            __m512i l[2] = {_mm512_maskz_loadu_epi8(half, xl + e),
                            _mm512_maskz_loadu_epi8(half, xl + e + 32)};
            __m512i h[2] = {_mm512_maskz_loadu_epi8(half, xh + e),
                            _mm512_maskz_loadu_epi8(half, xh + e + 32)};
            for (int r = 0; r < WIDE_ROWS; r++) {
                __m512i s = q4_sums(w + r * row_bytes + (b0 + p) * bytes, bytes, nib, 2, gather,
                                    l, h);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s),
                                         _mm512_permutexvar_ps(pick, scales[r]), acc[r]);
            }
        }
    }
    for (int r = 0; r < WIDE_ROWS; r++) y[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], off[r]));
}

static void rows_q8_0_wide(const uint8_t *w, int64_t row_bytes, const int16_t *xq,
                           const float *xd, int64_t nb, float *y) {
    __m512 acc[WIDE_ROWS];
    for (int r = 0; r < WIDE_ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        int n = nb - b0 < 16 ? (int)(nb - b0) : 16;
        __m512 scales[WIDE_ROWS];
        for (int r = 0; r < WIDE_ROWS; r++) {
            scales[r] = group_scales(w + r * row_bytes, Q8_0_BYTES, b0, n, xd, NULL, 0, NULL);
        }
        __m512i pick = _mm512_setzero_si512();
        for (int p = 0; p < n; p++, pick = _mm512_add_epi32(pick, _mm512_set1_epi32(1))) {
            int64_t b = b0 + p;
            __m512i x = _mm512_loadu_si512(xq + b * QK);
            for (int r = 0; r < WIDE_ROWS; r++) {
                const uint8_t *blk = w + r * row_bytes + b * Q8_0_BYTES;
                _mm_prefetch((const char *)(blk + WIDE_PREFETCH), ROW_PREFETCH_HINT);
                __m512i q = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 2)));
                __m512i sums = DPWSSD(_mm512_setzero_si512(), q, x);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums),
                                         _mm512_permutexvar_ps(pick, scales[r]), acc[r]);
            }
        }
    }
    for (int r = 0; r < WIDE_ROWS; r++) y[r] = _mm512_reduce_add_ps(acc[r]);
}
#endif

#if defined(__AVX2__) && !(defined(__AVX512F__) && defined(__AVX512BW__))
/* A row of K activations (K a multiple of 256) for the 256-bit K-quant one-row kernels: per 32,
 * the 16-bit words in the order 0-7, 16-23, 8-15, 24-31 (as int16_t at xb), the order in which
 * vpunpcklbw and vpunpckhbw widen 32 weight bytes in place (each in its 128-bit lane, one
 * instruction, where vpmovzxbw from memory takes three); then at xb + 2 K, for kq6_row_wide, 32
 * times the sum of each 16 activations (int32), per 128 in the order 0, 2, 4, 6, 1, 3, 5, 7. */
static void split_k(const int16_t *xq, int64_t K, uint8_t *xb) {
    int16_t *o = (int16_t *)xb;
    int32_t *sums = (int32_t *)(xb + 2 * K);
    static const int at[8] = {0, 4, 1, 5, 2, 6, 3, 7}; /* where group g of 8 goes */
    for (int64_t e = 0; e < K; e += 32) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(xq + e));
        __m256i b = _mm256_loadu_si256((const __m256i *)(xq + e + 16));
        _mm256_storeu_si256((__m256i *)(o + e), _mm256_permute2x128_si256(a, b, 0x20));
        _mm256_storeu_si256((__m256i *)(o + e + 16), _mm256_permute2x128_si256(a, b, 0x31));
    }
    for (int64_t g = 0; g < K / 16; g++) {
        int32_t t = 0;
        for (int i = 0; i < 16; i++) t += xq[16 * g + i];
        sums[g / 8 * 8 + at[g % 8]] = 32 * t;
    }
}
#endif

#include "kquant.c"

/* Which split the one-row kernels of format fmt take: BYTES_Q4 (split_q4: Q4_0 and Q4_1 split
 * into bytes at 512 bits, the words in pair order at 256), BYTES_K (split_k: the K-quants; at
 * 256 bits the words reordered) or none (0: Q8_0 keeps 16-bit words). */
#define BYTES_Q4 1
#define BYTES_K 2
static inline int bytes_split(int64_t fmt) {
#ifdef __AVX2__
    if (is_q4((int)fmt) || fmt == FMT_Q4_0S) return BYTES_Q4;
#endif
    return is_kquant((int)fmt) ? BYTES_K : 0;
}

/* The most activation rows whose 16-bit products run the one-row kernels, one row after
 * another over each group of weight rows (gemm_quant16_batch, stream_q16_batch, the fused
 * step's team_linear): the group comes from memory for the first row and from the core's
 * cache for the others, where the batch kernels (batch_row_q16; kq_rows for K-quants) are
 * several times slower at these row counts (benchmarks/few_rows.py; -DFEW_ROWS=1 builds the
 * batch kernels' way). From 8 rows the batch kernels take over (a bfloat16 model's in
 * bfloat16), not for K-quants on AVX2 builds: kq_rows_few to KQ_FEW_ROWS rows (kquant.c).
 * Each row's sums are those of a product of that row alone. */
#ifndef FEW_ROWS
#define FEW_ROWS 7
#endif

/* On AVX2 builds without AVX-512, the most activation rows whose products of a Q4 weight that
 * row_q4_pairs takes (or, with the same arithmetic, the stream layout's rows_q4_0s) run it row
 * after row, as FEW_ROWS rows do elsewhere. On Zen 3 a 1B-shape Q4_0 model in the stream
 * layout decoded 8 to 15 sequences 1.15-1.3x as fast so as by tile8_q16 over unpacked rows; in
 * the file layout 0.85x at 8 and alike at 12-15 (its scales and unaligned loads cost more),
 * but both layouts must give the same bits. 576-wide Q4_1 rows, which keep rows_q16, lost
 * (0.6-0.9x): FEW_ROWS stays theirs. */
#ifndef PAIR_ROWS
#if defined(__AVX2__) && !(defined(__AVX512F__) && defined(__AVX512BW__))
#define PAIR_ROWS 15
#else
#define PAIR_ROWS FEW_ROWS
#endif
#endif
/* The most rows split for the 4-bit one-row kernels (split_q4) in one product or step. */
#define Q4_SPLIT_ROWS (PAIR_ROWS > FEW_ROWS ? PAIR_ROWS : FEW_ROWS)

/* The most activation rows of a product of format fmt (rows of row_bytes, nb blocks) that run
 * the one-row kernels row after row: PAIR_ROWS for the Q4 rows row_q4_pairs takes and the
 * stream layout, else FEW_ROWS. */
static inline int64_t one_row_limit(int fmt, int64_t row_bytes, int64_t nb) {
#if defined(__AVX2__) && !(defined(__AVX512F__) && defined(__AVX512BW__))
    if (fmt == FMT_Q4_0S || (is_q4(fmt) && nb % 2 == 0 && row_bytes >= PAIRS_FROM)) {
        return PAIR_ROWS;
    }
#else
    (void)fmt, (void)row_bytes, (void)nb;
#endif
    return FEW_ROWS;
}

/* Whether rows_fast takes groups of ROWS weight rows of an N-row product. */
static inline int rows_fast_fits(int64_t N) {
#ifdef __AVX2__
    return N % ROWS == 0;
#else
    (void)N;
    return 0;
#endif
}

#ifdef __AVX2__
/* Outputs y[n .. n + ROWS) for one activation row, the fastest way the build has (the 512-bit
 * kernels where K is a multiple of 64; AVX2's row_q4_pairs for Q4 rows from PAIRS_FROM bytes;
 * their sums run in another order; else rows_q16): for the row-dependent products. */
static inline void rows_fast(const uint8_t *W, int fmt, int64_t row_bytes, int64_t n,
                             const int16_t *xq, const uint8_t *xb, const float *xd,
                             const float *xs, int64_t nb, float *y) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (xb && nb % 2 == 0 && fmt == FMT_Q4_1) {
        rows_q4_wide(W + n * row_bytes, FMT_Q4_1, row_bytes, xb, xd, xs, nb, y + n);
        return;
    }
    if (xb && nb % 2 == 0 && fmt == FMT_Q4_0) {
        rows_q4_wide(W + n * row_bytes, FMT_Q4_0, row_bytes, xb, xd, xs, nb, y + n);
        return;
    }
    if (fmt == FMT_Q8_0) {
        rows_q8_0_wide(W + n * row_bytes, row_bytes, xq, xd, nb, y + n);
        return;
    }
#else
    if (xb && nb % 2 == 0 && row_bytes >= PAIRS_FROM && fmt == FMT_Q4_1) {
        rows_q4_pairs(W + n * row_bytes, FMT_Q4_1, row_bytes, (const int16_t *)xb, xd, xs, nb,
                      y + n);
        return;
    }
    if (xb && nb % 2 == 0 && row_bytes >= PAIRS_FROM && fmt == FMT_Q4_0) {
        rows_q4_pairs(W + n * row_bytes, FMT_Q4_0, row_bytes, (const int16_t *)xb, xd, xs, nb,
                      y + n);
        return;
    }
#endif
    rows_q16(W, fmt, row_bytes, n, xq, xd, xs, nb, y);
}
#endif

#ifdef __AVX2__
/* One row of activations xq [K] for the 4-bit one-row kernels (bytes_split's BYTES_Q4, 2 K
 * bytes at xb): split into bytes (split_q16, SPLIT_Q4) at 512 bits, in pair order (pair_q16)
 * at 256. */
static void split_q4(const int16_t *xq, int64_t K, uint8_t *xb) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    split_q16(xq, K, SPLIT_Q4, xb);
#else
    pair_q16(xq, K, (int16_t *)xb);
#endif
}
#endif

/* The activation rows xq [M, K] split (or reordered) for the one-row kernels of format fmt
 * (split_q4's, 2 K bytes a row, or split_k's, SPLIT_K_BYTES(K) a row; row after
 * row; the caller frees it), or NULL where they take 16-bit words as they are or the build has
 * no AVX2 (or no memory: the 16-bit kernels, or for K-quants at 256 bits kq_rows, then run). */
static uint8_t *split_rows(const int16_t *xq, int64_t M, int64_t K, int fmt) {
#ifdef __AVX2__
    int split = bytes_split(fmt);
    if (!split) return NULL;
    int64_t each = split == BYTES_K ? SPLIT_K_BYTES(K) : 2 * K;
    uint8_t *xb = malloc((size_t)(each * M));
    for (int64_t m = 0; xb && m < M; m++) {
        if (split == BYTES_Q4) {
            split_q4(xq + m * K, K, xb + each * m);
            continue;
        }
        split_k(xq + m * K, K, xb + each * m);
    }
    return xb;
#else
    (void)xq, (void)M, (void)K, (void)fmt;
    return NULL;
#endif
}

#include "stream.c"

#if defined(__AVX2__) && !(defined(__AVX512F__) && defined(__AVX512BW__))
#define INVARIANT_TILE8 1
static void invariant8_q16(const uint8_t *W, int fmt, int64_t N, int64_t K, const int16_t *xq,
                           const float *xd, const float *xs, int64_t M, float *y, int64_t ldy);
#endif

/* As gemm_quant, with activations from quantize_q16. Row-invariant (the deterministic mode's
 * products): each row's outputs are bitwise the same at any row count M. On AVX2 builds without
 * AVX-512, Q4_0, Q4_1 and Q8_0 rows take invariant8_q16; K-quant rows take kq_rows_few where the
 * build has its many-row kernels (KQ_MANY), else kq_rows. */
void gemm_quant16(const uint8_t *W, int fmt, int64_t N, int64_t K, const int16_t *xq,
                  const float *xd, const float *xs, int64_t M, float *y, int64_t ldy) {
#ifdef INVARIANT_TILE8
    if (fmt != FMT_Q4_0S && !is_kquant(fmt)) {
        invariant8_q16(W, fmt, N, K, xq, xd, xs, M, y, ldy);
        return;
    }
#endif
    if (fmt == FMT_Q4_0S) {
        StreamProduct a = {CHUNK_Q16, K, M, ldy, xq, xd, xs, y, NULL, NULL};
        stream_chunks(W, N, &a);
        return;
    }
    int64_t nb = K / QK;
    int64_t row_bytes = nb * block_bytes(fmt);
    int parallel = N * K * M >= (1 << 17);
    if (is_kquant(fmt)) {
#if KQ_MANY_ROWS
        uint8_t *xb = K % QK_K == 0 ? split_rows(xq, M, K, fmt) : NULL;
        if (xb) {  /* (memory lacking: kq_rows below, whose bits differ) */
#pragma omp parallel for schedule(static) if (parallel)
            for (int64_t n = 0; n < N; n += 4) {
                kq_rows_few(W, fmt, K, n, n + 4 < N ? n + 4 : N, xq, xb, xd, xs, M, y, ldy);
            }
            free(xb);
            return;
        }
#endif
        float *xf = kq_float_rows(xq, xd, M, K);
#pragma omp parallel for schedule(static) if (parallel)
        for (int64_t n = 0; n < N; n += 4) {
            kq_rows_any(W, fmt, K, n, n + 4 < N ? n + 4 : N, xq, xd, xf, M, y, ldy);
        }
        free(xf);
        return;
    }
#ifdef __AVX2__
    if (M == 1 && N % ROWS == 0) {
#pragma omp parallel for schedule(static) if (parallel)
        for (int64_t n = 0; n < N; n += ROWS) rows_q16(W, fmt, row_bytes, n, xq, xd, xs, nb, y);
        return;
    }
#endif
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *w = W + n * row_bytes;
        for (int64_t m = 0; m < M; m += TILE) {
            int rows = M - m < TILE ? (int)(M - m) : TILE;
            tile_q16(w, fmt, xq + m * K, xd + m * nb, xs + m * nb, K, nb, rows, y + m * ldy + n,
                     ldy);
        }
    }
}

#ifdef __AVX2__
#if defined(__AVX512F__) && defined(__AVX512BW__)
/* Outputs y[t * ldy] of weight row w for 8 activation rows t (K apart in xq); dT and sT hold
 * each block's 8 activation scales and sums (dT[b * 8 + t]). At 512 bits a block of 32 weights
 * is one vector and so is a row's block of activations: each row accumulates its scaled block
 * sums in a vector of its own (a multiply-add, a conversion and a multiply-add with the row's
 * broadcast scale), reduced once at the end, where the AVX2 form reduces every block's sums
 * across lanes: on AMD Zen 5 the fused step of 8 and of 16 rows took 4-5% less time with it,
 * interleaved (benchmarks/RESULTS.md). */
static void tile8_q16(const uint8_t *w, int fmt, const int16_t *xq, const float *dT,
                      const float *sT, int64_t K, int64_t nb, float *y, int64_t ldy) {
    int64_t bytes = block_bytes(fmt);
    __m512 acc[8];
    __m256 offsets = _mm256_setzero_ps();
    float scale[8];
    for (int t = 0; t < 8; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += bytes) {
        /* the output head (49,152 rows, one product) stalled on its weight loads without it:
         * 1.3x faster at 8 and at 16 rows with it; a decode step's layers the same */
        _mm_prefetch((const char *)(w + PREFETCH), _MM_HINT_T0);
        __m512i wv;
        if (is_q4(fmt)) {
            __m256i both = _mm256_cvtepu8_epi16(
                _mm_loadu_si128((const __m128i *)(w + nibbles_at(fmt))));
            wv = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_and_si256(both, _mm256_set1_epi16(0x0f))),
                _mm256_srli_epi16(both, 4), 1);
            offsets = _mm256_fmadd_ps(_mm256_set1_ps(q4_offset(w, fmt)),
                                      _mm256_loadu_ps(sT + b * 8), offsets);
        } else {
            wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + 2)));
        }
        _mm256_storeu_ps(scale, _mm256_mul_ps(_mm256_set1_ps(fp16_to_float(w)),
                                              _mm256_loadu_ps(dT + b * 8)));
        for (int t = 0; t < 8; t++) {
            __m512i p = _mm512_madd_epi16(wv, _mm512_loadu_si512(xq + t * K + b * QK));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(scale[t]), acc[t]);
        }
    }
    float off[8];
    _mm256_storeu_ps(off, offsets);
    for (int t = 0; t < 8; t++) y[t * ldy] = _mm512_reduce_add_ps(acc[t]) + off[t];
}
#else
/* Outputs y[t * ldy] of weight row w for 8 activation rows t (K apart in xq). The block sums of
 * the 8 rows are reduced to one vector per block (lane t: row t), so the block's scales apply
 * once per block for all rows: dT and sT hold each block's 8 activation scales and sums
 * (dT[b * 8 + t]). */
static void tile8_q16(const uint8_t *w, int fmt, const int16_t *xq, const float *dT,
                      const float *sT, int64_t K, int64_t nb, float *y, int64_t ldy) {
    int64_t bytes = block_bytes(fmt);
    __m256 acc = _mm256_setzero_ps(), offsets = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += bytes) {
        __m256i lo, hi, p[8];
        if (is_q4(fmt)) {
            __m256i both = _mm256_cvtepu8_epi16(
                _mm_loadu_si128((const __m128i *)(w + nibbles_at(fmt))));
            lo = _mm256_and_si256(both, _mm256_set1_epi16(0x0f));
            hi = _mm256_srli_epi16(both, 4);
        } else {
            lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 2)));
            hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 18)));
        }
        for (int t = 0; t < 8; t++) {
            const int16_t *a = xq + t * K + b * QK;
            p[t] = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)a)),
                                    _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(a + 16))));
        }
        __m256 d = _mm256_mul_ps(_mm256_set1_ps(fp16_to_float(w)), _mm256_loadu_ps(dT + b * 8));
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(hsum8_epi32(p)), acc);
        if (is_q4(fmt)) {
            offsets = _mm256_fmadd_ps(_mm256_set1_ps(q4_offset(w, fmt)),
                                      _mm256_loadu_ps(sT + b * 8), offsets);
        }
    }
    float out[8];
    _mm256_storeu_ps(out, _mm256_add_ps(acc, offsets));
    for (int t = 0; t < 8; t++) y[t * ldy] = out[t];
}
#endif
#endif

/* The block scales xd and sums xs of M activation rows (nb blocks each) regrouped eight rows
 * at a time for tile8_q16: dT[(i * nb + b) * 8 + t] is row 8 i + t's scale of block b. */
static void regroup8(const float *xd, const float *xs, int64_t M, int64_t nb, float *dT,
                     float *sT) {
    for (int64_t i = 0; i < M / 8; i++) {
        for (int64_t b = 0; b < nb; b++) {
            for (int t = 0; t < 8; t++) {
                dT[(i * nb + b) * 8 + t] = xd[(i * 8 + t) * nb + b];
                sT[(i * nb + b) * 8 + t] = xs[(i * 8 + t) * nb + b];
            }
        }
    }
}

/* Outputs y[m * ldy] of weight row w for M activation rows: eight at a time through tile8_q16
 * (dT, sT from regroup8; AVX2 only), the rest in tiles of TILE. */
static void batch_row_q16(const uint8_t *w, int fmt, int64_t K, const int16_t *xq,
                          const float *xd, const float *xs, const float *dT, const float *sT,
                          int64_t M, float *y, int64_t ldy) {
    int64_t nb = K / QK, m = 0;
#ifdef __AVX2__
    for (; m + 8 <= M; m += 8) {
        tile8_q16(w, fmt, xq + m * K, dT + m * nb, sT + m * nb, K, nb, y + m * ldy, ldy);
    }
#else
    (void)dT;
    (void)sT;
#endif
    for (; m < M; m += TILE) {
        int rows = M - m < TILE ? (int)(M - m) : TILE;
        tile_q16(w, fmt, xq + m * K, xd + m * nb, xs + m * nb, K, nb, rows, y + m * ldy, ldy);
    }
}

#ifdef INVARIANT_TILE8
/* The 32 weights of the 4-bit or 8-bit block blk as two vectors of 16 int16, as tile8_q16 takes
 * them (nibbles: the low ones first). */
static inline void block_int16_tile8(const uint8_t *blk, int fmt, __m256i *lo, __m256i *hi) {
    if (is_q4(fmt)) {
        __m256i both = _mm256_cvtepu8_epi16(
            _mm_loadu_si128((const __m128i *)(blk + nibbles_at(fmt))));
        *lo = _mm256_and_si256(both, _mm256_set1_epi16(0x0f));
        *hi = _mm256_srli_epi16(both, 4);
    } else {
        *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2)));
        *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18)));
    }
}

#ifndef ONE8_AHEAD
#define ONE8_AHEAD 2
#endif

/* The fp16 values at p, p + stride, ... (8 of them) as floats, exactly as fp16_to_float. */
static inline __m256 halves8(const uint8_t *p, int64_t stride) {
#ifdef __F16C__
    __m128i h = _mm_cvtsi32_si128(*(const uint16_t *)p);
#define HALF_AT(r) h = _mm_insert_epi16(h, *(const uint16_t *)(p + (r) * stride), r)
    HALF_AT(1); HALF_AT(2); HALF_AT(3); HALF_AT(4); HALF_AT(5); HALF_AT(6); HALF_AT(7);
#undef HALF_AT
    return _mm256_cvtph_ps(h);
#else
    return _mm256_setr_ps(fp16_to_float(p), fp16_to_float(p + stride),
                          fp16_to_float(p + 2 * stride), fp16_to_float(p + 3 * stride),
                          fp16_to_float(p + 4 * stride), fp16_to_float(p + 5 * stride),
                          fp16_to_float(p + 6 * stride), fp16_to_float(p + 7 * stride));
#endif
}

/* Outputs y[0 .. 8) of weight rows w, w + row_bytes, ... (8 of them) for one activation row
 * (xq, its block scales xd and sums xs): the rows in the lanes where tile8_q16 has activation
 * rows, so that each output is computed as tile8_q16 computes it (the block's integer sum,
 * exact; one multiply-add with d * xd into the lane; the offsets' multiply-adds apart, added
 * at the end): the same bits as that row in any tile of 8. */
static void one8_q16(const uint8_t *w, int fmt, int64_t row_bytes, const int16_t *xq,
                     const float *xd, const float *xs, int64_t nb, float *y) {
    int64_t bytes = block_bytes(fmt);
    /* The 8 rows, side by side, are 8 short streams, which starve the hardware prefetchers
     * (a 30 MB Q8_0 weight 576 wide, one row, from memory: 0.4x the one-row kernel); each
     * block asks for its share of the group of 8 rows that comes ONE8_AHEAD groups later
     * (0.9-1.0x then). */
    int64_t ahead_per_block = (8 * row_bytes + nb - 1) / nb;
    const uint8_t *ahead = w + ONE8_AHEAD * 8 * row_bytes;
    __m256 acc = _mm256_setzero_ps(), offsets = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bytes;
        for (int64_t i = 0; i < ahead_per_block; i += 64) {
            _mm_prefetch((const char *)(ahead + b * ahead_per_block + i), _MM_HINT_T0);
        }
        __m256i a0 = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
        __m256i a1 = _mm256_loadu_si256((const __m256i *)(xq + b * QK + 16));
        __m256i p[8];
        for (int r = 0; r < 8; r++) {
            __m256i lo, hi;
            block_int16_tile8(blk + r * row_bytes, fmt, &lo, &hi);
            p[r] = _mm256_add_epi32(_mm256_madd_epi16(lo, a0), _mm256_madd_epi16(hi, a1));
        }
        __m256 d = halves8(blk, row_bytes);
        __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(xd[b]));
        acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(hsum8_epi32(p)), acc);
        if (is_q4(fmt)) {  /* q4_offset of each row: the stored m, or -8 d */
            __m256 m = fmt == FMT_Q4_1 ? halves8(blk + 2, row_bytes)
                                       : _mm256_mul_ps(_mm256_set1_ps(-8.0f), d);
            offsets = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[b]), offsets);
        }
    }
    _mm256_storeu_ps(y, _mm256_add_ps(acc, offsets));
}

/* One output of weight row w for one activation row, computed as one8_q16 computes each of
 * its lanes (for the rows of an N that is not a multiple of 8). */
static float one_q16(const uint8_t *w, int fmt, const int16_t *xq, const float *xd,
                     const float *xs, int64_t nb) {
    int64_t bytes = block_bytes(fmt);
    float acc = 0.0f, offsets = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += bytes) {
        __m256i lo, hi;
        block_int16_tile8(w, fmt, &lo, &hi);
        const int16_t *a = xq + b * QK;
        __m256i p = _mm256_add_epi32(
            _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)a)),
            _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(a + 16))));
        int32_t lanes[8], sum = 0;
        _mm256_storeu_si256((__m256i *)lanes, p);
        for (int i = 0; i < 8; i++) sum += lanes[i];
        acc = fmaf(fp16_to_float(w) * xd[b], (float)sum, acc);
        if (is_q4(fmt)) offsets = fmaf(q4_offset(w, fmt), xs[b], offsets);
    }
    return acc + offsets;
}

/* Rows of activations whose products invariant8_q16 runs over every weight row before it
 * moves on: their 16-bit rows stay in the core's cache (64 rows of 4,096 values: 512 KB). */
#define INVARIANT_ROWS 64

/* gemm_quant16 of Q4_0, Q4_1 and Q8_0 rows on AVX2 builds without AVX-512, row-invariant:
 * every tile of 8 activation rows through tile8_q16 (several times faster than tile_q16 from 8
 * rows), the rows left over (fewer than 8: all of a decode step's) through one8_q16 and
 * one_q16, which give each output the bits of tile8_q16's lane. */
static void invariant8_q16(const uint8_t *W, int fmt, int64_t N, int64_t K, const int16_t *xq,
                           const float *xd, const float *xs, int64_t M, float *y, int64_t ldy) {
    int64_t nb = K / QK, row_bytes = nb * block_bytes(fmt), tiles = M / 8;
    float *dT = tiles ? malloc((size_t)(2 * tiles * nb * 8) * sizeof(float)) : NULL;
    if (!dT) tiles = 0;  /* (memory lacking: every row through one8_q16, the same bits) */
    float *sT = dT ? dT + tiles * nb * 8 : NULL;
    if (tiles) regroup8(xd, xs, tiles * 8, nb, dT, sT);
    int parallel = N * K * M >= (1 << 17);
    for (int64_t m0 = 0; m0 < M; m0 += INVARIANT_ROWS) {
        int64_t m1 = m0 + INVARIANT_ROWS < M ? m0 + INVARIANT_ROWS : M;
#pragma omp parallel for schedule(static) if (parallel)
        for (int64_t n = 0; n < N; n += 8) {
            const uint8_t *w = W + n * row_bytes;
            int64_t m = m0;
            for (; n + 8 <= N && m + 8 <= m1 && m / 8 < tiles; m += 8) {
                for (int r = 0; r < 8; r++) {
                    tile8_q16(w + r * row_bytes, fmt, xq + m * K, dT + m * nb, sT + m * nb, K,
                              nb, y + m * ldy + n + r, ldy);
                }
            }
            for (; m < m1; m++) {
                const int16_t *x = xq + m * K;
                if (n + 8 <= N) {
                    float out[8];
                    one8_q16(w, fmt, row_bytes, x, xd + m * nb, xs + m * nb, nb, out);
                    for (int r = 0; r < 8; r++) y[m * ldy + n + r] = out[r];
                    continue;
                }
                for (int64_t r = n; r < N; r++) {
                    y[m * ldy + r] = one_q16(W + r * row_bytes, fmt, x, xd + m * nb,
                                             xs + m * nb, nb);
                }
            }
        }
    }
    free(dT);
}
#endif

/*
 * As gemm_quant16, faster for M >= 8: activation rows go 8 at a time through tile8_q16. A row's
 * result then depends on whether it falls in a tile of 8 (another order of float sums), so this
 * is not row-invariant: the deterministic mode uses gemm_quant16. (K-quants go through
 * kq_rows_few up to KQ_FEW_ROWS rows: each row's bits those of the row alone.)
 */
void gemm_quant16_batch(const uint8_t *W, int fmt, int64_t N, int64_t K, const int16_t *xq,
                        const float *xd, const float *xs, int64_t M, float *y, int64_t ldy) {
    if (fmt == FMT_Q4_0S) {
        stream_q16_batch(W, N, K, xq, xd, xs, M, y, ldy);
        return;
    }
    int64_t nb = K / QK, tiles = M / 8;
    if (is_kquant(fmt) && M <= KQ_FEW_ROWS) {
        uint8_t *xb = K % QK_K == 0 ? split_rows(xq, M, K, fmt) : NULL;
#pragma omp parallel for schedule(static) if (N * K >= (1 << 17))
        for (int64_t n = 0; n < N; n += 4) {
            kq_rows_few(W, fmt, K, n, n + 4 < N ? n + 4 : N, xq, xb, xd, xs, M, y, ldy);
        }
        free(xb);
        return;
    }
    if (is_kquant(fmt)) {
        gemm_quant16(W, fmt, N, K, xq, xd, xs, M, y, ldy);
        return;
    }
#ifdef __AVX2__
    if (M <= one_row_limit(fmt, nb * block_bytes(fmt), nb) && rows_fast_fits(N)) {
        int64_t row_bytes = nb * block_bytes(fmt);
        int parallel = N * K >= (1 << 17);
        uint8_t *xb = split_rows(xq, M, K, fmt);
#pragma omp parallel for schedule(static) if (parallel)
        for (int64_t n = 0; n < N; n += ROWS) {
            for (int64_t m = 0; m < M; m++) {
                rows_fast(W, fmt, row_bytes, n, xq + m * K, xb ? xb + 2 * K * m : NULL,
                          xd + m * nb, xs + m * nb, nb, y + m * ldy);
            }
        }
        free(xb);
        return;
    }
#endif
    float *dT = tiles ? malloc((size_t)(2 * tiles * nb * 8) * sizeof(float)) : NULL;
    if (!dT) {
        gemm_quant16(W, fmt, N, K, xq, xd, xs, M, y, ldy);
        return;
    }
    float *sT = dT + tiles * nb * 8;
    regroup8(xd, xs, M, nb, dT, sT);
    int64_t row_bytes = nb * block_bytes(fmt);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        batch_row_q16(W + n * row_bytes, fmt, K, xq, xd, xs, dT, sT, M, y + n, ldy);
    }
    free(dT);
}

/* The bfloat16 bits of f, rounded to nearest even (f not NaN). */
static inline uint16_t round_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

#ifdef __AVX512BF16__
/*
 * Products in bfloat16 for a bfloat16 model (AVX512-BF16): each block of 32 weights is expanded
 * to one vector of 32 bfloat16 (in the block's element order; block_bf16), the activation
 * rows are bfloat16 (round_rows_bf16), and `vdpbf16ps` adds each pair of products into
 * float32 lanes: one instruction for 32 multiply-adds of a row with a block, no per-block
 * scaling (the scales are in the expanded weights). Rows go BF16_R at a time.
 */
#define BF16_R 8
#define BF16_W 2

/* The 32 weights of a block as bfloat16, element j in lane j: each rounded from the float32
 * d * q (+ m), as dequantize_bf16 rounds them. */
static inline __m512bh block_bf16(const uint8_t *blk, int fmt) {
    __m512 d = _mm512_set1_ps(fp16_to_float(blk)), lo, hi;
    if (is_q4(fmt)) {
        /* the 16 values d * q + m a nibble can take, rounded once, and each nibble looked up */
        __m512 m = _mm512_set1_ps(q4_offset(blk, fmt));
        __m512 nibbles = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(
            _mm512_fmadd_ps(d, nibbles, m)));
        __m256i q = _mm256_cvtepu8_epi16(
            _mm_loadu_si128((const __m128i *)(blk + nibbles_at(fmt))));
        __m512i index = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_and_si256(q, _mm256_set1_epi16(0x0f))),
            _mm256_srli_epi16(q, 4), 1);
        return (__m512bh)_mm512_permutexvar_epi16(index, table);
    } else {
        lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(
                                  _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2)))));
        hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(
                                  _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18)))));
    }
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* a + b of each half: lanes 0-7 are a's lanes i + i + 8, lanes 8-15 b's. */
static inline __m512 add_halves(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}

/* Within each half of c and d (two vectors of add_halves): lanes i + i + 4. */
static inline __m512 add_quarters(__m512 c, __m512 d) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Within each quarter of e and f (two of add_quarters): e's lanes i + i + 2 (i < 2), then f's. */
static inline __m512 add_pairs(__m512 e, __m512 f) {
    __m512d e2 = _mm512_castps_pd(e), f2 = _mm512_castps_pd(f);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(e2, f2)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(e2, f2)));
}

/*
 * The sums of 16 accumulators at once, each bit for bit what _mm512_reduce_add_ps gives it
 * (the same pairs added in the same order: lanes i + i + 8, then i + i + 4, i + i + 2, i + i + 1;
 * addition commutes exactly), in 45 instructions instead of ~130: y[t * ldy + j] is the sum of
 * acc0[t] for j = 0 and of acc1[t] for j = 1 (t < 8, the tile of BF16_R rows and 2 weight rows).
 * Accumulator k of the tree is (t = k % 4 + 4 * (k / 8), j = k / 4 % 2), so that lane 4q + s of
 * the result holds accumulator 4s + q: (t = q, j = 0), (q, 1), (q + 4, 0), (q + 4, 1).
 */
static inline void store_sums16(const __m512 *acc0, const __m512 *acc1, float *y, int64_t ldy) {
    __m512 c[4];
    for (int r = 0; r < 4; r++) {
        /* accumulators 4r .. 4r + 3: rows t = (r / 2) * 4 + (0..3) of weight row j = r % 2 */
        const __m512 *a = (r % 2 ? acc1 : acc0) + (r / 2) * 4;
        c[r] = add_quarters(add_halves(a[0], a[1]), add_halves(a[2], a[3]));
    }
    __m512 d0 = add_pairs(c[0], c[1]), d1 = add_pairs(c[2], c[3]);
    __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_ps(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
    __m128 v[4] = {_mm512_castps512_ps128(sums), _mm512_extractf32x4_ps(sums, 1),
                   _mm512_extractf32x4_ps(sums, 2), _mm512_extractf32x4_ps(sums, 3)};
    for (int q = 0; q < 4; q++) {
        _mm_storel_pi((__m64 *)(y + q * ldy), v[q]);
        _mm_storeh_pi((__m64 *)(y + (q + 4) * ldy), v[q]);
    }
}

/* y[t * ldy + j] for weight rows j < W2 (row_bytes apart from w) and bfloat16 activation rows
 * t < R (K apart from x); R and W2 are constants where it is inlined. With `pre`, the rows'
 * blocks are read from there, expanded already (expand_bf16), instead of from w. */
static inline __attribute__((always_inline)) void tile_bf16(const uint8_t *w, int64_t row_bytes,
                                                            int fmt, const uint16_t *x,
                                                            int64_t K, int R, int W2, float *y,
                                                            int64_t ldy, const __m512bh *pre) {
    int64_t nb = K / QK, bytes = block_bytes(fmt);
    __m512 acc[BF16_W][BF16_R];
    for (int j = 0; j < W2; j++) {
        for (int t = 0; t < R; t++) acc[j][t] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        __m512bh wv[BF16_W];
        for (int j = 0; j < W2; j++) {
            if (pre) {
                wv[j] = pre[j * nb + b];
                continue;
            }
            const uint8_t *blk = w + j * row_bytes + b * bytes;
            _mm_prefetch((const char *)(blk + PREFETCH), _MM_HINT_T0);
            wv[j] = block_bf16(blk, fmt);
        }
        for (int t = 0; t < R; t++) {
            __m512bh a = (__m512bh)_mm512_loadu_si512(x + t * K + b * QK);
            for (int j = 0; j < W2; j++) acc[j][t] = _mm512_dpbf16_ps(acc[j][t], a, wv[j]);
        }
    }
    if (R == BF16_R && W2 == 2) {
        store_sums16(acc[0], acc[1], y, ldy);
        return;
    }
    for (int j = 0; j < W2; j++) {
        for (int t = 0; t < R; t++) y[t * ldy + j] = _mm512_reduce_add_ps(acc[j][t]);
    }
}

/* The W2 weight rows' blocks expanded to bfloat16 into pre[j * nb + b] (prefetching ahead). */
static void expand_bf16(const uint8_t *w, int64_t row_bytes, int fmt, int64_t K, int W2,
                        __m512bh *pre) {
    int64_t nb = K / QK, bytes = block_bytes(fmt);
    for (int j = 0; j < W2; j++) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + j * row_bytes + b * bytes;
            _mm_prefetch((const char *)(blk + PREFETCH), _MM_HINT_T0);
            pre[j * nb + b] = block_bf16(blk, fmt);
        }
    }
}

/* Blocks of a weight row expanded once for all the tiles of more than BF16_R rows (a decode
 * step of 16 sequences took two tiles, each expanding every block again): up to this many
 * columns, in a buffer of 2 * 64 bytes a block on the stack. */
#define PRE_MAX_K 8192

#define TILE_BF16(R, W2) tile_bf16(w, row_bytes, fmt, x + m * K, K, R, W2, y + m * ldy, ldy, pre)
#define TILE_BF16_R(R) (W2 == 2 ? TILE_BF16(R, 2) : TILE_BF16(R, 1))
/* tile_bf16 over all M rows: BF16_R at a time, then 4, 2, 1; with more than BF16_R rows, the
 * weight rows expanded once first (expand_bf16). */
static void rows_bf16(const uint8_t *w, int64_t row_bytes, int fmt, const uint16_t *x,
                      int64_t K, int64_t M, int W2, float *y, int64_t ldy) {
    int64_t m = 0;
    __m512bh buffer[M > BF16_R && K <= PRE_MAX_K ? BF16_W * (K / QK) : 1];
    const __m512bh *pre = NULL;
    if (M > BF16_R && K <= PRE_MAX_K) {
        expand_bf16(w, row_bytes, fmt, K, W2, buffer);
        pre = buffer;
    }
    for (; m + BF16_R <= M; m += BF16_R) TILE_BF16_R(BF16_R);
    if (m + 4 <= M) {
        TILE_BF16_R(4);
        m += 4;
    }
    if (m + 2 <= M) {
        TILE_BF16_R(2);
        m += 2;
    }
    if (m < M) TILE_BF16_R(1);
}
#undef TILE_BF16_R
#undef TILE_BF16
#endif

/* Rows from which a bfloat16 model's products take gemm_bf16_batch (QuantLinear and the fused
 * decode step both ask here), or 0 where this build has no such kernel (no AVX512-BF16): from
 * 8 rows the 16-bit kernel's rounding and per-block scaling cost more than bfloat16 products. */
int bf16_batch_rows(void) {
#ifdef __AVX512BF16__
    return 8;
#else
    return 0;
#endif
}

/* x [n] float32 to bfloat16, rounded to nearest even (as torch converts; x not NaN). */
static void round_rows_bf16(const float *x, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = round_bf16(x[i]);
}

/* Outputs y[m * ldy + n] of weight rows [n0, n1) for the M bfloat16 rows x (K apart), two weight
 * rows at a time; the caller shares the ranges out. AVX512-BF16 builds only. */
void bf16_rows_range(const uint8_t *W, int fmt, int64_t K, const uint16_t *x, int64_t M,
                     int64_t n0, int64_t n1, float *y, int64_t ldy) {
#ifdef __AVX512BF16__
    int64_t row_bytes = K / QK * block_bytes(fmt);
    for (int64_t n = n0; n < n1; n += BF16_W) {
        int W2 = n1 - n < BF16_W ? (int)(n1 - n) : BF16_W;
        rows_bf16(W + n * row_bytes, row_bytes, fmt, x, K, M, W2, y + n, ldy);
    }
#else
    (void)W, (void)fmt, (void)K, (void)x, (void)M, (void)n0, (void)n1, (void)y, (void)ldy;
#endif
}

/* y [M, N] (row stride ldy) = x [M, K] W^T with bfloat16 activations x (round_rows_bf16) and
 * float32 sums; AVX512-BF16 builds only (bf16_batch_rows() > 0). */
void gemm_bf16_batch(const uint8_t *W, int fmt, int64_t N, int64_t K, const uint16_t *x,
                     int64_t M, float *y, int64_t ldy) {
    if (fmt == FMT_Q4_0S) {
        StreamProduct a = {CHUNK_BF16, K, M, ldy, x, NULL, NULL, y, NULL, NULL};
        stream_chunks(W, N, &a);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < (N + 1) / 2; i++) {
        int64_t n0 = 2 * i, n1 = n0 + 2 < N ? n0 + 2 : N;
        bf16_rows_range(W, fmt, K, x, M, n0, n1, y, ldy);
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

/*
 * Products in bfloat16 on AMX tiles (CPUs with AMX-BF16: Intel Sapphire Rapids and later).
 * `tdpbf16ps` multiplies a tile A of 16 rows x 32 bfloat16 by a tile B of 16 pairs x 16 columns
 * into a tile C of 16 x 16 float32 sums: 16,384 multiply-adds, against vdpbf16ps's 32. Here A
 * is 16 weight rows' block b expanded to bfloat16 (block_bf16, as the batch kernel does; rows
 * past the weight's end are zero), B is block b of 16 activation rows in the pair layout the
 * instruction reads (amx_pack_units: pair p of row r at B[p][r]), and C holds output (weight
 * row i, activation row r) at C[i][r]; up to 4 C tiles take 64 activation rows at once. The
 * weights are expanded once per 64 rows (the expansion, not the tiles, is what such a product
 * spends its time on), and the sums are written out transposed.
 *
 * Sums are float32 as in the batch kernel, but the tile adds each pair's two products in its
 * own order, so a row's result differs from gemm_bf16_batch's in the last bits (and depends on
 * nothing but the row: the deterministic mode could use either kernel, but one of them at
 * every row count; it keeps the batch kernel).
 */
#ifdef HAVE_AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static int amx_state; /* 0 not asked yet, 1 granted, -1 refused (amx_rows) */

/* Every tile 16 rows of 64 bytes; a thread's tile configuration is its own. */
static void amx_configure(void) {
    TileConfig c __attribute__((aligned(64)));
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* C tile g (of the chunk's first group g0) += A (tile 4) x B (tile t) for block b. */
#define AMX_DP(g, t)                                                                           \
    do {                                                                                       \
        _tile_loadd(t, xv + ((g0 + (g)) * nb + b) * 256, 64);                                  \
        _tile_dpbf16ps(g, 4, t);                                                               \
    } while (0)

/* y[m * ldy + i] for the `rows` (<= 16) weight rows at w and activation rows m of groups
 * [g0, g0 + G) (G <= 4), at most M. */
static void amx_chunk(const uint8_t *w, int64_t row_bytes, int fmt, int64_t nb, int rows,
                      const uint32_t *xv, int64_t g0, int G, int64_t M, float *y, int64_t ldy) {
    int64_t bytes = block_bytes(fmt);
    __m512i a[2][16];
    float c[4][16][16] __attribute__((aligned(64)));
    if (rows < 16) memset(a, 0, sizeof a);
    _tile_zero(0);
    if (G > 1) _tile_zero(1);
    if (G > 2) _tile_zero(2);
    if (G > 3) _tile_zero(3);
    for (int64_t b = 0; b < nb; b++) {
        __m512i *ab = a[b & 1];
        for (int i = 0; i < rows; i++) {
            const uint8_t *blk = w + i * row_bytes + b * bytes;
            _mm_prefetch((const char *)(blk + PREFETCH), _MM_HINT_T0);
            ab[i] = (__m512i)block_bf16(blk, fmt);
        }
        _tile_loadd(4, ab, 64);
        AMX_DP(0, 5);
        if (G > 1) AMX_DP(1, 6);
        if (G > 2) AMX_DP(2, 7);
        if (G > 3) AMX_DP(3, 5);
    }
    _tile_stored(0, c[0], 64);
    if (G > 1) _tile_stored(1, c[1], 64);
    if (G > 2) _tile_stored(2, c[2], 64);
    if (G > 3) _tile_stored(3, c[3], 64);
    int64_t m0 = g0 * 16, m1 = M < m0 + 16 * G ? M : m0 + 16 * G;
    for (int64_t m = m0; m < m1; m++) {
        const float(*cg)[16] = c[(m - m0) / 16];
        for (int i = 0; i < rows; i++) y[m * ldy + i] = cg[i][m % 16];
    }
}
#undef AMX_DP
#endif

/* Rows from which a bfloat16 model's products take the AMX kernel (gemm_bf16_amx,
 * amx_rows_range), or 0 where the build has no such kernel or the OS refuses the tiles. The
 * tiles expand every weight block for each product, for one row as for 16, while the 16-bit
 * kernels run FEW_ROWS rows one after another, each further row for a share of the first's
 * time. On an AMX Xeon the default model's decode steps of 2 and 3 sequences took 0.65x and
 * 0.9x the tiles' time that way, and from 4 rows the tiles won (benchmarks/few_rows.py;
 * benchmarks/RESULTS.md): from 4 rows (amx_q4_0_rows: Q4_0 weights).
 * The first call asks Linux for the tile state (arch_prctl ARCH_REQ_XCOMP_PERM); make it
 * before any thread uses the kernel (the library's loader does). */
int amx_rows(void) {
#ifdef HAVE_AMX
    if (amx_state == 0) amx_state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                            18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
    return amx_state > 0 ? 4 : 0;
#else
    return 0;
#endif
}

/* amx_rows() for Q4_0 weights, in either layout, or 0 where it is 0. In the stream layout
 * (FMT_Q4_0S, stream.c) the one-row kernel takes each further row for less and the tiles
 * unpack each group first, so the rows that kernel takes (PAIR_ROWS) keep it: decode steps of
 * 2 / 4 / 6 sequences of a 1B and a 3B Llama shape took 0.4x / 0.6-0.65x / 0.8-0.9x the tiles'
 * time on the same Xeon. The file's layout must give the same bits, so it keeps them too,
 * although there the tiles, with no unpacking, were faster from 5 rows (a 1B step of 6 rows:
 * 88 against 106 ms). */
int amx_q4_0_rows(void) { return amx_rows() > 0 ? PAIR_ROWS + 1 : 0; }

/* Units of xv (amx_pack_units) for M rows of K columns. */
int64_t amx_units(int64_t M, int64_t K) { return (M + 15) / 16 * (K / QK); }

/* 32-bit words an AMX product of M rows of K columns needs for its packed activations. */
int64_t amx_packed_words(int64_t M, int64_t K) { return amx_units(M, K) * 256; }

/* The bfloat16 rows x [M, K] into xv in the layout of the tiles' B operand, units [u0, u1) of
 * it: unit u = g * nb + b (nb = K / 32) is block b of the rows of group g = m / 16, pair p of
 * row r = m % 16 at (u * 16 + p) * 16 + r: 1 KB, 16 cache lines, that no other unit touches
 * (threads that split rows instead wrote into the same lines: 6% of a served run's time went
 * to that). Rows of a group past M are never read into an output (left as they are). */
void amx_pack_units(const uint16_t *x, int64_t M, int64_t K, int64_t u0, int64_t u1,
                    uint32_t *xv) {
    int64_t nb = K / QK;
    for (int64_t u = u0; u < u1; u++) {
        int64_t g = u / nb, b = u % nb, rows = M - g * 16 < 16 ? M - g * 16 : 16;
        uint32_t *out = xv + u * 256;
        for (int64_t r = 0; r < rows; r++) {
            const uint32_t *row = (const uint32_t *)(x + (g * 16 + r) * K) + b * 16;
            for (int p = 0; p < 16; p++) out[p * 16 + r] = row[p];
        }
    }
}

/* Outputs y[m * ldy + n] of weight rows [n0, n1) for the M activation rows packed in xv
 * (amx_pack_units); the caller shares the ranges out (whole groups of 16 rows go fastest).
 * Builds with AMX only (amx_rows() > 0). */
void amx_rows_range(const uint8_t *W, int fmt, int64_t K, const uint32_t *xv, int64_t M,
                    int64_t n0, int64_t n1, float *y, int64_t ldy) {
#ifdef HAVE_AMX
    int64_t nb = K / QK, row_bytes = nb * block_bytes(fmt);
    int64_t groups = (M + 15) / 16;
    amx_configure();
    for (int64_t n = n0; n < n1; n += 16) {
        int rows = n1 - n < 16 ? (int)(n1 - n) : 16;
        for (int64_t g0 = 0; g0 < groups; g0 += 4) {
            int G = groups - g0 < 4 ? (int)(groups - g0) : 4;
            amx_chunk(W + n * row_bytes, row_bytes, fmt, nb, rows, xv, g0, G, M, y + n, ldy);
        }
    }
    _tile_release();
#else
    (void)W, (void)fmt, (void)K, (void)xv, (void)M, (void)n0, (void)n1, (void)y, (void)ldy;
#endif
}

/* y [M, N] (row stride ldy) = x [M, K] W^T on AMX tiles, called by every thread of a parallel
 * region: the bfloat16 rows x packed into xv (amx_packed_words(M, K) words of scratch), each
 * thread its own units (an orphaned `omp for`, a barrier at its end), then this thread's
 * contiguous run of 16-row groups of W, the weight rows [*n0, *n1) it returns (no barrier
 * after: the caller's). Builds with AMX only (amx_rows() > 0). */
static void amx_team_product(const uint8_t *W, int fmt, int64_t N, int64_t K, const uint16_t *x,
                             int64_t M, uint32_t *xv, float *y, int64_t ldy, int64_t *n0,
                             int64_t *n1) {
#pragma omp for schedule(static)
    for (int64_t u = 0; u < amx_units(M, K); u++) amx_pack_units(x, M, K, u, u + 1, xv);
    int T = omp_get_num_threads(), t = omp_get_thread_num();
    int64_t groups = (N + 15) / 16;
    *n0 = groups * t / T * 16;
    *n1 = groups * (t + 1) / T * 16 < N ? groups * (t + 1) / T * 16 : N;
    if (*n0 < *n1) amx_rows_range(W, fmt, K, xv, M, *n0, *n1, y, ldy);
}

/* y [M, N] (row stride ldy) = x [M, K] W^T on AMX tiles, with bfloat16 activations x (rounded
 * as for gemm_bf16_batch) and float32 sums; xv is scratch of amx_packed_words(M, K) words.
 * Builds with AMX only (amx_rows() > 0). */
void gemm_bf16_amx(const uint8_t *W, int fmt, int64_t N, int64_t K, const uint16_t *x, int64_t M,
                   uint32_t *xv, float *y, int64_t ldy) {
    if (fmt == FMT_Q4_0S) { /* the activations packed once, then the chunks */
        StreamProduct a = {CHUNK_AMX, K, M, ldy, x, NULL, NULL, y, NULL, xv};
#pragma omp parallel for schedule(static)
        for (int64_t u = 0; u < amx_units(M, K); u++) amx_pack_units(x, M, K, u, u + 1, xv);
        stream_chunks(W, N, &a);
        return;
    }
#pragma omp parallel
    {
        int64_t n0, n1;
        amx_team_product(W, fmt, N, K, x, M, xv, y, ldy, &n0, &n1);
    }
}

/*
 * Products of many rows (a prompt step) on AMX tiles, the other way round from amx_chunk: A is
 * 16 activation rows' block b read where they lie in x (row stride K), B is 16 weight rows'
 * block b expanded once per product into the pairs layout (amx_expand_pairs: block_bf16, then
 * a 16 x 16 transpose of 32-bit pairs), so C holds (activation row, weight row) as y does and
 * is stored row by row, rounded to bfloat16. Each thread takes a run of weight groups, two at a
 * time (their expanded blocks, 2 KB per block, stay in its caches), and for them every pair of
 * activation groups: four C tiles, so each tile loaded feeds two multiplies.
 */
#ifdef HAVE_AMX
/* v[p] = lane p of every v[i] (a 16 x 16 transpose of 32-bit elements). */
static inline void transpose16_epi32(__m512i v[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* lane L (128 bits) of v[4q + j] now holds rows 4q..4q+3 of column 4L + j: output row
     * 4L + j gathers lane L of v[j], v[4 + j], v[8 + j], v[12 + j] (two rounds of lane
     * shuffles) */
    for (int i = 0; i < 8; i++) {
        int a = (i / 4) * 8 + i % 4, b = a + 4;
        t[a] = _mm512_shuffle_i32x4(v[a], v[b], 0x88);
        t[b] = _mm512_shuffle_i32x4(v[a], v[b], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        int a = i, b = i + 8;
        v[a] = _mm512_shuffle_i32x4(t[a], t[b], 0x88);
        v[b] = _mm512_shuffle_i32x4(t[a], t[b], 0xdd);
    }
}

/* The `rows` (<= 16; the rest zero) weight rows at w, every block expanded to bfloat16 in the
 * tiles' B layout: block b at out + b * 256 words, pair p of weight row i at [p * 16 + i]. */
static void amx_expand_pairs(const uint8_t *w, int64_t row_bytes, int fmt, int64_t nb, int rows,
                             uint32_t *out) {
    int64_t bytes = block_bytes(fmt);
    for (int64_t b = 0; b < nb; b++) {
        __m512i v[16];
        for (int i = 0; i < 16; i++)
            v[i] = i < rows ? (__m512i)block_bf16(w + i * row_bytes + b * bytes, fmt)
                            : _mm512_setzero_si512();
        transpose16_epi32(v);
        for (int p = 0; p < 16; p++) _mm512_store_si512(out + (b * 16 + p) * 16, v[p]);
    }
}

/* 16 rows of C (float32, 16 x 16 at c) rounded to bfloat16 into y (row stride ldy elements):
 * rows < mrows, columns < ncols. */
static void amx_store_bf16(const float *c, int mrows, int ncols, uint16_t *y, int64_t ldy) {
    __mmask16 keep = (__mmask16)((1u << ncols) - 1);
    for (int r = 0; r < mrows; r++)
        _mm256_mask_storeu_epi16(y + r * ldy, keep,
                                 (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c + r * 16)));
}

/* Tiles: C 0-3, A (activations) 4-5, B (weights) 6-7. */
static void amx_large_tile(const uint16_t *a0, const uint16_t *a1, int64_t lda,
                           const uint32_t *b0, const uint32_t *b1, int64_t nb, int two_a,
                           int two_b, float c[4][256]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t b = 0; b < nb; b++) {
        _tile_loadd(4, a0 + b * QK, lda * 2);
        _tile_loadd(6, b0 + b * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two_b) {
            _tile_loadd(7, b1 + b * 256, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (two_a) {
            _tile_loadd(5, a1 + b * QK, lda * 2);
            _tile_dpbf16ps(2, 5, 6);
            if (two_b) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c[0], 64);
    if (two_b) _tile_stored(1, c[1], 64);
    if (two_a) _tile_stored(2, c[2], 64);
    if (two_a && two_b) _tile_stored(3, c[3], 64);
}
#endif

/* y [M, N] bfloat16 (row stride ldy) = x [M, K] W^T, the bfloat16 rows x on AMX tiles with
 * float32 sums rounded once (as a bfloat16 GEMM rounds them). Builds with AMX only
 * (amx_rows() > 0); K a multiple of 32. */
void gemm_bf16_amx_large(const uint8_t *W, int fmt, int64_t N, int64_t K, const uint16_t *x,
                         int64_t M, uint16_t *y, int64_t ldy) {
    if (fmt == FMT_Q4_0S) {
        StreamProduct a = {CHUNK_AMX_LARGE, K, M, ldy, x, NULL, NULL, NULL, y, NULL};
        stream_chunks(W, N, &a);
        return;
    }
#ifdef HAVE_AMX
    int64_t nb = K / QK, row_bytes = nb * block_bytes(fmt);
    int64_t wgroups = (N + 15) / 16, agroups = (M + 15) / 16;
#pragma omp parallel
    {
        int T = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t g0 = wgroups * t / T, g1 = wgroups * (t + 1) / T;
        uint32_t *bw = aligned_alloc(64, (size_t)(2 * nb * 256) * 4);
        /* the last activation group's rows, zero-padded to 16: a tile reads 16 rows, and rows
         * past M would be read from past the end of x (their sums are never stored) */
        uint16_t *tail = NULL;
        if (M % 16) {
            tail = aligned_alloc(64, (size_t)(16 * K) * 2);
            memset(tail, 0, (size_t)(16 * K) * 2);
            memcpy(tail, x + (M - M % 16) * K, (size_t)(M % 16 * K) * 2);
        }
        float c[4][256] __attribute__((aligned(64)));
        amx_configure();
        for (int64_t g = g0; g < g1; g += 2) {
            int two_b = g + 1 < g1;
            for (int j = 0; j < 1 + two_b; j++) {
                int64_t n = (g + j) * 16;
                amx_expand_pairs(W + n * row_bytes, row_bytes, fmt, nb,
                                 N - n < 16 ? (int)(N - n) : 16, bw + j * nb * 256);
            }
            for (int64_t a = 0; a < agroups; a += 2) {
                int two_a = a + 1 < agroups;
                const uint16_t *a0 = x + a * 16 * K, *a1 = x + (a + 1) * 16 * K;
                if (tail && a == agroups - 1) a0 = tail;
                if (tail && a + 1 == agroups - 1) a1 = tail;
                amx_large_tile(a0, a1, K, bw, bw + nb * 256, nb, two_a, two_b, c);
                for (int i = 0; i < 1 + two_a; i++) {
                    int64_t m = (a + i) * 16;
                    int mrows = M - m < 16 ? (int)(M - m) : 16;
                    for (int j = 0; j < 1 + two_b; j++) {
                        int64_t n = (g + j) * 16;
                        amx_store_bf16(c[i * 2 + j], mrows, N - n < 16 ? (int)(N - n) : 16,
                                       y + m * ldy + n, ldy);
                    }
                }
            }
        }
        _tile_release();
        free(bw);
        free(tail);
    }
#else
    (void)W, (void)fmt, (void)N, (void)K, (void)x, (void)M, (void)y, (void)ldy;
#endif
}

/* Outputs of weight row w for activation rows [m0, M). */
static void row_products(const uint8_t *w, int fmt, int64_t K, const int8_t *xq,
                         const float *xd, const float *xs, int64_t M, float *y, int64_t ldy) {
    int64_t nb = K / QK, m = 0;
#ifdef __AVX2__
    for (; m + TILE <= M; m += TILE) {
        if (is_q4(fmt)) {
            tile_q4(w, fmt, xq + m * K, xd + m * nb, xs + m * nb, K, nb, y + m * ldy, ldy);
        } else {
            tile_q8_0(w, xq + m * K, xd + m * nb, K, nb, y + m * ldy, ldy);
        }
    }
#endif
    for (; m < M; m++) {
        y[m * ldy] = is_q4(fmt) ? dot_q4(w, fmt, xq + m * K, xd + m * nb, xs + m * nb, nb)
                                : dot_q8_0(w, xq + m * K, xd + m * nb, nb);
    }
}

/*
 * y[m * ldy + n] = sum_k x[m, k] * W[n, k] for m < M, n < N, with x given quantized (see
 * quantize_q8). fmt is FMT_Q4_1, FMT_Q4_0 or FMT_Q8_0. Parallel over n when the product is
 * large enough.
 */
void gemm_quant(const uint8_t *W, int fmt, int64_t N, int64_t K, const int8_t *xq,
                const float *xd, const float *xs, int64_t M, float *y, int64_t ldy) {
    if (fmt == FMT_Q4_0S) {
        StreamProduct a = {CHUNK_Q8, K, M, ldy, xq, xd, xs, y, NULL, NULL};
        stream_chunks(W, N, &a);
        return;
    }
    int64_t row_bytes = K / QK * block_bytes(fmt);
    int parallel = N * K * M >= (1 << 17);
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t n = 0; n < N; n++) {
        row_products(W + n * row_bytes, fmt, K, xq, xd, xs, M, y + n, ldy);
    }
}

static void dequant_row(const uint8_t *w, int fmt, int64_t K, float *out) {
    if (is_kquant(fmt)) {
        kq_dequant_row(w, fmt, K, out);
        return;
    }
    int64_t nb = K / QK, bytes = block_bytes(fmt);
    for (int64_t b = 0; b < nb; b++) dequant_block(w + b * bytes, fmt, out + b * QK);
}

/*
 * Expand rows of W to float32: out[i * K + k] for rows rows[i] (i < n), or rows first + i when
 * rows is NULL.
 */
void dequantize(const uint8_t *W, int fmt, int64_t K, const int64_t *rows, int64_t first,
                int64_t n, float *out) {
    if (fmt == FMT_Q4_0S) {
        stream_expand(W, K, rows, first, n, out, NULL);
        return;
    }
    int64_t row_bytes = fmt_row_bytes(fmt, K);
    int parallel = n * K >= (1 << 16);
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t i = 0; i < n; i++) {
        int64_t r = rows ? rows[i] : first + i;
        dequant_row(W + r * row_bytes, fmt, K, out + i * K);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* 16 floats v rounded to bfloat16 as round_bf16 does, stored at o. */
static inline void store16_bf16(uint16_t *o, __m512 v) {
    __m512i bits = _mm512_castps_si512(v), one = _mm512_set1_epi32(1);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    _mm256_storeu_si256((__m256i *)o, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

static void dequant_block_bf16(const uint8_t *blk, int fmt, uint16_t *o) {
#ifdef __AVX512BF16__
    /* the kernels' own expansion: one table lookup per 4-bit block, the same roundings */
    _mm512_storeu_si512((void *)o, (__m512i)block_bf16(blk, fmt));
    return;
#endif
    __m512 d = _mm512_set1_ps(fp16_to_float(blk));
    if (is_q4(fmt)) {
        __m512 m = _mm512_set1_ps(q4_offset(blk, fmt));
        __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + nibbles_at(fmt))));
        __m512i lo = _mm512_and_si512(q, _mm512_set1_epi32(0x0f)), hi = _mm512_srli_epi32(q, 4);
        store16_bf16(o, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(lo), m));
        store16_bf16(o + 16, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(hi), m));
    } else {
        for (int h = 0; h < 2; h++) {
            __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2 + 16 * h)));
            store16_bf16(o + 16 * h, _mm512_mul_ps(d, _mm512_cvtepi32_ps(q)));
        }
    }
}
#else
static void dequant_block_bf16(const uint8_t *blk, int fmt, uint16_t *o) {
    float block[QK];
    dequant_block(blk, fmt, block);
    for (int j = 0; j < QK; j++) o[j] = round_bf16(block[j]);
}
#endif

/*
 * As dequantize, into bfloat16 (each float32 value rounded to nearest even, as torch's
 * conversion does): the large products of a bfloat16 model on a CPU with native bfloat16
 * multiply these with a bfloat16 GEMM.
 */
void dequantize_bf16(const uint8_t *W, int fmt, int64_t K, const int64_t *rows, int64_t first,
                     int64_t n, uint16_t *out) {
    if (fmt == FMT_Q4_0S) {
        stream_expand(W, K, rows, first, n, NULL, out);
        return;
    }
    int64_t row_bytes = fmt_row_bytes(fmt, K);
    int64_t nb = K / QK, bytes = block_bytes(fmt);
    int parallel = n * K >= (1 << 16);
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *w = W + (rows ? rows[i] : first + i) * row_bytes;
        uint16_t *o = out + i * K;
        if (is_kquant(fmt)) {
            float super[QK_K];
            for (int64_t s = 0; s < K / QK_K; s++) {
                kq_dequant_super(w + s * row_bytes / (K / QK_K), fmt, super);
                for (int j = 0; j < QK_K; j++) o[s * QK_K + j] = round_bf16(super[j]);
            }
            continue;
        }
        for (int64_t b = 0; b < nb; b++) dequant_block_bf16(w + b * bytes, fmt, o + b * QK);
    }
}

#include "panel.c"
