/*
 * The fused decode forward pass: every decoder layer of a Llama-family model for a batch of
 * sequences that each add one token, in one call, over the paged KV cache.
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
 * The result is x before the final norm, as CausalLM.forward returns it. Only float32
 * activations and cache; prefixserve.model.fused_decode decides when this path applies.
 *
 * Built and loaded like quant.c (prefixserve.model.quant_kernels.load_library); the build key
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
} DecodeLayer;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate;
    int64_t block_size, num_slots, kv_bf16;
    double eps;
    const float *inv_freq; /* [head_dim / 2] rotary inverse frequencies */
    const DecodeLayer *layers;
} DecodeModel;

/* The step's rows: row b is at position pos[b] (its context is pos[b] + 1 tokens) and its
 * block table is tables[rows[b] * table_stride ...]. */
typedef struct {
    int64_t B;
    const int64_t *pos;
    const int64_t *tables;
    const int64_t *rows;
    int64_t table_stride;
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
static void exp_inplace(float *x, int64_t n) {
    int64_t i = 0;
#ifdef __AVX2__
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp8(_mm256_loadu_ps(x + i)));
#endif
    for (; i < n; i++) x[i] = expf(x[i]);
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

/* Scratch of one call: 16-bit activations and their block scales and sums. */
typedef struct {
    int16_t *xq;
    float *xd, *xs;
} Quantized;

/* y [B, N] = x [B, K] W^T (+ bias), W packed in format fmt. */
static void linear(const uint8_t *W, int64_t fmt, int64_t N, int64_t K, const float *bias,
                   const float *x, int64_t B, const Quantized *q, float *y) {
    quantize_q16(x, B, K, q->xq, q->xd, q->xs);
    gemm_quant16_batch(W, (int)fmt, N, K, q->xq, q->xd, q->xs, B, y, N);
    if (bias) {
        for (int64_t b = 0; b < B; b++) {
            for (int64_t n = 0; n < N; n++) y[b * N + n] += bias[n];
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

/* The cache holds float32 or, with kv_bf16 set, bfloat16 (the upper half of a float32,
 * rounded to nearest even as torch rounds). Offsets below are in elements. */
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

static inline int64_t slot_of(const DecodeModel *m, const DecodeBatch *s, int64_t b, int64_t p) {
    const int64_t *table = s->tables + s->rows[b] * s->table_stride;
    return table[p / m->block_size] * m->block_size + p % m->block_size;
}

/* Keys of a row are attended in chunks of this many positions, each chunk a task of its own,
 * and the chunks' partial results merged: a single sequence's attention then spreads over the
 * threads too. (At most 64 query heads per KV head: prefixserve.model.fused_decode checks.) */
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
#endif
#define SCALAR_f32(x) (x)
#define SCALAR_bf16(x) bf16_to_float(x)

/* For cache element type T (f32: float, bf16: uint16_t) and head size DD (0: any, scalar):
 *   dot_DD_T(q, k, D): q . k;
 *   values_DD_T(...): out [D] = sum over positions [t0, t1) of p[t - t0] * v_t, the values at
 *     element offset base of each position's slot (stride elements per slot), accumulated in
 *     registers for DD 64 and 128. */
#define DEFINE_SCALAR(T, C)                                                                    \
    static float dot_0_##T(const float *a, const C *b, int64_t D) {                             \
        float total = 0.0f;                                                                    \
        for (int64_t d = 0; d < D; d++) total += a[d] * SCALAR_##T(b[d]);                      \
        return total;                                                                          \
    }                                                                                          \
    static void values_0_##T(const C *kv, const int64_t *table, int64_t bs, int64_t stride,    \
                             int64_t base, int64_t D, int64_t t0, int64_t t1, const float *p,  \
                             float *out) {                                                     \
        memset(out, 0, (size_t)D * sizeof(float));                                             \
        for (int64_t t = t0; t < t1;) {                                                        \
            int64_t end = run_end(t, t1, bs);                                                  \
            const C *row = kv + (table[t / bs] * bs + t % bs) * stride + base;                 \
            for (; t < end; t++, row += stride) {                                              \
                float w = p[t - t0];                                                           \
                for (int64_t d = 0; d < D; d++) out[d] += w * SCALAR_##T(row[d]);              \
            }                                                                                  \
        }                                                                                      \
    }
DEFINE_SCALAR(f32, float)
DEFINE_SCALAR(bf16, uint16_t)

#ifdef __AVX2__
#define DEFINE_VECTOR(DD, T, C)                                                                \
    static inline float dot_##DD##_##T(const float *a, const C *b) {                           \
        __m256 x = _mm256_setzero_ps(), y = _mm256_setzero_ps();                               \
        for (int v = 0; v < DD; v += 16) {                                                     \
            x = _mm256_fmadd_ps(_mm256_loadu_ps(a + v), LOAD_##T(b + v), x);                   \
            y = _mm256_fmadd_ps(_mm256_loadu_ps(a + v + 8), LOAD_##T(b + v + 8), y);           \
        }                                                                                      \
        return hsum(_mm256_add_ps(x, y));                                                      \
    }                                                                                          \
    static void values_##DD##_##T(const C *kv, const int64_t *table, int64_t bs,               \
                                  int64_t stride, int64_t base, int64_t t0, int64_t t1,        \
                                  const float *p, float *out) {                                \
        __m256 acc[DD / 8];                                                                    \
        for (int v = 0; v < DD / 8; v++) acc[v] = _mm256_setzero_ps();                         \
        for (int64_t t = t0; t < t1;) {                                                        \
            int64_t end = run_end(t, t1, bs);                                                  \
            const C *row = kv + (table[t / bs] * bs + t % bs) * stride + base;                 \
            for (; t < end; t++, row += stride) {                                              \
                __m256 w = _mm256_set1_ps(p[t - t0]);                                          \
                for (int v = 0; v < DD / 8; v++) {                                             \
                    acc[v] = _mm256_fmadd_ps(w, LOAD_##T(row + 8 * v), acc[v]);                \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int v = 0; v < DD / 8; v++) _mm256_storeu_ps(out + 8 * v, acc[v]);                \
    }
DEFINE_VECTOR(64, f32, float)
DEFINE_VECTOR(128, f32, float)
DEFINE_VECTOR(64, bf16, uint16_t)
DEFINE_VECTOR(128, bf16, uint16_t)
#endif

/* Partial attention of the `group` query heads q [group, D] that share KV head g, over
 * positions [t0, t1) of row b: for head r, mx[r] = the largest score, sm[r] = sum of
 * exp(score - mx[r]) and out [r * D ...] = that sum weighted by the values. scores holds
 * group * CHUNK floats. One definition per cache element type. */
#ifdef __AVX2__
#define HEAD_DOT(T, a, b, D)                                                                   \
    ((D) == 64 ? dot_64_##T(a, b) : (D) == 128 ? dot_128_##T(a, b) : dot_0_##T(a, b, D))
#define HEAD_VALUES(T, kv, table, bs, stride, base, D, t0, t1, p, out)                         \
    do {                                                                                       \
        if ((D) == 64) values_64_##T(kv, table, bs, stride, base, t0, t1, p, out);             \
        else if ((D) == 128) values_128_##T(kv, table, bs, stride, base, t0, t1, p, out);      \
        else values_0_##T(kv, table, bs, stride, base, D, t0, t1, p, out);                     \
    } while (0)
#else
#define HEAD_DOT(T, a, b, D) dot_0_##T(a, b, D)
#define HEAD_VALUES(T, kv, table, bs, stride, base, D, t0, t1, p, out)                         \
    values_0_##T(kv, table, bs, stride, base, D, t0, t1, p, out)
#endif

#define DEFINE_ATTEND(T, C)                                                                    \
    static void attend_chunk_##T(const DecodeModel *m, const DecodeBatch *s, const C *kv,       \
                                 int64_t b, int64_t g, const float *q, int64_t group,           \
                                 int64_t t0, int64_t t1, float *scores, float *out, float *mx,  \
                                 float *sm) {                                                   \
        int64_t D = m->head_dim, bs = m->block_size, n = t1 - t0;                              \
        int64_t stride = m->kv_heads * D;                                                      \
        const int64_t *table = s->tables + s->rows[b] * s->table_stride;                       \
        float scale = 1.0f / sqrtf((float)D);                                                  \
        for (int64_t t = t0; t < t1;) {                                                        \
            int64_t end = run_end(t, t1, bs);                                                  \
            const C *k = kv + cache_offset(m, 0, table[t / bs] * bs + t % bs, g);              \
            for (; t < end; t++, k += stride) {                                                \
                for (int64_t r = 0; r < group; r++) {                                          \
                    scores[r * CHUNK + t - t0] = HEAD_DOT(T, q + r * D, k, D) * scale;         \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int64_t r = 0; r < group; r++) {                                                  \
            float *row = scores + r * CHUNK, top = -INFINITY, total = 0.0f;                    \
            for (int64_t i = 0; i < n; i++) top = row[i] > top ? row[i] : top;                 \
            for (int64_t i = 0; i < n; i++) row[i] -= top;                                     \
            exp_inplace(row, n);                                                               \
            for (int64_t i = 0; i < n; i++) total += row[i];                                   \
            mx[r] = top;                                                                       \
            sm[r] = total;                                                                     \
            HEAD_VALUES(T, kv + m->num_slots * stride, table, bs, stride, g * D, D, t0, t1,    \
                        row, out + r * D);                                                     \
        }                                                                                      \
    }
DEFINE_ATTEND(f32, float)
DEFINE_ATTEND(bf16, uint16_t)

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
 * B * heads * chunks * (D + 2) floats, chunks = ceil(longest context / CHUNK). */
static void attention(const DecodeModel *m, const DecodeBatch *s, const void *kv,
                      const float *qkv, int64_t qkv_width, float *out, int64_t chunks,
                      float *parts) {
    int64_t D = m->head_dim, group = m->heads / m->kv_heads, part = D + 2;
    int64_t tasks = s->B * m->kv_heads * chunks;
#pragma omp parallel if (tasks > 1)
    {
        float *scores = malloc((size_t)(group * CHUNK) * sizeof(float));
        float mx[64], sm[64], *o = malloc((size_t)(group * D) * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            /* rows vary fastest: rows that share their first blocks (a system prompt) read
             * them in consecutive tasks, mostly from cache */
            int64_t b = task % s->B, g = task / s->B % m->kv_heads, c = task / s->B / m->kv_heads;
            int64_t n = s->pos[b] + 1, t0 = c * CHUNK, t1 = t0 + CHUNK < n ? t0 + CHUNK : n;
            if (t0 >= n) continue;
            const float *q = qkv + b * qkv_width + g * group * D;
            if (m->kv_bf16) {
                attend_chunk_bf16(m, s, kv, b, g, q, group, t0, t1, scores, o, mx, sm);
            } else {
                attend_chunk_f32(m, s, kv, b, g, q, group, t0, t1, scores, o, mx, sm);
            }
            for (int64_t r = 0; r < group; r++) {
                float *dst = parts + ((b * m->heads + g * group + r) * chunks + c) * part;
                memcpy(dst, o + r * D, (size_t)D * sizeof(float));
                dst[D] = mx[r];
                dst[D + 1] = sm[r];
            }
        }
        free(scores);
        free(o);
    }
    for (int64_t b = 0; b < s->B; b++) {
        int64_t used = (s->pos[b] + 1 + CHUNK - 1) / CHUNK;
        for (int64_t h = 0; h < m->heads; h++) {
            merge_chunks(parts + (b * m->heads + h) * chunks * part, used, D,
                         out + (b * m->heads + h) * D);
        }
    }
}

static void write_kv(const DecodeModel *m, const DecodeBatch *s, void *kv, const float *qkv,
                     int64_t qkv_width) {
    int64_t D = m->head_dim, kv_size = m->kv_heads * D, q_size = m->heads * D;
    for (int64_t b = 0; b < s->B; b++) {
        int64_t slot = slot_of(m, s, b, s->pos[b]);
        const float *k = qkv + b * qkv_width + q_size;
        for (int64_t which = 0; which < 2; which++) {
            const float *src = k + which * kv_size;
            int64_t at = cache_offset(m, which, slot, 0);
            if (m->kv_bf16) {
                uint16_t *dst = (uint16_t *)kv + at;
                for (int64_t i = 0; i < kv_size; i++) dst[i] = float_to_bf16(src[i]);
            } else {
                memcpy((float *)kv + at, src, (size_t)kv_size * sizeof(float));
            }
        }
    }
}

static float silu(float g) { return g / (1.0f + expf(-g)); }

/* Scratch buffers of a forward pass, one allocation. */
typedef struct {
    float *h, *qkv, *attn, *gu, *act, *delta, *cos_, *sin_, *parts;
    Quantized q;
    void *base;
} Scratch;

static int scratch_alloc(const DecodeModel *m, int64_t B, int64_t chunks, Scratch *sc) {
    int64_t H = m->hidden, D = m->head_dim, I = m->intermediate;
    int64_t qkv_width = (m->heads + 2 * m->kv_heads) * D, widest = I > H ? I : H;
    if (m->heads * D > widest) widest = m->heads * D;
    int64_t floats = B * (H + qkv_width + m->heads * D + 2 * I + I + H + D) + 2 * B * widest / QK
                     + B * m->heads * chunks * (D + 2);
    int64_t bytes = floats * (int64_t)sizeof(float) + B * widest * (int64_t)sizeof(int16_t) + 64;
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
    sc->q.xd = f; f += B * widest / QK;
    sc->q.xs = f; f += B * widest / QK;
    sc->parts = f; f += B * m->heads * chunks * (D + 2);
    sc->q.xq = (int16_t *)f;
    return 0;
}

static void layer_forward(const DecodeModel *m, const DecodeLayer *L, const DecodeBatch *s,
                          float *x, Scratch *sc, int64_t chunks) {
    int64_t B = s->B, H = m->hidden, D = m->head_dim, I = m->intermediate;
    int64_t q_size = m->heads * D, qkv_width = q_size + 2 * m->kv_heads * D;
    float eps = (float)m->eps;
    rmsnorm(x, L->input_norm, B, H, eps, sc->h);
    linear(L->qkv, L->qkv_fmt, qkv_width, H, L->qkv_bias, sc->h, B, &sc->q, sc->qkv);
    for (int64_t b = 0; b < B; b++) {
        rotate(sc->qkv + b * qkv_width, m->heads + m->kv_heads, D, sc->cos_ + b * D / 2,
               sc->sin_ + b * D / 2);
    }
    write_kv(m, s, L->kv, sc->qkv, qkv_width);
    attention(m, s, L->kv, sc->qkv, qkv_width, sc->attn, chunks, sc->parts);
    linear(L->o, L->o_fmt, H, q_size, L->o_bias, sc->attn, B, &sc->q, sc->delta);
    for (int64_t i = 0; i < B * H; i++) x[i] += sc->delta[i];
    rmsnorm(x, L->post_norm, B, H, eps, sc->h);
    linear(L->gate_up, L->gate_up_fmt, 2 * I, H, L->gate_up_bias, sc->h, B, &sc->q, sc->gu);
    for (int64_t b = 0; b < B; b++) {
        const float *gate = sc->gu + b * 2 * I, *up = gate + I;
        for (int64_t i = 0; i < I; i++) sc->act[b * I + i] = silu(gate[i]) * up[i];
    }
    linear(L->down, L->down_fmt, H, I, L->down_bias, sc->act, B, &sc->q, sc->delta);
    for (int64_t i = 0; i < B * H; i++) x[i] += sc->delta[i];
}

/* Runs every layer over x [B, hidden] (the embeddings in, the last layer's output out).
 * Returns 0, or -1 when scratch memory could not be allocated (x is then unchanged). */
int decode_forward(const DecodeModel *m, const DecodeBatch *s, float *x) {
    Scratch sc;
    int64_t half = m->head_dim / 2, max_context = 1;
    for (int64_t b = 0; b < s->B; b++) {
        if (s->pos[b] + 1 > max_context) max_context = s->pos[b] + 1;
    }
    int64_t chunks = (max_context + CHUNK - 1) / CHUNK;
    if (scratch_alloc(m, s->B, chunks, &sc)) return -1;
    for (int64_t b = 0; b < s->B; b++) {
        for (int64_t i = 0; i < half; i++) {
            float angle = (float)s->pos[b] * m->inv_freq[i];
            sc.cos_[b * half + i] = cosf(angle);
            sc.sin_[b * half + i] = sinf(angle);
        }
    }
    for (int64_t l = 0; l < m->num_layers; l++) layer_forward(m, &m->layers[l], s, x, &sc,
                                                              chunks);
    free(sc.base);
    return 0;
}
