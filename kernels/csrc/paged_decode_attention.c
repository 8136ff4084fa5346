/* Paged decode attention for the CPU, fp32: one query token per sequence, K/V read in place
 * through the block table (the PyTorch path in reference.py first gathers them into a dense
 * copy, which costs more memory traffic than the attention itself).
 *
 * Layouts:
 *   q             [num_seqs, num_heads, head_dim], rows q_stride floats apart (q is a view of
 *                 the fused qkv projection), heads packed
 *   out           [num_seqs, num_heads, head_dim], contiguous
 *   k/v cache     [num_blocks, block_size, num_kv_heads, head_dim], contiguous; token t of
 *                 sequence s is row  block_tables[s, t / block_size] * block_size + t % block_size
 *   block_tables  int32 [num_seqs, max_blocks]      context_lens int32 [num_seqs]
 *
 * One work item = one sequence, all its heads: a token's K (or V) rows for every KV head are
 * one contiguous run, read front to back; query head h uses KV head h / group (GQA). Items go
 * to OpenMP threads with a dynamic schedule (contexts differ in length). Softmax is exact, two
 * passes over the scores (max, then exp and sum); a context of 0 tokens gives 0, as in
 * reference.py.
 *
 * Speed notes (measured on the 2-core dev machine, batch 32, contexts ~310, 30 layers):
 * - blocks are scattered over the cache and the hardware prefetcher does not follow the block
 *   table, so the row PREFETCH_TOKENS ahead is asked for explicitly (1.5-3x);
 * - a sequence's whole token row per item instead of one KV head's slice: 43 -> 35 ms a step;
 * - constant head sizes (64, 128) let the dot and axpy loops unroll: another ~8%.
 *
 * Returns 0; -1 if a score buffer could not be allocated; -2 if a block table entry that a
 * context needs is out of range or a length is negative (checked before any K/V is read).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PREFETCH_TOKENS 8
#define INLINE static inline __attribute__((always_inline))

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int32_t *block_tables, *context_lens;
    float *out;
    int64_t q_stride, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
    float scale;
} decode_args;

INLINE float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

INLINE void axpy(float *y, float w, const float *x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += w * x[i];
}

INLINE void prefetch(const float *p, int64_t n) {
    for (int64_t off = 0; off < n; off += 64 / sizeof(float)) __builtin_prefetch(p + off);
}

/* Token t's rows, all KV heads: [num_kv_heads, head_dim], contiguous. */
INLINE const float *token_rows(const decode_args *a, const float *cache, const int32_t *table, int64_t t) {
    int64_t slot = (int64_t)table[t / a->block_size] * a->block_size + t % a->block_size;
    return cache + slot * a->num_kv_heads * a->head_dim;
}

/* In place: scores -> exp(scores - max); returns their sum. */
static float softmax_numerators(float *scores, int64_t ctx) {
    float max = -INFINITY, sum = 0.0f;
    for (int64_t t = 0; t < ctx; t++) max = scores[t] > max ? scores[t] : max;
    for (int64_t t = 0; t < ctx; t++) {
        scores[t] = expf(scores[t] - max);
        sum += scores[t];
    }
    return sum;
}

/* scores[h * ctx + t] = scale * q_h . k_t for every query head h. */
INLINE void qk_scores(const decode_args *a, const int32_t *table, const float *q, int64_t ctx,
                      float *scores, const int64_t d) {
    int64_t group = a->num_heads / a->num_kv_heads, row = a->num_kv_heads * d;
    for (int64_t t = 0; t < ctx; t++) {
        const float *k = token_rows(a, a->k_cache, table, t);
        if (t + PREFETCH_TOKENS < ctx) prefetch(token_rows(a, a->k_cache, table, t + PREFETCH_TOKENS), row);
        for (int64_t h = 0; h < a->num_heads; h++)
            scores[h * ctx + t] = dot(q + h * d, k + (h / group) * d, d) * a->scale;
    }
}

/* out_h = sum_t p_h[t] v_t, with p the normalized softmax of the scores. */
INLINE void weighted_values(const decode_args *a, const int32_t *table, const float *scores,
                            const float *inv_sum, int64_t ctx, float *out, const int64_t d) {
    int64_t group = a->num_heads / a->num_kv_heads, row = a->num_kv_heads * d;
    for (int64_t t = 0; t < ctx; t++) {
        const float *v = token_rows(a, a->v_cache, table, t);
        if (t + PREFETCH_TOKENS < ctx) prefetch(token_rows(a, a->v_cache, table, t + PREFETCH_TOKENS), row);
        for (int64_t h = 0; h < a->num_heads; h++)
            axpy(out + h * d, scores[h * ctx + t] * inv_sum[h], v + (h / group) * d, d);
    }
}

INLINE void attend_d(const decode_args *a, int64_t seq, float *scores, const int64_t d) {
    int64_t heads = a->num_heads, ctx = a->context_lens[seq];
    const int32_t *table = a->block_tables + seq * a->max_blocks;
    float *out = a->out + seq * heads * d;
    memset(out, 0, sizeof(float) * heads * d);
    if (ctx == 0) return;
    qk_scores(a, table, a->q + seq * a->q_stride, ctx, scores, d);
    float inv_sum[heads];
    for (int64_t h = 0; h < heads; h++) inv_sum[h] = 1.0f / softmax_numerators(scores + h * ctx, ctx);
    weighted_values(a, table, scores, inv_sum, ctx, out, d);
}

static void attend(const decode_args *a, int64_t seq, float *scores) {
    switch (a->head_dim) { /* constant head sizes: the inner loops unroll completely */
        case 64: attend_d(a, seq, scores, 64); break;
        case 128: attend_d(a, seq, scores, 128); break;
        default: attend_d(a, seq, scores, a->head_dim);
    }
}

/* Every block a context needs is a real block; returns the longest context (at least 1), or -1. */
static int64_t check_tables(const decode_args *a, int64_t num_seqs, int64_t num_blocks) {
    int64_t max_ctx = 1;
    for (int64_t s = 0; s < num_seqs; s++) {
        int64_t ctx = a->context_lens[s], used = (ctx + a->block_size - 1) / a->block_size;
        if (ctx < 0 || used > a->max_blocks) return -1;
        for (int64_t b = 0; b < used; b++) {
            int32_t block = a->block_tables[s * a->max_blocks + b];
            if (block < 0 || block >= num_blocks) return -1;
        }
        max_ctx = ctx > max_ctx ? ctx : max_ctx;
    }
    return max_ctx;
}

int paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                               const int32_t *block_tables, const int32_t *context_lens, float *out,
                               int64_t num_seqs, int64_t q_stride, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t num_blocks, int64_t block_size,
                               int64_t max_blocks, float scale, int num_threads) {
    decode_args a = {q, k_cache, v_cache, block_tables, context_lens, out, q_stride,
                     num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale};
    int64_t max_ctx = check_tables(&a, num_seqs, num_blocks), failed = 0;
    if (max_ctx < 0) return -2;
#pragma omp parallel num_threads(num_threads) reduction(+ : failed)
    {
        float *scores = malloc(sizeof(float) * num_heads * max_ctx);
        failed += scores == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t seq = 0; seq < num_seqs; seq++)
            if (scores) attend(&a, seq, scores);
        free(scores);
    }
    return failed ? -1 : 0;
}
