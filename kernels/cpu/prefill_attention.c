/* Paged prefill attention for the CPU: a chunk of query tokens per sequence, causal, read from the blocks.
 *
 * The torch backend's prefill runs one SDPA call per sequence and layer, after gathering the sequence's blocks into
 * a copy and, for a chunk that does not start at position 0 (a prefix-cache hit, a later chunk), building its causal
 * mask: a few dozen tensor operations per sequence. A busy server's prefill step holds dozens of short prompts, each
 * behind a cached system prompt, so those calls, not the arithmetic, were most of its attention time. This kernel
 * does a whole layer in one call. The maths is the reference's (kernels/reference.py: paged_prefill_attention):
 * sequence i has the q_len = cu_seqlens_q[i + 1] - cu_seqlens_q[i] query tokens that are the LAST q_len of its
 * seq_lens[i] cached tokens, and its query at position p sees the keys at positions 0..p:
 *
 *     score[t] = scale * dot(query, key[t])      for t <= p, the keys of the query head's KV head
 *     out      = sum over t <= p of softmax(score)[t] * value[t]
 *
 * Layouts (the query, the caches and the output all float32 or all bfloat16, as the engine keeps them on the CPU):
 *     query   [tokens, num_heads, head_dim], any strides for tokens and heads, head_dim contiguous
 *     caches  [num_blocks, block_size, num_kv_heads, head_dim], contiguous
 *     tables  [batch, table_width] int32, rows table_stride apart;  seq_lens [batch], cu_seqlens_q [batch + 1] int32
 *     out     [tokens, num_heads, head_dim], contiguous
 *     scratch threads * scratch_stride floats, scratch_stride >= (2 * head_dim + ROWS) * round_up(max seq_len, TILE)
 *
 * The work is cut into items: one KV head of one sequence, for up to QTILE of its query tokens. An item widens the
 * keys its queries can see into float32 once, keys transposed (a key's elements TILE keys apart, so a score loop runs
 * over keys in vector lanes with no horizontal sums), values as rows; then its query rows (each token's query heads
 * of that KV head, ROWS at a time, so each key and value is read once for ROWS rows) get their scores, a softmax
 * over the keys up to their own position, and the weighted sum of the values, all in float32; a bfloat16 output is
 * rounded once at the end (to nearest, ties to even, as torch rounds). Not SDPA's order of sums: the same maths as
 * the reference, to float32 rounding, as the decode kernel is.
 *
 * `skip` (NULL: none) marks sequences this call leaves alone: their rows of `out` are not written (the caller attends
 * them its own way; they are checked all the same).
 *
 * Threads: the items are shared out among `threads` OpenMP threads (torch's), a whole item to one thread, so every
 * output is computed by the same loops in the same order however many threads run: the same numbers to the bit.
 *
 * Returns 0, or (every sequence checked before any is computed, so on an error `out` is untouched; error[0] is the
 * sequence, error[1] and error[2] the bad values): 1 when a sequence is longer than its table holds (its length),
 * 2 when a table entry in use is not a block of the cache (the entry), 3 when a sequence has more queries than
 * cached tokens (queries, length), 4 when cu_seqlens_q is not rising from 0 within the query's tokens (the two
 * neighbouring entries), -1 when there is no memory for the work list.
 *
 * Built and loaded by kernels/cpu/__init__.py; called by kernels/cpu_backend.py (paged_prefill_attention).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "bf16.h"

/* Sizes that keep the sums in vector registers: ROWS x TILE floats are 16 of them (of AVX-512's 32 registers,
 * AVX2's 16; SSE's and NEON's 16 or 32) */
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
#define ROWS 4            /* query rows computed together */
#define TILE (4 * LANES)  /* keys per pass of the score loop, and value elements per pass of the weighted sum */
#define QTILE 32 /* query tokens of one item at most: a long prompt is several items, for the threads to share */

/* Keys 0..n-1 of KV head g of the sequence of `table`, in float32: transposed into kt (key t's element d at
 * kt[d * ld + t]; keys n..ld-1 zero, so the score loop may read whole tiles) and as rows into v (v[t * D + d]). */
