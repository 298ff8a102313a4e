/*
 * The fused decode forward pass: every decoder layer of a Llama-family or Gemma 3 model for a
 * batch of sequences that each add one token, in one call, over the paged KV cache (its KV
 * cache groups and sliding windows included).
 *
 * The eager path runs about 40 torch operations per layer (norms, rotary, cache writes, a
 * gather of the context's blocks, attention, residual adds), each a few to a few hundred
 * microseconds; here they are loops over a few kilobytes, and attention reads the keys and
 * values where they lie in the cache instead of gathering them first. The products go through
 * the packed-weight kernels of quant.c (included below), with activations rounded to 16 bits
 * per block of 32 as QuantLinear does.
 *
 * Per layer, for B rows x (the hidden states, updated in place):
 *   h = rmsnorm(x) * input_norm;  qkv = h Wqkv^T (+ b);  rotate q and k (rotate-half layout)
 *   write k, v at each row's slot;  a = softmax(q k^T / sqrt(D)) v over the row's context
 *   x += a Wo^T (+ b);  h = rmsnorm(x) * post_norm;  gu = h Wgu^T (+ b)
 *   x += (silu(gate) * up) Wdown^T (+ b)
 * Qwen3 and Gemma 3 normalise each head of q and k before rotating them; Gemma 3 also scales
 * q, rotates its sliding layers with another base, takes GELU for SiLU and normalises the
 * outputs of Wo and Wdown before adding them to x (the DecodeLayer and DecodeModel fields
 * marked "Gemma 3"). A layer of a sliding-window KV cache group attends its last `window`
 * positions only.
 * The result is x before the final norm, as CausalLM.forward returns it. Float32 activations;
 * prefixserve.model.attention.fused_decode decides when this path applies.
 *
 * Threads: the whole pass is one OpenMP parallel region. The products and attention are
 * shared out among its threads (orphaned `omp for` loops), the row-wise steps between them
 * run on one thread (`omp single`); each ends in a barrier, which costs less than forking
 * and joining a team for each product did.
 *
 * Built and loaded like quant.c (prefixserve.model.weights.quant_kernels.load_library); the build key
 * covers both files.
 */
#include <stdlib.h>

#include "quant.c"

#ifdef _OPENMP
#include <omp.h>
#endif

/* One decoder layer: norm weights, packed projections (format codes of quant.c) with optional
 * float32 biases, and the layer's cache [2, num_slots, kv_heads, head_dim]. */
typedef struct {
    const float *input_norm;
    const float *post_norm;
    const uint8_t *qkv;
    const uint8_t *o;
    const uint8_t *gate_up;
    const uint8_t *down;
    int64_t qkv_fmt, o_fmt, gate_up_fmt, down_fmt;
    const float *qkv_bias;
    const float *o_bias;
    const float *gate_up_bias;
    const float *down_bias;
    void *kv;
    /* Gemma 3 (NULL and 0 for a Llama-family layer): per-head RMSNorm weights [head_dim] of the
     * queries and keys (before rotary), the norms of the attention block's and of the MLP's
     * output (before each residual add), the layer's KV cache group (the DecodeBatch and the
     * window it attends through) and whether it rotates with inv_freq_local. */
    const float *q_norm;
    const float *k_norm;
    const float *attn_out_norm;
    const float *mlp_out_norm;
    int64_t group;
    int64_t local_rope;
    /* A fused projection whose parts are packed in different formats (a Q4_K_M file's Q6_K V
     * beside its Q4_K Q and K): qkv (gate_up) above is its first part, of qkv_rows[0]
     * (gate_up_rows[0]) rows, and up to two more parts follow here; qkv_rows[1] == 0 (one
     * format: the fields above alone). */
    int64_t qkv_rows[3], gate_up_rows[3];
    const uint8_t *qkv_more[2];
    const uint8_t *gate_up_more[2];
    int64_t qkv_more_fmt[2], gate_up_more_fmt[2];
    /* LoRA adapters of the four products, in the order qkv, o, gate_up, down (lora_a[p] NULL:
     * none on that product): A [slots, lora_rows[p], in] and B^T [slots, lora_rows[p], out]
     * in float32, and lora_used[p][s] the rows of them that slot s fills (0: its adapter
     * leaves the product alone). A row of the step runs under DecodeBatch.lora_slots. */
    const float *lora_a[4];
    const float *lora_bt[4];
    const int64_t *lora_used[4];
    int64_t lora_rows[4];
} DecodeLayer;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate;
    int64_t block_size, num_slots, kv_type; /* KV_F32, KV_BF16 or KV_F16 */
    int64_t bf16_products; /* a bfloat16 model: its batch products may take bfloat16 rows */
    int64_t bf16_queries;  /* a bfloat16 model: a bfloat16 cache is attended in bfloat16 */
    double eps;
    const float *inv_freq; /* [head_dim / 2] rotary inverse frequencies */
    const DecodeLayer *layers;
    /* Gemma 3 (0 and NULL for a Llama-family model, num_groups 0 or 1): */
    int64_t gelu;                /* the MLP's gate: 0 SiLU, 1 GELU (tanh approximation) */
    double query_factor;         /* queries scaled by this after rotary (0: not scaled) */
    const float *inv_freq_local; /* rotary of the layers with local_rope */
    int64_t num_groups;          /* KV cache groups: decode_forward takes a batch of each */
    const int64_t *windows;      /* [num_groups]: each group's sliding window, 0 for none */
    int64_t lora_max_rows;       /* the largest DecodeLayer.lora_rows (0: no adapters) */
    int64_t amx_from; /* rows from which a step multiplies on AMX tiles (amx_rows() or
                       * amx_q4_0_rows(): its products' QuantLinear.amx_from; 0: never) */
} DecodeModel;

/* The step's rows: row b is at position pos[b] (its context is pos[b] + 1 tokens) and its
 * block table is tables[rows[b] * table_stride ...]. A model of several KV cache groups has a
 * batch of each, the same rows and positions, each with its group's tables. */
typedef struct {
    int64_t B;
    const int64_t *pos;
    const int64_t *tables;
    const int64_t *rows;
    int64_t table_stride;
    const int64_t *lora_slots; /* [B]: each row's adapter slot, -1 for none (NULL: no row has one) */
} DecodeBatch;

/* exp of 8 floats: n = round(x log2 e), r = x - n ln 2 (two-part ln 2), a degree-6 polynomial
 * of r, scaled by 2^n through the exponent bits. Relative error ~2e-7 on [-87, 88]; inputs
 * below -87 give 0. */
#ifdef __AVX2__
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f), hi = _mm256_set1_ps(88.0f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
                                  23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

/* y[i] = exp(x[i]) for n floats, in place. */
/* x[i] = exp(x[i] - max x) for i < n; returns the max and sets *total to the sum. */
static float softmax_weights(float *x, int64_t n, float *total) {
    int64_t i = 0;
    float top = -INFINITY, sum = 0.0f;
#ifdef __AVX2__
    __m256 t8 = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= n; i += 8) t8 = _mm256_max_ps(t8, _mm256_loadu_ps(x + i));
    __m128 t4 = _mm_max_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
    t4 = _mm_max_ps(t4, _mm_movehl_ps(t4, t4));
    t4 = _mm_max_ss(t4, _mm_shuffle_ps(t4, t4, 1));
    top = _mm_cvtss_f32(t4);
#endif
    for (; i < n; i++) top = x[i] > top ? x[i] : top;
    i = 0;
#ifdef __AVX2__
    __m256 s8 = _mm256_setzero_ps(), shift = _mm256_set1_ps(top);
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), shift));
        _mm256_storeu_ps(x + i, e);
        s8 = _mm256_add_ps(s8, e);
    }
    sum = hsum(s8);
#endif
    for (; i < n; i++) {
        x[i] = expf(x[i] - top);
        sum += x[i];
    }
    *total = sum;
    return top;
}

static float dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float total = 0.0f;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    total = hsum(acc);
#endif
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

static void rmsnorm(const float *x, const float *w, int64_t B, int64_t H, float eps, float *out) {
    for (int64_t b = 0; b < B; b++) {
        const float *row = x + b * H;
        float scale = 1.0f / sqrtf(dot(row, row, H) / (float)H + eps);
        for (int64_t i = 0; i < H; i++) out[b * H + i] = row[i] * scale * w[i];
    }
}

/* Scratch of one product: 16-bit activations, their block scales and sums, and for 8 rows or
 * more the scales and sums regrouped 8 rows at a time (dT, sT: tile8_q16's layout). */
typedef struct {
    int16_t *xq; /* 16-bit integers per block, or bfloat16 bits when bf16 is set */
    float *xd, *xs, *dT, *sT;
    uint32_t *xv; /* bfloat16 rows in the AMX tiles' layout (amx_pack_units), when amx is set */
    uint8_t *xb;  /* the activations of a step of up to Q4_SPLIT_ROWS rows split or
                     reordered: row b's split_q4's at 2 K b, its split_k's (K a multiple of
                     256) at k_split(q, K, b) */
    int bf16, amx;
    int need_q4, need_k;   /* whether the model has Q4_0/Q4_1 (AVX2 builds), K-quant products */
    int split_q4, split_k; /* whether xb holds those splits of the last rounded rows (split_q4:
                              of every 16-bit rounding of the step, set once per step) */
    int32_t *pairs; /* a step of PANEL_TEAM_FROM rows or more where the build has the panel
                       kernel: its 16-bit rows paired for it (pair_blocks); else NULL */
} Quantized;

/* Where row b's split_k bytes lie in q->xb, after Q4_SPLIT_ROWS rows of split_q4's. */
static inline uint8_t *k_split(const Quantized *q, int64_t K, int64_t b) {
    return q->xb + 2 * K * Q4_SPLIT_ROWS + b * SPLIT_K_BYTES(K);
}

/* Whether a step of B rows rounds its products' rows to bfloat16 (gemm_bf16_batch or the AMX
 * kernel): a bfloat16 model's batch of bf16_batch_rows() or DecodeModel.amx_from or more where
 * the build has that kernel; else they are rounded to 16 bits per block of 32. */
static int bf16_rows(const DecodeModel *m, int64_t B) {
    int64_t from = bf16_batch_rows(), tiles = amx_rows() > 0 ? m->amx_from : 0;
    return m->bf16_products && ((from > 0 && B >= from) || (tiles > 0 && B >= tiles));
}

/* Whether a step of B bfloat16 rows (bf16_rows) multiplies on AMX tiles: where the library
 * has the AMX kernel, from DecodeModel.amx_from rows. */
static int amx_step(const DecodeModel *m, int bf16, int64_t B) {
    return bf16 && amx_rows() > 0 && m->amx_from > 0 && B >= m->amx_from;
}

/* Rounds rows [b0, b0 + n) of x [B, K] for a product as q->bf16 says. The rows of 16-bit
 * products are rounded in units of 8 (b0 a multiple of 8), each full unit's scales regrouped
 * for tile8_q16 (regroup8); bfloat16 rows one by one (with q->amx, team_linear then packs
 * them for the tiles). */
static void quantize_rows(const float *x, int64_t b0, int64_t n, int64_t K, Quantized *q) {
    if (q->bf16) {
        round_rows_bf16(x + b0 * K, n * K, (uint16_t *)q->xq + b0 * K);
        return;
    }
    int64_t nb = K / QK;
    quantize_q16(x + b0 * K, n, K, q->xq + b0 * K, q->xd + b0 * nb, q->xs + b0 * nb);
#ifdef HAVE_PANEL
    if (q->pairs) { /* every product of the step takes the panels: no regrouping, no splits */
        pair_blocks(q->xq, b0 * nb, (b0 + n) * nb, q->pairs);
        q->split_k = 0;
        return;
    }
#endif
    if (n == 8) regroup8(q->xd + b0 * nb, q->xs + b0 * nb, 8, nb, q->dT + b0 * nb, q->sT + b0 * nb);
    /* the 4-bit one-row kernels take each unit's rows split where the step asked for it
     * (split_q4, scratch_alloc); the K-quant ones (kq_rows_few) every unit's, where they take
     * steps of any size (KQ_FEW_ROWS), else a step of up to FEW_ROWS (one unit: b0 is 0) */
    q->split_k = (KQ_FEW_ROWS > FEW_ROWS || (b0 == 0 && n <= FEW_ROWS)) && q->need_k
                 && K % QK_K == 0;
#ifdef __AVX2__
    for (int64_t b = 0; b < n && (q->split_q4 || q->split_k); b++) {
        if (q->split_q4) split_q4(q->xq + (b0 + b) * K, K, q->xb + 2 * K * (b0 + b));
        if (q->split_k) split_k(q->xq + (b0 + b) * K, K, k_split(q, K, b0 + b));
    }
#endif
}

