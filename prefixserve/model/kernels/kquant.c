/*
 * K-quant weights multiplied in their GGUF layout: super-blocks of 256 weights along a row.
 *
 *   Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc_j and mins m_j of the 8
 *         sub-blocks of 32 (kq4_scales unpacks them), 128 bytes of nibbles. Weight i of
 *         sub-block j is d * sc_j * q - dmin * m_j, with q the low (j even) or high (j odd)
 *         nibble of nibble byte 32 * (j / 2) + i.
 *   Q5_K (176 bytes): Q4_K's d, dmin and scales, then 32 bytes qh, then its 128 bytes of
 *         nibbles; weight i of sub-block j is d * sc_j * q - dmin * m_j with q the Q4_K nibble
 *         plus 16 times bit j of qh[i].
 *   Q6_K (210 bytes): 128 bytes ql, 64 bytes qh, 16 int8 scales (one per 16 weights), fp16 d.
 *         Weight e = 128 h + 32 t + l (h < 2, t < 4, l < 32) is d * scale[e / 16] * (q - 32),
 *         q = the nibble t / 2 of ql[64 h + 32 (t % 2) + l], plus bits 2 t and 2 t + 1 of
 *         qh[32 h + l] as bits 4 and 5.
 *
 * Included by quant.c. Each 32 weights of a super-block meet one 16-bit activation block
 * (quantize_q16: scale xd, sum xs = xd * sum(q)). The products here are the one-row kernels of
 * decode steps (kq4_row_wide, kq6_row_wide: AVX-512 or AVX2), on AVX2 builds without AVX-512
 * the many-row kernels (kq_rows_few: 8 rows and more, each row with its one-row bits), and
 * kq_rows for every other case and the portable build: a few weight rows expanded to floats
 * (on the stack), then their dot
 * products with the activation rows (converted to floats once per product), each row's sums
 * in the same order whatever their number (row-invariant, as the deterministic mode needs).
 * Prefill expands whole rows (kq_dequant_row) for a float GEMM.
 */
#define FMT_Q4_K 2
#define FMT_Q6_K 3
#define FMT_Q5_K 5
#define QK_K 256
#define Q4_K_BYTES 144
#define Q6_K_BYTES 210
#define Q5_K_BYTES 176

static inline int is_kquant(int fmt) {
    return fmt == FMT_Q4_K || fmt == FMT_Q5_K || fmt == FMT_Q6_K;
}

/* Bytes of one super-block of a K-quant format. */
static inline int64_t kq_bytes(int fmt) {
    return fmt == FMT_Q4_K ? Q4_K_BYTES : fmt == FMT_Q5_K ? Q5_K_BYTES : Q6_K_BYTES;
}

/* Bytes of one row of K weights in format fmt. */
static inline int64_t fmt_row_bytes(int fmt, int64_t K) {
    switch (fmt) {
    case FMT_Q4_1: return K / QK * Q4_1_BYTES;
    case FMT_Q4_0: return K / QK * Q4_0_BYTES;
    case FMT_Q8_0: return K / QK * Q8_0_BYTES;
    case FMT_Q4_K: return K / QK_K * Q4_K_BYTES;
    case FMT_Q5_K: return K / QK_K * Q5_K_BYTES;
    default: return K / QK_K * Q6_K_BYTES;
    }
}

/* The 6-bit scales and mins of a Q4_K super-block's 8 sub-blocks, from its 12 packed bytes:
 * sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 in
 * the nibbles of bytes 8-11 (scales low, mins high) with their top two bits in the top bits of
 * bytes 0-3 (scales) and 4-7 (mins). */
static inline void kq4_scales(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 0x0f) | ((s[j] >> 6) << 4));
        mn[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

#ifdef __AVX2__
/* kq4_scales' 8 scales (low 64 bits) and 8 mins (high 64 bits) as bytes of a register, computed
 * in general registers: stored byte by byte and loaded as one vector, they stalled store
 * forwarding twice per super-block. */
static inline __m128i kq4_scales_vec(const uint8_t *s) {
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    uint32_t sc_lo = a & 0x3f3f3f3fu, mn_lo = b & 0x3f3f3f3fu;
    uint32_t sc_hi = (c & 0x0f0f0f0fu) | (((a >> 6) & 0x03030303u) << 4);
    uint32_t mn_hi = ((c >> 4) & 0x0f0f0f0fu) | (((b >> 6) & 0x03030303u) << 4);
    return _mm_set_epi32((int)mn_hi, (int)mn_lo, (int)sc_hi, (int)sc_lo);
}

/* One Q4_K super-block of a one-row product (after prefetching ahead of it): its 8 sub-blocks'
 * factors d * sc_j * xd_j into unit, and mins plus dmin * m_j * xs_j returned. */
static inline __m256 kq4_factors(const uint8_t *w, const float *xd, const float *xs, float *unit,
                                 __m256 mins) {
    _mm_prefetch((const char *)(w + ROW_PREFETCH), ROW_PREFETCH_HINT);
    _mm_prefetch((const char *)(w + ROW_PREFETCH + 64), ROW_PREFETCH_HINT);
    __m128i scales = kq4_scales_vec(w + 4);
    __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(scales));
    __m256 mnf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(scales, scales)));
    _mm256_storeu_ps(unit, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(fp16_to_float(w)), scf),
                                         _mm256_loadu_ps(xd)));
    return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(fp16_to_float(w + 2)), mnf),
                           _mm256_loadu_ps(xs), mins);
}
#endif

/* The 256 float32 weights of one super-block: d * sc * q - dmin * m (Q4_K, Q5_K),
 * d * scale * (q - 32) (Q6_K), in that order of operations (gguf-py's dequantization rounds the
 * same way); 16 or 8 at a time on AVX-512 or AVX2 (kq_rows expands the weights of every product
 * of 8 rows or more with it: on Zen 3 the scalar loop left Q6_K's 8- and 16-row products 2-3x
 * slower). */
static void kq_dequant_super(const uint8_t *blk, int fmt, float *o) {
    int five = fmt == FMT_Q5_K;
    const uint8_t *nibbles = blk + (five ? 48 : 16), *qh = blk + 16; /* qh: Q5_K only */
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (fmt != FMT_Q6_K) { /* the same products and differences, 16 at a time */
        float d = fp16_to_float(blk), dmin = fp16_to_float(blk + 2);
        uint8_t sc[8], mn[8];
        kq4_scales(blk + 4, sc, mn);
        for (int j = 0; j < 8; j++) {
            __m512 a = _mm512_set1_ps(d * (float)sc[j]), b = _mm512_set1_ps(dmin * (float)mn[j]);
            for (int h = 0; h < 2; h++) {
                __m512i q = _mm512_cvtepu8_epi32(
                    _mm_loadu_si128((const __m128i *)(nibbles + 32 * (j / 2) + 16 * h)));
                q = _mm512_and_si512(_mm512_srli_epi32(q, 4 * (j % 2)), _mm512_set1_epi32(15));
                if (five) {
                    __m512i high = _mm512_cvtepu8_epi32(
                        _mm_loadu_si128((const __m128i *)(qh + 16 * h)));
                    high = _mm512_and_si512(_mm512_srli_epi32(high, j), _mm512_set1_epi32(1));
                    q = _mm512_or_si512(q, _mm512_slli_epi32(high, 4));
                }
                _mm512_storeu_ps(o + 32 * j + 16 * h,
                                 _mm512_sub_ps(_mm512_mul_ps(a, _mm512_cvtepi32_ps(q)), b));
            }
        }
        return;
    }
    { /* Q6_K: 16 weights (one scale) at a time */
        const uint8_t *ql = blk;
        qh = blk + 128;
        const int8_t *scale = (const int8_t *)(blk + 192);
        float d = fp16_to_float(blk + 208);
        for (int h = 0; h < 2; h++) {
            for (int t = 0; t < 4; t++) {
                for (int half = 0; half < 2; half++) {
                    int e = 128 * h + 32 * t + 16 * half;
                    __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(
                        (const __m128i *)(ql + 64 * h + 32 * (t % 2) + 16 * half)));
                    __m512i hi = _mm512_cvtepu8_epi32(
                        _mm_loadu_si128((const __m128i *)(qh + 32 * h + 16 * half)));
                    lo = _mm512_and_si512(_mm512_srli_epi32(lo, 4 * (t / 2)), _mm512_set1_epi32(15));
                    hi = _mm512_and_si512(_mm512_srli_epi32(hi, 2 * t), _mm512_set1_epi32(3));
                    __m512i q = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)),
                                                 _mm512_set1_epi32(32));
                    _mm512_storeu_ps(o + e, _mm512_mul_ps(_mm512_set1_ps(d * (float)scale[e / 16]),
                                                          _mm512_cvtepi32_ps(q)));
                }
            }
        }
        return;
    }
