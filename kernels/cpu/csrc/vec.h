/* Vectors of 16 floats for the CPU kernels (GCC/Clang vector extensions: one AVX-512 register,
 * or a pair of AVX2 ones): loads, stores, the sum of the lanes and exp, shared by
 * paged_decode_attention.c and fused_ops.c (built together into one library, kernels/cpu/). */
#ifndef INFERLINE_VEC_H
#define INFERLINE_VEC_H

#include <stdint.h>
#include <string.h>

#define VEC 16
#define INLINE static inline __attribute__((always_inline))

typedef float vf __attribute__((vector_size(VEC * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VEC * sizeof(int32_t))));
typedef float vf8 __attribute__((vector_size(8 * sizeof(float)))); /* half a vf: one AVX2 register */
typedef int32_t vi8 __attribute__((vector_size(8 * sizeof(int32_t))));

INLINE vf load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
INLINE void store(float *p, vf v) { memcpy(p, &v, sizeof v); }
/* All lanes x. Not (vf){0} + x: that is an addition GCC must keep (0 + -0 is +0), a scalar add
 * before every broadcast. */
INLINE vf splat(float x) { return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
INLINE vf vselect(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }

/* a > b, a >= b, a <= b lane by lane: all ones or 0. GCC 12 scalarizes a comparison of vectors
 * wider than the machine's (16 floats on AVX2: a vcomiss and a cmov per lane), so without AVX-512
 * the two halves of 8 are compared apart (where __builtin_shufflevector exists: GCC 12+, Clang). */
#if defined(__AVX512F__) || (defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 12)
#define VCMP(name, op) \
    INLINE vi name(vf a, vf b) { return a op b; }
#else
#define VCMP(name, op)                                                                        \
    INLINE vi name(vf a, vf b) {                                                              \
        vi8 lo = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) op                     \
                 __builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7);                       \
        vi8 hi = __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15) op               \
                 __builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15);                 \
        return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); \
    }
#endif
VCMP(vgt, >)
VCMP(vge, >=)
VCMP(vle, <=)
#undef VCMP

/* acc + a * b, rounded once. With AVX-512 an explicit FMA instruction, so that two loops meant to
 * give the same bits (the decode and prompt-tile attention) do not depend on which product of
 * an a * b + c * d the compiler chose to fuse; elsewhere contracted (-ffp-contract=fast). */
#if defined(__AVX512F__)
#include <immintrin.h>
INLINE vf fma16(vf acc, vf a, vf b) { return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc); }
#else
INLINE vf fma16(vf acc, vf a, vf b) { return acc + a * b; }
#endif

/* fp16 K/V caches (INFERLINE_CACHE__DTYPE=float16), stored as uint16_t bit patterns: 16 halves
 * widened to 16 floats on load, floats rounded to the nearest half on store. x86 through the
 * F16C/AVX-512 conversions (GCC 12 scalarizes __builtin_convertvector on _Float16 vectors: the
 * attention kernel over fp16 ran slower than over fp32); elsewhere through _Float16 (AArch64
 * converts in vectors). Without either the library still builds; its fp16 calls return -3. */
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#define HAVE_F16 1
INLINE vf load_h(const uint16_t *p) {
    vf v;
#if defined(__AVX512F__)
    __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    memcpy(&v, &x, sizeof v);
#else
    __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    memcpy(&v, &lo, sizeof lo);
    memcpy((char *)&v + sizeof lo, &hi, sizeof hi);
#endif
    return v;
}
INLINE void store_h(uint16_t *p, vf v) {
#if defined(__AVX512F__)
    __m512 x;
    memcpy(&x, &v, sizeof x);
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    __m256 lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (char *)&v + sizeof lo, sizeof hi);
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm_storeu_si128((__m128i *)(p + 8), _mm256_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
}
#elif defined(__FLT16_MAX__)
#define HAVE_F16 1
typedef _Float16 vh __attribute__((vector_size(VEC * sizeof(_Float16))));
INLINE vf load_h(const uint16_t *p) { vh h; memcpy(&h, p, sizeof h); return __builtin_convertvector(h, vf); }
INLINE void store_h(uint16_t *p, vf v) { vh h = __builtin_convertvector(v, vh); memcpy(p, &h, sizeof h); }
#else
#define HAVE_F16 0
#endif

/* The machine's own vector, for loops whose every lane is computed on its own (so their bits do
 * not depend on the width): 16 floats with AVX-512, 8 with AVX2. GCC keeps an array of 16-float
 * vectors that a loop updates in memory where the machine has no such register, moving each
 * through general registers in 8-byte pieces. */
#if defined(__AVX512F__) || !defined(__AVX2__)
#define NVEC VEC
typedef vf vn;
INLINE vn load_n(const float *p) { return load(p); }
INLINE vn splat_n(float x) { return splat(x); }
#define load_n_h load_h
#else
#define NVEC 8
typedef vf8 vn;
INLINE vn load_n(const float *p) { vn v; memcpy(&v, p, sizeof v); return v; }
INLINE vn splat_n(float x) { return (vn){x, x, x, x, x, x, x, x}; }
#if defined(__F16C__)
INLINE vn load_n_h(const uint16_t *p) {
    __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    vn v;
    memcpy(&v, &x, sizeof v);
    return v;
}
#elif HAVE_F16
typedef _Float16 vnh __attribute__((vector_size(NVEC * sizeof(_Float16))));
INLINE vn load_n_h(const uint16_t *p) { vnh h; memcpy(&h, p, sizeof h); return __builtin_convertvector(h, vn); }
#endif
#endif
INLINE void store_n(float *p, vn v) { memcpy(p, &v, sizeof v); }