/* The AMX product of team_stream, shared out as amx_team_product does: the activations packed
 * by all threads, then this thread's run of 16-row groups, each unpacked into rows (NULL: no
 * memory, NaN out), with their biases. Every thread of the team calls it. */
static void team_stream_amx(const uint8_t *W, int64_t N, int64_t K, const float *bias,
                            const Quantized *q, int64_t B, uint8_t *rows, float *y,
                            int64_t ldy) {
    int64_t row_bytes = K / QK * Q4_0_BYTES;
#pragma omp for schedule(static)
    for (int64_t u = 0; u < amx_units(B, K); u++) {
        amx_pack_units((const uint16_t *)q->xq, B, K, u, u + 1, q->xv);
    }
    int T = omp_get_num_threads(), t = omp_get_thread_num();
    int64_t groups = (N + 15) / 16, n0 = groups * t / T * 16;
    int64_t n1 = groups * (t + 1) / T * 16 < N ? groups * (t + 1) / T * 16 : N;
    for (int64_t n = n0; n < n1; n += 16) {
        int64_t count = n1 - n < 16 ? n1 - n : 16;
        for (int64_t g = 0; rows && g < count / 4; g++) {
            unpack_q4_0s(W + (n + 4 * g) * row_bytes, K, rows + 4 * g * row_bytes);
        }
        if (rows) amx_rows_range(rows, FMT_Q4_0, K, q->xv, B, 0, count, y + n, ldy);
        for (int64_t b = 0; b < B; b++) {
            for (int64_t r = n; r < n + count; r++) {
                y[b * ldy + r] = rows ? y[b * ldy + r] + (bias ? bias[r] : 0.0f) : NAN;
            }
        }
    }
}

#ifdef HAVE_PANEL
/* team_linear of a step of PANEL_TEAM_FROM 16-bit rows or more: gemm_panel's products (the
 * eager step's, bit for bit), each panel of 16 outputs by one thread, from the rows paired as
 * they were rounded (q->pairs; the rows past B up to a multiple of PANEL_M are read but not
 * stored). NaN out where a thread's buffers could not be had. */
static void team_panel(const uint8_t *W, int fmt, int64_t N, int64_t K, const float *bias,
                       const Quantized *q, int64_t B, float *y, int64_t ldy) {
    int64_t nb = K / QK, Mp = (B + PANEL_M - 1) / PANEL_M * PANEL_M;
    int64_t row_bytes = fmt == FMT_Q4_0S ? nb * Q4_0_BYTES : fmt_row_bytes(fmt, K);
    PanelBuffers p;
    int mine = panel_buffers(fmt, nb, row_bytes, &p);
#pragma omp for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += PANEL_N) {
        int64_t end = n0 + PANEL_N < N ? n0 + PANEL_N : N;
        if (mine) panel_outputs(W, fmt, N, K, n0, &p, q->pairs, Mp, B, q->xd, q->xs, y, ldy);
        for (int64_t b = 0; b < B; b++) {
            for (int64_t n = n0; n < end; n++) {
                y[b * ldy + n] = mine ? y[b * ldy + n] + (bias ? bias[n] : 0.0f) : NAN;
            }
        }
    }
    panel_buffers_free(&p); /* after the loop's barrier */
}
#endif

/* team_linear of a stream-layout Q4_0 weight (stream.c), with the file layout's results
 * exactly: up to PAIR_ROWS 16-bit rows by rows_q4_0s, one after another over each group; more
 * rows by the kernel team_linear would take, over rows unpacked into each thread's buffer (16
 * rows: an AMX tile's; NULL: no memory, NaN out). */
static void team_stream(const uint8_t *W, int64_t N, int64_t K, const float *bias,
                        const Quantized *q, int64_t B, float *y, int64_t ldy) {
    int64_t row_bytes = K / QK * Q4_0_BYTES;
#ifdef __AVX2__
    if (!q->bf16 && B <= PAIR_ROWS && q->split_q4) {
        int64_t nb = K / QK;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < N / 4; g++) {
            for (int64_t b = 0; b < B; b++) {
                float *out = y + b * ldy + 4 * g;
                rows_q4_0s(W + 4 * g * row_bytes, K, q->xb + 2 * K * b, q->xd + b * nb,
                           q->xs + b * nb, out);
                for (int r = 0; bias && r < 4; r++) out[r] += bias[4 * g + r];
            }
        }
        return;
    }
#endif
    uint8_t *rows = malloc((size_t)(16 * row_bytes)); /* each thread's own */
    if (q->amx) {
        team_stream_amx(W, N, K, bias, q, B, rows, y, ldy);
#pragma omp barrier
        free(rows);
        return;
    }
#pragma omp for schedule(static)
    for (int64_t g = 0; g < N / 4; g++) {
        float *out = y + 4 * g;
        if (rows) unpack_q4_0s(W + 4 * g * row_bytes, K, rows);
        if (rows && q->bf16) {
            bf16_rows_range(rows, FMT_Q4_0, K, (const uint16_t *)q->xq, B, 0, 4, out, ldy);
        } else if (rows) {
            for (int r = 0; r < 4; r++) {
                batch_row_q16(rows + r * row_bytes, FMT_Q4_0, K, q->xq, q->xd, q->xs, q->dT,
                              q->sT, B, out + r, ldy);
            }
        }
        for (int64_t b = 0; b < B; b++) {
            for (int r = 0; r < 4; r++) {
                out[b * ldy + r] = rows ? out[b * ldy + r] + (bias ? bias[4 * g + r] : 0.0f)
                                        : NAN;
            }
        }
    }
    free(rows); /* after the loop's barrier */
}

/* y [B, N] (row stride ldy) = x [B, K] W^T (+ bias), W packed in format fmt, x as
 * quantize_rows left it: the output rows shared out among the threads of the enclosing
 * parallel region, every one of which must call it (an orphaned `omp for`, a barrier at its
 * end). Each output is what gemm_bf16_batch (q->bf16), gemm_panel (a step of
 * PANEL_TEAM_FROM 16-bit rows or more, where the build has it) or gemm_quant16_batch computes. */
static void team_linear(const uint8_t *W, int64_t fmt, int64_t N, int64_t K, const float *bias,
                        const Quantized *q, int64_t B, float *y, int64_t ldy) {
#ifdef HAVE_PANEL
    if (!q->bf16 && q->pairs) {
        team_panel(W, (int)fmt, N, K, bias, q, B, y, ldy);
        return;
    }
#endif
    if (fmt == FMT_Q4_0S) {
        team_stream(W, N, K, bias, q, B, y, ldy);
        return;
    }
    int64_t nb = K / QK, row_bytes = nb * block_bytes((int)fmt);
    if (is_kquant((int)fmt)) { /* 16-bit rows only (FusedDecode turns bfloat16 products off) */
        /* each row the product of that row alone (kq_rows_few), else kq_rows */
        int few = B <= FEW_ROWS || (B <= KQ_FEW_ROWS && q->split_k);
        float *xf = few ? NULL : kq_float_rows(q->xq, q->xd, B, K); /* each thread's own */
        const uint8_t *xb = q->split_k ? k_split(q, K, 0) : NULL;
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n += 4) {
            int64_t end = n + 4 < N ? n + 4 : N;
            if (few) kq_rows_few(W, (int)fmt, K, n, end, q->xq, xb, q->xd, q->xs, B, y, ldy);
            else kq_rows_any(W, (int)fmt, K, n, end, q->xq, q->xd, xf, B, y, ldy);
            for (int64_t r = n; bias && r < end; r++) {
                for (int64_t b = 0; b < B; b++) y[b * ldy + r] += bias[r];
            }
        }
        free(xf); /* after the loop's barrier */
        return;
    }
#ifdef __AVX2__
    if (!q->bf16 && B <= one_row_limit((int)fmt, row_bytes, nb) && rows_fast_fits(N)) {
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n += ROWS) {
            for (int64_t b = 0; b < B; b++) {
                float *out = y + b * ldy;
                rows_fast(W, (int)fmt, row_bytes, n, q->xq + b * K,
                          q->split_q4 ? q->xb + 2 * K * b : NULL, q->xd + b * nb, q->xs + b * nb,
                          nb, out);
                for (int r = 0; bias && r < ROWS; r++) out[n + r] += bias[n + r];
            }
        }
        return;
    }
#endif
    if (q->amx) {
        int64_t n0, n1; /* this thread's weight rows */
        amx_team_product(W, (int)fmt, N, K, (const uint16_t *)q->xq, B, q->xv, y, ldy, &n0,
                         &n1);
        for (int64_t n = n0; bias && n < n1; n++) {
            for (int64_t b = 0; b < B; b++) y[b * ldy + n] += bias[n];
        }
#pragma omp barrier
        return;
    }
    if (q->bf16) {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < (N + 1) / 2; i++) {
            int64_t n0 = 2 * i, n1 = n0 + 2 < N ? n0 + 2 : N;
            bf16_rows_range(W, (int)fmt, K, (const uint16_t *)q->xq, B, n0, n1, y, ldy);
            for (int64_t n = n0; bias && n < n1; n++) {
                for (int64_t b = 0; b < B; b++) y[b * ldy + n] += bias[n];
            }
        }
        return;
    }
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        batch_row_q16(W + n * row_bytes, (int)fmt, K, q->xq, q->xd, q->xs, q->dT, q->sT, B,
                      y + n, ldy);
        for (int64_t b = 0; bias && b < B; b++) y[b * ldy + n] += bias[n];
    }
}

/* y [B, N] = x [B, K] W^T (+ bias) for a fused projection: its first part W (format fmt) and,
 * where rows[1] > 0, up to two more parts (more, more_fmt) of rows[j] rows each, every part a
 * team_linear of its own into its columns of y. */
static void team_parts(const uint8_t *W, int64_t fmt, const int64_t *rows,
                       const uint8_t *const *more, const int64_t *more_fmt, int64_t N, int64_t K,
                       const float *bias, const Quantized *q, int64_t B, float *y) {
    if (rows[1] == 0) {
        team_linear(W, fmt, N, K, bias, q, B, y, N);
        return;
    }
    int64_t first = 0;
    for (int j = 0; j < 3 && (j == 0 || rows[j] > 0); j++) {
        team_linear(j ? more[j - 1] : W, j ? more_fmt[j - 1] : fmt, rows[j], K,
                    bias ? bias + first : NULL, q, B, y + first, N);
        first += rows[j];
    }
}

/* y [B, N] (row stride N) += each adapter row's LoRA delta, (x[b] A_s^T) B_s^T for the slot s
 * of row b (slots[b] >= 0), x [B, K] the product's input in float32 (not rounded, as the eager
 * LoRALinear takes it); low [B, R] is scratch. Product p of layer L (team_parts' numbering);
 * nothing without adapters. Two shared-out loops, each ending in a barrier: the low-rank
 * values (one dot product per row and rank), then the output columns. */
static void team_lora(const DecodeLayer *L, int p, const int64_t *slots, const float *x,
                      int64_t B, int64_t K, int64_t N, float *low, float *y) {
    const float *A = L->lora_a[p], *Bt = L->lora_bt[p];
    const int64_t *used = L->lora_used[p];
    int64_t R = L->lora_rows[p];
    if (!A || !slots) return;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < B * R; i++) {
        int64_t b = i / R, r = i % R, s = slots[b];
        low[i] = s >= 0 && r < used[s] ? dot(A + (s * R + r) * K, x + b * K, K) : 0.0f;
    }
#pragma omp for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += 64) {
        int64_t n1 = n0 + 64 < N ? n0 + 64 : N;
        for (int64_t b = 0; b < B; b++) {
            int64_t s = slots[b];
            for (int64_t r = 0; s >= 0 && r < used[s]; r++) {
                float l = low[b * R + r];
                const float *bt = Bt + (s * R + r) * N;
                float *out = y + b * N;
                for (int64_t n = n0; n < n1; n++) out[n] += l * bt[n];
            }
        }
    }
}

