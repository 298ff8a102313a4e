/*
 * Prefill products of 16-bit activations with packed weights, for every AVX2 build: a GEMM
 * whose inner product is vpmaddwd (vpdpwssd with AVX512-VNNI), the same 16-bit integer
 * products as the decode kernels, blocked for many rows.
 *
 * Each thread takes panels of PANEL_N (16) weight rows. A panel is decoded once per product
 * into 16-bit integers (Q4_0, Q4_1, Q4_K and Q5_K as they are, Q8_0 bytes, Q6_K q - 32), with a
 * factor per 16 weights (the block's or sub-block's scale) and an offset per 32 (Q4_1's m,
 * Q4_0's -8 d as the other kernels read it, the K-quants' -dmin * m; none for Q8_0, Q6_K). Its
 * words are laid out so that 64 bytes hold, for the panel's 16 rows, the pair of weights that
 * one 32-bit activation unit meets: pairs (k, k + 8) within each 16 weights ("units").
 * Activation rows are paired the same way once per product. A tile of PANEL_M activation rows
 * by the panel's 16 outputs then keeps its integer sums in registers, adds a product per unit
 * and row, and converts them to floats at each scale change (every 32 weights, every 16 for
 * Q6_K):
 *
 *     y[m][n] = sum over blocks b of  f[n][b] * xd[m][b] * sum_k q[n][k] * xq[m][k]
 *                                    + o[n][b] * xs[m][b]
 *
 * Two forms of the tile, with the same sums in the same order (so the same bits): 256 bits,
 * 6 rows, 12 sums of 8 outputs (AVX2 builds without AVX-512); 512 bits, 12 rows, 12 sums of 16
 * outputs and 12 float sums in registers, each unit broadcast from memory (AVX-512 F and BW).
 * The integer sums are exact (|xq| <= 32767, |q| <= 128, 32 terms), so each output differs
 * from the float32 product of the dequantized weight only by the activations' 16-bit rounding
 * and the float sums' order; a row's bits do not depend on the other rows of the product. The
 * tiles' inner steps are inline assembly: GCC otherwise hoisted the broadcasts and spilled the
 * sums (256 bits: 0.5x the speed), or took the weights from memory for each row. A Zen 3 core
 * issues one 256-bit vpmaddwd a cycle, and the products run at that rate; an AMX Xeon core two
 * 512-bit vpdpwssd (tiles over data in L1: 140-155 G multiply-adds a second), and the products
 * run at 60-70% of it, their panel words and rows coming from L2 (panel_peak;
 * benchmarks/prefill_products.py).
 */
#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_PANEL 1
#define PANEL_N 16
#if defined(__AVX512F__) && defined(__AVX512BW__)
/* 512-bit builds: one vector holds a unit's 16 outputs, and a tile takes 12 rows (12 integer
 * and 12 float sums in registers; vpdpwssd where the CPU has AVX512-VNNI). */
#define PANEL_WIDE 1
#define PANEL_M 12
#else
#define PANEL_M 6
#endif
/* Rows from which a fused step's products take the panels (decode.c, team_panel): past 16, as
 * QuantLinear's eager products past SMALL_M. */
#define PANEL_TEAM_FROM 17

/* The 16 words of v (k 0..15) as 8 units: (k, k + 8) for k = 0..3 in the low half, 4..7 in
 * the high half. */
static inline __m256i pair16(__m256i v) {
    __m128i a = _mm256_castsi256_si128(v), b = _mm256_extracti128_si256(v, 1);
    return _mm256_set_m128i(_mm_unpackhi_epi16(a, b), _mm_unpacklo_epi16(a, b));
}

/* Rows r[0..8) of 32-bit values transposed in place: r[p] holds value p of each row. */
static inline void transpose8x8(__m256i *r) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
    }
}

/* The words of one block of 32 weights (k 0..15 in *lo, 16..31 in *hi), the factors of its
 * halves (f[0], f[1]) and its offset (*o). Block b of a row in format fmt (file layout). */
