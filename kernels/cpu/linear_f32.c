/* A float32 linear layer for a decode step's rows, with the bits of torch's own float32 F.linear (Intel MKL's sgemm).
 *
 *     y[r][j] = sum over i of x[r][i] * w[j][i],   w is [n][k] as nn.Linear keeps it (no bias)
 *
 * A decode step reads every weight once for a handful of rows, so its products take the weights' bytes over memory
 * bandwidth. MKL's sgemm reads the trained model's float32 weights in such a step at about a third of what one core
 * streams (benchmarks/decode_step.py --dtype float32). Here the weight is laid out once (kvpaging_f32_pack) as
 * blocks of 16 outputs, input by input: 16 floats, one 64-byte line, per input, so a product reads the weight front
 * to back, once, in order, and the 16 outputs of a block are one AVX-512 register's lanes (two AVX2 registers').
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
 * is; the runs' sums are plain additions. A product's last rows may be summed in MKL's other order instead, four
 * lanes of rounded products (linear_f32_lanes.c, compiled without fused multiply-adds), block by block beside them.
 * Threads (OpenMP, torch's own) share out the blocks of outputs; each output is computed by one thread with the same
 * loops in the same order, however many run. Built with the other CPU kernels.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 16 /* outputs a block: one vector of 16 floats (one AVX-512 register, two AVX2 ones) */
#define AHEAD 16 /* inputs: each block's weight is asked for this far ahead of its use */
/* Blocks computed together, and the two sizes of a group of rows: NB x ROWS_B sums must stay in the vector
 * registers. AVX-512 has 32 registers of 16 floats: 2 blocks x 12 rows = 24 of them. AVX2 has 16 registers of 8
 * floats, a block taking two: 1 block x 6 rows = 12 of them (the AVX-512 tiling there spilled its sums on every
 * multiply-add and ran about twenty times slower than MKL, 2026-12-07, an AVX2-only AMD EPYC). The order of each
 * output's sums is the same either way. */
/* VEC: the floats of one vector register; a block is HALVES of them (one with AVX-512; two with AVX2, whose compiler
 * keeps a 64-byte vector type in memory, not in registers). */
#if defined(__AVX512F__)
#define NB 2
#define ROWS_A 8
#define ROWS_B 12
#define VEC 16
#else
#define NB 1
#define ROWS_A 4
#define ROWS_B 6
#define VEC 8
#endif
#define HALVES (BLOCK / VEC)
typedef float vec __attribute__((vector_size(4 * VEC)));

static inline vec load_vec(const float *p)
{
    vec v;
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
        vec acc[R][NB * HALVES];                                                                                  \
        for (int r = 0; r < R; r++)                                                                               \
            for (int j = 0; j < NB * HALVES; j++)                                                                 \
                acc[r][j] = (vec){0};                                                                             \
        for (int64_t i = start; i < end; i++) {                                                                   \
            vec u[NB * HALVES];                                                                                   \
            for (int j = 0; j < NB; j++) {                                                                        \
                __builtin_prefetch(w[j] + (i + AHEAD) * BLOCK, 0, 3);                                             \
                for (int h = 0; h < HALVES; h++)                                                                  \
                    u[j * HALVES + h] = load_vec(w[j] + i * BLOCK + h * VEC);                                     \
            }                                                                                                     \
            for (int r = 0; r < R; r++) {                                                                         \
                const float xr = x[(r0 + r) * k + i];                                                             \
                for (int j = 0; j < NB * HALVES; j++)                                                             \
                    acc[r][j] = acc[r][j] + xr * u[j];  /* one fused multiply-add each (-ffp-contract=fast) */    \
            }                                                                                                     \
        }                                                                                                         \
        for (int64_t r = 0; r < rows; r++)                                                                        \
            for (int64_t j = 0; j < nb * HALVES; j++)                                                             \
                for (int c = 0; c < VEC; c++) {                                                                   \
                    const int64_t out = (b + j / HALVES) * BLOCK + j % HALVES * VEC + c;                          \
                    if (out < n) {                                                                                \
                        float *at = y + (r0 + r) * n + out;                                                       \
                        *at = start ? *at + acc[r][j][c] : acc[r][j][c];                                          \
                    }                                                                                             \
                }                                                                                                 \
    }                                                                                                             \
}
BLOCKS_FOR_ROWS(ROWS_A) /* blocks_for_ROWS_A_rows (the name is pasted before ROWS_A expands) */
BLOCKS_FOR_ROWS(ROWS_B)

/* linear_f32_lanes.c: the last rows of a block's outputs in MKL's lanes, on the packed weight */
void kvpaging_f32_lanes_block(const float *x, const float *packed, float *y, int64_t first, int64_t rows, int64_t n,
                              int64_t k, int64_t head, int64_t b);

/* y = x w^T for `all` rows of x [all][k], w packed by kvpaging_f32_pack: the first all - lanes rows with each
 * output's inputs summed in runs of kc, the last `lanes` (0 to 3) in MKL's lanes after `head` inputs
 * (linear_f32_lanes.c), block by block, so each block's weights come from memory once for both. Returns 0, -1
 * when scratch memory is short, or -2 for `lanes` outside 0 to 3 (or above `all`) or a head of -1, which needs the
 * weight as nn.Linear keeps it (nothing written either way). */
int64_t kvpaging_f32_linear(const float *x, const float *packed, float *y, int64_t all, int64_t n, int64_t k,
                            int64_t kc, int64_t lanes, int64_t head, int64_t threads)
{
    if (lanes < 0 || lanes > 3 || lanes > all || head == -1)
        return -2;
    const int64_t rows = all - lanes; /* in runs */
    /* rows in groups of ROWS_A or of ROWS_B, whichever pads fewer (ROWS_B on a tie: fewer passes over each block's
     * weights) */
    const int64_t by = (rows + ROWS_B - 1) / ROWS_B * ROWS_B <= (rows + ROWS_A - 1) / ROWS_A * ROWS_A ? ROWS_B : ROWS_A;
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
    for (int64_t b = 0; b < blocks; b += NB) {
        const int64_t nb = blocks - b < NB ? blocks - b : NB;
        for (int64_t g = 0; g < groups; g++) {
            const int64_t r0 = g * by, left = rows - r0;
            if (by == ROWS_B)
                blocks_for_ROWS_B_rows(xp, packed, y, r0, left < by ? left : by, n, k, kc, b, nb);
            else
                blocks_for_ROWS_A_rows(xp, packed, y, r0, left < by ? left : by, n, k, kc, b, nb);
        }
        for (int64_t j = 0; lanes && j < nb; j++) /* while the blocks' weights are still in the caches */
            kvpaging_f32_lanes_block(x, packed, y, rows, all, n, k, head, b + j);
    }
    free(padded);
    return 0;
}
