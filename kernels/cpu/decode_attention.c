/* Paged decode attention for the CPU: one query token per sequence, read straight from the blocks.
 *
 * The torch backend gathers every sequence's blocks into a padded [batch, max_len] copy of the
 * keys and values, then runs SDPA over that copy: the cache is read, written and read again,
 * and the padding is read too. This kernel walks each sequence's block table and reads each
 * cached key and value once, in place, as the Triton kernel does on a GPU. The maths is the
 * reference's (kernels/reference.py: paged_decode_attention):
 *
 *     score[g][t] = scale * dot(query[g], key[t])        for the G query heads of one KV head
 *     p[g][t]     = softmax over t < seq_len of score[g][t]
 *     out[g]      = sum over t of p[g][t] * value[t]
 *
 * Layouts (the query, the caches and the output all float32 or all bfloat16, as the engine keeps them on the CPU):
 *     query   [batch, num_heads, head_dim], any strides for batch and head, head_dim contiguous
 *     caches  [num_blocks, block_size, num_kv_heads, head_dim], contiguous
 *     tables  [batch, table_width] int32, rows table_stride apart;  seq_lens [batch] int32
 *     out     [batch, num_heads, head_dim], contiguous
 *     scores  scratch of threads * scores_stride floats, scores_stride >= num_heads * max(seq_lens)
 *     block   scratch of threads * block_size * num_kv_heads * head_dim floats (bfloat16 caches only)
 *
 * A bfloat16 cache holds half the bytes of a float32 one, and reading the cache is most of the
 * time this kernel takes. Each block is widened to float32 in the `block` scratch as it is reached
 * (a bfloat16 number is the top half of a float32 one: widening is a 16-bit shift), and the loops
 * below run on it as on a float32 block: all arithmetic is float32, as in the reference. A bfloat16
 * query is widened the same way, one sequence's rows at a time, and each output row is computed in
 * float32 and rounded to bfloat16 once at the end (to nearest, ties to even, as torch rounds): the
 * numbers a float32 query, float32 caches and a float32 output rounded afterwards would give.
 * A sequence of length 0 (padding) gets zeros, as in the reference.
 *
 * Threads: with `threads` > 1 (the caller passes torch's thread count) the sequences are shared out
 * among that many OpenMP threads, a whole sequence to one thread, so each output is computed by the
 * same loops in the same order as on one thread: the same numbers to the bit. Each thread has its own
 * slice of the scratch (`scores` and `block` hold `threads` slices). Built with -fopenmp, the library
 * uses the OpenMP runtime torch already loaded (libgomp.so.1), so its threads are torch's own, often
 * still spinning from the last matrix product; built without, the pragma is ignored and one thread runs.
 *
 * Returns 0, or 1 when a sequence is longer than its table holds, or 2 when a table entry in use
 * is not a block of the cache; error[0] is then the sequence and error[1] the bad value. Every
 * sequence is checked before any is computed, so on an error `out` is untouched.
 *
 * Built and loaded by kernels/cpu/__init__.py (compiled with the flags written there); the
 * attention backend that calls it is kernels/cpu_backend.py.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "bf16.h"

/* Ask for part `part` of `parts` of the first `bytes` of a block that comes next (its 64-byte lines; NULL: none):
 * the cache is far bigger than the CPU's caches, so every block comes from memory. A block's lines are asked for a
 * part at a time, spread over the work on the block before it: asked for all at once, they would stall that work (a
 * core tracks only so many lines on their way), and memory would sit idle while it runs. */
static inline void prefetch_part(const char *block, int64_t bytes, int64_t part, int64_t parts)
{
    if (block == NULL)
        return;
    for (int64_t at = part * bytes / parts / 64 * 64; at < (part + 1) * bytes / parts; at += 64)
        __builtin_prefetch(block + at, 0, 3);
}

/* How many of a sequence's len tokens block j holds. */
static inline int64_t tokens_in(int64_t len, int64_t j, int64_t block_size)
{
    return len - j * block_size < block_size ? len - j * block_size : block_size;
}

/* Block j of a sequence in a cache, as float32: in place in a float32 cache; from a bfloat16 one, its first
 * `elems` values widened into `scratch`. */
static inline const float *block_of(const void *cache, int bf16, const int32_t *table, int64_t j,
                                    int64_t block_stride, int64_t elems, float *scratch)
{
    if (!bf16)
        return (const float *)cache + (int64_t)table[j] * block_stride;
    const uint16_t *src = (const uint16_t *)cache + (int64_t)table[j] * block_stride;
    for (int64_t i = 0; i < elems; i++) {
        const uint32_t bits = (uint32_t)src[i] << 16;
        memcpy(scratch + i, &bits, sizeof(float));
    }
    return scratch;
}

/* The attention of sequence b, whose table and length were checked, into o: one thread's whole share of work.
 * q: its query rows, float32, q_head_stride apart. The blocks are read in the order key blocks, value blocks, and
 * each asks for the next on its way: after the last key block the first value block, after the last value block
 * the first key block of `next` (the sequence this thread computes next; NULL: none known). */
