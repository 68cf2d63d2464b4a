// The driver the grouped 4-bit formats share (MXFP4 in mxfp4.cpp, INT4_AFFINE in
// int4_affine.cpp): activation rows prepared once per call in the form the format's row
// dot wants, weights decoded in registers straight from the packed plane and its scales
// (no dequantized copy), rows split across the pool.
//
// MXFP4's float lane order (permute_activations). Both formats pack element 2k in the low nibble of byte k, so one 32-bit lane
// holds 8 consecutive elements and a 256-bit load holds 64: lane i = elements 8i .. 8i + 7.
// Shifting the whole register right by 4j and masking gives element 8i + j in lane i, so
// the kernels dot the weights against activations permuted once per call into that order:
// for each 64 columns, xp[8j + i] = x[8i + j]. A trailing half chunk (cols % 64 == 32) is
// padded with zeros to a full one. Lanes 0-3 are the chunk's first 32 elements and lanes
// 4-7 the next 32, so a per-32 scale is a half-register broadcast.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "core/thread_pool.h"

namespace turbospark::cpu::grouped {

constexpr int kMaxTokens = 4;

// Where element i of an int8 activation row goes (INT4_AFFINE and the MXFP4 int8 path): the
// order of the packed nibbles, so codes meet their activations without a shuffle. For each
// full 64 columns c (32 packed bytes, element c + 2k in the low nibble of byte k):
// x[c + 2k] -> c + k and x[c + 2k + 1] -> c + 32 + k; a trailing 32 columns (cols % 64 == 32)
// the same on 16 bytes: x[c + 2k] -> c + k, x[c + 2k + 1] -> c + 16 + k.
inline int64_t int8_index(int64_t i, int64_t cols) {
  const int64_t c = i / 64 * 64, j = i - c;
  return c + (j & 1) * (c + 64 <= cols ? 32 : 16) + j / 2;
}

// Floats per permuted activation row: cols rounded up to a multiple of 64.
inline int64_t permuted_stride(int64_t cols) { return (cols + 63) / 64 * 64; }
// x (cols floats, cols % 32 == 0) -> xp (permuted_stride(cols) floats) in the lane order above.
void permute_activations(const float* x, float* xp, int64_t cols);

// How a format wants its activation rows: `row_bytes(cols)` bytes per row, written by
// `prepare` once per call (MXFP4: the permuted floats above; INT4_AFFINE: int8 blocks).
struct ActivationPrep {
  int64_t (*row_bytes)(int64_t cols);
  void (*prepare)(const float* x, uint8_t* dst, int64_t cols);
};

// One weight row r against NT prepared activation rows (x + t * x_stride bytes): out[t].
template <int NT>
using RowDot = void (*)(const WeightView& w, int64_t r, const uint8_t* x, int64_t x_stride, float* out);

struct RowDots {
  RowDot<1> dot1;
  RowDot<2> dot2;
  RowDot<3> dot3;
  RowDot<4> dot4;
};

// y = x w^T with the shape contract of cpu::matmul; `op` names the caller in errors.
void matmul(ThreadPool& pool, const WeightView& w, const Mat& x, const Mat& y, const RowDots& dots,
            const ActivationPrep& prep, const char* op);
// The same on the calling thread only (scalar references run their row dots through it).
void matmul_serial(const WeightView& w, const Mat& x, const Mat& y, const RowDots& dots, const ActivationPrep& prep,
                   const char* op);

// Scalar reference: dequantize_weight_row (core/quant_grouped.h) then a float dot per
// element, single-threaded. The fast paths must match it to float rounding.
void matmul_reference(const WeightView& w, const Mat& x, const Mat& y, const char* op);

// out[t, :] = scale * dequantized row ids[t] of table; ids outside [0, rows) are refused.
void embedding(const WeightView& table, const int32_t* ids, int64_t n, float scale, const Mat& out, const char* op);

}  // namespace turbospark::cpu::grouped