/* Rotate heads [n_heads, D] of one row by the position's angles (cos_, sin_: [D / 2]). */
static void rotate(float *x, int64_t n_heads, int64_t D, const float *cos_, const float *sin_) {
    int64_t half = D / 2;
    for (int64_t h = 0; h < n_heads; h++) {
        float *v = x + h * D;
        for (int64_t i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = a * cos_[i] + b * -sin_[i];
            v[i + half] = b * cos_[i] + a * sin_[i];
        }
    }
}

/* The cache holds float32, bfloat16 (the upper half of a float32) or IEEE float16, the 16-bit
 * types rounded to nearest even as torch rounds. Offsets below are in elements. */
enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };
static inline int64_t cache_offset(const DecodeModel *m, int64_t which, int64_t slot,
                                   int64_t kv_head) {
    return ((which * m->num_slots + slot) * m->kv_heads + kv_head) * m->head_dim;
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float f16_to_float(uint16_t h) {
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}

static inline uint16_t float_to_f16(float f) {
    _Float16 h = (_Float16)f;
    uint16_t bits;
    memcpy(&bits, &h, 2);
    return bits;
}

static inline int64_t slot_of(const DecodeModel *m, const DecodeBatch *s, int64_t b, int64_t p) {
    const int64_t *table = s->tables + s->rows[b] * s->table_stride;
    return table[p / m->block_size] * m->block_size + p % m->block_size;
}

/* Contexts are attended in chunks of this many positions, each chunk a task of its own (or of
 * the group of rows that share it), and the chunks' partial results merged: a single
 * sequence's attention then spreads over the threads too. */
#define CHUNK 256

/* The first position of the next block after t, or t1 if that comes first. */
static inline int64_t run_end(int64_t t, int64_t t1, int64_t bs) {
    int64_t end = (t / bs + 1) * bs;
    return end < t1 ? end : t1;
}

/* Eight cache elements as floats. */
#ifdef __AVX2__
#define LOAD_f32(p) _mm256_loadu_ps(p)
#define LOAD_bf16(p)                                                                           \
    _mm256_castsi256_ps(_mm256_slli_epi32(                                                     \
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#ifdef __F16C__
#define LOAD_f16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#else
static inline __m256 load_f16_soft(const uint16_t *p) {
    float f[8];
    for (int i = 0; i < 8; i++) f[i] = f16_to_float(p[i]);
    return _mm256_loadu_ps(f);
}
#define LOAD_f16(p) load_f16_soft(p)
#endif
#endif
#define SCALAR_f32(x) (x)
#define SCALAR_bf16(x) bf16_to_float(x)
#define SCALAR_f16(x) f16_to_float(x)

/* For cache element type T (f32: float, bf16 and f16: uint16_t) and head size DD (0: any, scalar):
 *   dot_DD_T(q, k, D): q . k;
 *   vacc_DD_T(row, stride, count, p, out): out [D] += sum over i < count of p[i] * row_i, the
 *     values of count consecutive slots stride elements apart, accumulated in registers for
 *     DD 64, 128 and 256;
 *   scores8_DD_T(q, k, stride, scale, out) (DD 64 and 128): out [8] = scale * q . k_i for eight
 *     consecutive keys stride elements apart. */
#define DEFINE_SCALAR(T, C)                                                                    \
    static float dot_0_##T(const float *a, const C *b, int64_t D) {                             \
        float total = 0.0f;                                                                    \
        for (int64_t d = 0; d < D; d++) total += a[d] * SCALAR_##T(b[d]);                      \
        return total;                                                                          \
    }                                                                                          \
    static void vacc_0_##T(const C *row, int64_t stride, int64_t count, const float *p,       \
                           int64_t D, float *out) {                                            \
        for (int64_t t = 0; t < count; t++, row += stride) {                                   \
            for (int64_t d = 0; d < D; d++) out[d] += p[t] * SCALAR_##T(row[d]);               \
        }                                                                                      \
    }
DEFINE_SCALAR(f32, float)
DEFINE_SCALAR(bf16, uint16_t)
DEFINE_SCALAR(f16, uint16_t)

#ifdef __AVX2__
/* vhaddps(a, b) as two shuffles and an add: the same sums of adjacent lanes, in the same
 * order (bit for bit), where vhaddps takes about four times a shuffle's time on AMD Zen 3. */
static inline __m256 hadd_pairs(__m256 a, __m256 b) {
    return _mm256_add_ps(_mm256_shuffle_ps(a, b, 0x88), _mm256_shuffle_ps(a, b, 0xdd));
}

/* The eight horizontal sums of a[0..7], in order, as one vector. */
static inline __m256 sum8(const __m256 *a) {
    __m256 s01 = hadd_pairs(a[0], a[1]), s23 = hadd_pairs(a[2], a[3]);
    __m256 s45 = hadd_pairs(a[4], a[5]), s67 = hadd_pairs(a[6], a[7]);
    __m256 lo = hadd_pairs(s01, s23), hi = hadd_pairs(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20),
                         _mm256_permute2f128_ps(lo, hi, 0x31));
}

#define DEFINE_VECTOR(DD, T, C)                                                                \
    static inline float dot_##DD##_##T(const float *a, const C *b) {                           \
        __m256 x = _mm256_setzero_ps(), y = _mm256_setzero_ps();                               \
        for (int v = 0; v < DD; v += 16) {                                                     \
            x = _mm256_fmadd_ps(_mm256_loadu_ps(a + v), LOAD_##T(b + v), x);                   \
            y = _mm256_fmadd_ps(_mm256_loadu_ps(a + v + 8), LOAD_##T(b + v + 8), y);           \
        }                                                                                      \
        return hsum(_mm256_add_ps(x, y));                                                      \
    }                                                                                          \
    static inline void vacc_##DD##_##T(const C *row, int64_t stride, int64_t count,          \
                                       const float *p, float *out) {                           \
        __m256 acc[DD / 8];                                                                    \
        for (int v = 0; v < DD / 8; v++) acc[v] = _mm256_loadu_ps(out + 8 * v);                \
        for (int64_t t = 0; t < count; t++, row += stride) {                                   \
            __m256 w = _mm256_set1_ps(p[t]);                                                   \
            for (int v = 0; v < DD / 8; v++) {                                                 \
                acc[v] = _mm256_fmadd_ps(w, LOAD_##T(row + 8 * v), acc[v]);                    \
            }                                                                                  \
        }                                                                                      \
        for (int v = 0; v < DD / 8; v++) _mm256_storeu_ps(out + 8 * v, acc[v]);                \
    }                                                                                          \
    static inline void scores8_##DD##_##T(const float *q, const C *k, int64_t stride,          \
                                          float scale, float *out) {                           \
        __m256 a[8];                                                                           \
        for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();                                \
        for (int v = 0; v < DD; v += 8) {                                                      \
            __m256 x = _mm256_loadu_ps(q + v);                                                 \
            for (int i = 0; i < 8; i++) {                                                      \
                a[i] = _mm256_fmadd_ps(x, LOAD_##T(k + i * stride + v), a[i]);                 \
            }                                                                                  \
        }                                                                                      \
        _mm256_storeu_ps(out, _mm256_mul_ps(sum8(a), _mm256_set1_ps(scale)));                  \
    }
DEFINE_VECTOR(64, f32, float)
DEFINE_VECTOR(128, f32, float)
DEFINE_VECTOR(64, bf16, uint16_t)
DEFINE_VECTOR(128, bf16, uint16_t)
DEFINE_VECTOR(64, f16, uint16_t)
DEFINE_VECTOR(128, f16, uint16_t)
DEFINE_VECTOR(256, f32, float)
DEFINE_VECTOR(256, bf16, uint16_t)
DEFINE_VECTOR(256, f16, uint16_t)
#endif

/* widen_T(src, stride, count, D, dst): dst [count, D] = the float values of count slots of
 * D 16-bit elements, stride elements apart. WIDEN_T says whether type T needs it. */
#define WIDEN_f32 0
#define WIDEN_bf16 1
#define WIDEN_f16 1
#ifdef __AVX2__
#define WIDEN_VECTOR(T, src, dst) _mm256_storeu_ps(dst, LOAD_##T(src))
#define WIDEN_STEP 8
#else
#define WIDEN_VECTOR(T, src, dst) (*(dst) = SCALAR_##T(*(src)))
#define WIDEN_STEP 1
#endif
#define DEFINE_WIDEN(T)                                                                        \
    static void widen_##T(const uint16_t *src, int64_t stride, int64_t count, int64_t D,        \
                          float *dst) {                                                        \
        for (int64_t i = 0; i < count; i++, src += stride, dst += D) {                         \
            int64_t d = 0;                                                                     \
            for (; d + WIDEN_STEP <= D; d += WIDEN_STEP) WIDEN_VECTOR(T, src + d, dst + d);    \
            for (; d < D; d++) dst[d] = SCALAR_##T(src[d]);                                    \
        }                                                                                      \
    }
DEFINE_WIDEN(bf16)
DEFINE_WIDEN(f16)
static void widen_f32(const float *src, int64_t stride, int64_t count, int64_t D, float *dst) {
    for (int64_t i = 0; i < count; i++) memcpy(dst + i * D, src + i * stride, (size_t)D * 4);
}

/* Partial attention of the `group` query heads q [group, D] that share KV head g, over
 * positions [t0, t1) of row b: for head r, mx[r] = the largest score, sm[r] = sum of
 * exp(score - mx[r]) and out [r * D ...] = that sum weighted by the values. scores holds
 * group * CHUNK floats. One definition per cache element type. */