#elif defined(__AVX2__)
    if (fmt != FMT_Q6_K) { /* the same products and differences, 8 at a time */
        float d = fp16_to_float(blk), dmin = fp16_to_float(blk + 2);
        uint8_t sc[8], mn[8];
        kq4_scales(blk + 4, sc, mn);
        const __m256i fifteen = _mm256_set1_epi32(15), one = _mm256_set1_epi32(1);
        for (int j = 0; j < 8; j++) {
            __m256 a = _mm256_set1_ps(d * (float)sc[j]), b = _mm256_set1_ps(dmin * (float)mn[j]);
            for (int k = 0; k < 4; k++) {
                __m256i q = _mm256_cvtepu8_epi32(
                    _mm_loadl_epi64((const __m128i *)(nibbles + 32 * (j / 2) + 8 * k)));
                q = _mm256_and_si256(_mm256_srli_epi32(q, 4 * (j % 2)), fifteen);
                if (five) {
                    __m256i high = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qh + 8 * k)));
                    high = _mm256_and_si256(_mm256_srli_epi32(high, j), one);
                    q = _mm256_or_si256(q, _mm256_slli_epi32(high, 4));
                }
                _mm256_storeu_ps(o + 32 * j + 8 * k,
                                 _mm256_sub_ps(_mm256_mul_ps(a, _mm256_cvtepi32_ps(q)), b));
            }
        }
        return;
    }
    { /* Q6_K: 8 weights (of one scale) at a time */
        const uint8_t *ql = blk;
        qh = blk + 128;
        const int8_t *scale = (const int8_t *)(blk + 192);
        float d = fp16_to_float(blk + 208);
        for (int h = 0; h < 2; h++) {
            for (int t = 0; t < 4; t++) {
                for (int k = 0; k < 4; k++) {
                    int e = 128 * h + 32 * t + 8 * k;
                    __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                        (const __m128i *)(ql + 64 * h + 32 * (t % 2) + 8 * k)));
                    __m256i hi = _mm256_cvtepu8_epi32(
                        _mm_loadl_epi64((const __m128i *)(qh + 32 * h + 8 * k)));
                    lo = _mm256_and_si256(_mm256_srli_epi32(lo, 4 * (t / 2)), _mm256_set1_epi32(15));
                    hi = _mm256_and_si256(_mm256_srli_epi32(hi, 2 * t), _mm256_set1_epi32(3));
                    __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)),
                                                 _mm256_set1_epi32(32));
                    _mm256_storeu_ps(o + e, _mm256_mul_ps(_mm256_set1_ps(d * (float)scale[e / 16]),
                                                          _mm256_cvtepi32_ps(q)));
                }
            }
        }
        return;
    }
#endif
    if (fmt != FMT_Q6_K) {
        float d = fp16_to_float(blk), dmin = fp16_to_float(blk + 2);
        uint8_t sc[8], mn[8];
        kq4_scales(blk + 4, sc, mn);
        for (int j = 0; j < 8; j++) {
            const uint8_t *q = nibbles + 32 * (j / 2);
            int shift = 4 * (j % 2);
            float a = d * (float)sc[j], b = dmin * (float)mn[j];
            for (int i = 0; i < 32; i++) {
                int high = five ? ((qh[i] >> j) & 1) << 4 : 0;
                o[32 * j + i] = a * (float)(((q[i] >> shift) & 15) | high) - b;
            }
        }
        return;
    }
    const uint8_t *ql = blk;
    qh = blk + 128;
    const int8_t *scale = (const int8_t *)(blk + 192);
    float d = fp16_to_float(blk + 208);
    for (int h = 0; h < 2; h++) {
        for (int t = 0; t < 4; t++) {
            for (int l = 0; l < 32; l++) {
                int e = 128 * h + 32 * t + l;
                int low = (ql[64 * h + 32 * (t % 2) + l] >> (4 * (t / 2))) & 15;
                int high = (qh[32 * h + l] >> (2 * t)) & 3;
                o[e] = d * (float)scale[e / 16] * (float)((low | (high << 4)) - 32);
            }
        }
    }
}

static void kq_dequant_row(const uint8_t *w, int fmt, int64_t K, float *out) {
    int64_t bytes = kq_bytes(fmt);
    for (int64_t s = 0; s < K / QK_K; s++) kq_dequant_super(w + s * bytes, fmt, out + s * QK_K);
}

/* The M activation rows as floats, each 16-bit value times its block's scale (NULL where the
 * memory is lacking; the caller frees it). */
static float *kq_float_rows(const int16_t *xq, const float *xd, int64_t M, int64_t K) {
    float *xf = malloc((size_t)(M * K) * sizeof(float));
    if (xf) {
        for (int64_t i = 0; i < M * K; i++) xf[i] = (float)xq[i] * xd[i / QK];
    }
    return xf;
}

/* sum over a super-block of w[j] * x[j], in the same order for every call */
static inline float dot256(const float *w, const float *x) {
#if defined(__AVX512F__)
    __m512 acc[4];
    for (int k = 0; k < 4; k++) acc[k] = _mm512_setzero_ps();
    for (int j = 0; j < QK_K; j += 64) {
        for (int k = 0; k < 4; k++) {
            acc[k] = _mm512_fmadd_ps(_mm512_loadu_ps(w + j + 16 * k), _mm512_loadu_ps(x + j + 16 * k),
                                     acc[k]);
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]),
                                              _mm512_add_ps(acc[2], acc[3])));
#elif defined(__AVX2__)
    __m256 acc[4];
    for (int k = 0; k < 4; k++) acc[k] = _mm256_setzero_ps();
    for (int j = 0; j < QK_K; j += 32) {
        for (int k = 0; k < 4; k++) {
            acc[k] = _mm256_fmadd_ps(_mm256_loadu_ps(w + j + 8 * k), _mm256_loadu_ps(x + j + 8 * k),
                                     acc[k]);
        }
    }
    return hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
#else
    float total = 0.0f;
    for (int j = 0; j < QK_K; j++) total += w[j] * x[j];
    return total;
#endif
}

#if defined(__AVX2__) && !defined(__AVX512F__)
/* dot256 of one activation slice x with four weight slices (ldw floats apart) at once, into
 * out[0..4): each dot's four chains summed in dot256's order, so the same bits; two chains of
 * the four rows at a time (8 accumulators) share each activation load, which dot256 row by row
 * loaded again for every weight row. */
static inline void dot256_x4(const float *w, int64_t ldw, const float *x, float *out) {
    __m256 half[4];
    for (int k0 = 0; k0 < 4; k0 += 2) {
        __m256 acc[4][2];
        for (int n = 0; n < 4; n++) acc[n][0] = acc[n][1] = _mm256_setzero_ps();
        for (int j = 0; j < QK_K; j += 32) {
            for (int k = 0; k < 2; k++) {
                __m256 xv = _mm256_loadu_ps(x + j + 8 * (k0 + k));
                for (int n = 0; n < 4; n++) {
                    acc[n][k] = _mm256_fmadd_ps(_mm256_loadu_ps(w + n * ldw + j + 8 * (k0 + k)), xv,
                                                acc[n][k]);
                }
            }
        }
        for (int n = 0; n < 4; n++) {
            __m256 pair = _mm256_add_ps(acc[n][0], acc[n][1]);
            half[n] = k0 == 0 ? pair : _mm256_add_ps(half[n], pair);
        }
    }
    for (int n = 0; n < 4; n++) out[n] = hsum(half[n]);
}
#endif

