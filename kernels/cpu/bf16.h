/* bfloat16 <-> float32 for the CPU kernels (included by decode_attention.c and linear.c).
 *
 * A bfloat16 number is the top 16 bits of a float32 one: widening is a shift, exact; narrowing rounds to the nearest
 * bfloat16, ties to even, as torch's .to(torch.bfloat16) does, and keeps a NaN a NaN. */
#ifndef KVPAGING_BF16_H
#define KVPAGING_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  /* round to nearest, ties to even */
    const uint32_t quiet_nan = (u >> 16) | 0x40u;  /* a NaN stays a NaN */
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);  /* a select: loops vectorize */
}

#endif
