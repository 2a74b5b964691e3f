/* RMSNorm over the last dimension in one pass per row, for the CPU.
 *
 *     out[r][d] = weight[d] * (x[r][d] / sqrt(mean over d of x[r][d]^2 + eps))
 *
 * transformers' RMSNorm modules compute the same thing as five separate tensor operations
 * (square, mean, add, rsqrt, two multiplies), each a full pass over memory plus its own
 * dispatch; on a CPU step of a small model that adds up to a tenth of the time. Rows are
 * contiguous float32, or bfloat16 (then computed as transformers computes it: the row widened
 * to float32, normalized, rounded to bfloat16, multiplied by the bfloat16 weight, and rounded
 * again). Built together with decode_attention.c by kernels/cpu/__init__.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

void kvpaging_rms_norm_f32(const float *x, const float *weight, float *out, int64_t rows, int64_t dim,
                           float eps)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        float sum_sq = 0.0f;
        for (int64_t d = 0; d < dim; d++)
            sum_sq += xr[d] * xr[d];
        const float inv_rms = 1.0f / sqrtf(sum_sq / (float)dim + eps);
        for (int64_t d = 0; d < dim; d++)
            o[d] = weight[d] * (xr[d] * inv_rms);
    }
}

static inline float bf16_to_f32(uint16_t h)
{
    const uint32_t bits = (uint32_t)h << 16;  /* a bfloat16 number is the top half of a float32 one */
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to the nearest bfloat16, ties to even (torch's rounding); a NaN stays a NaN. Integer
 * arithmetic and a select, no branch, so that the loops below vectorize. */
static inline uint16_t f32_to_bf16(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (bits >> 16) | 0x40u;
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

void kvpaging_rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows, int64_t dim,
                            float eps)
{
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * dim;
        uint16_t *o = out + r * dim;
        float sum_sq = 0.0f;
        for (int64_t d = 0; d < dim; d++) {
            const float v = bf16_to_f32(xr[d]);
            sum_sq += v * v;
        }
        const float inv_rms = 1.0f / sqrtf(sum_sq / (float)dim + eps);
        for (int64_t d = 0; d < dim; d++) {
            const float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[d]) * inv_rms));
            o[d] = f32_to_bf16(bf16_to_f32(weight[d]) * normed);
        }
    }
}
