// Matrix products and embedding lookups with MXFP4 weights (FP4 e2m1 codes plus one e8m0
// scale per 32 elements; layout in core/quant_grouped.h), read in place: each 64-column
// chunk is decoded in registers (a vpermps table lookup for the magnitude, the code's top
// bit as the sign, times the power-of-two scale) and multiplied into float32 activations
// (lane order in backends/cpu/grouped_matmul.h). The decoded weights are exact, so results
// differ from "dequantize, then float matmul" by summation order only.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "core/thread_pool.h"

namespace turbospark::cpu {

// y[t, o] = sum_i w[o, i] * x[t, i], the contract of cpu::matmul, for an MXFP4 w.
void mxfp4_matmul(ThreadPool& pool, const WeightView& w, const Mat& x, const Mat& y);

// out[t, :] = scale * dequantized row ids[t] of an MXFP4 table.
void mxfp4_embedding(const WeightView& table, const int32_t* ids, int64_t n, float scale, const Mat& out);

namespace ref {
// Scalar reference (dequantize the row, float dot), single-threaded.
void mxfp4_matmul(const WeightView& w, const Mat& x, const Mat& y);
}  // namespace ref

}  // namespace turbospark::cpu
