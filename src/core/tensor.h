// Views over memory the engine does not own: weights (usually inside a memory-mapped
// checkpoint) and activation matrices. Views are cheap to copy and never free anything.
#pragma once

#include <cstdint>
#include <string>

#include "core/dtype.h"

namespace turbospark {

// A 2-D weight matrix as stored: [rows, cols] row-major, each row `row_bytes` apart.
// For a linear layer rows = out_features and cols = in_features (the checkpoint layout).
struct WeightView {
  DType dtype = DType::F32;
  const void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_bytes = 0;
  // Grouped formats (MXFP4, INT4_AFFINE; core/quant_grouped.h) keep their per-group scales
  // and biases in planes of their own, read in place from the checkpoint like `data`: row r
  // has cols / group_size scales at scales_row(r) (scales_dtype: U8 e8m0 for MXFP4, BF16/F16/
  // F32 for INT4_AFFINE) and as many biases at biases_row(r) (INT4_AFFINE only).
  const void* scales = nullptr;
  int64_t scales_row_bytes = 0;
  DType scales_dtype = DType::U8;
  const void* biases = nullptr;
  int64_t biases_row_bytes = 0;
  int32_t group_size = 0;

  const uint8_t* row(int64_t r) const { return static_cast<const uint8_t*>(data) + r * row_bytes; }
  const uint8_t* scales_row(int64_t r) const { return static_cast<const uint8_t*>(scales) + r * scales_row_bytes; }
  const uint8_t* biases_row(int64_t r) const { return static_cast<const uint8_t*>(biases) + r * biases_row_bytes; }
  int64_t bytes() const { return rows * (row_bytes + (scales ? scales_row_bytes : 0) + (biases ? biases_row_bytes : 0)); }
  // Rows [r0, r0 + n) of every plane, sharing storage (e.g. the gate half of a fused gate_up).
  WeightView rows_slice(int64_t r0, int64_t n) const {
    WeightView v = *this;
    v.data = row(r0);
    if (scales) v.scales = scales_row(r0);
    if (biases) v.biases = biases_row(r0);
    v.rows = n;
    return v;
  }
};

// A 2-D float32 activation matrix [rows, cols] whose rows are `stride` floats apart.
struct Mat {
  float* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t stride = 0;

  Mat() = default;
  Mat(float* d, int64_t r, int64_t c) : data(d), rows(r), cols(c), stride(c) {}
  Mat(float* d, int64_t r, int64_t c, int64_t s) : data(d), rows(r), cols(c), stride(s) {}
  float* row(int64_t r) const { return data + r * stride; }
  // Columns [c0, c0 + n) of every row, sharing storage.
  Mat cols_slice(int64_t c0, int64_t n) const { return Mat(data + c0, rows, n, stride); }
  // Rows [r0, r0 + n), sharing storage.
  Mat rows_slice(int64_t r0, int64_t n) const { return Mat(data + r0 * stride, n, cols, stride); }
};

}  // namespace turbospark