static inline __attribute__((always_inline)) void gather(
    const void *k_cache, const void *v_cache, int bf16, const int32_t *table, int64_t n, int64_t ld, int64_t g,
    int64_t D, int64_t num_kv_heads, int64_t block_size, float *kt, float *v)
{
    const int64_t token_stride = num_kv_heads * D;
    for (int64_t t = 0; t < n; t++) {
        const int64_t at = ((int64_t)table[t / block_size] * block_size + t % block_size) * token_stride + g * D;
        float *vt = v + t * D;
        if (bf16) {
            const uint16_t *ks = (const uint16_t *)k_cache + at, *vs = (const uint16_t *)v_cache + at;
            for (int64_t d = 0; d < D; d++) {
                kt[d * ld + t] = bf16_to_f32(ks[d]);
                vt[d] = bf16_to_f32(vs[d]);
            }
        } else {
            const float *ks = (const float *)k_cache + at;
            for (int64_t d = 0; d < D; d++)
                kt[d * ld + t] = ks[d];
            memcpy(vt, (const float *)v_cache + at, sizeof(float) * D);
        }
    }
    for (int64_t d = 0; d < D; d++)
        memset(kt + d * ld + n, 0, sizeof(float) * (ld - n));
}

/* A vector of LANES floats (GCC's and clang's vector extension: AVX-512 or AVX2 registers, as the target has), loaded
 * from and stored to floats at any alignment, and one float broadcast to all lanes. */
typedef float vec __attribute__((vector_size(4 * LANES)));
static inline vec load(const float *p)
{
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }
static inline vec splat(float x) { return (vec){0} + x; }

/* ROWS x W vectors of sums over the query elements: rows q[r] (D each) times keys t0.. of kt (W * LANES of them). */
#define SCORES(W)                                                                                                 \
    do {                                                                                                          \
        vec acc[ROWS][W];                                                                                         \
        for (int r = 0; r < ROWS; r++)                                                                            \
            for (int j = 0; j < W; j++)                                                                           \
                acc[r][j] = splat(0.0f);                                                                          \
        for (int64_t d = 0; d < D; d++) {                                                                         \
            vec k[W];                                                                                             \
            for (int j = 0; j < W; j++)                                                                           \
                k[j] = load(kt + d * ld + t0 + j * LANES);                                                        \
            for (int r = 0; r < ROWS; r++) {                                                                      \
                const vec x = splat(q[r * D + d]);                                                                \
                for (int j = 0; j < W; j++)                                                                       \
                    acc[r][j] += x * k[j];                                                                        \
            }                                                                                                     \
        }                                                                                                         \
        for (int r = 0; r < ROWS; r++)                                                                            \
            for (int j = 0; j < W; j++)                                                                           \
                store(s + r * ld + t0 + j * LANES, acc[r][j] * splat(scale));                                     \
    } while (0)

/* ROWS x W vectors of weighted sums: each row's weights s[r] times the values' elements d0.. (W * LANES of them). */
#define VALUES(W)                                                                                                 \
    do {                                                                                                          \
        vec acc[ROWS][W];                                                                                         \
        for (int r = 0; r < ROWS; r++)                                                                            \
            for (int j = 0; j < W; j++)                                                                           \
                acc[r][j] = splat(0.0f);                                                                          \
        for (int64_t t = 0; t < n; t++) {                                                                         \
            vec x[W];                                                                                             \
            for (int j = 0; j < W; j++)                                                                           \
                x[j] = load(v + t * D + d0 + j * LANES);                                                          \
            for (int r = 0; r < ROWS; r++) {                                                                      \
                const vec p = splat(s[r * ld + t]);                                                               \
                for (int j = 0; j < W; j++)                                                                       \
                    acc[r][j] += p * x[j];                                                                        \
            }                                                                                                     \
        }                                                                                                         \
        for (int r = 0; r < ROWS; r++)                                                                            \
            for (int j = 0; j < W; j++)                                                                           \
                store(o + r * D + d0 + j * LANES, acc[r][j]);                                                     \
    } while (0)

/* ROWS query rows q[r] (float32, D each), row r seeing keys 0..len[r]-1 (len[r] = 0: a row that is not there), into
 * o[r] (float32, D each, not yet divided: inv[r] is the softmax's 1 / sum). s: ROWS * ld floats of scratch. */
