/* y = x . W^T (+ bias) for the linear layers on the CPU, fp32: a register-tiled GEMM over weights
 * packed once at load (kernels/cpu/gemm.py), for the few rows of a decode step.
 *
 * Why not oneDNN or MKL: a decode step multiplies ~30 rows by every weight of the model, and the
 * weights (540 MB for SmolLM2-135M) come from memory each step. Below ~100 rows the libraries run
 * far below this machine's FMA rate (figures: docs/benchmarks.md). This is the textbook loop nest
 * (BLIS's): the weight is stored in panels of NR output columns, k-major (panel[k][0..NR-1]), so
 * one k step of a panel is NR / NVEC vector loads; a tile of MR rows x NR columns keeps its MR x NR
 * sums in registers (AVX2: 6 x 16 = 12 of the 16 registers) and each x value is broadcast once per
 * k. Panels are spread over the threads; within a thread each panel is read from memory once and
 * from cache for its other row tiles.
 *
 * A weight quantized before it reached us (a GGUF model's) may come as 8-bit codes instead of
 * fp32 panels, widened to the same fp32 values as they are used (below: "weights stored as 8-bit
 * codes"): a third of the bytes, the same bits.
 *
 * Every output is one chain of FMAs over k = 0, 1, ..., K - 1 from 0 (the bias added last),
 * whatever the number of rows, the tile a row falls in, the row block or the thread count: a
 * row gets the same bits alone or in any batch, by construction (tests/kernels/test_gemm.py checks it).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define NR_VECS 2            /* vectors of output columns in a panel */
#define NR (NR_VECS * NVEC)  /* output columns in a panel: 16 with AVX2, 32 with AVX-512 */
/* Rows in a tile. AVX2: 12 of the 16 registers hold the sums, 2 the panel's k step, 1 the
 * broadcast (the other shapes tried ran slower: docs/benchmarks.md). AVX-512 (and builds
 * without AVX2: generic 16-float vectors): 16 of its 32 registers; correct, not tuned (no machine). */
#if NVEC == 16
#define MR 8
#else
#define MR 6
#endif
/* Rows of x a pass over the panels takes at once: their K values must stay in the L2 cache
 * next to the panel being read; longer prompt chunks take passes. */
#define X_BLOCK_BYTES (192 * 1024)
/* A call of few rows (STREAM_ROWS or fewer) waits on the weights: its first row tile of each
 * panel requests the panel STREAM_AHEAD k steps (cache lines, with AVX2) ahead of its loads. One
 * row is left to the hardware prefetcher, and so are many rows, which wait on the FMAs instead. */
#define STREAM_ROWS (2 * MR)
#define STREAM_AHEAD 16

int64_t gemm_panel_width(void) { return NR; }

/* ---- weights stored as 8-bit codes ---------------------------------------------------------------
 *
 * A model quantized before it reached us (a GGUF file's Q4_1 or Q8_0 tensors) arrives as fp32
 * weights that are each scale * code + offset, with one (scale, offset) per column and block of
 * Q_BLOCK inputs. kernels/cpu/gemm.py finds those codes where they reproduce every weight exactly
 * (and the scale is an fp16 value, so scale * code is exact in fp32 and FMA-contracted or not
 * gives the same bits) and packs them in the panels' order: per panel and block of Q_BLOCK
 * inputs, Q_BLOCK x NR codes (k-major), then NR scales and NR offsets (fp32), Q_BLOCK_BYTES
 * in all: 10 bits a weight instead of 32. A panel's first row tile widens them back to fp32 as
 * it goes (and leaves them in a per-thread buffer when the panel has more row tiles, which read
 * that), so every output is the same FMA chain over the same fp32 weights as over fp32 panels:
 * the same bits. What it saves is the memory traffic that a decode step of few rows waits on. */
#define Q_BLOCK 32
#define Q_BLOCK_BYTES (Q_BLOCK * NR + 2 * NR * (int64_t)sizeof(float))
/* A lone row reads the codes faster than the hardware prefetcher brings them: its tile requests
 * them CODES_AHEAD bytes (~3 blocks) ahead, a line every 4 k steps. More rows gain nothing from
 * it, so they leave it to the hardware. */
#define CODES_AHEAD 2048

