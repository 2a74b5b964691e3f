/* RMSNorm as transformers' RMSNorm modules compute it, to the bit, in two C passes around torch's own mean.
 *
 * transformers writes it (Llama's LlamaRMSNorm, and the many models that copy it) as
 *
 *     h = x.to(float32); var = h.pow(2).mean(-1, keepdim=True); h = h * rsqrt(var + eps)
 *     out = weight * h.to(x.dtype)
 *
 * eight tensor operations, each a pass over memory with its own dispatch: about 2 ms for a 2048-token bfloat16
 * prefill chunk of the trained model, 61 times a step. Every step but the mean is elementwise IEEE arithmetic,
 * which C reproduces exactly: a float32 square, add, square root, division and product are each rounded once,
 * and a bfloat16 result is the float32 one rounded to nearest, ties to even (bf16.h), as torch rounds it; the
 * product of two bfloat16 numbers is exact in float32, so `weight * h` rounds once too. The mean is a sum, whose
 * order decides its last bit, and torch's order depends on its vector width: so it stays torch's own, called by
 * kvpaging/kernels/cpu/__init__.py between the two passes here on the squares the first one writes (a float32
 * tensor of the shape `h.pow(2)` has, so the same code sums it). `rsqrt` is torch's 1 / sqrt.
 *
 * Compiled without -ffast-math (kvpaging/kernels/cpu/__init__.py gives each file its flags): reordered or fused
 * arithmetic would not be torch's. Rows are shared among `threads` OpenMP threads when there are many.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

#define MANY 32768 /* elements worth more than one thread */

/* squares[i] = x[i] * x[i] in float32, x float32 or bfloat16 (widened exactly) */
void kvpaging_rms_squares(const void *x, int64_t bf16, float *squares, int64_t n, int64_t threads)
{
    const uint16_t *xh = x;
    const float *xf = x;
    if (bf16) {
#pragma omp parallel for num_threads((int)threads) schedule(static) if (threads > 1 && n >= MANY)
        for (int64_t i = 0; i < n; i++) {
            const float h = bf16_to_f32(xh[i]);
            squares[i] = h * h;
        }
    } else {
#pragma omp parallel for num_threads((int)threads) schedule(static) if (threads > 1 && n >= MANY)
        for (int64_t i = 0; i < n; i++)
            squares[i] = xf[i] * xf[i];
    }
}

/* out[r][d] = weight[d] * round(x[r][d] * (1 / sqrt(var[r] + eps))), in x's dtype (weight's is the same) */
void kvpaging_rms_scale(const void *x, const float *var, const void *weight, void *out, int64_t bf16, int64_t rows,
                        int64_t dim, float eps, int64_t threads)
{
#pragma omp parallel for num_threads((int)threads) schedule(static) if (threads > 1 && rows * dim >= MANY)
    for (int64_t r = 0; r < rows; r++) {
        const float inv = 1.0f / sqrtf(var[r] + eps);
        if (bf16) {
            const uint16_t *xr = (const uint16_t *)x + r * dim, *w = weight;
            uint16_t *o = (uint16_t *)out + r * dim;
            for (int64_t d = 0; d < dim; d++)
                o[d] = f32_to_bf16(bf16_to_f32(w[d]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[d]) * inv)));
        } else {
            const float *xr = (const float *)x + r * dim, *w = weight;
            float *o = (float *)out + r * dim;
            for (int64_t d = 0; d < dim; d++)
                o[d] = w[d] * (xr[d] * inv);
        }
    }
}