typedef struct {
    __m256i lo, hi;
    float f[2], o;
} BlockWords;

static inline __m256i nibble_words(const uint8_t *p, int shift) {
    __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    return _mm256_and_si256(_mm256_srli_epi16(v, shift), _mm256_set1_epi16(15));
}

/* A Q4_K or Q5_K super-block's factors d * sc_j and offsets -dmin * m_j, kept while a row's
 * 8 blocks of 32 in it are decoded (super-block `at`; -1: none yet). */
typedef struct {
    int64_t at;
    float f[8], o[8];
} SuperScales;

static void kq_block_words(const uint8_t *row, int fmt, int64_t b, SuperScales *held,
                           BlockWords *w) {
    const uint8_t *s = row + b / 8 * kq_bytes(fmt);
    int j = (int)(b % 8);
    if (fmt == FMT_Q6_K) {
        int h = j / 4, t = j % 4;
        const uint8_t *ql = s + 64 * h + 32 * (t % 2), *qh = s + 128 + 32 * h;
        const int8_t *sc = (const int8_t *)(s + 192) + 8 * h + 2 * t;
        float d = fp16_to_float(s + 208);
        __m256i lo = nibble_words(ql, 4 * (t / 2)), hi = nibble_words(ql + 16, 4 * (t / 2));
        __m256i three = _mm256_set1_epi16(3), bias = _mm256_set1_epi16(32);
        __m256i hlo = _mm256_and_si256(_mm256_srli_epi16(_mm256_cvtepu8_epi16(
            _mm_loadu_si128((const __m128i *)qh)), 2 * t), three);
        __m256i hhi = _mm256_and_si256(_mm256_srli_epi16(_mm256_cvtepu8_epi16(
            _mm_loadu_si128((const __m128i *)(qh + 16))), 2 * t), three);
        w->lo = _mm256_sub_epi16(_mm256_or_si256(lo, _mm256_slli_epi16(hlo, 4)), bias);
        w->hi = _mm256_sub_epi16(_mm256_or_si256(hi, _mm256_slli_epi16(hhi, 4)), bias);
        w->f[0] = d * (float)sc[0];
        w->f[1] = d * (float)sc[1];
        w->o = 0.0f;
        return;
    }
    if (held->at != b / 8) {
        uint8_t sc[8], mn[8];
        kq4_scales(s + 4, sc, mn);
        float d = fp16_to_float(s), dmin = fp16_to_float(s + 2);
        for (int i = 0; i < 8; i++) {
            held->f[i] = d * (float)sc[i];
            held->o[i] = -dmin * (float)mn[i];
        }
        held->at = b / 8;
    }
    int five = fmt == FMT_Q5_K;
    const uint8_t *nib = s + (five ? 48 : 16) + 32 * (j / 2);
    w->lo = nibble_words(nib, 4 * (j % 2));
    w->hi = nibble_words(nib + 16, 4 * (j % 2));
    if (five) {
        __m256i one = _mm256_set1_epi16(1);
        __m256i a = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(s + 16)));
        __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(s + 32)));
        w->lo = _mm256_or_si256(w->lo, _mm256_slli_epi16(_mm256_and_si256(
            _mm256_srli_epi16(a, j), one), 4));
        w->hi = _mm256_or_si256(w->hi, _mm256_slli_epi16(_mm256_and_si256(
            _mm256_srli_epi16(c, j), one), 4));
    }
    w->f[0] = w->f[1] = held->f[j];
    w->o = held->o[j];
}

static void block_words(const uint8_t *row, int fmt, int64_t b, SuperScales *held,
                        BlockWords *w) {
    if (is_kquant(fmt)) {
        kq_block_words(row, fmt, b, held, w);
        return;
    }
    const uint8_t *blk = row + b * block_bytes(fmt);
    w->f[0] = w->f[1] = fp16_to_float(blk);
    w->o = 0.0f;
    if (fmt == FMT_Q8_0) {
        w->lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2)));
        w->hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18)));
        return;
    }
    const uint8_t *nib = blk + nibbles_at(fmt);
    w->lo = nibble_words(nib, 0);
    w->hi = nibble_words(nib, 4);
    w->o = q4_offset(blk, fmt); /* Q4_0 as Q4_1 with the offset -8 d, as everywhere */
}