/* NVEC codes (bytes) as floats. GCC 12 scalarizes __builtin_convertvector from bytes (a
 * vcvtsi2ss per code: slower than reading the weights in fp32),
 * so x86 goes through the zero-extending load and the int-to-float conversion. */
#if (defined(__AVX512F__) && NVEC == 16) || (defined(__AVX2__) && NVEC == 8)
INLINE vn load_codes(const uint8_t *p) {
#if NVEC == 16
    __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
    __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#endif
    vn v;
    memcpy(&v, &x, sizeof v);
    return v;
}
#else
INLINE vn load_codes(const uint8_t *p) {
    vn v;
    for (int i = 0; i < NVEC; i++) v[i] = (float)p[i];
    return v;
}
#endif

/* ---- the row tile --------------------------------------------------------------------------------- */

/* acc[r] += x[r][kk] * b for the tile's rows: one k step. */
INLINE void tile_step(vn acc[MR][NR_VECS], const float *x, int64_t ldx, int64_t kk, const vn *b, const int rows) {
    for (int r = 0; r < rows; r++) {
        vn a = splat_n(x[r * ldx + kk]);
        for (int v = 0; v < NR_VECS; v++) acc[r][v] += a * b[v];
    }
}

/* The MR-or-fewer rows x one panel tile: sums over every k in registers, then bias, then stored
 * (cols < NR: the last panel of a width that is not a multiple of NR, zero-padded in the pack).
 * The panel is fp32 (panel) or codes (coded: widened here, and stored to `widened` if not NULL). */
INLINE void tile(const float *x, int64_t ldx, const float *panel, const uint8_t *codes, float *widened, int64_t k,
                 const float *bias, float *y, int64_t ldy, const int rows, int cols, const int stream,
                 const int coded) {
    vn acc[MR][NR_VECS];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < NR_VECS; v++) acc[r][v] = splat_n(0.0f);
    if (coded) {
        for (int64_t kb = 0; kb < k / Q_BLOCK; kb++) {
            const uint8_t *block = codes + kb * Q_BLOCK_BYTES;
            const float *scale = (const float *)(block + Q_BLOCK * NR), *offset = scale + NR;
            for (int64_t kk = kb * Q_BLOCK; kk < (kb + 1) * Q_BLOCK; kk++, block += NR) {
                if (rows == 1 && kk % 4 == 0) __builtin_prefetch(block + CODES_AHEAD, 0, 3);
                vn b[NR_VECS];
                for (int v = 0; v < NR_VECS; v++) {
                    b[v] = load_n(scale + v * NVEC) * load_codes(block + v * NVEC) + load_n(offset + v * NVEC);
                    if (widened) memcpy(widened + kk * NR + v * NVEC, &b[v], sizeof b[v]);
                }
                tile_step(acc, x, ldx, kk, b, rows);
            }
        }
    } else {
        for (int64_t kk = 0; kk < k; kk++) {
            if (stream) __builtin_prefetch(panel + (kk + STREAM_AHEAD) * NR, 0, 2);
            vn b[NR_VECS];
            for (int v = 0; v < NR_VECS; v++) b[v] = load_n(panel + kk * NR + v * NVEC);
            tile_step(acc, x, ldx, kk, b, rows);
        }
    }
    float out[NR];
    for (int r = 0; r < rows; r++) {
        for (int v = 0; v < NR_VECS; v++) store_n(out + v * NVEC, acc[r][v]);
        if (bias)
            for (int j = 0; j < cols; j++) out[j] += bias[j];
        memcpy(y + r * ldy, out, (size_t)cols * sizeof(float));
    }
}

/* tile() with its row count, `stream` and `coded` constants, so that the sums stay in registers
 * and the loop has no test for the prefetch (a streaming tile has 2 rows or more: see gemm()). */
static void tile_rows(const float *x, int64_t ldx, const float *panel, const uint8_t *codes, float *widened,
                      int64_t k, const float *bias, float *y, int64_t ldy, int rows, int cols, int stream) {
#define TILE(R, S, C) case R: tile(x, ldx, panel, codes, widened, k, bias, y, ldy, R, cols, S, C); return;
    if (codes) switch (rows) {
        TILE(1, 0, 1) TILE(2, 0, 1) TILE(3, 0, 1) TILE(4, 0, 1) TILE(5, 0, 1) TILE(6, 0, 1)
#if MR > 6
        TILE(7, 0, 1) TILE(8, 0, 1)
#endif
    }
    if (stream) switch (rows) {
        TILE(2, 1, 0) TILE(3, 1, 0) TILE(4, 1, 0) TILE(5, 1, 0) TILE(6, 1, 0)
#if MR > 6
        TILE(7, 1, 0) TILE(8, 1, 0)
#endif
    }
    switch (rows) {
        TILE(1, 0, 0) TILE(2, 0, 0) TILE(3, 0, 0) TILE(4, 0, 0) TILE(5, 0, 0) TILE(6, 0, 0)
#if MR > 6
        TILE(7, 0, 0) TILE(8, 0, 0)
#endif
    }
#undef TILE
}

