/* RMSNorm as transformers' RMSNorm modules compute it, to the bit: in one C call, or in two C passes around torch's
 * own mean.
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
 * order decides its last bit, and torch's order depends on its vector width. Where that order is not found (below),
 * the mean stays torch's own, called by kvpaging/kernels/cpu/__init__.py between the two passes here on the squares
 * the first one writes (a float32 tensor of the shape `h.pow(2)` has, so the same code sums it). `rsqrt` is torch's
 * 1 / sqrt.
 *
 * The mean can also be computed here, in torch's order (kvpaging_rms_norm_rows): torch sums a contiguous row of
 * float32 in vector lanes (`lanes` wide: 8 with torch 2.13 on an AVX-512 Xeon; 16 and 4 are tried too), four vectors
 * side by side, and adds those partial sums into each other in a cascade of four levels (every 16 groups of four
 * vectors, then every 256, ...), so that only sums of like size meet; then the four partials lane by lane, then,
 * after the scalar tail, the lanes one by one; then it divides by the row's length. SUM_SQUARES below retraces
 * that order step by step. kvpaging/kernels/cpu/__init__.py uses it only after comparing it with torch's own mean
 * on probe rows of many lengths at load; where they differ in any bit, the two passes above run around torch's
 * mean instead. One call then does a whole RMSNorm: no torch operation between, which on a CPU whose caches a
 * decode step's weights have just swept is most of a small norm's time.
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

#define ILP 4    /* vectors summed side by side */
#define LEVELS 4 /* levels of the cascade */

static int64_t ceil_log2(int64_t x)
{
    if (x <= 2)
        return 1;
    int64_t bits = 0;
    for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1)
        bits++;
    return bits;
}

static inline float widen_f32(const float *row, int64_t i) { return row[i]; }
static inline float widen_bf16(const uint16_t *row, int64_t i) { return bf16_to_f32(row[i]); }

/* NAME(row, n): the float32 sum of the squares of row[0..n), added in the order torch's sum adds a contiguous row of
 * float32 in LANES-wide vectors (see the top of the file). One function per element type and width, so that the
 * compiler keeps each vector's lanes in registers. */
#define SUM_SQUARES(NAME, T, WIDEN, LANES)                                                                          \
    static float NAME(const T *row, int64_t n)                                                                     \
    {                                                                                                              \
        float acc[LEVELS][ILP][LANES] = {{{0.0f}}};                                                                \
        const int64_t vectors = n / LANES, groups = vectors / ILP;                                                 \
        int64_t power = ceil_log2(groups) / LEVELS;                                                                \
        power = power > 4 ? power : 4;                                                                             \
        const int64_t step = (int64_t)1 << power;                                                                  \
        int64_t g = 0;                                                                                             \
        while (g + step <= groups) { /* a chunk of `step` groups into level 0, then up the cascade */              \
            for (int64_t j = 0; j < step; j++, g++)                                                                \
                for (int k = 0; k < ILP; k++)                                                                      \
                    for (int l = 0; l < LANES; l++) {                                                              \
                        const float h = WIDEN(row, (g * ILP + k) * LANES + l);                                     \
                        acc[0][k][l] += h * h;                                                                     \
                    }                                                                                              \
            for (int level = 1; level < LEVELS; level++) {                                                         \
                for (int k = 0; k < ILP; k++)                                                                      \
                    for (int l = 0; l < LANES; l++) {                                                              \
                        acc[level][k][l] += acc[level - 1][k][l];                                                  \
                        acc[level - 1][k][l] = 0.0f;                                                               \
                    }                                                                                              \
                if (g & ((step - 1) << (level * power)))                                                           \
                    break;                                                                                         \
            }                                                                                                      \
        }                                                                                                          \
        for (; g < groups; g++) /* the groups after the last whole chunk */                                        \
            for (int k = 0; k < ILP; k++)                                                                          \
                for (int l = 0; l < LANES; l++) {                                                                  \
                    const float h = WIDEN(row, (g * ILP + k) * LANES + l);                                         \
                    acc[0][k][l] += h * h;                                                                         \
                }                                                                                                  \
        for (int level = 1; level < LEVELS; level++)                                                               \
            for (int k = 0; k < ILP; k++)                                                                          \
                for (int l = 0; l < LANES; l++)                                                                    \
                    acc[0][k][l] += acc[level][k][l];                                                              \
        for (int64_t v = groups * ILP; v < vectors; v++) /* whole vectors left over: into the first partial */      \
            for (int l = 0; l < LANES; l++) {                                                                      \
                const float h = WIDEN(row, v * LANES + l);                                                         \
                acc[0][0][l] += h * h;                                                                             \
            }                                                                                                      \
        for (int k = 1; k < ILP; k++)                                                                              \
            for (int l = 0; l < LANES; l++)                                                                        \
                acc[0][0][l] += acc[0][k][l];                                                                      \
        float total = 0.0f;                                                                                        \
        for (int64_t i = vectors * LANES; i < n; i++) { /* the scalar tail first, then the lanes in order */       \
            const float h = WIDEN(row, i);                                                                         \
            total += h * h;                                                                                        \
        }                                                                                                          \
        for (int l = 0; l < LANES; l++)                                                                            \
            total += acc[0][0][l];                                                                                 \
        return total;                                                                                              \
    }