/* One panel: rows[0..16) (file layout) decoded into units wp[(b * 16 + p) * 16 + n], factors
 * f[(2 b + h) * 16 + n] and offsets o[b * 16 + n]. */
static void pack_panel(const uint8_t *const *rows, int fmt, int64_t nb, int32_t *wp, float *f,
                       float *o) {
    SuperScales held[PANEL_N];
    for (int r = 0; r < PANEL_N; r++) held[r].at = -1;
    for (int64_t b = 0; b < nb; b++) {
        for (int g = 0; g < 2; g++) {
            __m256i ua[8], ub[8];
            for (int r = 0; r < 8; r++) {
                BlockWords w;
                int n = 8 * g + r;
                block_words(rows[n], fmt, b, &held[n], &w);
                ua[r] = pair16(w.lo);
                ub[r] = pair16(w.hi);
                f[2 * b * 16 + n] = w.f[0];
                f[(2 * b + 1) * 16 + n] = w.f[1];
                o[b * 16 + n] = w.o;
            }
            transpose8x8(ua);
            transpose8x8(ub);
            int32_t *dst = wp + b * 256 + 8 * g;
            for (int p = 0; p < 8; p++) {
                _mm256_store_si256((__m256i *)(dst + p * 16), ua[p]);
                _mm256_store_si256((__m256i *)(dst + (p + 8) * 16), ub[p]);
            }
        }
    }
}

/* Blocks [i0, i1) of 16-bit activations as units a[i * 16 + p] (block i of row m is m * nb +
 * b), paired as pack_panel pairs the weights. */
static inline void pair_blocks(const int16_t *xq, int64_t i0, int64_t i1, int32_t *a) {
    for (int64_t i = i0; i < i1; i++) {
        __m256i lo = _mm256_loadu_si256((const __m256i *)(xq + i * QK));
        __m256i hi = _mm256_loadu_si256((const __m256i *)(xq + i * QK + 16));
        _mm256_storeu_si256((__m256i *)(a + i * 16), pair16(lo));
        _mm256_storeu_si256((__m256i *)(a + i * 16 + 8), pair16(hi));
    }
}

/* M rows of 16-bit activations (nb blocks each) as units (pair_blocks); rows M .. Mp (up to a
 * multiple of PANEL_M) zero. */
static void pair_rows(const int16_t *xq, int64_t M, int64_t Mp, int64_t nb, int32_t *a) {
    int parallel = M * nb >= 4096;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t i = 0; i < M * nb; i += 64) {
        pair_blocks(xq, i, i + 64 < M * nb ? i + 64 : M * nb, a);
    }
    memset(a + M * nb * 16, 0, (size_t)((Mp - M) * nb * 16) * sizeof(int32_t));
}

#ifdef PANEL_WIDE
/* Unit p of a 12-row tile: the panel's 16 outputs' words at w (one vector) times each row's
 * unit p, broadcast from memory (rows ld bytes apart from a0, a3, a6, a9: three rows each),
 * into the sums. Inline assembly, as the 256-bit form's: GCC broadcast the units into
 * registers and took the weights from memory, two loads a product. */
#ifdef __AVX512VNNI__
#define PANEL_ROW512(p, r, at) "vpdpwssd " #p "*4" at "%{1to16%}, %%zmm31, %[s" #r "]\n\t"
#else
/* (vpmaddwd takes no embedded broadcast) */
#define PANEL_ROW512(p, r, at)                                                                 \
    "vpbroadcastd " #p "*4" at ", %%zmm30\n\t"                                                 \
    "vpmaddwd %%zmm30, %%zmm31, %%zmm29\n\t"                                                   \
    "vpaddd %%zmm29, %[s" #r "], %[s" #r "]\n\t"
