/* Paged decode attention for the CPU, fp32 queries and outputs over an fp32 or fp16 K/V cache
 * (kv_half; the halves are widened as they are loaded, all arithmetic in fp32): one query token
 * per sequence (or per row: prompt chunks, below), K/V read in place
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
 * of a step, and a prompt's rows are computed the way its decode steps will be. Then
 * cu_seqlens (int32 [num_seqs + 1]) gives sequence s the rows cu[s] .. cu[s + 1] - 1 (q, out
 * and context_lens have a row each, block_tables a row per sequence), and the rows of a
 * sequence go in tiles of 16 (attend_tile_d below): each block's K/V once per tile, scores 16
 * tokens a vector, with a decode's bits (tested: tests/test_cpu_kernels.py). One layer of one
 * 2048-token prompt: 84 ms a row at a time, 68 ms in tiles (bench/prompt_attention.py).
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

#ifdef _OPENMP
#include <omp.h>
#define omp_thread() omp_get_thread_num()
#else
#define omp_thread() 0
#endif

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

/* k * q and acc + k * q (one rounding, as the contracted acc += q * k of chunk_scores) with q a
 * float broadcast to every lane. With AVX-512 the broadcast is the instruction's memory operand:
 * GCC would rather load k there (once per head) and broadcast q apart, one more instruction per
 * FMA on the same pipes (tile_scores at ~60% of the FMA rate). */
