/* Fused elementwise ops for the CPU, fp32, under vLLM's names: rms_norm, fused_add_rms_norm,
 * silu_and_mul, and rotary_embedding fused with the K/V store (reshape_and_cache).
 *
 * Why: each of these is several PyTorch ops (rms_norm alone is pow, mean, add, rsqrt, mul, mul),
 * and every op is a dispatch plus an OpenMP fork and join over a few KB of data; one pass over
 * the rows here does the same arithmetic for a fraction of that. The arithmetic follows
 * HF's: x * rsqrt(mean(x^2) + eps) * weight; silu(g) * u = g * sigmoid(g) * u;
 * x * cos + rotate_half(x) * sin (sums may round differently from PyTorch's, by an ulp or so).
 *
 * Rows are spread over OpenMP threads only when there is enough work: below PAR_MIN floats a
 * fork and join costs more than the op. Every row is computed the same way whichever thread
 * takes it, so results do not depend on the thread count or on the other rows of the batch.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

#define PAR_MIN 65536 /* floats of work below which one thread does the whole op */
#define PF 3          /* rows ahead that a row loop requests (prefetch_row) */

static int threads_for(int64_t floats, int threads) { return floats >= PAR_MIN ? threads : 1; }

/* Rows are requested PF rows ahead of their use. Between two calls of one of these ops a decode
 * step streams megabytes of weights and K/V through the caches, so the rows they read (the
 * residual stream) and the freshly allocated rows they write start in memory, and this machine's
 * hardware prefetchers barely help: without this, most of the time goes to the residual's
 * loads. `write` 1 asks for the lines to be written (an output row). */
INLINE void prefetch_row(const float *p, int64_t floats, int write) {
    for (int64_t off = 0; off < floats; off += 64 / sizeof(float)) {
        if (write)
            __builtin_prefetch(p + off, 1, 3);
        else
            __builtin_prefetch(p + off, 0, 3);
    }
}

/* 1 / sqrt(mean(x^2) + eps) of one row: 16 partial sums (lane j over elements j, j + 16, ...),
 * then their sum (hsum). The partial sums live in the machine's vectors (VEC / NVEC of them):
 * as one 16-float vector, AVX2 builds kept it on the stack. */
INLINE float rms_scale(const float *x, int64_t n, float eps) {
    vn acc[VEC / NVEC];
    for (int j = 0; j < VEC / NVEC; j++) acc[j] = splat_n(0.0f);
    int64_t i = 0;
    for (; i + VEC <= n; i += VEC)
        for (int j = 0; j < VEC / NVEC; j++) {
            vn v = load_n(x + i + j * NVEC);
            acc[j] += v * v;
        }
    vf all;
    memcpy(&all, acc, sizeof all);
    float sum = hsum(all);
    for (; i < n; i++) sum += x[i] * x[i];
    return 1.0f / sqrtf(sum / (float)n + eps);
}

INLINE void scale_row(const float *x, const float *w, float r, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* out[r] = rms_norm(x[r]) * weight; x rows x_stride floats apart, out contiguous. */
void rms_norm_f32(const float *x, int64_t x_stride, const float *weight, float *out, int64_t rows,
                  int64_t cols, float eps, int threads) {
#pragma omp parallel for num_threads(threads_for(rows * cols, threads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        if (r + PF < rows) {
            prefetch_row(xr + PF * x_stride, cols, 0);
            prefetch_row(out + (r + PF) * cols, cols, 1);
        }
        scale_row(xr, weight, rms_scale(xr, cols, eps), out + r * cols, cols);
    }
}

/* residual[r] += x[r]; out[r] = rms_norm(residual[r]) * weight (vLLM's fused_add_rms_norm: the
 * residual stream is updated in place, the normalized copy goes to the next sublayer). */
void fused_add_rms_norm_f32(const float *x, int64_t x_stride, float *residual, const float *weight, float *out,
                            int64_t rows, int64_t cols, float eps, int threads) {
#pragma omp parallel for num_threads(threads_for(rows * cols, threads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *res = residual + r * cols;
        if (r + PF < rows) {
            prefetch_row(xr + PF * x_stride, cols, 0);
            prefetch_row(res + PF * cols, cols, 1);
            prefetch_row(out + (r + PF) * cols, cols, 1);
        }
        for (int64_t i = 0; i < cols; i++) res[i] = xr[i] + res[i];
        scale_row(res, weight, rms_scale(res, cols, eps), out + r * cols, cols);
    }
}