/* Rows of activations whose super-block slices kq_rows multiplies with the weight rows' slice
 * before moving on to the next super-block: 16 rows' slices (16 KB) and four weight rows' (4 KB)
 * stay in L1, where running every row over the whole width first read both from L2 (on Zen 3,
 * 8 and 16 sequences of a Q4_K_M model decoded at half one sequence's tokens/s). */
#define KQ_ROWS_AT_ONCE 16

/* Outputs y[m * ldy + n] of weight rows n0 <= n < n1 (a few: row W + n * row_bytes) for the M
 * float activation rows xf (kq_float_rows): the weight rows expanded once, then every
 * activation row read once for all of them (for a prompt's thousands of rows that stream from
 * memory, once per weight row was twice the old 16-bit kernel's time), KQ_ROWS_AT_ONCE rows
 * at a time super-block by super-block; each output the sum of its super-blocks' dot products
 * in order, whatever M is. */
static void kq_rows(const uint8_t *W, int fmt, int64_t K, int64_t n0, int64_t n1,
                    const float *xf, int64_t M, float *y, int64_t ldy) {
    int64_t row_bytes = fmt_row_bytes(fmt, K), supers = K / QK_K;
    if (n1 <= n0) return;
    float wf[(n1 - n0) * K];
    for (int64_t n = n0; n < n1; n++) kq_dequant_row(W + n * row_bytes, fmt, K, wf + (n - n0) * K);
    for (int64_t m0 = 0; m0 < M; m0 += KQ_ROWS_AT_ONCE) {
        int64_t m1 = m0 + KQ_ROWS_AT_ONCE < M ? m0 + KQ_ROWS_AT_ONCE : M;
        float total[KQ_ROWS_AT_ONCE][n1 - n0];
        for (int64_t m = m0; m < m1; m++) {
            for (int64_t n = n0; n < n1; n++) total[m - m0][n - n0] = 0.0f;
        }
        for (int64_t s = 0; s < supers; s++) {
            for (int64_t m = m0; m < m1; m++) {
#if defined(__AVX2__) && !defined(__AVX512F__)
                if (n1 - n0 == 4) {
                    float four[4];
                    dot256_x4(wf + s * QK_K, K, xf + m * K + s * QK_K, four);
                    for (int n = 0; n < 4; n++) total[m - m0][n] += four[n];
                    continue;
                }
#endif
                for (int64_t n = n0; n < n1; n++) {
                    total[m - m0][n - n0] += dot256(wf + (n - n0) * K + s * QK_K,
                                                    xf + m * K + s * QK_K);
                }
            }
        }
        for (int64_t m = m0; m < m1; m++) {
            for (int64_t n = n0; n < n1; n++) y[m * ldy + n] = total[m - m0][n - n0];
        }
    }
}

/* As kq_rows from the 16-bit rows (xq, xd): through xf when given (kq_float_rows), else one
 * row at a time converted on the stack (where the memory for xf was lacking). */
static void kq_rows_any(const uint8_t *W, int fmt, int64_t K, int64_t n0, int64_t n1,
                        const int16_t *xq, const float *xd, const float *xf, int64_t M,
                        float *y, int64_t ldy) {
    if (xf) {
        kq_rows(W, fmt, K, n0, n1, xf, M, y, ldy);
        return;
    }
    float row[K];
    for (int64_t m = 0; m < M; m++) {
        for (int64_t i = 0; i < K; i++) row[i] = (float)xq[m * K + i] * xd[m * (K / QK) + i / QK];
        kq_rows(W, fmt, K, n0, n1, row, 1, y + m * ldy, ldy);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* One output of a Q4_K row for one activation row: per sub-block a multiply-add of the nibbles
 * (16-bit) with the activations, converted and scaled by d * sc_j * xd; the mins' term
 * dmin * m_j * xs added per super-block, 8 sub-blocks at once. */
/* v shifted left by n bits (right by -n where n < 0); n a constant where it is inlined. */
static inline __m512i shift512(__m512i v, int n) {
    return n > 0 ? _mm512_slli_epi16(v, n) : n < 0 ? _mm512_srli_epi16(v, -n) : v;
}

/* As kq4_row_wide for Q4_K (five = 0) or Q5_K (five = 1: each sub-block j's nibbles take bit
 * j of qh as bit 4); five a constant where it is inlined. */
static inline __attribute__((always_inline)) float kq45_row_wide(const uint8_t *w, int five,
                                                                 const int16_t *xq,
                                                                 const float *xd,
                                                                 const float *xs,
                                                                 int64_t supers) {
    /* one accumulator per sub-block: a single one made each super-block a chain of 8
     * dependent multiply-adds, and the kernel half as fast */
    __m512 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm512_setzero_ps();
    __m256 mins = _mm256_setzero_ps();
    const __m512i low = _mm512_set1_epi16(0x0f), bit4 = _mm512_set1_epi16(0x10);
    int64_t bytes = five ? Q5_K_BYTES : Q4_K_BYTES, at = five ? 48 : 16;
    for (int64_t s = 0; s < supers; s++, w += bytes) {
        float unit[8];
        mins = kq4_factors(w, xd + s * 8, xs + s * 8, unit, mins);
        if (five) _mm_prefetch((const char *)(w + ROW_PREFETCH + 128), ROW_PREFETCH_HINT);
        const int16_t *a = xq + s * QK_K;
        __m512i qh = five ? _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w + 16)))
                          : _mm512_setzero_si512();
        for (int i = 0; i < 4; i++) {
            __m512i both = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w + at + 32 * i)));
            __m512i q0 = _mm512_and_si512(both, low), q1 = _mm512_srli_epi16(both, 4);
            if (five) { /* bits 2 i and 2 i + 1 of qh moved to bit 4 */
                q0 = _mm512_or_si512(q0, _mm512_and_si512(shift512(qh, 4 - 2 * i), bit4));
                q1 = _mm512_or_si512(q1, _mm512_and_si512(shift512(qh, 3 - 2 * i), bit4));
            }
            __m512i p0 = DPWSSD(_mm512_setzero_si512(), q0, _mm512_loadu_si512(a + 64 * i));
            __m512i p1 = DPWSSD(_mm512_setzero_si512(), q1, _mm512_loadu_si512(a + 64 * i + 32));
            acc[2 * i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_set1_ps(unit[2 * i]),
                                         acc[2 * i]);
            acc[2 * i + 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1),
                                             _mm512_set1_ps(unit[2 * i + 1]), acc[2 * i + 1]);
        }
    }
    for (int j = 1; j < 8; j++) acc[0] = _mm512_add_ps(acc[0], acc[j]);
    return _mm512_reduce_add_ps(acc[0]) - hsum(mins);
}


/* The factors of one super-block of four Q4_K rows (row_bytes apart; after prefetching ahead
 * of them: three lines a row, a Q4_K or Q5_K super-block's 144 or 176 bytes): t[r] lanes 0-7
 * d * sc_j, lanes 8-15 dmin * m_j of row r. The four 16-byte headers
 * share one vector, a row per 128-bit lane, so the 6-bit scales unpack for all four at once:
 * per lane the dwords d|dmin, a (bytes 0-3 of the scales), b (4-7), c (8-11) become sc_j for
 * j < 4 (a & 63), j >= 4 ((c & 15) | (a >> 6) << 4), and the same for m_j from b and c >> 4. */