#endif
#define PANEL_ROWS3(p, r0, r1, r2, base)                                                       \
    PANEL_ROW512(p, r0, "(%[" base "])") PANEL_ROW512(p, r1, "(%[" base "],%[ld])")            \
    PANEL_ROW512(p, r2, "(%[" base "],%[ld],2)")
/* (p: a literal; the 24 sums' operands leave room for no immediates within GCC's 30) */
#define PANEL_UNIT512(p)                                                                       \
    __asm__("vmovdqa32 " #p "*64(%[w]), %%zmm31\n\t"                                           \
            PANEL_ROWS3(p, 0, 1, 2, "a0") PANEL_ROWS3(p, 3, 4, 5, "a3")                        \
            PANEL_ROWS3(p, 6, 7, 8, "a6") PANEL_ROWS3(p, 9, 10, 11, "a9")                      \
            : [s0] "+v"(s[0]), [s1] "+v"(s[1]), [s2] "+v"(s[2]), [s3] "+v"(s[3]),              \
              [s4] "+v"(s[4]), [s5] "+v"(s[5]), [s6] "+v"(s[6]), [s7] "+v"(s[7]),              \
              [s8] "+v"(s[8]), [s9] "+v"(s[9]), [s10] "+v"(s[10]), [s11] "+v"(s[11])           \
            : [w] "r"(wb), [a0] "r"(ab), [a3] "r"(ab + 3 * lda), [a6] "r"(ab + 6 * lda),       \
              [a9] "r"(ab + 9 * lda), [ld] "r"(lda * 4)                                        \
            : "memory", "xmm29", "xmm30", "xmm31")

/* Units p0 .. p0 + 8 (p0 0 or 8) of block b (units ab, lda a row; the panel's words wb) into
 * the sums. */
static inline __attribute__((always_inline)) void panel_units512(const int32_t *wb,
                                                                 const int32_t *ab, int64_t lda,
                                                                 int p0, __m512i *s) {
    if (p0 == 0) {
        PANEL_UNIT512(0); PANEL_UNIT512(1); PANEL_UNIT512(2); PANEL_UNIT512(3);
        PANEL_UNIT512(4); PANEL_UNIT512(5); PANEL_UNIT512(6); PANEL_UNIT512(7);
    } else {
        PANEL_UNIT512(8); PANEL_UNIT512(9); PANEL_UNIT512(10); PANEL_UNIT512(11);
        PANEL_UNIT512(12); PANEL_UNIT512(13); PANEL_UNIT512(14); PANEL_UNIT512(15);
    }
}

/* panel_flush in 512 bits: the float sums c[r] += s[r] * (f * xd[r][b]), s zeroed. */
static inline __attribute__((always_inline)) void panel_flush512(__m512i *s, const float *f,
                                                                 const float *xd, int64_t nb,
                                                                 int64_t b, __m512 *c) {
    __m512 fv = _mm512_load_ps(f);
    for (int r = 0; r < PANEL_M; r++) {
        __m512 d = _mm512_mul_ps(fv, _mm512_set1_ps(xd[r * nb + b]));
        c[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), d, c[r]);
        s[r] = _mm512_setzero_si512();
    }
}

/* c[r * 16 + n] = output n of the panel for activation row r of 12: the 256-bit form's sums
 * in the same order, so the same bits. */