static inline __attribute__((always_inline)) void decode_one(
    const float *q, int64_t q_head_stride,
    const void *k_cache, const void *v_cache, int bf16, const int32_t *block_tables, int64_t table_stride,
    const int32_t *seq_lens, float *o, float *scores, float *block, int64_t b, const int32_t *next,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;  /* one token's keys, all KV heads */
    const int64_t block_stride = block_size * token_stride;
    const int64_t len = seq_lens[b];
    const int32_t *table = block_tables + b * table_stride;
    const int64_t num_used = (len + block_size - 1) / block_size;
    const int64_t token_bytes = token_stride * (bf16 ? 2 : 4), block_bytes = block_size * token_bytes;
    memset(o, 0, sizeof(float) * num_heads * head_dim);
    if (len <= 0)
        return;
    float row_max[num_heads], inv_sum[num_heads];
    for (int64_t h = 0; h < num_heads; h++)
        row_max[h] = -FLT_MAX;
    /* pass 1: every head's scores (scores[h][t]), block by block: a block is read from memory once, for all heads */
    for (int64_t j = 0; j < num_used; j++) {
        const int64_t start = j * block_size, n = tokens_in(len, j, block_size);
        const float *k = block_of(k_cache, bf16, table, j, block_stride, n * token_stride, block);
        const int64_t after = j + 1 < num_used ? j + 1 : 0;  /* the next key block, or the first value block */
        const char *ahead = (const char *)(j + 1 < num_used ? k_cache : v_cache) + table[after] * block_bytes;
        const int64_t ahead_bytes = tokens_in(len, after, block_size) * token_bytes;
        for (int64_t h = 0; h < num_heads; h++) {  /* one head at a time: its query stays in registers */
            prefetch_part(ahead, ahead_bytes, h, num_heads);
            const float *qh = q + h * q_head_stride, *kh = k + (h / group) * head_dim;
            float *s = scores + h * len + start, m = row_max[h];
            for (int64_t i = 0; i < n; i++, kh += token_stride) {
                float dot = 0.0f;
                for (int64_t d = 0; d < head_dim; d++)
                    dot += qh[d] * kh[d];
                s[i] = dot * scale;
                m = s[i] > m ? s[i] : m;
            }
            row_max[h] = m;
        }
    }
    /* softmax weights, not yet divided by their sum */
    for (int64_t h = 0; h < num_heads; h++) {
        float *s = scores + h * len, sum = 0.0f;
        const float m = row_max[h];
        for (int64_t t = 0; t < len; t++) {  /* vectorized: 16 expf at a time (glibc's vector maths) */
            const float e = expf(s[t] - m);
            s[t] = e;
            sum += e;
        }
        inv_sum[h] = 1.0f / sum;
    }
    /* pass 2: the weighted sum of the values */
    for (int64_t j = 0; j < num_used; j++) {
        const int64_t start = j * block_size, n = tokens_in(len, j, block_size);
        const float *v = block_of(v_cache, bf16, table, j, block_stride, n * token_stride, block);
        const char *ahead = j + 1 < num_used ? (const char *)v_cache + table[j + 1] * block_bytes  /* next values */
                            : next != NULL ? (const char *)k_cache + next[0] * block_bytes : NULL;  /* next keys */
        const int64_t ahead_bytes = j + 1 < num_used ? tokens_in(len, j + 1, block_size) * token_bytes : block_bytes;
        for (int64_t h = 0; h < num_heads; h++) {  /* one head at a time: its sum stays in registers */
            prefetch_part(ahead, ahead_bytes, h, num_heads);
            const float *vh = v + (h / group) * head_dim, *p = scores + h * len + start;
            float *oh = o + h * head_dim, acc[head_dim];
            for (int64_t d = 0; d < head_dim; d++)
                acc[d] = oh[d];
            for (int64_t i = 0; i < n; i++, vh += token_stride)
                for (int64_t d = 0; d < head_dim; d++)
                    acc[d] += p[i] * vh[d];
            for (int64_t d = 0; d < head_dim; d++)
                oh[d] = acc[d];
        }
    }
    for (int64_t h = 0; h < num_heads; h++)
        for (int64_t d = 0; d < head_dim; d++)
            o[h * head_dim + d] *= inv_sum[h];
}

/* Every sequence's length against its table, and every table entry it uses against the cache. */
static int64_t check_tables(const int32_t *block_tables, int64_t table_stride, int64_t table_width,
                            const int32_t *seq_lens, int64_t num_blocks, int64_t batch, int64_t block_size,
                            int64_t *error)
{
    for (int64_t b = 0; b < batch; b++) {
        const int64_t len = seq_lens[b];
        const int32_t *table = block_tables + b * table_stride;
        const int64_t num_used = (len + block_size - 1) / block_size;
        if (len > table_width * block_size) {
            error[0] = b, error[1] = len;
            return 1;
        }
        for (int64_t j = 0; j < num_used; j++) {
            if (table[j] < 0 || table[j] >= num_blocks) {
                error[0] = b, error[1] = table[j];
                return 2;
            }
        }
    }
    return 0;
}