static inline void kq4_factors4(const uint8_t *w, int64_t row_bytes, __m512 *t) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)w));
    for (int r = 1; r < 4; r++) {
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(w + r * row_bytes)), r);
    }
    for (int r = 0; r < 4; r++) {
        _mm_prefetch((const char *)(w + r * row_bytes + WIDE_PREFETCH), ROW_PREFETCH_HINT);
        _mm_prefetch((const char *)(w + r * row_bytes + WIDE_PREFETCH + 64), ROW_PREFETCH_HINT);
        _mm_prefetch((const char *)(w + r * row_bytes + WIDE_PREFETCH + 128), ROW_PREFETCH_HINT);
    }
    __m512i ab = _mm512_shuffle_epi32(v, (_MM_PERM_ENUM)0xa5); /* dwords a, a, b, b */
    __m512i cc = _mm512_shuffle_epi32(v, (_MM_PERM_ENUM)0xff); /* c, c, c, c */
    __m512i low6 = _mm512_and_si512(ab, _mm512_set1_epi32(0x3f3f3f3f));
    __m512i top2 = _mm512_and_si512(_mm512_srli_epi32(ab, 2), _mm512_set1_epi32(0x30303030));
    __m512i nib = _mm512_and_si512(_mm512_srlv_epi32(cc, _mm512_setr_epi32(0, 0, 4, 4, 0, 0, 4, 4,
                                                                             0, 0, 4, 4, 0, 0, 4, 4)),
                                   _mm512_set1_epi32(0x0f0f0f0f));
    /* per lane: sc_0-3, sc_4-7, m_0-3, m_4-7 */
    __m512i scales = _mm512_mask_blend_epi32((__mmask16)0xaaaa, low6, _mm512_or_si512(nib, top2));
    const __m256i spread = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                            2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    const __m128i lanes[4] = {_mm512_castsi512_si128(scales), _mm512_extracti32x4_epi32(scales, 1),
                              _mm512_extracti32x4_epi32(scales, 2),
                              _mm512_extracti32x4_epi32(scales, 3)};
    for (int r = 0; r < 4; r++) {
        uint32_t dm;
        memcpy(&dm, w + r * row_bytes, 4);
        __m128i lane = lanes[r];
        __m512 dmf = _mm512_cvtph_ps(_mm256_shuffle_epi8(_mm256_set1_epi32((int)dm), spread));
        t[r] = _mm512_mul_ps(dmf, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lane)));
    }
}

/* Outputs y[0 .. 4) of four Q4_K (five = 0) or Q5_K rows (row_bytes apart) for one activation
 * row, from the activations split into bytes (split_q16, SPLIT_K4: low bytes at xb, high bytes
 * at xb + K):
 * each 64-byte load of a row's nibbles holds sub-blocks 0 and 2 (low nibbles) and 1 and 3
 * (high nibbles) of a half super-block; their sums with the high bytes (vpdpbusd), shifted
 * left by 8 bits, take the sums with the low bytes, the 16-bit products exactly. Lanes 0-7
 * then hold one sub-block's sums and lanes 8-15 the other's, so one conversion and one
 * multiply-add by their two factors (one permute) serve 64 weights. The factors come from
 * kq4_factors4 (the four headers unpacked together) times the activations' xd (lanes 0-7)
 * and xs (lanes 8-15: the mins' terms, summed in the upper half of mins), in kq4_factors'
 * order of operations. Each activation vector is loaded once for the four rows. */
static inline __attribute__((always_inline)) void kq45_rows4_split(
    const uint8_t *w, int five, int64_t row_bytes, const uint8_t *xb, const float *xd,
    const float *xs, int64_t supers, float *y) {
    __m512 acc[4][2], mins[4];
    for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = mins[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f), bit4 = _mm512_set1_epi8(0x10);
    __m512i pick[4]; /* the factors of sub-blocks (0, 2), (1, 3), (4, 6), (5, 7) */
    __m512i bit[4];  /* Q5_K: the bit of qh of those sub-blocks, per half */
    for (int c = 0; c < 4; c++) {
        int j = c / 2 * 4 + c % 2;
        __m512i first = _mm512_set1_epi32(j);
        pick[c] = _mm512_mask_add_epi32(first, (__mmask16)0xff00, first, _mm512_set1_epi32(2));
        bit[c] = _mm512_mask_blend_epi8((__mmask64)0xffffffff00000000ull,
                                        _mm512_set1_epi8((char)(1 << j)),
                                        _mm512_set1_epi8((char)(1 << (j + 2))));
    }
    int64_t bytes = five ? Q5_K_BYTES : Q4_K_BYTES, at = five ? 48 : 16;
    const uint8_t *xl = xb, *xh = xb + supers * QK_K;
    for (int64_t s = 0; s < supers; s++) {
        const uint8_t *blk = w + s * bytes;
        __m512 both_scales = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(xd + s * 8)),
                                                _mm256_loadu_ps(xs + s * 8), 1);
        __m512 t[4];
        kq4_factors4(blk, row_bytes, t);
        __m512i l[4], h[4];
        for (int c = 0; c < 4; c++) {
            l[c] = _mm512_loadu_si512(xl + s * QK_K + 64 * c);
            h[c] = _mm512_loadu_si512(xh + s * QK_K + 64 * c);
        }
        for (int r = 0; r < 4; r++) {
            const uint8_t *row = blk + r * row_bytes;
            __m512i qh = _mm512_setzero_si512();
            if (five) qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(row + 16)));
            __m512 units = _mm512_mul_ps(t[r], both_scales);
            mins[r] = _mm512_fmadd_ps(t[r], both_scales, mins[r]);
            for (int k = 0; k < 2; k++) {
                __m512i v = _mm512_loadu_si512(row + at + 64 * k);
                __m512i q[2] = {_mm512_and_si512(v, low),
                                _mm512_and_si512(_mm512_srli_epi16(v, 4), low)};
                for (int j = 0; j < 2; j++) {
                    int c = 2 * k + j;
                    if (five) {
                        q[j] = _mm512_mask_add_epi8(q[j], _mm512_test_epi8_mask(qh, bit[c]), q[j],
                                                    bit4);
                    }
                    __m512i p = DPBUSD(_mm512_setzero_si512(), q[j], h[c]);
                    p = DPBUSD(_mm512_slli_epi32(p, 8), l[c], q[j]);
                    acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p),
                                                _mm512_permutexvar_ps(pick[c], units), acc[r][j]);
                }
            }
        }
    }
    for (int r = 0; r < 4; r++) {
        y[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]))
               - hsum(_mm512_extractf32x8_ps(mins[r], 1));
    }
}

static void kq4_rows4_wide(const uint8_t *w, int64_t row_bytes, const uint8_t *xb,
                           const float *xd, const float *xs, int64_t supers, float *y) {
    kq45_rows4_split(w, 0, row_bytes, xb, xd, xs, supers, y);
}

/* As kq4_rows4_wide for four Q5_K rows: each sub-block's fifth bits (qh, in both halves of a
 * vector) tested per byte and added as 16. */
static void kq5_rows4_wide(const uint8_t *w, int64_t row_bytes, const uint8_t *xb,
                           const float *xd, const float *xs, int64_t supers, float *y) {
    kq45_rows4_split(w, 1, row_bytes, xb, xd, xs, supers, y);
}

/* The 16 factors d * scale_g * xd of one Q6_K super-block (lane g: the scale of weights 16 g
 * to 16 g + 15), after prefetching `ahead` bytes past it. */
static inline __m512 kq6_units(const uint8_t *w, const float *xd, int64_t ahead) {
    for (int k = 0; k < 4; k++) _mm_prefetch((const char *)(w + ahead + 64 * k), ROW_PREFETCH_HINT);
    const __m512i spread = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    __m512 scale = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 192))));
    __m512 xdv = _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(_mm256_loadu_ps(xd)));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(fp16_to_float(w + 208)), scale), xdv);
}