/* out[r, i] = silu(x[r, i]) * x[r, inter + i]: gate and up side by side in each row of the
 * fused gate_up projection (x rows x_stride floats apart), out [rows, inter] contiguous. */
void silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t inter, int threads) {
#pragma omp parallel for num_threads(threads_for(rows * inter * 4, threads)) schedule(static) /* exp: 4x the work */
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * x_stride, *up = gate + inter;
        float *o = out + r * inter;
        if (r + PF < rows) prefetch_row(o + PF * inter, inter, 1);
        int64_t i = 0;
        for (; i + NVEC <= inter - inter % VEC; i += NVEC) { /* the tail past whole vfs: expf, whatever NVEC */
            vn g = load_n(gate + i);
            store_n(o + i, g / (1.0f + vexp_n(-g)) * load_n(up + i)); /* silu(g) = g / (1 + exp(-g)) */
        }
        for (; i < inter; i++) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

/* Neox/HF rotation of one head in place: the two halves of head_dim are the pairs; cos and sin
 * are the position's rows of tables holding (c, c) and (-s, s), so that
 * x' = x * cos + swap_halves(x) * sin (kernels/fused.py's torch path does the same). */
INLINE void rotate_head(float *x, const float *cos, const float *sin, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] + b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* 1 if this build reads and writes fp16 K/V caches (kernels/cpu/ supports_kv_half). */
int kv_half_supported(void) { return HAVE_F16; }

/* n floats into an fp16 cache row, rounded to the nearest half (n a multiple of VEC). */
INLINE void store_halves(void *dst, const float *src, int64_t n) {
#if HAVE_F16
    for (int64_t i = 0; i < n; i += VEC) store_h((uint16_t *)dst + i, load(src + i));
#endif
}

/* For each token t of qkv [tokens, (q_heads + 2 kv_heads) * head_dim] (rows `stride` apart):
 * rotate its q and k heads in place by cos/sin [tokens, head_dim], then copy its k and v heads
 * into the caches at slot slots[t] (cache row = slot; a negative slot is skipped, as padding);
 * the caches hold floats, or halves when kv_half (head_dim a multiple of VEC).
 * Returns 0, -2 (nothing written) if a slot is past the cache's num_slots rows, or -3 for a
 * shape or element type it does not take. */
int rope_store_kv_f32(float *qkv, int64_t stride, const float *cos, const float *sin, int64_t tokens,
                      int64_t q_heads, int64_t kv_heads, int64_t head_dim, void *k_cache, void *v_cache,
                      const int64_t *slots, int64_t num_slots, int threads, int kv_half) {
    if (kv_half && (!HAVE_F16 || head_dim % VEC)) return -3;
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] >= num_slots) return -2;
    int64_t kv_row = kv_heads * head_dim, esz = kv_half ? 2 : 4;
    char *kc = k_cache, *vc = v_cache;
#pragma omp parallel for num_threads(threads_for(tokens * stride, threads)) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        float *row = qkv + t * stride;
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        if (t + 1 < tokens && slots[t + 1] >= 0) { /* the next token's cache rows, to be written */
            prefetch_row((float *)(kc + slots[t + 1] * kv_row * esz), kv_row * esz / 4, 1);
            prefetch_row((float *)(vc + slots[t + 1] * kv_row * esz), kv_row * esz / 4, 1);
        }
        for (int64_t h = 0; h < q_heads + kv_heads; h++) rotate_head(row + h * head_dim, c, s, head_dim / 2);
        if (slots[t] < 0) continue;
        const float *k = row + q_heads * head_dim;
        char *kd = kc + slots[t] * kv_row * esz, *vd = vc + slots[t] * kv_row * esz;
        if (kv_half) {
            store_halves(kd, k, kv_row);
            store_halves(vd, k + kv_row, kv_row);
        } else {
            memcpy(kd, k, sizeof(float) * kv_row);
            memcpy(vd, k + kv_row, sizeof(float) * kv_row);
        }
    }
    return 0;
}
