/*
 * The stream layout of Q4_0 weights (FMT_Q4_0S): the layout a one-row product reads at the
 * memory's speed. Included by quant.c.
 *
 * The same bytes as the file's Q4_0 (18 per block of 32 weights), moved: per group of four
 * rows and run of 16 blocks, the four rows' fp16 scales (4 x 2 x 16 bytes), then per four blocks
 * each row's 64 bytes of nibbles (block j's 16 bytes in 16-byte lane j, as q4_sums gathers
 * them from the file's layout). A group is one contiguous stream (K a multiple of 128: runs
 * of 16 blocks, 1,152 bytes, the last of 4, 8 or 12); the one-row product (rows_q4_0s) reads
 * it with one aligned load per 64 bytes of nibbles and row and one L2 prefetch per cache
 * line, where the file's layout takes two unaligned loads and a byte permute per four blocks
 * and row (benchmarks/q4_layout_probe.c compares the two). At 256 bits its one-row product
 * runs row_q4_pairs' arithmetic (two blocks per aligned 32-byte load, the scales of 8 blocks in
 * one 16-byte load, where the file's layout takes eight 32-bit loads), so AVX2 builds stream
 * only the widths row_q4_pairs takes (rows of PAIRS_FROM bytes: from 1,024 wide).
 *
 * Products of up to PAIR_ROWS rows of 16-bit activations run rows_q4_0s row after row. Every
 * other product (more rows, bfloat16, AMX, the deterministic mode's gemm_quant16, expansions)
 * runs the file layout's kernels over groups unpacked into each thread's buffer
 * (stream_chunks), so its results are the file layout's exactly.
 */

void gemm_quant16(const uint8_t *W, int fmt, int64_t N, int64_t K, const int16_t *xq,
                  const float *xd, const float *xs, int64_t M, float *y, int64_t ldy);
void gemm_quant16_batch(const uint8_t *W, int fmt, int64_t N, int64_t K, const int16_t *xq,
                        const float *xd, const float *xs, int64_t M, float *y, int64_t ldy);
void gemm_quant(const uint8_t *W, int fmt, int64_t N, int64_t K, const int8_t *xq,
                const float *xd, const float *xs, int64_t M, float *y, int64_t ldy);
void gemm_bf16_batch(const uint8_t *W, int fmt, int64_t N, int64_t K, const uint16_t *x,
                     int64_t M, float *y, int64_t ldy);
void gemm_bf16_amx(const uint8_t *W, int fmt, int64_t N, int64_t K, const uint16_t *x, int64_t M,
                   uint32_t *xv, float *y, int64_t ldy);
void gemm_bf16_amx_large(const uint8_t *W, int fmt, int64_t N, int64_t K, const uint16_t *x,
                         int64_t M, uint16_t *y, int64_t ldy);
int64_t amx_packed_words(int64_t M, int64_t K);
int64_t amx_units(int64_t M, int64_t K);
void amx_pack_units(const uint16_t *x, int64_t M, int64_t K, int64_t u0, int64_t u1,
                    uint32_t *xv);
void amx_rows_range(const uint8_t *W, int fmt, int64_t K, const uint32_t *xv, int64_t M,
                    int64_t n0, int64_t n1, float *y, int64_t ldy);
static void dequant_block_bf16(const uint8_t *blk, int fmt, uint16_t *o);

/* Whether an N x K Q4_0 weight can take the stream layout: rows in fours, K a multiple of 128
 * (on AVX2 builds without AVX-512, rows of PAIRS_FROM bytes or more), and a build with AVX2
 * (else 0: the file's layout stays). */
int q4_0s_fits(int64_t N, int64_t K) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    return N > 0 && N % 4 == 0 && K > 0 && K % 128 == 0;
#elif defined(__AVX2__)
    return N > 0 && N % 4 == 0 && K % 128 == 0 && K / QK * Q4_0_BYTES >= PAIRS_FROM;
#else
    (void)N, (void)K;
    return 0;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#define STREAM_VBMI 1 /* the byte permutes of pack_group and unpack_q4_0s */
#endif

#ifdef STREAM_VBMI
/* Byte permutes between a run's 72 file bytes of four blocks and their 64 bytes of nibbles,
 * constants of the layout: TO_CHUNK(o) picks nibble byte o of the chunk from the loads at blk
 * and blk + 8 (byte at of the 72 lies in the second load from 64 on); TO_BLOCKS(p, o) picks
 * file byte o of blocks 4 p .. 4 p + 3 from the chunk, or from the run's 32 bytes of scales
 * (bytes 0-1 of each 18). */