/* One output of a Q6_K row for one activation row: per 32 weights, q - 32 (16-bit) times the
 * activations, whose lanes 0-7 hold the first 16 weights' sums and lanes 8-15 the next 16's,
 * so the 16 scales of a super-block (d * scale * xd, computed at once) apply by one permute.
 * Each half's low bytes are widened once for the two t that share them; the high bits move
 * into place with one shift and one mask. */
static float kq6_row_wide(const uint8_t *w, const int16_t *xq, const float *xd, int64_t supers) {
    __m512 acc[4]; /* one per t: independent chains, as in kq4_row_wide */
    for (int t = 0; t < 4; t++) acc[t] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi16(0x0f), top = _mm512_set1_epi16(0x30);
    const __m512i bias = _mm512_set1_epi16(32);
    __m512i pick[8]; /* scale pair g = 4 h + t: lanes 0-7 take unit 2 g, lanes 8-15 2 g + 1 */
    for (int g = 0; g < 8; g++) {
        pick[g] = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                   _mm512_set1_epi32(2 * g));
    }
    for (int64_t s = 0; s < supers; s++, w += Q6_K_BYTES) {
        __m512 units = kq6_units(w, xd + s * 8, ROW_PREFETCH);
        const int16_t *a = xq + s * QK_K;
        for (int h = 0; h < 2; h++) {
            __m512i qh = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h)));
            __m512i ql[2] = {
                _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w + 64 * h))),
                _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w + 64 * h + 32)))};
            for (int t = 0; t < 4; t++) {
                __m512i lo = t < 2 ? _mm512_and_si512(ql[t % 2], low) : _mm512_srli_epi16(ql[t % 2], 4);
                /* bits 2 t and 2 t + 1 of qh as bits 4 and 5 */
                __m512i hi = t < 2 ? _mm512_slli_epi16(qh, 4 - 2 * t)
                                   : (t == 2 ? qh : _mm512_srli_epi16(qh, 2));
                __m512i q = _mm512_sub_epi16(_mm512_or_si512(lo, _mm512_and_si512(hi, top)), bias);
                __m512i p = DPWSSD(_mm512_setzero_si512(), q,
                                   _mm512_loadu_si512(a + 128 * h + 32 * t));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p),
                                         _mm512_permutexvar_ps(pick[4 * h + t], units), acc[t]);
            }
        }
    }
    acc[0] = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    return _mm512_reduce_add_ps(acc[0]);
}

/* kq6_row_wide from the activations split into bytes (split_q16, SPLIT_PLAIN: low bytes at
 * xb, high bytes at xb + K, then the float sums of each 16 activations, s16): a half
 * super-block's 64 bytes ql and its 32 bytes qh (in both halves of a vector) give two vectors
 * of 64 stored values q (0-63; the weight is q - 32) in element order (the nibbles, and each
 * byte's two bits of qh moved to bits 4 and 5 by a shift per half), multiplied as unsigned
 * bytes; the 32 comes off at the end, 32 times the sums s16 by the same factors. Lanes 4 j to 4 j + 3 hold the sums
 * of one scale's 16 weights, so one conversion and one multiply-add (one permute of the
 * super-block's 16 factors) serve 64 weights. */
static float kq6_row_split(const uint8_t *w, const uint8_t *xb, const float *xd,
                           int64_t supers) {
    int64_t K = supers * QK_K;
    const uint8_t *xl = xb, *xh = xb + K;
    const float *s16 = (const float *)(xb + 2 * K);
    __m512 acc[4], bias = _mm512_setzero_ps();
    for (int c = 0; c < 4; c++) acc[c] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f), top = _mm512_set1_epi8(0x30);
    /* qh bits 0-1 (first half) and 2-3 (second) to bits 4-5; bits 4-5 and 6-7 likewise */
    const __m512i up = _mm512_mask_blend_epi16(0xffff0000u, _mm512_set1_epi16(4),
                                               _mm512_set1_epi16(2));
    const __m512i down = _mm512_mask_blend_epi16(0xffff0000u, _mm512_setzero_si512(),
                                                 _mm512_set1_epi16(2));
    __m512i pick[4]; /* elements 64 c .. 64 c + 63: scales 4 c .. 4 c + 3, four lanes each */
    const __m512i four = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (int c = 0; c < 4; c++) pick[c] = _mm512_add_epi32(four, _mm512_set1_epi32(4 * c));
    for (int64_t s = 0; s < supers; s++, w += Q6_K_BYTES) {
        __m512 units = kq6_units(w, xd + s * 8, WIDE_PREFETCH);
        bias = _mm512_fmadd_ps(units, _mm512_loadu_ps(s16 + s * 16), bias);
        for (int h = 0; h < 2; h++) {
            __m512i ql = _mm512_loadu_si512(w + 64 * h);
            __m512i qh = _mm512_broadcast_i64x4(
                _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h)));
            __m512i q[2] = {_mm512_or_si512(_mm512_and_si512(ql, low),
                                            _mm512_and_si512(_mm512_sllv_epi16(qh, up), top)),
                            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low),
                                            _mm512_and_si512(_mm512_srlv_epi16(qh, down), top))};
            for (int j = 0; j < 2; j++) {
                int c = 2 * h + j;
                int64_t e = s * QK_K + 64 * c;
                __m512i p = DPBUSD(_mm512_setzero_si512(), q[j], _mm512_loadu_si512(xh + e));
                p = DPBUSD(_mm512_slli_epi32(p, 8), _mm512_loadu_si512(xl + e), q[j]);
                acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p),
                                         _mm512_permutexvar_ps(pick[c], units), acc[c]);
            }
        }
    }
    acc[0] = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    return _mm512_reduce_add_ps(acc[0]) - 32.0f * _mm512_reduce_add_ps(bias);
}
#elif defined(__AVX2__)
/* The 8 scales (low 64 bits) and 8 mins (high 64 bits) of the Q4_K or Q5_K super-block at w as
 * bytes, unpacked in the vector unit from one load of its 16-byte header (d, dmin, then the
 * dwords a, b, c of the 6-bit scales: sc_j = a & 63 for j < 4, (c & 15) | (a >> 6) << 4 from 4
 * on, the mins the same from b and c >> 4). kq4_scales_vec's general-register result took four
 * inserts into a vector; this way the AVX2 one-row kernels are 4-17% faster on Zen 3. */
static inline __m128i kq4_scales_xmm(__m128i header) {
    __m128i ab = _mm_shuffle_epi32(header, 0xa5), cc = _mm_shuffle_epi32(header, 0xff);
    __m128i low6 = _mm_and_si128(ab, _mm_set1_epi32(0x3f3f3f3f));
    __m128i top2 = _mm_and_si128(_mm_srli_epi32(ab, 2), _mm_set1_epi32(0x30303030));
    __m128i nib = _mm_and_si128(_mm_srlv_epi32(cc, _mm_setr_epi32(0, 0, 4, 4)),
                                _mm_set1_epi32(0x0f0f0f0f));
    return _mm_blend_epi32(low6, _mm_or_si128(nib, top2), 0xa); /* sc 0-3, 4-7, m 0-3, 4-7 */
}

/* d * sc_j of the Q4_K or Q5_K super-block at w's 8 sub-blocks, and dmin * m_j in *dmn (d and
 * dmin converted together from the header). */
static inline __m256 kq4_scaled(const uint8_t *w, __m256 *dmn) {
    __m128i header = _mm_loadu_si128((const __m128i *)w);
    __m128i scales = kq4_scales_xmm(header);
    __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(scales));
    __m256 mnf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(scales, scales)));
    __m128 dm = _mm_cvtph_ps(header); /* d, dmin in lanes 0 and 1 */
    __m256 d = _mm256_broadcastss_ps(dm), dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
    *dmn = _mm256_mul_ps(dmin, mnf);
    return _mm256_mul_ps(d, scf);
}

/* The factors d * sc_j * xd_j of one Q4_K or Q5_K super-block's 8 sub-blocks, and mins plus
 * dmin * m_j * xs_j in *mins: kq4_factors' numbers, kept in registers. */
