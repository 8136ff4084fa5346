/* Paged decode attention for the CPU, fp32 queries and outputs over an fp32 or fp16 K/V cache
 * (kv_half; the halves are widened as they are loaded, all arithmetic in fp32): one query token
 * per sequence, K/V read in place
 * through the block table (the PyTorch path in reference.py first gathers them into a dense
 * copy, which costs more memory traffic than the attention itself).
 *
 * Layouts:
 *   q             [num_seqs, num_heads, head_dim], rows q_stride floats apart (q is a view of
 *                 the fused qkv projection), heads packed
 *   out           [num_seqs, num_heads, head_dim], contiguous
 *   k/v cache     [num_blocks, block_size, num_kv_heads, head_dim], contiguous, float or
 *                 fp16 bits (kv_half); token t of
 *                 sequence s is row  block_tables[s, t / block_size] * block_size + t % block_size
 *   block_tables  int32 [num_seqs, max_blocks]      context_lens int32 [num_seqs]
 *   head_dim      a multiple of 16 (VEC floats) up to 256; else the call returns -3
 *
 * One work item = up to PART_TOKENS (512) tokens of one sequence's context, all its heads, one
 * cache block at a time (flash-decoding's online softmax): a block's scores for every head,
 * then the running max and sum are updated and the block's V rows added in, so each block's K
 * and V are read once, while in L1. A longer context is split into several items, whose partial
 * results are combined at the end (rescaled to the common max), so one long sequence alone still
 * uses every thread. Query head h uses KV head h / group (GQA). Items go to OpenMP threads with
 * a dynamic schedule (contexts differ in length); the split and every item's order are fixed,
 * so the result does not depend on the thread count. A context of 0 tokens gives 0, as in
 * reference.py.
 *
 * Speed notes (2-core dev machine, batch 32, contexts 173-440, 30 layers: ~450 MB of K/V read
 * per step; a pass that only reads those bytes the same way takes 19-22 ms):
 * - blocks are scattered over the cache and the hardware prefetcher does not follow the block
 *   table, so the next block's rows are requested while this one is computed, a row of K and V
 *   per token (a burst of a whole block at once stalled on the memory queues: ~10% slower);
 * - vectors of 16 floats (GCC/Clang vector extensions: AVX-512, or pairs of AVX2 registers),
 *   the head size a compile-time constant for 64 and 128, the q rows (scores) and output rows
 *   (values) of up to 4 heads held in registers, exp computed 16 lanes at a time, FMA
 *   contraction on (-ffp-contract=fast; ISO C mode forbids it otherwise): with the data in
 *   cache the whole step's attention computes in 9 ms, the previous scalar two-pass version in
 *   22 ms; from memory 28.8 vs 33.6 ms (median of 12, same process);
 * - the split of long contexts: one sequence of 4000 tokens alone, 20.3 -> 12.1 ms a step (both
 *   threads at work); batch 32 at the contexts above is unchanged (nothing to split).
 *
 * The engine sends prompt rows here too (ModelRunner._token_tables): a prompt token is a query
 * whose context is the first position + 1 tokens of its sequence, so one call attends every row
 * of a step, and a prompt's rows are computed the way its decode steps will be.
 *
 * Returns 0; -1 if its work lists could not be allocated; -2 if a block table entry that a
 * context needs is out of range or a length is negative (checked before any K/V is read); -3 if
 * the shape is not one it takes (kernels/cpu.py supports(): head_dim a multiple of 16 up to 256).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#define MAX_SCORES 16384 /* floats of one block's scores, on the stack */

typedef struct {
    const float *q;
    const void *k_cache, *v_cache; /* fp32, or fp16 when kv_half */
    const int32_t *block_tables, *context_lens;
    float *out;
    int64_t q_stride, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
    float scale;
    int kv_half;
} decode_args;

/* K/V elements are floats or halves: `half` is a constant in each compiled variant of the loops
 * (attend_blocks), so the loads below compile to plain vector loads or to widening ones. */
