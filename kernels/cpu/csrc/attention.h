/* The attention loops shared by paged_decode_attention.c (head sizes 64 and 128, constants there,
 * every loop over a head's vectors unrolled) and attention_any_head_dim.c (any other multiple of
 * 16 up to 256, those loops left rolled): one block's scores, its online softmax and its values,
 * for one row (attend_blocks_d, a decode) or a tile of one sequence's rows (attend_tile_d). Both
 * files compile the same source, so a row's bits do not depend on which one computes it for a
 * given head size. Layouts and the speed notes: paged_decode_attention.c. */
#ifndef INFERLINE_ATTENTION_H
#define INFERLINE_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

typedef struct {
    const float *q;
    const void *k_cache, *v_cache; /* fp32, or fp16 when kv_half */
    const int32_t *block_tables, *context_lens;
    float *out;
    int64_t q_stride, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
    float scale;
    int kv_half;
    int64_t window; /* sliding window: a row of context ctx sees tokens [ctx - window, ctx); 0: all */
    float softcap;  /* scores become softcap * tanh(s / softcap) before the mask (Gemma 2); 0: off */
    /* [num_heads]: a logit per head in each softmax, then dropped (gpt-oss); NULL: none */
    const float *sinks;
} decode_args;

/* What a head's sink adds to its softmax sum, under the running max m (0 without sinks). */
INLINE float sink_term(const decode_args *a, int64_t h, float m) {
    return a->sinks ? expf(a->sinks[h] - m) : 0.0f;
}

/* Gemma 2's attention logit soft-capping of a block's n scores for `heads` runs ss apart. */
INLINE void soft_cap(float *s, int64_t heads, int64_t ss, int64_t n, float cap) {
    for (int64_t h = 0; h < heads; h++)
        for (int64_t t = 0; t < n; t++) s[h * ss + t] = cap * tanhf(s[h * ss + t] / cap);
}

/* The first token a row of context `ctx` sees (transformers' sliding window: p - j < window). */
INLINE int64_t first_token(const decode_args *a, int64_t ctx) {
    return a->window > 0 && ctx > a->window ? ctx - a->window : 0;
}

/* Scores of tokens before `lo` in block b (of bs tokens) to -inf, for `heads` runs ss apart. */
INLINE void mask_before(float *s, int64_t heads, int64_t ss, int64_t b, int64_t bs, int64_t lo) {
    for (int64_t t = 0; t < lo - b * bs && t < bs; t++)
        for (int64_t h = 0; h < heads; h++) s[h * ss + t] = -INFINITY;
}

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

INLINE vn load_kv_n(const char *p, int64_t i, const int half) {
#if HAVE_F16
    if (half) return load_n_h((const uint16_t *)p + i);
#endif
    return load_n((const float *)p + i);
}

/* Into L2 (locality 1), not L1: the block is used once, a block later. */
INLINE void prefetch_rows(const char *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 1);
}

/* The next block's K and V rows, requested a few lines at every token of the loops over this block
 * (chunk_scores, chunk_values): spread over the block's work, the requests keep memory busy
 * while it computes. All of them at the start of the block, or during its first head's loop alone,
 * filled the core's miss queues and left memory idle for the rest (decode attention from memory
 * ~2x its time with the data in cache). */
typedef struct {
    const char *k, *v;
    int64_t at, bytes, step; /* next byte of the stream (K rows, then V rows), each's bytes, bytes per call */
} prefetcher;

INLINE void prefetch_some(prefetcher *pf) {
    int64_t end = pf->at + pf->step < 2 * pf->bytes ? pf->at + pf->step : 2 * pf->bytes;
    for (; pf->at < end; pf->at += 64)
        __builtin_prefetch(pf->at < pf->bytes ? pf->k + pf->at : pf->v + (pf->at - pf->bytes), 0, 1);
}

INLINE const char *block_rows(const decode_args *a, const void *cache, const int32_t *table, int64_t b,
                              const int half) {
    return kv_at(cache, (int64_t)table[b] * a->block_size * a->num_kv_heads * a->head_dim, half);
}