#ifdef __AVX2__
#define HEAD_DOT(T, a, b, D)                                                                   \
    ((D) == 64    ? dot_64_##T(a, b)                                                          \
     : (D) == 128 ? dot_128_##T(a, b)                                                         \
     : (D) == 256 ? dot_256_##T(a, b)                                                         \
                  : dot_0_##T(a, b, D))
#define HEAD_VACC(T, row, stride, count, p, D, out)                                           \
    do {                                                                                       \
        if ((D) == 64) vacc_64_##T(row, stride, count, p, out);                                \
        else if ((D) == 128) vacc_128_##T(row, stride, count, p, out);                         \
        else if ((D) == 256) vacc_256_##T(row, stride, count, p, out);                         \
        else vacc_0_##T(row, stride, count, p, D, out);                                        \
    } while (0)
/* Scores of eight consecutive positions (keys stride elements apart) for head sizes 64 and
 * 128; FAST8 says whether the head size has it. */
#define FAST8(D) ((D) == 64 || (D) == 128)
#define HEAD_SCORES8(T, q, k, stride, scale, D, out)                                           \
    do {                                                                                       \
        if ((D) == 64) scores8_64_##T(q, k, stride, scale, out);                               \
        else scores8_128_##T(q, k, stride, scale, out);                                        \
    } while (0)
#else
#define FAST8(D) 0
#define HEAD_SCORES8(T, q, k, stride, scale, D, out) ((void)0)
#define HEAD_DOT(T, a, b, D) dot_0_##T(a, b, D)
#define HEAD_VACC(T, row, stride, count, p, D, out) vacc_0_##T(row, stride, count, p, D, out)
#endif

/* Rows that attend over the same positions [t0, t1) of the same blocks: a chunk of a system
 * prompt they share, or a chunk of one row alone; or positions of one prompt, each attending
 * up to its own position (member_end), the group ending with its last member's. Each group's
 * keys and values are read once for all its rows. members[first .. first + count) are its
 * rows, in increasing order; the last one's table holds the group's blocks. Within a sliding
 * window (window > 0) each member attends from its window's first position on
 * (member_begin), the group starting with its first member's. */
typedef struct {
    int64_t c, t0, t1, first, count, window;
} ChunkGroup;


/* The first position row b attends: pos[b] + 1 - window within a sliding window, else 0. */
static inline int64_t window_start(const DecodeBatch *s, int64_t b, int64_t window) {
    int64_t lo = s->pos[b] + 1 - window;
    return window > 0 && lo > 0 ? lo : 0;
}

/* The end of member `member`'s positions in group gr: its context's, or the group's. */
static inline int64_t member_end(const DecodeBatch *s, const ChunkGroup *gr, int64_t member) {
    int64_t n = s->pos[member] + 1;
    return n < gr->t1 ? n : gr->t1;
}

/* The start of member `member`'s positions in group gr: its window's, or the group's. */
static inline int64_t member_begin(const DecodeBatch *s, const ChunkGroup *gr, int64_t member) {
    int64_t lo = window_start(s, member, gr->window);
    return lo > gr->t0 ? lo : gr->t0;
}

/* Softmax weights of one query's scores over [t0, t0 + n): those in [begin, own) (its
 * positions), zeros elsewhere; returns the max and sets *total to the sum. */
static float member_weights(float *scores, int64_t begin, int64_t own, int64_t n, float *total) {
    float top = softmax_weights(scores + begin, own - begin, total);
    if (begin > 0) memset(scores, 0, (size_t)begin * sizeof(float));
    if (own < n) memset(scores + own, 0, (size_t)(n - own) * sizeof(float));
    return top;
}

/* A step's chunk groups and each thread's attention scratch (thread_floats floats each: scores,
 * outputs, maxima, sums and query pointers of up to `queries` queries). */
typedef struct {
    ChunkGroup *groups;
    int64_t *members;
    int64_t *chunk_first; /* [chunks + 1]: the first group of each chunk, then count */
    int64_t count, queries, thread_floats;
    int64_t window; /* the sliding window the rows attend over, 0 for their whole context */
    float *per_thread;
} ChunkGroups;


/* Whether rows a and b hold the same blocks for positions [t0, t1). */
static int same_blocks(const DecodeModel *m, const DecodeBatch *s, int64_t a, int64_t b,
                       int64_t t0, int64_t t1) {
    if (s->rows[a] == s->rows[b]) return 1; /* two positions of one sequence */
    const int64_t *ta = s->tables + s->rows[a] * s->table_stride;
    const int64_t *tb = s->tables + s->rows[b] * s->table_stride;
    for (int64_t j = t0 / m->block_size; j <= (t1 - 1) / m->block_size; j++) {
        if (ta[j] != tb[j]) return 0;
    }
    return 1;
}

/* The most rows in one chunk group. A prompt's positions share all of its chunks before their
 * own: with no bound, a group of hundreds of queries would keep their scores and outputs in
 * scratch far larger than the caches; bounded, each group of rows reads the chunk again, from
 * the caches once the first has read it. */
#define MAX_GROUP_ROWS 16

/* Splits every row's context into chunks of CHUNK positions and groups the rows of each chunk
 * that share it, up to MAX_GROUP_ROWS a group. groups and members hold B * chunks entries,
 * taken B; returns the number of groups. The same for every layer of a KV cache group, so
 * built once a step. Within a sliding window (window > 0) a row attends its last `window`
 * positions only: its chunks start there, and a group starts with its first member's window
 * (the later members' windows start later: member_begin). */
static int64_t group_chunks(const DecodeModel *m, const DecodeBatch *s, int64_t chunks,
                            int64_t window, ChunkGroup *groups, int64_t *members,
                            int64_t *chunk_first, char *taken) {
    int64_t count = 0, used = 0;
    for (int64_t c = 0; c < chunks; c++) {
        int64_t c0 = c * CHUNK, c1 = c0 + CHUNK;
        chunk_first[c] = count;
        memset(taken, 0, (size_t)s->B);
        for (int64_t b = 0; b < s->B; b++) {
            int64_t n = s->pos[b] + 1, t1 = c1 < n ? c1 : n;
            int64_t lo = window_start(s, b, window), t0 = c0 > lo ? c0 : lo;
            if (taken[b] || t0 >= t1) continue;
            ChunkGroup *gr = &groups[count++];
            *gr = (ChunkGroup){c, t0, t1, used, 1, window};
            members[used++] = b;
            for (int64_t o = b + 1; o < s->B && gr->count < MAX_GROUP_ROWS; o++) {
                int64_t on = s->pos[o] + 1, o1 = c1 < on ? c1 : on;
                int64_t o_lo = window_start(s, o, window), o0 = c0 > o_lo ? c0 : o_lo;
                int64_t last = members[used - 1];
                if (taken[o] || o1 < gr->t1) continue;
                /* within a window: a row whose window starts before the group's first
                 * position, or after this chunk, is not one of its members */
                if (o0 < t0 || o0 >= o1) continue;
                /* a later position of the same prompt extends the group's end */
                if (o1 > gr->t1 && s->rows[o] != s->rows[last]) continue;
                if (!same_blocks(m, s, last, o, t0, gr->t1)) continue;
                taken[o] = 1;
                members[used++] = o;
                gr->count++;
                gr->t1 = o1;
            }
        }
    }
    chunk_first[chunks] = count;
    return count;
}

/* Partial attention over a group's positions [t0, t1) of the query heads that share KV head
 * g, for each of its rows: query j (row members[j / group], head g * group + j % group) gets
 * mx[j] = its largest score, sm[j] = the sum of exp(score - mx[j]) and out [j * D ...] = that
 * sum weighted by the values. scores holds Q * CHUNK floats and q Q pointers, Q = rows *
 * group. One definition per cache element type.
 *
 * A row alone is bound by memory: its keys are scored a position at a time and its values
 * added head by head. A group of rows is bound by arithmetic, its keys and values being read
 * from memory once for all of them: it scores eight positions at a time against every query
 * and adds each block of values into every query's output while the block sits in L1. (On
 * the row alone, both measured slower: benchmarks/RESULTS.md.) */
#define DEFINE_ATTEND(T, C)                                                                    \
    static void attend_group_##T(const DecodeModel *m, const DecodeBatch *s, const C *kv,       \
                                 const ChunkGroup *gr, const int64_t *members, int64_t g,       \
                                 const float *qkv, int64_t qkv_width, const float **q,          \
                                 float *scores, float *out, float *mx, float *sm, float *run) { \
        int64_t D = m->head_dim, bs = m->block_size, t0 = gr->t0, t1 = gr->t1, n = t1 - t0;    \
        int64_t group = m->heads / m->kv_heads, Q = gr->count * group;                         \
        int64_t stride = m->kv_heads * D, shared = gr->count > 1;                              \
        const int64_t *table = s->tables + s->rows[members[gr->count - 1]] * s->table_stride;  \
        for (int64_t j = 0; j < Q; j++) {                                                      \
            q[j] = qkv + members[j / group] * qkv_width + (g * group + j % group) * D;         \
        }                                                                                      \
        float scale = 1.0f / sqrtf((float)D);                                                  \
        for (int64_t t = t0; t < t1;) {                                                        \
            int64_t end = run_end(t, t1, bs);                                                  \
            const C *k = kv + cache_offset(m, 0, table[t / bs] * bs + t % bs, g);              \
            if (shared && WIDEN_##T) { /* widened once for every query of the group */        \
                int64_t len = end - t, i = 0;                                                  \
                widen_##T(k, stride, len, D, run);                                             \
                for (; FAST8(D) && i + 8 <= len; i += 8) {                                     \
                    for (int64_t j = 0; j < Q; j++) {                                          \
                        HEAD_SCORES8(f32, q[j], run + i * D, D, scale, D,                      \
                                     scores + j * CHUNK + t + i - t0);                         \
                    }                                                                          \
                }                                                                              \
                for (; i < len; i++) {                                                         \
                    for (int64_t j = 0; j < Q; j++) {                                          \
                        float dot = HEAD_DOT(f32, q[j], run + i * D, D);                       \
                        scores[j * CHUNK + t + i - t0] = dot * scale;                          \
                    }                                                                          \
                }                                                                              \
                t = end;                                                                       \
                continue;                                                                      \
            }                                                                                  \
            for (; shared && FAST8(D) && t + 8 <= end; t += 8, k += 8 * stride) {              \
                for (int64_t j = 0; j < Q; j++) {                                              \
                    HEAD_SCORES8(T, q[j], k, stride, scale, D, scores + j * CHUNK + t - t0);   \
                }                                                                              \
            }                                                                                  \
            for (; t < end; t++, k += stride) {                                                \
                for (int64_t j = 0; j < Q; j++) {                                              \
                    scores[j * CHUNK + t - t0] = HEAD_DOT(T, q[j], k, D) * scale;              \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int64_t j = 0; j < Q; j++) {                                                      \
            int64_t own = member_end(s, gr, members[j / group]) - t0;                          \
            int64_t begin = member_begin(s, gr, members[j / group]) - t0;                      \
            mx[j] = member_weights(scores + j * CHUNK, begin, own, n, &sm[j]);                 \
            memset(out + j * D, 0, (size_t)D * sizeof(float));                                 \
        }                                                                                      \
        int64_t per_pass = shared ? Q : 1; /* queries served by one pass over the values */    \
        for (int64_t j0 = 0; j0 < Q; j0 += per_pass) {                                         \
            for (int64_t t = t0; t < t1;) {                                                    \
                int64_t end = run_end(t, t1, bs);                                              \
                const C *v = kv + cache_offset(m, 1, table[t / bs] * bs + t % bs, g);          \
                if (shared && WIDEN_##T) {                                                     \
                    widen_##T(v, stride, end - t, D, run);                                     \
                    for (int64_t j = j0; j < j0 + per_pass; j++) {                             \
                        HEAD_VACC(f32, run, D, end - t, scores + j * CHUNK + t - t0, D,        \
                                  out + j * D);                                                \
                    }                                                                          \
                    t = end;                                                                   \
                    continue;                                                                  \
                }                                                                              \
                for (int64_t j = j0; j < j0 + per_pass; j++) {                                 \
                    HEAD_VACC(T, v, stride, end - t, scores + j * CHUNK + t - t0, D,           \
                              out + j * D);                                                    \
                }                                                                              \
                t = end;                                                                       \
            }                                                                                  \
        }                                                                                      \
    }
DEFINE_ATTEND(f32, float)
DEFINE_ATTEND(bf16, uint16_t)
DEFINE_ATTEND(f16, uint16_t)

#if defined(__AVX512F__)
/* The attention of a chunk group at 512 bits, for head sizes 64, 128 and 256: the result of
 * attend_group_T (up to float rounding: another summation order), with the work arranged for
 * arithmetic rather than for loads. A run of positions of one block is read from the cache
 * once for all the group's queries, a row alone included (its `group` query heads share the
 * KV head): widened to float into `run` for a 16-bit cache, read in place for a float32 one.
 * Scores take eight positions against one query at a time, the query in registers and the
 * eight sums reduced together (sum8x16); values are added into the outputs of up to
 * PV_BLOCK(DD) queries at a time, their accumulators in registers for the whole run. The
 * AVX2 form scored a position at a time per query and made one pass over the values per
 * query, converting each 16-bit element again every time (benchmarks/RESULTS.md). */
#define LOAD16_f32(p) _mm512_loadu_ps(p)
#define LOAD16_bf16(p)                                                                         \
    _mm512_castsi512_ps(_mm512_slli_epi32(                                                     \
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define LOAD16_f16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))

/* The eight sums of the sixteen floats of each of a[0..7], in order. */
static inline __m256 sum8x16(const __m512 *a) {
    __m512 t[4], u0, u1, v, w;
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: [a0 a1 a0 a1] partial sums of a pair */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    }
    /* per lane: [a0 a1 a2 a3] and [a4 a5 a6 a7] */
    u0 = _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 2, 3, 2)));
    u1 = _mm512_add_ps(_mm512_shuffle_ps(t[2], t[3], _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(t[2], t[3], _MM_SHUFFLE(3, 2, 3, 2)));
    /* lanes: [u0 lanes 0+1, u0 lanes 2+3, u1 lanes 0+1, u1 lanes 2+3] */
    v = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                      _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
    /* lane 0: the sums of a0..a3, lane 2: of a4..a7 */
    w = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm512_castps512_ps256(_mm512_shuffle_f32x4(w, w, _MM_SHUFFLE(0, 0, 2, 0)));
}

/* scores512_DD(q, k, ks, n, scale, out): out[i] = scale * q . k_i for i < n, key i at
 * k + i * ks (floats).
 * pv512_DD_NB(v, vs, n, p, out): out[j] [DD] += sum over t < n of p[j][t] * v_t for j < NB,
 * value t at v + t * vs (floats). */
#define DEFINE_SCORES512(DD)                                                                   \
    static void scores512_##DD(const float *q, const float *k, int64_t ks, int64_t n,         \
                               float scale, float *out) {                                      \
        __m512 qv[DD / 16];                                                                    \
        for (int u = 0; u < DD / 16; u++) qv[u] = _mm512_loadu_ps(q + 16 * u);                 \
        int64_t i = 0;                                                                         \
        for (; i + 8 <= n; i += 8) {                                                           \
            __m512 a[8];                                                                       \
            for (int r = 0; r < 8; r++) a[r] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k + (i + r) * ks)); \
            for (int u = 1; u < DD / 16; u++) {                                                \
                for (int r = 0; r < 8; r++) {                                                  \
                    a[r] = _mm512_fmadd_ps(qv[u], _mm512_loadu_ps(k + (i + r) * ks + 16 * u), a[r]); \
                }                                                                              \
            }                                                                                  \
            _mm256_storeu_ps(out + i, _mm256_mul_ps(sum8x16(a), _mm256_set1_ps(scale)));       \
        }                                                                                      \
        for (; i < n; i++) {                                                                   \
            __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k + i * ks));                      \
            for (int u = 1; u < DD / 16; u++) {                                                \
                a = _mm512_fmadd_ps(qv[u], _mm512_loadu_ps(k + i * ks + 16 * u), a);           \
            }                                                                                  \
            out[i] = _mm512_reduce_add_ps(a) * scale;                                          \
        }                                                                                      \
    }