#define CHUNK_AT(o) ((o) / 16 * Q4_0_BYTES + 2 + (o) % 16)
#define TO_CHUNK(o) (CHUNK_AT(o) < 64 ? CHUNK_AT(o) : CHUNK_AT(o) + 56)
#define TO_BLOCKS(p, o)                                                                        \
    ((o) % Q4_0_BYTES < 2 ? 64 + 8 * (p) + 2 * ((o) / Q4_0_BYTES) + (o) % Q4_0_BYTES            \
                          : 16 * ((o) / Q4_0_BYTES) + (o) % Q4_0_BYTES - 2)
#define ROW8(F, ...) F(__VA_ARGS__ 0), F(__VA_ARGS__ 1), F(__VA_ARGS__ 2), F(__VA_ARGS__ 3),   \
                     F(__VA_ARGS__ 4), F(__VA_ARGS__ 5), F(__VA_ARGS__ 6), F(__VA_ARGS__ 7)
#define ROW64(F, ...)                                                                          \
    ROW8(F, __VA_ARGS__), ROW8(F, __VA_ARGS__ 8 +), ROW8(F, __VA_ARGS__ 16 +),                  \
    ROW8(F, __VA_ARGS__ 24 +), ROW8(F, __VA_ARGS__ 32 +), ROW8(F, __VA_ARGS__ 40 +),            \
    ROW8(F, __VA_ARGS__ 48 +), ROW8(F, __VA_ARGS__ 56 +)
static const uint8_t to_chunk[64] __attribute__((aligned(64))) = {ROW64(TO_CHUNK, )};
#define TO_BLOCKS_OF(p) {ROW64(TO_BLOCKS, p, )}
static const uint8_t to_blocks[4][64] __attribute__((aligned(64))) = {
    TO_BLOCKS_OF(0), TO_BLOCKS_OF(1), TO_BLOCKS_OF(2), TO_BLOCKS_OF(3)};
#endif

/* Blocks in the run of the four rows that starts at block b0 of nb (16, or 4, 8 or 12 at the
 * end of a row); a run of n blocks takes 72 n bytes: 2 n of scales per row, then 64 bytes of
 * nibbles per four blocks and row. */
static inline int run_blocks(int64_t b0, int64_t nb) { return nb - b0 < 16 ? (int)(nb - b0) : 16; }

/* Group g's rows in the file's layout (rows, 4 x row_bytes) as one stream (out). */
static void pack_group(const uint8_t *rows, int64_t K, uint8_t *out) {
    int64_t nb = K / QK, row_bytes = nb * Q4_0_BYTES;
#ifdef STREAM_VBMI
    const __m512i gather = _mm512_load_si512(to_chunk);
#endif
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        int n = run_blocks(b0, nb);
        uint8_t *run = out + b0 * 4 * Q4_0_BYTES;
        for (int r = 0; r < 4; r++) {
            const uint8_t *src = rows + r * row_bytes + b0 * Q4_0_BYTES;
            for (int i = 0; i < n; i++) memcpy(run + 2 * n * r + 2 * i, src + i * Q4_0_BYTES, 2);
            for (int p = 0; p < n / 4; p++) {
                const uint8_t *blk = src + 4 * p * Q4_0_BYTES;
                uint8_t *chunk = run + 8 * n + 256 * p + 64 * r;
#ifdef STREAM_VBMI
                _mm512_storeu_si512(chunk, _mm512_permutex2var_epi8(_mm512_loadu_si512(blk),
                                                                    gather,
                                                                    _mm512_loadu_si512(blk + 8)));
#else
                for (int j = 0; j < 4; j++) memcpy(chunk + 16 * j, blk + j * Q4_0_BYTES + 2, 16);
#endif
            }
        }
    }
}