static inline __m256 kq4_factors_reg(const uint8_t *w, const float *xd, const float *xs,
                                     __m256 *mins) {
    __m256 dmn, dsc = kq4_scaled(w, &dmn);
    *mins = _mm256_fmadd_ps(dmn, _mm256_loadu_ps(xs), *mins);
    return _mm256_mul_ps(dsc, _mm256_loadu_ps(xd));
}

/* The 16-bit weights of sub-blocks j (q[0], q[1]) and j + 1 (q[2], q[3]; j even) of the Q4_K
 * (five = 0) or Q5_K super-block at w, in split_k's word order: their 32 nibble bytes widened
 * to words in place by vpunpcklbw and vpunpckhbw, a mask and a shift giving the two
 * sub-blocks (Q5_K: each sub-block's bit of qh, the super-block's qh bytes widened the same
 * way, moved to bit 4). */
static inline __attribute__((always_inline)) void kq45_widen_pair(const uint8_t *w, int five,
                                                                  int j, const __m256i *qh,
                                                                  __m256i *q) {
    const __m256i low = _mm256_set1_epi16(0x0f), sixteen = _mm256_set1_epi16(16);
    const __m256i zero = _mm256_setzero_si256();
    __m256i n = _mm256_loadu_si256((const __m256i *)(w + (five ? 48 : 16) + 16 * j));
    for (int e = 0; e < 2; e++) {
        __m256i u = e ? _mm256_unpackhi_epi8(n, zero) : _mm256_unpacklo_epi8(n, zero);
        q[e] = _mm256_and_si256(u, low);
        q[2 + e] = _mm256_srli_epi16(u, 4);
        if (five) { /* bit j of qh as 16, then bit j + 1 */
            __m256i b = j >= 4 ? _mm256_srli_epi16(qh[e], j - 4) : _mm256_slli_epi16(qh[e], 4 - j);
            q[e] = _mm256_or_si256(q[e], _mm256_and_si256(b, sixteen));
            q[2 + e] = _mm256_or_si256(q[2 + e],
                                       _mm256_and_si256(_mm256_srli_epi16(b, 1), sixteen));
        }
    }
}

/* A Q5_K super-block's 32 bytes qh widened to words as kq45_widen_pair takes them. */
static inline void kq5_widen_qh(const uint8_t *w, int five, __m256i *qh) {
    const __m256i zero = _mm256_setzero_si256();
    __m256i h = five ? _mm256_loadu_si256((const __m256i *)(w + 16)) : zero;
    qh[0] = _mm256_unpacklo_epi8(h, zero);
    qh[1] = _mm256_unpackhi_epi8(h, zero);
}

/* The products of a sub-block pair's words q (kq45_widen_pair) with their 64 activations at x:
 * 8 int32 lanes for each sub-block, v[0] and v[1]. */
static inline void kq45_pair_products(const __m256i *q, const int16_t *x, __m256i *v) {
    v[0] = _mm256_add_epi32(_mm256_madd_epi16(q[0], _mm256_loadu_si256((const __m256i *)x)),
                            _mm256_madd_epi16(q[1], _mm256_loadu_si256((const __m256i *)(x + 16))));
    v[1] = _mm256_add_epi32(
        _mm256_madd_epi16(q[2], _mm256_loadu_si256((const __m256i *)(x + 32))),
        _mm256_madd_epi16(q[3], _mm256_loadu_si256((const __m256i *)(x + 48))));
}

/* As kq45_row_wide at 256 bits, from the activations reordered by split_k (xp: per 32, words
 * 0-7, 16-23, 8-15, 24-31). Each two sub-blocks' weights are widened by kq45_widen_pair; each
 * sub-block's products leave 8 int32 lanes, and per super-block horizontal adds reduce the 8
 * sub-blocks' lanes to one vector (hadd4_epi32 as soon as four sub-blocks are there, which
 * keeps the registers from spilling; lane j: sub-block j's integer sum), converted once and
 * multiplied by the 8 factors in one multiply-add. */
static inline __attribute__((always_inline)) float kq45_row_wide(const uint8_t *w, int five,
                                                                 const int16_t *xp,
                                                                 const float *xd,
                                                                 const float *xs,
                                                                 int64_t supers) {
    __m256 acc = _mm256_setzero_ps(), mins = _mm256_setzero_ps();
    int64_t bytes_per = five ? Q5_K_BYTES : Q4_K_BYTES;
    for (int64_t s = 0; s < supers; s++, w += bytes_per) {
        _mm_prefetch((const char *)(w + ROW_PREFETCH), ROW_PREFETCH_HINT);
        _mm_prefetch((const char *)(w + ROW_PREFETCH + 64), ROW_PREFETCH_HINT);
        if (five) _mm_prefetch((const char *)(w + ROW_PREFETCH + 128), ROW_PREFETCH_HINT);
        __m256 f = kq4_factors_reg(w, xd + s * 8, xs + s * 8, &mins);
        const int16_t *a = xp + s * QK_K;
        __m256i qh[2], v[8], half[2];
        kq5_widen_qh(w, five, qh);
        for (int j = 0; j < 8; j += 2) { /* sub-blocks j (low nibbles) and j + 1 (high) */
            __m256i q[4];
            kq45_widen_pair(w, five, j, qh, q);
            kq45_pair_products(q, a + 32 * j, v + j);
            if (j % 4 == 2) { /* sub-blocks j - 2 .. j + 1, as soon as they are there */
                half[j / 4] = hadd4_epi32(v[j - 2], v[j - 1], v[j], v[j + 1]);
            }
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hadd4_halves(half[0], half[1])), f, acc);
    }
    return hsum(acc) - hsum(mins);
}

/* Words of one t of a Q6_K half super-block h (ql and qh its bytes there) as kq6_row_wide
 * multiplies them: the 6-bit values (the weight plus 32) of 32 weights widened in place. */
static inline __attribute__((always_inline)) void kq6_widen_t(const uint8_t *w, int h, int t,
                                                              __m256i qh, __m256i *q) {
    const __m256i low = _mm256_set1_epi8(0x0f), top = _mm256_set1_epi8(0x30);
    const __m256i zero = _mm256_setzero_si256();
    __m256i ql = _mm256_loadu_si256((const __m256i *)(w + 64 * h + 32 * (t % 2)));
    __m256i lo = _mm256_and_si256(t / 2 ? _mm256_srli_epi16(ql, 4) : ql, low);
    /* bits 2 t and 2 t + 1 of qh as bits 4 and 5 (what crosses a byte is masked) */
    __m256i hi = t == 2 ? qh : t < 2 ? _mm256_slli_epi16(qh, 4 - 2 * t) : _mm256_srli_epi16(qh, 2);
    __m256i b = _mm256_or_si256(lo, _mm256_and_si256(hi, top));
    q[0] = _mm256_unpacklo_epi8(b, zero);
    q[1] = _mm256_unpackhi_epi8(b, zero);
}

/* The products of one t's words q (kq6_widen_t) with its 32 activations at x: 8 int32 lanes,
 * the low 4 one scale's 16 weights, the high 4 the next's. */
static inline __m256i kq6_t_products(const __m256i *q, const int16_t *x) {
    return _mm256_add_epi32(_mm256_madd_epi16(q[0], _mm256_loadu_si256((const __m256i *)x)),
                            _mm256_madd_epi16(q[1], _mm256_loadu_si256((const __m256i *)(x + 16))));
}

/* The 8 factors' d * scale_g of a Q6_K half super-block h, sc its scales in split_k's order. */
static inline __m256 kq6_half_scales(__m256 d, __m128i sc, int h) {
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h ? _mm_srli_si128(sc, 8)
                                                                        : sc)));
}

/* A Q6_K super-block's 16 scales in the order of split_k's sums (0, 2, 4, 6, 1, 3, 5, 7 of each
 * half). */