#define DEFINE_PV512(DD, NB)                                                                   \
    static void pv512_##DD##_##NB(const float *v, int64_t vs, int64_t n, const float **p,     \
                                  float **out) {                                               \
        __m512 acc[NB][DD / 16];                                                               \
        for (int j = 0; j < NB; j++) {                                                         \
            for (int u = 0; u < DD / 16; u++) acc[j][u] = _mm512_loadu_ps(out[j] + 16 * u);    \
        }                                                                                      \
        for (int64_t t = 0; t < n; t++, v += vs) {                                             \
            __m512 w[NB];                                                                      \
            for (int j = 0; j < NB; j++) w[j] = _mm512_set1_ps(p[j][t]);                       \
            for (int u = 0; u < DD / 16; u++) {                                                \
                __m512 x = _mm512_loadu_ps(v + 16 * u);                                        \
                for (int j = 0; j < NB; j++) acc[j][u] = _mm512_fmadd_ps(w[j], x, acc[j][u]);  \
            }                                                                                  \
        }                                                                                      \
        for (int j = 0; j < NB; j++) {                                                         \
            for (int u = 0; u < DD / 16; u++) _mm512_storeu_ps(out[j] + 16 * u, acc[j][u]);    \
        }                                                                                      \
    }
DEFINE_SCORES512(64)
DEFINE_SCORES512(128)
DEFINE_SCORES512(256)
DEFINE_PV512(64, 1)
DEFINE_PV512(64, 2)
DEFINE_PV512(64, 3)
DEFINE_PV512(64, 4)
DEFINE_PV512(64, 5)
DEFINE_PV512(64, 6)
DEFINE_PV512(128, 1)
DEFINE_PV512(128, 2)
DEFINE_PV512(128, 3)
DEFINE_PV512(256, 1)
/* Queries whose outputs pv512 accumulates at once: their accumulators, their weights and one
 * value vector fill the 32 registers. */
#define PV_BLOCK(DD) ((DD) == 64 ? 6 : (DD) == 128 ? 3 : 1)

/* out[j] += p[j] weighted values for j < nb <= PV_BLOCK(D). */
static void pv512(int64_t D, int64_t nb, const float *v, int64_t vs, int64_t n, const float **p,
                  float **out) {
    typedef void (*Pv)(const float *, int64_t, int64_t, const float **, float **);
    static const Pv pv64[6] = {pv512_64_1, pv512_64_2, pv512_64_3,
                               pv512_64_4, pv512_64_5, pv512_64_6};
    static const Pv pv128[3] = {pv512_128_1, pv512_128_2, pv512_128_3};
    static const Pv pv256[1] = {pv512_256_1};
    (D == 64 ? pv64 : D == 128 ? pv128 : pv256)[nb - 1](v, vs, n, p, out);
}

/* scores_bf16(D, q, Q, k, ks, n, scale, scores): for each query j < Q, scores[j * CHUNK + i] =
 * scale * q[j] . k_i for i < n, the keys bfloat16 in the cache (key i at k + i * ks elements)
 * and each query rounded to bfloat16 (to nearest even, as torch rounds): `vdpbf16ps` adds each
 * pair of products into float32 lanes, so the keys are read in place, neither widened into a
 * buffer nor converted, and one instruction makes 32 multiply-adds where an FMA made 16. Only
 * for queries that are bfloat16 values already (a bfloat16 model's: the eager path's SDPA
 * rounds them so too), where the rounding changes nothing or what the model itself rounds.
 * Needs AVX512-BF16 (bf16_attention_built); head sizes 64, 128 and 256. */
#if defined(__AVX512BF16__)
#define DEFINE_SCORES_BF16(DD)                                                                 \
    static void scores_bf16_##DD(const float *q, const uint16_t *k, int64_t ks, int64_t n,    \
                                 float scale, float *out) {                                    \
        __m512bh qv[DD / 32];                                                                  \
        for (int u = 0; u < DD / 32; u++) {                                                    \
            qv[u] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 32 * u + 16),                      \
                                        _mm512_loadu_ps(q + 32 * u));                          \
        }                                                                                      \
        int64_t i = 0;                                                                         \
        for (; i + 8 <= n; i += 8) {                                                           \
            __m512 a[8];                                                                       \
            for (int r = 0; r < 8; r++) a[r] = _mm512_setzero_ps();                            \
            for (int u = 0; u < DD / 32; u++) {                                                \
                for (int r = 0; r < 8; r++) {                                                  \
                    __m512bh key = (__m512bh)_mm512_loadu_si512(k + (i + r) * ks + 32 * u);    \
                    a[r] = _mm512_dpbf16_ps(a[r], qv[u], key);                                 \
                }                                                                              \
            }                                                                                  \
            _mm256_storeu_ps(out + i, _mm256_mul_ps(sum8x16(a), _mm256_set1_ps(scale)));       \
        }                                                                                      \
        for (; i < n; i++) {                                                                   \
            __m512 a = _mm512_setzero_ps();                                                    \
            for (int u = 0; u < DD / 32; u++) {                                                \
                a = _mm512_dpbf16_ps(a, qv[u], (__m512bh)_mm512_loadu_si512(k + i * ks + 32 * u)); \
            }                                                                                  \
            out[i] = _mm512_reduce_add_ps(a) * scale;                                          \
        }                                                                                      \
    }
DEFINE_SCORES_BF16(64)
DEFINE_SCORES_BF16(128)
DEFINE_SCORES_BF16(256)
#endif

static int bf16_attention_built(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

static void scores_bf16(int64_t D, const float *const *q, int64_t Q, const void *k, int64_t ks,
                        int64_t n, float scale, float *scores) {
#if defined(__AVX512BF16__)
    for (int64_t j = 0; j < Q; j++) {
        (D == 64 ? scores_bf16_64 : D == 128 ? scores_bf16_128 : scores_bf16_256)(
            q[j], (const uint16_t *)k, ks, n, scale, scores + j * CHUNK);
    }
#else
    (void)D, (void)q, (void)Q, (void)k, (void)ks, (void)n, (void)scale, (void)scores;
#endif
}

/* pv_bf16(D, nb, v, vs, n, p, out): pv512's contract with bfloat16 values read in place (value
 * t at v + t * vs elements) and bfloat16 weights (p[j][t]): two positions at a time, their
 * values interleaved element by element (vpermt2w) so that `vdpbf16ps` adds both products of
 * an output element in one lane, against the pair of a query's weights broadcast. An odd last
 * position is paired with itself at weight zero. The weights rounded to bfloat16 are what
 * torch's CPU flash attention multiplies the values by for bfloat16 inputs. */
#if defined(__AVX512BF16__)
#define DEFINE_PV_BF16(DD, NB)                                                                 \
    static void pv_bf16_##DD##_##NB(const uint16_t *v, int64_t vs, int64_t n,                 \
                                    const uint16_t **p, float **out) {                         \
        __m512 acc[NB][DD / 16];                                                               \
        for (int j = 0; j < NB; j++) {                                                         \
            for (int u = 0; u < DD / 16; u++) acc[j][u] = _mm512_loadu_ps(out[j] + 16 * u);    \
        }                                                                                      \
        const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10,    \
                                            41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3,   \
                                            34, 2, 33, 1, 32, 0);                              \
        const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));                        \
        for (int64_t t = 0; t < n; t += 2, v += 2 * vs) {                                      \
            int last = t + 1 == n; /* pair the odd last position with itself, weight 0 */      \
            const uint16_t *v2 = last ? v : v + vs;                                            \
            __m512i w[NB];                                                                     \
            for (int j = 0; j < NB; j++) {                                                     \
                uint32_t pair = (uint32_t)p[j][t] | (last ? 0u : (uint32_t)p[j][t + 1] << 16); \
                w[j] = _mm512_set1_epi32((int)pair);                                           \
            }                                                                                  \
            for (int u = 0; u < DD / 32; u++) {                                                \
                __m512i a = _mm512_loadu_si512(v + 32 * u), b = _mm512_loadu_si512(v2 + 32 * u); \
                __m512bh x0 = (__m512bh)_mm512_permutex2var_epi16(a, lo, b);                  \
                __m512bh x1 = (__m512bh)_mm512_permutex2var_epi16(a, hi, b);                  \
                for (int j = 0; j < NB; j++) {                                                 \
                    acc[j][2 * u] = _mm512_dpbf16_ps(acc[j][2 * u], (__m512bh)w[j], x0);       \
                    acc[j][2 * u + 1] = _mm512_dpbf16_ps(acc[j][2 * u + 1], (__m512bh)w[j], x1); \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int j = 0; j < NB; j++) {                                                         \
            for (int u = 0; u < DD / 16; u++) _mm512_storeu_ps(out[j] + 16 * u, acc[j][u]);    \
        }                                                                                      \
    }
DEFINE_PV_BF16(64, 1)
DEFINE_PV_BF16(64, 2)
DEFINE_PV_BF16(64, 3)
DEFINE_PV_BF16(64, 4)
DEFINE_PV_BF16(64, 5)
DEFINE_PV_BF16(64, 6)
DEFINE_PV_BF16(128, 1)
DEFINE_PV_BF16(128, 2)
DEFINE_PV_BF16(128, 3)
DEFINE_PV_BF16(256, 1)
#endif

static void pv_bf16(int64_t D, int64_t nb, const void *v, int64_t vs, int64_t n,
                    const uint16_t **p, float **out) {
#if defined(__AVX512BF16__)
    typedef void (*Pv)(const uint16_t *, int64_t, int64_t, const uint16_t **, float **);
    static const Pv pv64[6] = {pv_bf16_64_1, pv_bf16_64_2, pv_bf16_64_3,
                               pv_bf16_64_4, pv_bf16_64_5, pv_bf16_64_6};
    static const Pv pv128[3] = {pv_bf16_128_1, pv_bf16_128_2, pv_bf16_128_3};
    static const Pv pv256[1] = {pv_bf16_256_1};
    (D == 64 ? pv64 : D == 128 ? pv128 : pv256)[nb - 1]((const uint16_t *)v, vs, n, p, out);
#else
    (void)D, (void)nb, (void)v, (void)vs, (void)n, (void)p, (void)out;
#endif
}

/* dst[i] = x[i] rounded to bfloat16 (to nearest even) for i < n: softmax weights, 16 at a time
 * where the build has AVX512-BF16. That conversion takes inputs below 2^-126 as zero, where
 * round_rows_bf16 (the products' activations) keeps torch's bits; a weight that small is
 * exp(-87) of the chunk's largest, nothing to any sum. */
static void round_bf16_n(const float *x, int64_t n, uint16_t *dst) {
    int64_t i = 0;
#if defined(__AVX512BF16__)
    for (; i + 16 <= n; i += 16) {
        _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
    }
#endif
    for (; i < n; i++) dst[i] = round_bf16(x[i]);
}

/* widen512_T(src, stride, count, D, dst): dst [count, D] = the float values of count slots
 * stride elements apart (D a multiple of 16). */
#define DEFINE_WIDEN512(T, C)                                                                  \
    static void widen512_##T(const C *src, int64_t stride, int64_t count, int64_t D,          \
                             float *dst) {                                                     \
        for (int64_t i = 0; i < count; i++, src += stride, dst += D) {                         \
            for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, LOAD16_##T(src + d)); \
        }                                                                                      \
    }
DEFINE_WIDEN512(f32, float) /* never called: a float32 cache is read in place */
DEFINE_WIDEN512(bf16, uint16_t)
DEFINE_WIDEN512(f16, uint16_t)

#ifndef KEY_RUNS_AHEAD
#define KEY_RUNS_AHEAD 1
#endif