/* The inverse of pack_group: one group of the stream (g) as four rows of the file's layout. */
static void unpack_q4_0s(const uint8_t *g, int64_t K, uint8_t *rows) {
    int64_t nb = K / QK, row_bytes = nb * Q4_0_BYTES;
#ifdef STREAM_VBMI
#endif
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        int n = run_blocks(b0, nb);
        const uint8_t *run = g + b0 * 4 * Q4_0_BYTES;
        for (int r = 0; r < 4; r++) {
            uint8_t *dst = rows + r * row_bytes + b0 * Q4_0_BYTES;
#ifdef STREAM_VBMI
            __m512i scales = _mm512_maskz_loadu_epi8((__mmask64)((1ull << (2 * n)) - 1),
                                                     run + 2 * n * r);
            for (int p = 0; p < n / 4; p++) {
                const uint8_t *chunk = run + 8 * n + 256 * p + 64 * r;
                uint8_t *blk = dst + 4 * p * Q4_0_BYTES;
                __m512i v = _mm512_loadu_si512(chunk);
                __m512i to_file = _mm512_load_si512(to_blocks[p]);
                _mm512_storeu_si512(blk, _mm512_permutex2var_epi8(v, to_file, scales));
                memcpy(blk + 64, chunk + 56, 8); /* block 3's last 8 nibble bytes */
            }
#else
            for (int i = 0; i < n; i++) {
                memcpy(dst + i * Q4_0_BYTES, run + 2 * n * r + 2 * i, 2);
                const uint8_t *nibbles = run + 8 * n + 256 * (i / 4) + 64 * r + 16 * (i % 4);
                memcpy(dst + i * Q4_0_BYTES + 2, nibbles, 16);
            }
#endif
        }
    }
}

/* W [N, K] Q4_0 in the file's layout as the stream layout at out (the same size); N and K
 * as q4_0s_fits requires. */
void repack_q4_0s(const uint8_t *W, int64_t N, int64_t K, uint8_t *out) {
    int64_t group_bytes = 4 * (K / QK) * Q4_0_BYTES;
#pragma omp parallel for schedule(static) if (N * K >= (1 << 20))
    for (int64_t g = 0; g < N / 4; g++) pack_group(W + g * group_bytes, K, out + g * group_bytes);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* Outputs y[0 .. 4) of one group of the stream (g) for one activation row split into bytes
 * (split_q16's SPLIT_Q4 at xb), with its scales xd and sums xs: rows_q4_wide's arithmetic. */
static void rows_q4_0s(const uint8_t *g, int64_t K, const uint8_t *xb, const float *xd,
                       const float *xs, float *y) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    const uint8_t *xl = xb, *xh = xb + K;
    __m512 acc[4], off[4];
    for (int r = 0; r < 4; r++) acc[r] = off[r] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < K / QK; b0 += 16) {
        int n = run_blocks(b0, K / QK);
        const uint8_t *run = g + b0 * 4 * Q4_0_BYTES;
        __mmask16 lanes = (__mmask16)((1u << n) - 1);
        __m512 scale[4];
        for (int r = 0; r < 4; r++) {
            __m512 d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, run + 2 * n * r));
            off[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(-8.0f)),
                                     _mm512_maskz_loadu_ps(lanes, xs + b0), off[r]);
            scale[r] = _mm512_mul_ps(d, _mm512_maskz_loadu_ps(lanes, xd + b0));
        }
        __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        for (int p = 0; p < n / 4; p++, pick = _mm512_add_epi32(pick, _mm512_set1_epi32(4))) {
            int64_t e = (b0 + 4 * p) * QK;
            const uint8_t *chunk = run + 8 * n + 256 * p;
            __m512i l0 = _mm512_loadu_si512(xl + e), l1 = _mm512_loadu_si512(xl + e + 64);
            __m512i h0 = _mm512_loadu_si512(xh + e), h1 = _mm512_loadu_si512(xh + e + 64);
            for (int r = 0; r < 4; r++) {
                _mm_prefetch((const char *)(chunk + 64 * r + WIDE_PREFETCH), ROW_PREFETCH_HINT);
                __m512i v = _mm512_loadu_si512(chunk + 64 * r);
                __m512i q0 = _mm512_and_si512(v, low);
                __m512i q1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                __m512i s = DPBUSD(DPBUSD(_mm512_setzero_si512(), q0, h0), q1, h1);
                s = DPBUSD(DPBUSD(_mm512_slli_epi32(s, 8), l0, q0), l1, q1);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s),
                                         _mm512_permutexvar_ps(pick, scale[r]), acc[r]);
            }
        }
    }
    for (int r = 0; r < 4; r++) y[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], off[r]));
}
#endif

