/* The rotary position embedding as transformers applies it (Llama's apply_rotary_pos_emb), to the bit.
 *
 *     out = (x * cos) + (rotate_half(x) * sin),   rotate_half(x) = cat(-x[..., half:], x[..., :half])
 *
 * with cos and sin (one row of `dim` per token) broadcast over the heads: two slices, a negation, a concatenation,
 * two products and a sum, each a pass over memory with its own dispatch, for the queries and again for the keys
 * of every layer. All of it is elementwise IEEE arithmetic, which C repeats exactly: in float32 each product and the
 * sum are rounded once (compiled without -ffast-math and with -ffp-contract=off: no fused multiply-add); in bfloat16
 * torch computes each product and the sum in float32 and rounds each result to bfloat16 (to nearest, ties to even:
 * bf16.h), and so does this. A negation is exact.
 *
 * Layouts: x [tokens, heads, dim] with dim contiguous, token rows `x_token_stride` elements apart and heads
 * `x_head_stride` apart (the view of a projection's output); cos and sin [tokens, dim], contiguous; out [tokens,
 * heads, dim], contiguous. All float32 or all bfloat16. Tokens are shared among `threads` OpenMP threads when there
 * are many. Built with the other CPU kernels by kvpaging/kernels/cpu/__init__.py.
 */
#include <stdint.h>

#include "bf16.h"

#define MANY 32768 /* elements worth more than one thread */

void kvpaging_rotary(const void *x, int64_t x_token_stride, int64_t x_head_stride, const void *cos, const void *sin,
                     void *out, int64_t bf16, int64_t tokens, int64_t heads, int64_t dim, int64_t threads)
{
    const int64_t half = dim / 2;
#pragma omp parallel for num_threads((int)threads) schedule(static) if (threads > 1 && tokens * heads * dim >= MANY)
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t h = 0; h < heads; h++) {
            const int64_t in = t * x_token_stride + h * x_head_stride, at = (t * heads + h) * dim;
            if (bf16) {
                const uint16_t *xr = (const uint16_t *)x + in, *c = (const uint16_t *)cos + t * dim,
                               *s = (const uint16_t *)sin + t * dim;
                uint16_t *o = (uint16_t *)out + at;
                for (int64_t d = 0; d < dim; d++) {
                    const float rotated = d < half ? -bf16_to_f32(xr[d + half]) : bf16_to_f32(xr[d - half]);
                    const uint16_t first = f32_to_bf16(bf16_to_f32(xr[d]) * bf16_to_f32(c[d]));
                    const uint16_t second = f32_to_bf16(rotated * bf16_to_f32(s[d]));
                    o[d] = f32_to_bf16(bf16_to_f32(first) + bf16_to_f32(second));
                }
            } else {
                const float *xr = (const float *)x + in, *c = (const float *)cos + t * dim,
                            *s = (const float *)sin + t * dim;
                float *o = (float *)out + at;
                for (int64_t d = 0; d < dim; d++) {
                    const float rotated = d < half ? -xr[d + half] : xr[d - half];
                    const float first = xr[d] * c[d], second = rotated * s[d];
                    o[d] = first + second;
                }
            }
        }
    }
}