static inline __attribute__((always_inline)) void attend_rows(
    const float *q, const int64_t *len, const float *kt, const float *v, int64_t ld, float *s, float *o, float *inv,
    int64_t D, float scale)
{
    int64_t n = 0;
    for (int r = 0; r < ROWS; r++)
        n = len[r] > n ? len[r] : n;
    /* scores, a tile of keys at a time, then the keys after the last whole tile two vectors or one at a time (kt
     * holds zeros up to ld, a multiple of TILE: a vector may run past n) */
    int64_t t0 = 0;
    for (; t0 + TILE <= n; t0 += TILE)
        SCORES(4);
    for (; t0 + LANES < n; t0 += 2 * LANES)  /* (two vectors: twice the sums in flight) */
        SCORES(2);
    for (; t0 < n; t0 += LANES)
        SCORES(1);
    /* softmax weights, not yet divided by their sum; zero past a row's own keys, up to n */
    for (int r = 0; r < ROWS; r++) {
        float *sr = s + r * ld, m = -FLT_MAX, sum = 0.0f;
        for (int64_t t = 0; t < len[r]; t++)
            m = sr[t] > m ? sr[t] : m;
        for (int64_t t = 0; t < len[r]; t++) {  /* vectorized: 16 expf at a time (glibc's vector maths) */
            const float e = expf(sr[t] - m);
            sr[t] = e;
            sum += e;
        }
        for (int64_t t = len[r] > 0 ? len[r] : 0; t < n; t++)
            sr[t] = 0.0f;
        inv[r] = len[r] > 0 ? 1.0f / sum : 0.0f;
    }
    /* the weighted sums of the values: a tile of elements at a time, then a vector, then one by one */
    int64_t d0 = 0;
    for (; d0 + TILE <= D; d0 += TILE)
        VALUES(4);
    for (; d0 + LANES <= D; d0 += LANES)
        VALUES(1);
    for (; d0 < D; d0++)
        for (int r = 0; r < ROWS; r++) {
            float acc = 0.0f;
            for (int64_t t = 0; t < n; t++)
                acc += s[r * ld + t] * v[t * D + d0];
            o[r * D + d0] = acc;
        }
}

/* One item: KV head g of sequence b, its query tokens first..last-1 (counted in the chunk). */
static inline __attribute__((always_inline)) void prefill_item(
    const void *query, int64_t q_token_stride, int64_t q_head_stride, const void *k_cache, const void *v_cache,
    int bf16, const int32_t *table, int64_t seq_len, int64_t q_len, int64_t q_start, int64_t first, int64_t last,
    int64_t g, void *out, float *scratch, int64_t num_heads, int64_t num_kv_heads, int64_t D, int64_t block_size,
    float scale)
{
    const int64_t group = num_heads / num_kv_heads, context = seq_len - q_len;
    const int64_t n = context + last;  /* the keys the item's last query sees */
    const int64_t ld = (n + TILE - 1) / TILE * TILE;
    float *kt = scratch, *v = kt + D * ld, *s = v + D * ld;
    gather(k_cache, v_cache, bf16, table, n, ld, g, D, num_kv_heads, block_size, kt, v);
    const int64_t num_rows = (last - first) * group;
    for (int64_t r0 = 0; r0 < num_rows; r0 += ROWS) {
        float q[ROWS * D], o[ROWS * D], inv[ROWS];
        int64_t len[ROWS], token[ROWS], head[ROWS];
        for (int r = 0; r < ROWS; r++) {
            const int64_t row = r0 + r;
            token[r] = first + row / group;
            head[r] = g * group + row % group;
            len[r] = row < num_rows ? context + token[r] + 1 : 0;
            const int64_t at = (q_start + token[r]) * q_token_stride + head[r] * q_head_stride;
            for (int64_t d = 0; d < D; d++)
                q[r * D + d] = len[r] == 0 ? 0.0f
                               : bf16 ? bf16_to_f32(((const uint16_t *)query)[at + d]) : ((const float *)query)[at + d];
        }
        attend_rows(q, len, kt, v, ld, s, o, inv, D, scale);
        for (int r = 0; r < ROWS && r0 + r < num_rows; r++) {
            const int64_t at = ((q_start + token[r]) * num_heads + head[r]) * D;
            for (int64_t d = 0; d < D; d++) {
                const float x = o[r * D + d] * inv[r];
                if (bf16)
                    ((uint16_t *)out)[at + d] = f32_to_bf16(x);
                else
                    ((float *)out)[at + d] = x;
            }
        }
    }
}

