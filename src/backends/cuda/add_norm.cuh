// A residual add and the RMSNorm of its sum (Backend::add_rmsnorm_into), as the standalone
// kernels in norm.cu compute it and as the kernels that fold it into their own launch
// (Backend::add_rmsnorm_matmul, Backend::add_rmsnorm_router_topk) recompute it per block.
//
// The folded form must give the very bits norm.cu gives, so that a consumer's output does not
// depend on whether its input norm was folded in: both take the sum of squares through
// sum_sq_step() and normalize through norm4(), with the roundings spelled out (no contraction
// left to the compiler), and add_norm_inv_rms() reproduces the reduction tree norm.cu uses for
// decode rows: a warp per row up to kNormWarpRowMaxCols columns (lane l sums float4s l, l + 32,
// ...), else a 1024-thread block per row (thread t sums float4s t, t + 1024, ...; warp sums, then
// the 32 warp sums by one warp).
#pragma once

#include "backends/cuda/common.cuh"
#include "ops/backend.h"

namespace turbospark::cuda {

constexpr int64_t kNormWarpRowMaxCols = 1024;  // norm.cu: rows up to this take a warp each
constexpr int kNormBlockRowThreads = 1024;      // norm.cu: longer decode rows take a block of this

__device__ __forceinline__ float sum_sq_step(float acc, float4 v) {
  return __fadd_rn(acc, __fmaf_rn(v.w, v.w, __fmaf_rn(v.z, v.z, __fmaf_rn(v.y, v.y, __fmul_rn(v.x, v.x)))));
}
__device__ __forceinline__ float4 add4(float4 a, float4 b) {
  return make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z), __fadd_rn(a.w, b.w));
}
// (v * inv_rms) * (w + offset), elementwise.
__device__ __forceinline__ float norm1(float v, float inv_rms, float w, float offset) {
  return __fmul_rn(__fmul_rn(v, inv_rms), __fadd_rn(w, offset));
}
__device__ __forceinline__ float4 norm4(float4 v, float inv_rms, float4 w, float offset) {
  return make_float4(norm1(v.x, inv_rms, w.x, offset), norm1(v.y, inv_rms, w.y, offset),
                     norm1(v.z, inv_rms, w.z, offset), norm1(v.w, inv_rms, w.w, offset));
}
__device__ __forceinline__ float inv_rms_of(float sum_sq, int cols, float eps) {
  return 1.f / sqrtf(sum_sq / float(cols) + eps);
}

// Whether consumers fold their input norm in (TURBOSPARK_CUDA_FOLD_NORM=0: never, for measuring
// it; the separate launches then run).
inline bool fold_input_norm() {
  static const bool on = [] {
    const char* v = std::getenv("TURBOSPARK_CUDA_FOLD_NORM");
    return !(v && std::string_view(v) == "0");
  }();
  return on;
}

// Device view of an AddNorm (ops/backend.h) for kernels that fold it in. Every pointer is
// 16-byte aligned and every stride a multiple of 4 floats; cols % 4 == 0.
struct AddNormDev {
  const float* x;
  int64_t x_stride;
  const float* r;  // null: no residual (a plain norm of x)
  int64_t r_stride;
  float* sum;  // receives x + r (r non-null), written by the block that owns_writes
  int64_t sum_stride;
  const float* w;
  float eps, offset;
  float* normed;  // null: not written; else written by the block that owns_writes
  int64_t normed_stride;
  int cols;
};