static inline __m128i kq6_scales_ordered(const uint8_t *w) {
    const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    return _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(w + 192)), order);
}

/* As kq6_row_wide at 256 bits, from the activations reordered by split_k. Each 32 weights'
 * 6-bit values are assembled as the stored bytes 0-63 (the weight plus 32) and widened in place
 * (kq6_widen_t); the products of one t leave the sums of its two scales' 16 weights
 * in the low and the high 4 lanes, and two rounds of horizontal adds over the 4 t of a half
 * super-block leave one lane per scale (scales 0, 2, 4, 6, 1, 3, 5, 7 of the half, the order
 * of split_k's sums and of the factors d * scale_g * xd, the half's 4 xd broadcast from memory,
 * not permuted: vpermps is slow on Zen 3); 32 times each scale's activation sum comes off in
 * int32 (exact), then one conversion and one multiply-add. */
static float kq6_row_wide(const uint8_t *w, const int16_t *xp, const float *xd, int64_t supers) {
    __m256 acc = _mm256_setzero_ps();
    const int32_t *sums32 = (const int32_t *)(xp + QK_K * supers);
    for (int64_t s = 0; s < supers; s++, w += Q6_K_BYTES) {
        for (int k = 0; k < 4; k++) {
            _mm_prefetch((const char *)(w + ROW_PREFETCH + 64 * k), ROW_PREFETCH_HINT);
        }
        __m256 d = _mm256_set1_ps(fp16_to_float(w + 208));
        __m128i sc = kq6_scales_ordered(w);
        const int16_t *a = xp + s * QK_K;
        for (int h = 0; h < 2; h++) {
            __m256 f = _mm256_mul_ps(kq6_half_scales(d, sc, h),
                                     _mm256_broadcast_ps((const __m128 *)(xd + s * 8 + 4 * h)));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
            __m256i v[4];
            for (int t = 0; t < 4; t++) {
                __m256i q[2];
                kq6_widen_t(w, h, t, qh, q);
                v[t] = kq6_t_products(q, a + 128 * h + 32 * t);
            }
            __m256i sums = _mm256_sub_epi32(
                hadd4_epi32(v[0], v[1], v[2], v[3]),
                _mm256_loadu_si256((const __m256i *)(sums32 + 8 * (2 * s + h))));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), f, acc);
        }
    }
    return hsum(acc);
}

/* Weight rows that the many-row kernels widen together, one super-block each, before the
 * activation rows run over them (defined where the build has those kernels). */
#define KQ_MANY 4

/* kq45_row_wide's outputs (their bits) for weight rows n0 <= n < n1 (at most KQ_MANY, row_bytes
 * apart) and M activation rows at once (xb: each row's split_k bytes, SPLIT_K_BYTES(K) a row;
 * xd, xs K / 32 a row), into y[m * ldy + n]: each super-block of the weight rows is widened
 * once (kq45_widen_pair) for all M rows, where kq45_row_wide row after row widened it M times;
 * each row's factors, integer sums and multiply-adds are kq45_row_wide's, in its order. */
static inline __attribute__((always_inline)) void kq45_rows_many(
    const uint8_t *W, int five, int64_t row_bytes, int64_t n0, int64_t n1, const uint8_t *xb,
    const float *xd, const float *xs, int64_t K, int64_t M, float *y, int64_t ldy) {
    int64_t R = n1 - n0, supers = K / QK_K, nb = K / QK;
    int64_t bytes_per = five ? Q5_K_BYTES : Q4_K_BYTES;
    float acc[M][KQ_MANY][8], mins[M][KQ_MANY][8];
    memset(acc, 0, sizeof acc);
    memset(mins, 0, sizeof mins);
    for (int64_t s = 0; s < supers; s++) {
        __m256i q[KQ_MANY][16];
        __m256 dsc[KQ_MANY], dmn[KQ_MANY];
        for (int64_t r = 0; r < R; r++) {
            const uint8_t *w = W + (n0 + r) * row_bytes + s * bytes_per;
            for (int k = 0; k < (five ? 3 : 2); k++) {
                _mm_prefetch((const char *)(w + ROW_PREFETCH + 64 * k), ROW_PREFETCH_HINT);
            }
            dsc[r] = kq4_scaled(w, dmn + r);
            __m256i qh[2];
            kq5_widen_qh(w, five, qh);
            for (int j = 0; j < 8; j += 2) kq45_widen_pair(w, five, j, qh, q[r] + 2 * j);
        }
        for (int64_t m = 0; m < M; m++) {
            const int16_t *a = (const int16_t *)(xb + m * SPLIT_K_BYTES(K)) + s * QK_K;
            __m256 xdv = _mm256_loadu_ps(xd + m * nb + s * 8);
            __m256 xsv = _mm256_loadu_ps(xs + m * nb + s * 8);
            for (int64_t r = 0; r < R; r++) {
                __m256i v[8];
                for (int j = 0; j < 8; j += 2) kq45_pair_products(q[r] + 2 * j, a + 32 * j, v + j);
                __m256i sums = hadd4_halves(hadd4_epi32(v[0], v[1], v[2], v[3]),
                                            hadd4_epi32(v[4], v[5], v[6], v[7]));
                _mm256_storeu_ps(acc[m][r], _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums),
                                                            _mm256_mul_ps(dsc[r], xdv),
                                                            _mm256_loadu_ps(acc[m][r])));
                _mm256_storeu_ps(mins[m][r], _mm256_fmadd_ps(dmn[r], xsv,
                                                             _mm256_loadu_ps(mins[m][r])));
            }
        }
    }
    for (int64_t m = 0; m < M; m++) {
        for (int64_t r = 0; r < R; r++) {
            y[m * ldy + n0 + r] = hsum(_mm256_loadu_ps(acc[m][r]))
                                  - hsum(_mm256_loadu_ps(mins[m][r]));
        }
    }
}

static void kq4_rows_many(const uint8_t *W, int64_t row_bytes, int64_t n0, int64_t n1,
                          const uint8_t *xb, const float *xd, const float *xs, int64_t K,
                          int64_t M, float *y, int64_t ldy) {
    kq45_rows_many(W, 0, row_bytes, n0, n1, xb, xd, xs, K, M, y, ldy);
}

static void kq5_rows_many(const uint8_t *W, int64_t row_bytes, int64_t n0, int64_t n1,
                          const uint8_t *xb, const float *xd, const float *xs, int64_t K,
                          int64_t M, float *y, int64_t ldy) {
    kq45_rows_many(W, 1, row_bytes, n0, n1, xb, xd, xs, K, M, y, ldy);
}

/* kq6_row_wide's outputs for weight rows n0 <= n < n1 and M activation rows at once, as
 * kq45_rows_many does for Q4_K and Q5_K: each half super-block of the weight rows widened once
 * (kq6_widen_t), each row's sums and multiply-adds kq6_row_wide's, in its order. */
