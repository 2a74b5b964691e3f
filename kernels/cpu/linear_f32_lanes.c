/* A float32 linear layer for one to three rows, in the other order of sums MKL's sgemm uses for so few rows.
 *
 *     y[r][j] = sum over i of x[r][i] * w[j][i],   w is [n][k] as nn.Linear keeps it (no bias)
 *
 * linear_f32.c gives MKL's bits where MKL sums each output's inputs in runs of fused multiply-adds (four rows and
 * more on the AVX2-only AMD EPYC of 2026-12-07). With fewer rows MKL runs another kernel, whose order the probes of
 * benchmarks/f32_small_order.py mapped on that machine (a pair of inputs that cancel, +2^30 and -2^30, and a 1 that
 * survives only where it is added after the pair has met; benchmarks/RESULTS.md):
 *
 *   - each product x[r][i] * w[j][i] rounded on its own, then added (no fused multiply-add: this file is compiled
 *     with -ffp-contract=off);
 *   - the inputs from `head` on in four lanes, input i in lane (i - head) mod 4, each lane a chain of additions in
 *     input order; the first `head` inputs added one after another before lane 0's first: for two or three rows
 *     those before the first input at a 16-byte boundary of x's row (0 to 3), for a single row (MKL's
 *     matrix-vector product) those up to the first weight past the first at a 16-byte boundary (1 to 4: 4 for a
 *     weight row that starts at one, 2 for a row 8 bytes past one);
 *   - the lanes added as (lane 0 + lane 2) + (lane 1 + lane 3), then the inputs past the lanes' last group of four
 *     one after another.
 *
 * At two threads MKL also computes the rows past the last whole group of four this way (the others in runs), so
 * the caller may send a product's last rows here and its first ones to linear_f32.c. As there, nothing here is
 * assumed: kernels/cpu/layers.py uses this only for a shape, row count and thread count where it gave F.linear's
 * bits. It reads the weight as nn.Linear keeps it (no layout of its own: a one-row product costs no memory), each
 * output's four lanes one 16-byte vector, added across only at its end.
 */
#include <stdint.h>
#include <string.h>

#define MAX_ROWS 3
typedef float vec4 __attribute__((vector_size(16))); /* four lanes: inputs i..i+3 of one output and row */