/* The sum of the lanes: halves added to each other, log2(16) times. */
INLINE float hsum(vf v) {
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 12
    float s = 0.0f;
    for (int i = 0; i < VEC; i++) s += v[i];
    return s;
#else
    typedef float vf4 __attribute__((vector_size(4 * sizeof(float))));
    vf8 s8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
             __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    vf4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
#endif
}

/* One round of transpose_n: in every 2m x 2m block of the matrix (x[i] its rows), the two
 * off-diagonal m x m blocks change places; `lo` and `hi` pick the lanes of the new x[i] and
 * x[i + m] from the old pair (shuffle indices: NVEC and up are the second vector's lanes). */
#define UNPAREN(...) __VA_ARGS__
#define SWAP_BLOCKS(m, lo, hi)                                                   \
    for (int i = 0; i < NVEC; i++)                                               \
        if (!(i & (m))) {                                                        \
            vn a = x[i], b = x[i | (m)];                                         \
            x[i] = __builtin_shufflevector(a, b, UNPAREN lo);                    \
            x[i | (m)] = __builtin_shufflevector(a, b, UNPAREN hi);              \
        }

/* Transposes NVEC vectors of the machine's width in place (lane j of x[i] goes to lane i of
 * x[j]): rounds that swap the off-diagonal blocks of NVEC / 2, ..., 2 and 1 lanes (16 lanes: 64
 * shuffles). Written for 16-float vectors alone, AVX2 had GCC move every lane on its own: 512
 * scalar moves a transpose. */
INLINE void transpose_n(vn x[NVEC]) {
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 12 /* no __builtin_shufflevector */
    vn y[NVEC];
    for (int i = 0; i < NVEC; i++)
        for (int j = 0; j < NVEC; j++) y[j][i] = x[i][j];
    memcpy(x, y, sizeof y);
#elif NVEC == 16
    SWAP_BLOCKS(8, (0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
                (8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
    SWAP_BLOCKS(4, (0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27),
                (4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31))
    SWAP_BLOCKS(2, (0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),
                (2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))
    SWAP_BLOCKS(1, (0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30),
                (1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31))
#else
    SWAP_BLOCKS(4, (0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15))
    SWAP_BLOCKS(2, (0, 1, 8, 9, 4, 5, 12, 13), (2, 3, 10, 11, 6, 7, 14, 15))
    SWAP_BLOCKS(1, (0, 8, 2, 10, 4, 12, 6, 14), (1, 9, 3, 11, 5, 13, 7, 15))
#endif
}
#undef SWAP_BLOCKS
#undef UNPAREN

/* Lane-wise comparisons and select in the machine's own vectors (vn), for vexp_n. */
#if NVEC == VEC
typedef vi vin;
INLINE vin vgt_n(vn a, vn b) { return vgt(a, b); }
INLINE vin vge_n(vn a, vn b) { return vge(a, b); }
INLINE vin vle_n(vn a, vn b) { return vle(a, b); }
#else
typedef int32_t vin __attribute__((vector_size(NVEC * sizeof(int32_t))));
INLINE vin vgt_n(vn a, vn b) { return a > b; }
INLINE vin vge_n(vn a, vn b) { return a >= b; }
INLINE vin vle_n(vn a, vn b) { return a <= b; }
#endif
INLINE vn vselect_n(vin mask, vn a, vn b) { return (vn)((mask & (vin)a) | (~mask & (vin)b)); }

/* exp(x) lane by lane: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-6 polynomial (Cephes'
 * coefficients, ~1 ulp), times 2^n built in the exponent bits. Below -87.3 the result is 0
 * (-inf gives 0); above 88 it is exp(88), finite (so g / (1 + exp(-g)) stays a number).
 * In the machine's vectors: written over 16-float vectors, AVX2 builds kept every intermediate
 * on the stack. Every lane is computed on its own, so the bits do not depend on the width (the
 * 16-float version and this one gave equal outputs on 10^6 inputs, both ends of the range too). */
INLINE vn vexp_n(vn x) {
    x = vselect_n(vgt_n(x, splat_n(88.0f)), splat_n(88.0f), x);
    vin underflow = vle_n(x, splat_n(-87.3f));
    x = vselect_n(underflow, splat_n(-87.3f), x);
    vn n = x * 1.44269504f;
    n = n + vselect_n(vge_n(n, splat_n(0.0f)), splat_n(0.5f), splat_n(-0.5f));
    vin ni = __builtin_convertvector(n, vin); /* rounded to the nearest integer */
    n = __builtin_convertvector(ni, vn);
    vn r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vn p = splat_n(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vin bits = (ni + 127) << 23;
    vn two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return vselect_n(underflow, splat_n(0.0f), p * two_n);
}

/* exp of 16 lanes: vexp_n on each of the vf's NVEC-float parts. */
INLINE vf vexp(vf x) {
    vn part[VEC / NVEC];
    memcpy(part, &x, sizeof x);
    for (int i = 0; i < VEC / NVEC; i++) part[i] = vexp_n(part[i]);
    memcpy(&x, part, sizeof x);
    return x;
}

#endif