#if defined(__AVX2__) && !(defined(__AVX512F__) && defined(__AVX512BW__))
/* The fp16 scales of a half run (m blocks, 8 or 4) at h, in run order (q4_run_scales'). */
static inline __m128i half_scales(const uint8_t *h, int m) {
    const __m128i order = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const __m128i order4 = _mm_setr_epi8(0, 1, 4, 5, -1, -1, -1, -1, 2, 3, 6, 7, -1, -1, -1, -1);
    if (m == 8) return _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)h), order);
    return _mm_shuffle_epi8(_mm_loadl_epi64((const __m128i *)h), order4);
}

/* Outputs y[0 .. 4) of one group of the stream (g) for one activation row in pair order
 * (pair_q16 at xp), with its scales xd and sums xs: row_q4_pairs' arithmetic, run by run of 8
 * blocks (half a run of the layout), each of the four rows' 32-byte pairs one aligned load. */
static void rows_q4_0s(const uint8_t *g, int64_t K, const uint8_t *xb, const float *xd,
                       const float *xs, float *y) {
    const int16_t *xp = (const int16_t *)xb;
    __m256 acc[4], off[4];
    for (int r = 0; r < 4; r++) acc[r] = off[r] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < K / QK; b0 += 16) {
        int n = run_blocks(b0, K / QK);
        const uint8_t *run = g + b0 * 4 * Q4_0_BYTES;
        for (int h = 0; 8 * h < n; h++) {
            int m = n - 8 * h < 8 ? 4 : 8;
            int64_t b = b0 + 8 * h;
            const uint8_t *chunk = run + 8 * n + 512 * h;
            for (int r = 0; r < 4; r++) {
                __m256i s[4];
                for (int p = 0; p < 4; p++) {
                    const uint8_t *pair = chunk + 256 * (p / 2) + 64 * r + 32 * (p % 2);
                    if (p % 2 == 0) {
                        _mm_prefetch((const char *)(pair + WIDE_PREFETCH), ROW_PREFETCH_HINT);
                    }
                    s[p] = 2 * p < m ? q4_pair_sums(_mm256_loadu_si256((const __m256i *)pair),
                                                    xp + (b + 2 * p) * QK)
                                     : _mm256_setzero_si256();
                }
                q4_run_add(hadd4_epi32(s[0], s[1], s[2], s[3]),
                           half_scales(run + 2 * n * r + 16 * h, m), _mm_setzero_si128(),
                           FMT_Q4_0, xd + b, xs + b, m, &acc[r], &off[r]);
            }
        }
    }
    for (int r = 0; r < 4; r++) y[r] = hsum(acc[r]) + -8.0f * hsum(off[r]);
}
#endif

/* Which product stream_chunks runs over each unpacked chunk, with its arguments. */
enum { CHUNK_Q16, CHUNK_Q16_BATCH, CHUNK_Q8, CHUNK_BF16, CHUNK_AMX, CHUNK_AMX_LARGE };
typedef struct {
    int kind;
    int64_t K, M, ldy;
    const void *x;
    const float *xd, *xs;
    float *y;
    uint16_t *y16;
    const uint32_t *xv; /* CHUNK_AMX: the activations packed for the tiles */
} StreamProduct;

/* The product a->kind of rows [n0, n0 + count) of the weight, unpacked at rows. Called inside
 * stream_chunks' parallel loop: the product's own parallel region runs on this thread. */
static void chunk_product(const StreamProduct *a, const uint8_t *rows, int64_t n0,
                          int64_t count) {
    int64_t K = a->K, M = a->M;
    switch (a->kind) {
    case CHUNK_Q16:
        gemm_quant16(rows, FMT_Q4_0, count, K, a->x, a->xd, a->xs, M, a->y + n0, a->ldy);
        break;
    case CHUNK_Q16_BATCH:
        gemm_quant16_batch(rows, FMT_Q4_0, count, K, a->x, a->xd, a->xs, M, a->y + n0, a->ldy);
        break;
    case CHUNK_Q8:
        gemm_quant(rows, FMT_Q4_0, count, K, a->x, a->xd, a->xs, M, a->y + n0, a->ldy);
        break;
    case CHUNK_BF16:
        gemm_bf16_batch(rows, FMT_Q4_0, count, K, a->x, M, a->y + n0, a->ldy);
        break;
    case CHUNK_AMX: /* the activations packed once for every chunk (a->xv) */
        amx_rows_range(rows, FMT_Q4_0, K, a->xv, M, 0, count, a->y + n0, a->ldy);
        break;
    default:
        gemm_bf16_amx_large(rows, FMT_Q4_0, count, K, a->x, M, a->y16 + n0, a->ldy);
    }
}

