// Device helpers every CUDA op file shares: error checks that name the op and shape,
// warp reductions, bf16/f16 conversions. Kept small (llama.cpp's common.cuh habit): anything
// one op needs lives in that op's file.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <utility>

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

// ---- cp.async (sm_80+): global -> shared copies that bypass registers ----
// 16 bytes; only src_bytes (0..16) are read and the rest of the 16 written as zeros (rows or
// keys past the end of a range).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most kPending committed groups of this thread are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// ---- programmatic dependent launch (PDL, sm_90) ----
// A kernel started with launch() may be scheduled while the kernel before it in the stream
// is still finishing (its blocks land as the previous grid drains, launch latency hidden; in
// a captured decode graph this removes most of the gap between the ~13 kernels of a layer).
// Every kernel launched that way starts with pdl_begin(): the wait returns once the previous
// kernel has completed and its writes are visible, so nothing before it may read or write
// memory another kernel touches (kernel arguments and weights are fine); the trigger then
// lets the next kernel be scheduled. Under a plain <<<>>> launch both are no-ops.
// TURBOSPARK_CUDA_PDL=0 launches without the attribute (for measuring it).
__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// ---- bulk L2 prefetch (sm_90 cp.async.bulk.prefetch.L2) ----
// Asks L2 for [p, p + bytes) in one instruction per 256 KiB, without waiting: every byte of a
// block's weight rows is in flight at once, where a GEMV's own loads keep only what its
// unrolled loop issues (decode GEMVs of a few MB were latency bound at 0.5-0.9 TB/s). Issued
// before pdl_begin() for weights (never written by a kernel), so the fetch overlaps the tail of
// the previous kernel; the kernel's loads then meet the lines in L2. The unaligned 0..15 bytes
// at either end are left to the loads. One thread calls it.
__device__ __forceinline__ void prefetch_l2(const void* p, int64_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr uint64_t kChunk = 256 << 10;
  const uint64_t a = reinterpret_cast<uint64_t>(p);
  const uint64_t lo = (a + 15) & ~uint64_t(15), hi = (a + uint64_t(bytes > 0 ? bytes : 0)) & ~uint64_t(15);
  for (uint64_t c = lo; c < hi; c += kChunk) {
    const uint32_t n = uint32_t(hi - c < kChunk ? hi - c : kChunk);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(c), "r"(n) : "memory");
  }
#endif
}

// Prefetched lines must still be in L2 when the loads come: callers bound what the blocks
// resident at once ask for to half the L2 (bf16 experts prefetched past that lost 8%: 905 ->
// 833 tok/s on the 30B-A3B shape, their lines evicting each other before use).
// TURBOSPARK_CUDA_L2_PREFETCH=0 turns the prefetches off (kernels take it as a flag, so a
// captured graph keeps the setting it was captured with): for measuring them.
inline bool l2_prefetch_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("TURBOSPARK_CUDA_L2_PREFETCH");
    return !(v && std::string_view(v) == "0");
  }();
  return on;
}

// L2 bytes of the current device (cached: one device per process).
inline int64_t device_l2_bytes() {
  static const int64_t bytes = [] {
    int device = 0, n = 0;
    if (cudaGetDevice(&device) != cudaSuccess || cudaDeviceGetAttribute(&n, cudaDevAttrL2CacheSize, device) != cudaSuccess)
      return int64_t(0);
    return int64_t(n);
  }();
  return bytes;
}

inline bool pdl_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("TURBOSPARK_CUDA_PDL");
    return !(v && std::string_view(v) == "0");
  }();
  return on;
}

// kernel<<<grid, block, smem, stream>>>(args...) with the PDL attribute (see above), its
// blocks in clusters of cluster_x along the grid's x when cluster_x > 0 (cluster_x divides
// grid.x); launch errors are left for the caller's TS_CUDA_LAUNCH_CHECK, as with <<<>>>.
template <typename... Params, typename... Args>
void launch_cluster(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                    unsigned cluster_x, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (cluster_x > 0) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster_x;
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  if (pdl_enabled()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  (void)cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
  launch_cluster(kernel, grid, block, smem, stream, 0u, std::forward<Args>(args)...);
}

// A count from the environment (name=N, N >= 0), or `fallback` when unset or empty; anything
// else fails naming the variable and what it means (`what`).
inline int64_t env_count(const char* name, int64_t fallback, const char* what) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  TS_CHECK(end && *end == '\0' && n >= 0, "{} must be {} (a whole number >= 0), got '{}'", name, what, v);
  return int64_t(n);
}

}  // namespace turbospark::cuda
