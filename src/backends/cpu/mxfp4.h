// Matrix products and embedding lookups with MXFP4 weights (FP4 e2m1 codes plus one e8m0
// scale per 32 elements; layout in core/quant_grouped.h), read in place.
//
// mxfp4_matmul_int8 (the default, as llama.cpp does for its MXFP4 type and as this engine
// does for INT4_AFFINE and the ggml formats): activations are quantized to int8 once per call
// with one float scale per 32 elements; twice each e2m1 value is an integer in [-12, 12],
// looked up with pshufb and multiplied in int8/int16 (maddubs/madd), one float FMA per block
// by d * 2^(e - 127) / 2. It differs from "dequantize, then float matmul" by the activation
// rounding: per element at most amax(its 32-block) / 254, times |w|.
//
// mxfp4_matmul_exact keeps the float path: each 64-column
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
// Runs mxfp4_matmul_int8 while int8 activations are on (the default), else
// mxfp4_matmul_exact: mxfp4_set_int8_activations(false), or TURBOSPARK_MXFP4_INT8=0 in the
// environment at start-up. The transformers golden tests (tests/golden/test_gpt_oss.cpp)
// run the exact path, which holds logits to 2e-5; the int8 path moves the tiny random
// fixture's logits by up to ~0.1 relative (near-tied routers flip) and keeps >= 95% of
// bf16's top-1 on the trained fixtures (tests/cli/test_convert.cpp).
void mxfp4_matmul(ThreadPool& pool, const WeightView& w, const Mat& x, const Mat& y);
void mxfp4_set_int8_activations(bool on);
bool mxfp4_int8_activations();
// The integer fast path described above (activations rounded to int8 per 32 elements).
void mxfp4_matmul_int8(ThreadPool& pool, const WeightView& w, const Mat& x, const Mat& y);
// Exactly decoded weights and float32 activations (no activation rounding).
void mxfp4_matmul_exact(ThreadPool& pool, const WeightView& w, const Mat& x, const Mat& y);

// out[t, :] = scale * dequantized row ids[t] of an MXFP4 table.
void mxfp4_embedding(const WeightView& table, const int32_t* ids, int64_t n, float scale, const Mat& out);

namespace ref {
// Scalar reference (dequantize the row, float dot), single-threaded.
void mxfp4_matmul(const WeightView& w, const Mat& x, const Mat& y);
// The fast path's integer arithmetic (activations quantized identically) in scalar loops,
// single-threaded: the AVX2 fast path must match it to float rounding.
void mxfp4_matmul_int8(const WeightView& w, const Mat& x, const Mat& y);
}  // namespace ref

}  // namespace turbospark::cpu