/* Part `part` of `parts` of the `bytes` bytes at p asked into the L2 cache, a line at a time.
 * A block's slots are a few kilobytes and the next block lies anywhere, so the hardware
 * prefetchers alone left the loads waiting on memory (the widening loop took 88% of the
 * attention's time). Asking for a whole run's keys and values at once (192 lines of
 * a run of 16 slots) did not help as much as it could: the requests fill the core's miss
 * buffers and the prefetch instructions then wait for them, so the scores stalled behind the
 * memory instead of overlapping it. The key pass therefore asks for the next runs in slices,
 * one before each query head's scores: a decode step's attention at 16 rows x 415
 * positions takes 7.9 ms this way, 12.1 ms with the prefetchers alone. */
static inline void prefetch_part(const void *p, int64_t bytes, int64_t part, int64_t parts) {
    const char *at = (const char *)p;
    /* the lines that begin in this part: each line of the span once over the parts */
    for (int64_t b = (bytes * part / parts + 63) & ~(int64_t)63; b < bytes * (part + 1) / parts;
         b += 64) {
        _mm_prefetch(at + b, _MM_HINT_T1);
    }
}

/* attend512_T: attend_group_T's contract for the ng KV heads from g at once (head sizes 64
 * and 128): query j of the task is query j % Qg of KV head g + j / Qg, Qg = the group's rows
 * times the query heads of a KV head. A slot holds every KV head's keys (or values) side by
 * side, so reading all the heads of a run is one contiguous read of the run's slots; a task
 * per KV head read a third of each slot, and that strided read cost this machine nearly what
 * the whole slots did. With bf16_queries, a bfloat16 cache is read in
 * place: scores_bf16 for the keys, the weights rounded to bfloat16 into `run`, and pv_bf16
 * for the values. */
#define DEFINE_ATTEND512(T, C)                                                                 \
    static const float *run_floats_##T(const C *src, int64_t stride, int64_t count, int64_t D, \
                                       float *run, int64_t *run_stride) {                      \
        if (!WIDEN_##T) {                                                                      \
            *run_stride = stride;                                                              \
            return (const float *)(const void *)src;                                           \
        }                                                                                      \
        widen512_##T(src, stride, count, D, run);                                              \
        *run_stride = D;                                                                       \
        return run;                                                                            \
    }                                                                                          \
    static void attend512_##T(const DecodeModel *m, const DecodeBatch *s, const C *kv,          \
                              const ChunkGroup *gr, const int64_t *members, int64_t g,          \
                              int64_t ng, const float *qkv, int64_t qkv_width, const float **q, \
                              float *scores, float *out, float *mx, float *sm, float *run) {    \
        int64_t D = m->head_dim, bs = m->block_size, t0 = gr->t0, t1 = gr->t1, rs;             \
        int64_t group = m->heads / m->kv_heads, Qg = gr->count * group, Q = ng * Qg;           \
        int64_t stride = m->kv_heads * D, block = PV_BLOCK(D);                                 \
        const int64_t *table = s->tables + s->rows[members[gr->count - 1]] * s->table_stride;  \
        for (int64_t j = 0; j < Q; j++) {                                                      \
            int64_t jj = j % Qg;                                                               \
            q[j] = qkv + members[jj / group] * qkv_width + ((g + j / Qg) * group + jj % group) * D; \
        }                                                                                      \
        float scale = 1.0f / sqrtf((float)D);                                                  \
        int in_place = KEYS_BF16_##T && m->bf16_queries && bf16_attention_built();             \
        for (int64_t t = t0, end; t < t1; t = end) {                                           \
            end = run_end(t, t1, bs);                                                          \
            int64_t slot = table[t / bs] * bs + t % bs, ahead = end;                           \
            /* this run's values and the keys KEY_RUNS_AHEAD runs after the next, in slices */ \
            for (int r = 0; r < KEY_RUNS_AHEAD && ahead < t1; r++) ahead = run_end(ahead, t1, bs); \
            const C *values = kv + cache_offset(m, 1, slot, g), *keys_ahead = NULL;            \
            int64_t run_bytes = ((end - t - 1) * stride + ng * D) * (int64_t)sizeof(C);        \
            int64_t ahead_bytes = 0;                                                           \
            if (ahead < t1) {                                                                  \
                keys_ahead = kv + cache_offset(m, 0, table[ahead / bs] * bs + ahead % bs, g);  \
                ahead_bytes = ((run_end(ahead, t1, bs) - ahead - 1) * stride + ng * D) *       \
                              (int64_t)sizeof(C);                                              \
            }                                                                                  \
            for (int64_t h = 0; h < ng; h++) {                                                 \
                const C *k = kv + cache_offset(m, 0, slot, g + h);                             \
                float *sc = scores + h * Qg * CHUNK + t - t0;                                  \
                const float *keys = in_place ? NULL : run_floats_##T(k, stride, end - t, D, run, &rs); \
                for (int64_t j = 0; j < Qg; j++) {                                             \
                    prefetch_part(keys_ahead, ahead_bytes, h * Qg + j, ng * Qg);               \
                    prefetch_part(values, run_bytes, h * Qg + j, ng * Qg);                     \
                    if (in_place) {                                                            \
                        scores_bf16(D, q + h * Qg + j, 1, k, stride, end - t, scale, sc + j * CHUNK); \
                    } else {                                                                   \
                        (D == 64 ? scores512_64 : D == 128 ? scores512_128 : scores512_256)(     \
                            q[h * Qg + j], keys, rs, end - t,                                  \
                                                                  scale, sc + j * CHUNK);      \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int64_t j = 0; j < Q; j++) {                                                      \
            int64_t own = member_end(s, gr, members[(j % Qg) / group]) - t0;                   \
            int64_t begin = member_begin(s, gr, members[(j % Qg) / group]) - t0;               \
            mx[j] = member_weights(scores + j * CHUNK, begin, own, t1 - t0, &sm[j]);           \
            memset(out + j * D, 0, (size_t)D * sizeof(float));                                 \
        }                                                                                      \
        uint16_t *weights = (uint16_t *)run; /* in place: the weights in bfloat16 */            \
        for (int64_t j = 0; in_place && j < Q; j++) {                                          \
            round_bf16_n(scores + j * CHUNK, t1 - t0, weights + j * CHUNK);                    \
        }                                                                                      \
        for (int64_t t = t0, end; t < t1; t = end) {                                           \
            end = run_end(t, t1, bs);                                                          \
            for (int64_t h = 0; h < ng; h++) {                                                 \
                const C *v = kv + cache_offset(m, 1, table[t / bs] * bs + t % bs, g + h);      \
                /* in place, `run` holds the bfloat16 weights: the values are read in place */ \
                const float *values =                                                          \
                    in_place ? NULL : run_floats_##T(v, stride, end - t, D, run, &rs);         \
                for (int64_t j0 = h * Qg; j0 < (h + 1) * Qg; j0 += block) {                    \
                    int64_t nb = (h + 1) * Qg - j0 < block ? (h + 1) * Qg - j0 : block;        \
                    const float *p[6];                                                         \
                    const uint16_t *pw[6];                                                     \
                    float *o[6];                                                               \
                    for (int64_t j = 0; j < nb; j++) {                                         \
                        p[j] = scores + (j0 + j) * CHUNK + t - t0;                             \
                        pw[j] = weights + (j0 + j) * CHUNK + t - t0;                           \
                        o[j] = out + (j0 + j) * D;                                             \
                    }                                                                          \
                    if (in_place) pv_bf16(D, nb, v, stride, end - t, pw, o);                   \
                    else pv512(D, nb, values, rs, end - t, p, o);                              \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }
/* Whether a cache of this type is attended in place in bfloat16 (scores_bf16, pv_bf16). */
#define KEYS_BF16_f32 0
#define KEYS_BF16_bf16 1
#define KEYS_BF16_f16 0
DEFINE_ATTEND512(f32, float)
DEFINE_ATTEND512(bf16, uint16_t)
DEFINE_ATTEND512(f16, uint16_t)
#define ATTEND512(D) ((D) == 64 || (D) == 128 || (D) == 256)
#endif

/* Merges the chunks' partial results of one query head (each D + 2 floats: out, max, sum). */
static void merge_chunks(const float *parts, int64_t chunks, int64_t D, float *out) {
    float top = -INFINITY, total = 0.0f;
    for (int64_t c = 0; c < chunks; c++) {
        float mx = parts[c * (D + 2) + D];
        top = mx > top ? mx : top;
    }
    for (int64_t d = 0; d < D; d++) out[d] = 0.0f;
    for (int64_t c = 0; c < chunks; c++) {
        const float *p = parts + c * (D + 2);
        float w = expf(p[D] - top);
        total += w * p[D + 1];
        for (int64_t d = 0; d < D; d++) out[d] += w * p[d];
    }
    float inv = 1.0f / total;
    for (int64_t d = 0; d < D; d++) out[d] *= inv;
}

/* Attention of every row's query heads over its context; out is [B, heads * D]. parts holds
 * B * heads * chunks * (D + 2) floats, chunks = ceil(longest context / CHUNK). A task is one
 * group of rows sharing a chunk (group_chunks) and its KV heads: all of them at 512 bits
 * (attend512_T, whole slots read at once), one otherwise. Tasks are handed out chunk by chunk
 * (the large groups of shared first chunks first), within a chunk by KV head, and within a
 * head group by group, so that two threads read different rows at a time. Called by every
 * thread of the enclosing parallel region, as team_linear. */
static void attention(const DecodeModel *m, const DecodeBatch *s, const void *kv,
                      const float *qkv, int64_t qkv_width, float *out, int64_t chunks,
                      float *parts, const ChunkGroups *cg) {
    int64_t D = m->head_dim, group = m->heads / m->kv_heads, part = D + 2;
    /* KV heads a task attends: all of them at 512 bits (attend512_T reads whole slots) */
    int64_t per_task = 1;
#if defined(__AVX512F__)
    if (ATTEND512(D)) per_task = m->kv_heads;
#endif
    int64_t splits = m->kv_heads / per_task, tasks = cg->count * splits;
    {
        float *scores = cg->per_thread + (int64_t)omp_get_thread_num() * cg->thread_floats;
        float *o = scores + cg->queries * CHUNK, *mx = o + cg->queries * D, *sm = mx + cg->queries;
        const float **q = (const float **)(sm + cg->queries);
        float *run = (float *)(q + cg->queries);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            /* chunk by chunk, KV head by KV head, then the chunk's groups */
            int64_t c = 0;
            while (task >= cg->chunk_first[c + 1] * splits) c++;
            int64_t first = cg->chunk_first[c], in_chunk = cg->chunk_first[c + 1] - first;
            int64_t local = task - first * splits;
            const ChunkGroup *gr = &cg->groups[first + local % in_chunk];
            int64_t g = local / in_chunk * per_task, Qg = gr->count * group;
            const int64_t *rows = cg->members + gr->first;
/* the task's attention through NAME_bf16, NAME_f16 or NAME_f32, by the cache's type */
#define ATTEND_BY_KV(NAME, ...)                                                                \
    do {                                                                                       \
        if (m->kv_type == KV_BF16) {                                                           \
            NAME##_bf16(m, s, kv, gr, rows, g, __VA_ARGS__ qkv, qkv_width, q, scores, o, mx, sm, run); \
        } else if (m->kv_type == KV_F16) {                                                     \
            NAME##_f16(m, s, kv, gr, rows, g, __VA_ARGS__ qkv, qkv_width, q, scores, o, mx, sm, run); \
        } else {                                                                               \
            NAME##_f32(m, s, kv, gr, rows, g, __VA_ARGS__ qkv, qkv_width, q, scores, o, mx, sm, run); \
        }                                                                                      \
    } while (0)
#if defined(__AVX512F__)
            if (ATTEND512(D)) ATTEND_BY_KV(attend512, per_task, );
            else ATTEND_BY_KV(attend_group, );
#else
            ATTEND_BY_KV(attend_group, );
#endif
            for (int64_t j = 0; j < per_task * Qg; j++) {
                int64_t b = rows[j % Qg / group], h = (g + j / Qg) * group + j % Qg % group;
                float *dst = parts + ((b * m->heads + h) * chunks + gr->c) * part;
                memcpy(dst, o + j * D, (size_t)D * sizeof(float));
                dst[D] = mx[j];
                dst[D + 1] = sm[j];
            }
        }
    }
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < s->B * m->heads; bh++) {
        int64_t b = bh / m->heads, used = (s->pos[b] + 1 + CHUNK - 1) / CHUNK;
        int64_t first = window_start(s, b, cg->window) / CHUNK; /* a window's first chunk */
        merge_chunks(parts + (bh * chunks + first) * part, used - first, D, out + bh * D);
    }
}

/* Writes the K and V of rows [b0, b0 + n) into the cache at their positions. */
static void write_kv(const DecodeModel *m, const DecodeBatch *s, void *kv, const float *qkv,
                     int64_t qkv_width, int64_t b0, int64_t n) {
    int64_t D = m->head_dim, kv_size = m->kv_heads * D, q_size = m->heads * D;
    for (int64_t b = b0; b < b0 + n; b++) {
        int64_t slot = slot_of(m, s, b, s->pos[b]);
        const float *k = qkv + b * qkv_width + q_size;
        for (int64_t which = 0; which < 2; which++) {
            const float *src = k + which * kv_size;
            int64_t at = cache_offset(m, which, slot, 0);
            if (m->kv_type == KV_BF16) {
                uint16_t *dst = (uint16_t *)kv + at;
                for (int64_t i = 0; i < kv_size; i++) dst[i] = float_to_bf16(src[i]);
            } else if (m->kv_type == KV_F16) {
                uint16_t *dst = (uint16_t *)kv + at;
                for (int64_t i = 0; i < kv_size; i++) dst[i] = float_to_f16(src[i]);
            } else {
                memcpy((float *)kv + at, src, (size_t)kv_size * sizeof(float));
            }
        }
    }
}

static float silu(float g) { return g / (1.0f + expf(-g)); }

/* out[i] = silu(gate[i]) * up[i] for i < n. */
static void silu_mul(const float *gate, const float *up, int64_t n, float *out) {
    int64_t i = 0;
#ifdef __AVX2__
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 e = exp8(_mm256_xor_ps(g, sign));
        __m256 v = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(v, _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) out[i] = silu(gate[i]) * up[i];
}

/* out[i] = gelu(gate[i]) * up[i] for i < n, GELU's tanh approximation (Gemma's gate):
 * 0.5 g (1 + tanh(u)), u = sqrt(2 / pi) (g + 0.044715 g^3), tanh(u) = 1 - 2 / (exp(2u) + 1). */
static void gelu_mul(const float *gate, const float *up, int64_t n, float *out) {
    const float c = 0.7978845608028654f, k = 0.044715f;
    int64_t i = 0;
#ifdef __AVX2__
    const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 u = _mm256_mul_ps(_mm256_set1_ps(c),
                                 _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(k), g),
                                                 _mm256_mul_ps(g, g), g));
        __m256 e = exp8(_mm256_add_ps(u, u));
        __m256 t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one)));
        __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(one, t));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(v, _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) {
        float g = gate[i];
        out[i] = 0.5f * g * (1.0f + tanhf(c * (g + k * g * g * g))) * up[i];
    }
}