/* The product a of a stream-layout weight W [N, K]: its rows in chunks (64 rows; 256 for the
 * AMX products), each unpacked into its thread's buffer and multiplied there by the file
 * layout's kernel. */
static void stream_chunks(const uint8_t *W, int64_t N, const StreamProduct *a) {
    int64_t row_bytes = a->K / QK * Q4_0_BYTES;
    int64_t chunk = a->kind == CHUNK_AMX || a->kind == CHUNK_AMX_LARGE ? 256 : 64;
    int64_t chunks = (N + chunk - 1) / chunk;
#pragma omp parallel
    {
        uint8_t *rows = malloc((size_t)(chunk * row_bytes));
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            int64_t n0 = c * chunk, count = N - n0 < chunk ? N - n0 : chunk;
            for (int64_t g = 0; rows && g < count / 4; g++) {
                unpack_q4_0s(W + (n0 + 4 * g) * row_bytes, a->K, rows + 4 * g * row_bytes);
            }
            if (rows) {
                chunk_product(a, rows, n0, count);
            } else { /* no memory: NaN, not wrong numbers */
                for (int64_t m = 0; m < a->M; m++) {
                    for (int64_t n = n0; n < n0 + count; n++) {
                        if (a->kind == CHUNK_AMX_LARGE) a->y16[m * a->ldy + n] = 0x7fc0;
                        else a->y[m * a->ldy + n] = NAN;
                    }
                }
            }
        }
        free(rows);
    }
}

/* gemm_quant16_batch of a stream-layout weight: up to PAIR_ROWS rows by rows_q4_0s, more by
 * chunks. */
static void stream_q16_batch(const uint8_t *W, int64_t N, int64_t K, const int16_t *xq,
                             const float *xd, const float *xs, int64_t M, float *y,
                             int64_t ldy) {
#ifdef __AVX2__
    uint8_t *xb = M <= PAIR_ROWS ? split_rows(xq, M, K, FMT_Q4_0) : NULL;
    if (xb) {
        int64_t nb = K / QK, group_bytes = 4 * nb * Q4_0_BYTES;
#pragma omp parallel for schedule(static) if (N * K >= (1 << 17))
        for (int64_t g = 0; g < N / 4; g++) {
            for (int64_t m = 0; m < M; m++) {
                rows_q4_0s(W + g * group_bytes, K, xb + 2 * K * m, xd + m * nb, xs + m * nb,
                           y + m * ldy + 4 * g);
            }
        }
        free(xb);
        return;
    }
#endif
    StreamProduct a = {CHUNK_Q16_BATCH, K, M, ldy, xq, xd, xs, y, NULL, NULL};
    stream_chunks(W, N, &a);
}

/* dequantize / dequantize_bf16 of a stream-layout weight (out or out16): each row from its
 * group, unpacked once for the rows of the group that follow it. */
static void stream_expand(const uint8_t *W, int64_t K, const int64_t *rows, int64_t first,
                          int64_t n, float *out, uint16_t *out16) {
    int64_t row_bytes = K / QK * Q4_0_BYTES;
#pragma omp parallel if (n * K >= (1 << 16))
    {
        uint8_t *group = malloc((size_t)(4 * row_bytes));
        int64_t held = -1;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            int64_t r = rows ? rows[i] : first + i;
            if (group && r / 4 != held) {
                unpack_q4_0s(W + r / 4 * 4 * row_bytes, K, group);
                held = r / 4;
            }
            const uint8_t *w = group ? group + r % 4 * row_bytes : NULL;
            for (int64_t b = 0, at = i * K; b < K / QK; b++, at += QK) {
                if (out16 && w) dequant_block_bf16(w + b * Q4_0_BYTES, FMT_Q4_0, out16 + at);
                else if (w) dequant_block(w + b * Q4_0_BYTES, FMT_Q4_0, out + at);
                for (int j = 0; !w && j < QK; j++) { /* no memory: NaN */
                    if (out16) out16[at + j] = 0x7fc0;
                    else out[at + j] = NAN;
                }
            }
        }
        free(group);
    }
}