static inline vec4 load4(const float *p)
{
    vec4 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The head of output j for the rows of x from r0: `head` where it is 0 or more; where it is -1 (one row: MKL's
 * matrix-vector product), the inputs before the first one past the first whose weight lies at a 16-byte boundary,
 * 1 to 4 (4 for a row of weights that starts at one, 2 for one that starts 8 bytes past one); where it is -2 (two or
 * three rows), those before the first one at a 16-byte boundary of x's row r0, 0 to 3. */
static inline int64_t head_of(const float *x, const float *w, int64_t r0, int64_t j, int64_t k, int64_t head)
{
    if (head == -1)
        return 4 - (int64_t)(((uintptr_t)(w + j * k) >> 2) & 3);
    if (head == -2)
        return (int64_t)((0 - ((uintptr_t)(x + r0 * k) >> 2)) & 3);
    return head;
}

/* O outputs from j0 (O x R chains of sums at once, so that the additions' latency is hidden), whose weights' rows
 * share a head, of R rows of x from row r0: y[r][j] for j in j0..j0+O-1. */
#define OUTPUTS_FOR_ROWS(O, R)                                                                                    \
static void outputs_##O##_rows_##R(const float *x, const float *w, float *y, int64_t r0, int64_t n, int64_t k,  \
                                   int64_t head, int64_t j0)                                                      \
{                                                                                                                 \
    head = head_of(x, w, r0, j0, k, head);                                                                        \
    if (head > k)                                                                                                 \
        head = k;                                                                                                 \
    const int64_t end = head + (k - head) / 4 * 4; /* the lanes' last input + 1; the rest added after them */    \
    vec4 acc[R][O];                                                                                               \
    float first[R][O]; /* the head's sum, in order, before lane 0's first input */                               \
    for (int r = 0; r < R; r++)                                                                                   \
        for (int o = 0; o < O; o++) {                                                                             \
            acc[r][o] = (vec4){0};                                                                                \
            float s = 0.0f;                                                                                       \
            for (int64_t i = 0; i < head; i++)                                                                    \
                s = s + x[(r0 + r) * k + i] * w[(j0 + o) * k + i];                                                \
            first[r][o] = s;                                                                                      \
        }                                                                                                         \
    int64_t i = head;                                                                                             \
    if (head && i < end) { /* lane 0's chain starts from the head's sum */                                       \
        for (int r = 0; r < R; r++)                                                                               \
            for (int o = 0; o < O; o++) {                                                                         \
                const vec4 p = load4(x + (r0 + r) * k + i) * load4(w + (j0 + o) * k + i);                         \
                acc[r][o] = p;                                                                                    \
                acc[r][o][0] = first[r][o] + p[0];                                                                \
            }                                                                                                     \
        i += 4;                                                                                                   \
    }                                                                                                             \
    for (; i < end; i += 4) {                                                                                     \
        vec4 v[R]; /* the rows' four inputs, loaded once for the O outputs */                                      \
        for (int r = 0; r < R; r++)                                                                               \
            v[r] = load4(x + (r0 + r) * k + i);                                                                   \
        for (int o = 0; o < O; o++) {                                                                             \
            const vec4 u = load4(w + (j0 + o) * k + i);                                                           \
            for (int r = 0; r < R; r++)                                                                           \
                acc[r][o] = acc[r][o] + v[r] * u;                                                                 \
        }                                                                                                         \
    }                                                                                                             \
    for (int r = 0; r < R; r++)                                                                                   \
        for (int o = 0; o < O; o++) {                                                                             \
            float sum = head == end ? first[r][o]                                                                 \
                                    : (acc[r][o][0] + acc[r][o][2]) + (acc[r][o][1] + acc[r][o][3]);              \
            for (int64_t t = end; t < k; t++) /* inputs past the lanes' last group of four, in order */           \
                sum = sum + x[(r0 + r) * k + t] * w[(j0 + o) * k + t];                                            \
            y[(r0 + r) * n + j0 + o] = sum;                                                                       \
        }                                                                                                         \
}
OUTPUTS_FOR_ROWS(8, 1)
OUTPUTS_FOR_ROWS(4, 2)
OUTPUTS_FOR_ROWS(4, 3)
OUTPUTS_FOR_ROWS(1, 1)
OUTPUTS_FOR_ROWS(1, 2)
OUTPUTS_FOR_ROWS(1, 3)

/* The same order on a weight packed by kvpaging_f32_pack (linear_f32.c: blocks of BLOCK outputs, input by input),
 * for the outputs of block b: rows `first` to `rows` - 1 (at most MAX_ROWS), their head fixed or, where `head` is -2,
 * from x's address (head_of). linear_f32.c calls it for a product's rows past its runs, block by block. */
#define BLOCK 16
#if defined(__AVX512F__)
#define VEC 16
#else
#define VEC 8
#endif
typedef float vec __attribute__((vector_size(4 * VEC)));