#if defined(__AVX512F__) && VEC == 16
INLINE vf mul_bcast(vf k, const float *q) {
    vf r;
    __asm__("vmulps %2%{1to16%}, %1, %0" : "=v"(r) : "v"(k), "m"(*q));
    return r;
}
INLINE vf fma_bcast(vf acc, vf k, const float *q) {
    __asm__("vfmadd231ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(k), "m"(*q));
    return acc;
}
#else
INLINE vf mul_bcast(vf k, const float *q) { return splat(*q) * k; }
INLINE vf fma_bcast(vf acc, vf k, const float *q) { return acc + splat(*q) * k; }
#endif

/* Each head's run of one block's scores, padded to whole vectors. */
INLINE int64_t score_stride(int64_t block_size) { return (block_size + VEC - 1) / VEC * VEC; }

/* Query heads go through a block G at a time with their q rows (scores) or their output rows
 * (values) held in registers: G * D / VEC vectors, at most 16 of the 32 AVX-512 registers. */
#define REG_VECTORS 16
#define MAX_G 4
#define MAX_DV 16 /* head_dim <= 256 */

/* q . k as 16 lanes of partial sums (their hsum is the dot product), lane j over dims j, j + 16, ...
 * in a fixed order: the product of the second vector, then the first added in by an FMA, then
 * the others (what GCC 12 made of `acc = q0 k0; acc += q_i k_i`, so the bits did not change when
 * this became explicit); score_chain adds the same terms in the same order. */
INLINE vf dot_lanes(const vf *q, const vf *k, const int64_t d) {
    if (d / VEC == 1) return q[0] * k[0];
    vf acc = fma16(q[1] * k[1], q[0], k[0]);
    _Pragma("GCC unroll 16") for (int64_t i = 2; i < d / VEC; i++) acc = fma16(acc, q[i], k[i]);
    return acc;
}

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
            s[g * ss + t] = hsum(dot_lanes(qr[g], kr, d)) * scale;
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

/* Block b's K and V rows (k, v) in a pass over blocks [b0, b_end): the first block's `used`
 * bytes are requested at once; the next block's rows (pk, pv; NULL after the last) are for the
 * loops over this one to request, a token's rows at a time. Every block but the last is full,
 * so the whole next block can be (rows past a short last block are still its memory). */
INLINE void block_kv(const decode_args *a, const int32_t *table, int64_t b, int64_t b0, int64_t b_end,
                     int64_t used, const char **k, const char **v, const char **pk, const char **pv,
                     const int half) {
    *k = block_rows(a, a->k_cache, table, b, half);
    *v = block_rows(a, a->v_cache, table, b, half);
    if (b == b0) {
        prefetch_rows(*k, used);
        prefetch_rows(*v, used);
    }
    *pk = b + 1 < b_end ? block_rows(a, a->k_cache, table, b + 1, half) : NULL;
    *pv = b + 1 < b_end ? block_rows(a, a->v_cache, table, b + 1, half) : NULL;
}

/* Attention of row `r` (its context_lens entry, its q row) over blocks [b0, b1) of `table`:
 * out_h = sum_t p_h[t] v_t with p_h the softmax numerators exp(s - m_h); also returns m_h and
 * l_h = sum_t p_h[t] per head. */
INLINE void attend_blocks_d(const decode_args *a, int64_t r, const int32_t *table, int64_t b0, int64_t b1,
                            float *out, float *m, float *l, const int64_t d, const int half) {
    int64_t heads = a->num_heads, kv_heads = a->num_kv_heads, group = heads / kv_heads;
    int64_t bs = a->block_size, ss = score_stride(bs), ctx = a->context_lens[r], row = kv_heads * d;
    int64_t row_bytes = row * (half ? 2 : 4);
    const float *q = a->q + r * a->q_stride;
    float s[heads * ss] __attribute__((aligned(64))), corr[heads];
    memset(out, 0, sizeof(float) * heads * d);
    for (int64_t h = 0; h < heads; h++) m[h] = -INFINITY, l[h] = 0.0f;
    for (int64_t b = b0; b < b1; b++) {
        int64_t n = ctx - b * bs < bs ? ctx - b * bs : bs;
        const char *k, *v, *pk, *pv;
        block_kv(a, table, b, b0, b1, n * row_bytes, &k, &v, &pk, &pv, half);
        FOR_HEAD_CHUNKS(chunk_scores, group, kv_heads, d, h, j,
                        q + h * d, kv_at(k, j * d, half), n, row, s + h * ss, ss, a->scale, h == 0 ? pk : NULL, pv,
                        half)
        for (int64_t h = 0; h < heads; h++) corr[h] = block_softmax(s + h * ss, n, &m[h], &l[h]);
        FOR_HEAD_CHUNKS(chunk_values, group, kv_heads, d, h, j,
                        out + h * d, kv_at(v, j * d, half), n, row, s + h * ss, ss, corr + h, half)
    }
}

/* ---- prompt rows: a tile of one sequence's rows per block ----------------------------------------
 *
 * Rows of one sequence (a prompt chunk) share their K/V: a work item takes up to TILE_ROWS of
 * them and goes through the blocks once, each block's K and V used by every row of the tile
 * while in L1 (one row at a time, they come from L2 or L3 once per row). And scores come from
 * the block's K transposed (kt: [kv head][16-token chunk][dim][16 tokens]), 16 tokens' scores
 * a vector, no sum across lanes per score: a lane's sum over the head's dims is accumulated in
 * the order chunk_scores' lanes and hsum's tree add them (dims j + 16, j, j + 32, ... in one
 * chain per j; the chains added as halves, quarters, ...), so a prompt row's scores, and
 * everything after, have the same bits as a decode's. Scores alone (data in L1): ~2x the rate
 * of chunk_scores; a whole prompt's attention 1.1-1.27x (softmax and values are the same code). */

#define TILE_ROWS 16

/* o[g] = the chain chunk_scores' lane j computes: sum over i of q_g[16 i + j] k[16 i + j]. */
INLINE void score_chain(vf *o, const float *q, const float *kt, int j, const int G, const int64_t d) {
    vf k = load(kt + j * VEC);
    if (d / VEC == 1) {
        _Pragma("GCC unroll 16") for (int g = 0; g < G; g++) o[g] = mul_bcast(k, q + g * d + j);
        return;
    }
    vf k1 = load(kt + (VEC + j) * VEC); /* dot_lanes' order: dims j + 16, j, j + 32, ... */
    _Pragma("GCC unroll 16") for (int g = 0; g < G; g++)
        o[g] = fma_bcast(mul_bcast(k1, q + g * d + VEC + j), k, q + g * d + j);
    _Pragma("GCC unroll 16") for (int64_t i = 2; i < d / VEC; i++) {
        k = load(kt + (i * VEC + j) * VEC);
        _Pragma("GCC unroll 16") for (int g = 0; g < G; g++) o[g] = fma_bcast(o[g], k, q + g * d + i * VEC + j);
    }
}

/* hsum's tree over the chains: (j + 8), then (j + 4), then (0 + 2) + (1 + 3). */
INLINE void score_pair8(vf *o, const float *q, const float *kt, int j, const int G, const int64_t d) {
    vf x[MAX_G], y[MAX_G];
    score_chain(x, q, kt, j, G, d);
    score_chain(y, q, kt, j + 8, G, d);
    _Pragma("GCC unroll 16") for (int g = 0; g < G; g++) o[g] = x[g] + y[g];
}

INLINE void score_pair4(vf *o, const float *q, const float *kt, int j, const int G, const int64_t d) {
    vf x[MAX_G], y[MAX_G];
    score_pair8(x, q, kt, j, G, d);
    score_pair8(y, q, kt, j + 4, G, d);
    _Pragma("GCC unroll 16") for (int g = 0; g < G; g++) o[g] = x[g] + y[g];
}

INLINE void score_pair2(vf *o, const float *q, const float *kt, int j, const int G, const int64_t d) {
    vf x[MAX_G], y[MAX_G];
    score_pair4(x, q, kt, j, G, d);
    score_pair4(y, q, kt, j + 2, G, d);
    _Pragma("GCC unroll 16") for (int g = 0; g < G; g++) o[g] = x[g] + y[g];
}

/* s[g * ss + t] = scale * q_g . k_t for G query heads over one block's n tokens, from the KV
 * head's transposed K (kt), 16 tokens a vector. */
INLINE void tile_scores(const float *q, const float *kt, int64_t n, float *s, int64_t ss, float scale, const int G,
                        const int64_t d) {
    for (int64_t t0 = 0; t0 < n; t0 += VEC, kt += d * VEC) {
        /* q's broadcasts stay loads inside the loop (FMA operands): hoisted, GCC keeps G * d of
         * them live across the loops around, far more than 32 registers (spilled: ~1.5x slower). */
        __asm__("" : "+r"(q));
        vf x[MAX_G], y[MAX_G];
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 12 /* hsum adds the lanes in order */
        _Pragma("GCC unroll 16") for (int g = 0; g < G; g++) x[g] = splat(0.0f);
        for (int j = 0; j < VEC; j++) {
            score_chain(y, q, kt, j, G, d);
            _Pragma("GCC unroll 16") for (int g = 0; g < G; g++) x[g] += y[g];
        }
#else
        score_pair2(x, q, kt, 0, G, d);
        score_pair2(y, q, kt, 1, G, d);
        _Pragma("GCC unroll 16") for (int g = 0; g < G; g++) x[g] = x[g] + y[g];
#endif
        _Pragma("GCC unroll 16") for (int g = 0; g < G; g++) store(s + g * ss + t0, x[g] * scale);
    }
}

/* kt = the block's first n tokens of K, per KV head transposed (tokens past n: 0); meanwhile the
 * next block's rows (pk, pv; NULL if none) are requested, a token's rows at a time. */
INLINE void transpose_block(float *kt, const char *k, int64_t n, int64_t row_bytes, int64_t kv_heads,
                            int64_t chunks, const char *pk, const char *pv, int64_t bs, const int64_t d,
                            const int half) {
    for (int64_t j = 0; j < kv_heads; j++)
        for (int64_t c = 0; c < chunks; c++)
            for (int64_t i = 0; i < d / VEC; i++) {
                vf x[VEC];
                for (int t = 0; t < VEC; t++) {
                    int64_t token = c * VEC + t;
                    x[t] = token < n ? load_kv(k + token * row_bytes, j * d + i * VEC, half) : splat(0.0f);
                    if (pk && j == 0 && i == 0 && token < bs) {
                        prefetch_rows(pk + token * row_bytes, row_bytes);
                        prefetch_rows(pv + token * row_bytes, row_bytes);
                    }
                }
                transpose16(x);
                float *dst = kt + ((j * chunks + c) * d + i * VEC) * VEC;
                for (int dd = 0; dd < VEC; dd++) store(dst + dd * VEC, x[dd]);
            }
}

/* Where each row of a tile accumulates: acc [heads, d], m [heads], l [heads]; acc NULL if the
 * row has no tokens in this item's part. */
typedef struct {
    float *acc, *m, *l;
    int64_t ctx, b1;
} tile_row;

/* Rows r0 .. r0 + nr - 1 of sequence `table` over blocks [b0, ...): row i up to its own b1. */
INLINE void attend_tile_d(const decode_args *a, int64_t r0, int64_t nr, const int32_t *table, int64_t b0,
                          tile_row *rows, float *kt, const int64_t d, const int half) {
    int64_t heads = a->num_heads, kv_heads = a->num_kv_heads, group = heads / kv_heads;
    int64_t bs = a->block_size, ss = score_stride(bs), chunks = ss / VEC, row = kv_heads * d;
    int64_t row_bytes = row * (half ? 2 : 4), b_end = b0, ctx_max = 0;
    float s[heads * ss] __attribute__((aligned(64))), corr[heads];
    for (int64_t i = 0; i < nr; i++)
        if (rows[i].acc) {
            b_end = rows[i].b1 > b_end ? rows[i].b1 : b_end;
            ctx_max = rows[i].ctx > ctx_max ? rows[i].ctx : ctx_max;
        }
    for (int64_t b = b0; b < b_end; b++) {
        int64_t n_block = ctx_max - b * bs < bs ? ctx_max - b * bs : bs;
        const char *k, *v, *pk, *pv;
        block_kv(a, table, b, b0, b_end, n_block * row_bytes, &k, &v, &pk, &pv, half);
        transpose_block(kt, k, n_block, row_bytes, kv_heads, chunks, pk, pv, bs, d, half);
        for (int64_t i = 0; i < nr; i++) {
            tile_row *tr = &rows[i];
            if (!tr->acc || b >= tr->b1) continue;
            int64_t n = tr->ctx - b * bs < bs ? tr->ctx - b * bs : bs;
            const float *q = a->q + (r0 + i) * a->q_stride;
            FOR_HEAD_CHUNKS(tile_scores, group, kv_heads, d, h, j,
                            q + h * d, kt + j * chunks * d * VEC, n, s + h * ss, ss, a->scale)
            for (int64_t h = 0; h < heads; h++) corr[h] = block_softmax(s + h * ss, n, &tr->m[h], &tr->l[h]);
            FOR_HEAD_CHUNKS(chunk_values, group, kv_heads, d, h, j,
                            tr->acc + h * d, kv_at(v, j * d, half), n, row, s + h * ss, ss, corr + h, half)
        }
    }
}

/* One function per element type (each with its head sizes as constants, so the inner loops unroll
 * completely): kept apart, the fp32 one compiles as before the fp16 variant existed (one function
 * holding both ran ~3% slower over fp32, its code twice the size). */
#define HEAD_SIZES(fn, half, ...)                                                           \
    switch (a->head_dim) {                                                                   \
        case 64: fn(__VA_ARGS__, 64, half); break;                                           \
        case 128: fn(__VA_ARGS__, 128, half); break;                                         \
        default: fn(__VA_ARGS__, a->head_dim, half);                                         \
    }

#define BLOCKS_ARGS a, r, table, b0, b1, out, m, l
#define BLOCKS_PARAMS                                                                               \
    const decode_args *a, int64_t r, const int32_t *table, int64_t b0, int64_t b1, float *out, float *m, \
        float *l
#define TILE_ARGS a, r0, nr, table, b0, rows, kt
#define TILE_PARAMS \
    const decode_args *a, int64_t r0, int64_t nr, const int32_t *table, int64_t b0, tile_row *rows, float *kt

__attribute__((noinline)) static void attend_blocks_f32(BLOCKS_PARAMS) { HEAD_SIZES(attend_blocks_d, 0, BLOCKS_ARGS) }
__attribute__((noinline)) static void attend_tile_f32(TILE_PARAMS) { HEAD_SIZES(attend_tile_d, 0, TILE_ARGS) }
/* Without HAVE_F16 the fp16 ones are empty: the entry point refuses kv_half then. */
__attribute__((noinline)) static void attend_blocks_f16(BLOCKS_PARAMS) {
#if HAVE_F16
    HEAD_SIZES(attend_blocks_d, 1, BLOCKS_ARGS)
#endif
}
__attribute__((noinline)) static void attend_tile_f16(TILE_PARAMS) {
#if HAVE_F16
    HEAD_SIZES(attend_tile_d, 1, TILE_ARGS)
#endif
}
#undef HEAD_SIZES

/* ---- the entry point: work items over rows, tiles and parts -------------------------------------- */

/* out = the parts' outputs, each rescaled from its own max to the common one, over their sums.
 * part p of a row: acc [heads, d], then m [heads], then l [heads] (part_floats apart). */
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

INLINE void normalize(float *o, const float *l, int64_t heads, int64_t d) {
    for (int64_t h = 0; h < heads; h++)
        for (int64_t x = 0; x < d; x++) o[h * d + x] = l[h] > 0.0f ? o[h * d + x] / l[h] : 0.0f;
}

/* A work item covers at most this many tokens of one context (flash-decoding's split): a long
 * context is spread over the threads even when it is alone in the batch. Fixed, not derived
 * from the thread count, so the result does not depend on the thread count. */
#define PART_TOKENS 512

typedef struct {
    int64_t seq, row, rows, part; /* rows [row, row + rows) of sequence seq, blocks of part `part` */
} work_item;

typedef struct {
    decode_args a;
    const int32_t *cu;      /* rows of sequence s: cu[s] .. cu[s + 1] - 1 */
    int64_t part_blocks;    /* blocks per part */
    int64_t *row_parts;     /* parts of each row's context */
    int64_t *part_first;    /* where a row's parts start in `parts` (rows of more than one part) */
    float *parts;
    work_item *items;
    int64_t num_items;
} plan;

static int64_t blocks_of(const decode_args *a, int64_t ctx) { return (ctx + a->block_size - 1) / a->block_size; }

/* Every context is >= 0 and its blocks are real ones; the rows of sequence s are cu[s] .. cu[s + 1]. */
static int check_rows(const decode_args *a, const int32_t *cu, int64_t num_seqs, int64_t num_rows,
                      int64_t num_blocks) {
    if (cu[0] != 0 || cu[num_seqs] != num_rows) return -1;
    for (int64_t s = 0; s < num_seqs; s++) /* all of cu first: no row read past num_rows */
        if (cu[s + 1] < cu[s] || cu[s + 1] > num_rows) return -1;
    for (int64_t s = 0; s < num_seqs; s++) {
        int64_t ctx = 0;
        for (int64_t r = cu[s]; r < cu[s + 1]; r++) {
            if (a->context_lens[r] < 0) return -1;
            ctx = a->context_lens[r] > ctx ? a->context_lens[r] : ctx;
        }
        int64_t used = blocks_of(a, ctx);
        if (used > a->max_blocks) return -1;
        for (int64_t b = 0; b < used; b++) {
            int32_t block = a->block_tables[s * a->max_blocks + b];
            if (block < 0 || block >= num_blocks) return -1;
        }
    }
    return 0;
}

/* Items: a sequence of one row gets an item per part of its context (a decode); the rows of a
 * longer one go in tiles of TILE_ROWS, an item per tile and part. Counted (items NULL), then made. */
static int64_t make_items(plan *pl, int64_t num_seqs) {
    int64_t count = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        int64_t r0 = pl->cu[s], r1 = pl->cu[s + 1], tile = r1 - r0 > 1 ? TILE_ROWS : 1;
        for (int64_t t = r0; t < r1; t += tile) {
            int64_t nr = r1 - t < tile ? r1 - t : tile, parts = 0;
            for (int64_t r = t; r < t + nr; r++) parts = pl->row_parts[r] > parts ? pl->row_parts[r] : parts;
            for (int64_t p = 0; p < parts; p++, count++)
                if (pl->items) pl->items[count] = (work_item){s, t, nr, p};
        }
    }
    return count;
}

