/* A gated MLP's middle, silu(gate) * up, as torch computes it in bfloat16, to the bit, in one pass.
 *
 * Llama's MLP (and the many that copy it) computes `down_proj(act_fn(gate_proj(x)) * up_proj(x))`: torch's SiLU
 * writes a tensor the size of the layer's widest activation, then the product reads it back and writes another. In
 * bfloat16 both are elementwise: SiLU maps each of the 65,536 bfloat16 numbers to one bfloat16 result, and the product
 * of two bfloat16 numbers is exact in float32, then rounded once to nearest, ties to even (bf16.h), as torch rounds it.
 * So the SiLU comes from a table that torch itself computed for every bfloat16 number (`silu`, indexed by the number's
 * 16 bits, each result widened to float32: kvpaging/kernels/cpu/__init__.py makes it once, and uses it only where
 * torch's vectorized and scalar loops agree on every number, so that a result never depends on where in a tensor the
 * number sits), and the product and its rounding are computed here. Nothing transcendental is computed in C: a
 * table lookup and one product per element.
 *
 * Layouts: gate and up [rows, cols], each row contiguous, rows `gate_stride` and `up_stride` elements apart (the two
 * halves of one fused gate/up product are views of one tensor); out [rows, cols], contiguous. Rows are shared among
 * `threads` OpenMP threads when there are many. Built with the other CPU kernels.
 */
#include <stdint.h>

#include "bf16.h"

#define MANY 32768 /* elements worth more than one thread */

void kvpaging_silu_mul(const uint16_t *gate, int64_t gate_stride, const uint16_t *up, int64_t up_stride,
                       const float *silu, uint16_t *out, int64_t rows, int64_t cols, int64_t threads)
{
#pragma omp parallel for num_threads((int)threads) schedule(static) if (threads > 1 && rows * cols >= MANY)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *restrict g = gate + r * gate_stride, *restrict u = up + r * up_stride;
        uint16_t *restrict o = out + r * cols;
        for (int64_t c = 0; c < cols; c++)
            o[c] = f32_to_bf16(silu[g[c]] * bf16_to_f32(u[c]));
    }
}