static inline __attribute__((always_inline)) void panel_tile(
    const int32_t *a, int64_t lda, const int32_t *wp, const float *f, const float *o,
    const float *xd, const float *xs, int64_t nb, int halves, int offsets, float *c) {
    __m512i s[PANEL_M];
    __m512 acc[PANEL_M];
    for (int r = 0; r < PANEL_M; r++) {
        s[r] = _mm512_setzero_si512();
        acc[r] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        const int32_t *wb = wp + b * 256, *ab = a + b * 16;
        panel_units512(wb, ab, lda, 0, s);
        if (halves) panel_flush512(s, f + 2 * b * 16, xd, nb, b, acc);
        panel_units512(wb, ab, lda, 8, s);
        panel_flush512(s, f + (2 * b + halves) * 16, xd, nb, b, acc);
        if (offsets) {
            __m512 ov = _mm512_load_ps(o + b * 16);
            for (int r = 0; r < PANEL_M; r++) {
                acc[r] = _mm512_fmadd_ps(ov, _mm512_set1_ps(xs[r * nb + b]), acc[r]);
            }
        }
    }
    for (int r = 0; r < PANEL_M; r++) _mm512_store_ps(c + r * 16, acc[r]);
}
#else
/* Unit p of a tile: the panel's 16 words at w (two vectors) times each of 6 rows' unit p (rows
 * ld bytes apart from a0: a0, a0 + ld, a0 + 2 ld, a3, a3 + ld, a3 + 2 ld), into the sums. */
#define PANEL_ROW(r, at)                                                                       \
    "vpbroadcastd %c[o]" at ", %%ymm14\n\t"                                                    \
    "vpmaddwd %%ymm12, %%ymm14, %%ymm15\n\t"                                                   \
    "vpaddd %%ymm15, %[s" #r "0], %[s" #r "0]\n\t"                                             \
    "vpmaddwd %%ymm13, %%ymm14, %%ymm15\n\t"                                                   \
    "vpaddd %%ymm15, %[s" #r "1], %[s" #r "1]\n\t"
#define PANEL_UNIT(p)                                                                          \
    __asm__("vmovdqa %c[wo](%[w]), %%ymm12\n\t"                                                \
            "vmovdqa %c[wo]+32(%[w]), %%ymm13\n\t"                                             \
            PANEL_ROW(0, "(%[a0])") PANEL_ROW(1, "(%[a0],%[ld])")                              \
            PANEL_ROW(2, "(%[a0],%[ld],2)") PANEL_ROW(3, "(%[a3])")                            \
            PANEL_ROW(4, "(%[a3],%[ld])") PANEL_ROW(5, "(%[a3],%[ld],2)")                      \
            : [s00] "+x"(s[0]), [s01] "+x"(s[1]), [s10] "+x"(s[2]), [s11] "+x"(s[3]),          \
              [s20] "+x"(s[4]), [s21] "+x"(s[5]), [s30] "+x"(s[6]), [s31] "+x"(s[7]),          \
              [s40] "+x"(s[8]), [s41] "+x"(s[9]), [s50] "+x"(s[10]), [s51] "+x"(s[11])         \
            : [w] "r"(wb), [a0] "r"(ab), [a3] "r"(ab + 3 * lda), [ld] "r"(lda * 4),            \
              [o] "i"((p) * 4), [wo] "i"((p) * 64)                                             \
            : "memory", "xmm12", "xmm13", "xmm14", "xmm15")

/* The sums s of 6 rows into the float sums c (c[r * 16 + n]): times the factors f (16 of the
 * panel) and each row's activation scale of block b. */
static inline __attribute__((always_inline)) void panel_flush(__m256i *s, const float *f,
                                                              const float *xd, int64_t nb,
                                                              int64_t b, float *c) {
    __m256 f0 = _mm256_load_ps(f), f1 = _mm256_load_ps(f + 8);
    for (int r = 0; r < PANEL_M; r++) {
        __m256 d = _mm256_set1_ps(xd[r * nb + b]);
        __m256 *cr = (__m256 *)(c + r * 16);
        cr[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[2 * r]), _mm256_mul_ps(f0, d), cr[0]);
        cr[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[2 * r + 1]), _mm256_mul_ps(f1, d), cr[1]);
        s[2 * r] = s[2 * r + 1] = _mm256_setzero_si256();
    }
}