static void kq6_rows_many(const uint8_t *W, int64_t row_bytes, int64_t n0, int64_t n1,
                          const uint8_t *xb, const float *xd, int64_t K, int64_t M, float *y,
                          int64_t ldy) {
    int64_t R = n1 - n0, supers = K / QK_K, nb = K / QK;
    float acc[M][KQ_MANY][8];
    memset(acc, 0, sizeof acc);
    for (int64_t s = 0; s < supers; s++) {
        for (int h = 0; h < 2; h++) {
            __m256i q[KQ_MANY][8];
            __m256 dsc[KQ_MANY];
            for (int64_t r = 0; r < R; r++) {
                const uint8_t *w = W + (n0 + r) * row_bytes + s * Q6_K_BYTES;
                for (int k = 0; h == 0 && k < 4; k++) {
                    _mm_prefetch((const char *)(w + ROW_PREFETCH + 64 * k), ROW_PREFETCH_HINT);
                }
                dsc[r] = kq6_half_scales(_mm256_set1_ps(fp16_to_float(w + 208)),
                                         kq6_scales_ordered(w), h);
                __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
                for (int t = 0; t < 4; t++) kq6_widen_t(w, h, t, qh, q[r] + 2 * t);
            }
            for (int64_t m = 0; m < M; m++) {
                const uint8_t *row = xb + m * SPLIT_K_BYTES(K);
                const int16_t *a = (const int16_t *)row + s * QK_K + 128 * h;
                __m256 xdv = _mm256_broadcast_ps((const __m128 *)(xd + m * nb + s * 8 + 4 * h));
                __m256i bias = _mm256_loadu_si256(
                    (const __m256i *)((const int32_t *)(row + 2 * K) + 8 * (2 * s + h)));
                for (int64_t r = 0; r < R; r++) {
                    __m256i v[4];
                    for (int t = 0; t < 4; t++) v[t] = kq6_t_products(q[r] + 2 * t, a + 32 * t);
                    __m256i sums = _mm256_sub_epi32(hadd4_epi32(v[0], v[1], v[2], v[3]), bias);
                    _mm256_storeu_ps(acc[m][r], _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums),
                                                                _mm256_mul_ps(dsc[r], xdv),
                                                                _mm256_loadu_ps(acc[m][r])));
                }
            }
        }
    }
    for (int64_t m = 0; m < M; m++) {
        for (int64_t r = 0; r < R; r++) y[m * ldy + n0 + r] = hsum(_mm256_loadu_ps(acc[m][r]));
    }
}
#endif

#ifdef __AVX2__
static float kq4_row_wide(const uint8_t *w, const int16_t *xq, const float *xd,
                          const float *xs, int64_t supers) {
    return kq45_row_wide(w, 0, xq, xd, xs, supers);
}

static float kq5_row_wide(const uint8_t *w, const int16_t *xq, const float *xd,
                          const float *xs, int64_t supers) {
    return kq45_row_wide(w, 1, xq, xd, xs, supers);
}
#endif

/* Outputs y[n0 .. n1) of a one-row product (y indexed by output), the fastest way the build
 * has: four Q4_K or Q5_K rows through kq4_rows4_wide / kq5_rows4_wide and Q6_K rows through
 * kq6_row_split (512 bits; xb the activations split by split_k, or NULL), else kq4_row_wide /
 * kq5_row_wide / kq6_row_wide (sums in another order than kq_rows): at 512 bits from xq, at 256
 * bits from xb (split_k's reordered words); else (no xb at 256 bits, no AVX2) kq_rows. */
static void kq_rows_one(const uint8_t *W, int fmt, int64_t K, int64_t n0, int64_t n1,
                        const int16_t *xq, const uint8_t *xb, const float *xd, const float *xs,
                        float *y) {
#ifdef __AVX2__
    int64_t row_bytes = fmt_row_bytes(fmt, K);
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (fmt == FMT_Q4_K && n1 - n0 == 4 && xb) {
        kq4_rows4_wide(W + n0 * row_bytes, row_bytes, xb, xd, xs, K / QK_K, y + n0);
        return;
    }
    if (fmt == FMT_Q5_K && n1 - n0 == 4 && xb) {
        kq5_rows4_wide(W + n0 * row_bytes, row_bytes, xb, xd, xs, K / QK_K, y + n0);
        return;
    }
    if (fmt == FMT_Q6_K && xb) {
        for (int64_t n = n0; n < n1; n++) {
            y[n] = kq6_row_split(W + n * row_bytes, xb + 2 * K, xd, K / QK_K);
        }
        return;
    }
#else
    /* the 256-bit kernels read the words as split_k orders them; every caller passes them
     * (split_rows, the fused step's k_split) unless an allocation failed */
    if (!xb) {
        kq_rows_any(W, fmt, K, n0, n1, xq, xd, NULL, 1, y, 1);
        return;
    }
    xq = (const int16_t *)xb;
#endif
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *w = W + n * row_bytes;
        y[n] = fmt == FMT_Q4_K   ? kq4_row_wide(w, xq, xd, xs, K / QK_K)
               : fmt == FMT_Q5_K ? kq5_row_wide(w, xq, xd, xs, K / QK_K)
                                 : kq6_row_wide(w, xq, xd, K / QK_K);
    }
#else
    (void)xb, (void)xs;
    kq_rows_any(W, fmt, K, n0, n1, xq, xd, NULL, 1, y, 1);
#endif
}

/* Whether the row-invariant K-quant products (gemm_quant16: the deterministic mode) take
 * kq_rows_few: where the build has its many-row kernels; else kq_rows (a Gemma 3 prefill of
 * 1,024 tokens in the deterministic mode took 1.05x its time row after row, AMX Xeon). */
#ifdef KQ_MANY
#define KQ_MANY_ROWS 1
#else
#define KQ_MANY_ROWS 0
#endif

/* The most 16-bit rows of a batch (gemm_quant16_batch, the fused step) whose K-quant products
 * take kq_rows_few: any number on AVX2 builds, whose one-row kernels run row after row where
 * the build has no many-row kernels (AVX-512): 1B Q4_K_M decode steps of 8 / 12 / 16 sequences
 * took 0.70x / 0.79x / 0.84x kq_rows' time that way on an AMX Xeon (benchmarks/few_rows.py),
 * 7 sequences 0.42x on Zen 5. Elsewhere FEW_ROWS: kq_rows_one is kq_rows of one row. */
#ifdef __AVX2__
#define KQ_FEW_ROWS INT64_MAX
#else
#define KQ_FEW_ROWS FEW_ROWS
#endif

/* Activation rows from which kq_rows_few takes its many-row kernels: below, kq_rows_one row
 * after row is as fast or faster (on Zen 3, 2 rows 0.76x, 4 rows 0.96x), from 8 the many-row
 * kernels are 1.4-2.5x kq_rows' float products (which made 8 and 16 sequences of a Q4_K_M model
 * decode below one sequence's tokens/s in all). */
#define KQ_MANY_FROM 8

/* Outputs y[m * ldy + n] of weight rows n0 <= n < n1 (at most 4) for M activation rows (xq K a
 * row, xd and xs K / 32, xb each row's split_k bytes, SPLIT_K_BYTES(K) a row, or NULL), each
 * row's bits those of kq_rows_one for that row alone: on AVX2 builds without AVX-512, from
 * KQ_MANY_FROM rows, by the many-row kernels, 16 activation rows at a time; else by
 * kq_rows_one row after row. */
static void kq_rows_few(const uint8_t *W, int fmt, int64_t K, int64_t n0, int64_t n1,
                        const int16_t *xq, const uint8_t *xb, const float *xd, const float *xs,
                        int64_t M, float *y, int64_t ldy) {
    int64_t nb = K / QK;
#ifdef KQ_MANY
    int64_t row_bytes = fmt_row_bytes(fmt, K);
    for (int64_t m = 0; xb && M >= KQ_MANY_FROM && m < M; m += KQ_ROWS_AT_ONCE) {
        int64_t rows = M - m < KQ_ROWS_AT_ONCE ? M - m : KQ_ROWS_AT_ONCE;
        const uint8_t *x = xb + SPLIT_K_BYTES(K) * m;
        if (fmt == FMT_Q6_K) {
            kq6_rows_many(W, row_bytes, n0, n1, x, xd + m * nb, K, rows, y + m * ldy, ldy);
        } else {
            (fmt == FMT_Q5_K ? kq5_rows_many : kq4_rows_many)(W, row_bytes, n0, n1, x, xd + m * nb,
                                                               xs + m * nb, K, rows, y + m * ldy,
                                                               ldy);
        }
    }
    if (xb && M >= KQ_MANY_FROM) return;
#endif
    for (int64_t m = 0; m < M; m++) {
        kq_rows_one(W, fmt, K, n0, n1, xq + m * K, xb ? xb + SPLIT_K_BYTES(K) * m : NULL,
                    xd + m * nb, xs + m * nb, y + m * ldy);
    }
}
