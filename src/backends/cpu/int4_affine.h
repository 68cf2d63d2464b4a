// Matrix products and embedding lookups with INT4_AFFINE weights (MLX affine 4-bit: packed
// codes plus per-group scale and bias planes; layout in core/quant_grouped.h), read in
// place. As the ggml formats do (backends/cpu/quant_matmul.h), each call first quantizes
// the activation rows to int8 with one scale per weight group, then every group's packed
// bytes meet their activations in integer multiply-adds, summed in int32, with one float
// FMA by scale * d per group; the bias meets the activation group sum. Results differ from
// "dequantize, then float matmul" by the activation rounding: per group at most
// amax(group) / 254 per element, times |w| summed over the group.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "core/thread_pool.h"

namespace turbospark::cpu {

// y[t, o] = sum_i w[o, i] * x[t, i], the contract of cpu::matmul, for an INT4_AFFINE w.
// Throws Error naming the shapes, the dtype or a group size that does not fit.
void int4_affine_matmul(ThreadPool& pool, const WeightView& w, const Mat& x, const Mat& y);

// out[t, :] = scale * dequantized row ids[t] of an INT4_AFFINE table.
void int4_affine_embedding(const WeightView& table, const int32_t* ids, int64_t n, float scale, const Mat& out);

namespace ref {
// The same integer arithmetic (activations quantized identically) in scalar loops,
// single-threaded: the AVX2 path must match it to float rounding.
void int4_affine_matmul(const WeightView& w, const Mat& x, const Mat& y);
}  // namespace ref

}  // namespace turbospark::cpu
