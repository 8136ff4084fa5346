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
 * Why it is built this way (figures: docs/benchmarks.md, "Figures behind code comments"):
 * - blocks are scattered over the cache and the hardware prefetcher does not follow the block
 *   table, so the next block's rows are requested while this one is computed, a few lines at
 *   every token of every head chunk's loops (attention.h, prefetcher): a burst of a whole block
 *   at once stalls on the memory queues, and requests from the first head chunk alone leave
 *   memory idle for the rest of the block;
 * - on AVX2 the scores of 8 tokens are summed across lanes together (hsum_each8: hsum's tree in
 *   shuffles of 8 vectors, the same bits);
 * - vectors of 16 floats (GCC/Clang vector extensions: AVX-512, or pairs of AVX2 registers),
 *   the head size a compile-time constant for 64 and 128, the q rows (scores) and output rows
 *   (values) of up to 4 heads held in registers, exp computed 16 lanes at a time, FMA
 *   contraction on (-ffp-contract=fast; ISO C mode forbids it otherwise);
 * - long contexts are split so that one long sequence alone keeps every thread at work.
 *
 * The engine sends prompt rows here too (ModelRunner._token_tables): a prompt token is a query
 * whose context is the first position + 1 tokens of its sequence, so one call attends every row
 * of a step, and a prompt's rows are computed the way its decode steps will be. Then
 * cu_seqlens (int32 [num_seqs + 1]) gives sequence s the rows cu[s] .. cu[s + 1] - 1 (q, out
 * and context_lens have a row each, block_tables a row per sequence), and the rows of a
 * sequence go in tiles of 16 (attend_tile_d below): each block's K/V once per tile, scores 16
 * tokens a vector, with a decode's bits (tested: tests/kernels/test_cpu_kernels.py; figures:
 * docs/benchmarks.md).
 *
 * softcap > 0 (Gemma 2): a block's scaled scores become softcap * tanh(s / softcap) before the
 * window's mask and the softmax; 0 leaves them as they are.
 *
 * sinks (gpt-oss, float [num_heads], NULL: none): head h's softmax has one more term,
 * exp(sinks[h] - max), whose value row is dropped: it joins the sum once per row, where the
 * output is normalized (the row's own parts combined first), never per part.
 *
 * Returns 0; -1 if its work lists could not be allocated; -2 if a block table entry that a
 * context needs is out of range or a length is negative (checked before any K/V is read); -3 if
 * the shape is not one it takes (kernels/cpu/ supports(): head_dim a multiple of 16 up to 256).
 */
#include "attention.h"

#ifdef _OPENMP
#include <omp.h>
#define omp_thread() omp_get_thread_num()
#else
#define omp_thread() 0
#endif

#define MAX_SCORES 16384 /* floats of one block's scores, on the stack */

/* One function per element type (each with its head sizes as constants, so the inner loops unroll
 * completely): kept apart, the fp32 one compiles as before the fp16 variant existed (one function
 * holding both ran slower over fp32, its code twice the size). Other head sizes go to the
 * rolled loops of attention_any_head_dim.c. */
#define HEAD_SIZES(fn, any, half, ...)                                                      \
    switch (a->head_dim) {                                                                   \
        case 64: fn(__VA_ARGS__, 64, half); break;                                           \
        case 128: fn(__VA_ARGS__, 128, half); break;                                         \
        default: any(__VA_ARGS__);                                                           \
    }

#define BLOCKS_ARGS a, r, table, b0, b1, out, m, l
#define TILE_ARGS a, r0, nr, table, b0, rows, kt

__attribute__((noinline)) static void attend_blocks_f32(BLOCKS_PARAMS) {
    HEAD_SIZES(attend_blocks_d, attend_blocks_any_f32, 0, BLOCKS_ARGS)
}
__attribute__((noinline)) static void attend_tile_f32(TILE_PARAMS) {
    HEAD_SIZES(attend_tile_d, attend_tile_any_f32, 0, TILE_ARGS)
}
/* Without HAVE_F16 the fp16 ones are empty: the entry point refuses kv_half then. */
__attribute__((noinline)) static void attend_blocks_f16(BLOCKS_PARAMS) {
#if HAVE_F16
    HEAD_SIZES(attend_blocks_d, attend_blocks_any_f16, 1, BLOCKS_ARGS)
#endif
}
__attribute__((noinline)) static void attend_tile_f16(TILE_PARAMS) {
#if HAVE_F16
    HEAD_SIZES(attend_tile_d, attend_tile_any_f16, 1, TILE_ARGS)
#endif
}
#undef HEAD_SIZES

/* ---- the entry point: work items over rows, tiles and parts -------------------------------------- */

/* out = the parts' outputs, each rescaled from its own max to the common one, over their sums
 * (plus the head's sink, once). part p of a row: acc [heads, d], then m [heads], then l [heads]
 * (part_floats apart). */
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
        sum += sink_term(a, h, max);
        for (int64_t i = 0; i < d; i++) oh[i] /= sum;
    }
}