static void run_item(const plan *pl, const work_item *it, float *m, float *l, float *kt, tile_row *rows) {
    const decode_args *a = &pl->a;
    int64_t heads = a->num_heads, d = a->head_dim, part_floats = heads * (d + 2);
    const int32_t *table = a->block_tables + it->seq * a->max_blocks;
    int64_t b0 = it->part * pl->part_blocks;
    for (int64_t i = 0; i < it->rows; i++) {
        int64_t r = it->row + i, ctx = a->context_lens[r], b1 = b0 + pl->part_blocks;
        b1 = b1 < blocks_of(a, ctx) ? b1 : blocks_of(a, ctx);
        tile_row *tr = &rows[i];
        *tr = (tile_row){NULL, m + i * heads, l + i * heads, ctx, b1};
        if (it->part >= pl->row_parts[r]) continue; /* none of this row's context is in the part */
        if (pl->row_parts[r] == 1) { /* the whole context: normalized in place below */
            tr->acc = a->out + r * heads * d;
        } else {
            tr->acc = pl->parts + (pl->part_first[r] + it->part) * part_floats;
            tr->m = tr->acc + heads * d, tr->l = tr->m + heads;
        }
        if (it->rows > 1) {
            memset(tr->acc, 0, sizeof(float) * heads * d);
            for (int64_t h = 0; h < heads; h++) tr->m[h] = -INFINITY, tr->l[h] = 0.0f;
        }
    }
    if (it->rows == 1) {
        if (rows[0].acc) (a->kv_half ? attend_blocks_f16 : attend_blocks_f32)(a, it->row, table, b0, rows[0].b1,
                                                                                rows[0].acc, rows[0].m, rows[0].l);
    } else {
        (a->kv_half ? attend_tile_f16 : attend_tile_f32)(a, it->row, it->rows, table, b0, rows, kt);
    }
    for (int64_t i = 0; i < it->rows; i++)
        if (rows[i].acc && pl->row_parts[it->row + i] == 1) normalize(rows[i].acc, rows[i].l, heads, d);
}