/* The offsets' terms of block b: o (16 of the panel) times each row's activation sum. */
static inline __attribute__((always_inline)) void panel_offsets(const float *o, const float *xs,
                                                                int64_t nb, int64_t b, float *c) {
    __m256 o0 = _mm256_load_ps(o), o1 = _mm256_load_ps(o + 8);
    for (int r = 0; r < PANEL_M; r++) {
        __m256 v = _mm256_set1_ps(xs[r * nb + b]);
        __m256 *cr = (__m256 *)(c + r * 16);
        cr[0] = _mm256_fmadd_ps(o0, v, cr[0]);
        cr[1] = _mm256_fmadd_ps(o1, v, cr[1]);
    }
}

/* c[r * 16 + n] = output n of the panel for activation row r of 6 (units a, lda units a row;
 * scales xd and sums xs, nb a row). halves: a factor per 16 weights (Q6_K); offsets: add
 * the offsets' terms. */
static inline __attribute__((always_inline)) void panel_tile(
    const int32_t *a, int64_t lda, const int32_t *wp, const float *f, const float *o,
    const float *xd, const float *xs, int64_t nb, int halves, int offsets, float *c) {
    __m256i s[12];
    for (int i = 0; i < 12; i++) s[i] = _mm256_setzero_si256();
    for (int i = 0; i < 6 * 16; i += 8) _mm256_store_ps(c + i, _mm256_setzero_ps());
    for (int64_t b = 0; b < nb; b++) {
        const int32_t *wb = wp + b * 256, *ab = a + b * 16;
        PANEL_UNIT(0); PANEL_UNIT(1); PANEL_UNIT(2); PANEL_UNIT(3);
        PANEL_UNIT(4); PANEL_UNIT(5); PANEL_UNIT(6); PANEL_UNIT(7);
        if (halves) panel_flush(s, f + 2 * b * 16, xd, nb, b, c);
        PANEL_UNIT(8); PANEL_UNIT(9); PANEL_UNIT(10); PANEL_UNIT(11);
        PANEL_UNIT(12); PANEL_UNIT(13); PANEL_UNIT(14); PANEL_UNIT(15);
        panel_flush(s, f + (2 * b + halves) * 16, xd, nb, b, c);
        if (offsets) panel_offsets(o + b * 16, xs, nb, b, c);
    }
}
#endif /* PANEL_WIDE */

/* Every tile of one panel (outputs n0 .. n0 + cols of y) over the Mp paired rows. */
static void panel_rows_all(const int32_t *a, int64_t Mp, int64_t M, int64_t nb,
                           const int32_t *wp, const float *f, const float *o, const float *xd,
                           const float *xs, int fmt, float *y, int64_t ldy, int cols) {
    float c[PANEL_M * 16] __attribute__((aligned(64)));
    int halves = fmt == FMT_Q6_K;
    int offsets = fmt != FMT_Q8_0 && fmt != FMT_Q6_K;
    for (int64_t m = 0; m < Mp; m += PANEL_M) {
        const int32_t *am = a + m * nb * 16;
        const float *dm = xd + m * nb, *sm = xs + m * nb;
        if (halves) {
            panel_tile(am, nb * 16, wp, f, o, dm, sm, nb, 1, 0, c);
        } else if (offsets) {
            panel_tile(am, nb * 16, wp, f, o, dm, sm, nb, 0, 1, c);
        } else {
            panel_tile(am, nb * 16, wp, f, o, dm, sm, nb, 0, 0, c);
        }
        for (int r = 0; r < PANEL_M && m + r < M; r++) {
            memcpy(y + (m + r) * ldy, c + r * 16, (size_t)cols * sizeof(float));
        }
    }
}
#endif

/* Multiply-adds a second of the tile alone, on one thread, over data in L1 (the ceiling of
 * gemm_panel on this core: benchmarks/prefill_products.py): the 256-bit form's inner step, the
 * 512-bit form's whole tiles over 4 blocks; 0 where there is no panel kernel. */