/* A row of one part: acc over its sum (plus the head's sink); a row with no tokens gives 0. */
INLINE void normalize(const decode_args *a, float *o, const float *m, const float *l, int64_t heads,
                      int64_t d) {
    for (int64_t h = 0; h < heads; h++) {
        float sum = l[h] > 0.0f ? l[h] + sink_term(a, h, m[h]) : 0.0f;
        for (int64_t x = 0; x < d; x++) o[h * d + x] = sum > 0.0f ? o[h * d + x] / sum : 0.0f;
    }
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
    int64_t *row_parts;     /* parts of each row's context (its sliding window's) */
    int64_t *part0;         /* each row's first part: parts before its window are skipped */
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
            int64_t nr = r1 - t < tile ? r1 - t : tile, p0 = INT64_MAX, p1 = 0;
            for (int64_t r = t; r < t + nr; r++) {
                p0 = pl->part0[r] < p0 ? pl->part0[r] : p0;
                p1 = pl->part0[r] + pl->row_parts[r] > p1 ? pl->part0[r] + pl->row_parts[r] : p1;
            }
            for (int64_t p = p0; p < p1; p++, count++)
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
        *tr = (tile_row){NULL, m + i * heads, l + i * heads, ctx, b1, first_token(a, ctx)};
        int64_t p = it->part - pl->part0[r];
        if (p < 0 || p >= pl->row_parts[r]) continue; /* none of this row's context is in the part */
        if (pl->row_parts[r] == 1) { /* the whole context: normalized in place below */
            tr->acc = a->out + r * heads * d;
        } else {
            tr->acc = pl->parts + (pl->part_first[r] + p) * part_floats;
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
        if (rows[i].acc && pl->row_parts[it->row + i] == 1)
            normalize(a, rows[i].acc, rows[i].m, rows[i].l, heads, d);
}

static void free_plan(plan *pl) {
    free(pl->row_parts);
    free(pl->part0);
    free(pl->part_first);
    free(pl->parts);
    free(pl->items);
}

/* Sizes every row's parts and lists the work items; -1 if out of memory. */
static int make_plan(plan *pl, int64_t num_seqs, int64_t num_rows) {
    const decode_args *a = &pl->a;
    int64_t part_floats = a->num_heads * (a->head_dim + 2);
    pl->row_parts = malloc(sizeof(int64_t) * (num_rows + 1));
    pl->part0 = malloc(sizeof(int64_t) * (num_rows + 1));
    pl->part_first = malloc(sizeof(int64_t) * (num_rows + 1));
    if (!pl->row_parts || !pl->part0 || !pl->part_first) return -1;
    pl->part_first[0] = 0;
    for (int64_t r = 0; r < num_rows; r++) {
        int64_t ctx = a->context_lens[r], blocks = blocks_of(a, ctx);
        int64_t p0 = first_token(a, ctx) / a->block_size / pl->part_blocks;
        int64_t p1 = (blocks + pl->part_blocks - 1) / pl->part_blocks;
        pl->part0[r] = p0;
        pl->row_parts[r] = p1 - p0 <= 1 ? 1 : p1 - p0;
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
                        int num_threads, int kv_half, int64_t window, float softcap, const float *sinks) {
    plan pl = {{q, k_cache, v_cache, block_tables, context_lens, out, q_stride, num_heads, num_kv_heads,
                head_dim, block_size, max_blocks, scale, kv_half, window, softcap, sinks}};
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
