/* Paged attention for head sizes other than 64 and 128 (any multiple of 16 up to 256), called
 * from paged_decode_attention.c: the same loops (attention.h) with the head size a run-time
 * value, so its loops over a head's vectors stay rolled, and one query head at a time. Built
 * as its own object, alongside the constant-size one (kernels/cpu/ compiles them in parallel):
 * nested and unrolled 16 times each, these loops were most of the library's build time (four
 * minutes of GCC on an AVX2 machine) for shapes the default models do not have. */
#define MAX_G 1
#define UNROLL_D _Pragma("GCC unroll 1")
#include "attention.h"

void attend_blocks_any_f32(BLOCKS_PARAMS) { attend_blocks_d(a, r, table, b0, b1, out, m, l, a->head_dim, 0); }
void attend_tile_any_f32(TILE_PARAMS) { attend_tile_d(a, r0, nr, table, b0, rows, kt, a->head_dim, 0); }

void attend_blocks_any_f16(BLOCKS_PARAMS) {
#if HAVE_F16
    attend_blocks_d(a, r, table, b0, b1, out, m, l, a->head_dim, 1);
#endif
}
void attend_tile_any_f16(TILE_PARAMS) {
#if HAVE_F16
    attend_tile_d(a, r0, nr, table, b0, rows, kt, a->head_dim, 1);
#endif
}