INLINE const char *kv_at(const void *p, int64_t elems, const int half) {
    return (const char *)p + elems * (half ? 2 : 4);
}

INLINE vf load_kv(const char *p, int64_t i, const int half) {
#if HAVE_F16
    if (half) return load_h((const uint16_t *)p + i);
#endif
    return load((const float *)p + i);
}

/* Into L2 (locality 1): into L1 measured slower, the block is used once a block later. */
INLINE void prefetch_rows(const char *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 1);
}

INLINE const char *block_rows(const decode_args *a, const void *cache, const int32_t *table, int64_t b,
                              const int half) {
    return kv_at(cache, (int64_t)table[b] * a->block_size * a->num_kv_heads * a->head_dim, half);
}

/* Each head's run of one block's scores, padded to whole vectors. */
INLINE int64_t score_stride(int64_t block_size) { return (block_size + VEC - 1) / VEC * VEC; }

/* Query heads go through a block G at a time with their q rows (scores) or their output rows
 * (values) held in registers: G * D / VEC vectors, at most 16 of the 32 AVX-512 registers. */
#define REG_VECTORS 16
#define MAX_G 4
#define MAX_DV 16 /* head_dim <= 256 */

/* s[g * ss + t] = scale * q_g . k_t for G query heads sharing the KV head whose rows start at k. */
INLINE void chunk_scores(const float *q, const char *k, int64_t n, int64_t row, float *s, int64_t ss,
                         float scale, const char *pk, const char *pv, const int half, const int G,
                         const int64_t d) {
    int64_t row_bytes = row * (half ? 2 : 4);
    vf qr[MAX_G][MAX_DV];
    _Pragma("GCC unroll 16") for (int g = 0; g < G; g++)
        _Pragma("GCC unroll 16") for (int64_t i = 0; i < d / VEC; i++) qr[g][i] = load(q + g * d + i * VEC);
    for (int64_t t = 0; t < n; t++, k += row_bytes) {
        if (pk) { /* the next block, a row of K and V per token: spread, not a burst */
            prefetch_rows(pk + t * row_bytes, row_bytes);
            prefetch_rows(pv + t * row_bytes, row_bytes);
        }
        vf kr[MAX_DV];
        _Pragma("GCC unroll 16") for (int64_t i = 0; i < d / VEC; i++) kr[i] = load_kv(k, i * VEC, half);
        _Pragma("GCC unroll 16") for (int g = 0; g < G; g++) {
            vf acc = qr[g][0] * kr[0];
            _Pragma("GCC unroll 16") for (int64_t i = 1; i < d / VEC; i++) acc += qr[g][i] * kr[i];
            s[g * ss + t] = hsum(acc) * scale;
        }
    }
}

/* out_g = out_g * corr_g + sum_t p_g[t] v_t for G query heads sharing the KV head at v. */
INLINE void chunk_values(float *out, const char *v, int64_t n, int64_t row, const float *p, int64_t ss,
                         const float *corr, const int half, const int G, const int64_t d) {
    int64_t row_bytes = row * (half ? 2 : 4);
    vf acc[MAX_G][MAX_DV];
    _Pragma("GCC unroll 16") for (int g = 0; g < G; g++)
        _Pragma("GCC unroll 16") for (int64_t i = 0; i < d / VEC; i++) acc[g][i] = load(out + g * d + i * VEC) * corr[g];
    for (int64_t t = 0; t < n; t++, v += row_bytes) {
        vf vr[MAX_DV];
        _Pragma("GCC unroll 16") for (int64_t i = 0; i < d / VEC; i++) vr[i] = load_kv(v, i * VEC, half);
        _Pragma("GCC unroll 16") for (int g = 0; g < G; g++) {
            vf w = splat(p[g * ss + t]);
            _Pragma("GCC unroll 16") for (int64_t i = 0; i < d / VEC; i++) acc[g][i] += w * vr[i];
        }
    }
    _Pragma("GCC unroll 16") for (int g = 0; g < G; g++)
        _Pragma("GCC unroll 16") for (int64_t i = 0; i < d / VEC; i++) store(out + g * d + i * VEC, acc[g][i]);
}

