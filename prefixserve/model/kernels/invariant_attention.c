/*
 * Batch-invariant paged attention for the deterministic mode (prefixserve.model.attention.batch_invariant).
 *
 * Every query row attends to the keys 0..pos of its own sequence, read from the paged KV cache
 * through the sequence's block table, whatever else is in the step: a prompt computed at once,
 * in chunks, over a cached prefix, or a decode step all run the same arithmetic for a row. The
 * keys are split into KV blocks (block_size positions each, the cache's own blocks: a fixed
 * split that no cache hit or chunk boundary moves). For each block, in order from the first,
 * the kernel computes the row's scores, their maximum, the exponentials' sum and the weighted
 * sum of values, and merges that partial result into the running one by log-sum-exp (rescaling
 * both by their maxima). All sums run in a fixed order: dot products in 8 lanes (32 from a
 * head size of 128) summed in a fixed tree, block sums key by key. So a row's output is a
 * function of its query, its position and its sequence's keys and values only: bitwise the
 * same in any batch.
 *
 * Layout: q and out are float32 [N, H, D] (contiguous); the cache's K and V are [slots, KVH, D]
 * of float32 (is_bf16 = 0) or bfloat16 bits (is_bf16 = 1); tables is int64 [*, table_stride]
 * (table_of_row[n] picks row n's table), pos_of_row[n] the position of row n's query.
 * Query heads h of KV head g are g * (H / KVH) .. (g + 1) * (H / KVH) - 1 (grouped queries).
 * With a sliding window (window > 0) a row at position pos attends to the keys
 * max(0, pos + 1 - window) .. pos only: the loop starts at the block holding the first of them
 * and skips the earlier positions of that block. The split is still the cache's blocks, and
 * the table entries of blocks before the first are never read (the KV cache manager may have
 * put the null block there).
 * The work is split over (row, KV head) pairs (OpenMP); each pair is computed by one thread
 * start to end, so the thread count changes no result either.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 8
/* Partial sums of a dot product of WIDE_FROM or more elements: 32, so that the compiler keeps
 * four (or, at 512 bits, two) independent vector accumulators: with 8 (one vector) every add
 * waits for the one before it, and Gemma 3's dot products of 256 ran at a quarter of the adder's
 * rate (2.5-4x slower). Shorter ones keep 8, whose smaller tree costs less (SmolLM2's 64). The
 * choice is a function of the head size alone, the same for every row and batch. */
#define WIDE_LANES 32
#define WIDE_FROM 128

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

/* Row `slot` of K or V for KV head g, as float32 into dst (D values). */
static inline void load_row(const void *cache, int is_bf16, int64_t slot, int64_t KVH,
                            int64_t g, int64_t D, float *dst) {
    int64_t offset = (slot * KVH + g) * D;
    if (is_bf16) {
        const uint16_t *src = (const uint16_t *)cache + offset;
        for (int64_t d = 0; d < D; d++) dst[d] = bf16_to_float(src[d]);
    } else {
        memcpy(dst, (const float *)cache + offset, (size_t)D * sizeof(float));
    }
}

