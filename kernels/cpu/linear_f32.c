/* A float32 linear layer for a decode step's rows, with the bits of torch's own float32 F.linear (Intel MKL's sgemm).
 *
 *     y[r][j] = sum over i of x[r][i] * w[j][i],   w is [n][k] as nn.Linear keeps it (no bias)
 *
 * A decode step reads every weight once for a handful of rows, so its products take the weights' bytes over memory
 * bandwidth. MKL's sgemm reads the trained model's float32 weights in such a step at about a third of what one core
 * streams (benchmarks/decode_step.py --dtype float32). Here the weight is laid out once (kvpaging_f32_pack) as
 * blocks of 16 outputs, input by input: 16 floats, one 64-byte line, per input, so a product reads the weight front
 * to back, once, in order, and the 16 outputs of a block are one vector register's lanes.
 *
 * The order of the sums is MKL's as found on the machines this was written on (an AMX Xeon, torch 2.13's MKL, one
 * and two threads; benchmarks/RESULTS.md): for 16 rows and more, MKL sums each output's inputs in `kc`-long runs
 * (288 for 576 inputs, 384 for 1,536), each run a chain of fused multiply-adds from zero in input order, and adds
 * the runs' sums one after another. This kernel does exactly that, for any `kc` it is given. Which `kc` MKL uses,
 * and for which row counts and thread counts it sums this way at all, is not something to assume: the caller
 * (kernels/cpu/layers.py) compares this product with F.linear's, to the bit, before it uses it for a shape, a row
 * count and a thread count, and keeps F.linear wherever they differ.
 *
 * Compiled with -ffp-contract=fast (kernels/cpu/__init__.py): `acc + x * w` must be one fused multiply-add, as MKL's
 * is; the runs' sums are plain additions. Threads (OpenMP, torch's own) share out the blocks of outputs; each output
 * is computed by one thread with the same loops in the same order, however many run. Built with the other CPU
 * kernels.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 16 /* outputs a block: one vector of 16 floats */
#define NB 2     /* blocks computed together */
#define AHEAD 16 /* inputs: each block's weight is asked for this far ahead of its use */

typedef float v16 __attribute__((vector_size(4 * BLOCK)));

static inline v16 load16(const float *p)
{
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The weight [n][k] as blocks of BLOCK outputs: element (b, i, c) = w[BLOCK * b + c][i]; outputs past n (a last
 * block not full) are zero. */
void kvpaging_f32_pack(const float *w, float *packed, int64_t n, int64_t k)
{
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t i = 0; i < k; i++)
            for (int64_t c = 0; c < BLOCK; c++) {
                const int64_t j = b * BLOCK + c;
                packed[(b * k + i) * BLOCK + c] = j < n ? w[j * k + i] : 0.0f;
            }
}

/* Outputs of blocks b.. (NB of them, or fewer at the end: `nb`) for R rows of x from row r0 (x holds whole groups
 * of R rows), their first `rows` rows stored into y. Each run's sums are added to y's as they come. One copy for
 * each group size R, so that its NB x R sums stay in registers. */
#define BLOCKS_FOR_ROWS(R)                                                                                        \
static void blocks_for_##R##_rows(const float *x, const float *packed, float *y, int64_t r0, int64_t rows,       \
                                  int64_t n, int64_t k, int64_t kc, int64_t b, int64_t nb)                       \
{                                                                                                                 \
    const float *w[NB];                                                                                           \
    for (int j = 0; j < NB; j++)                                                                                  \
        w[j] = packed + (b + (j < nb ? j : 0)) * k * BLOCK;                                                       \
    for (int64_t start = 0; start < k; start += kc) {                                                             \
        const int64_t end = start + kc < k ? start + kc : k;                                                      \
        v16 acc[R][NB];                                                                                           \
        for (int r = 0; r < R; r++)                                                                               \
            for (int j = 0; j < NB; j++)                                                                          \
                acc[r][j] = (v16){0};                                                                             \
        for (int64_t i = start; i < end; i++) {                                                                   \
            v16 u[NB];                                                                                            \
            for (int j = 0; j < NB; j++) {                                                                        \
                __builtin_prefetch(w[j] + (i + AHEAD) * BLOCK, 0, 3);                                             \
                u[j] = load16(w[j] + i * BLOCK);                                                                  \
            }                                                                                                     \
            for (int r = 0; r < R; r++) {                                                                         \
                const float xr = x[(r0 + r) * k + i];                                                             \
                for (int j = 0; j < NB; j++)                                                                      \
                    acc[r][j] = acc[r][j] + xr * u[j];  /* one fused multiply-add each (-ffp-contract=fast) */    \
            }                                                                                                     \
        }                                                                                                         \
        for (int64_t r = 0; r < rows; r++)                                                                        \
            for (int64_t j = 0; j < nb; j++)                                                                      \
                for (int c = 0; c < BLOCK; c++) {                                                                 \
                    const int64_t out = (b + j) * BLOCK + c;                                                      \
                    if (out < n) {                                                                                \
                        float *at = y + (r0 + r) * n + out;                                                       \
                        *at = start ? *at + acc[r][j][c] : acc[r][j][c];                                          \
                    }                                                                                             \
                }                                                                                                 \
    }                                                                                                             \
}
BLOCKS_FOR_ROWS(8)
BLOCKS_FOR_ROWS(12)

/* y = x w^T for `rows` rows of x [rows][k], w packed by kvpaging_f32_pack, each output's inputs summed in runs of
 * kc. Returns 0, or -1 when scratch memory is short (nothing written). */
int64_t kvpaging_f32_linear(const float *x, const float *packed, float *y, int64_t rows, int64_t n, int64_t k,
                            int64_t kc, int64_t threads)
{
    /* rows in groups of 8 or of 12, whichever pads fewer (12 on a tie: fewer passes over each block's weights) */
    const int64_t by = (rows + 11) / 12 * 12 <= (rows + 7) / 8 * 8 ? 12 : 8;
    const int64_t groups = (rows + by - 1) / by, blocks = (n + BLOCK - 1) / BLOCK;
    float *padded = NULL;  /* x with its last group of rows filled up with zeros, where it is not whole */
    if (rows % by) {
        padded = calloc((size_t)(groups * by * k), sizeof(float));
        if (padded == NULL)
            return -1;
        memcpy(padded, x, sizeof(float) * (size_t)(rows * k));
    }
    const float *xp = padded != NULL ? padded : x;
#ifdef _OPENMP
#pragma omp parallel for num_threads((int)threads) schedule(static) if (threads > 1)
#endif
    for (int64_t b = 0; b < blocks; b += NB)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t r0 = g * by, left = rows - r0, nb = blocks - b < NB ? blocks - b : NB;
            if (by == 12)
                blocks_for_12_rows(xp, packed, y, r0, left < by ? left : by, n, k, kc, b, nb);
            else
                blocks_for_8_rows(xp, packed, y, r0, left < by ? left : by, n, k, kc, b, nb);
        }
    free(padded);
    return 0;
}
