/* A bfloat16 linear layer for a few rows (a decode step of one or two sequences), for the CPU.
 *
 *     y[r][j] = sum over i of x[r][i] * w[j][i]  (+ bias[j]),   w is [n][k] as nn.Linear keeps it
 *
 * At one row a linear layer is a matrix-vector product: every weight is read once and used once, so its time is
 * the weight's bytes over memory bandwidth. oneDNN's bfloat16 kernels, built for matrix tiles, read the trained
 * model's weights in a decode step of one sequence at about half the bandwidth a core has. Here the rows of w are
 * shared out among the caller's threads (OpenMP), and each is read front to back once for every row of x (from
 * the cache after the first): output j of row r is the float32 dot product of x's row r with w's row j (16 lanes,
 * then the lanes), rounded to bfloat16 once, to nearest even, as F.linear rounds its output. Every row of x goes
 * through the same code, so a row's result does not depend on the rows beside it. The sums run in another order
 * than oneDNN's, so the result is not F.linear's to the bit: this is an opt-in path (cpu_fast_layers=True). Built
 * with the other CPU kernels by kernels/cpu/__init__.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define LANES 16

/* One output: the float32 dot product of xr with the weight row wj (k of them; main_k: k rounded down to LANES). */
static inline float dot(const float *xr, const uint16_t *wj, int64_t k, int64_t main_k)
{
    float acc[LANES] = {0.0f};
    for (int64_t i = 0; i < main_k; i += LANES)
        for (int l = 0; l < LANES; l++)
            acc[l] += xr[i + l] * bf16_to_f32(wj[i + l]);
    float sum = 0.0f;
    for (int l = 0; l < LANES; l++)
        sum += acc[l];
    for (int64_t i = main_k; i < k; i++)
        sum += xr[i] * bf16_to_f32(wj[i]);
    return sum;
}

/* Returns 0, or -1 when scratch memory is short (nothing written). */
int64_t kvpaging_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                             int64_t rows, int64_t n, int64_t k, int64_t threads)
{
    float *xf = malloc(sizeof(float) * (size_t)(rows * k));
    if (xf == NULL)
        return -1;
    for (int64_t i = 0; i < rows * k; i++)
        xf[i] = bf16_to_f32(x[i]);
    const int64_t main_k = k - k % LANES;
#ifdef _OPENMP
#pragma omp parallel for num_threads((int)threads) schedule(static) if (threads > 1)
#endif
    for (int64_t j = 0; j < n; j++) {
        const uint16_t *wj = w + j * k;
        for (int64_t r = 0; r < rows; r++) {
            float sum = dot(xf + r * k, wj, k, main_k);
            if (bias != NULL)
                sum += bf16_to_f32(bias[j]);
            y[r * n + j] = f32_to_bf16(sum);
        }
    }
    free(xf);
    return 0;
}
