/* y = x . W^T (+ bias) for the linear layers on the CPU, fp32: a register-tiled GEMM over weights
 * packed once at load (kernels/gemm.py), for the few rows of a decode step.
 *
 * Why not oneDNN or MKL: a decode step multiplies ~30 rows by every weight of the model, and
 * the weights (540 MB for SmolLM2-135M) come from memory each step. Below ~100 rows the
 * libraries run far below this machine's FMA rate (figures: docs/benchmarks.md; whole steps:
 * bench/decode_step.py --compare). This is the textbook loop nest (BLIS's): the weight is
 * stored in panels of NR output columns, k-major (panel[k][0..NR-1]), so one k step of a panel
 * is NR / NVEC vector loads; a tile of MR rows x NR columns keeps its MR x NR sums in registers
 * (AVX2: 6 x 16 = 12 of the 16 registers) and each x value is broadcast once per k. Panels are
 * spread over the threads; within a thread each panel is read from memory once and from cache
 * for its other row tiles.
 *
 * Every output is one chain of FMAs over k = 0, 1, ..., K - 1 from 0 (the bias added last),
 * whatever the number of rows, the tile a row falls in, the row block or the thread count: a
 * row gets the same bits alone or in any batch, by construction (tests/test_gemm.py checks it).
 */
#include <stdint.h>
#include <string.h>

#include "vec.h"

#define NR_VECS 2            /* vectors of output columns in a panel */
#define NR (NR_VECS * NVEC)  /* output columns in a panel: 16 with AVX2, 32 with AVX-512 */
/* Rows in a tile. AVX2: 12 of the 16 registers hold the sums, 2 the panel's k step, 1 the
 * broadcast (measured on a Zen 3: tiles of 4 x 24 ran 1.3-1.45x slower, rows spread evenly over
 * the tiles (6 6 5 5 5 5 for 32, not 6 6 6 6 6 2) 4-13% slower at 8-32 rows). AVX-512 (and builds
 * without AVX2: generic 16-float vectors): 16 of its 32 registers; correct, not tuned (no machine). */
#if NVEC == 16
#define MR 8
#else
#define MR 6
#endif
/* Rows of x a pass over the panels takes at once: their K values must stay in the L2 cache
 * (512 KB a core on a Zen 3) next to the panel being read; longer prompt chunks take passes. */
#define X_BLOCK_BYTES (192 * 1024)
/* A call of few rows (STREAM_ROWS or fewer) waits on the weights: its first row tile of each
 * panel requests the panel STREAM_AHEAD k steps (cache lines, with AVX2) ahead of its loads.
 * Measured on a Zen 3 (30 layers of weights from memory): 4-12 rows 1.06-1.25x faster, 1 row the
 * same or slower (left to the hardware), 32-60 rows the same or slower (they wait on the FMAs). */
#define STREAM_ROWS (2 * MR)
#define STREAM_AHEAD 16

int64_t gemm_panel_width(void) { return NR; }

/* The MR-or-fewer rows x one panel tile: sums over every k in registers, then bias, then stored
 * (cols < NR: the last panel of a width that is not a multiple of NR, zero-padded in the pack). */
INLINE void tile(const float *x, int64_t ldx, const float *panel, int64_t k, const float *bias,
                 float *y, int64_t ldy, const int rows, int cols, const int stream) {
    vn acc[MR][NR_VECS];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < NR_VECS; v++) acc[r][v] = splat_n(0.0f);
    for (int64_t kk = 0; kk < k; kk++) {
        if (stream) __builtin_prefetch(panel + (kk + STREAM_AHEAD) * NR, 0, 2);
        vn b[NR_VECS];
        for (int v = 0; v < NR_VECS; v++) b[v] = load_n(panel + kk * NR + v * NVEC);
        for (int r = 0; r < rows; r++) {
            vn a = splat_n(x[r * ldx + kk]);
            for (int v = 0; v < NR_VECS; v++) acc[r][v] += a * b[v];
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

/* tile() with its row count and `stream` constants, so that the sums stay in registers and the
 * loop has no test for the prefetch (a streaming tile has 2 rows or more: see gemm_f32). */
static void tile_rows(const float *x, int64_t ldx, const float *panel, int64_t k, const float *bias,
                      float *y, int64_t ldy, int rows, int cols, int stream) {
#define TILE(R, S) case R: tile(x, ldx, panel, k, bias, y, ldy, R, cols, S); return;
    if (stream) switch (rows) {
        TILE(2, 1) TILE(3, 1) TILE(4, 1) TILE(5, 1) TILE(6, 1)
#if MR > 6
        TILE(7, 1) TILE(8, 1)
#endif
    }
    switch (rows) {
        TILE(1, 0) TILE(2, 0) TILE(3, 0) TILE(4, 0) TILE(5, 0) TILE(6, 0)
#if MR > 6
        TILE(7, 0) TILE(8, 0)
#endif
    }
#undef TILE
}

/* y[m, n] (rows ldy floats apart) = x[m, k] (rows ldx apart) . W^T + bias (NULL: none), W [n, k]
 * packed by kernels/gemm.py into ceil(n / NR) panels of k x NR floats. */
void gemm_f32(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
              int64_t m, int64_t n, int64_t k, int threads) {
    int64_t panels = (n + NR - 1) / NR;
    int64_t block = X_BLOCK_BYTES / (k * (int64_t)sizeof(float)) / MR * MR;
    if (block < MR) block = MR;
    for (int64_t m0 = 0; m0 < m; m0 += block) {
        int64_t rows = m - m0 < block ? m - m0 : block;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            int cols = n - p * NR < NR ? (int)(n - p * NR) : NR;
            for (int64_t r = 0; r < rows; r += MR)
                tile_rows(x + (m0 + r) * ldx, ldx, packed + p * k * NR, k, bias ? bias + p * NR : NULL,
                          y + (m0 + r) * ldy + p * NR, ldy, rows - r < MR ? (int)(rows - r) : MR, cols,
                          r == 0 && m >= 2 && m <= STREAM_ROWS);
        }
    }
}
