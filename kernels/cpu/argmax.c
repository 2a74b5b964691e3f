/* The greedy pick: the index of each row's largest logit, as torch.max(logits, dim=-1).indices gives it.
 *
 * torch's CPU max walks a row front to back and moves to an element when `!(value <= best)`: the first maximum
 * wins a tie, and the first NaN, where there is one, is the answer (it stops there). This finds the same index in
 * two passes over the row: the row's largest value and whether it holds a NaN, then the first element equal to that
 * value (or the first NaN). The first pass compares integers, so that the compiler can run it in vector lanes
 * without fast-math: a float's bits, with the magnitude bits of a negative one flipped, order as signed integers
 * the way the floats order (-0 just below +0). The second pass compares floats, so a zero maximum finds the first
 * zero of either sign, as torch's test does. bfloat16 logits are widened exactly, so their answer is the one the
 * float32 copy the sampler would otherwise make gives: the copy is not made.
 *
 * Compiled without -ffast-math: NaN and the sign of zero matter here. Rows are shared among `threads` OpenMP
 * threads when there are enough of them.
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* a float's bits as a signed integer that orders as the float does (NaNs aside) */
static inline int32_t order_key(uint32_t u)
{
    return (int32_t)(u ^ ((uint32_t)((int32_t)u >> 31) >> 1));
}

static inline float from_key(int32_t key)
{
    const uint32_t u = (uint32_t)key ^ ((uint32_t)(key >> 31) >> 1);
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t bits_f32(const float *row, int64_t i)
{
    uint32_t u;
    memcpy(&u, row + i, sizeof u);
    return u;
}

#define CHUNK 64 /* values tested together in the second pass */
#define IS_NAN_BITS(u) (((u) & 0x7fffffffu) > 0x7f800000u)

static int64_t argmax_f32(const float *row, int64_t cols)
{
    int32_t best = INT32_MIN;
    uint32_t nan = 0;
    for (int64_t i = 0; i < cols; i++) {
        const uint32_t u = bits_f32(row, i);
        const int32_t key = order_key(u);
        best = key > best ? key : best;
        nan |= IS_NAN_BITS(u);
    }
    const float m = from_key(best);
    int64_t i = 0;
    for (; i + CHUNK <= cols; i += CHUNK) { /* the chunk that holds it, tested in lanes */
        int hit = 0;
        for (int l = 0; l < CHUNK; l++)
            hit |= nan ? row[i + l] != row[i + l] : row[i + l] == m;
        if (hit)
            break;
    }
    for (; i < cols; i++)
        if (nan ? row[i] != row[i] : row[i] == m)
            return i;
    return 0; /* not reached */
}

static int64_t argmax_bf16(const uint16_t *row, int64_t cols)
{
    int32_t best = INT32_MIN;
    uint32_t nan = 0;
    for (int64_t i = 0; i < cols; i++) {
        const uint32_t u = (uint32_t)row[i] << 16;
        const int32_t key = order_key(u);
        best = key > best ? key : best;
        nan |= IS_NAN_BITS(u);
    }
    const float m = from_key(best);
    int64_t i = 0;
    for (; i + CHUNK <= cols; i += CHUNK) {
        int hit = 0;
        for (int l = 0; l < CHUNK; l++) {
            const float v = bf16_to_f32(row[i + l]);
            hit |= nan ? v != v : v == m;
        }
        if (hit)
            break;
    }
    for (; i < cols; i++) {
        const float v = bf16_to_f32(row[i]);
        if (nan ? v != v : v == m)
            return i;
    }
    return 0;
}

/* out[r] = the index of row r's largest value; x holds `rows` rows of `cols` values, `row_stride` apart */
void kvpaging_argmax_rows(const void *x, int64_t bf16, int64_t rows, int64_t cols, int64_t row_stride, int64_t *out,
                          int64_t threads)
{
#pragma omp parallel for num_threads((int)threads) schedule(static) if (threads > 1 && rows > 1 && rows * cols >= 65536)
    for (int64_t r = 0; r < rows; r++)
        out[r] = bf16 ? argmax_bf16((const uint16_t *)x + r * row_stride, cols)
                      : argmax_f32((const float *)x + r * row_stride, cols);
}