/* k * q and acc + k * q (one rounding, as the contracted acc += q * k of chunk_scores) with q a
 * float broadcast to every lane. With AVX-512 the broadcast is the instruction's memory operand:
 * GCC would rather load k there (once per head) and broadcast q apart, one more instruction per
 * FMA on the same pipes. */
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
 * (values) held in registers: G * D / VEC vectors, at most 16 of the 32 AVX-512 registers, or 8
 * (16 halves) of the 16 AVX2 ones: on AVX2, 8 is as fast as 16 and builds faster; 4 is slower. */
#if defined(__AVX512F__)
#define REG_VECTORS 16
#else
#define REG_VECTORS 8
#endif
#ifndef MAX_G /* attention_any_head_dim.c takes one head at a time */
#define MAX_G 4
#endif
#define MAX_DV 16 /* head_dim <= 256 */

/* Loops over a head's d / VEC vectors unroll completely where d is a constant (64, 128). With d
 * known only at run time (attention_any_head_dim.c) they stay rolled: unrolled 16 times each,
 * nested, they made a function of megabytes that took GCC four minutes on an AVX2 machine. */
#ifndef UNROLL_D
#define UNROLL_D _Pragma("GCC unroll 16")
#endif

/* q . k as 16 lanes of partial sums (their hsum is the dot product), lane j over dims j, j + 16, ...
 * in a fixed order: the product of the second vector, then the first added in by an FMA, then
 * the others (what GCC 12 made of `acc = q0 k0; acc += q_i k_i`, so the bits did not change when
 * this became explicit); score_chain adds the same terms in the same order. */
INLINE vf dot_lanes(const vf *q, const vf *k, const int64_t d) {
    if (d / VEC == 1) return q[0] * k[0];
    vf acc = fma16(q[1] * k[1], q[0], k[0]);
    UNROLL_D for (int64_t i = 2; i < d / VEC; i++) acc = fma16(acc, q[i], k[i]);
    return acc;
}

/* Scores eight tokens at a time where the machine's vectors are 8 floats (AVX2): hsum's tree is
 * then a few shuffles for eight tokens rather than ~10 instructions and a scalar store for each
 * (the tree as it was, hsum_each8 below, so the bits do not change). Needs __builtin_shufflevector. */
#if NVEC == 8 && !(defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 12)
#define SCORES_BY_8 1
#else
#define SCORES_BY_8 0
#endif

#if SCORES_BY_8
/* The upper and lower halves of a 16-lane dot_lanes, added: hsum's first step. */
INLINE vn halves_sum(vf v) {
    vn lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
    vn hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    return lo + hi;
}

/* Lane t = the rest of hsum's tree over x[t] (s4 = lanes i + lanes i + 4, then
 * (s4[0] + s4[2]) + (s4[1] + s4[3])), for eight vectors at once: tokens t and t + 4 share a vector
 * in the first step, so the last one lands in token order. */
