// y = x W^T for few activation rows (decode: 1 row; up to kGemvMaxRows), any weight format,
// weights dequantized in registers (quant.cuh), f32 accumulation.
//
// Bound: HBM bandwidth on the weight bytes, read exactly once per call for all rows (the
// activations, rows x in x 4 bytes, stay in L1/L2). At 4.8 TB/s an H200 streams a 4096 x 4096
// Q4_K matrix (9.4 MB) in ~2 us, a bf16 one (33.5 MB) in ~7 us.
//
// Layout: a "group" of warps_per_group warps computes kOut consecutive output rows; its
// threads stride over 8-element units, so a warp reads 32 consecutive units of each weight
// row per step (contiguous bytes: 1 KB for f32, 512 B bf16, 128-176 B for 4-bit formats) and
// each activation chunk it loads (two 16-byte loads) meets kOut weight rows: without that
// reuse the activation reads from L1 would outweigh the 4-bit weight reads ~7:1 and bound the
// kernel on L1 rather than HBM. warps_per_group > 1 (split-K inside the block, reduced in
// shared memory) only when the matrix has too few rows to occupy the GPU otherwise.
// (An int8 dp4a path with q8-quantized activations, llama.cpp mmvq's, is the next step for
// the 4-bit formats: it cuts both the activation bytes and the dequantize ALU work.)
#include "backends/cuda/matmul.h"
#include "backends/cuda/quant.cuh"