/* The largest lane (padding lanes hold -inf). */
INLINE float hmax(vf v) {
    float m = v[0];
    for (int i = 1; i < VEC; i++) m = v[i] > m ? v[i] : m;
    return m;
}

/* Online softmax over one block for one head: p = exp(s - m_new) in place (padding lanes past n
 * get 0); returns the factor that rescales what was accumulated under the old max. */
INLINE float block_softmax(float *s, int64_t n, float *m, float *l) {
    for (int64_t t = n; t < score_stride(n); t++) s[t] = -INFINITY;
    vf vmax = load(s);
    for (int64_t t = VEC; t < n; t += VEC) {
        vf x = load(s + t);
        vmax = vselect(x > vmax, x, vmax);
    }
    float block_max = hmax(vmax);
    float m_new = block_max > *m ? block_max : *m;
    /* the running max rarely moves after the first blocks: then nothing needs rescaling */
    float corr = m_new == *m ? 1.0f : (*m == -INFINITY ? 0.0f : expf(*m - m_new));
    vf sum = splat(0.0f);
    for (int64_t t = 0; t < n; t += VEC) {
        vf p = vexp(load(s + t) - m_new);
        store(s + t, p);
        sum += p;
    }
    *l = *l * corr + hsum(sum);
    *m = m_new;
    return corr;
}

/* Calls fn(..., G, d) for query heads [h, h + G) of every KV head, G constant (unrolled). */
#define FOR_HEAD_CHUNKS(fn, group, kv_heads, d, h, j, ...)                                     \
    for (int64_t j = 0; j < (kv_heads); j++)                                                    \
        for (int64_t h = j * (group), h_end = h + (group); h < h_end;) {                        \
            int64_t left = h_end - h, max_g = REG_VECTORS / ((d) / VEC);                        \
            int64_t g = left < max_g ? left : max_g;                                           \
            switch (g) {                                                                       \
                case 1: fn(__VA_ARGS__, 1, d); break;                                          \
                case 2: fn(__VA_ARGS__, 2, d); break;                                          \
                case 3: fn(__VA_ARGS__, 3, d); break;                                          \
                default: g = 4; fn(__VA_ARGS__, 4, d);                                         \
            }                                                                                  \
            h += g;                                                                            \
        }

/* Attention of sequence `seq` over its blocks [b0, b1): out_h = sum_t p_h[t] v_t with p_h the
 * softmax numerators exp(s - m_h); also returns m_h and l_h = sum_t p_h[t] per head. */
INLINE void attend_blocks_d(const decode_args *a, int64_t seq, int64_t b0, int64_t b1, float *out, float *m,
                            float *l, const int64_t d, const int half) {
    int64_t heads = a->num_heads, kv_heads = a->num_kv_heads, group = heads / kv_heads;
    int64_t bs = a->block_size, ss = score_stride(bs), ctx = a->context_lens[seq], row = kv_heads * d;
    int64_t row_bytes = row * (half ? 2 : 4);
    const int32_t *table = a->block_tables + seq * a->max_blocks;
    const float *q = a->q + seq * a->q_stride;
    float s[heads * ss] __attribute__((aligned(64))), corr[heads];
    memset(out, 0, sizeof(float) * heads * d);
    for (int64_t h = 0; h < heads; h++) m[h] = -INFINITY, l[h] = 0.0f;
    for (int64_t b = b0; b < b1; b++) {
        int64_t n = ctx - b * bs < bs ? ctx - b * bs : bs;
        const char *k = block_rows(a, a->k_cache, table, b, half), *v = block_rows(a, a->v_cache, table, b, half);
        if (b == b0) {
            prefetch_rows(k, n * row_bytes);
            prefetch_rows(v, n * row_bytes);
        }
        /* Every block but the last is full (n == bs), so the scores loop can prefetch the whole
         * next block, a row per token (rows past a short last block are still its memory). */
        const char *pk = NULL, *pv = NULL;
        if (b + 1 < b1) {
            pk = block_rows(a, a->k_cache, table, b + 1, half);
            pv = block_rows(a, a->v_cache, table, b + 1, half);
        }
        FOR_HEAD_CHUNKS(chunk_scores, group, kv_heads, d, h, j,
                        q + h * d, kv_at(k, j * d, half), n, row, s + h * ss, ss, a->scale, h == 0 ? pk : NULL, pv,
                        half)
        for (int64_t h = 0; h < heads; h++) corr[h] = block_softmax(s + h * ss, n, &m[h], &l[h]);
        FOR_HEAD_CHUNKS(chunk_values, group, kv_heads, d, h, j,
                        out + h * d, kv_at(v, j * d, half), n, row, s + h * ss, ss, corr + h, half)
    }
}