/* Scratch buffers of a forward pass, one allocation. */
typedef struct {
    float *h, *qkv, *attn, *gu, *act, *delta, *cos_, *sin_, *cos_local, *sin_local, *parts, *low;
    Quantized q;
    void *base;
} Scratch;

/* Which byte splits a one-row step's products take (Quantized.need_q4, need_k): every part
 * of every layer's products looked at once per step (bytes_split; none without AVX2). */
static void split_needs(const DecodeModel *m, Quantized *q) {
    q->need_q4 = q->need_k = q->split_q4 = q->split_k = 0;
#ifdef __AVX2__
    for (int64_t i = 0; i < m->num_layers; i++) {
        const DecodeLayer *L = &m->layers[i];
        int64_t fmts[8] = {L->qkv_fmt, L->o_fmt, L->gate_up_fmt, L->down_fmt, -1, -1, -1, -1};
        for (int j = 0; j < 2; j++) {
            if (L->qkv_rows[j + 1] > 0) fmts[4 + j] = L->qkv_more_fmt[j];
            if (L->gate_up_rows[j + 1] > 0) fmts[6 + j] = L->gate_up_more_fmt[j];
        }
        for (int j = 0; j < 8; j++) {
            q->need_q4 |= bytes_split(fmts[j]) == BYTES_Q4;
            q->need_k |= bytes_split(fmts[j]) == BYTES_K;
        }
    }
#else
    (void)m;
#endif
}

/* Bytes of a step's paired rows for the panel kernel (Quantized.pairs): the B rows and
 * PANEL_M more that a tile reads, where the step takes the panels (16-bit rows: not a step
 * that rounds its rows to bfloat16, bf16_rows); else 0. */
static int64_t pair_bytes(const DecodeModel *m, int64_t B, int64_t widest) {
#ifdef HAVE_PANEL
    int panels = B >= PANEL_TEAM_FROM && !bf16_rows(m, B);
    return panels ? (B + PANEL_M) * widest * (int64_t)sizeof(int16_t) : 0;
#else
    (void)m, (void)B, (void)widest;
    return 0;
#endif
}

/* Rows of scales and sums past B that a panel tile reads (not stored). */
#ifdef HAVE_PANEL
#define SPARE_ROWS PANEL_M
#else
#define SPARE_ROWS 0
#endif

static int scratch_alloc(const DecodeModel *m, int64_t B, int64_t chunks, Scratch *sc) {
    int64_t H = m->hidden, D = m->head_dim, I = m->intermediate;
    int64_t qkv_width = (m->heads + 2 * m->kv_heads) * D, widest = I > H ? I : H;
    if (m->heads * D > widest) widest = m->heads * D;
    int64_t floats = B * (H + qkv_width + m->heads * D + 2 * I + I + H + 2 * D) + 4 * B * widest / QK
                     + B * m->heads * chunks * (D + 2) + B * m->lora_max_rows
                     + 2 * SPARE_ROWS * widest / QK;
    int64_t words = amx_rows() > 0 ? amx_packed_words(B, widest) : 0; /* q.xv */
    split_needs(m, &sc->q);
    sc->q.split_q4 = sc->q.need_q4 && B <= Q4_SPLIT_ROWS; /* for every unit of its rows */
    /* split_k's rows (none where the panels take the products) */
    int64_t k_rows = KQ_FEW_ROWS > FEW_ROWS && sc->q.need_k && B > FEW_ROWS
                     && !pair_bytes(m, B, widest) ? B : FEW_ROWS;
    int64_t bytes = floats * (int64_t)sizeof(float) + words * (int64_t)sizeof(uint32_t)
                    + B * widest * (int64_t)sizeof(int16_t) + 2 * Q4_SPLIT_ROWS * widest
                    + k_rows * SPLIT_K_BYTES(widest) + pair_bytes(m, B, widest) + 192;
    char *p = malloc((size_t)bytes);
    if (!p) return -1;
    sc->base = p;
    float *f = (float *)p;
    sc->h = f; f += B * H;
    sc->qkv = f; f += B * qkv_width;
    sc->attn = f; f += B * m->heads * D;
    sc->gu = f; f += B * 2 * I;
    sc->act = f; f += B * I;
    sc->delta = f; f += B * H;
    sc->cos_ = f; f += B * D / 2;
    sc->sin_ = f; f += B * D / 2;
    sc->cos_local = f; f += B * D / 2;
    sc->sin_local = f; f += B * D / 2;
    sc->q.xd = f; f += (B + SPARE_ROWS) * widest / QK;
    sc->q.xs = f; f += (B + SPARE_ROWS) * widest / QK;
    sc->q.dT = f; f += B * widest / QK;
    sc->q.sT = f; f += B * widest / QK;
    sc->parts = f; f += B * m->heads * chunks * (D + 2);
    sc->low = f; f += B * m->lora_max_rows;
    sc->q.xv = (uint32_t *)f; f += words;
    sc->q.xq = (int16_t *)f;
    sc->q.xb = (uint8_t *)(((uintptr_t)(sc->q.xq + B * widest) + 63) & ~(uintptr_t)63);
    uint8_t *after = sc->q.xb + 2 * Q4_SPLIT_ROWS * widest + k_rows * SPLIT_K_BYTES(widest);
    sc->q.pairs = pair_bytes(m, B, widest)
                      ? (int32_t *)(((uintptr_t)after + 63) & ~(uintptr_t)63) : NULL;
    return 0;
}

/* The row-wise steps of a layer on rows [b0, b0 + n), one unit of rows (rows_unit):
 * rows_in: x += the last product's output (add; first normalised, rmsnorm(.) * delta_norm,
 *   where that is not NULL), h = rmsnorm(x) * w, h rounded for a product;
 * rows_qk: the Q/K norms (Gemma), rotate q and k (and scale q: Gemma), write k and v into
 *   the cache;
 * rows_act: act = silu(gate) * up (or gelu), rounded for the down product. */
static void rows_in(const DecodeModel *m, float *x, const float *w, Scratch *sc, int add,
                    const float *delta_norm, int64_t b0, int64_t n) {
    int64_t H = m->hidden;
    if (add && delta_norm) {
        rmsnorm(sc->delta + b0 * H, delta_norm, n, H, (float)m->eps, sc->delta + b0 * H);
    }
    for (int64_t i = b0 * H; add && i < (b0 + n) * H; i++) x[i] += sc->delta[i];
    rmsnorm(x + b0 * H, w, n, H, (float)m->eps, sc->h + b0 * H);
    quantize_rows(sc->h, b0, n, H, &sc->q);
}

static void rows_qk(const DecodeModel *m, const DecodeLayer *L, const DecodeBatch *s,
                    Scratch *sc, int64_t b0, int64_t n) {
    int64_t D = m->head_dim, q_size = m->heads * D, qkv_width = q_size + 2 * m->kv_heads * D;
    const float *cos_ = L->local_rope ? sc->cos_local : sc->cos_;
    const float *sin_ = L->local_rope ? sc->sin_local : sc->sin_;
    float eps = (float)m->eps, factor = (float)m->query_factor;
    for (int64_t b = b0; b < b0 + n; b++) {
        float *row = sc->qkv + b * qkv_width;
        if (L->q_norm) rmsnorm(row, L->q_norm, m->heads, D, eps, row); /* head by head */
        if (L->k_norm) rmsnorm(row + q_size, L->k_norm, m->kv_heads, D, eps, row + q_size);
        rotate(row, m->heads + m->kv_heads, D, cos_ + b * D / 2, sin_ + b * D / 2);
        for (int64_t i = 0; factor != 0.0f && factor != 1.0f && i < q_size; i++) row[i] *= factor;
    }
    write_kv(m, s, L->kv, sc->qkv, qkv_width, b0, n);
}

static void rows_act(const DecodeModel *m, Scratch *sc, int64_t b0, int64_t n) {
    int64_t I = m->intermediate;
    for (int64_t b = b0; b < b0 + n; b++) {
        (m->gelu ? gelu_mul : silu_mul)(sc->gu + b * 2 * I, sc->gu + b * 2 * I + I, I,
                                        sc->act + b * I);
    }
    quantize_rows(sc->act, b0, n, I, &sc->q);
}

/* The rows a thread takes at once in the row-wise steps: 8 for 16-bit products (their
 * rounding regroups scales 8 rows at a time), else 1. */
static int64_t rows_unit(const Quantized *q) { return q->bf16 ? 1 : 8; }

/* The rows of unit u of B rows: the first returned, their count in *n. */
static int64_t unit_rows(int64_t u, int64_t unit, int64_t B, int64_t *n) {
    *n = B - u * unit < unit ? B - u * unit : unit;
    return u * unit;
}

/* Runs STEP(b0, n) on every unit of rows, the units shared out among the threads (an orphaned
 * `omp for`, a barrier at its end). */
#define FOR_ROWS(STEP)                                                                         \
    do {                                                                                       \
        int64_t unit_ = rows_unit(&sc->q), n_;                                                 \
        _Pragma("omp for schedule(static)")                                                    \
        for (int64_t u_ = 0; u_ < (B + unit_ - 1) / unit_; u_++) {                             \
            int64_t b0_ = unit_rows(u_, unit_, B, &n_);                                        \
            STEP(b0_, n_);                                                                     \
        }                                                                                      \
    } while (0)

#define PHASES 8
#ifdef PROFILE_PHASES /* profiling only (decode_split.py --phases): process-wide timers */
/* Seconds thread 0 spent in each part of layer_forward: the input norm, QKV, the rotary step
 * with the attention, O, the post-attention norm, gate/up, the activation, down. */
static double phase_seconds[PHASES];
#define PHASE_START double phase_mark = omp_get_wtime()
#define PHASE(i)                                                                               \
    do {                                                                                       \
        _Pragma("omp master") {                                                                \
            double now = omp_get_wtime();                                                      \
            phase_seconds[i] += now - phase_mark;                                              \
            phase_mark = now;                                                                  \
        }                                                                                      \
    } while (0)