/* The entry points, one per cache dtype. Common head sizes get their own copy of the loops above,
 * with head_dim a constant the compiler can unroll and vectorize exactly; any other size runs the
 * general copy. The switch sits inside the threads' loop, so each copy is made inside the code the
 * threads run. */
#define DECODE(BF16, D) decode_one(q, q_stride, k_cache, v_cache, BF16, block_tables, table_stride, seq_lens, o,  \
    scores + thread * scores_stride, BF16 ? block + thread * block_size * num_kv_heads * D : block, b, next,   \
    num_heads, num_kv_heads, D, block_size, scale)
#ifdef _OPENMP
#define THREAD_NUM omp_get_thread_num()
#else
#define THREAD_NUM 0
#endif
#define ENTRY_POINT(NAME, BF16)                                                                               \
int64_t NAME(const void *query, int64_t q_batch_stride, int64_t q_head_stride,                                \
             const void *k_cache, const void *v_cache, int64_t num_blocks,                                   \
             const int32_t *block_tables, int64_t table_stride, int64_t table_width, const int32_t *seq_lens, \
             void *out, float *scores, int64_t scores_stride, float *block, int64_t *error,                  \
             int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,    \
             float scale, int64_t threads)                                                                    \
{                                                                                                             \
    const int64_t status = check_tables(block_tables, table_stride, table_width, seq_lens, num_blocks, batch,  \
                                        block_size, error);                                                   \
    if (status != 0)                                                                                          \
        return status;                                                                                        \
    _Pragma("omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)")                    \
    for (int64_t b = 0; b < batch; b++) {                                                                     \
        const int64_t thread = THREAD_NUM, row = num_heads * head_dim;                                        \
        /* the sequence this thread computes next, known when one thread computes them all in order */              \
        const int32_t *next = threads == 1 && b + 1 < batch && seq_lens[b + 1] > 0                              \
                              ? block_tables + (b + 1) * table_stride : NULL;                                   \
        float q_row[BF16 ? row : 1], o_row[BF16 ? row : 1];  /* bfloat16: the widened query, the float32 output */ \
        const float *q = BF16 ? q_row : (const float *)query + b * q_batch_stride;                            \
        float *o = BF16 ? o_row : (float *)out + b * row;                                                     \
        const int64_t q_stride = BF16 ? head_dim : q_head_stride;                                             \
        const uint16_t *q_bf16 = (const uint16_t *)query + b * q_batch_stride;                                \
        for (int64_t h = 0; BF16 && h < num_heads; h++)                                                       \
            for (int64_t d = 0; d < head_dim; d++)                                                            \
                q_row[h * head_dim + d] = bf16_to_f32(q_bf16[h * q_head_stride + d]);                         \
        switch (head_dim) {                                                                                   \
        case 32: DECODE(BF16, 32); break;                                                                     \
        case 64: DECODE(BF16, 64); break;                                                                     \
        case 128: DECODE(BF16, 128); break;                                                                   \
        default: DECODE(BF16, head_dim); break;                                                               \
        }                                                                                                     \
        if (BF16)                                                                                             \
            for (int64_t i = 0; i < row; i++)                                                                 \
                ((uint16_t *)out)[b * row + i] = f32_to_bf16(o_row[i]);                                       \
    }                                                                                                         \
    return 0;                                                                                                 \
}

ENTRY_POINT(kvpaging_decode_attention_f32, 0)
ENTRY_POINT(kvpaging_decode_attention_bf16, 1)

/* The step's new keys and values into their cache slots, before any layer attends: token i's row of `row_elems`
 * values (`elem_size` bytes each, contiguous; rows `key_stride` and `value_stride` values apart in key and value) to
 * slot slots[i] of k_cache and of v_cache (rows of the same size, slot after slot). Returns 0, or i + 1 for the
 * first token whose slot lies outside [0, num_slots): then nothing is written (the caller's general path handles
 * padding slots and names a bad one). */
int64_t kvpaging_store_kv(const void *key, int64_t key_stride, const void *value, int64_t value_stride,
                          void *k_cache, void *v_cache, const int64_t *slots, int64_t tokens, int64_t row_elems,
                          int64_t elem_size, int64_t num_slots)
{
    for (int64_t i = 0; i < tokens; i++)
        if (slots[i] < 0 || slots[i] >= num_slots)
            return i + 1;
    const size_t row = (size_t)(row_elems * elem_size);
    for (int64_t i = 0; i < tokens; i++) {
        memcpy((char *)k_cache + slots[i] * (int64_t)row, (const char *)key + i * key_stride * elem_size, row);
        memcpy((char *)v_cache + slots[i] * (int64_t)row, (const char *)value + i * value_stride * elem_size, row);
    }
    return 0;
}
