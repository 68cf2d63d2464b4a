// Multi-token (prefill) products for Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K: weight rows are
// taken 8 at a time and repacked, per call, into a small row-interleaved tile (4 bytes of
// each of the 8 rows side by side, sub-block scales widened to int16 lanes), so one AVX2
// maddubs multiplies 4 quants of 8 rows by 4 broadcast activation bytes of one token and
// its int16 results can be summed over a sub-block (4-bit quants: 8 maddubs; 5-bit: 4;
// Q6_K: 2, as far as int16 cannot overflow) before one madd applies the scale (or, for the
// 32-element formats, sums the pairs before the block's float scale). The row-at-a-time
// dot kernels (quant_matmul.cpp) need that madd after every maddubs. Q8_0 has no tiled
// kernel: its signed 8-bit quants allow no int16 accumulation, so tiling gains little.
// The tile lives in thread-local scratch and is reused by every token of the call; nothing
// is repacked at load time, so resident memory is unchanged and the mmap'd weights are
// read in place.
//
// Internal to the CPU backend: quant_matmul (quant_matmul.h) decides when to use it.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "core/thread_pool.h"

namespace turbospark::cpu::quant_gemm {

// Weight rows per tile (outputs per token per kernel call).
constexpr int kTileRows = 8;

// Whether `t` has a tiled kernel.
bool has_tiled_kernel(DType t);

// y[t, r] for r in [row_begin, row_end) and every t < n_tokens, from activation rows already
// quantized (row t at xq + t * xq_stride) to BlockQ8_K for the k-quants, BlockQ8x32 for the
// 32-element formats. `fast` picks the AVX2 kernels (when
// built with AVX2) over the scalar reference ones; both read the same tile layout.
void matmul_rows(const WeightView& w, const uint8_t* xq, int64_t xq_stride, int64_t n_tokens, const Mat& y,
                 int64_t row_begin, int64_t row_end, bool fast);

// The whole product y = x w^T through the tiled path whatever the token count, with the
// reference activation quantizer: what the tests compare, fast against scalar and both
// against ref::quant_matmul (quant_matmul.h).
void matmul(ThreadPool* pool, const WeightView& w, const Mat& x, const Mat& y, bool fast);

}  // namespace turbospark::cpu::quant_gemm