static void free_plan(plan *pl) {
    free(pl->row_parts);
    free(pl->part_first);
    free(pl->parts);
    free(pl->items);
}

/* Sizes every row's parts and lists the work items; -1 if out of memory. */
static int make_plan(plan *pl, int64_t num_seqs, int64_t num_rows) {
    const decode_args *a = &pl->a;
    int64_t part_floats = a->num_heads * (a->head_dim + 2);
    pl->row_parts = malloc(sizeof(int64_t) * (num_rows + 1));
    pl->part_first = malloc(sizeof(int64_t) * (num_rows + 1));
    if (!pl->row_parts || !pl->part_first) return -1;
    pl->part_first[0] = 0;
    for (int64_t r = 0; r < num_rows; r++) {
        int64_t blocks = blocks_of(a, a->context_lens[r]);
        pl->row_parts[r] = blocks <= pl->part_blocks ? 1 : (blocks + pl->part_blocks - 1) / pl->part_blocks;
        pl->part_first[r + 1] = pl->part_first[r] + (pl->row_parts[r] > 1 ? pl->row_parts[r] : 0);
    }
    if (pl->part_first[num_rows] > 0) {
        pl->parts = malloc(sizeof(float) * part_floats * pl->part_first[num_rows]);
        if (!pl->parts) return -1;
    }
    pl->num_items = make_items(pl, num_seqs);
    pl->items = malloc(sizeof(work_item) * (pl->num_items + 1));
    if (!pl->items) return -1;
    make_items(pl, num_seqs);
    return 0;
}