INLINE vn hsum_each8(const vn x[8]) {
    vn b[4], c[2];
    for (int t = 0; t < 4; t++) /* [s4 of token t | s4 of token t + 4] */
        b[t] = __builtin_shufflevector(x[t], x[t + 4], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(x[t], x[t + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++) /* [x, y of tokens 2i, 2i + 1 | the same of 2i + 4, 2i + 5]: x = s4[0] + s4[2] */
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(c[0], c[1], 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(c[0], c[1], 1, 3, 9, 11, 5, 7, 13, 15);
}
#endif

/* s[g * ss + t] = scale * q_g . k_t for G query heads sharing the KV head whose rows start at k. */
INLINE void chunk_scores(const float *q, const char *k, int64_t n, int64_t row, float *s, int64_t ss,
                         float scale, prefetcher *pf, const int half, const int G,
                         const int64_t d) {
    int64_t row_bytes = row * (half ? 2 : 4);
    vf qr[MAX_G][MAX_DV];
    _Pragma("GCC unroll 16") for (int g = 0; g < G; g++)
        UNROLL_D for (int64_t i = 0; i < d / VEC; i++) qr[g][i] = load(q + g * d + i * VEC);
#if SCORES_BY_8
    if (d / VEC > 1) { /* one vector a head: dot_lanes is a product, which the add after it could absorb */
        /* tokens past n score 0 here: block_softmax overwrites them (s has ss >= n rounded up to 8) */
        for (int64_t t0 = 0; t0 < n; t0 += 8) {
            vn part[MAX_G][8];
            for (int i = 0; i < 8; i++) {
                int64_t t = t0 + i;
                if (t >= n) {
                    _Pragma("GCC unroll 16") for (int g = 0; g < G; g++) part[g][i] = splat_n(0.0f);
                    continue;
                }
                if (pf) prefetch_some(pf);
                vf kr[MAX_DV];
                UNROLL_D for (int64_t j = 0; j < d / VEC; j++) kr[j] = load_kv(k + t * row_bytes, j * VEC, half);
                _Pragma("GCC unroll 16") for (int g = 0; g < G; g++) part[g][i] = halves_sum(dot_lanes(qr[g], kr, d));
            }
            _Pragma("GCC unroll 16") for (int g = 0; g < G; g++) store_n(s + g * ss + t0, hsum_each8(part[g]) * scale);
        }
        return;
    }
#endif
    for (int64_t t = 0; t < n; t++, k += row_bytes) {
        if (pf) prefetch_some(pf);
        vf kr[MAX_DV];
        UNROLL_D for (int64_t i = 0; i < d / VEC; i++) kr[i] = load_kv(k, i * VEC, half);
        _Pragma("GCC unroll 16") for (int g = 0; g < G; g++) {
            s[g * ss + t] = hsum(dot_lanes(qr[g], kr, d)) * scale;
        }
    }
}

/* out_g = out_g * corr_g + sum_t p_g[t] v_t for G query heads sharing the KV head at v. Lane by
 * lane, in the machine's own vectors (vn: NVEC floats). */
INLINE void chunk_values(float *out, const char *v, int64_t n, int64_t row, const float *p, int64_t ss,
                         const float *corr, prefetcher *pf, const int half, const int G, const int64_t d) {
    int64_t row_bytes = row * (half ? 2 : 4);
    vn acc[MAX_G][MAX_DV * VEC / NVEC];
    _Pragma("GCC unroll 16") for (int g = 0; g < G; g++)
        UNROLL_D for (int64_t i = 0; i < d / NVEC; i++) acc[g][i] = load_n(out + g * d + i * NVEC) * corr[g];
    for (int64_t t = 0; t < n; t++, v += row_bytes) {
        if (pf) prefetch_some(pf);
        vn vr[MAX_DV * VEC / NVEC];
        UNROLL_D for (int64_t i = 0; i < d / NVEC; i++) vr[i] = load_kv_n(v, i * NVEC, half);
        _Pragma("GCC unroll 16") for (int g = 0; g < G; g++) {
            vn w = splat_n(p[g * ss + t]);
            UNROLL_D for (int64_t i = 0; i < d / NVEC; i++) acc[g][i] += w * vr[i];
        }
    }
    _Pragma("GCC unroll 16") for (int g = 0; g < G; g++)
        UNROLL_D for (int64_t i = 0; i < d / NVEC; i++) store_n(out + g * d + i * NVEC, acc[g][i]);
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
        vmax = vselect(vgt(x, vmax), x, vmax);
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

/* Heads in the next chunk of `left` (head size d): as many as REG_VECTORS hold, 1 to MAX_G. */
INLINE int64_t chunk_size(int64_t left, int64_t d) {
    int64_t fit = REG_VECTORS / (d / VEC), g = left < fit ? left : fit;
    return g > MAX_G ? MAX_G : g < 1 ? 1 : g;
}

/* Calls fn(..., G, d) for query heads [h, h + G) of every KV head, G constant (unrolled): chunks
 * of chunk_size heads (the tests against MAX_G fold away, so no variant past it is compiled). */
#define FOR_HEAD_CHUNKS(fn, group, kv_heads, d, h, j, ...)                                     \
    for (int64_t j = 0; j < (kv_heads); j++)                                                    \
        for (int64_t h = j * (group), h_end = h + (group); h < h_end;) {                        \
            int64_t g = chunk_size(h_end - h, d);                                               \
            if (MAX_G >= 4 && g == 4) fn(__VA_ARGS__, 4, d);                                     \
            else if (MAX_G >= 3 && g == 3) fn(__VA_ARGS__, 3, d);                                \
            else if (MAX_G >= 2 && g == 2) fn(__VA_ARGS__, 2, d);                                \
            else fn(__VA_ARGS__, 1, d);                                                          \
            h += g;                                                                            \
        }

/* How many calls FOR_HEAD_CHUNKS makes. */
INLINE int64_t head_chunks(int64_t group, int64_t kv_heads, int64_t d) {
    int64_t count = 0;
    for (int64_t h = 0; h < group; h += chunk_size(group - h, d)) count++;
    return count * kv_heads;
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
    int64_t row_bytes = row * (half ? 2 : 4), lo = first_token(a, ctx);
    const float *q = a->q + r * a->q_stride;
    float s[heads * ss] __attribute__((aligned(64))), corr[heads];
    memset(out, 0, sizeof(float) * heads * d);
    for (int64_t h = 0; h < heads; h++) m[h] = -INFINITY, l[h] = 0.0f;
    if (b0 < lo / bs) b0 = lo / bs; /* blocks wholly before the sliding window */
    for (int64_t b = b0; b < b1; b++) {
        int64_t n = ctx - b * bs < bs ? ctx - b * bs : bs;
        const char *k, *v, *pk, *pv;
        block_kv(a, table, b, b0, b1, n * row_bytes, &k, &v, &pk, &pv, half);
        /* the next block (full: only the last is not), a share at each token of the scores' and
         * values' loops; ahead of the end when the share rounds up */
        int64_t calls = 2 * n * head_chunks(group, kv_heads, d);
        prefetcher next = {pk, pv, 0, bs * row_bytes, (2 * bs * row_bytes / calls + 63) / 64 * 64};
        prefetcher *pf = pk ? &next : NULL;
        FOR_HEAD_CHUNKS(chunk_scores, group, kv_heads, d, h, j,
                        q + h * d, kv_at(k, j * d, half), n, row, s + h * ss, ss, a->scale, pf,
                        half)
        if (a->softcap > 0.0f) soft_cap(s, heads, ss, n, a->softcap);
        if (b * bs < lo) mask_before(s, heads, ss, b, bs, lo);
        for (int64_t h = 0; h < heads; h++) corr[h] = block_softmax(s + h * ss, n, &m[h], &l[h]);
        FOR_HEAD_CHUNKS(chunk_values, group, kv_heads, d, h, j,
                        out + h * d, kv_at(v, j * d, half), n, row, s + h * ss, ss, corr + h,
                        pf, half)
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
    UNROLL_D for (int64_t i = 2; i < d / VEC; i++) {
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
         * them live across the loops around, far more than 32 registers, and spills. */
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
            for (int64_t i = 0; i < d / NVEC; i++)
                for (int64_t t0 = 0; t0 < VEC; t0 += NVEC) { /* the chunk's tokens, NVEC at a time */
                    vn x[NVEC];
                    for (int t = 0; t < NVEC; t++) {
                        int64_t token = c * VEC + t0 + t;
                        x[t] = token < n ? load_kv_n(k + token * row_bytes, j * d + i * NVEC, half) : splat_n(0.0f);
                        if (pk && j == 0 && i == 0 && token < bs) {
                            prefetch_rows(pk + token * row_bytes, row_bytes);
                            prefetch_rows(pv + token * row_bytes, row_bytes);
                        }
                    }
                    transpose_n(x);
                    float *dst = kt + (j * chunks + c) * d * VEC + i * NVEC * VEC + t0;
                    for (int dd = 0; dd < NVEC; dd++) store_n(dst + dd * VEC, x[dd]);
                }
}

/* Where each row of a tile accumulates: acc [heads, d], m [heads], l [heads]; acc NULL if the
 * row has no tokens in this item's part. */
typedef struct {
    float *acc, *m, *l;
    int64_t ctx, b1, lo; /* lo: its first token (first_token) */
} tile_row;

/* Rows r0 .. r0 + nr - 1 of sequence `table` over blocks [b0, ...): row i up to its own b1. */
INLINE void attend_tile_d(const decode_args *a, int64_t r0, int64_t nr, const int32_t *table, int64_t b0,
                          tile_row *rows, float *kt, const int64_t d, const int half) {
    int64_t heads = a->num_heads, kv_heads = a->num_kv_heads, group = heads / kv_heads;
    int64_t bs = a->block_size, ss = score_stride(bs), chunks = ss / VEC, row = kv_heads * d;
    int64_t row_bytes = row * (half ? 2 : 4), b_end = b0, ctx_max = 0;
    float s[heads * ss] __attribute__((aligned(64))), corr[heads];
    int64_t b_start = INT64_MAX;
    for (int64_t i = 0; i < nr; i++)
        if (rows[i].acc) {
            b_end = rows[i].b1 > b_end ? rows[i].b1 : b_end;
            ctx_max = rows[i].ctx > ctx_max ? rows[i].ctx : ctx_max;
            b_start = rows[i].lo / bs < b_start ? rows[i].lo / bs : b_start;
        }
    if (b0 < b_start && b_start != INT64_MAX) b0 = b_start; /* no row's window reaches back */
    for (int64_t b = b0; b < b_end; b++) {
        int64_t n_block = ctx_max - b * bs < bs ? ctx_max - b * bs : bs;
        const char *k, *v, *pk, *pv;
        block_kv(a, table, b, b0, b_end, n_block * row_bytes, &k, &v, &pk, &pv, half);
        transpose_block(kt, k, n_block, row_bytes, kv_heads, chunks, pk, pv, bs, d, half);
        for (int64_t i = 0; i < nr; i++) {
            tile_row *tr = &rows[i];
            if (!tr->acc || b >= tr->b1 || b < tr->lo / bs) continue;
            int64_t n = tr->ctx - b * bs < bs ? tr->ctx - b * bs : bs;
            const float *q = a->q + (r0 + i) * a->q_stride;
            FOR_HEAD_CHUNKS(tile_scores, group, kv_heads, d, h, j,
                            q + h * d, kt + j * chunks * d * VEC, n, s + h * ss, ss, a->scale)
            if (a->softcap > 0.0f) soft_cap(s, heads, ss, n, a->softcap);
            if (b * bs < tr->lo) mask_before(s, heads, ss, b, bs, tr->lo);
            for (int64_t h = 0; h < heads; h++) corr[h] = block_softmax(s + h * ss, n, &tr->m[h], &tr->l[h]);
            FOR_HEAD_CHUNKS(chunk_values, group, kv_heads, d, h, j,
                            tr->acc + h * d, kv_at(v, j * d, half), n, row, s + h * ss, ss, corr + h, NULL, half)
        }
    }
}

#define BLOCKS_PARAMS                                                                               \
    const decode_args *a, int64_t r, const int32_t *table, int64_t b0, int64_t b1, float *out, float *m, \
        float *l
#define TILE_PARAMS \
    const decode_args *a, int64_t r0, int64_t nr, const int32_t *table, int64_t b0, tile_row *rows, float *kt

/* attention_any_head_dim.c: head sizes other than 64 and 128 (fp16 ones empty without HAVE_F16). */
void attend_blocks_any_f32(BLOCKS_PARAMS);
void attend_tile_any_f32(TILE_PARAMS);
void attend_blocks_any_f16(BLOCKS_PARAMS);
void attend_tile_any_f16(TILE_PARAMS);

#endif