namespace turbospark::cuda {
namespace {

constexpr int kGemvThreads = 256;  // 8 warps: up to 8 groups of one warp per block

template <class F, int kMaxRows, int kOut>
__global__ void __launch_bounds__(kGemvThreads)
    gemv_kernel(DeviceWeight w, const float* __restrict__ x, int64_t x_stride, int n_rows, float* __restrict__ y,
                int64_t y_stride, int warps_per_group) {
  const int group_threads = warps_per_group * kWarp;
  const int groups_per_block = kGemvThreads / group_threads;
  const int group = threadIdx.x / group_threads, t = threadIdx.x % group_threads;
  const int64_t o0 = (int64_t(blockIdx.x) * groups_per_block + group) * kOut;
  // Rows past the end read the last row (valid memory, result dropped): no divergence inside
  // the unit loop.
  WeightRow wr[kOut];
#pragma unroll
  for (int j = 0; j < kOut; ++j) wr[j] = weight_row(w, o0 + j < w.rows ? o0 + j : w.rows - 1);
  float acc[kMaxRows][kOut] = {};
  const int64_t n_units = w.cols / kUnit;
  if (o0 < w.rows) {
#pragma unroll 2
    for (int64_t u = t; u < n_units; u += group_threads) {
      float wv[kOut][kUnit];
#pragma unroll
      for (int j = 0; j < kOut; ++j) F::unit(wr[j], u, wv[j]);
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r) {
        if (r < n_rows) {
          float xv[kUnit];
          load_x8(x + r * x_stride + u * kUnit, xv);
#pragma unroll
          for (int j = 0; j < kOut; ++j)
#pragma unroll
            for (int i = 0; i < kUnit; ++i) acc[r][j] = fmaf(wv[j][i], xv[i], acc[r][j]);
        }
      }
    }
    if constexpr (F::kTail) {
      for (int64_t i = n_units * kUnit + t; i < w.cols; i += group_threads) {
#pragma unroll
        for (int j = 0; j < kOut; ++j) {
          const float wj = F::elem(wr[j], i);
#pragma unroll
          for (int r = 0; r < kMaxRows; ++r)
            if (r < n_rows) acc[r][j] = fmaf(wj, __ldg(x + r * x_stride + i), acc[r][j]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r)
#pragma unroll
    for (int j = 0; j < kOut; ++j) acc[r][j] = warp_sum(acc[r][j]);

  const int lane = threadIdx.x % kWarp;
  if (warps_per_group == 1) {
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r)
#pragma unroll
        for (int j = 0; j < kOut; ++j)
          if (r < n_rows && o0 + j < w.rows) y[r * y_stride + o0 + j] = acc[r][j];
    }
    return;
  }
  // Split-K: each warp's partial sums to shared memory, the group's first threads add them.
  __shared__ float partial[kGemvThreads / kWarp][kMaxRows * kOut];
  const int warp = threadIdx.x / kWarp;
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r)
#pragma unroll
      for (int j = 0; j < kOut; ++j) partial[warp][r * kOut + j] = acc[r][j];
  }
  __syncthreads();
  if (t < kMaxRows * kOut) {
    const int r = t / kOut, j = t % kOut;
    float sum = 0.f;
    for (int i = 0; i < warps_per_group; ++i) sum += partial[group * warps_per_group + i][t];
    if (r < n_rows && o0 + j < w.rows) y[r * y_stride + o0 + j] = sum;
  }
}

template <class F, int kMaxRows, int kOut>
void run_gemv(const WeightView& w, const float* x, int64_t x_stride, const Mat& y, int num_sms,
              cudaStream_t stream) {
  const int64_t n_units = w.cols / kUnit;
  const int64_t groups = (w.rows + kOut - 1) / kOut;
  // Aim for ~16 warps per SM of groups before splitting K: each thread then keeps >= 4
  // units in its loop (a split-K group of 8 warps on a 4096-column row left 2 per thread,
  // and the block's life was load latency plus the shared-memory reduction: 56% of peak
  // DRAM on 4096 x 4096 bf16, measured). Split K only while every thread keeps >= 2 units.
  const int64_t target_warps = int64_t(std::max(num_sms, 1)) * 16;
  int warps_per_group = 1;
  while (warps_per_group < kGemvThreads / kWarp && groups * warps_per_group < target_warps &&
         n_units >= int64_t(warps_per_group) * 2 * kWarp * 2)
    warps_per_group *= 2;
  const int groups_per_block = kGemvThreads / (warps_per_group * kWarp);
  const int64_t blocks = (groups + groups_per_block - 1) / groups_per_block;
  gemv_kernel<F, kMaxRows, kOut><<<dim3(unsigned(blocks)), kGemvThreads, 0, stream>>>(
      device_weight(w), x, x_stride, int(y.rows), y.data, y.stride, warps_per_group);
  TS_CUDA_LAUNCH_CHECK("gemv {} [{}, {}] x {} rows ({} blocks, {} warps/group)", dtype_name(w.dtype), w.rows,
                       w.cols, y.rows, blocks, warps_per_group);
}

}  // namespace

void launch_gemv(const WeightView& w, const float* x, int64_t x_stride, const Mat& y, int num_sms,
                 cudaStream_t stream) {
  TS_CHECK(y.cols == w.rows && y.rows >= 0 && y.rows <= kGemvMaxRows,
           "gemv: {} weight [{}, {}] with output [{}, {}] (at most {} rows)", dtype_name(w.dtype), w.rows, w.cols,
           y.rows, y.cols, kGemvMaxRows);
  TS_CHECK(reinterpret_cast<uintptr_t>(x) % 16 == 0 && x_stride % 4 == 0 && x_stride >= w.cols,
           "gemv: activation rows must be 16-byte aligned (x {}, stride {} floats for {} cols)",
           static_cast<const void*>(x), x_stride, w.cols);
  dispatch_weight_format(w, "gemv", [&](auto fmt) {
    using F = decltype(fmt);
    if (y.rows == 0 || w.rows == 0) return;
    // One row: 4 output rows per group reuse each activation chunk 4x. 2..8 rows: the rows
    // already reuse each weight unit, 2 outputs per group keep the accumulators at 16.
    if (y.rows == 1) run_gemv<F, 1, 4>(w, x, x_stride, y, num_sms, stream);
    else run_gemv<F, kGemvMaxRows, 2>(w, x, x_stride, y, num_sms, stream);
  });
}

}  // namespace turbospark::cuda