#else
#define PHASE_START
#define PHASE(i)
#endif

/* The seconds of each part of the layers since the last call, into out (PHASES of them);
 * returns PHASES, or 0 where the build does not time them (no -DPROFILE_PHASES). */
int phase_times(double *out) {
#ifdef PROFILE_PHASES
    for (int i = 0; i < PHASES; i++) {
        out[i] = phase_seconds[i];
        phase_seconds[i] = 0.0;
    }
    return PHASES;
#else
    (void)out;
    return 0;
#endif
}

/* One decoder layer over x [B, hidden], called by every thread of the step's parallel region:
 * the products and attention are shared out (team_linear, attention), and so are the small
 * row-wise steps between them, by rows (FOR_ROWS; on one thread, `omp single`, they left the
 * other waiting ~9% of a 16-row step). Each ends in a barrier. The last
 * product's output is left in sc->delta, added to x by the next layer (or decode_forward)
 * so that one barrier serves both. */
static void layer_forward(const DecodeModel *m, const DecodeLayer *L, const DecodeBatch *s,
                          float *x, Scratch *sc, int64_t chunks, const ChunkGroups *cg,
                          int add_delta, const float *delta_norm) {
    int64_t B = s->B, H = m->hidden, D = m->head_dim, I = m->intermediate;
    int64_t q_size = m->heads * D, qkv_width = q_size + 2 * m->kv_heads * D;
#define STEP_IN(b0, n) rows_in(m, x, L->input_norm, sc, add_delta, delta_norm, b0, n)
#define STEP_QK(b0, n) rows_qk(m, L, s, sc, b0, n)
#define STEP_ATTN(b0, n) quantize_rows(sc->attn, b0, n, q_size, &sc->q)
#define STEP_POST(b0, n) rows_in(m, x, L->post_norm, sc, 1, L->attn_out_norm, b0, n)
#define STEP_ACT(b0, n) rows_act(m, sc, b0, n)
    PHASE_START;
    FOR_ROWS(STEP_IN);
    PHASE(0);
    team_parts(L->qkv, L->qkv_fmt, L->qkv_rows, L->qkv_more, L->qkv_more_fmt, qkv_width, H,
               L->qkv_bias, &sc->q, B, sc->qkv);
    team_lora(L, 0, s->lora_slots, sc->h, B, H, qkv_width, sc->low, sc->qkv);
    PHASE(1);
    FOR_ROWS(STEP_QK);
    attention(m, s, L->kv, sc->qkv, qkv_width, sc->attn, chunks, sc->parts, cg);
    FOR_ROWS(STEP_ATTN);
    PHASE(2);
    team_linear(L->o, L->o_fmt, H, q_size, L->o_bias, &sc->q, B, sc->delta, H);
    team_lora(L, 1, s->lora_slots, sc->attn, B, q_size, H, sc->low, sc->delta);
    PHASE(3);
    FOR_ROWS(STEP_POST);
    PHASE(4);
    team_parts(L->gate_up, L->gate_up_fmt, L->gate_up_rows, L->gate_up_more,
               L->gate_up_more_fmt, 2 * I, H, L->gate_up_bias, &sc->q, B, sc->gu);
    team_lora(L, 2, s->lora_slots, sc->h, B, H, 2 * I, sc->low, sc->gu);
    PHASE(5);
    FOR_ROWS(STEP_ACT);
    PHASE(6);
    team_linear(L->down, L->down_fmt, H, I, L->down_bias, &sc->q, B, sc->delta, H);
    team_lora(L, 3, s->lora_slots, sc->act, B, I, H, sc->low, sc->delta);
    PHASE(7);
#undef STEP_IN
#undef STEP_QK
#undef STEP_ATTN
#undef STEP_POST
#undef STEP_ACT
}

/* The floats of a thread's `run` scratch: a block's keys or values widened to float, or, when
 * the queries are scored in bfloat16, the weights of up to `queries` queries over a chunk in
 * bfloat16 (attend512_T). */
static int64_t run_scratch_floats(const DecodeModel *m, int64_t queries) {
    int64_t widened = m->block_size * m->head_dim, weights = queries * CHUNK / 2;
    return (widened > weights ? widened : weights) + 16;
}

/* The bytes of a step's chunk groups and attention scratch (groups_init). */
static size_t groups_bytes(const DecodeModel *m, const DecodeBatch *s, int64_t chunks) {
    int64_t rows = s->B < MAX_GROUP_ROWS ? s->B : MAX_GROUP_ROWS;
    int64_t queries = rows * m->heads;
    int64_t pointers = (queries * (int64_t)sizeof(float *) + sizeof(float) - 1) / sizeof(float);
    int64_t thread_floats = queries * (CHUNK + m->head_dim + 2) + pointers +
                            run_scratch_floats(m, queries);
    return (size_t)(s->B * chunks) * (sizeof(ChunkGroup) + sizeof(int64_t)) +
           (size_t)(chunks + 1) * sizeof(int64_t) + (size_t)s->B +
           (size_t)(omp_get_max_threads() * thread_floats) * sizeof(float) + 64;
}

/* Lays a step's chunk groups and attention scratch out in p (groups_bytes of it) and plans
 * the groups (of rows attending over `window` positions; 0: their whole contexts). */
static void groups_init(const DecodeModel *m, const DecodeBatch *s, int64_t chunks,
                        int64_t window, char *p, ChunkGroups *cg) {
    int64_t slots = s->B * chunks, rows = s->B < MAX_GROUP_ROWS ? s->B : MAX_GROUP_ROWS;
    int64_t queries = rows * m->heads; /* a task's: its rows' query heads of every KV head */
    int64_t pointers = (queries * (int64_t)sizeof(float *) + sizeof(float) - 1) / sizeof(float);
    cg->queries = queries;
    cg->thread_floats = queries * (CHUNK + m->head_dim + 2) + pointers +
                        run_scratch_floats(m, queries);
    cg->groups = (ChunkGroup *)p;
    cg->members = (int64_t *)(cg->groups + slots);
    cg->chunk_first = cg->members + slots;
    cg->per_thread = (float *)(cg->chunk_first + chunks + 1);
    char *taken = (char *)(cg->per_thread + omp_get_max_threads() * cg->thread_floats);
    cg->window = window;
    cg->count = group_chunks(m, s, chunks, window, cg->groups, cg->members, cg->chunk_first,
                             taken);
}

/* The step's chunk groups and attention scratch, one allocation; 0, or -1 when out of memory. */
static int groups_alloc(const DecodeModel *m, const DecodeBatch *s, int64_t chunks,
                        int64_t window, ChunkGroups *cg) {
    char *p = malloc(groups_bytes(m, s, chunks));
    if (!p) return -1;
    groups_init(m, s, chunks, window, p, cg);
    return 0;
}

/* How many chunks of CHUNK positions the longest of the rows' contexts takes. */
static int64_t context_chunks(const DecodeBatch *s) {
    int64_t max_context = 1;
    for (int64_t b = 0; b < s->B; b++) {
        if (s->pos[b] + 1 > max_context) max_context = s->pos[b] + 1;
    }
    return (max_context + CHUNK - 1) / CHUNK;
}

/* The rotary angles' cosines and sines of every row: [B, head_dim / 2] each. */
static void rotary_tables(const DecodeModel *m, const DecodeBatch *s, const float *inv_freq,
                          float *cos_, float *sin_) {
    int64_t half = m->head_dim / 2;
    for (int64_t b = 0; b < s->B; b++) {
        for (int64_t i = 0; i < half; i++) {
            float angle = (float)s->pos[b] * inv_freq[i];
            cos_[b * half + i] = cosf(angle);
            sin_[b * half + i] = sinf(angle);
        }
    }
}

/* Frees the first n plans of cg and cg itself, and the scratch; returns -1 (out of memory). */
static int free_step(ChunkGroups *cg, int64_t n, Scratch *sc) {
    for (int64_t g = 0; g < n; g++) free(cg[g].groups);
    free(cg);
    free(sc->base);
    return -1;
}

/* Runs every layer over x [B, hidden] (the embeddings in, the last layer's output out); s is
 * one batch per KV cache group (DecodeModel.num_groups, one where that is 0). Returns 0, or
 * -1 when scratch memory could not be allocated (x is then unchanged). */
int decode_forward(const DecodeModel *m, const DecodeBatch *s, float *x) {
    Scratch sc;
    int64_t chunks = context_chunks(s), groups = m->num_groups > 1 ? m->num_groups : 1;
    if (scratch_alloc(m, s->B, chunks, &sc)) return -1;
    sc.q.bf16 = bf16_rows(m, s->B);
    sc.q.amx = amx_step(m, sc.q.bf16, s->B);
    ChunkGroups *cg = calloc((size_t)groups, sizeof(ChunkGroups));
    if (!cg) return free_step(cg, 0, &sc);
    for (int64_t g = 0; g < groups; g++) {
        if (groups_alloc(m, &s[g], chunks, m->windows ? m->windows[g] : 0, &cg[g])) {
            return free_step(cg, g, &sc);
        }
    }
    rotary_tables(m, s, m->inv_freq, sc.cos_, sc.sin_);
    if (m->inv_freq_local) rotary_tables(m, s, m->inv_freq_local, sc.cos_local, sc.sin_local);
    /* one parallel region for every layer: a team forked per product (about 150 a step), with
     * the scalar rounding, left one row's layers 1.2x slower (benchmarks/RESULTS.md) */
#pragma omp parallel
    {
        for (int64_t l = 0; l < m->num_layers; l++) {
            const DecodeLayer *L = &m->layers[l];
            layer_forward(m, L, &s[L->group], x, &sc, chunks, &cg[L->group], l > 0,
                          l > 0 ? m->layers[l - 1].mlp_out_norm : NULL);
        }
    }
    const float *last_norm = m->layers[m->num_layers - 1].mlp_out_norm;
    if (last_norm) rmsnorm(sc.delta, last_norm, s->B, m->hidden, (float)m->eps, sc.delta);
    for (int64_t i = 0; i < s->B * m->hidden; i++) x[i] += sc.delta[i];
    free_step(cg, groups, &sc);
    return 0;
}

/* Attention alone, for the rows of a step that the fused layers do not run (a prompt's
 * positions, each a row at its position of its sequence's table): attention_plan once a step
 * into `plan` (attention_plan_bytes of it, its alignment a float's; the rows attending over
 * a sliding window of `window` positions, or their whole contexts for 0), then attention_run
 * for each layer, with the layer's cache kv, the rows' queries q [B, heads * D] and out as
 * `attention` has them. The rows' K/V are in the cache already. */
int64_t attention_plan_bytes(const DecodeModel *m, const DecodeBatch *s) {
    int64_t chunks = context_chunks(s);
    return (int64_t)(sizeof(ChunkGroups) + groups_bytes(m, s, chunks)) +
           s->B * m->heads * chunks * (m->head_dim + 2) * (int64_t)sizeof(float);
}

void attention_plan(const DecodeModel *m, const DecodeBatch *s, int64_t window, void *plan) {
    ChunkGroups *cg = (ChunkGroups *)plan;
    int64_t chunks = context_chunks(s);
    groups_init(m, s, chunks, window, (char *)plan + sizeof(ChunkGroups), cg);
}

void attention_run(const DecodeModel *m, const DecodeBatch *s, const void *plan, const void *kv,
                   const float *q, float *out) {
    const ChunkGroups *cg = (const ChunkGroups *)plan;
    int64_t chunks = context_chunks(s);
    float *parts = (float *)((char *)plan + sizeof(ChunkGroups) + groups_bytes(m, s, chunks));
#pragma omp parallel
    attention(m, s, kv, q, m->heads * m->head_dim, out, chunks, parts, cg);
}

/* Whether this build attends in bfloat16 over a bfloat16 cache with vdpbf16ps (scores_bf16,
 * pv_bf16; DecodeModel.bf16_queries asks for it). Without AVX512-BF16 the flag is ignored. */
int attention_has_bf16_form(void) {
#if defined(__AVX512F__)
    return bf16_attention_built();
#else
    return 0;
#endif
}

/* Whether attention at head size D has its 512-bit form in this build (attend512_T). */
int attention_has_fast_form(int64_t D) {
#if defined(__AVX512F__)
    return ATTEND512(D);
#else
    (void)D;
    return 0;
#endif
}