static inline vec load_vec(const float *p)
{
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

#define PART_FOR_ROWS(R)                                                                                          \
static void part_for_##R##_rows(const float *x, const float *w, float *y, int64_t r0, int64_t n, int64_t k,     \
                                int64_t head, int64_t out0)                                                       \
{                                                                                                                 \
    head = head_of(x, w, r0, 0, k, head);                                                                         \
    if (head > k)                                                                                                 \
        head = k;                                                                                                 \
    const int64_t end = head + (k - head) / 4 * 4;                                                                \
    vec lane[R][4], first[R];                                                                                     \
    for (int r = 0; r < R; r++) {                                                                                 \
        first[r] = (vec){0};                                                                                      \
        for (int l = 0; l < 4; l++)                                                                               \
            lane[r][l] = (vec){0};                                                                                \
        for (int64_t i = 0; i < head; i++)                                                                        \
            first[r] = first[r] + x[(r0 + r) * k + i] * load_vec(w + i * BLOCK);                                  \
    }                                                                                                             \
    int64_t i = head;                                                                                             \
    if (head && i < end) {                                                                                        \
        for (int r = 0; r < R; r++) {                                                                             \
            lane[r][0] = first[r] + x[(r0 + r) * k + i] * load_vec(w + i * BLOCK);                                \
            for (int l = 1; l < 4; l++)                                                                           \
                lane[r][l] = x[(r0 + r) * k + i + l] * load_vec(w + (i + l) * BLOCK);                             \
        }                                                                                                         \
        i += 4;                                                                                                   \
    }                                                                                                             \
    for (; i < end; i += 4)                                                                                       \
        for (int l = 0; l < 4; l++) {                                                                             \
            const vec u = load_vec(w + (i + l) * BLOCK);                                                          \
            for (int r = 0; r < R; r++)                                                                           \
                lane[r][l] = lane[r][l] + x[(r0 + r) * k + i + l] * u;                                            \
        }                                                                                                         \
    for (int r = 0; r < R; r++) {                                                                                 \
        vec sum = head == end ? first[r] : (lane[r][0] + lane[r][2]) + (lane[r][1] + lane[r][3]);                 \
        for (int64_t t = end; t < k; t++)                                                                         \
            sum = sum + x[(r0 + r) * k + t] * load_vec(w + t * BLOCK);                                            \
        for (int c = 0; c < VEC && out0 + c < n; c++)                                                             \
            y[(r0 + r) * n + out0 + c] = sum[c];                                                                  \
    }                                                                                                             \
}
PART_FOR_ROWS(1)
PART_FOR_ROWS(2)
PART_FOR_ROWS(3)

void kvpaging_f32_lanes_block(const float *x, const float *packed, float *y, int64_t first, int64_t rows, int64_t n,
                              int64_t k, int64_t head, int64_t b)
{
    const float *w = packed + b * k * BLOCK;
    for (int64_t h = 0; h < BLOCK / VEC; h++) {
        if (rows - first == 1)
            part_for_1_rows(x, w + h * VEC, y, first, n, k, head, b * BLOCK + h * VEC);
        else if (rows - first == 2)
            part_for_2_rows(x, w + h * VEC, y, first, n, k, head, b * BLOCK + h * VEC);
        else if (rows - first == 3)
            part_for_3_rows(x, w + h * VEC, y, first, n, k, head, b * BLOCK + h * VEC);
    }
}

/* Rows `first` to `rows` - 1 of y = x w^T (x [rows][k], w [n][k] as nn.Linear keeps it), at most MAX_ROWS of them,
 * in the lanes order above (`head` -1 or -2: from the addresses, head_of); the rows before `first` are left alone.
 * Returns 0, or -1 for more than MAX_ROWS rows. */
int64_t kvpaging_f32_linear_lanes(const float *x, const float *w, float *y, int64_t first, int64_t rows, int64_t n,
                                  int64_t k, int64_t head, int64_t threads)
{
    /* outputs in groups where their weight rows all start at one alignment (k a multiple of 4), else one by one (the
     * rows of x share one head only where k is a multiple of 4: the caller's to see to) */
    const int64_t count = rows - first, group = k % 4 ? 1 : count == 1 ? 8 : 4, groups = group > 1 ? n / group : 0;
    if (count < 1 || count > MAX_ROWS)
        return -1;
#ifdef _OPENMP
#pragma omp parallel for num_threads((int)threads) schedule(static) if (threads > 1)
#endif
    for (int64_t g = 0; g <= groups; g++) {
        if (g < groups) {
            if (count == 1)
                outputs_8_rows_1(x, w, y, first, n, k, head, g * group);
            else if (count == 2)
                outputs_4_rows_2(x, w, y, first, n, k, head, g * group);
            else
                outputs_4_rows_3(x, w, y, first, n, k, head, g * group);
        } else /* the outputs past the last whole group, one at a time */
            for (int64_t j = groups * group; j < n; j++) {
                if (count == 1)
                    outputs_1_rows_1(x, w, y, first, n, k, head, j);
                else if (count == 2)
                    outputs_1_rows_2(x, w, y, first, n, k, head, j);
                else
                    outputs_1_rows_3(x, w, y, first, n, k, head, j);
            }
    }
    return 0;
}