SUM_SQUARES(sum_squares_f32_16, float, widen_f32, 16)
SUM_SQUARES(sum_squares_f32_8, float, widen_f32, 8)
SUM_SQUARES(sum_squares_f32_4, float, widen_f32, 4)
SUM_SQUARES(sum_squares_bf16_16, uint16_t, widen_bf16, 16)
SUM_SQUARES(sum_squares_bf16_8, uint16_t, widen_bf16, 8)
SUM_SQUARES(sum_squares_bf16_4, uint16_t, widen_bf16, 4)

static float sum_squares(const void *row, int64_t bf16, int64_t n, int64_t lanes)
{
    if (bf16)
        return lanes == 16 ? sum_squares_bf16_16(row, n) : lanes == 8 ? sum_squares_bf16_8(row, n)
                                                                      : sum_squares_bf16_4(row, n);
    return lanes == 16 ? sum_squares_f32_16(row, n) : lanes == 8 ? sum_squares_f32_8(row, n) : sum_squares_f32_4(row, n);
}

static void scale_row(const void *x, float var, const void *weight, void *out, int64_t bf16, int64_t dim, float eps)
{
    const float inv = 1.0f / sqrtf(var + eps);
    if (bf16) {
        const uint16_t *xr = x, *w = weight;
        uint16_t *o = out;
        for (int64_t d = 0; d < dim; d++)
            o[d] = f32_to_bf16(bf16_to_f32(w[d]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[d]) * inv)));
    } else {
        const float *xr = x, *w = weight;
        float *o = out;
        for (int64_t d = 0; d < dim; d++)
            o[d] = w[d] * (xr[d] * inv);
    }
}

/* A whole RMSNorm of `rows` rows of `dim` in one call, the mean in torch's order for `lanes`-wide vectors (16, 8 or
 * 4; dim >= lanes). With `residual` (not NULL), each row is first the sum residual + x, rounded to x's dtype and
 * written to `sum`, and that sum is normalized: a decoder layer's residual connection and the norm after it. */
void kvpaging_rms_norm_rows(const void *x, const void *residual, void *sum, const void *weight, void *out, int64_t bf16,
                            int64_t rows, int64_t dim, float eps, int64_t lanes, int64_t threads)
{
    const int64_t size = bf16 ? 2 : 4;
#pragma omp parallel for num_threads((int)threads) schedule(static) if (threads > 1 && rows * dim >= MANY)
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)x + r * dim * size;
        if (residual != NULL) {
            const char *res = (const char *)residual + r * dim * size;
            char *s = (char *)sum + r * dim * size;
            if (bf16)
                for (int64_t d = 0; d < dim; d++)
                    ((uint16_t *)s)[d] = f32_to_bf16(bf16_to_f32(((const uint16_t *)res)[d])
                                                     + bf16_to_f32(((const uint16_t *)row)[d]));
            else
                for (int64_t d = 0; d < dim; d++)
                    ((float *)s)[d] = ((const float *)res)[d] + ((const float *)row)[d];
            row = s;
        }
        const float var = sum_squares(row, bf16, dim, lanes) / (float)dim;
        scale_row(row, var, weight, (char *)out + r * dim * size, bf16, dim, eps);
    }
}