double panel_peak(int64_t blocks) {
#ifdef PANEL_WIDE
    /* whole tiles (their flushes included) over 4 blocks in L1, again and again */
    static int32_t w[4 * 256] __attribute__((aligned(64))), x[PANEL_M * 4 * 16];
    static float f[4 * 48] __attribute__((aligned(64))), d[PANEL_M * 4];
    float c[PANEL_M * 16] __attribute__((aligned(64)));
    double start = omp_get_wtime();
    for (int64_t b = 0; b < blocks; b += 4) {
        panel_tile(x, 4 * 16, w, f, f + 4 * 32, d, d, 4, 0, 0, c);
        __asm__ volatile("" : : "r"(c) : "memory");
    }
    double spent = omp_get_wtime() - start;
    return c[0] == 12345.0f ? 0.0 : (double)((blocks + 3) / 4 * 4) * 16 * PANEL_M * 32 / spent;
#elif defined(HAVE_PANEL)
    static int32_t w[256] __attribute__((aligned(32))), x[6 * 16] __attribute__((aligned(32)));
    __m256i s[12];
    for (int i = 0; i < 12; i++) s[i] = _mm256_setzero_si256();
    const int32_t *wb = w, *ab = x;
    int64_t lda = 16;
    double start = omp_get_wtime();
    for (int64_t b = 0; b < blocks; b++) {
        PANEL_UNIT(0); PANEL_UNIT(1); PANEL_UNIT(2); PANEL_UNIT(3);
        PANEL_UNIT(4); PANEL_UNIT(5); PANEL_UNIT(6); PANEL_UNIT(7);
        PANEL_UNIT(8); PANEL_UNIT(9); PANEL_UNIT(10); PANEL_UNIT(11);
        PANEL_UNIT(12); PANEL_UNIT(13); PANEL_UNIT(14); PANEL_UNIT(15);
    }
    double spent = omp_get_wtime() - start;
    int32_t sink[8];
    __m256i all = s[0];
    for (int i = 1; i < 12; i++) all = _mm256_add_epi32(all, s[i]);
    _mm256_storeu_si256((__m256i *)sink, all);
    return sink[0] == 12345 ? 0.0 : (double)blocks * 16 * 12 * 16 / spent;
#else
    (void)blocks;
    return 0.0;
#endif
}

/* Rows from which products take the panels, in the fused step (team_panel) and in QuantLinear
 * (SMALL_M + 1, a test holds the two together); 0 where the build has no panel kernel, which
 * leaves large products to expand-and-GEMM. */
int panel_rows(void) {
#ifdef HAVE_PANEL
    return PANEL_TEAM_FROM;
#else
    return 0;
#endif
}

#ifdef HAVE_PANEL
/* The panel's 16 rows in the file's layout: row pointers into W, a Q4_0S group unpacked into
 * tmp, or the zero row past N. */
static void panel_sources(const uint8_t *W, int fmt, int64_t N, int64_t K, int64_t n0,
                          int64_t row_bytes, uint8_t *tmp, const uint8_t *zero,
                          const uint8_t **rows) {
    for (int r = 0; r < PANEL_N; r++) {
        int64_t n = n0 + r;
        if (n >= N) {
            rows[r] = zero;
        } else if (fmt == FMT_Q4_0S) {
            if (r % 4 == 0) unpack_q4_0s(W + n * row_bytes, K, tmp + r * row_bytes);
            rows[r] = tmp + r * row_bytes;
        } else {
            rows[r] = W + n * row_bytes;
        }
    }
}

/* A thread's buffers for its panels: one panel's words, factors and offsets (wp, f), the rows
 * of a Q4_0S group unpacked (tmp) and a zero row (zero: the rows past N). */
typedef struct {
    int32_t *wp;
    float *f;
    uint8_t *tmp, *zero;
} PanelBuffers;