/* Rows of a sequence share its block table row: cu_seqlens (int32 [num_seqs + 1]) gives sequence
 * s the rows cu[s] .. cu[s + 1] - 1, each with its own context length (a prompt chunk's rows:
 * position + 1); NULL: one row per sequence (decode). */
int paged_attention_f32(const float *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                        const int32_t *cu_seqlens, const int32_t *context_lens, float *out, int64_t num_rows,
                        int64_t num_seqs, int64_t q_stride, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t num_blocks, int64_t block_size, int64_t max_blocks, float scale,
                        int num_threads, int kv_half) {
    plan pl = {{q, k_cache, v_cache, block_tables, context_lens, out, q_stride, num_heads, num_kv_heads,
                head_dim, block_size, max_blocks, scale, kv_half}};
    if (head_dim % VEC || head_dim > VEC * MAX_DV || num_heads * score_stride(block_size) > MAX_SCORES) return -3;
    if (kv_half && !HAVE_F16) return -3;
    if (cu_seqlens == NULL && num_seqs != num_rows) return -2;
    int32_t *identity = cu_seqlens ? NULL : malloc(sizeof(int32_t) * (num_rows + 1));
    if (!cu_seqlens && !identity) return -1;
    for (int64_t i = 0; identity && i <= num_rows; i++) identity[i] = (int32_t)i; /* decode: row i is sequence i */
    pl.cu = cu_seqlens ? cu_seqlens : identity;
    pl.part_blocks = PART_TOKENS / block_size > 0 ? PART_TOKENS / block_size : 1;
    int rc = check_rows(&pl.a, pl.cu, num_seqs, num_rows, num_blocks) < 0 ? -2 : make_plan(&pl, num_seqs, num_rows);
    int64_t kt_floats = num_kv_heads * score_stride(block_size) * head_dim, heads = num_heads;
    float *kt_all = NULL;
    if (rc == 0 && cu_seqlens && !(kt_all = aligned_alloc(64, sizeof(float) * kt_floats * num_threads))) rc = -1;
    if (rc == 0) {
#pragma omp parallel num_threads(num_threads)
        {
            float m[TILE_ROWS * heads], l[TILE_ROWS * heads];
            tile_row rows[TILE_ROWS];
            float *kt = kt_all ? kt_all + kt_floats * omp_thread() : NULL;
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < pl.num_items; i++) run_item(&pl, &pl.items[i], m, l, kt, rows);
#pragma omp for schedule(dynamic, 1)
            for (int64_t r = 0; r < num_rows; r++)
                if (pl.row_parts[r] > 1)
                    combine_parts(&pl.a, pl.parts + pl.part_first[r] * heads * (head_dim + 2), pl.row_parts[r],
                                  out + r * heads * head_dim);
        }
    }
    free(kt_all);
    free(identity);
    free_plan(&pl);
    return rc;
}
