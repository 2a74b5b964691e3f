/* A bfloat16 linear layer for a decode step's rows (at most 32), on the matrix units of an Intel CPU (AMX).
 *
 *     y[r][j] = sum over i of x[r][i] * w[j][i],   w is [n][k] as nn.Linear keeps it (no bias)
 *
 * A decode step's linear layers read every weight once for a handful of rows: their time is the weights' bytes over
 * memory bandwidth, not arithmetic. oneDNN's packed product reads the trained model's weights at one core at about
 * 60-70% of what the core can stream. Here the weight is laid out once (kvpaging_amx_pack) as the tiles the unit
 * reads, 16 outputs by 32 inputs, each tile 1 KB, a block of 16 outputs' tiles one after another: a product walks
 * the weight front to back, in order, once, while the next block is fetched ahead. The rows of x (a last row tile of
 * fewer than 16 filled up with zeros) are the tiles' other operand, from the cache.
 *
 * Each output is a float32 sum, 32 inputs at a time by the unit's bfloat16 dot product (TDPBF16PS), from the first
 * 32 inputs to the last, rounded to bfloat16 once, to nearest even: the instruction, the blocking and the order of
 * oneDNN's AMX product of up to 32 rows, so the results are the same bits (the caller checks that on each real
 * layer before using it: kernels/cpu/layers.py). For more rows oneDNN sums the inputs in runs whose length depends
 * on the shape and the rows (576 inputs as two runs of 288 from 33 rows to 64; 1536 as three of 512 at 33-36 rows,
 * four of 384 from 37), and these tiles were no faster there: those products stay with it. A row's result does not
 * depend on the rows beside it.
 *
 * Compiled with the other CPU kernels (-march=native); on a CPU without AMX the functions exist and report that
 * they cannot run (kvpaging_amx_ready returns 0). Linux asks a process to request the tile registers before it
 * uses them (arch_prctl ARCH_REQ_XCOMP_PERM): kvpaging_amx_ready does.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define KVPAGING_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define TILE_N 16      /* outputs per tile */
#define TILE_K 32      /* inputs per tile (16 pairs) */
#define MAX_ROWS 32    /* two tiles of 16 rows */
#define AHEAD 3       /* blocks: the weight is fetched (to L2) this far ahead of the block being read */

/* The weight [n][k] as tiles: block b (outputs 16b..16b+15), then tile t (inputs 32t..32t+31) of it, 16 rows of 16
 * pairs: element (b, t, p, c, h) = w[16b + c][32t + 2p + h]. n a multiple of 16, k of 32. */
void kvpaging_amx_pack(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k)
{
    const int64_t tiles = k / TILE_K;
    for (int64_t b = 0; b < n / TILE_N; b++)
        for (int64_t t = 0; t < tiles; t++) {
            uint16_t *tile = packed + (b * tiles + t) * (TILE_N * TILE_K);
            for (int64_t p = 0; p < TILE_K / 2; p++)
                for (int64_t c = 0; c < TILE_N; c++)
                    for (int64_t h = 0; h < 2; h++)
                        tile[(p * TILE_N + c) * 2 + h] = w[(b * TILE_N + c) * k + t * TILE_K + 2 * p + h];
        }
}