/* One function per element type (each with its head sizes as constants, so the inner loops unroll
 * completely): kept apart, the fp32 one compiles as before the fp16 variant existed (one function
 * holding both ran ~3% slower over fp32, its code twice the size). */
#define HEAD_SIZES(half)                                                                    \
    switch (a->head_dim) {                                                                   \
        case 64: attend_blocks_d(a, seq, b0, b1, out, m, l, 64, half); break;               \
        case 128: attend_blocks_d(a, seq, b0, b1, out, m, l, 128, half); break;             \
        default: attend_blocks_d(a, seq, b0, b1, out, m, l, a->head_dim, half);             \
    }

__attribute__((noinline)) static void attend_blocks_f32(const decode_args *a, int64_t seq, int64_t b0, int64_t b1,
                                                        float *out, float *m, float *l) {
    HEAD_SIZES(0)
}

__attribute__((noinline)) static void attend_blocks_f16(const decode_args *a, int64_t seq, int64_t b0, int64_t b1,
                                                        float *out, float *m, float *l) {
#if HAVE_F16
    HEAD_SIZES(1)
#endif
}
#undef HEAD_SIZES

static void attend_blocks(const decode_args *a, int64_t seq, int64_t b0, int64_t b1, float *out, float *m,
                          float *l) {
    if (a->kv_half)
        attend_blocks_f16(a, seq, b0, b1, out, m, l);
    else
        attend_blocks_f32(a, seq, b0, b1, out, m, l);
}

/* out = the parts' outputs, each rescaled from its own max to the common one, over their sums.
 * part p of a sequence: acc [heads, d], then m [heads], then l [heads] (part_floats apart). */
static void combine_parts(const decode_args *a, const float *parts, int64_t num_parts, float *out) {
    int64_t heads = a->num_heads, d = a->head_dim, part_floats = heads * (d + 2);
    for (int64_t h = 0; h < heads; h++) {
        float max = -INFINITY, sum = 0.0f;
        for (int64_t p = 0; p < num_parts; p++) {
            float mp = parts[p * part_floats + heads * d + h];
            max = mp > max ? mp : max;
        }
        float *oh = out + h * d;
        memset(oh, 0, sizeof(float) * d);
        for (int64_t p = 0; p < num_parts; p++) {
            const float *part = parts + p * part_floats;
            float w = part[heads * d + h] == -INFINITY ? 0.0f : expf(part[heads * d + h] - max);
            sum += part[heads * d + heads + h] * w;
            for (int64_t i = 0; i < d; i++) oh[i] += part[h * d + i] * w;
        }
        for (int64_t i = 0; i < d; i++) oh[i] /= sum;
    }
}

/* Every block a context needs is a real block; 0 if so, else -1. */
static int check_tables(const decode_args *a, int64_t num_seqs, int64_t num_blocks) {
    for (int64_t s = 0; s < num_seqs; s++) {
        int64_t ctx = a->context_lens[s], used = (ctx + a->block_size - 1) / a->block_size;
        if (ctx < 0 || used > a->max_blocks) return -1;
        for (int64_t b = 0; b < used; b++) {
            int32_t block = a->block_tables[s * a->max_blocks + b];
            if (block < 0 || block >= num_blocks) return -1;
        }
    }
    return 0;
}