// an as a kernel reads it, when its shapes allow folding (16-byte-aligned rows, cols % 4 == 0,
// sum distinct from x and residual); false otherwise (the caller runs add_rmsnorm_into first).
// write_normed: whether the consumer's writer block also stores the normed rows.
inline bool add_norm_device(const AddNorm& an, bool write_normed, AddNormDev* dev) {
  auto a16 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  auto rows_ok = [&](const Mat& m) {
    return m.data && a16(m.data) && m.stride % 4 == 0 && m.rows == an.x.rows && m.cols == an.x.cols;
  };
  if (!an.weight || !a16(an.weight) || an.x.cols % 4 != 0 || an.x.cols > (int64_t(1) << 30) || !rows_ok(an.x) ||
      (write_normed && !rows_ok(an.normed)))
    return false;
  if (an.has_residual() &&
      (!rows_ok(an.residual) || !rows_ok(an.sum) || an.sum.data == an.x.data || an.sum.data == an.residual.data))
    return false;
  *dev = AddNormDev{an.x.data,   an.x.stride,  an.has_residual() ? an.residual.data : nullptr,
                    an.residual.stride,        an.has_residual() ? an.sum.data : nullptr,
                    an.sum.stride,             an.weight,
                    an.eps,                    an.offset,
                    write_normed ? an.normed.data : nullptr,
                    an.normed.stride,          int(an.x.cols)};
  return true;
}

// Float4 c of row `row` of the norm's input: x + r, or x.
__device__ __forceinline__ float4 add_norm_input4(const AddNormDev& a, int row, int c) {
  const float4 v = __ldg(reinterpret_cast<const float4*>(a.x + row * a.x_stride) + c);
  if (!a.r) return v;
  return add4(v, __ldg(reinterpret_cast<const float4*>(a.r + row * a.r_stride) + c));
}

// The normalized float4 c of row `row` (inv_rms from add_norm_inv_rms); when `writer`, also
// stores the sum and the normed values where the AddNorm asks for them.
__device__ __forceinline__ float4 add_norm_load4(const AddNormDev& a, int row, int c, float inv_rms, bool writer) {
  const float4 v = add_norm_input4(a, row, c);
  const float4 y = norm4(v, inv_rms, __ldg(reinterpret_cast<const float4*>(a.w) + c), a.offset);
  if (writer) {
    if (a.r) reinterpret_cast<float4*>(a.sum + row * a.sum_stride)[c] = v;
    if (a.normed) reinterpret_cast<float4*>(a.normed + row * a.normed_stride)[c] = y;
  }
  return y;
}

// inv_rms of rows [0, rows) into s_inv, in norm.cu's decode order (see the top of the file).
// All of the block's threads (a multiple of 32) call it; s_part holds rows x 32 floats of
// shared memory. Ends with a barrier, after which s_inv is readable.
__device__ __forceinline__ void add_norm_inv_rms(const AddNormDev& a, int rows, float* s_inv, float* s_part) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = blockDim.x / kWarp;
  const int words = a.cols / 4;
  if (a.cols <= kNormWarpRowMaxCols) {
    for (int row = warp; row < rows; row += n_warps) {
      float acc = 0.f;
      for (int c = lane; c < words; c += kWarp) acc = sum_sq_step(acc, add_norm_input4(a, row, c));
      acc = warp_sum(acc);
      if (lane == 0) s_inv[row] = inv_rms_of(acc, a.cols, a.eps);
    }
    __syncthreads();
    return;
  }
  // Virtual warp vw of the 1024-thread block: its lane l is virtual thread 32 vw + l.
  constexpr int kVirtualWarps = kNormBlockRowThreads / kWarp;
  for (int row = 0; row < rows; ++row) {
    for (int vw = warp; vw < kVirtualWarps; vw += n_warps) {
      float acc = 0.f;
      for (int c = vw * kWarp + lane; c < words; c += kNormBlockRowThreads)
        acc = sum_sq_step(acc, add_norm_input4(a, row, c));
      acc = warp_sum(acc);
      if (lane == 0) s_part[row * kWarp + vw] = acc;
    }
  }
  __syncthreads();
  for (int row = warp; row < rows; row += n_warps) {
    const float acc = warp_sum(s_part[row * kWarp + lane]);
    if (lane == 0) s_inv[row] = inv_rms_of(acc, a.cols, a.eps);
  }
  __syncthreads();
}

}  // namespace turbospark::cuda
