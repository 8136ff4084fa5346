/* The search for a weight's exact 8-bit codes (kernels/cpu/gemm.py, exact_codes): for each block
 * of `block` weights, the first of its `num_steps` candidate steps (fp16 values, in the caller's
 * order) with which every weight is step * code + low exactly, code = (w - low) / step rounded half
 * to even and clamped to 0..255. The arithmetic is exact_codes_reference's, value by value: an fp32
 * divide, nearbyintf under the default rounding (half to even, as torch.round), and step * code
 * exact in fp32 (an fp16 step times a code below 256), so a contracted FMA gives the same bits.
 * A constant block gets scale 0 and codes 0. Returns the number of blocks no step fits. */
#include <math.h>
#include <stdint.h>

static int fits(const float *w, float low, float step, int64_t block, uint8_t *codes) {
    if (!(step > 0.0f) || !isfinite(step)) return 0;
    for (int64_t j = 0; j < block; j++) {
        float q = nearbyintf((w[j] - low) / step);
        q = q < 0.0f ? 0.0f : (q > 255.0f ? 255.0f : q);
        if (step * q + low != w[j]) return 0;
        codes[j] = (uint8_t)q;
    }
    return 1;
}

static int constant(const float *w, float low, int64_t block, uint8_t *codes) {
    for (int64_t j = 0; j < block; j++)
        if (w[j] != low) return 0;
    for (int64_t j = 0; j < block; j++) codes[j] = 0;
    return 1;
}

int64_t gemm_codes_search(const float *w, const float *low, const float *steps, int64_t n,
                          int64_t block, int64_t num_steps, float *scale, uint8_t *codes) {
    int64_t unfitted = 0;
#pragma omp parallel for reduction(+ : unfitted) schedule(static)
    for (int64_t b = 0; b < n; b++) {
        const float *wb = w + b * block;
        uint8_t *cb = codes + b * block;
        scale[b] = 0.0f;
        if (constant(wb, low[b], block, cb)) continue;
        int64_t s = 0;
        while (s < num_steps && !fits(wb, low[b], steps[b * num_steps + s], block, cb)) s++;
        if (s < num_steps) scale[b] = steps[b * num_steps + s];
        else unfitted++;
    }
    return unfitted;
}
