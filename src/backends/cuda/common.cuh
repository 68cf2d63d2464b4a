// Device helpers every CUDA op file shares: error checks that name the op and shape,
// warp reductions, bf16/f16 conversions. Kept small (llama.cpp's common.cuh habit): anything
// one op needs lives in that op's file.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/error.h"

namespace turbospark::cuda {

// Throws turbospark::Error naming the op (and whatever shape the caller formats into it)
// with CUDA's own message. Every runtime call and every launch goes through one of these.
#define TS_CUDA_CHECK(expr, ...)                                                                   \
  do {                                                                                             \
    cudaError_t ts_err_ = (expr);                                                                  \
    if (ts_err_ != cudaSuccess) {                                                                  \
      ::turbospark::fail("cuda: {}: {} ({})", ::fmt::format(__VA_ARGS__), cudaGetErrorString(ts_err_), \
                         int(ts_err_));                                                            \
    }                                                                                              \
  } while (0)

// After a launch: configuration errors surface here, named by the op and shape.
#define TS_CUDA_LAUNCH_CHECK(...) TS_CUDA_CHECK(cudaGetLastError(), __VA_ARGS__)

constexpr int kWarp = 32;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024); every thread gets
// the result. `scratch` is 32 floats of shared memory; the call contains __syncthreads.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = blockDim.x / kWarp;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < n_warps ? scratch[lane] : 0.f;
  return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = blockDim.x / kWarp;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < n_warps ? scratch[lane] : -INFINITY;
  return warp_max(v);
}

__device__ __forceinline__ float bf16_bits_to_f32(uint16_t h) { return __uint_as_float(uint32_t(h) << 16); }
__device__ __forceinline__ float f16_bits_to_f32(uint16_t h) { return __half2float(__ushort_as_half(h)); }

inline int ceil_div(int64_t a, int64_t b) { return int((a + b - 1) / b); }

}  // namespace turbospark::cuda
