#include "backends/cpu/grouped_matmul.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/quant_grouped.h"

namespace turbospark::cpu::grouped {
namespace {

// Each thread reads its rows in order, one row per kernel call. quant_matmul.cpp reads ggml
// blocks as 4 interleaved runs; here each row is already three streams (codes, scales,
// biases), and on the 2-core dev VM (INT4_AFFINE qwen3-0.6b decode, paired runs) 1 run gave
// 2.8-3.1 GB/s, 2 runs 2.7-2.9, 4 runs 1.9-2.2, 8 runs 2.0. Kernels that dot several
// adjacent rows per pass were slower for the same reason (INT4 g64 at gpt-oss expert shapes,
// bench/kernels_bench.cpp: 13.3-14.3 GiB/s one row per pass, 6.9-9.4 for two or four, all
// ~32 GiB/s from L3).

void check_shapes(const WeightView& w, const Mat& x, const Mat& y, const char* op) {
  if (x.cols != w.cols || y.cols != w.rows || y.rows != x.rows)
    fail("{}: shape mismatch w [{}, {}] x [{}, {}] y [{}, {}]", op, w.rows, w.cols, x.rows, x.cols, y.rows, y.cols);
  if (!is_grouped(w.dtype)) fail("{}: weight dtype {} is not MXFP4 or INT4_AFFINE", op, dtype_name(w.dtype));
  if (w.cols % 32 != 0) fail("{}: {} weight has {} columns, not a multiple of 32", op, dtype_name(w.dtype), w.cols);
  if (!w.scales || (w.dtype == DType::INT4_AFFINE && !w.biases))
    fail("{}: {} weight without its scale/bias planes", op, dtype_name(w.dtype));
  if (w.group_size <= 0 || w.group_size % 32 != 0 || w.cols % w.group_size != 0)
    fail("{}: {} group size {} does not divide rows of {} into whole 32-element chunks", op, dtype_name(w.dtype),
         w.group_size, w.cols);
  if (w.row_bytes < grouped_row_bytes(w.dtype, w.cols))
    fail("{}: {} weight rows are {} bytes apart, less than one row ({} bytes)", op, dtype_name(w.dtype), w.row_bytes,
         grouped_row_bytes(w.dtype, w.cols));
}

// Rows [row_begin, row_end) of y for every token, weight rows in tiles that stay in cache
// while each group of kMaxTokens activation rows passes over them.
void matmul_rows(const RowDots& dots, const WeightView& w, const uint8_t* xp, int64_t xp_stride, int64_t n_tokens,
                 const Mat& y, int64_t row_begin, int64_t row_end) {
  const int64_t packed = std::max<int64_t>(1, w.cols / 2);
  const int64_t tile = n_tokens <= kMaxTokens ? row_end - row_begin : std::max<int64_t>(1, (int64_t(32) << 10) / packed);
  float out[kMaxTokens];
  for (int64_t r0 = row_begin; r0 < row_end; r0 += tile) {
    const int64_t r1 = std::min(row_end, r0 + tile);
    for (int64_t t0 = 0; t0 < n_tokens; t0 += kMaxTokens) {
      const int nt = int(std::min<int64_t>(kMaxTokens, n_tokens - t0));
      const uint8_t* xt = xp + t0 * xp_stride;
      for (int64_t r = r0; r < r1; ++r) {
        switch (nt) {
          case 1: dots.dot1(w, r, xt, xp_stride, out); break;
          case 2: dots.dot2(w, r, xt, xp_stride, out); break;
          case 3: dots.dot3(w, r, xt, xp_stride, out); break;
          default: dots.dot4(w, r, xt, xp_stride, out); break;
        }
        for (int k = 0; k < nt; ++k) y.row(t0 + k)[r] = out[k];
      }
    }
  }
}

// Reused across calls so decode allocates nothing; thread-local because each calling
// thread runs its own matmuls (the pool's workers only read the caller's buffer).
std::vector<uint8_t>& activation_scratch() {
  thread_local std::vector<uint8_t> buffer;
  return buffer;
}

}  // namespace

void permute_activations(const float* x, float* xp, int64_t cols) {
  int64_t c = 0;
  for (; c + 64 <= cols; c += 64)
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 8; ++i) xp[c + 8 * j + i] = x[c + 8 * i + j];
  if (c < cols) {  // 32 trailing columns: lanes 0-3 real, 4-7 zero
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 8; ++i) xp[c + 8 * j + i] = i < 4 ? x[c + 8 * i + j] : 0.f;
  }
}

void matmul(ThreadPool& pool, const WeightView& w, const Mat& x, const Mat& y, const RowDots& dots,
            const ActivationPrep& prep, const char* op) {
  check_shapes(w, x, y, op);
  if (x.rows == 0 || w.rows == 0) return;
  const int64_t stride = prep.row_bytes(w.cols);
  std::vector<uint8_t>& xp = activation_scratch();
  if (int64_t(xp.size()) < stride * x.rows) xp.resize(size_t(stride * x.rows));
  uint8_t* xp_data = xp.data();
  for (int64_t t = 0; t < x.rows; ++t) prep.prepare(x.row(t), xp_data + t * stride, w.cols);
  pool.parallel_for(w.rows, 8, [&](int64_t b, int64_t e) { matmul_rows(dots, w, xp_data, stride, x.rows, y, b, e); });
}

void matmul_serial(const WeightView& w, const Mat& x, const Mat& y, const RowDots& dots, const ActivationPrep& prep,
                   const char* op) {
  check_shapes(w, x, y, op);
  const int64_t stride = prep.row_bytes(w.cols);
  std::vector<uint8_t> xp(size_t(stride * x.rows));
  for (int64_t t = 0; t < x.rows; ++t) prep.prepare(x.row(t), xp.data() + t * stride, w.cols);
  matmul_rows(dots, w, xp.data(), stride, x.rows, y, 0, w.rows);
}

void matmul_reference(const WeightView& w, const Mat& x, const Mat& y, const char* op) {
  check_shapes(w, x, y, op);
  std::vector<float> row(size_t(w.cols));
  for (int64_t r = 0; r < w.rows; ++r) {
    dequantize_weight_row(w, r, row.data());
    for (int64_t t = 0; t < x.rows; ++t) {
      const float* xr = x.row(t);
      float acc = 0.f;
      for (int64_t i = 0; i < w.cols; ++i) acc += row[size_t(i)] * xr[i];
      y.row(t)[r] = acc;
    }
  }
}

void embedding(const WeightView& table, const int32_t* ids, int64_t n, float scale, const Mat& out, const char* op) {
  if (out.rows != n || out.cols != table.cols)
    fail("{}: out is [{}, {}], expected [{}, {}]", op, out.rows, out.cols, n, table.cols);
  for (int64_t t = 0; t < n; ++t) {
    if (ids[t] < 0 || ids[t] >= table.rows) fail("{}: token id {} out of range [0, {})", op, ids[t], table.rows);
    float* dst = out.row(t);
    dequantize_weight_row(table, ids[t], dst);
    if (scale != 1.f)
      for (int64_t i = 0; i < table.cols; ++i) dst[i] *= scale;
  }
}

}  // namespace turbospark::cpu::grouped