/* A work item covers at most this many tokens of one context (flash-decoding's split): a long
 * context is spread over the threads even when it is alone in the batch. Fixed, not derived
 * from the thread count, so the result does not depend on the thread count. */
#define PART_TOKENS 512

static int64_t num_parts(const decode_args *a, int64_t seq, int64_t part_blocks) {
    int64_t blocks = (a->context_lens[seq] + a->block_size - 1) / a->block_size;
    return blocks <= part_blocks ? 1 : (blocks + part_blocks - 1) / part_blocks;
}

int paged_decode_attention_f32(const float *q, const void *k_cache, const void *v_cache,
                               const int32_t *block_tables, const int32_t *context_lens, float *out,
                               int64_t num_seqs, int64_t q_stride, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t num_blocks, int64_t block_size,
                               int64_t max_blocks, float scale, int num_threads, int kv_half) {
    decode_args a = {q, k_cache, v_cache, block_tables, context_lens, out, q_stride,
                     num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale, kv_half};
    if (head_dim % VEC || head_dim > VEC * MAX_DV || num_heads * score_stride(block_size) > MAX_SCORES) return -3;
    if (kv_half && !HAVE_F16) return -3;
    if (check_tables(&a, num_seqs, num_blocks) < 0) return -2;
    int64_t part_blocks = PART_TOKENS / block_size > 0 ? PART_TOKENS / block_size : 1;
    int64_t heads = num_heads, d = head_dim, part_floats = heads * (d + 2);
    /* the items of sequence s are seq_first[s] .. seq_first[s + 1] - 1; item i belongs to item_seq[i] */
    int64_t *seq_first = malloc(sizeof(int64_t) * (num_seqs + 1)), *item_seq = NULL;
    float *parts = NULL;
    if (seq_first == NULL) return -1;
    seq_first[0] = 0;
    for (int64_t seq = 0; seq < num_seqs; seq++)
        seq_first[seq + 1] = seq_first[seq] + num_parts(&a, seq, part_blocks);
    int64_t num_items = seq_first[num_seqs];
    item_seq = malloc(sizeof(int64_t) * (num_items + 1));
    if (num_items > num_seqs) parts = malloc(sizeof(float) * part_floats * num_items);
    if (item_seq == NULL || (num_items > num_seqs && parts == NULL)) {
        free(seq_first);
        free(item_seq);
        free(parts);
        return -1;
    }
    for (int64_t seq = 0; seq < num_seqs; seq++)
        for (int64_t i = seq_first[seq]; i < seq_first[seq + 1]; i++) item_seq[i] = seq;
#pragma omp parallel num_threads(num_threads)
    {
        float m[heads], l[heads];
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_items; i++) {
            int64_t seq = item_seq[i], p = i - seq_first[seq], n = seq_first[seq + 1] - seq_first[seq];
            int64_t blocks = (context_lens[seq] + block_size - 1) / block_size;
            int64_t b0 = p * part_blocks, b1 = b0 + part_blocks < blocks ? b0 + part_blocks : blocks;
            if (n == 1) { /* the whole context: normalize in place */
                float *o = out + seq * heads * d;
                attend_blocks(&a, seq, b0, b1, o, m, l);
                for (int64_t h = 0; h < heads; h++)
                    for (int64_t x = 0; x < d; x++) o[h * d + x] = l[h] > 0.0f ? o[h * d + x] / l[h] : 0.0f;
            } else {
                float *part = parts + i * part_floats;
                attend_blocks(&a, seq, b0, b1, part, part + heads * d, part + heads * d + heads);
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t seq = 0; seq < num_seqs; seq++) {
            int64_t first = seq_first[seq], n = seq_first[seq + 1] - first;
            if (n > 1) combine_parts(&a, parts + first * part_floats, n, out + seq * heads * d);
        }
    }
    free(seq_first);
    free(item_seq);
    free(parts);
    return 0;
}