/* Allocates p for products of nb blocks a row (row_bytes) in format fmt; 0 where memory lacks. */
static int panel_buffers(int fmt, int64_t nb, int64_t row_bytes, PanelBuffers *p) {
    p->wp = aligned_alloc(64, (size_t)(nb * 256) * sizeof(int32_t));
    p->f = aligned_alloc(64, (size_t)(nb * 48) * sizeof(float));
    p->tmp = fmt == FMT_Q4_0S ? malloc((size_t)(PANEL_N * row_bytes)) : NULL;
    p->zero = calloc((size_t)row_bytes, 1);
    return p->wp && p->f && p->zero && (p->tmp || fmt != FMT_Q4_0S);
}

static void panel_buffers_free(PanelBuffers *p) {
    free(p->wp);
    free(p->f);
    free(p->tmp);
    free(p->zero);
}

/* Outputs n0 .. n0 + 16 (fewer at N) of the M rows (paired units a, Mp rows; scales xd and
 * sums xs, nb a row, Mp rows readable) into y, through one panel decoded into p. */
static void panel_outputs(const uint8_t *W, int fmt, int64_t N, int64_t K, int64_t n0,
                          const PanelBuffers *p, const int32_t *a, int64_t Mp, int64_t M,
                          const float *xd, const float *xs, float *y, int64_t ldy) {
    int64_t nb = K / QK;
    int64_t row_bytes = fmt == FMT_Q4_0S ? nb * Q4_0_BYTES : fmt_row_bytes(fmt, K);
    int unpacked = fmt == FMT_Q4_0S ? FMT_Q4_0 : fmt;
    const uint8_t *rows[PANEL_N];
    panel_sources(W, fmt, N, K, n0, row_bytes, p->tmp, p->zero, rows);
    pack_panel(rows, unpacked, nb, p->wp, p->f, p->f + nb * 32);
    int cols = N - n0 < PANEL_N ? (int)(N - n0) : PANEL_N;
    panel_rows_all(a, Mp, M, nb, p->wp, p->f, p->f + nb * 32, xd, xs, unpacked, y + n0, ldy,
                   cols);
}
#endif

/*
 * y[m * ldy + n] = sum_k x[m][k] W[n][k] for M rows of 16-bit activations (quantize_q16: xq,
 * scales xd, sums xs) and an N x K weight in format fmt (Q4_0S: N a multiple of 4). Returns 0,
 * or -1 where this build has no such kernel (y untouched) or memory is lacking (y possibly
 * written in part: the caller computes it another way).
 */
int gemm_panel(const uint8_t *W, int fmt, int64_t N, int64_t K, const int16_t *xq,
               const float *xd, const float *xs, int64_t M, float *y, int64_t ldy) {
#ifdef HAVE_PANEL
    int64_t nb = K / QK, Mp = (M + PANEL_M - 1) / PANEL_M * PANEL_M;
    int64_t row_bytes = fmt == FMT_Q4_0S ? nb * Q4_0_BYTES : fmt_row_bytes(fmt, K);
    int32_t *a = aligned_alloc(32, (size_t)(Mp * nb * 16) * sizeof(int32_t));
    float *scales = calloc((size_t)(2 * Mp * nb), sizeof(float));
    int failed = !a || !scales;
    if (!failed) {
        pair_rows(xq, M, Mp, nb, a);
        memcpy(scales, xd, (size_t)(M * nb) * sizeof(float));
        memcpy(scales + Mp * nb, xs, (size_t)(M * nb) * sizeof(float));
#pragma omp parallel
        {
            PanelBuffers p;
            int mine = panel_buffers(fmt, nb, row_bytes, &p);
            if (!mine) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (int64_t n0 = 0; n0 < N; n0 += PANEL_N) {
                if (mine) {
                    panel_outputs(W, fmt, N, K, n0, &p, a, Mp, M, scales, scales + Mp * nb, y,
                                  ldy);
                }
            }
            panel_buffers_free(&p);
        }
    }
    free(a);
    free(scales);
    return failed ? -1 : 0;
#else
    (void)W, (void)fmt, (void)N, (void)K, (void)xq, (void)xd, (void)xs, (void)M, (void)y;
    (void)ldy;
    return -1;
#endif
}
