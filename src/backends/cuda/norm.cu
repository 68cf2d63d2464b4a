// RMSNorm over rows (Backend::rmsnorm): y = x * rsqrt(mean(x^2) + eps) * (weight + offset),
// in f32 like transformers (variance in float32, then x * inv_rms, then * weight).
//
// Bound: memory. Each row is read twice (the second read hits L1: a row of 8192 floats is
// 32 KB) and written once, so the target is 8 bytes per element at HBM bandwidth. Two
// shapes matter: hidden-size rows (few, 1k-8k columns) and per-head q/k norms viewed as
// [rows * heads, head_dim] (many rows of 64-256 columns). The first gets a block per row,
// the second a warp per row so that short rows do not leave 7 of 8 warps idle.
#include "backends/cuda/common.cuh"
#include "backends/cuda/ops.h"

namespace turbospark::cuda {
namespace {

constexpr int kWarpRowsPerBlock = 8;    // warp-per-row kernel: 8 rows per 256-thread block
constexpr int kBlockRowThreads = 1024;  // block-per-row kernel: the most threads a launch uses
constexpr int64_t kWarpRowMaxCols = 1024;

// x += residual first, in place, with the sum of squares taken over the sums (kAdd,
// Backend::add_rmsnorm: the residual add and the next norm in one launch). Each thread re-reads
// only the elements it wrote, so the second pass sees the sums without a barrier.
template <bool kVec, bool kAdd>
__device__ __forceinline__ float sum_squares(float* xr, const float* __restrict__ rr, int cols, int t, int n) {
  float sum_sq = 0.f;
  if constexpr (kVec) {
    float4* x4 = reinterpret_cast<float4*>(xr);
    for (int c = t; c < cols / 4; c += n) {
      float4 v = x4[c];
      if constexpr (kAdd) {
        const float4 r = reinterpret_cast<const float4*>(rr)[c];
        v = make_float4(v.x + r.x, v.y + r.y, v.z + r.z, v.w + r.w);
        x4[c] = v;
      }
      sum_sq += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
  } else {
    for (int c = t; c < cols; c += n) {
      float v = xr[c];
      if constexpr (kAdd) xr[c] = v = v + rr[c];
      sum_sq += v * v;
    }
  }
  return sum_sq;
}

// One warp per row. kVec: the row is float4-aligned (x, y, weight, residual, strides, cols % 4).
template <bool kVec, bool kAdd>
__global__ void rmsnorm_warp_kernel(float* x, int64_t x_stride, const float* __restrict__ residual, int64_t r_stride,
                                    const float* __restrict__ weight, float eps, float* y, int64_t y_stride,
                                    int64_t rows, int cols, int groups, float weight_offset) {
  pdl_begin();
  const int64_t item = int64_t(blockIdx.x) * kWarpRowsPerBlock + threadIdx.x / kWarp;
  if (item >= rows * groups) return;
  const int lane = threadIdx.x % kWarp;
  const int64_t row = item / groups, g = item % groups;
  float* xr = x + row * x_stride + g * cols;
  float* yr = y + row * y_stride + g * cols;
  weight += g * cols;
  float sum_sq = sum_squares<kVec, kAdd>(xr, residual + row * r_stride + g * cols, cols, lane, kWarp);
  sum_sq = warp_sum(sum_sq);
  const float inv_rms = 1.f / sqrtf(sum_sq / float(cols) + eps);
  // y may alias x: every lane reads an element before writing that same element only.
  if constexpr (kVec) {
    const float4* x4 = reinterpret_cast<const float4*>(xr);
    const float4* w4 = reinterpret_cast<const float4*>(weight);
    float4* y4 = reinterpret_cast<float4*>(yr);
    for (int c = lane; c < cols / 4; c += kWarp) {
      const float4 v = x4[c], w = w4[c];
      y4[c] = make_float4((v.x * inv_rms) * (w.x + weight_offset), (v.y * inv_rms) * (w.y + weight_offset),
                          (v.z * inv_rms) * (w.z + weight_offset), (v.w * inv_rms) * (w.w + weight_offset));
    }
  } else {
    for (int c = lane; c < cols; c += kWarp) yr[c] = (xr[c] * inv_rms) * (weight[c] + weight_offset);
  }
}

// One block per row (256 or kBlockRowThreads threads), for long rows.
template <bool kVec, bool kAdd>
__global__ void __launch_bounds__(kBlockRowThreads)
    rmsnorm_block_kernel(float* x, int64_t x_stride, const float* __restrict__ residual, int64_t r_stride,
                         const float* __restrict__ weight, float eps, float* y, int64_t y_stride, int cols,
                         int groups, float weight_offset) {
  pdl_begin();
  __shared__ float scratch[kWarp];
  const int64_t row = blockIdx.x / groups, g = blockIdx.x % groups;
  float* xr = x + row * x_stride + g * cols;
  float* yr = y + row * y_stride + g * cols;
  weight += g * cols;
  float sum_sq = sum_squares<kVec, kAdd>(xr, residual + row * r_stride + g * cols, cols, threadIdx.x, blockDim.x);
  sum_sq = block_sum(sum_sq, scratch);  // contains the barrier that orders every read before any write
  const float inv_rms = 1.f / sqrtf(sum_sq / float(cols) + eps);
  if constexpr (kVec) {
    const float4* x4 = reinterpret_cast<const float4*>(xr);
    const float4* w4 = reinterpret_cast<const float4*>(weight);
    float4* y4 = reinterpret_cast<float4*>(yr);
    for (int c = threadIdx.x; c < cols / 4; c += blockDim.x) {
      const float4 v = x4[c], w = w4[c];
      y4[c] = make_float4((v.x * inv_rms) * (w.x + weight_offset), (v.y * inv_rms) * (w.y + weight_offset),
                          (v.z * inv_rms) * (w.z + weight_offset), (v.w * inv_rms) * (w.w + weight_offset));
    }
  } else {
    for (int c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = (xr[c] * inv_rms) * (weight[c] + weight_offset);
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

namespace {

// groups > 1: each row's `groups` equal column ranges normed on their own (a warp or block
// each), range g with weight + g * x.cols / groups.
template <bool kAdd>
void launch_rmsnorm(const Mat& x, const float* residual, int64_t r_stride, const float* weight, float eps,
                    const Mat& y, float weight_offset, int groups, cudaStream_t stream) {
  TS_CHECK(x.rows == y.rows && x.cols == y.cols, "rmsnorm: x [{}, {}] vs y [{}, {}]", x.rows, x.cols, y.rows, y.cols);
  TS_CHECK(x.cols > 0 && x.cols < (int64_t(1) << 31), "rmsnorm: {} columns", x.cols);
  TS_CHECK(groups >= 1 && x.cols % groups == 0, "rmsnorm: {} columns in {} groups", x.cols, groups);
  if (x.rows == 0) return;
  const int cols = int(x.cols / groups);
  const bool vec = aligned16(x.data) && aligned16(y.data) && aligned16(weight) && x.stride % 4 == 0 &&
                   y.stride % 4 == 0 && cols % 4 == 0 && (!kAdd || (aligned16(residual) && r_stride % 4 == 0));
  const int64_t items = x.rows * groups;
  if (cols <= kWarpRowMaxCols) {
    // Warp per row: 8 rows per 256-thread block; a 1024-column row is 8 float4 loads per lane.
    const int blocks = ceil_div(items, kWarpRowsPerBlock);
    auto* kernel = vec ? rmsnorm_warp_kernel<true, kAdd> : rmsnorm_warp_kernel<false, kAdd>;
    launch(kernel, blocks, kWarpRowsPerBlock * kWarp, 0, stream, x.data, x.stride, residual, r_stride, weight, eps,
           y.data, y.stride, x.rows, cols, groups, weight_offset);
  } else {
    TS_CHECK(items <= 0x7fffffff, "rmsnorm: {} rows", items);
    // Block per row: 256 threads x float4 cover 1024 columns per sweep (hidden 8192: 8 sweeps).
    // A decode step's few rows get 1024 threads instead: the block is latency bound (read,
    // reduce, read again, write), and a 4096-column row then takes one float4 per thread
    // (5.5 us per call at 256 threads on the H200, measured with ncu).
    const int threads = items <= 16 ? kBlockRowThreads : 256;
    auto* kernel = vec ? rmsnorm_block_kernel<true, kAdd> : rmsnorm_block_kernel<false, kAdd>;
    launch(kernel, int(items), threads, 0, stream, x.data, x.stride, residual, r_stride, weight, eps, y.data, y.stride,
           cols, groups, weight_offset);
  }
  TS_CUDA_LAUNCH_CHECK("rmsnorm{} [{}, {}] in {} groups (stride {} -> {})", kAdd ? " with residual add" : "", x.rows,
                       x.cols, groups, x.stride, y.stride);
}

}  // namespace

void rmsnorm(const Mat& x, const float* weight, float eps, const Mat& y, float weight_offset, cudaStream_t stream) {
  launch_rmsnorm<false>(x, nullptr, 0, weight, eps, y, weight_offset, 1, stream);
}

void rmsnorm_groups(const Mat& x, const float* weight, int groups, float eps, const Mat& y, float weight_offset,
                    cudaStream_t stream) {
  launch_rmsnorm<false>(x, nullptr, 0, weight, eps, y, weight_offset, groups, stream);
}

void add_rmsnorm(const Mat& x, const Mat& residual, const float* weight, float eps, const Mat& y, float weight_offset,
                 cudaStream_t stream) {
  TS_CHECK(residual.rows == x.rows && residual.cols == x.cols, "add_rmsnorm: x [{}, {}] vs residual [{}, {}]",
           x.rows, x.cols, residual.rows, residual.cols);
  launch_rmsnorm<true>(x, residual.data, residual.stride, weight, eps, y, weight_offset, 1, stream);
}

}  // namespace turbospark::cuda