/* Every sequence's queries, length and table against the cache (see the status codes above). */
static int64_t check_prefill(const int32_t *block_tables, int64_t table_stride, int64_t table_width,
                             const int32_t *seq_lens, const int32_t *cu, int64_t num_tokens, int64_t num_blocks,
                             int64_t batch, int64_t block_size, int64_t *error)
{
    if (cu[0] != 0) {
        error[0] = 0, error[1] = cu[0], error[2] = batch > 0 ? cu[1] : cu[0];
        return 4;
    }
    for (int64_t b = 0; b < batch; b++) {
        const int64_t len = seq_lens[b], q_len = (int64_t)cu[b + 1] - cu[b];
        const int32_t *table = block_tables + b * table_stride;
        error[0] = b;
        if (q_len < 0 || cu[b + 1] > num_tokens) {
            error[1] = cu[b], error[2] = cu[b + 1];
            return 4;
        }
        if (q_len > len) {
            error[1] = q_len, error[2] = len;
            return 3;
        }
        if (len > table_width * block_size) {
            error[1] = len;
            return 1;
        }
        for (int64_t j = 0; j < (len + block_size - 1) / block_size; j++) {
            if (table[j] < 0 || table[j] >= num_blocks) {
                error[1] = table[j];
                return 2;
            }
        }
    }
    return 0;
}

#ifdef _OPENMP
#define THREAD_NUM omp_get_thread_num()
#else
#define THREAD_NUM 0
#endif
/* Common head sizes get their own copy of the loops, head_dim a constant the compiler vectorizes exactly. */
#define ITEM(BF16, DIM) prefill_item(query, q_token_stride, q_head_stride, k_cache, v_cache, BF16,                 \
    block_tables + b * table_stride, seq_lens[b], q_len, cu[b], first, last, g, out,                                \
    scratch + THREAD_NUM * scratch_stride, num_heads, num_kv_heads, DIM, block_size, scale)
#define ENTRY_POINT(NAME, BF16)                                                                                     \
int64_t NAME(const void *query, int64_t q_token_stride, int64_t q_head_stride, const void *k_cache,                 \
             const void *v_cache, int64_t num_blocks, const int32_t *block_tables, int64_t table_stride,            \
             int64_t table_width, const int32_t *seq_lens, const int32_t *cu, const uint8_t *skip,                   \
             int64_t num_tokens, void *out,                                                                         \
             float *scratch, int64_t scratch_stride, int64_t *error, int64_t batch, int64_t num_heads,               \
             int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t threads)             \
{                                                                                                                   \
    const int64_t status = check_prefill(block_tables, table_stride, table_width, seq_lens, cu, num_tokens,          \
                                         num_blocks, batch, block_size, error);                                     \
    if (status != 0)                                                                                                \
        return status;                                                                                              \
    int64_t num_items = 0;                                                                                          \
    for (int64_t b = 0; b < batch; b++)                                                                             \
        num_items += skip != NULL && skip[b] ? 0 : (cu[b + 1] - cu[b] + QTILE - 1) / QTILE * num_kv_heads;          \
    int64_t *items = malloc(sizeof(int64_t) * 2 * (num_items ? num_items : 1));  /* (sequence, tile * kv + head) */ \
    if (items == NULL)                                                                                              \
        return -1;                                                                                                  \
    for (int64_t b = 0, k = 0; b < batch; b++)                                                                      \
        for (int64_t j = 0; !(skip != NULL && skip[b]) && j < (cu[b + 1] - cu[b] + QTILE - 1) / QTILE * num_kv_heads;\
             j++, k++)                                                                                              \
            items[2 * k] = b, items[2 * k + 1] = j;                                                                  \
    _Pragma("omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)")                          \
    for (int64_t k = 0; k < num_items; k++) {                                                                       \
        const int64_t b = items[2 * k], g = items[2 * k + 1] % num_kv_heads;                                        \
        const int64_t q_len = cu[b + 1] - cu[b], first = items[2 * k + 1] / num_kv_heads * QTILE;                   \
        const int64_t last = first + QTILE < q_len ? first + QTILE : q_len;                                         \
        switch (head_dim) {                                                                                         \
        case 64: ITEM(BF16, 64); break;                                                                             \
        case 128: ITEM(BF16, 128); break;                                                                           \
        default: ITEM(BF16, head_dim); break;                                                                       \
        }                                                                                                           \
    }                                                                                                               \
    free(items);                                                                                                    \
    return 0;                                                                                                       \
}

ENTRY_POINT(kvpaging_prefill_attention_f32, 0)
ENTRY_POINT(kvpaging_prefill_attention_bf16, 1)