/* sum(a[d] * b[d]) in LANES partial sums (d mod LANES), then the tail, then a fixed tree. */
static inline float dot(const float *a, const float *b, int64_t D) {
    float acc[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= D; d += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[d + l] * b[d + l];
    for (int l = 0; d < D; d++, l++) acc[l] += a[d] * b[d];
    float s01 = acc[0] + acc[1], s23 = acc[2] + acc[3], s45 = acc[4] + acc[5],
          s67 = acc[6] + acc[7];
    return (s01 + s23) + (s45 + s67);
}

/* As dot in WIDE_LANES partial sums, summed in a fixed tree (lane l + w into lane l, for
 * w = WIDE_LANES / 2, ..., 1). */
static inline float dot_wide(const float *a, const float *b, int64_t D) {
    float acc[WIDE_LANES] = {0};
    int64_t d = 0;
    for (; d + WIDE_LANES <= D; d += WIDE_LANES)
        for (int l = 0; l < WIDE_LANES; l++) acc[l] += a[d + l] * b[d + l];
    for (int l = 0; d < D; d++, l++) acc[l] += a[d] * b[d];
    for (int w = WIDE_LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

/*
 * One (row, KV head) pair: P query heads q[P][D] over keys begin..last of the sequence whose block
 * table is `table`. Scratch: keys[block_size][D], vals[D], scores[P][block_size],
 * block_out[P][D], acc[P][D]. Writes out[P][D] (heads of one KV head are adjacent).
 */
static void attend(const float *q, const void *kc, const void *vc, int is_bf16, int64_t KVH,
                   int64_t g, int64_t D, int64_t P, int64_t block_size, const int64_t *table,
                   int64_t begin, int64_t last, float scale, float *scratch, float *out) {
    float *keys = scratch;
    float *vals = keys + block_size * D;
    float *scores = vals + D;
    int64_t stride = block_size + 1; /* a head's scores, then its block's merge weight */
    float *block_out = scores + P * stride;
    float *acc = block_out + P * D;
    float run_max[P], run_sum[P];
    for (int64_t p = 0; p < P; p++) {
        run_max[p] = -INFINITY;
        run_sum[p] = 0.0f;
    }
    memset(acc, 0, (size_t)(P * D) * sizeof(float));
    for (int64_t b = begin / block_size; b * block_size <= last; b++) {
        /* keys first .. end - 1 of this block: from the window's start on, up to last */
        int64_t first = b * block_size > begin ? b * block_size : begin;
        int64_t end = (b + 1) * block_size < last + 1 ? (b + 1) * block_size : last + 1;
        int64_t n = end - first;
        int64_t base = table[b] * block_size + (first - b * block_size);
        for (int64_t j = 0; j < n; j++) load_row(kc, is_bf16, base + j, KVH, g, D, keys + j * D);
        for (int64_t p = 0; p < P; p++) {
            float m = -INFINITY;
            for (int64_t j = 0; j < n; j++) {
                float s = (D >= WIDE_FROM ? dot_wide(q + p * D, keys + j * D, D)
                                          : dot(q + p * D, keys + j * D, D)) * scale;
                scores[p * stride + j] = s;
                m = s > m ? s : m;
            }
            float total = 0.0f;
            for (int64_t j = 0; j < n; j++) {
                float e = expf(scores[p * stride + j] - m);
                scores[p * stride + j] = e;
                total += e;
            }
            /* merge the block's (max m, sum total) into the running pair */
            float new_max = run_max[p] > m ? run_max[p] : m;
            float keep = expf(run_max[p] - new_max), add = expf(m - new_max);
            run_sum[p] = run_sum[p] * keep + total * add;
            run_max[p] = new_max;
            float *o = block_out + p * D;
            memset(o, 0, (size_t)D * sizeof(float));
            scores[p * stride + n] = add; /* the block's weight, read below */
            float *a = acc + p * D;
            for (int64_t d = 0; d < D; d++) a[d] *= keep;
        }
        for (int64_t j = 0; j < n; j++) {
            load_row(vc, is_bf16, base + j, KVH, g, D, vals);
            for (int64_t p = 0; p < P; p++) {
                float e = scores[p * stride + j];
                float *o = block_out + p * D;
                for (int64_t d = 0; d < D; d++) o[d] += e * vals[d];
            }
        }
        for (int64_t p = 0; p < P; p++) {
            float add = scores[p * stride + n];
            float *a = acc + p * D, *o = block_out + p * D;
            for (int64_t d = 0; d < D; d++) a[d] += o[d] * add;
        }
    }
    for (int64_t p = 0; p < P; p++) {
        float inv = 1.0f / run_sum[p];
        for (int64_t d = 0; d < D; d++) out[p * D + d] = acc[p * D + d] * inv;
    }
}

void invariant_attention(const float *q, int64_t N, int64_t H, int64_t D, const void *k_cache,
                         const void *v_cache, int is_bf16, int64_t KVH, int64_t block_size,
                         const int64_t *tables, int64_t table_stride,
                         const int64_t *table_of_row, const int64_t *pos_of_row,
                         int64_t window, float scale, float *out) {
    int64_t P = H / KVH;
    /* block_size + 1 score slots per head: the last holds the block's merge weight */
    int64_t scratch_floats = block_size * D + D + P * (block_size + 1) + 2 * P * D;
    int64_t pairs = N * KVH;
#pragma omp parallel
    {
        float *scratch = malloc((size_t)scratch_floats * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t i = 0; i < pairs; i++) {
            int64_t n = i / KVH, g = i % KVH;
            const int64_t *table = tables + table_of_row[n] * table_stride;
            int64_t last = pos_of_row[n];
            int64_t begin = window > 0 && last + 1 > window ? last + 1 - window : 0;
            attend(q + (n * H + g * P) * D, k_cache, v_cache, is_bf16, KVH, g, D, P,
                   block_size, table, begin, last, scale, scratch, out + (n * H + g * P) * D);
        }
        free(scratch);
    }
}