/* A thread's buffer for one widened panel, grown as needed and kept (OpenMP's threads persist):
 * a fresh allocation per call of this size would be an mmap and its page faults every call. */
static float *panel_buffer(int64_t k) {
    static _Thread_local float *buf;
    static _Thread_local int64_t floats;
    if (floats < k * NR) {
        free(buf);
        buf = aligned_alloc(64, (size_t)(k * NR * sizeof(float) + 63) / 64 * 64);
        floats = buf ? k * NR : 0;
    }
    return buf;
}

/* y[m, n] (rows ldy floats apart) = x[m, k] (rows ldx apart) . W^T + bias (NULL: none), W [n, k]
 * packed by kernels/cpu/gemm.py into ceil(n / NR) panels: k x NR floats each (packed), or the panel's
 * codes (codes, k a multiple of Q_BLOCK; packed NULL). Returns 0, or -1 if a buffer for a panel's
 * widened weights could not be allocated (codes and more than MR rows only). */
static int gemm(const float *x, int64_t ldx, const float *packed, const uint8_t *codes, const float *bias,
                float *y, int64_t ldy, int64_t m, int64_t n, int64_t k, int threads) {
    int64_t panels = (n + NR - 1) / NR;
    int64_t block = X_BLOCK_BYTES / (k * (int64_t)sizeof(float)) / MR * MR;
    int failed = 0;
    if (block < MR) block = MR;
    for (int64_t m0 = 0; m0 < m; m0 += block) {
        int64_t rows = m - m0 < block ? m - m0 : block;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(| : failed)
        for (int64_t p = 0; p < panels; p++) {
            int cols = n - p * NR < NR ? (int)(n - p * NR) : NR;
            const float *panel = packed ? packed + p * k * NR : NULL;
            const uint8_t *panel_codes = codes ? codes + p * (k / Q_BLOCK) * Q_BLOCK_BYTES : NULL;
            float *widened = codes && rows > MR ? panel_buffer(k) : NULL;
            if (codes && rows > MR && !widened) {
                failed = 1;
                continue;
            }
            for (int64_t r = 0; r < rows; r += MR) {
                int tile_height = rows - r < MR ? (int)(rows - r) : MR;
                const float *x_tile = x + (m0 + r) * ldx, *b = bias ? bias + p * NR : NULL;
                float *y_tile = y + (m0 + r) * ldy + p * NR;
                if (r == 0 && codes) /* widens the codes; the tiles below read what it widened */
                    tile_rows(x_tile, ldx, NULL, panel_codes, widened, k, b, y_tile, ldy, tile_height, cols, 0);
                else
                    tile_rows(x_tile, ldx, codes ? widened : panel, NULL, NULL, k, b, y_tile, ldy, tile_height,
                              cols, r == 0 && m >= 2 && m <= STREAM_ROWS);
            }
        }
        if (failed) return -1;
    }
    return 0;
}

void gemm_f32(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
              int64_t m, int64_t n, int64_t k, int threads) {
    gemm(x, ldx, packed, NULL, bias, y, ldy, m, n, k, threads);
}

int64_t gemm_codes_block(void) { return Q_BLOCK; }

/* gemm_f32 over a weight kept as codes (kernels/cpu/gemm.py's CodedWeight). Returns 0, -1 (no memory)
 * or -3 (k not a multiple of Q_BLOCK). */
int gemm_codes_f32(const float *x, int64_t ldx, const uint8_t *codes, const float *bias, float *y, int64_t ldy,
                   int64_t m, int64_t n, int64_t k, int threads) {
    if (k % Q_BLOCK) return -3;
    return gemm(x, ldx, NULL, codes, bias, y, ldy, m, n, k, threads);
}