#ifdef KVPAGING_AMX
struct tile_config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Eight tiles of 16 rows of 64 bytes (their roles: two_blocks and block; tile 6 is two_blocks' alone). */
static void configure(void)
{
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* Fetch the weight's bytes [from, to) towards the core (to L2), a cache line at a time. */
static inline void fetch(const uint16_t *from, const uint16_t *to)
{
    for (const char *p = (const char *)from; p < (const char *)to; p += 64)
        _mm_prefetch(p, _MM_HINT_T1);
}

/* Sums of tile C into y's rows 16m.. and outputs 16b.., rounded to bfloat16. */
#define STORE(C, M, B) do { \
        _tile_stored(C, sums, 64); \
        for (int64_t r = 0; r < 16 && (M) * 16 + r < rows; r++) \
            for (int c = 0; c < TILE_N; c++) \
                y[((M) * 16 + r) * n + (B) * TILE_N + c] = f32_to_bf16(sums[r * 16 + c]); \
    } while (0)

/* Outputs of blocks b and b + 1 (32 outputs) for up to 32 rows: tiles 0, 1 block b's row tiles, 2, 3 block b + 1's,
 * 4 and 7 the row tiles of x, 5 and 6 the two blocks' weight tiles. Each output's sum runs over the tiles in order. */
static void two_blocks(const uint16_t *xp, const uint16_t *w, uint16_t *y, int64_t rows, int64_t row_tiles,
                       int64_t n, int64_t k, int64_t b, const uint16_t *end)
{
    const int64_t tiles = k / TILE_K, block_elems = k * TILE_N;
    const uint16_t *w0 = w + b * block_elems, *w1 = w0 + block_elems;
    const uint16_t *ahead = w0 + AHEAD * block_elems;
    float sums[16 * 16];
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t t = 0; t < tiles; t++) {
        const uint16_t *from = ahead + t * 2 * TILE_N * TILE_K;
        if (from < end)
            fetch(from, from + 2 * TILE_N * TILE_K < end ? from + 2 * TILE_N * TILE_K : end);
        _tile_loadd(4, xp + t * TILE_K, k * 2);
        _tile_loadd(5, w0 + t * TILE_N * TILE_K, 64);
        _tile_loadd(6, w1 + t * TILE_N * TILE_K, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(2, 4, 6);
        if (row_tiles > 1) {
            _tile_loadd(7, xp + 16 * k + t * TILE_K, k * 2);
            _tile_dpbf16ps(1, 7, 5);
            _tile_dpbf16ps(3, 7, 6);
        }
    }
    STORE(0, 0, b);
    STORE(2, 0, b + 1);
    if (row_tiles > 1) {
        STORE(1, 1, b);
        STORE(3, 1, b + 1);
    }
}

/* Outputs 16b..16b+15 (a last block without a pair) for up to 32 rows: tiles 0 and 1 the row tiles' sums, 4 and 7
 * the row tiles of x, 5 the weight's. */
static void block(const uint16_t *xp, const uint16_t *w, uint16_t *y, int64_t rows, int64_t row_tiles, int64_t n,
                  int64_t k, int64_t b)
{
    const int64_t tiles = k / TILE_K;
    const uint16_t *wb = w + b * k * TILE_N;
    float sums[16 * 16];
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t t = 0; t < tiles; t++) {
        _tile_loadd(4, xp + t * TILE_K, k * 2);
        _tile_loadd(5, wb + t * TILE_N * TILE_K, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (row_tiles > 1) {
            _tile_loadd(7, xp + 16 * k + t * TILE_K, k * 2);
            _tile_dpbf16ps(1, 7, 5);
        }
    }
    STORE(0, 0, b);
    if (row_tiles > 1)
        STORE(1, 1, b);
}
#endif

/* 1 where this build and this process can use the tile unit (permission asked for once), else 0. */
int64_t kvpaging_amx_ready(void)
{
#ifdef KVPAGING_AMX
    static int ready = -1;
    if (ready < 0)
        ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    return ready;
#else
    return 0;
#endif
}

/* y = x w^T for up to 32 rows of x [rows][k], w packed by kvpaging_amx_pack. Returns 0, -1 when scratch memory is
 * short, -2 when the tile unit cannot be used (nothing written either way). */
int64_t kvpaging_amx_linear(const uint16_t *x, const uint16_t *packed, uint16_t *y, int64_t rows, int64_t n, int64_t k,
                            int64_t threads)
{
#ifdef KVPAGING_AMX
    if (!kvpaging_amx_ready() || rows < 1 || rows > MAX_ROWS || n % TILE_N || k % TILE_K)
        return -2;
    const int64_t row_tiles = (rows + 15) / 16;
    uint16_t *padded = NULL;  /* x with its last row tile filled up with zeros, where it is not whole */
    if (rows % 16) {
        padded = calloc((size_t)(row_tiles * 16 * k), sizeof(uint16_t));
        if (padded == NULL)
            return -1;
        memcpy(padded, x, sizeof(uint16_t) * (size_t)(rows * k));
    }
    const uint16_t *xp = padded != NULL ? padded : x;
    const int64_t blocks = n / TILE_N;
    const uint16_t *end = packed + n * k;
    fetch(packed, packed + (AHEAD * k * TILE_N < n * k ? AHEAD * k * TILE_N : n * k));  /* the first blocks, on their way */
#ifdef _OPENMP
#pragma omp parallel num_threads((int)threads) if (threads > 1)
#endif
    {
        configure();
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t pair = 0; pair < (blocks + 1) / 2; pair++) {
            const int64_t b = 2 * pair;
            if (b + 1 < blocks)
                two_blocks(xp, packed, y, rows, row_tiles, n, k, b, end);
            else
                block(xp, packed, y, rows, row_tiles, n, k, b);
        }
        _tile_release();
    }
    free(padded);
    return 0;
#else
    (void)x; (void)packed; (void)y; (void)rows; (void)n; (void)k; (void)threads;
    return -2;
#endif
}
